"""`python -m dejavuu_build`: the `dejavuu-build` command group."""

from dejavuu_build.cli import main

main()
