"""The numbers of ``hookcli diff``: default tolerances, run A's disk-backed store, and the comparison.

``compare`` reduces two tensors to six numbers on the device (no host sync); ``errors_from`` turns
them into the reported errors on the host. Nothing here runs a model.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from dataclasses import dataclass

import torch

from hookcli.records import Errors, Tolerance

Key = tuple[str, int, str]  # (module name, call index, output path)

#: Default (rtol, atol) by dtype. A pair of dtypes gets the looser of its two entries; integer and
#: bool tensors must be equal. Looser than torch.testing's per-op defaults: errors add up over layers.
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-7, 1e-7),
    "float32": (1e-5, 1e-5),
    "float16": (1e-2, 1e-3),
    "bfloat16": (5e-2, 1e-2),
}
#: Any other floating dtype (float8 kinds).
LOOSEST_TOLERANCE = (1e-1, 1e-1)


def tolerance_for(a_dtype: str, b_dtype: str, rtol: float | None, atol: float | None) -> Tolerance:
    """The tolerance two tensors are compared with: given values, else the dtypes' defaults."""
    floating = [d for d in (a_dtype, b_dtype) if d.startswith(("float", "bfloat", "complex"))]
    if not floating:
        return Tolerance(a_dtype, b_dtype, 0.0, 0.0, "exact")
    pairs = [DEFAULT_TOLERANCES.get(d.replace("complex128", "float64").replace("complex64", "float32"),
                                    LOOSEST_TOLERANCE) for d in floating]
    default_rtol, default_atol = max(p[0] for p in pairs), max(p[1] for p in pairs)
    source = "given" if rtol is not None or atol is not None else "default"
    return Tolerance(a_dtype, b_dtype, default_rtol if rtol is None else float(rtol),
                     default_atol if atol is None else float(atol), source)


# --------------------------------------------------------------------------- run A's store


@dataclass
class _Stored:
    path: str | None  # None: an empty tensor (nothing to map)
    shape: list[int]
    dtype: torch.dtype


