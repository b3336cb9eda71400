"""What a hook computes, on the device, without holding activations.

Each function reduces one tensor to a small result tensor on the tensor's own device (no host
synchronisation); ``to_host`` turns all of them into Python values with one transfer per device at the
end of a run. Float16/bfloat16 are reduced in float32; the standard deviation is the population one
(correction=0).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from hookcli.engine import backends, kernel
from hookcli.records import statistics as table

#: The optional one-pass C kernel, or None (imported here, after torch, to share torch's OpenMP).
_fastreduce = kernel.load()

#: The dtypes the C kernel reads in place, by the name it takes.
_KERNEL_DTYPES = ({getattr(torch, name): name for name in _fastreduce.DTYPES} if _fastreduce is not None else {})
_MAX_NESTING = 8


class Moments(NamedTuple):
    """A tensor's statistics as mergeable sufficient statistics (host floats; on an accelerator the same
    fields, in this order, are a float64 tensor: ``Vector``).

    ``count``, ``mean`` and the central moment sums ``m2``, ``m3``, ``m4`` (sums of (x - mean)^k) are over
    the *finite* values; NaN and +-Inf are only counted. ``min``/``max`` ignore NaN and include +-Inf (an
    empty or all-NaN tensor has min +inf, max -inf: the identity of ``merge``). ``merge`` combines two
    exactly in the counts and extremes and by Pebay's pairwise formulas in the moments; ``summary`` gives
    what reports show. The first three fields are intensive, the rest additive (``ADDITIVE``): a tensor
    that repeats each value of another k times has the additive fields times k.
    """

    mean: float
    min: float
    max: float
    count: float
    m2: float
    m3: float
    m4: float
    zeros: float
    nans: float
    infs: float


assert Moments._fields == table.ACCUMULATORS  # the table of statistics names them; this is their layout
#: Index of each field in a ``Vector`` (host ``Moments`` or device tensor): the one place the layout lives.
MEAN, MIN, MAX, COUNT, M2, M3, M4, ZEROS, NANS, INFS = range(len(Moments._fields))
#: The fields that add up (and scale with repeats); the others are means and extremes.
ADDITIVE = slice(COUNT, INFS + 1)
#: A device vector has one more element, a scale: its m2, m3, m4 are in units of scale^2, ^3, ^4, so that
#: they stay in range where the device reduces in float32 (Apple's MPS: a std of 1e20 has m2 > 1e40).
#: ``as_moments`` turns a host copy of either kind into ``Moments``.
SCALE = len(Moments._fields)
#: The statistics of no values: ``merge(EMPTY, s) == s``.
EMPTY = Moments(0.0, math.inf, -math.inf, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
#: A statistics vector: ``Moments`` on the host (CPU tensors, where reading a scalar costs no device
#: synchronisation), or a tensor in ``device_float`` on an accelerator, the same layout plus ``SCALE``,
#: read once at the end of a run (``to_host``). CPU results stay out of torch so a run keeps no small
#: tensors alive.
Vector = torch.Tensor | Moments


def kernel_available() -> bool:
    """Whether CPU statistics take the one-pass C kernel (built, and not switched off by the environment)."""
    return kernel.enabled()


def is_float(t: torch.Tensor) -> bool:
    """Statistics make sense for real floating tensors only (ints/bools get shape and dtype)."""
    return t.is_floating_point()


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (cached: it runs for every hooked tensor)."""
    return str(dtype).removeprefix("torch.")


