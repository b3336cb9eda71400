"""A tensor's statistics vector in a fixed, small number of torch ops: the fallback for devices without
Triton (Apple's MPS, Intel's XPU, CUDA without Triton), the same layout and numbers as the accelerator
path of ``engine.stats`` (``MEAN, MIN, MAX, COUNT, M2, M3, M4, ZEROS, NANS, INFS, SCALE``).

On such a device every op is a kernel launch, so the op count is the cost: ``reduce_lean`` takes 19
compute ops for a float32/float64 tensor (20 for bfloat16/float16, which are widened first), and
views, where the accelerator path of ``engine.stats`` takes 71 ops. Each op does several things at once: one comparison with a
column of bounds flags every count (finite, not NaN, +-Inf, zero) and one sum counts them all; one
``amax`` over ``[x, -x]`` gives both extremes; one ``pow`` with a column of exponents and one ``nansum``
give the three power sums; the vector is put together by one ``cat`` and one ``addcmul`` with
constants cached per device and size.

The numbers: the mean is the float64 (``device_float``) sum of the finite values over their count; the
moments are about that mean rounded to the working dtype (float32, or float64 for float64 data),
in units of ``SCALE^k`` (the largest finite magnitude, clamped to the smallest normal number) so that
their powers cannot overflow; a value that is not finite is replaced by the mean before centring, so it
adds nothing. Two differences from the Triton kernel, both shared with the accelerator path's float32
arithmetic or smaller: the rounding of the centre is not corrected afterwards (that correction alone
costs about six ops), so moments are about ``centre = mean + c`` with ``|c|`` at most half a float32 unit
of the mean: ``M3`` moves by about ``3 c M2`` (``1e-7 * |mean| / std`` of its own size), ``M4`` by
``4 c M3``, ``M2`` by ``count * c^2``; and values whose span exceeds the working dtype's range (both
signs near float32's limit) overflow ``x - centre``, giving infinite moments (the accelerator path: NaN).
"""

from __future__ import annotations

import functools
import math

import torch

from hookcli.engine.stats import (
    COUNT,
    INFS,
    M2,
    M4,
    MAX,
    MEAN,
    MIN,
    NANS,
    SCALE,
    ZEROS,
    device_float,
    empty_vector,
    unbroadcast,
)

#: Added to the count of finite values before it divides (and taken off again): 0 / EPSILON is 0, and
#: n + EPSILON is n for every count n >= 1 in float32 and float64 (a power of two: its multiples are exact).
EPSILON = 2.0 ** -100
#: Rows of the bounds column: ``x <= bound`` for each, summed into these counts.
_BOUNDS = ("neg_inf", "max", "inf", "zero", "neg_sub")


def reduce_lean(t: torch.Tensor, zeros: bool = True) -> torch.Tensor:
    """``t``'s statistics vector on its device (``device_float``), with no host synchronisation, in 19
    compute ops (20 for 16-bit floats); ``zeros=False`` leaves the zero count at 0."""
    x = t.detach() if t.requires_grad else t
    if x.is_neg():
        x = x.resolve_neg()
    if x.numel() == 0:
        return empty_vector(x.device)
    x, repeats = unbroadcast(x)
    if x.dim() == 0:
        x = x.view(1)
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()
    acc = device_float(x.device)
    k = _constants(x.device, x.dtype, acc, x.dim(), x.numel(), repeats, zeros)
    dims = tuple(range(1, x.dim() + 1))
    flags = torch.le(x, k.bounds)  # one row per bound
    # [finite + EPSILON, zeros, not NaN, +-Inf]: EPSILON vanishes in any count >= 1 and keeps 0 / 0 out
    counts = torch.addmv(k.epsilon, k.mix, flags.sum(dims, dtype=acc))
    finite = torch.ne(flags[0], flags[1])  # x <= max but not x <= -inf
    mean = torch.where(finite, x, k.zero).sum(dtype=acc) / counts[0]
    centred = torch.where(finite, x, mean)  # the mean where a value is not finite: adds nothing below
    # the largest finite magnitude, at least the smallest normal number (as the scale it is reported as)
    scale = torch.linalg.vector_norm(centred, math.inf).clamp_(min=k.tiny)
    ends = (x * k.signs).nan_to_num_(-math.inf, math.inf, -math.inf).amax(dims)  # [-min, max]: NaN ignored, +-Inf seen
    powers = torch.pow((centred - mean) / scale, k.exponents).nansum(dims, dtype=acc)
    parts = torch.cat([mean.view(1), ends, counts[:1], powers, counts[1:], scale.view(1)])
    return torch.addcmul(k.offset, parts, k.factor)


class _Constants:
    """The small tensors ``reduce_lean`` broadcasts against, for one device, dtype and size."""

    def __init__(self, device: torch.device, dtype: torch.dtype, acc: torch.dtype, dim: int, numel: int,
                 repeats: int, zeros: bool) -> None:
        info = torch.finfo(dtype)
        column = (len(_BOUNDS),) + (1,) * dim
        values = {"neg_inf": -math.inf, "max": info.max, "inf": math.inf, "zero": 0.0,
                  "neg_sub": -info.smallest_normal * info.eps}  # below 0 by the least subnormal
        self.bounds = torch.tensor([values[b] for b in _BOUNDS], dtype=dtype).view(column).to(device)
        row = {b: i for i, b in enumerate(_BOUNDS)}
        mix = torch.zeros(4, len(_BOUNDS), dtype=acc)
        mix[0, row["max"]], mix[0, row["neg_inf"]] = 1, -1  # finite: <= max, not -inf
        if zeros:
            mix[1, row["zero"]], mix[1, row["neg_sub"]] = 1, -1  # zero: <= 0, not below it
        mix[2, row["inf"]] = 1  # not NaN: <= inf
        mix[3, row["inf"]], mix[3, row["max"]], mix[3, row["neg_inf"]] = 1, -1, 1  # +-Inf
        self.mix = mix.to(device)
        self.epsilon = torch.tensor([EPSILON, 0.0, 0.0, 0.0], dtype=acc).to(device)
        self.zero = torch.zeros((), dtype=dtype, device=device)
        self.signs = torch.tensor([-1.0, 1.0], dtype=dtype).view((2,) + (1,) * dim).to(device)
        self.exponents = torch.tensor([2.0, 3.0, 4.0], dtype=dtype).view((3,) + (1,) * dim).to(device)
        # parts: mean, -min, max, count, s2, s3, s4, zeros, not NaN, +-Inf, scale
        factor = [1.0, -1.0, 1.0] + [float(repeats)] * 5 + [-float(repeats), float(repeats), 1.0]
        offset = [0.0] * (SCALE + 1)
        offset[NANS] = float(numel * repeats)  # NaN = all - not NaN
        offset[COUNT] = -EPSILON * repeats
        self.tiny = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).tiny
        assert (MEAN, MIN, MAX, COUNT, M2, M4, ZEROS, NANS, INFS) == (0, 1, 2, 3, 4, 6, 7, 8, 9)
        self.factor = torch.tensor(factor, dtype=acc).to(device)
        self.offset = torch.tensor(offset, dtype=acc).to(device)


@functools.lru_cache(maxsize=256)
def _constants(device: torch.device, dtype: torch.dtype, acc: torch.dtype, dim: int, numel: int, repeats: int,
               zeros: bool) -> _Constants:
    """Cached: a hook reduces tensors of the same few shapes at every step, and building these costs
    host-to-device copies."""
    return _Constants(device, dtype, acc, dim, numel, repeats, zeros)
