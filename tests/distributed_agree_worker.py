"""Run under torchrun by tests/test_distributed_agree.py: each rank in a checkout of its own
(``ROOT/rank<RANK>``, as ranks on several machines are), running ``hookcli ARGS`` there, so that the ranks
can be given different configs, model files or data."""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.chdir(os.path.join(sys.argv[1], "rank" + os.environ["RANK"]))
    sys.argv = ["hookcli", *sys.argv[2:]]
    from hookcli.cli.main import main

    main()