class Reducer:
    """Reduces tensors to ``Moments`` (host) or tensors of the same layout (accelerators), fast and
    without host syncs.

    Memory traffic is the cost (a hooked activation is usually no longer in cache), so each path
    reads a tensor from memory once where it can and never allocates an activation-sized temporary; the
    slow reductions (Welford ``std_mean``, ``count_nonzero``, bool sums like ``(x == 0).sum()``)
    cost 10-50x a plain sum on CPU and are avoided.

    * CPU, where reading a scalar costs no device synchronisation: float32, bfloat16 and float16
      go through the C kernel ``hookcli.engine._fastreduce`` when it is built: the power sums of x to
      x^4 (float64), min, max and zero count in one pass, without a widened copy. The kernel gets memory
      only as a buffer-protocol object (``kernel_buffer``) and refuses any that is not one dense
      block of the declared item format; this side hands it only stride-1 views of tensors that are
      dense in some dimension order (``dense_view``). Other layouts (stepped slices, overlapping
      views) are copied by ``reshape`` or read by the torch reductions, which follow strides.
      Without the kernel (and for float64), the tensor is read in cache-sized chunks (``CHUNK``): each
      chunk is summed, min/maxed, squared into a scratch buffer whose sum and dot products give the
      other power sums, and zero-counted only where zeros can be (``_zero_count``), all while it is in
      cache; the chunks' ``Moments`` are merged. A tensor of at most ``SMALL`` values goes to numpy instead
      (centred float64 sums, exact zero count), where torch's per-op dispatch would cost more than
      the reading. Either way NaN/Inf are handled only when a sum or an extreme is not finite (both
      propagate), on a rare path that counts them and reduces the finite values, and the centred
      second pass runs only where power sums about 0 would lose the moments' digits (a large offset).
    * Other devices: one branch-free path (centred moments of data scaled into [-2, 2], all counts),
      so nothing waits for the device.

    A tensor seen again unchanged (same object and version: a Bottleneck's output *is* its last
    ReLU's output, a Sequential's *is* its last child's) reuses its vector. The one change this cannot
    see is an in-place write through ``.data`` (which has a version counter of its own): a parent
    returning its child's output after ``y.data.mul_(2)`` shows the child's statistics. An expanded tensor
    (stride 0: a broadcast mask, the gradient of ``sum``) is reduced without its repeats.
    """

    CHUNK = 1 << 20  # elements per chunk on CPU without the kernel: 4 MB of float32, stays in cache
    #: up to this many elements, CPU tensors the kernel does not read are reduced with numpy (``_small``)
    SMALL = 1 << 15
    #: power sums about 0 are used while mean^2 <= RATIO * var; else a centred second pass. float64 sums
    #: (kernel) keep ~10 more digits than float32 ones (torch's float32 sum/dot)
    OFFSET_RATIO_FLOAT64 = 1e3
    OFFSET_RATIO_FLOAT32 = 4.0

    def __init__(self, *, kernel: bool | None = None, backend: str | None = None) -> None:
        """``backend``: a name of ``engine.backends.BACKENDS`` (default: ``engine.backends.choose``'s, by
        ``HOOKCLI_REDUCTION``); ``kernel``: the host ``kernel`` (True) or ``torch`` (False) backend."""
        if kernel is not None:
            backend = "kernel" if kernel else "torch"
        #: the backend of CPU tensors, and of the others (an accelerator's, or a forced device backend)
        self.host_backend = backends.choose(torch.device("cpu"), backend)
        self._backend_name = backend
        self._device_vector: Callable[[torch.Tensor, bool], torch.Tensor] | None = None
        self.kernel = self.host_backend.name == "kernel"
        if self.kernel and _fastreduce is None:
            raise RuntimeError("hookcli.engine._fastreduce is not built (a C compiler was missing at install time)")
        self.threads = torch.get_num_threads()
        #: dtype -> the name the kernel reads it by; empty when the kernel is not used
        self._kernel_dtypes = _KERNEL_DTYPES if self.kernel else {}
        self._scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._seen: dict[tuple[int, int, bool], tuple[weakref.ref[torch.Tensor], Vector]] = {}

    @functools.cached_property
    def device_backend(self) -> backends.Backend:
        """The backend of an accelerator's tensors (or of every tensor, forced): chosen at the first such
        tensor, so that a CPU run never imports what an accelerator's backend needs (Triton)."""
        return backends.choose(torch.device("meta"), self._backend_name)

    def clear(self) -> None:
        """Forget every tensor seen and free the scratch buffers: a long-lived hook set calls this at
        each step boundary, so neither grows with the steps nor keeps an activation-sized buffer."""
        self._seen.clear()
        self._scratch.clear()

    def scratch(self, like: torch.Tensor, numel: int | None = None) -> torch.Tensor:
        """A buffer of ``numel`` (default ``like.numel()``) elements of ``like``'s device and dtype, reused."""
        size = like.numel() if numel is None else numel
        key = (like.device, like.dtype)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < size:
            buf = torch.empty(size, dtype=like.dtype, device=like.device)
            self._scratch[key] = buf
        return buf[:size]

    def reduce(self, t: torch.Tensor, *, zeros: bool = True) -> Vector:
        """``t``'s statistics: ``Moments`` for a CPU tensor, else a tensor on ``t``'s device (same layout).

        ``zeros=False``: the zero count is not wanted and left at 0 (gradients).
        """
        try:
            key: tuple[int, int, bool] | None = (id(t), t._version, zeros)
        except RuntimeError:  # an inference tensor keeps no version counter: never reused
            key = None
        hit = self._seen.get(key) if key is not None else None
        if hit is not None and hit[0]() is t:
            return hit[1]
        x = t.detach() if t.requires_grad else t
        vector = self._reduce(x, zeros)
        if table.extra_accumulators():
            vector = with_extras(vector, x)
        self._remember(key, t, vector)
        return vector

    def _reduce(self, x: torch.Tensor, zeros: bool) -> Vector:
        """``x``'s vector by this reducer's backend (``reduce`` without the reuse and the extras)."""
        kernel_dtype = self._kernel_dtypes.get(x.dtype)
        vector: Vector
        if (kernel_dtype is not None and type(x) is torch.Tensor and x.is_cpu and x.layout == torch.strided
                and not x.is_nested and x.is_contiguous() and not x.is_neg() and x.numel()):
            # the common case (a dense CPU activation), without the general path's views: the kernel
            # takes the tensor's memory as one C-contiguous buffer of any rank
            sums = _fastreduce.reduce(kernel_buffer(x), kernel_dtype, self.threads)
            s1, s2, s3, s4, lo, hi, zero_count = sums
            n = x.numel()
            mean = s1 / n
            m2 = s2 - s1 * mean
            if 0.0 <= m2 and mean * mean * n <= self.OFFSET_RATIO_FLOAT64 * m2:
                # finite (a NaN or Inf makes m2 NaN) and well conditioned: what _from_power_sums computes,
                # without its rare branches (central_moments about 0, written out)
                sq = mean * mean
                vector = tuple.__new__(Moments, (  # (Moments(...) costs a Python call more)
                    mean, lo, hi, float(n), m2, s3 - 3 * mean * s2 + 2 * n * sq * mean,
                    s4 - 4 * mean * s3 + 6 * sq * s2 - 3 * n * sq * sq, float(zero_count) if zeros else 0.0,
                    0.0, 0.0))
            else:
                flat = x.view(-1)
                moments = self._from_power_sums(flat, sums[:4], lo, hi, zero_count if zeros else 0,
                                                self.OFFSET_RATIO_FLOAT64)
                vector = self._nonfinite(flat, zeros) if moments is None else moments
            return vector
        if x.is_nested:  # a nested (ragged) tensor: statistics of its components' values
            x = nested_values(x)
        if x.layout != torch.strided:
            x = x.to_dense()  # a sparse output: statistics of its dense values, zeros included
        host = x.device.type == "cpu" and self.host_backend.host
        if x.numel() == 0:
            return EMPTY if host else empty_vector(x.device)
        return self._reduce_host(x, zeros) if host else self._reduce_accelerator(x, zeros)

    def _remember(self, key: tuple[int, int, bool] | None, t: torch.Tensor, vector: Vector) -> None:
        """Keep ``t``'s vector for its next sighting unchanged (same object and version)."""
        try:
            if key is not None:
                self._seen[key] = (weakref.ref(t), vector)
        except TypeError:  # tensor subclasses without weakref support
            pass

    # An expanded (stride-0) tensor repeats each value of a smaller one equally often: both paths reduce
    # that one (``unbroadcast``), without materialising the repeats, and scale the additive fields.
    def _reduce_host(self, x: torch.Tensor, zeros: bool) -> Moments:
        """The ``Moments`` of a non-empty, strided CPU tensor."""
        x, repeats = unbroadcast(x)
        flat = flat_view(x)
        if flat.dtype not in (torch.float32, torch.float64) and not self._kernel_reads(flat):
            flat = flat.float()  # float16/bfloat16 in float32 (the C kernel widens as it reads)
        moments = self._host_moments(flat, zeros)
        if repeats == 1:
            return moments
        return Moments(*moments[:COUNT], *(value * repeats for value in moments[ADDITIVE]))

    def _reduce_accelerator(self, x: torch.Tensor, zeros: bool) -> torch.Tensor:
        """The vector of a non-empty, strided tensor, as a tensor on its device (no host synchronisation)."""
        backend = self.device_backend
        if self._device_vector is None:
            self._device_vector = backend.vector_fn()
        if backend.reads_layouts:  # its own fixed ops (1 for triton, 12 for lean), whatever the layout
            return self._device_vector(x, zeros)
        x, repeats = unbroadcast(x)
        if x.dtype not in (torch.float32, torch.float64) and not backend.reads_half:
            x = x.float()  # (a backend that reads 16-bit floats widens them as it reads: no copy)
        vector = self._device_vector(flat_view(x), zeros)
        if repeats != 1:
            vector[ADDITIVE] *= repeats  # a Python scalar: no host synchronisation
        return vector

    # -- CPU: cheap passes, exact checks on the host decide what else is needed ---------------------
    def _kernel_reads(self, flat: torch.Tensor) -> bool:
        """Whether the C kernel takes ``flat`` (a 1-D CPU tensor): a plain tensor of its dtypes whose
        memory is exactly its values, one dense block (stride 1, no lazy negation bit: a negative
        view's memory holds ``-x``). The kernel checks the layout again where it reads."""
        return (self.kernel and type(flat) is torch.Tensor and dtype_name(flat.dtype) in _fastreduce.DTYPES
                and flat.dim() == 1 and flat.is_contiguous() and not flat.is_neg())

    def _host_moments(self, flat: torch.Tensor, zeros: bool) -> Moments:
        """The ``Moments`` of a non-empty 1-D CPU tensor, by the cheapest path that reads it."""
        if self._kernel_reads(flat):
            return self._from_kernel(flat, zeros)
        if flat.numel() <= self.SMALL and type(flat) is torch.Tensor:
            return self._small(flat, zeros)
        return self._chunked(flat, zeros)

    def _from_kernel(self, flat: torch.Tensor, zeros: bool) -> Moments:
        """One kernel pass over a dense 1-D tensor of a kernel dtype (a second one for offset data)."""
        *sums, lo, hi, zero_count = _fastreduce.reduce(kernel_buffer(flat), dtype_name(flat.dtype), self.threads)
        moments = self._from_power_sums(flat, sums, lo, hi, zero_count if zeros else 0, self.OFFSET_RATIO_FLOAT64)
        return self._nonfinite(flat, zeros) if moments is None else moments

    def _from_power_sums(self, flat: torch.Tensor, sums: Sequence[float], lo: float, hi: float, zero_count: int,
                         ratio: float) -> Moments | None:
        """``Moments`` from the power sums ``(sum x, x^2, x^3, x^4)`` of finite ``flat``; None when ``flat``
        holds NaN/Inf (a sum or an extreme is not finite: both propagate, and min/max see Inf). Where the
        data's offset would cancel the moments' digits (``mean^2 > ratio * var``) or a float32 power
        overflowed, a centred float64 pass around the mean gives them instead."""
        n = flat.numel()
        if not (math.isfinite(lo) and math.isfinite(hi)):
            return None
        finite_sums = all(map(math.isfinite, sums))
        if not finite_sums and not bool(torch.isfinite(flat).all()):  # (the kernel's min/max ignore NaN)
            return None
        if finite_sums:
            mean, m2, m3, m4 = central_moments(n, 0.0, *sums)
            if 0.0 <= m2 and mean * mean * n <= ratio * m2:
                return Moments(mean, lo, hi, float(n), m2, m3, m4, float(zero_count), 0.0, 0.0)
            shift = mean
        else:  # x^k overflowed float32 (the values are finite): the mean in float64 first
            shift = sum(float(c.sum(dtype=torch.float64)) for c in flat.split(self.CHUNK)) / n
        mean, m2, m3, m4 = central_moments(n, shift, *self._centred_sums(flat, shift))
        return Moments(mean, lo, hi, float(n), max(m2, 0.0), m3, max(m4, 0.0), float(zero_count), 0.0, 0.0)

    def _centred_sums(self, flat: torch.Tensor, shift: float) -> tuple[float, float, float, float]:
        """Sums of d, d^2, d^3, d^4 for ``d = x - shift`` in float64: the rare second pass for data with a
        large offset (tiny squeeze-and-excite gates near 0.5 take it on every call). ``central_moments``
        removes what the shift's own error adds (the corrected two-pass algorithm)."""
        if self._kernel_reads(flat):
            return _fastreduce.centred(kernel_buffer(flat), dtype_name(flat.dtype), self.threads, shift)
        totals = [0.0, 0.0, 0.0, 0.0]
        for chunk in flat.split(self.CHUNK):
            d = chunk.double() - shift
            d2 = d * d
            for k, value in enumerate((d.sum(), d2.sum(), torch.dot(d2, d), torch.dot(d2, d2))):
                totals[k] += float(value)
        return totals[0], totals[1], totals[2], totals[3]

    def _small(self, flat: torch.Tensor, zeros: bool) -> Moments:
        """``Moments`` of a small float32/float64 tensor without the kernel: numpy's reductions in float64,
        centred on the mean, where torch's cost ~5-10 us of dispatch each on a few thousand values. The
        zero count is exact (NaN is not zero)."""
        values = flat.resolve_neg().numpy()
        wide = values.astype(np.float64, copy=False)
        n = values.size
        with np.errstate(all="ignore"):  # inf + -inf is NaN here as in torch, not a warning to the user
            # ufuncs only, never np.dot: numpy's BLAS starts threads of its own, which then spin against
            # torch's on the same cores (a 12x slower forward of mobilenet_v3_small, measured)
            shift = float(np.add.reduce(wide)) / n
            if not math.isfinite(shift):
                return self._nonfinite(flat, zeros)
            d = wide - shift
            d2 = d * d
            sums = (float(np.add.reduce(d)), float(np.add.reduce(d2)), float(np.add.reduce(d2 * d)),
                    float(np.add.reduce(np.multiply(d2, d2, out=d2))))
        mean, m2, m3, m4 = central_moments(n, shift, *sums)
        zero_count = n - int(np.count_nonzero(values)) if zeros else 0
        return Moments(mean, float(np.minimum.reduce(values)), float(np.maximum.reduce(values)), float(n),
                       max(m2, 0.0), m3, max(m4, 0.0), float(zero_count), 0.0, 0.0)

    def _chunked(self, flat: torch.Tensor, zeros: bool) -> Moments:
        """``Moments`` of a 1-D float32/float64 tensor with torch, one cache-sized chunk at a time: the
        chunk is read from memory once (by ``sum``); ``aminmax``, the square into a scratch buffer and
        the products giving x^2..x^4 read it again from cache, and the zero count only where zeros can
        be (``_zero_count``)."""
        total = EMPTY
        ratio = self.OFFSET_RATIO_FLOAT32 if flat.dtype == torch.float32 else self.OFFSET_RATIO_FLOAT64
        for chunk in flat.split(self.CHUNK):
            s1 = float(chunk.sum())
            lo_t, hi_t = torch.aminmax(chunk)
            lo, hi = float(lo_t), float(hi_t)
            buf = self.scratch(chunk, self.CHUNK)[: chunk.numel()]
            torch.mul(chunk, chunk, out=buf)
            sums = (s1, float(buf.sum()), float(torch.dot(buf, chunk)), float(torch.dot(buf, buf)))
            zero_count = self._zero_count(chunk, buf, lo, hi) if zeros else 0
            moments = self._from_power_sums(chunk, sums, lo, hi, zero_count, ratio)
            if moments is None:
                return self._nonfinite(flat, zeros)
            total = merge_moments(total, moments)
        return total

    @staticmethod
    def _zero_count(chunk: torch.Tensor, squares: torch.Tensor, lo: float, hi: float) -> int:
        """How many values of ``chunk`` are 0 (or -0), given its extremes and ``squares`` (a scratch
        buffer holding ``chunk * chunk``, overwritten here when the values are counted).

        Counting costs two passes (``eq`` into the buffer, its ``sum``), the most expensive statistic of
        the torch path, so it runs only where its answer is not known: no zero lies outside
        ``[min, max]``; a zero extreme (a ReLU's output) means zeros to count; and data on both sides of
        0 (most conv and norm outputs) holds none when its smallest square is positive (one cheap
        ``amin`` from cache). A square that underflowed to 0 (|x| below about 1e-23 in float32) or a NaN (handled
        by the caller) only sends the chunk to the exact count."""
        if not lo <= 0.0 <= hi or (lo != 0.0 and hi != 0.0 and float(squares.amin()) > 0.0):
            return 0
        torch.eq(chunk, 0, out=squares)
        return int(squares.sum())

    def _nonfinite(self, flat: torch.Tensor, zeros: bool) -> Moments:
        """The rare path for a tensor holding NaN or Inf: they are counted, the finite values reduced
        (a copy), and min/max widened to the infinities present."""
        finite = torch.isfinite(flat)
        nans = int(torch.isnan(flat).sum())
        pos = int((flat == math.inf).sum())
        neg = int((flat == -math.inf).sum())
        values = flat[finite]
        base = self._host_moments(values, zeros) if values.numel() else EMPTY
        if base.nans or base.infs:  # the finite values' moments overflowed: float64 data near its limit
            base = base._replace(nans=0.0, infs=0.0)
        return base._replace(min=-math.inf if neg else base.min, max=math.inf if pos else base.max,
                             nans=float(nans), infs=float(pos + neg))

