"""What the tests compare hookcli with: the dummy input hookcli builds, statistics computed with plain torch
in float64, module outputs captured with plain forward hooks, and the aten ops a call runs (to prove that
nothing was copied)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


def dummy(*shape: int) -> torch.Tensor:
    """The dummy input hookcli builds by default: randn from a generator seeded with --seed (0)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(0))


def float64_stats(t: torch.Tensor) -> dict[str, float | int | None]:
    """The statistics hookcli reports, from the float64 values of ``t`` (a lazy negation resolved);
    population std; an empty tensor has NaN statistics and no zero fraction."""
    d = t.detach().to("cpu", torch.float64).reshape(-1)
    n = d.numel()
    return {
        "mean": float(d.mean()),
        "std": float(d.std(correction=0)) if n else math.nan,
        "min": float(d.min()) if n else math.nan,
        "max": float(d.max()) if n else math.nan,
        "norm": float(torch.linalg.vector_norm(d)),
        "zero_fraction": int((d == 0).sum()) / n if n else None,
        "nan_count": int(torch.isnan(d).sum()),
        "inf_count": int(torch.isinf(d).sum()),
    }


class _OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.add(str(func.overloadpacket))
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def aten_ops(fn: Callable[[], object]) -> set[str]:
    """The names of the aten ops (``aten._to_copy``, ...) that ``fn()`` runs."""
    with _OpLog() as log:
        fn()
    return log.ops


def aten_op_counts(fn: Callable[[], object]) -> Counter[str]:
    """How many times ``fn()`` runs each aten op (load-independent: what a timing cannot show)."""
    with _OpLog() as log:
        fn()
    return log.counts


def finished_outputs(model: nn.Module, x: torch.Tensor, *, root: bool = False) -> list[tuple[str, torch.Tensor]]:
    """(module name, output copy) in the order module calls *finish*, with plain forward hooks, for the
    calls that return one tensor; the model itself as ``""`` when ``root``."""
    seen: list[tuple[str, torch.Tensor]] = []

    def keep(name: str, out: object) -> None:
        if isinstance(out, torch.Tensor):
            seen.append((name, out.detach().clone()))

    forward_with(model, x, [m.register_forward_hook(lambda _m, _i, o, n=n: keep(n, o))
                            for n, m in model.named_modules() if n or root])
    return seen


def forward_with(model: nn.Module, x: torch.Tensor, handles: list[Any]) -> None:
    """One ``torch.no_grad`` forward of ``model`` with the test's own hooks ``handles``, removed after."""
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()


def outputs_by_call(model: nn.Module, x: torch.Tensor) -> dict[tuple[str, int], torch.Tensor]:
    """{(module name, call index): output copy} for every module (the root as ""), plain hooks."""
    seen: dict[tuple[str, int], torch.Tensor] = {}
    counts: dict[str, int] = {}
    for name, out in finished_outputs(model, x, root=True):
        counts[name] = counts.get(name, -1) + 1
        seen[(name, counts[name])] = out
    return seen



def float64_moments(t: torch.Tensor) -> dict[str, float]:
    """What a statistics vector holds, from the float64 values of ``t`` with plain torch: count, mean and
    the central moment sums m2..m4 of the finite values, min/max ignoring NaN (+-Inf included; +inf and
    -inf for no values), zero, NaN and Inf counts."""
    d = t.detach().to("cpu", torch.float64).resolve_neg().reshape(-1)
    finite = d[torch.isfinite(d)]
    seen = d[~torch.isnan(d)]
    n = finite.numel()
    mean = float(finite.mean()) if n else 0.0
    dev = finite - mean
    return {"count": float(n), "mean": mean, "m2": float(dev.pow(2).sum()), "m3": float(dev.pow(3).sum()),
            "m4": float(dev.pow(4).sum()), "min": float(seen.min()) if seen.numel() else math.inf,
            "max": float(seen.max()) if seen.numel() else -math.inf, "zeros": float((d == 0).sum()),
            "nans": float(torch.isnan(d).sum()), "infs": float(torch.isinf(d).sum()),
            "scale": float(finite.abs().max()) if n else 0.0}


