"""A tensor's statistics vector in a fixed number of torch ops (12, whatever its dtype and layout): the
fallback for devices without Triton (Apple's MPS, Intel's XPU, CUDA without Triton), the same layout and
numbers as the accelerator path of ``engine.stats`` (``MEAN, MIN, MAX, COUNT, M2, M3, M4, ZEROS, NANS, INFS,
SCALE``), which takes 71 ops.

On such a device every op is a kernel launch, so the op count is the cost. Each op does several things:

1. ``|x|``; 2. one comparison with a column of bounds flags, per value, zero / not NaN / finite; 3. one sum
   counts them all;
4. one ``where`` with a 2x2 block of fills writes four rows in the working dtype (``device_float``: float64,
   float32 on MPS; float16/bfloat16 are widened here): ``x`` with NaN as +inf and as -inf (for min and
   max, +-Inf kept), and the finite values with 0 and with NaN elsewhere;
5. one ``aminmax`` over three of those rows gives min, max and the finite extremes; 6. one ``nansum`` the
   finite sum; 7. one ``vector_norm`` over three numbers the scale (the largest finite magnitude, at
   least the smallest normal number);
8. - 11. the finite row becomes four rows ``[x / n, d, d, d]`` with ``d = (x - total / n) / scale`` (one
   ``addcdiv``, one in-place ``div_``), raised to ``[1, 2, 3, 4]`` in place, and summed by one ``nansum``:
   the mean and the central sums ``M2..M4`` (NaN, where a value is not finite, adds nothing; with no
   finite value the mean row is all NaN, and the mean 0);
12. one ``embedding_bag`` (a sparse weighted gather-sum) assembles the vector: the counts mixed
   (NaN = all - not NaN, Inf = not NaN - finite) and the additive fields times the repeats of an expanded
   tensor. A dense product would turn an infinite min times a zero weight into NaN; a sparse one has no
   zero weights.

Each op writes its small result with ``out=`` into a scratch vector kept per device, dtype and thread
(``_scratch``: its constants are written once), which the last op reads; the vector returned is the last
op's own. The moments are centred on the float64 mean (float32 on MPS) and not corrected afterwards;
float64 powers cannot overflow, so values of both signs near float32's limit give finite moments (on MPS,
in float32: infinite ones, as the accelerator path's NaN). The price of so few ops is memory: the four
rows of step 4 and the four of steps 8-11 are temporaries of the tensor's size in the working dtype.
"""

from __future__ import annotations

import functools
import math
import threading

import torch
import torch.nn.functional as F

from hookcli.engine.stats import (
    COUNT,
    INFS,
    M2,
    M3,
    M4,
    MAX,
    MEAN,
    MIN,
    NANS,
    SCALE,
    ZEROS,
    dense_view,
    device_float,
    empty_vector,
    unbroadcast,
)

# Slots of the scratch vector: where each op writes (``out=``) and the last op reads.
_ZERO, _NOT_NAN, _FINITE = 0, 1, 2  # the counts, in the order of the bounds
_SCALES = 3  # 3, 4: the scale twice (the divisor column of step 9)
_NIL = 5  # constant 0: the mean row's shift
_TOTALS = 6  # 6, 7: the finite sum twice (the shift column of step 8)
_MINS, _MAXS = 8, 11  # 8..10 and 11..13: aminmax of the rows [NaN as +inf, NaN as -inf, finite or 0]
_TINY = 16  # constant: the smallest normal number (the scale's floor), 3 after the finite maximum
_SUMS = 17  # 17..20: mean, M2, M3, M4
_ONE = 21  # constant 1 (times the number of values: NaN = all - not NaN)
_WIDTH = 22
_LOCAL = threading.local()


