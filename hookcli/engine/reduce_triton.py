"""A tensor's statistics vector in one fused Triton pass (CUDA), the same numbers as ``stats.Reducer``.

``reduce_moments(t)`` gives the device vector of ``stats`` (``MEAN, MIN, MAX, COUNT, M2, M3, M4, ZEROS,
NANS, INFS, SCALE``, float64): the moments are those of the finite values, about their mean, in units of
``SCALE^k`` (the largest finite magnitude, clamped to the smallest normal number), min/max ignore NaN and
include +-Inf; ``zeros=False`` leaves the zero count at 0.

How (``_partials_kernel`` and ``_merge_kernel``):

* The tensor is read once, in its own dtype (float32, bfloat16, float16, float64), in storage order (a
  dense layout of any dimension order, ``stats.dense_view``; an expanded one without its repeats,
  ``stats.unbroadcast``; only a gapped layout is copied). Values are widened in registers; nothing
  of the tensor's size is allocated.
* Each program walks blocks of ``BLOCK`` values. A block is centred on its own mean and scaled by its own
  largest finite magnitude in registers (``(x - mean) / scale``: powers up to 4 lie in [-16, 16]), its sums
  of ``d^1..d^4`` turned into central moments about its exact mean (the corrected two-pass algorithm),
  and merged into the program's running moments by Pebay's pairwise formulas in float64, rescaled to the
  larger scale. Counts and extremes add up or take min/max.
* Each program writes one partial vector (the final layout). A tensor of at most ``SINGLE_BLOCKS``
  blocks takes one program, whose partial *is* the result: one launch. A larger one takes up to
  ``programs()`` programs and a second, one-program launch merges their partials (the binomial shift of
  each partial's central sums to the common mean, exact algebra): two launches.

``reduce_moments_many(tensors)`` does the same for a list (a step's parameters, gradients or updates):
one ``_partials_kernel`` launch over a 2-D grid (program, tensor) that reads each tensor's address from a
table, and one ``_merge_kernel`` launch with one program per tensor, per dtype present; its result has one
row per tensor. ``norms`` is ``torch._foreach_norm``: one op for all L2 norms. ``histograms`` gives
``stats.histogram``'s rows for many tensors in a fixed number of launches (the moments, small ops on
columns, and one counting launch per dtype).

Both are ``torch.library`` custom ops (``hookcli::reduce_moments``, ``hookcli::reduce_moments_many``)
with fake implementations, so ``torch.compile`` traces a call as one node instead of breaking the
graph. ``available(t)`` says whether a tensor can take this path: a CUDA tensor when Triton is
installed, or a CPU tensor under ``TRITON_INTERPRET=1`` (Triton's interpreter, which the tests use).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hookcli.engine.stats import SCALE, dense_view, unbroadcast

try:  # Triton is optional: without it, available() is False and the ops are never called
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the test machine has Triton
    triton = None
    tl = None

#: Whether Triton was imported under ``TRITON_INTERPRET=1``: its own library functions are then
#: interpreted, so kernels run on CPU tensors only (Triton reads the variable once, at import).
INTERPRETED = triton is not None and type(tl.standard.cdiv).__name__ == "InterpretedFunction"

#: Values per block: what one program holds in registers at a time.
BLOCK = 4096
#: A tensor of at most this many blocks is reduced by one program (one launch, no merge).
SINGLE_BLOCKS = 4
#: The dtypes read in place; others are widened to float32 first.
_READ = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
#: Length of a statistics vector.
WIDTH = SCALE + 1


def available(t: torch.Tensor) -> bool:
    """Whether ``t`` can be reduced here: a CUDA tensor with Triton installed, or a CPU tensor when Triton
    was imported under ``TRITON_INTERPRET=1`` (its interpreter runs the same kernels with numpy; CUDA
    tensors are then refused: the kernels read raw device addresses)."""
    if triton is None or t.layout != torch.strided or t.is_nested or not t.is_floating_point():
        return False
    return t.device.type == ("cpu" if INTERPRETED else "cuda")


@functools.cache
def unavailable(device_type: str = "cuda") -> str | None:
    """Why tensors of ``device_type`` cannot take this path here (None: they can), for a backend's
    ``unavailable``."""
    if triton is None:
        return "Triton is not installed"
    if device_type == "cuda":
        if INTERPRETED:
            return "Triton was imported for its interpreter (TRITON_INTERPRET=1): CPU tensors only"
        return None if torch.cuda.is_available() else "no CUDA device"
    if device_type == "cpu":
        return None if INTERPRETED else "CPU tensors need Triton's interpreter: TRITON_INTERPRET=1 before importing it"
    return f"Triton does not run on {device_type} tensors"


def backend_unavailable() -> str | None:
    """Why the ``triton`` reduction backend cannot run here (``engine.backends``; None: it can)."""
    return unavailable("cpu" if INTERPRETED else "cuda")


def backend_vector(flat: torch.Tensor, zeros: bool) -> torch.Tensor:
    """The ``triton`` backend's vector: the fused kernel where it reads ``flat``, else the lean torch path
    (a tensor Triton cannot read here: never one a hook hands it in practice)."""
    if available(flat):
        return reduce_moments(flat, zeros)  # type: ignore[no-any-return]
    from hookcli.engine.reduce_lean import reduce_lean

    return reduce_lean(flat, zeros)


def _tl_dtype(dtype: torch.dtype) -> Any:
    return {torch.float32: tl.float32, torch.float64: tl.float64, torch.bfloat16: tl.bfloat16,
            torch.float16: tl.float16}[dtype]


def _wide(dtype: torch.dtype) -> Any:
    """The dtype a block is centred and powered in: float64 for float64 data, else float32 (values scaled
    into [-2, 2] lose nothing to float32 that the data had)."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def _tiny(dtype: torch.dtype) -> float:
    """The smallest scale: the smallest normal number of the dtype the data is reduced in (as ``stats``)."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).tiny


# -- the kernels (plain functions: compiled with triton.jit for CUDA, interpreted for CPU) -----------

def _jit(fn: Callable[..., Any]) -> Any:
    """A device function the kernels call: ``triton.jit``, which gives the interpreted kind when Triton was
    imported for its interpreter (the only kind an interpreted kernel can call) and the compiled one else."""
    return fn if triton is None else triton.jit(fn)


@_jit
def _read(base, offs, inside, DTYPE: tl.constexpr, WIDE: tl.constexpr):  # noqa: ANN001, ANN202
    """A block of values widened to ``WIDE``; bfloat16 is read as its 16-bit patterns and shifted (exact,
    subnormals included)."""
    if DTYPE == tl.bfloat16:
        x = (tl.load(base + offs, mask=inside, other=0).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(base + offs, mask=inside, other=0.0).to(WIDE)
    return x


@_jit
def _block(x, fin, TINY: tl.constexpr, WIDE: tl.constexpr):  # noqa: ANN001, ANN202
    """``(count, mean, m2, m3, m4, s)`` of a block's finite values: centred on their mean and scaled by
    their largest magnitude ``s`` in registers, the central sums (units of ``s^k``) about the exact mean
    (the rounding of the centre removed, as ``stats.central_moments``)."""
    c = tl.sum(fin.to(WIDE), axis=0)
    s = tl.maximum(tl.max(tl.where(fin, tl.abs(x), 0.0), axis=0), TINY)
    shift = s * (tl.sum(tl.where(fin, x / s, 0.0), axis=0) / tl.maximum(c, 1.0))
    diff = x - shift  # overflows only for values near the dtype's limit of both signs: halves then
    d = tl.where(tl.abs(diff) < float("inf"), diff / s, (x * 0.5 - shift * 0.5) / (s * 0.5))
    d = tl.where(fin, d, 0.0)
    d2 = d * d
    n = c.to(tl.float64)
    q1 = tl.sum(d, axis=0).to(tl.float64)
    q2 = tl.sum(d2, axis=0).to(tl.float64)
    q3 = tl.sum(d2 * d, axis=0).to(tl.float64)
    q4 = tl.sum(d2 * d2, axis=0).to(tl.float64)
    delta = q1 / tl.maximum(n, 1.0)
    m2 = q2 - q1 * delta
    m3 = q3 - 3.0 * delta * q2 + 2.0 * n * delta * delta * delta
    m4 = q4 - 4.0 * delta * q3 + 6.0 * delta * delta * q2 - 3.0 * n * delta * delta * delta * delta
    return n, shift.to(tl.float64) + delta * s.to(tl.float64), m2, m3, m4, s.to(tl.float64)


@_jit
def _pebay(cnt, mean, m2, m3, m4, scale, c, bmean, b2, b3, b4, s):  # noqa: ANN001, ANN202
    """Pebay's pairwise merge of ``(cnt, mean, m2..m4 in units of scale)`` with a block's ``(c, bmean,
    b2..b4 in units of s)``, in the larger scale (``stats.merge``, in float64 registers)."""
    new_scale = tl.maximum(scale, s)
    ra = scale / new_scale
    rb = s / new_scale
    total = cnt + c
    wa = cnt / tl.maximum(total, 1.0)
    wb = c / tl.maximum(total, 1.0)
    a2, a3, a4 = m2 * ra * ra, m3 * ra * ra * ra, m4 * (ra * ra) * (ra * ra)
    b2, b3, b4 = b2 * rb * rb, b3 * rb * rb * rb, b4 * (rb * rb) * (rb * rb)
    dm = tl.where(total > 0, (bmean - mean) / new_scale, 0.0)
    dd = dm * dm
    m4 = (a4 + b4 + dd * dd * cnt * wb * (wa * wa - wa * wb + wb * wb)
          + 6.0 * dd * (wa * wa * b2 + wb * wb * a2) + 4.0 * dm * (wa * b3 - wb * a3))
    m3 = a3 + b3 + dd * dm * cnt * wb * (wa - wb) + 3.0 * dm * (wa * b2 - wb * a2)
    m2 = a2 + b2 + dd * cnt * wb
    return total, mean + dm * wb * new_scale, m2, m3, m4, new_scale


def _partials_kernel(x_ptr, table_ptr, out_ptr, n_arg, repeats_arg, G,  # noqa: ANN001
                     TINY: tl.constexpr, TABLE: tl.constexpr, DTYPE: tl.constexpr, WIDE: tl.constexpr,
                     BLOCK: tl.constexpr, ZEROS: tl.constexpr, FINAL: tl.constexpr):
    """Program ``(g, t)``: blocks ``g, g + G, ...`` of tensor ``t`` (``x_ptr``, or row ``t`` of the table
    ``[address, numel, repeats]``) merged into one vector, written to ``out[t, g]``; ``FINAL``: the
    program is its tensor's only one, and the additive fields are multiplied by the repeats."""
    g = tl.program_id(0)
    t = tl.program_id(1)
    if TABLE:  # bfloat16 is read as 16-bit patterns (_read)
        base = tl.load(table_ptr + t * 3).to(tl.pointer_type(tl.uint16 if DTYPE == tl.bfloat16 else DTYPE))
        n = tl.load(table_ptr + t * 3 + 1)
        repeats = tl.load(table_ptr + t * 3 + 2).to(tl.float64)
    else:
        base = x_ptr.to(tl.pointer_type(tl.uint16)) if DTYPE == tl.bfloat16 else x_ptr
        n = n_arg.to(tl.int64)
        repeats = repeats_arg.to(tl.float64)
    zero = tl.zeros([], tl.float64)
    cnt, mean, m2, m3, m4, scale = zero, zero, zero, zero, zero, zero + TINY
    lo, hi = zero + float("inf"), zero - float("inf")
    zeros, nans, infs = zero, zero, zero
    for b in range(g, tl.cdiv(n, BLOCK), G):
        offs = b * BLOCK + tl.arange(0, BLOCK)  # int64: n is
        inside = offs < n
        x = _read(base, offs, inside, DTYPE, WIDE)
        nan = x != x
        lo = tl.minimum(lo, tl.min(tl.where(inside & ~nan, x, float("inf")), axis=0).to(tl.float64))
        hi = tl.maximum(hi, tl.max(tl.where(inside & ~nan, x, -float("inf")), axis=0).to(tl.float64))
        nans += tl.sum(nan.to(tl.float64), axis=0)
        infs += tl.sum((tl.abs(x) == float("inf")).to(tl.float64), axis=0)
        if ZEROS:
            zeros += tl.sum((inside & (x == 0)).to(tl.float64), axis=0)
        c, bmean, b2, b3, b4, s = _block(x, inside & (tl.abs(x) < float("inf")), TINY, WIDE)
        cnt, mean, m2, m3, m4, scale = _pebay(cnt, mean, m2, m3, m4, scale, c, bmean, b2, b3, b4, s)
    if FINAL:
        scale = tl.where(n == 0, 1.0, scale)  # no values at all: stats.empty_vector's scale
        cnt, m2, m3, m4 = cnt * repeats, m2 * repeats, m3 * repeats, m4 * repeats
        zeros, nans, infs = zeros * repeats, nans * repeats, infs * repeats
    row = out_ptr + (t * G + g) * 11
    tl.store(row + 0, mean)
    tl.store(row + 1, lo)
    tl.store(row + 2, hi)
    tl.store(row + 3, cnt)
    tl.store(row + 4, tl.maximum(m2, 0.0))
    tl.store(row + 5, m3)
    tl.store(row + 6, tl.maximum(m4, 0.0))
    tl.store(row + 7, zeros)
    tl.store(row + 8, nans)
    tl.store(row + 9, infs)
    tl.store(row + 10, scale)


