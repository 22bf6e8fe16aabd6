"""`python -m kvcompile.cli`: the command line."""

from kvcompile.cli import main

main()
