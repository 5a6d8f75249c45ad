"""`python -m iop` runs the command line."""

from iop.cli import main

main()
