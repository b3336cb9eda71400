"""The command line under ``torchrun``: one process group per command, and one exit code for every rank
(the engine's ``sharding`` does the work; docs/distributed.md)."""

from __future__ import annotations

from contextlib import AbstractContextManager


def torchrun_group(device: str | None) -> AbstractContextManager[bool]:
    """The default process group for one command under torchrun (gloo; nccl with a CUDA ``device``),
    destroyed when the block ends, also on errors; nothing outside torchrun."""
    from hookcli.engine.sharding import process_group

    return process_group(device)


def agree_exit(code: int, own: bool, failure: BaseException | None = None) -> tuple[int, bool]:
    """Every rank's exit code (the same on all) and whether rank 0 had an error of its own
    (``engine.sharding.agree``; ``failure``: this rank's, voted first if its run had not started)."""
    from hookcli.engine.sharding import agree

    return agree(code, own, failure)


__all__ = ["agree_exit", "torchrun_group"]
