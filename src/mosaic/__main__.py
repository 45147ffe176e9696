"""`python -m mosaic ...` (and `torchrun -m mosaic train ...`) run the CLI."""

from mosaic.cli import main

main()