def assert_moments_match(values: list[float], t: torch.Tensor, *, zeros: bool = True, rtol: float = 1e-5,
                         centre_error: float = 0.0, merged: bool = False) -> None:
    """A host copy of a statistics vector (``MEAN, MIN, MAX, COUNT, M2, M3, M4, ZEROS, NANS, INFS, SCALE``)
    against ``float64_moments(t)``: counts and extremes exactly; the mean within ``rtol`` of the largest
    finite magnitude; each moment sum within ``rtol`` of ``count * spread^k``, its natural size (spread: the
    larger of the standard deviation and the data's rounding, ``rtol * scale``). ``centre_error``: how far
    (relative to the largest magnitude) the centre of the moments may be from the float64 mean: moments
    about ``mean + c`` differ by the binomial shift's terms (m3 by about ``3 c m2``, m4 by ``4 c m3``).
    ``merged``: the vector is a ``stats.merge`` of others, whose scale is the largest of theirs (an empty
    tensor's is 1), not necessarily the largest magnitude."""
    exp = float64_moments(t)
    mean, lo, hi, count, m2, m3, m4, zero_count, nans, infs, scale = values
    assert (count, nans, infs) == (exp["count"], exp["nans"], exp["infs"]), (values, exp)
    assert zero_count == (exp["zeros"] if zeros else 0.0), (values, exp)
    assert (lo, hi) == (exp["min"], exp["max"]), (values, exp)
    tiny = torch.finfo(torch.float64 if t.dtype == torch.float64 else torch.float32).tiny
    assert merged or scale == max(exp["scale"], tiny) or (not t.numel() and scale == 1.0), (scale, exp["scale"])
    n = exp["count"]
    assert abs(mean - exp["mean"]) <= rtol * exp["scale"], (mean, exp["mean"])
    spread = max(math.sqrt(exp["m2"] / n) if n else 0.0, rtol * exp["scale"])
    got = (m2 * scale ** 2, m3 * scale ** 3, m4 * scale ** 4)  # in data units
    for k, g, e in ((2, got[0], exp["m2"]), (3, got[1], exp["m3"]), (4, got[2], exp["m4"])):
        tol = rtol * (n * spread ** k * (3 if k == 4 else 1) + abs(e))
        c = centre_error * max(exp["scale"], tiny)  # moments about mean + c: the binomial shift's terms
        tol += {2: n * c * c, 3: 3 * c * exp["m2"] + n * c ** 3,
                4: 4 * c * abs(exp["m3"]) + 6 * c * c * exp["m2"] + n * c ** 4}[k]
        assert abs(g - e) <= tol + 1e-300, (f"m{k}", g, e, tol, values)


def hard_cases(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors of ``dtype`` a reduction must get right, by name: denormals, a constant, signed zeros,
    NaN and Inf alone and mixed (each reduction's tests add the extremes near the dtype's limit it takes)."""
    info = torch.finfo(dtype)
    return {
        "denormals": torch.tensor([info.smallest_normal * info.eps * k for k in (1, 2, 3, -5)], dtype=dtype),
        "constant": torch.full((9000,), 0.3, dtype=dtype),
        "signed zeros": torch.tensor([0.0, -0.0, 0.0, 1.0], dtype=dtype),
        "all NaN": torch.full((7,), math.nan, dtype=dtype),
        "inf and NaN only": torch.tensor([math.inf, math.nan, -math.inf], dtype=dtype),
        "+inf only": torch.tensor([math.inf, math.inf], dtype=dtype),
        "mixed": torch.tensor([1.0, math.nan, math.inf, -2.0, 0.0, -math.inf, -0.0], dtype=dtype),
    }
