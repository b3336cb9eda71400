"""What a hook computes, on the device, without holding activations.

Each function reduces one tensor to a small result tensor on the tensor's own device (no host
synchronisation); ``to_host`` turns all of them into Python values with one transfer per device at the
end of a run. Float16/bfloat16 are reduced in float32; the standard deviation is the population one
(correction=0).
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from hookcli.records import GRAD_KEYS, STAT_KEYS

#: Order of the values in the vector ``reduce_tensor`` returns.
_VECTOR = ("mean", "std", "min", "max", "zero_count", "nan_count", "inf_count", "numel")
_MAX_NESTING = 8


def is_float(t: torch.Tensor) -> bool:
    """Statistics make sense for real floating tensors only (ints/bools get shape and dtype)."""
    return t.is_floating_point()


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


class Reducer:
    """Reduces tensors to statistics vectors with fast kernels and one reusable scratch buffer.

    Per tensor: ``sum`` (the mean, kept on the device), ``aminmax``, the centred sum of squares
    (two-pass variance: exact also for offset data) and, for activations, the count of zeros; the
    last two go through a float scratch buffer that is reused across calls, so no activation-sized
    temporary is allocated per layer (slow bool reductions like ``(x == 0).sum()``, Welford
    ``std_mean`` and ``count_nonzero`` are avoided: they cost 10-50x a plain sum on CPU).

    NaN/Inf counts: a sum is finite exactly when the tensor holds no NaN and no Inf (both propagate),
    so on CPU, where reading a scalar costs no device synchronisation, the counting passes run only
    when the sum is not finite. On other devices they always run, so nothing waits for the device.

    A tensor seen again unchanged (same object and version: a Bottleneck's output *is* its last
    ReLU's output, a Sequential's *is* its last child's) reuses its vector.
    """

    def __init__(self) -> None:
        self._scratch: dict[torch.device, torch.Tensor] = {}
        self._seen: dict[tuple[int, int, bool], tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}

    def scratch(self, like: torch.Tensor) -> torch.Tensor:
        """A float32 buffer of ``like.numel()`` elements on ``like``'s device, reused across calls."""
        buf = self._scratch.get(like.device)
        if buf is None or buf.numel() < like.numel():
            buf = torch.empty(like.numel(), dtype=torch.float32, device=like.device)
            self._scratch[like.device] = buf
        return buf[: like.numel()]

    def reduce(self, t: torch.Tensor, *, zeros: bool = True) -> torch.Tensor:
        """A float64 vector (``_VECTOR`` layout) of ``t``'s statistics, computed on ``t``'s device."""
        key = (id(t), t._version, zeros)
        hit = self._seen.get(key)
        if hit is not None and hit[0]() is t:
            return hit[1]
        vector = self._reduce(t, zeros)
        try:
            self._seen[key] = (weakref.ref(t), vector)
        except TypeError:  # tensor subclasses without weakref support
            pass
        return vector

    def _reduce(self, t: torch.Tensor, zeros: bool) -> torch.Tensor:
        x = t.detach()
        if x.dtype != torch.float32 and x.dtype != torch.float64:
            x = x.float()  # float16/bfloat16 are reduced in float32
        n = x.numel()
        device = x.device
        if n == 0:
            return torch.tensor([math.nan] * 4 + [0, 0, 0, 0], dtype=torch.float64, device=device)
        flat = x.reshape(-1)
        total = flat.sum(dtype=torch.float64) if flat.dtype == torch.float64 else flat.sum()
        mean = total / n
        lo, hi = torch.aminmax(flat)
        buf = self.scratch(flat) if flat.dtype == torch.float32 else torch.empty_like(flat)
        torch.sub(flat, mean, out=buf)
        buf.square_()
        var = buf.sum() / n
        zero_count = torch.eq(flat, 0, out=buf).sum() if zeros else torch.zeros((), device=device)
        if device.type == "cpu" and math.isfinite(float(total)):
            nan_count = inf_count = torch.zeros((), device=device)
        else:
            nan_count = torch.ne(flat, flat, out=buf).sum()
            inf_count = torch.eq(flat.abs(), math.inf, out=buf).sum()
        numel = torch.full((), float(n), device=device)
        parts = (mean, var.sqrt(), lo, hi, zero_count, nan_count, inf_count, numel)
        return torch.stack([p.to(torch.float64) for p in parts])


def reduce_tensor(t: torch.Tensor, *, zeros: bool = True) -> torch.Tensor:
    """Statistics vector of one tensor (a one-off ``Reducer``); see ``Reducer.reduce``."""
    return Reducer().reduce(t, zeros=zeros)


def _clean(value: float) -> float:
    return value if math.isfinite(value) else float(value)


def _norm(v: dict[str, float]) -> float:
    """L2 norm from population mean and std: sqrt(n * (std^2 + mean^2)), in float64."""
    if v["nan_count"]:
        return math.nan
    if v["inf_count"]:
        return math.inf
    if not v["numel"]:
        return math.nan
    return math.sqrt(v["numel"] * (v["std"] ** 2 + v["mean"] ** 2))


def activation_stats(values: Sequence[float]) -> dict[str, float | int | None]:
    """Turn a host copy of ``reduce_tensor``'s vector into the activation stats dict (``STAT_KEYS``)."""
    v = dict(zip(_VECTOR, values))
    numel = int(v["numel"])
    stats: dict[str, float | int | None] = {
        "mean": _clean(v["mean"]),
        "std": _clean(v["std"]),
        "min": _clean(v["min"]),
        "max": _clean(v["max"]),
        "norm": _norm(v),
        "zero_fraction": (v["zero_count"] / numel) if numel else None,
        "nan_count": int(v["nan_count"]),
        "inf_count": int(v["inf_count"]),
    }
    assert tuple(stats) == STAT_KEYS
    return stats


def gradient_stats(values: Sequence[float], *, abs_max: bool = False) -> dict[str, float | int | None]:
    """Turn a host copy of ``reduce_tensor``'s vector into the gradient stats dict (``GRAD_KEYS``)."""
    v = dict(zip(_VECTOR, values))
    stats: dict[str, float | int | None] = {key: _clean(v[key]) for key in ("mean", "std", "min", "max")}
    stats["norm"] = _norm(v)
    stats["nan_count"] = int(v["nan_count"])
    stats["inf_count"] = int(v["inf_count"])
    assert tuple(stats) == GRAD_KEYS
    if abs_max:
        stats["abs_max"] = max(abs(v["min"]), abs(v["max"])) if int(v["numel"]) else None
    return stats


def to_host(vectors: Sequence[torch.Tensor]) -> list[list[float]]:
    """Move many small result vectors to the host with one transfer per device (usually one)."""
    if not vectors:
        return []
    by_device: dict[torch.device, list[int]] = {}
    for index, vec in enumerate(vectors):
        by_device.setdefault(vec.device, []).append(index)
    out: list[list[float]] = [[] for _ in vectors]
    for indices in by_device.values():
        rows = torch.stack([vectors[i] for i in indices]).cpu().tolist()
        for i, row in zip(indices, rows):
            out[i] = row
    return out


def iter_tensors(obj: Any, path: str = "", _level: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(path, tensor)`` for every tensor inside a module output or input.

    Paths: ``""`` for a plain tensor, ``[0]`` for tuple/list items, ``['out']`` for dict keys,
    ``.logits`` for namedtuple and dataclass fields. None and other values are skipped.
    """
    if isinstance(obj, torch.Tensor):
        yield path, obj
        return
    if _level >= _MAX_NESTING or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        for field in obj._fields:
            yield from iter_tensors(getattr(obj, field), f"{path}.{field}", _level + 1)
    elif isinstance(obj, (list, tuple)):
        for index, item in enumerate(obj):
            yield from iter_tensors(item, f"{path}[{index}]", _level + 1)
    elif isinstance(obj, Mapping):
        for key, item in obj.items():
            yield from iter_tensors(item, f"{path}[{key!r}]", _level + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, field.name), f"{path}.{field.name}", _level + 1)


def shape_of(t: torch.Tensor) -> list[int]:
    return [int(d) for d in t.shape]
