"""The library's release: ``deltarefit.__version__``, pyproject.toml's ``version``, and what every delta's
manifest names as its encoder (``format.RELEASE``). A module of its own, importing nothing, so that the
command line can print it, and ``import deltarefit`` can bind it, without loading numpy."""

RELEASE = "0.1.0"