# -- accelerators: branch-free, no host synchronisation ------------------------------------------
def device_vector(flat: torch.Tensor, zeros: bool, acc: torch.dtype | None = None) -> torch.Tensor:
    """The vector of a non-empty 1-D float32/float64 tensor on any device (the ``device`` backend of
    ``engine.reduction``), in ``acc`` (default: ``device_float`` of the device), with no host
    synchronisation.

    Moments are of the finite values, centred on their mean (summed in ``acc``: its error would bias
    them; what is left of it is removed by ``central_moments``) and divided by their largest
    magnitude, so the powers lie in [-16, 16] and cannot overflow float32 whatever the data's scale.
    """
    n = flat.numel()
    device = flat.device
    acc = acc or device_float(device)
    finite = torch.isfinite(flat)
    nan = torch.isnan(flat)
    count = finite.sum(dtype=torch.int64)
    nans = nan.sum(dtype=torch.int64)
    values = torch.where(finite, flat, 0)
    mean = values.sum(dtype=acc) / count.clamp(min=1)
    lo = torch.where(nan, math.inf, flat).amin()  # min/max ignore NaN and see +-Inf
    hi = torch.where(nan, -math.inf, flat).amax()
    scale = torch.clamp(values.abs().amax(), min=torch.finfo(flat.dtype).tiny)
    shift = mean.to(flat.dtype)
    d = values.sub_(shift).div_(scale).masked_fill_(~finite, 0)
    d2 = d * d
    s1, s2 = d.sum(dtype=acc), d2.sum(dtype=acc)  # sums in acc: float32 ones lose digits over many values
    s3 = d.mul_(d2).sum(dtype=acc)
    s4 = d2.square_().sum(dtype=acc)
    count_acc = count.to(acc)
    s = scale.to(acc)
    # about the mean (the offset of the rounded shift is removed here; the mean is the sum's)
    _offset, m2, m3, m4 = central_moments(count_acc.clamp(min=1), 0.0, s1, s2, s3, s4)  # in units of scale
    zero_count = torch.eq(flat, 0).sum(dtype=torch.int64) if zeros else torch.zeros((), device=device)
    parts = (mean, lo, hi, count_acc, m2.clamp(min=0), m3, m4.clamp(min=0), zero_count, nans,
             n - count - nans, s)
    return torch.stack([p.to(acc) for p in parts])