def _merge_kernel(part_ptr, out_ptr, table_ptr, G, repeats_arg, TABLE: tl.constexpr,  # noqa: ANN001
                  PARTS: tl.constexpr):
    """Program ``t``: the ``G`` partial vectors of tensor ``t`` merged into row ``t`` of ``out``: each
    partial's central sums shifted to the common mean (binomially, exact algebra) in the largest scale,
    then the rounding of that mean removed (``stats.central_moments``)."""
    t = tl.program_id(0)
    if TABLE:
        numel = tl.load(table_ptr + t * 3 + 1)
        repeats = tl.load(table_ptr + t * 3 + 2).to(tl.float64)
    else:
        numel = 1
        repeats = repeats_arg.to(tl.float64)
    k = tl.arange(0, PARTS)
    valid = k < G
    rows = part_ptr + (t * G + k) * 11
    pmean = tl.load(rows + 0, mask=valid, other=0.0)
    pcnt = tl.load(rows + 3, mask=valid, other=0.0)
    p2 = tl.load(rows + 4, mask=valid, other=0.0)
    p3 = tl.load(rows + 5, mask=valid, other=0.0)
    p4 = tl.load(rows + 6, mask=valid, other=0.0)
    pscale = tl.load(rows + 10, mask=valid, other=0.0)
    n = tl.sum(pcnt, axis=0)
    scale = tl.max(pscale, axis=0)
    mean = tl.sum(pmean * (pcnt / tl.maximum(n, 1.0)), axis=0)
    r = pscale / scale
    r2 = r * r
    a2, a3, a4 = p2 * r2, p3 * r2 * r, p4 * r2 * r2
    d = tl.where(pcnt > 0, (pmean - mean) / scale, 0.0)
    dd = d * d
    s1 = tl.sum(pcnt * d, axis=0)
    s2 = tl.sum(a2 + pcnt * dd, axis=0)
    s3 = tl.sum(a3 + 3.0 * d * a2 + pcnt * dd * d, axis=0)
    s4 = tl.sum(a4 + 4.0 * d * a3 + 6.0 * dd * a2 + pcnt * dd * dd, axis=0)
    delta = s1 / tl.maximum(n, 1.0)
    m2 = s2 - s1 * delta
    m3 = s3 - 3.0 * delta * s2 + 2.0 * n * delta * delta * delta
    m4 = s4 - 4.0 * delta * s3 + 6.0 * delta * delta * s2 - 3.0 * n * delta * delta * delta * delta
    out = out_ptr + t * 11
    tl.store(out + 0, mean + delta * scale)
    tl.store(out + 1, tl.min(tl.load(rows + 1, mask=valid, other=float("inf")), axis=0))
    tl.store(out + 2, tl.max(tl.load(rows + 2, mask=valid, other=-float("inf")), axis=0))
    tl.store(out + 3, n * repeats)
    tl.store(out + 4, tl.maximum(m2, 0.0) * repeats)
    tl.store(out + 5, m3 * repeats)
    tl.store(out + 6, tl.maximum(m4, 0.0) * repeats)
    for j in tl.static_range(7, 10):
        tl.store(out + j, tl.sum(tl.load(rows + j, mask=valid, other=0.0), axis=0) * repeats)
    tl.store(out + 10, tl.where(numel == 0, 1.0, scale))


