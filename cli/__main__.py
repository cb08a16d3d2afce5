"""`python -m cli ...`: the `areal-pipeline` command line."""

from cli import main

main()