def central_moments(n: Any, shift: Any, s1: Any, s2: Any, s3: Any, s4: Any) -> tuple[Any, Any, Any, Any]:
    """``(mean, m2, m3, m4)`` of ``n`` values from the sums ``s1..s4`` of ``d^k``, ``d = x - shift``.

    Exact algebra (the binomial shift from ``shift`` to the mean); numerically good when ``shift`` is
    near the mean (the corrected two-pass algorithm), or for power sums about 0 (``shift = 0``) of data
    whose mean is small against its spread. Works on floats and on 0-d tensors alike.
    """
    delta = s1 / n
    d2 = delta * delta  # products, not **: a float's ** raises OverflowError where * gives inf
    m2 = s2 - s1 * delta
    m3 = s3 - 3 * delta * s2 + 2 * n * d2 * delta
    m4 = s4 - 4 * delta * s3 + 6 * d2 * s2 - 3 * n * d2 * d2
    return shift + delta, m2, m3, m4


def merge(a: Vector, b: Vector) -> Vector:
    """The statistics of the values of both ``a`` and ``b`` (two calls, batches, steps or ranks): their
    ``Moments`` (``merge_moments``) and the sums of their extra accumulators (``with_extras``; a vector
    without them, ``EMPTY``, adds none)."""
    count = len(table.extra_accumulators())
    if not count:
        return merge_moments(a, b)
    (core_a, extra_a), (core_b, extra_b) = _split(a, count), _split(b, count)
    core = merge_moments(core_a, core_b)
    if isinstance(core, torch.Tensor):
        return torch.cat([core, torch.as_tensor(extra_a, dtype=core.dtype, device=core.device)
                          + torch.as_tensor(extra_b, dtype=core.dtype, device=core.device)])
    return (*core, *(x + y for x, y in zip(extra_a, extra_b)))  # type: ignore[return-value]


