"""Every run option, validated in one place before any model is built.

The CLI and the Python API both build a ``RunOptions`` and call ``validate()``: bad values raise
``UsageError`` (exit 2) with a hint, so nothing slow happens before the user learns of a typo.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from hookcli.errors import InputError, UsageError, did_you_mean

if TYPE_CHECKING:
    import torch
    from torch import nn

    from hookcli.inputs import InputSpec

DEFAULT_MODEL = "resnet50"
FILLS = ("randn", "rand", "ones", "zeros")
DTYPES = {
    "float32": "float32", "float": "float32", "fp32": "float32",
    "float16": "float16", "half": "float16", "fp16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float64": "float64", "double": "float64", "fp64": "float64",
}
LOSSES = ("auto", "ce", "nll", "sum", "mean")
PARAM_SCOPES = ("selected", "all", "none")


@dataclass
class RunOptions:
    """Options shared by the commands that run a model (shapes, stats, grads, ...)."""

    model: Any = None  # a spec string, an nn.Module, or None for the default
    model_source: str = "argument"
    model_args: Mapping[str, Any] = field(default_factory=dict)
    weights: str | None = None
    # let torch.load unpickle arbitrary objects from weights/input files (runs code from them);
    # only the command line or a Python keyword sets it, never a config file
    trust_pickle: bool = False
    input_shapes: Sequence[Any] = ()  # strings like "2x3x224x224:float16" or InputSpec
    inputs: Sequence[str | os.PathLike[str]] = ()
    batch_size: int | None = None
    fill: str = "randn"
    seed: int = 0
    layers: Sequence[str] | str | None = None
    types: Sequence[str] | str | None = None
    depth: int | None = None
    all_modules: bool = False
    device: str | None = None
    dtype: str | None = None
    train: bool = False
    # gradients (grads, check)
    loss: str = "auto"
    target: int = 0
    output_key: str | None = None
    params: str = "selected"
    clip: float | None = None
    input_grads: bool = False
    # shapes: FLOPs per call; run on the meta device (None: when nothing needs real values)
    flops: bool = False
    meta: bool | None = None

    # filled by validate()
    specs: list[InputSpec] = field(default_factory=list, init=False)

    def validate(self) -> RunOptions:
        """Check and normalise every option; return a new, validated copy."""
        from hookcli.inputs import InputSpec, parse_input_shape

        opts = replace(self)
        if opts.model is None:
            opts.model, opts.model_source = DEFAULT_MODEL, "default"
        if isinstance(opts.model, str) and not opts.model.strip():
            raise UsageError("the model spec is empty", hint="e.g. resnet50, pkg.mod:Net or path/to/file.py:build")
        opts.specs = [s if isinstance(s, InputSpec) else parse_input_shape(str(s)) for s in opts.input_shapes]
        opts.inputs = [os.fspath(p) for p in opts.inputs]
        if not isinstance(opts.trust_pickle, bool):
            raise UsageError(f"trust_pickle must be True or False, got {opts.trust_pickle!r}")
        if opts.specs and opts.inputs:
            raise UsageError("--input-shape and --input are mutually exclusive", hint="use one way to give the input")
        for path in opts.inputs:
            if not os.path.exists(path):
                raise InputError(f"input file not found: {path}")
        if opts.batch_size is not None and opts.batch_size < 1:
            raise UsageError(f"--batch-size must be at least 1, got {opts.batch_size}")
        if opts.fill not in FILLS:
            raise UsageError(f"unknown --fill {opts.fill!r}", hint=f"choose one of: {', '.join(FILLS)}")
        if opts.depth is not None and opts.depth < 0:
            raise UsageError(f"--depth must be 0 or more, got {opts.depth}")
        if opts.dtype is not None:
            key = str(opts.dtype).removeprefix("torch.").lower()
            if key not in DTYPES:
                raise UsageError(f"unsupported --dtype {opts.dtype!r}", hint=did_you_mean(key, DTYPES) or
                                 "choose one of: float32, float16, bfloat16, float64")
            opts.dtype = DTYPES[key]
        if opts.device is not None:
            opts.device = _check_device(str(opts.device))
        if opts.loss not in LOSSES:
            raise UsageError(f"unknown --loss {opts.loss!r}", hint=f"choose one of: {', '.join(LOSSES)}")
        if opts.params not in PARAM_SCOPES:
            raise UsageError(f"unknown --params {opts.params!r}", hint=f"choose one of: {', '.join(PARAM_SCOPES)}")
        if opts.clip is not None and not opts.clip > 0:
            raise UsageError(f"--clip must be a positive number, got {opts.clip}")
        if opts.target < 0:
            raise UsageError(f"--target must be a class index (0 or more), got {opts.target}")
        if opts.weights is not None and _looks_like_path(opts.weights) and not os.path.exists(opts.weights):
            from hookcli.errors import WeightsError

            raise WeightsError(f"weights file not found: {opts.weights}")
        return opts

    def torch_dtype(self) -> torch.dtype | None:
        import torch

        return getattr(torch, self.dtype) if self.dtype else None


def _looks_like_path(text: str) -> bool:
    return os.sep in text or text.endswith((".pt", ".pth", ".bin", ".safetensors", ".ckpt"))


def _check_device(text: str) -> str:
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError) as exc:
        raise UsageError(f"unknown --device {text!r}: {exc}", hint="e.g. cpu, cuda, cuda:1, mps") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {text}: CUDA is not available on this machine", hint="use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {text}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif device.type == "mps":
        if not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
            raise UsageError(f"--device {text}: MPS is not available on this machine", hint="use --device cpu")
    elif device.type not in ("cpu", "meta"):
        raise UsageError(f"unsupported --device {text!r}", hint="e.g. cpu, cuda, cuda:1, mps")
    return str(device)


def model_is_instance(model: Any) -> bool:
    """True for an ``nn.Module`` object (Python API), without importing torch for strings."""
    if isinstance(model, (str, type(None))):
        return False
    from torch import nn

    return isinstance(model, nn.Module)


__all__ = ["RunOptions", "DEFAULT_MODEL", "FILLS", "LOSSES", "PARAM_SCOPES", "model_is_instance"]

if TYPE_CHECKING:  # keep type checkers aware of the nn import used in annotations
    _ = nn
