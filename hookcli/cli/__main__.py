"""``python -m hookcli.cli``."""

from hookcli.cli.main import main

main()