def merged(a: Vector | None, b: Vector | None) -> Vector | None:
    """``merge`` where either side may have no statistics (None): the other as it is. What merging a
    watch step's calls (``step_rows.merged_outputs``) and a run's batches (``batches.MergedRows``) is."""
    return b if a is None else a if b is None else merge(a, b)


def _split(vector: Vector, count: int) -> tuple[Vector, Any]:
    """A vector's ``Moments`` (device: with ``SCALE``) and its ``count`` extra accumulators (zeros where it
    has none)."""
    if isinstance(vector, torch.Tensor):
        extra = vector[SCALE + 1:] if vector.numel() > SCALE + 1 else torch.zeros(count, dtype=vector.dtype,
                                                                                    device=vector.device)
        return vector[:SCALE + 1], extra
    return Moments(*vector[:SCALE]), list(vector[SCALE:]) if len(vector) > SCALE else [0.0] * count


def with_extras(vector: Vector, x: torch.Tensor) -> Vector:
    """``vector`` with the declared extra accumulators of ``x`` after it (``records.statistics``): each a
    float64 sum (``device_float``) of its term over the finite values, a host float for a host vector,
    else on ``x``'s device. Torch ops on a widened copy, a tensor at a time: the first implementation,
    for every backend (the C kernel computes none)."""
    if x.is_nested:
        x = nested_values(x)
    if x.layout != torch.strided:
        x = x.to_dense()
    values = x.to(device_float(x.device))
    finite = torch.isfinite(values)
    terms = [getattr(torch, a.term) if isinstance(a.term, str) else a.term for a in table.extra_accumulators()]
    sums = [torch.where(finite, term(values), 0).sum() for term in terms]
    if isinstance(vector, tuple):
        return (*vector, *(float(v) for v in sums))  # type: ignore[return-value]
    return torch.cat([vector, torch.stack(sums).to(vector.dtype)])


