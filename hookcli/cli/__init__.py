"""The command line: the Click group and its commands (``main``), option bundles (``options``).

Thin by design: each command parses options, calls one ``hookcli.api`` function and renders the
result; ``HookcliError`` becomes a message and an exit code in one place. No torch at import time.
"""

from hookcli.cli.main import main

__all__ = ["main"]
