"""``python -m deltarefit.cli``: the command line."""

from .core import main

main()