def reduce_lean(t: torch.Tensor, zeros: bool = True) -> torch.Tensor:
    """``t``'s statistics vector on its device (``device_float``), with no host synchronisation, in 12
    torch ops whatever its dtype and layout (views apart: a layout with gaps is read in place, its
    dimensions put in memory order); ``zeros=False`` leaves the zero count at 0."""
    x = t.detach() if t.requires_grad else t
    if x.is_neg():
        x = x.resolve_neg()
    if x.numel() == 0:
        return empty_vector(x.device)
    x, repeats = unbroadcast(x)
    flat = dense_view(x)
    if flat is None:  # a layout with gaps: its dimensions in memory order (a view), so that the rows below
        x = x.view(1) if x.dim() == 0 else x.permute(sorted(range(x.dim()), key=lambda d: -x.stride(d)))
    else:  # are laid out row after row and flatten as views
        x = flat
    acc = device_float(x.device)
    k = _constants(x.device, x.dtype, acc, x.dim(), x.numel(), repeats, zeros)
    s = _scratch(x.device, acc, torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).tiny)
    dims = tuple(range(1, x.dim() + 1))
    cond = torch.le(torch.abs(x), k.bounds)  # rows: zero, not NaN, finite
    torch.sum(cond, dims, dtype=acc, out=s[_ZERO:_FINITE + 1])
    rows = torch.where(cond[_NOT_NAN:].unsqueeze(1), x, k.fills)  # [[min row, max row], [finite or 0, or NaN]]
    del cond
    finite = rows[1, 1]
    torch.aminmax(rows.reshape(4, -1)[:3], dim=1, out=(s[_MINS:_MINS + 3], s[_MAXS:_MAXS + 3]))
    torch.nansum(finite.expand((2,) + finite.shape), dims, dtype=acc, out=s[_TOTALS:_TOTALS + 2])
    extremes = s.as_strided((2, 3), (0, _MAXS - _MINS), _MINS + 2)  # [-finite min, finite max, tiny]
    torch.linalg.vector_norm(extremes, math.inf, dim=1, out=s[_SCALES:_SCALES + 2])
    del rows
    ones = (0,) * x.dim()
    shifts = s.as_strided((2, 2) + (1,) * x.dim(), (1, 1) + ones, _NIL)  # [[0, total], [total, total]]
    count = s.as_strided((1, 1) + (1,) * x.dim(), (0, 0) + ones, _FINITE)
    powers = torch.addcdiv(finite, shifts, count, value=-1)  # [[x, x - mean], [x - mean, x - mean]]
    powers.div_(s.as_strided((2, 2) + (1,) * x.dim(), (1, 1) + ones, _FINITE))  # [[count, scale], [scale, scale]]
    powers.pow_(k.exponents)
    torch.nansum(powers, tuple(d + 1 for d in dims), dtype=acc, out=s.as_strided((2, 2), (2, 1), _SUMS))
    return k.assemble(s)


class _Constants:
    """The small tensors ``reduce_lean`` broadcasts against and assembles with, for one device, dtype and
    size."""

    def __init__(self, device: torch.device, dtype: torch.dtype, acc: torch.dtype, dim: int, numel: int,
                 repeats: int, zeros: bool) -> None:
        info = torch.finfo(dtype)
        column = (3,) + (1,) * dim
        bounds = [0.0 if zeros else math.nan, math.inf, info.max]  # |x| <= bound: zero, not NaN, finite
        self.bounds = torch.tensor(bounds, dtype=dtype).view(column).to(device)
        block = (2, 2) + (1,) * dim
        self.fills = torch.tensor([[math.inf, -math.inf], [0.0, math.nan]], dtype=acc).view(block).to(device)
        self.exponents = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=acc).view(block).to(device)
        r = float(repeats)
        terms = {MEAN: [(_SUMS, 1.0)], MIN: [(_MINS, 1.0)], MAX: [(_MAXS + 1, 1.0)], COUNT: [(_FINITE, r)],
                 M2: [(_SUMS + 1, r)], M3: [(_SUMS + 2, r)], M4: [(_SUMS + 3, r)], ZEROS: [(_ZERO, r)],
                 NANS: [(_ONE, numel * r), (_NOT_NAN, -r)], INFS: [(_NOT_NAN, r), (_FINITE, -r)],
                 SCALE: [(_SCALES, 1.0)]}
        assert sorted(terms) == list(range(SCALE + 1))
        pairs = [terms[field] for field in sorted(terms)]
        self.index = torch.tensor([i for p in pairs for i, _ in p], device=device)
        self.weights = torch.tensor([w for p in pairs for _, w in p], dtype=acc).to(device)
        lengths = [len(p) for p in pairs]
        self.offsets = torch.tensor([sum(lengths[:i]) for i in range(len(lengths))], device=device)

    def assemble(self, scratch: torch.Tensor) -> torch.Tensor:
        """The statistics vector from the scratch slots: one ``embedding_bag`` (each field a weighted sum of
        slots)."""
        return F.embedding_bag(self.index, scratch.view(-1, 1), self.offsets, mode="sum",
                               per_sample_weights=self.weights).view(-1)


@functools.lru_cache(maxsize=256)
def _constants(device: torch.device, dtype: torch.dtype, acc: torch.dtype, dim: int, numel: int, repeats: int,
               zeros: bool) -> _Constants:
    """Cached: a hook reduces tensors of the same few shapes at every step, and building these costs
    host-to-device copies."""
    return _Constants(device, dtype, acc, dim, numel, repeats, zeros)


def _scratch(device: torch.device, acc: torch.dtype, tiny: float) -> torch.Tensor:
    """The scratch vector of this thread for ``device``, ``acc`` and the scale's floor ``tiny`` (the
    smallest normal number of the dtype the data is reduced in, as ``engine.stats``; inference mode apart: a tensor made in
    it cannot be written outside it), made once with its constant slots filled. On one thread the ops of
    two reductions are queued one after the other on the device, so the next reduction overwrites slots
    only after the previous one's last op read them."""
    cache = _LOCAL.__dict__.setdefault("scratch", {})
    key = (device, acc, tiny, torch.is_inference_mode_enabled())
    scratch = cache.get(key)
    if scratch is None:
        values = [0.0] * _WIDTH
        values[_TINY], values[_ONE] = tiny, 1.0
        scratch = cache[key] = torch.tensor(values, dtype=acc).to(device)
    return scratch