def merge_moments(a: Vector, b: Vector) -> Vector:
    """The ``Moments`` of the values of both ``a`` and ``b``.

    Counts and extremes are exact; the mean and moment sums follow Pebay (2008), "Formulas for robust,
    one-pass parallel computation of covariances and arbitrary-order statistical moments", eq. 2.1-2.2.
    Both host ``Moments``, or both device vectors on one device (merged as tensor ops: no host
    synchronisation; the result takes the larger scale). ``EMPTY`` is the identity; the result does not
    depend on the order but for rounding.
    """
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            raise TypeError("merge takes two host Moments or two device vectors on one device")
        scale = torch.fmax(a[SCALE], b[SCALE])
        ra, rb = a[SCALE] / scale, b[SCALE] / scale  # at most 1: rescaled moments cannot overflow
        fields = _pebay(a[COUNT], b[COUNT], (b[MEAN] - a[MEAN]) / scale,
                        (a[M2] * ra ** 2, a[M3] * ra ** 3, a[M4] * ra ** 4),
                        (b[M2] * rb ** 2, b[M3] * rb ** 3, b[M4] * rb ** 4), (a[COUNT] + b[COUNT]).clamp(min=1))
        mean = a[MEAN] + fields[0] * scale
        return torch.stack((mean, torch.fmin(a[MIN], b[MIN]), torch.fmax(a[MAX], b[MAX]), a[COUNT] + b[COUNT],
                            *fields[1:], a[ZEROS] + b[ZEROS], a[NANS] + b[NANS], a[INFS] + b[INFS], scale))
    if not b.count or not a.count:
        base = b if not a.count else a
        return base._replace(min=min(a.min, b.min), max=max(a.max, b.max), zeros=a.zeros + b.zeros,
                             nans=a.nans + b.nans, infs=a.infs + b.infs)
    n = a.count + b.count
    shift, m2, m3, m4 = _pebay(a.count, b.count, b.mean - a.mean, a[M2:M4 + 1], b[M2:M4 + 1], n)
    return Moments(a.mean + shift, min(a.min, b.min), max(a.max, b.max), n, m2, m3, m4, a.zeros + b.zeros,
                   a.nans + b.nans, a.infs + b.infs)


def _pebay(na: Any, nb: Any, delta: Any, ma: Sequence[Any], mb: Sequence[Any], n: Any) -> tuple[Any, Any, Any, Any]:
    """``(mean_b - mean_a) * nb / n`` and the merged ``m2, m3, m4`` of two sets of ``na`` and ``nb`` values
    whose means differ by ``delta`` and whose central moment sums are ``ma``, ``mb`` (floats or tensors)."""
    (m2a, m3a, m4a), (m2b, m3b, m4b) = ma, mb
    wa, wb = na / n, nb / n
    d2 = delta * delta  # products, not **: a float's ** raises OverflowError where * gives inf
    m2 = m2a + m2b + d2 * na * wb
    m3 = m3a + m3b + d2 * delta * na * wb * (wa - wb) + 3 * delta * (wa * m2b - wb * m2a)
    m4 = (m4a + m4b + d2 * d2 * na * wb * (wa * wa - wa * wb + wb * wb)
          + 6 * d2 * (wa * wa * m2b + wb * wb * m2a) + 4 * delta * (wa * m3b - wb * m3a))
    return delta * wb, m2, m3, m4


def empty_vector(device: torch.device) -> torch.Tensor:
    """``EMPTY`` as a device vector (``SCALE`` 1), filled on the device: ``torch.tensor(list, device=...)``
    would copy from the host and synchronise."""
    vector = torch.zeros(SCALE + 1, dtype=device_float(device), device=device)
    vector[MIN], vector[MAX], vector[SCALE] = math.inf, -math.inf, 1.0
    return vector


def as_moments(values: Sequence[float]) -> Moments:
    """Host ``Moments`` from a host copy of any ``Vector`` (``to_host``'s row of a device vector carries
    ``SCALE``: its moments are brought back to the data's units here, in float64). The declared extra
    accumulators a row carries after those (``extras``) are left out."""
    width = len(values) - len(table.extra_accumulators())
    if width == SCALE:
        return values if isinstance(values, Moments) else Moments(*values[:SCALE])
    s = values[SCALE]
    m2, m3, m4 = values[M2] * s * s, values[M3] * s * s * s, values[M4] * (s * s) * (s * s)
    return Moments(*values[:M2], m2, m3, m4, *values[M4 + 1:SCALE])


def extras(values: Sequence[float]) -> list[float]:
    """The declared extra accumulators' values of a host row (``records.statistics.extra_accumulators``,
    in that order; empty when none is declared)."""
    count = len(table.extra_accumulators())
    return [float(v) for v in values[len(values) - count:]] if count else []


