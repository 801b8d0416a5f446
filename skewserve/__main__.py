"""`python -m skewserve`: the `skewserve` command."""

from skewserve.commands.main import main

main()