class DiskStore:
    """Tensors kept on disk: each one a file mapped with ``torch.from_file``, read back lazily.

    Holding run A's activations here costs page cache, which the kernel can drop, not process memory.
    ``close`` removes the folder.
    """

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="hookcli-diff-")
        self.items: dict[Key, _Stored] = {}

    def put(self, name: str, call: int, path: str, tensor: torch.Tensor) -> None:
        """Keep ``tensor`` under (name, call, path): a ``HookOptions.keep`` callback."""
        key = (name, call, path)
        t = plain_tensor(tensor)
        file = None
        if t.numel():
            file = os.path.join(self.folder, f"{len(self.items)}.bin")
            disk = torch.from_file(file, shared=True, size=t.numel(), dtype=t.dtype)
            disk.view(t.shape).copy_(t)
            del disk  # unmapped; the values stay in the file
        self.items[key] = _Stored(file, list(t.shape), t.dtype)

    def get(self, key: Key) -> torch.Tensor:
        item = self.items[key]
        if item.path is None:
            return torch.empty(item.shape, dtype=item.dtype)
        return torch.from_file(item.path, shared=False, size=math.prod(item.shape), dtype=item.dtype).view(item.shape)

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def plain_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A detached dense real tensor: quantized ones dequantized, complex ones as (..., 2) real."""
    t = tensor.detach()
    if t.is_quantized:
        t = t.dequantize()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    return t


# --------------------------------------------------------------------------- comparing


#: Elements compared at a time: the float64 working copies never exceed this (8 MB each).
CHUNK = 1 << 20


def compare(a: torch.Tensor, b: torch.Tensor, rtol: float) -> torch.Tensor:
    """Six numbers on ``b``'s device, no host sync: max|a-b|, ||a||^2, ||b||^2, ||a-b||^2, <a,b>, and
    max(|a-b| - rtol |a|) (within tolerance when it is <= atol).

    Equal values (also equal infinities, and NaN against NaN) differ by 0. Computed in float64 (float32
    on MPS, which has none; cosine near 1 needs the precision), CHUNK elements at a time, so the
    working copies stay small next to the activations; sums of squares as dot products (no temporaries).
    """
    ct = torch.float32 if b.device.type == "mps" else torch.float64
    a = a.to(device=b.device).reshape(-1)
    b = b.reshape(-1)
    zero = torch.zeros((), dtype=ct, device=b.device)
    parts = []
    for start in range(0, a.numel(), CHUNK):
        x = a[start:start + CHUNK].to(ct)
        y = b[start:start + CHUNK].to(ct)
        same = x == y  # also equal infinities, whose difference is NaN
        same |= x.isnan() & y.isnan()
        d = torch.where(same, zero, x - y)
        low, high = torch.aminmax(d)
        sums = [torch.dot(x, x), torch.dot(y, y), torch.dot(d, d), torch.dot(x, y)]
        d.abs_()
        if rtol:
            d.sub_(x.abs(), alpha=rtol)  # x may be the caller's own tensor: never in place
        parts.append(torch.stack([torch.maximum(-low, high), *sums, d.amax()]))
    if not parts:
        return torch.zeros(6, dtype=torch.float64, device=b.device)
    acc = torch.stack(parts)
    return torch.cat([acc[:, 0].amax().reshape(1), acc[:, 1:5].sum(0), acc[:, 5].amax().reshape(1)]).to(torch.float64)


def errors_from(values: list[float], atol: float) -> Errors:
    """The reported errors from ``compare``'s six numbers (host floats).

    rel_l2 = ||a-b|| / ||a|| (0 when both are 0, inf when only ||a|| is); cosine = <a,b> / (||a|| ||b||)
    computed as (||a||^2 + ||b||^2 - ||a-b||^2) / (2 ||a|| ||b||) when the norms are within 100x of
    each other (precise near 1, exactly 1 for equal tensors), clamped to [-1, 1] (1 when both are all
    zeros, 0 when one is); sqnr_db = 20 log10(||a|| / ||a-b||)
    (inf when a == b, also both zero; -inf when a is zero and b is not). NaN in, NaN out.
    """
    max_abs, sa, sb, sd, dot, excess = values
    na, nb, nd = math.sqrt(sa), math.sqrt(sb), math.sqrt(sd)
    within = not math.isnan(excess) and excess <= atol  # NaN/inf in the same places in both: equal
    if any(math.isnan(v) or math.isinf(v) for v in (sa, sb, sd, dot)):
        nan = math.nan
        return Errors(max_abs, nan, nan, nan, within)
    if nd == 0:
        rel, sqnr = 0.0, math.inf
    elif na == 0:
        rel, sqnr = math.inf, -math.inf
    else:
        rel = nd / na
        sqnr = 10 * math.log10(sa / sd) if math.isfinite(sa / sd) and sa / sd > 0 else 20 * math.log10(na / nd)
    if na == 0 and nb == 0:
        cos = 1.0
    elif na == 0 or nb == 0:
        cos = 0.0
    else:
        product = sa * sb  # sqrt(x * x) == x exactly: equal tensors give exactly 1
        denom = math.sqrt(product) if math.isfinite(product) and product > 0 else na * nb
        if 1e-4 < sa / sb < 1e4:
            # 2<a,b> = ||a||^2 + ||b||^2 - ||a-b||^2: exact for equal tensors and precise near 1, where
            # the summed <a,b> loses the digits that matter (not for norms far apart: cancellation)
            cos = (sa + sb - sd) / (2 * denom)
        else:
            cos = dot / denom
        cos = max(-1.0, min(1.0, cos))
    return Errors(max_abs, rel, cos, sqnr, within)


__all__ = ["CHUNK", "DEFAULT_TOLERANCES", "DiskStore", "Key", "compare", "errors_from", "plain_tensor", "tolerance_for"]