def host_row(values: Sequence[float]) -> list[float]:
    """A host copy of any ``Vector`` as the accumulators, by ``records.statistics``' order: ``Moments`` in
    the data's units, then the extra accumulators."""
    return [*as_moments(values), *extras(values)]


def l2_norm(t: torch.Tensor, *, use_kernel: bool | None = None) -> Vector:
    """``t``'s L2 norm as a one-element vector, summed in ``device_float``, with no host synchronisation.

    A dense CPU tensor the C kernel reads (float32, bfloat16, float16) gives the square root of the
    kernel's float64 sum of squares, a host tuple: one read of ``t``. ``torch.linalg.vector_norm(t,
    dtype=float64)`` would first write a float64 copy of it (a watch takes the norm of every parameter
    and every update at each logged step: that copy was ~9% of a GPT-style training step). Anything
    else, and a tensor holding NaN/Inf, goes to ``vector_norm`` on its device. ``use_kernel``: whether the
    kernel may be used (default: where it is built and not switched off; ``engine.reduction.norms``
    passes its backend's choice).
    """
    x = t.detach()
    name = _KERNEL_DTYPES.get(x.dtype) if (kernel_available() if use_kernel is None else use_kernel) else None
    if (name is not None and type(x) is torch.Tensor and x.is_cpu and x.layout == torch.strided
            and x.is_contiguous() and not x.is_neg() and x.numel()):
        sum_of_squares = _fastreduce.reduce(kernel_buffer(x), name, torch.get_num_threads())[1]
        if math.isfinite(sum_of_squares):
            return (math.sqrt(sum_of_squares),)  # type: ignore[return-value]  # a host value, as to_host takes
    return torch.linalg.vector_norm(x, dtype=device_float(x.device)).reshape(1)


#: The buckets of a ``histogram`` (TensorBoard's histograms of hookcli.watch's parameters).
HISTOGRAM_BINS = 30


def histogram(t: torch.Tensor, bins: int = HISTOGRAM_BINS, bounds: tuple[float, float] | None = None
              ) -> torch.Tensor | None:
    """``[min, max, count, sum, sum of squares, *bucket counts]`` of a dense tensor's values, on its device
    (no transfer): ``bins`` equal buckets from min to max, the last one closed (``torch.histc``'s); when
    min and max are equal (a constant tensor: a norm's weight at init), from min - 1 to max + 1 as
    ``torch.histc`` widens them, the values in the middle bucket (``records.Histogram`` has the edges). Its
    min or max is not finite when a value is not (the buckets are then meaningless). ``bounds``: the
    buckets' ``(min, max)`` instead of ``t``'s own (a histogram over several ranks' parts, whose
    counts add up: ``engine.rank_stats.global_histograms``; ``t``'s values lie within them). None for
    an empty or non-strided tensor."""
    if t.numel() == 0 or t.layout != torch.strided or t.is_nested or not t.is_floating_point():
        return None
    wide = device_float(t.device)
    x = t.detach().reshape(-1)
    x = x if x.dtype in (torch.float32, torch.float64) else x.float()
    if bounds is None:
        lo, hi = torch.aminmax(x)
    else:
        lo, hi = (torch.tensor(b, dtype=wide, device=x.device) for b in bounds)
    flat = hi == lo  # torch.histc's widening: the buckets span lo - 1 to hi + 1
    left = torch.where(flat, lo - 1, lo)
    span = torch.where(flat, torch.full_like(hi, 2.0), hi - lo)
    scaled = (x - left).div_(torch.where(span > 0, span, torch.ones_like(span))).mul_(bins)
    index = scaled.nan_to_num_(0.0).clamp_(0, bins - 1).long()  # truncation is floor: scaled >= 0
    ones = torch.ones(1, dtype=wide, device=x.device).expand(x.numel())
    counts = torch.zeros(bins, dtype=wide, device=x.device).index_add_(0, index, ones)
    head = torch.stack([lo.to(wide), hi.to(wide), torch.tensor(x.numel(), dtype=wide, device=x.device),
                        x.sum(dtype=wide), torch.linalg.vector_norm(x, dtype=wide).square()])
    return torch.cat([head, counts])


def device_float(device: torch.device) -> torch.dtype:
    """The widest float a device reduces in: float64, except on Apple's MPS, which has none."""
    return torch.float32 if device.type == "mps" else torch.float64


