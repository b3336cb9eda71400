"""The reduction backends by name, and the one place one is chosen (``choose``); ``engine.reduction``
is their public face and says what each is. Imports no statistics code: ``engine.stats`` asks here.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hookcli.engine import kernel
from hookcli.errors import UsageError

#: The environment variable that forces a backend.
REDUCTION_ENV = "HOOKCLI_REDUCTION"


@dataclass(frozen=True)
class Backend:
    """A way to reduce tensors: ``host`` backends reduce CPU tensors to host ``Moments``
    (``engine.stats.Reducer``); the others any tensor to a vector on its device with the function
    ``vector`` names (``"module:function"``, imported when first used: ``fn(flat, zeros)``).
    ``unavailable`` says why it cannot run here (None: it can)."""

    name: str
    host: bool
    vector: str | None = None
    unavailable: Callable[[], str | None] = lambda: None
    #: whether ``vector`` reads float16/bfloat16 itself (else it is given a float32 copy)
    reads_half: bool = False
    #: whether ``vector`` takes a tensor of any strided layout, expanded (stride-0) ones included, and
    #: reduces it without its repeats itself (else it is given a 1-D view of the values without them, and
    #: its additive fields are scaled after: two more ops); such a backend reads float16/bfloat16 too
    reads_layouts: bool = False

    def vector_fn(self) -> Callable[[torch.Tensor, bool], torch.Tensor]:
        """The function ``vector`` names."""
        module, _, function = (self.vector or "").partition(":")
        return getattr(importlib.import_module(module), function)  # type: ignore[no-any-return]


def _kernel_unavailable() -> str | None:
    return f"the C statistics kernel is {kernel.status()}" if kernel.load() is None else None


def _call(target: str) -> Callable[[], str | None]:
    """A function of no arguments that calls ``"module:function"``, imported when first called (the
    Triton backend's module imports Triton: only where it is asked for)."""

    def call() -> str | None:
        module, _, function = target.partition(":")
        return getattr(importlib.import_module(module), function)()  # type: ignore[no-any-return]

    return call


BACKENDS: dict[str, Backend] = {
    "kernel": Backend("kernel", host=True, unavailable=_kernel_unavailable),
    "torch": Backend("torch", host=True),
    "device": Backend("device", host=False, vector="hookcli.engine.stats:device_vector"),
    "triton": Backend("triton", host=False, vector="hookcli.engine.reduce_triton:backend_vector",
                      unavailable=_call("hookcli.engine.reduce_triton:backend_unavailable"), reads_half=True,
                      reads_layouts=True),
    "lean": Backend("lean", host=False, vector="hookcli.engine.reduce_lean:reduce_lean", reads_half=True,
                    reads_layouts=True),
}


def _accelerator() -> Backend:
    """What ``auto`` reduces an accelerator's tensors with: the fused Triton kernel where CUDA and Triton
    are here, else the lean torch path (Apple's MPS, Intel's XPU, CUDA without Triton)."""
    if torch.cuda.is_available() and BACKENDS["triton"].unavailable() is None:
        return BACKENDS["triton"]
    return BACKENDS["lean"]


def choose(device: torch.device | str = "cpu", name: str | None = None) -> Backend:
    """The backend that reduces tensors on ``device``: ``name``'s, else ``HOOKCLI_REDUCTION``'s, else the
    best one there (the one place it is chosen: on an accelerator ``triton`` where CUDA and Triton are
    here, else ``lean``). A forced host backend leaves an accelerator's tensors to that choice. Raises ``UsageError`` for an unknown name or one that cannot run here (the kernel
    not built; or switched off by ``HOOKCLI_NO_KERNEL`` while ``HOOKCLI_REDUCTION`` asks for it: a caller's
    own ``name="kernel"`` takes it where it is built, as ``Reducer(kernel=True)`` did)."""
    wanted = name or os.environ.get(REDUCTION_ENV, "").strip() or "auto"
    on_cpu = torch.device(device).type == "cpu"
    if wanted == "auto":
        if not on_cpu:
            return _accelerator()
        return BACKENDS["kernel" if kernel.enabled() else "torch"]
    backend = BACKENDS.get(wanted)
    if backend is None:
        raise UsageError(f"{REDUCTION_ENV}={wanted}: no such reduction backend",
                         hint=f"use one of auto, {', '.join(BACKENDS)}")
    why = backend.unavailable()
    if why is None and name is None and wanted == "kernel" and kernel.switched_off():  # the two variables disagree
        why = f"the C statistics kernel is switched off by {kernel.NO_KERNEL_ENV}"
    if why is not None:
        raise UsageError(f"{REDUCTION_ENV}={wanted}: {why}",
                         hint=f"unset {REDUCTION_ENV} (auto picks what runs here), or set it to torch")
    return backend if on_cpu or not backend.host else _accelerator()


def name_for(device: torch.device | str) -> str:
    """The name of the backend a run on ``device`` reduces with (reports' ``reduction``)."""
    return choose(device).name
