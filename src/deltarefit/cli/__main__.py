"""``python -m deltarefit.cli``: the command line."""

from . import main

main()