def unbroadcast(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(base, repeats)``: ``x`` with every stride-0 (expanded) dimension cut to size 1, a view, and
    how many times ``x`` repeats each of its values. Mean, std, min and max of ``x`` are those of
    ``base``; counts are ``repeats`` times ``base``'s. ``x`` must not be empty."""
    strides = x.stride()
    if 0 not in strides:
        return x, 1
    base = x.as_strided([1 if st == 0 else size for size, st in zip(x.shape, strides)], strides)
    return base, x.numel() // base.numel()


def dense_view(x: torch.Tensor) -> torch.Tensor | None:
    """``x``'s values as a 1-D view with stride 1, or None when they are not one dense block of memory.

    Dense in any dimension order counts (contiguous, channels-last, transposed, permuted): every
    statistic is independent of element order, so such a tensor is reduced in memory order instead of
    being copied into the logical one. Stride-0, overlapping and stepped views are not dense.
    """
    if x.is_contiguous():
        return x.view(-1)
    dims = sorted((stride, size) for size, stride in zip(x.shape, x.stride()) if size != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return None
        expected *= size
    return x.as_strided((x.numel(),), (1,))  # at x's storage offset; x covers exactly these elements


def flat_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 1-D tensor: a stride-1 view when its memory is dense (``dense_view``), else
    ``reshape(-1)``, which may still be a *strided* view (a stepped slice of a 1-D tensor, an expanded
    one): only the torch reductions may read that; the C kernel takes stride-1 tensors only."""
    view = dense_view(x)
    return x.reshape(-1) if view is None else view


def kernel_buffer(flat: torch.Tensor) -> Any:
    """A dense 1-D CPU tensor's memory as a buffer-protocol object (a NumPy array sharing it, no copy)
    for the C kernel. bfloat16 has no buffer format: its 16-bit patterns go as int16."""
    return (flat.view(torch.int16) if flat.dtype == torch.bfloat16 else flat).numpy()


def reduce_tensor(t: torch.Tensor, *, zeros: bool = True) -> Vector:
    """Statistics vector of one tensor (a one-off ``Reducer``); see ``Reducer.reduce``."""
    return Reducer().reduce(t, zeros=zeros)


def summary(values: Sequence[float]) -> tuple[float, float, float, float, float]:
    """``(mean, std, min, max, kurtosis)`` of a host vector (``Moments`` layout), as reports show them
    (``records.statistics.Summary`` says what they are)."""
    return table.summary(as_moments(values)._asdict())


def activation_stats(values: Sequence[float]) -> dict[str, float | int | None]:
    """Turn a host copy of ``Reducer.reduce``'s vector into the activation stats dict (the table's
    ``ACTIVATION`` statistics: the table's columns, then JSON-only extras)."""
    return table.stats_dict(host_row(values), table.ACTIVATION)


def gradient_stats(values: Sequence[float], *, abs_max: bool = False) -> dict[str, float | int | None]:
    """Turn a host copy of ``Reducer.reduce``'s vector into the gradient stats dict: a layer output's
    (``GRADIENT``), or with ``abs_max`` a parameter's (``PARAM_GRADIENT``)."""
    return table.stats_dict(host_row(values), table.PARAM_GRADIENT if abs_max else table.GRADIENT)


def watch_stats(values: Sequence[float]) -> dict[str, float | int | None]:
    """A host vector as ``hookcli.watch`` logs it, activations and gradients alike (``WATCH``)."""
    return table.stats_dict(host_row(values), table.WATCH, missing=math.nan)


class Transfer:
    """Small result vectors gathered for one host transfer: ``slot(vector)`` is the vector's index in it
    (None for None); ``run()`` makes the transfer (``to_host``); then ``row(index)`` is a slot's host
    values (None for None) and ``values`` every slot's."""

    def __init__(self) -> None:
        self.vectors: list[Vector] = []
        self.values: list[list[float]] = []

    def slot(self, vector: Vector | None) -> int | None:
        if vector is None:
            return None
        self.vectors.append(vector)
        return len(self.vectors) - 1

    def run(self) -> list[list[float]]:
        self.values = to_host(self.vectors)
        return self.values

    def row(self, index: int | None) -> list[float] | None:
        return self.values[index] if index is not None else None


def to_host(vectors: Sequence[Vector]) -> list[list[float]]:
    """Host values of many small result vectors of any lengths, with one transfer per device.

    Tuples are host values already; tensors are grouped by device, widened to ``device_float``,
    padded to the group's longest, stacked, copied in one go and trimmed back.
    """
    out: list[list[float]] = [[] for _ in vectors]
    by_device: dict[torch.device, list[int]] = {}
    for index, vec in enumerate(vectors):
        if isinstance(vec, tuple):
            out[index] = list(vec)
        else:
            by_device.setdefault(vec.device, []).append(index)
    for device, indices in by_device.items():
        wide = device_float(device)
        flat = [vectors[i].reshape(-1).to(wide) for i in indices]  # type: ignore[union-attr]
        width = max(v.numel() for v in flat)
        padded = [v if v.numel() == width else torch.nn.functional.pad(v, (0, width - v.numel())) for v in flat]
        rows = torch.stack(padded).cpu().double().tolist()
        for i, row, v in zip(indices, rows, flat):
            out[i] = row[: v.numel()]
    return out


def iter_tensors(obj: Any, path: str = "", _level: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(path, tensor)`` for every tensor inside a module output or input.

    Paths: ``""`` for a plain tensor, ``[0]`` for tuple/list items, ``['out']`` for mapping keys
    (transformers' ``ModelOutput`` too: it is a dict of its non-None fields, ``['logits']``),
    ``.logits`` for namedtuple and (non-mapping) dataclass fields. None and other values are skipped.
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


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """``obj`` with ``fn`` applied to every tensor in its tuples, namedtuples, lists and mappings (a
    mapping comes back as a dict); anything else as it is. Inputs are walked with it (moved, copied,
    made to require grad); outputs are read with ``iter_tensors``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    if isinstance(obj, Mapping):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    return obj


def shape_of(t: torch.Tensor) -> list[int]:
    """The shape as ints; for a nested (ragged) tensor ``[components, ...]`` with -1 where they differ."""
    if t.is_nested:
        sizes = [c.shape for c in t.unbind()]
        if not sizes:
            return [0]
        return [len(sizes)] + [int(d) if all(s[i] == d for s in sizes) else -1 for i, d in enumerate(sizes[0])]
    return list(t.shape)  # torch.Size holds ints (hooks run eagerly, also under torch.compile)


def nested_values(t: torch.Tensor) -> torch.Tensor:
    """Every value of a nested tensor's components, as one 1-D tensor (no padding)."""
    parts = [c.reshape(-1) for c in t.unbind()]
    return torch.cat(parts) if parts else torch.empty(0, dtype=t.dtype, device=t.device)