def _histogram_kernel(table_ptr, bounds_ptr, out_ptr, G, DTYPE: tl.constexpr, BLOCK: tl.constexpr,  # noqa: ANN001
                      BINS: tl.constexpr, SLOTS: tl.constexpr):
    """Program ``(g, t)``: blocks ``g, g + G, ...`` of tensor ``t`` counted into ``BINS`` buckets from
    ``bounds[t] = (left, span)`` as ``stats.histogram`` computes them (``(x - left) / span * BINS`` in
    float32, NaN to bucket 0, clamped, truncated), added to row ``t`` of ``out`` (``SLOTS`` wide)."""
    g = tl.program_id(0)
    t = tl.program_id(1)
    base = tl.load(table_ptr + t * 3).to(tl.pointer_type(tl.uint16 if DTYPE == tl.bfloat16 else DTYPE))
    n = tl.load(table_ptr + t * 3 + 1)
    repeats = tl.load(table_ptr + t * 3 + 2).to(tl.int32)
    left = tl.load(bounds_ptr + t * 2).to(tl.float32)
    span = tl.load(bounds_ptr + t * 2 + 1).to(tl.float32)
    lanes = tl.arange(0, BLOCK)
    total = tl.zeros([SLOTS], tl.int32)
    for b in range(g, tl.cdiv(n, BLOCK), G):
        offs = b * BLOCK + lanes
        inside = offs < n
        x = _read(base, offs, inside, DTYPE, tl.float32)
        scaled = (x - left) / span * BINS
        scaled = tl.where(scaled != scaled, 0.0, scaled)
        bucket = tl.minimum(tl.maximum(scaled, 0.0), BINS - 1).to(tl.int32)
        total += tl.histogram(tl.where(inside, bucket, BINS), SLOTS)
    tl.atomic_add(out_ptr + t * SLOTS + tl.arange(0, SLOTS), total * repeats)


