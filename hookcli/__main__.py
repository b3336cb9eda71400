"""``python -m hookcli``."""

from hookcli.cli.main import main

main()