@functools.cache
def _kernel(fn: Callable[..., Any], interpret: bool) -> Any:
    """``fn`` as a Triton kernel: compiled for CUDA, or Triton's interpreter for CPU tensors (chosen by
    the tensor's device, not by the environment at import time)."""
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(fn)
    # sizes and counts are never specialised as constants (a 1 would be, and then has no .to)
    return triton.runtime.jit.JITFunction(fn, do_not_specialize=[name for name in ("n_arg", "repeats_arg", "G")
                                                                 if name in fn.__code__.co_varnames])


def programs(device: torch.device) -> int:
    """How many programs share one large tensor: four per streaming multiprocessor (a few on CPU,
    where the interpreter runs them one after another)."""
    if device.type != "cuda":
        return 4
    return 4 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _readable(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(flat, repeats)``: ``t``'s values as a stride-1 tensor of a dtype the kernel reads, and how many
    times ``t`` repeats each (expanded dimensions). Dense layouts are views; gapped ones are copied."""
    x = t.detach()
    if x.is_neg():
        x = x.resolve_neg()
    if x.numel() == 0:
        return x.reshape(-1), 1
    x, repeats = unbroadcast(x)
    flat = dense_view(x)
    if flat is None:
        flat = x.contiguous().view(-1)
    if flat.dtype not in _READ:
        flat = flat.float()
    return flat, repeats


def _require(device: torch.device) -> None:
    """Raise (a clear ``RuntimeError``) where the kernels cannot run on ``device``'s tensors."""
    why = unavailable(device.type)
    if why is not None:
        raise RuntimeError(f"hookcli's Triton reduction cannot run here: {why}")


def _launch_one(flat: torch.Tensor, repeats: int, zeros: bool) -> torch.Tensor:
    """The vector of a stride-1 tensor: one ``_partials_kernel`` launch, and a ``_merge_kernel`` launch
    when it took several programs."""
    interpret = flat.device.type == "cpu"
    blocks = -(-flat.numel() // BLOCK)
    g = 1 if blocks <= SINGLE_BLOCKS else min(blocks, programs(flat.device))
    out = torch.empty(WIDTH, dtype=torch.float64, device=flat.device)
    parts = out if g == 1 else torch.empty(g * WIDTH, dtype=torch.float64, device=flat.device)
    meta = {"TABLE": False, "DTYPE": _tl_dtype(flat.dtype), "WIDE": _wide(flat.dtype), "BLOCK": BLOCK,
            "ZEROS": zeros, "FINAL": g == 1}
    _kernel(_partials_kernel, interpret)[(g, 1)](flat, flat, parts, flat.numel(), repeats, g,
                                                 TINY=_tiny(flat.dtype), **meta, num_warps=8)
    if g > 1:
        _kernel(_merge_kernel, interpret)[(1,)](parts, out, parts, g, repeats, TABLE=False,
                                                PARTS=triton.next_power_of_2(g))
    return out


@torch.library.custom_op("hookcli::reduce_moments", mutates_args=())
def reduce_moments(x: torch.Tensor, zeros: bool = True) -> torch.Tensor:
    """``x``'s statistics vector (``stats`` layout, float64, on ``x``'s device) in one or two kernel
    launches and no host synchronisation; ``zeros=False`` leaves the zero count at 0."""
    _require(x.device)
    flat, repeats = _readable(x)
    if flat.numel() == 0:
        out = torch.zeros(WIDTH, dtype=torch.float64, device=x.device)
        out[1], out[2], out[SCALE] = math.inf, -math.inf, 1.0
        return out
    return _launch_one(flat, repeats, zeros)


@reduce_moments.register_fake
def _(x: torch.Tensor, zeros: bool = True) -> torch.Tensor:
    return x.new_empty(WIDTH, dtype=torch.float64)


def _no_gradient(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
    """Statistics are read, never trained through: no gradient flows back into the tensor."""
    return None, None


reduce_moments.register_autograd(_no_gradient)


@torch.library.custom_op("hookcli::reduce_moments_many", mutates_args=())
def reduce_moments_many(xs: Sequence[torch.Tensor], zeros: bool = False) -> torch.Tensor:
    """One statistics vector per tensor of ``xs`` (all on one device), as the rows of a ``(len(xs), 11)``
    float64 tensor: per dtype present one ``_partials_kernel`` launch over every tensor of it and one
    ``_merge_kernel`` launch, plus the copy of its small address table to the device (reused while the
    tensors stay)."""
    if not xs:
        raise ValueError("reduce_moments_many takes at least one tensor")
    device = xs[0].device
    _require(device)
    if any(x.device != device for x in xs):
        raise ValueError(f"reduce_moments_many takes tensors of one device: {sorted({str(x.device) for x in xs})}")
    out = torch.empty(len(xs), WIDTH, dtype=torch.float64, device=device)
    groups: dict[torch.dtype, list[tuple[int, torch.Tensor, int]]] = {}
    keep = []  # the flat tensors (copies among them) live until the kernels are queued
    for index, x in enumerate(xs):
        flat, repeats = _readable(x)
        keep.append(flat)
        groups.setdefault(flat.dtype, []).append((index, flat, repeats))
    for dtype, members in groups.items():
        _launch_group(dtype, members, out, zeros)
    return out


@reduce_moments_many.register_fake
def _(xs: Sequence[torch.Tensor], zeros: bool = False) -> torch.Tensor:
    return xs[0].new_empty((len(xs), WIDTH), dtype=torch.float64)


reduce_moments_many.register_autograd(_no_gradient)


def _launch_group(dtype: torch.dtype, members: list[tuple[int, torch.Tensor, int]], out: torch.Tensor,
                  zeros: bool) -> None:
    """``reduce_moments_many`` for the tensors of one dtype: rows ``index`` of ``out``."""
    device = out.device
    interpret = device.type == "cpu"
    entries = tuple((flat.data_ptr(), flat.numel(), repeats) for _, flat, repeats in members)
    table = _table(entries, device)
    blocks = max(-(-numel // BLOCK) for _, numel, _ in entries)
    g = 1 if blocks <= SINGLE_BLOCKS else min(blocks, programs(device))
    rows = [index for index, _, _ in members]
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    target = out[rows[0]: rows[0] + len(rows)] if contiguous else torch.empty(len(rows), WIDTH, dtype=out.dtype,
                                                                               device=device)
    parts = target if g == 1 else torch.empty(len(rows) * g * WIDTH, dtype=torch.float64, device=device)
    meta = {"TABLE": True, "DTYPE": _tl_dtype(dtype), "WIDE": _wide(dtype), "BLOCK": BLOCK, "ZEROS": zeros,
            "FINAL": g == 1}
    _kernel(_partials_kernel, interpret)[(g, len(rows))](table, table, parts, 0, 1, g, TINY=_tiny(dtype), **meta,
                                                         num_warps=8)
    if g > 1:
        _kernel(_merge_kernel, interpret)[(len(rows),)](parts, target, table, g, 1, TABLE=True,
                                                        PARTS=triton.next_power_of_2(g))
    if not contiguous:
        out[rows] = target


#: Device copies of address tables, by their contents (a step's parameters keep their addresses).
_TABLES: dict[tuple[torch.device, tuple[tuple[int, int, int], ...]], torch.Tensor] = {}
_TABLES_KEPT = 64


def _table(entries: tuple[tuple[int, int, int], ...], device: torch.device) -> torch.Tensor:
    """The ``[address, numel, repeats]`` rows as an int64 tensor on ``device``: copied from pinned
    memory without waiting for the device, and kept for the next call with the same rows."""
    key = (device, entries)
    table = _TABLES.get(key)
    if table is None:
        host = torch.tensor(entries, dtype=torch.int64)
        if device.type == "cuda":
            table = host.pin_memory().to(device, non_blocking=True)
        else:
            table = host
        if len(_TABLES) >= _TABLES_KEPT:
            _TABLES.pop(next(iter(_TABLES)))
        _TABLES[key] = table
    return table


def norms(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The L2 norm of each tensor (0-d, float64; float32 on MPS), in one op: ``torch._foreach_norm``,
    whose CUDA kernel handles a list of tensors per launch."""
    if not tensors:
        return []
    wide = torch.float32 if tensors[0].device.type == "mps" else torch.float64
    return list(torch._foreach_norm([t.detach() for t in tensors], 2, dtype=wide))


def histograms(tensors: Sequence[torch.Tensor], bins: int = 30) -> torch.Tensor:
    """``stats.histogram`` of each non-empty float tensor of ``tensors`` (one device), as the rows of a
    ``(len, 5 + bins)`` float64 tensor: ``[min, max, count, sum, sum of squares, *bucket counts]``, in a
    fixed number of launches whatever the number of tensors (about 70 ops for one dtype):
    ``reduce_moments_many`` (min, max and the moments give the head), small ops on the ``(len,)`` columns
    for the head and the buckets' bounds, zero fills, and one counting launch per dtype (each program
    counts its blocks with ``tl.histogram`` in registers and adds them to its tensor's row atomically)."""
    rows = reduce_moments_many(tensors, zeros=False)
    mean, lo, hi, count = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3]
    nans, infs, scale = rows[:, 8], rows[:, 9], rows[:, SCALE]
    nan = nans > 0  # stats.histogram's aminmax, sum and norm propagate NaN; its sum sees +-Inf
    both = (lo == -math.inf) & (hi == math.inf)
    total = torch.where(infs > 0, torch.where(both, math.nan, torch.where(hi == math.inf, math.inf, -math.inf)),
                        mean * count)
    squares = torch.where(infs > 0, math.inf, rows[:, 4] * scale * scale + count * mean * mean)
    lo, hi = torch.where(nan, math.nan, lo), torch.where(nan, math.nan, hi)
    head = torch.stack([lo, hi, count + nans + infs, torch.where(nan, math.nan, total),
                        torch.where(nan, math.nan, squares)], dim=1)
    flat = hi == lo  # torch.histc's widening, as stats.histogram
    bounds = torch.stack([torch.where(flat, lo - 1, lo), torch.where(flat, 2.0, hi - lo)], dim=1)
    bounds[:, 1] = torch.where(bounds[:, 1] > 0, bounds[:, 1], 1.0)
    slots = triton.next_power_of_2(bins + 1)  # one more: the lanes past a tensor's end
    counts = torch.zeros(len(tensors), slots, dtype=torch.int32, device=rows.device)
    groups: dict[torch.dtype, list[tuple[int, torch.Tensor, int]]] = {}
    keep = []
    for index, x in enumerate(tensors):
        flat_x, repeats = _readable(x)
        keep.append(flat_x)
        groups.setdefault(flat_x.dtype, []).append((index, flat_x, repeats))
    interpret = rows.device.type == "cpu"
    for dtype, members in groups.items():
        index = torch.tensor([i for i, _, _ in members], device=rows.device)
        table = _table(tuple((f.data_ptr(), f.numel(), r) for _, f, r in members), rows.device)
        part = torch.zeros(len(members), slots, dtype=torch.int32, device=rows.device)
        blocks = max(-(-f.numel() // BLOCK) for _, f, _ in members)
        g = max(1, min(blocks, programs(rows.device)))
        _kernel(_histogram_kernel, interpret)[(g, len(members))](
            table, bounds[index].contiguous(), part, g, DTYPE=_tl_dtype(dtype), BLOCK=BLOCK, BINS=bins, SLOTS=slots)
        counts[index] = part
    return torch.cat([head, counts[:, :bins].to(torch.float64)], dim=1)
