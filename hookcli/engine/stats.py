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
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from hookcli.engine import kernel
from hookcli.records import GRAD_KEYS, STAT_KEYS

#: The optional one-pass C kernel, or None (imported here, after torch, to share torch's OpenMP).
_fastreduce = kernel.load()

#: The dtypes the C kernel reads in place, by the name it takes.
_KERNEL_DTYPES = ({getattr(torch, name): name for name in _fastreduce.DTYPES} if _fastreduce is not None else {})
#: Order of the values in the vector ``reduce_tensor`` returns.
_VECTOR = ("mean", "std", "min", "max", "zero_count", "nan_count", "inf_count", "numel")
#: A statistics vector: host floats already (CPU), or a float64 tensor on an accelerator, read once at
#: the end of a run (``to_host``). CPU results stay out of torch so a run keeps no small tensors alive.
Vector = torch.Tensor | tuple[float, ...]
_MAX_NESTING = 8


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
    """Reduces tensors to statistics vectors (``_VECTOR`` layout), fast and without host syncs.

    Memory traffic is the cost (a hooked activation is usually no longer in cache), so each path
    reads a tensor as few times as it can and never allocates an activation-sized temporary; the
    slow reductions (Welford ``std_mean``, ``count_nonzero``, bool sums like ``(x == 0).sum()``)
    cost 10-50x a plain sum on CPU and are avoided.

    * CPU, where reading a scalar costs no device synchronisation: float32, bfloat16 and float16
      go through the C kernel ``hookcli.engine._fastreduce`` when it is built: sum, sum of squares (both
      float64), min, max and zero count in one pass, without a widened copy. The kernel gets memory
      only as a buffer-protocol object (``kernel_buffer``) and refuses any that is not one dense
      block of the declared item format; this side hands it only stride-1 views of tensors that are
      dense in some dimension order (``dense_view``). Other layouts (stepped slices, overlapping
      views) are copied by ``reshape`` or read by the torch reductions, which follow strides.
      Without the kernel (and for float64), ``sum``, ``aminmax`` and ``dot`` take three passes and
      zeros are counted in cache-sized chunks, only when ``min <= 0 <= max``; a tensor of at most
      ``SMALL`` values goes to numpy instead (float64 sums, exact zero count), where torch's per-op
      dispatch would cost more than the reading. Either way NaN/Inf
      are counted only when a sum is not finite (a sum is finite exactly when the tensor holds
      neither: both propagate), and the exact centred two-pass variance runs only where
      ``E[x^2] - mean^2`` would lose digits (a large offset).
    * Other devices: one branch-free path (centred variance of data scaled into [-1, 1], all counts)
      through a reusable scratch buffer, so nothing waits for the device.

    A tensor seen again unchanged (same object and version: a Bottleneck's output *is* its last
    ReLU's output, a Sequential's *is* its last child's) reuses its vector. The one change this cannot
    see is an in-place write through ``.data`` (which has a version counter of its own): a parent
    returning its child's output after ``y.data.mul_(2)`` shows the child's statistics. An expanded tensor
    (stride 0: a broadcast mask, the gradient of ``sum``) is reduced without its repeats.
    """

    CHUNK = 1 << 20  # elements per counting pass on CPU: 4 MB of float32, stays in cache
    #: up to this many elements, CPU tensors the kernel does not read are reduced with numpy (``_small_passes``)
    SMALL = 1 << 15
    #: two-pass variance when mean^2 > RATIO * var: float64 sums of squares keep ~10 more digits
    OFFSET_RATIO_FLOAT64 = 1e3
    OFFSET_RATIO_FLOAT32 = 4.0

    def __init__(self, *, kernel: bool | None = None) -> None:
        """``kernel``: use the C kernel on CPU (default: where it is built and not switched off)."""
        self.kernel = kernel_available() if kernel is None else kernel
        if self.kernel and _fastreduce is None:
            raise RuntimeError("hookcli.engine._fastreduce is not built (a C compiler was missing at install time)")
        self.threads = torch.get_num_threads()
        #: dtype -> the name the kernel reads it by; empty when the kernel is not used
        self._kernel_dtypes = _KERNEL_DTYPES if self.kernel else {}
        self._scratch: dict[torch.device, torch.Tensor] = {}
        self._seen: dict[tuple[int, int, bool], tuple[weakref.ref[torch.Tensor], Vector]] = {}

    def clear(self) -> None:
        """Forget every tensor seen and free the scratch buffers: a long-lived hook set calls this at
        each step boundary, so neither grows with the steps nor keeps an activation-sized buffer."""
        self._seen.clear()
        self._scratch.clear()

    def scratch(self, like: torch.Tensor, numel: int | None = None) -> torch.Tensor:
        """A float32 buffer of ``numel`` (default ``like.numel()``) elements on ``like``'s device, reused."""
        size = like.numel() if numel is None else numel
        buf = self._scratch.get(like.device)
        if buf is None or buf.numel() < size:
            buf = torch.empty(size, dtype=torch.float32, device=like.device)
            self._scratch[like.device] = buf
        return buf[:size]

    def reduce(self, t: torch.Tensor, *, zeros: bool = True) -> Vector:
        """``t``'s statistics vector: host floats for a CPU tensor, else a tensor on ``t``'s device."""
        try:
            key: tuple[int, int, bool] | None = (id(t), t._version, zeros)
        except RuntimeError:  # an inference tensor keeps no version counter: never reused
            key = None
        hit = self._seen.get(key) if key is not None else None
        if hit is not None and hit[0]() is t:
            return hit[1]
        x = t.detach() if t.requires_grad else t
        kernel_dtype = self._kernel_dtypes.get(x.dtype)
        if (kernel_dtype is not None and type(x) is torch.Tensor and x.is_cpu and x.layout == torch.strided
                and not x.is_nested and x.is_contiguous() and not x.is_neg() and (n := x.numel())):
            # the common case (a dense CPU activation), without the general path's views: the kernel
            # takes the tensor's memory as one C-contiguous buffer of any rank
            total, squares, lo, hi, zero_count = _fastreduce.reduce(kernel_buffer(x), kernel_dtype, self.threads)
            mean = total / n
            var = squares / n - mean * mean
            vector: Vector
            if 0.0 <= var and mean * mean <= self.OFFSET_RATIO_FLOAT64 * var:
                # finite (a NaN or Inf makes the sum NaN or infinite, and var NaN) and well conditioned:
                # what _finish computes, without its rare branches
                vector = (mean, math.sqrt(var), lo, hi, float(zero_count) if zeros else 0.0, 0.0, 0.0, float(n))
            else:
                vector = self._finish(x, (total, squares, lo, hi, zero_count, self.OFFSET_RATIO_FLOAT64), zeros)
            self._remember(key, t, vector)
            return vector
        if x.is_nested:  # a nested (ragged) tensor: statistics of its components' values
            x = nested_values(x)
        if x.layout != torch.strided:
            x = x.to_dense()  # a sparse output: statistics of its dense values, zeros included
        n = x.numel()
        if n == 0 and x.device.type == "cpu":
            vector = (math.nan,) * 4 + (0.0,) * 4
        elif n == 0:
            # filled on the device (torch.tensor(list, device=...) would copy from the host and sync)
            vector = torch.full((len(_VECTOR),), math.nan, dtype=device_float(x.device), device=x.device)
            vector[4:] = 0.0
        elif x.device.type == "cpu":
            vector = self._reduce_host(x, zeros)
        else:
            vector = self._reduce_accelerator(x, zeros)
        self._remember(key, t, vector)
        return vector

    def _remember(self, key: tuple[int, int, bool] | None, t: torch.Tensor, vector: Vector) -> None:
        """Keep ``t``'s vector for its next sighting unchanged (same object and version)."""
        try:
            if key is not None:
                self._seen[key] = (weakref.ref(t), vector)
        except TypeError:  # tensor subclasses without weakref support
            pass

    # An expanded (stride-0) tensor repeats each value of a smaller one equally often: both paths reduce
    # that one (``unbroadcast``), without materialising the repeats, and scale the counts.
    def _reduce_host(self, x: torch.Tensor, zeros: bool) -> tuple[float, ...]:
        """The vector of a non-empty, strided CPU tensor, as host floats."""
        x, repeats = unbroadcast(x)
        flat = flat_view(x)
        if flat.dtype not in (torch.float32, torch.float64) and not self._kernel_reads(flat):
            flat = flat.float()  # float16/bfloat16 in float32 (the C kernel widens as it reads)
        vector = self._reduce_cpu(flat, zeros)
        if repeats == 1:
            return vector
        return (*vector[:4], *(count * repeats for count in vector[4:7]), vector[7] * repeats)

    def _reduce_accelerator(self, x: torch.Tensor, zeros: bool) -> torch.Tensor:
        """The vector of a non-empty, strided tensor, as a tensor on its device (no host synchronisation)."""
        x, repeats = unbroadcast(x)
        if x.dtype not in (torch.float32, torch.float64):
            x = x.float()
        vector = self._reduce_device(flat_view(x), zeros)
        if repeats != 1:
            vector[4:] *= repeats  # the counts and numel; a Python scalar: no host synchronisation
        return vector

    # -- CPU: cheap passes, exact checks on the host decide what else is needed ---------------------
    def _count(self, flat: torch.Tensor, op: str) -> int:
        """Exact count of zeros / NaNs / Infs, in cache-sized chunks (float32 counts stay exact)."""
        total = 0
        for chunk in flat.split(self.CHUNK):
            buf = self.scratch(chunk, self.CHUNK)[: chunk.numel()]
            if op == "zero":
                torch.eq(chunk, 0, out=buf)
            elif op == "nan":
                torch.ne(chunk, chunk, out=buf)
            else:
                torch.eq(chunk.abs(), math.inf, out=buf)
            total += int(buf.sum())
        return total

    def _exact_moments(self, flat: torch.Tensor, total: float) -> tuple[float, float]:
        """Mean and sum of squared deviations by the corrected two-pass formula, in float64.

        The rare path for ill-conditioned data (a large offset, where ``E[x^2] - mean^2`` cancels):
        one more pass sums ``d = x - shift`` and ``d^2`` around ``shift = total / n`` (the first
        pass's mean), and ``sum(d^2) - sum(d)^2 / n`` removes what the shift's own error adds, so a
        float32 first-pass sum is good enough as the shift. The C kernel does that pass where it
        reads the tensor (tiny squeeze-and-excite gates near 0.5 take this path on every call), torch
        in float64 chunks elsewhere.
        """
        n = flat.numel()
        shift = total / n
        if not math.isfinite(shift):  # a float32 first-pass sum overflowed: the mean in float64 first
            shift = sum(float(c.sum(dtype=torch.float64)) for c in flat.split(self.CHUNK)) / n
        if self._kernel_reads(flat):
            s1, s2 = _fastreduce.centred(kernel_buffer(flat), dtype_name(flat.dtype), self.threads, shift)
        elif n <= self.SMALL and type(flat) is torch.Tensor:
            with np.errstate(all="ignore"):
                centred = flat.resolve_neg().numpy().astype(np.float64) - shift
                s1 = float(np.add.reduce(centred))
                s2 = float(np.add.reduce(np.multiply(centred, centred, out=centred)))  # (no BLAS: see above)
        else:
            s1 = s2 = 0.0
            for chunk in flat.split(self.CHUNK):
                centred = chunk.double() - shift
                s1 += float(centred.sum())
                s2 += float(torch.dot(centred, centred))
        return shift + s1 / n, s2 - s1 * s1 / n

    def _kernel_reads(self, flat: torch.Tensor) -> bool:
        """Whether the C kernel takes ``flat`` (a 1-D CPU tensor): a plain tensor of its dtypes whose
        memory is exactly its values, one dense block (stride 1, no lazy negation bit: a negative
        view's memory holds ``-x``). The kernel checks the layout again where it reads."""
        return (self.kernel and type(flat) is torch.Tensor and dtype_name(flat.dtype) in _fastreduce.DTYPES
                and flat.dim() == 1 and flat.is_contiguous() and not flat.is_neg())

    def _cpu_passes(self, flat: torch.Tensor) -> tuple[float, float, float, float, int | None, float]:
        """``(sum, sum of squares, min, max, zero count or None, offset ratio)`` of a 1-D tensor.

        min/max may ignore NaN here (the caller counts NaN when the sum is not finite); a zero count
        of None means "not counted yet".
        """
        if self._kernel_reads(flat):
            total, squares, lo, hi, zero_count = _fastreduce.reduce(kernel_buffer(flat), dtype_name(flat.dtype),
                                                                    self.threads)
            return total, squares, lo, hi, zero_count, self.OFFSET_RATIO_FLOAT64
        if flat.dtype not in (torch.float32, torch.float64):
            flat = flat.float()
        if flat.numel() <= self.SMALL and type(flat) is torch.Tensor:
            return self._small_passes(flat)
        total = float(flat.sum())
        lo_t, hi_t = torch.aminmax(flat)
        squares = float(torch.dot(flat, flat))
        ratio = self.OFFSET_RATIO_FLOAT32 if flat.dtype == torch.float32 else self.OFFSET_RATIO_FLOAT64
        lo, hi = float(lo_t), float(hi_t)
        # no zero lies outside [min, max]; a NaN min/max (a NaN is present) fails both tests
        zero_count = 0 if lo > 0.0 or hi < 0.0 else None
        return total, squares, lo, hi, zero_count, ratio

    def _small_passes(self, flat: torch.Tensor) -> tuple[float, float, float, float, int, float]:
        """``_cpu_passes`` of a small float32/float64 tensor without the kernel: numpy's reductions in
        float64 (sums), where torch's cost ~5-10 us of dispatch each on a few thousand values (43 us per
        tensor in all against 7 us here). The zero count is exact (NaN is not zero)."""
        values = flat.resolve_neg().numpy()
        wide = values.astype(np.float64, copy=False)
        zero_count = values.size - int(np.count_nonzero(values))
        with np.errstate(all="ignore"):  # inf + -inf is NaN here as in torch, not a warning to the user
            # ufuncs only, never np.dot: numpy's BLAS starts threads of its own, which then spin against
            # torch's on the same cores (a 12x slower forward of mobilenet_v3_small, measured)
            return (float(np.add.reduce(wide)), float(np.add.reduce(np.multiply(wide, wide))),
                    float(np.minimum.reduce(values)), float(np.maximum.reduce(values)), zero_count,
                    self.OFFSET_RATIO_FLOAT64)

    def _reduce_cpu(self, flat: torch.Tensor, zeros: bool) -> tuple[float, ...]:
        return self._finish(flat, self._cpu_passes(flat), zeros)

    def _finish(self, x: torch.Tensor, passes: tuple[float, float, float, float, int | None, float],
                zeros: bool) -> tuple[float, ...]:
        """The vector from ``_cpu_passes``' numbers for CPU tensor ``x`` (any shape: the rare passes that
        read it again, NaN/Inf/zero counts and the two-pass variance, read it as ``flat_view``)."""
        total, squares, lo, hi, zero_count, ratio = passes
        n = x.numel()
        nan_count = inf_count = 0
        if not (math.isfinite(total) and math.isfinite(squares)):
            nan_count, inf_count = self._count(flat_view(x), "nan"), self._count(flat_view(x), "inf")
        if nan_count:
            lo = hi = math.nan  # as torch.aminmax reports them
        mean = total / n
        if nan_count or inf_count:
            std = math.nan
        else:
            var = squares / n - mean * mean
            # E[x^2] - mean^2 loses digits for offset data, and x^2 can overflow float32: two-pass
            if not math.isfinite(squares) or mean * mean > ratio * max(var, 0.0):
                mean, m2 = self._exact_moments(flat_view(x), total)
                var = m2 / n
            std = math.sqrt(max(var, 0.0))
        if not zeros:
            zero_count = 0
        elif zero_count is None:
            zero_count = self._count(flat_view(x), "zero")
        return (mean, std, lo, hi, float(zero_count), float(nan_count), float(inf_count), float(n))

    # -- accelerators: branch-free, no host synchronisation ---------------------------------------
    def _reduce_device(self, flat: torch.Tensor, zeros: bool, acc: torch.dtype | None = None) -> torch.Tensor:
        """The vector in ``acc`` (default: ``device_float`` of the device), with no host synchronisation."""
        n = flat.numel()
        device = flat.device
        acc = acc or device_float(device)
        mean = flat.sum(dtype=acc) / n  # float64 where it exists: its error would bias the centred variance
        lo, hi = torch.aminmax(flat)
        buf = self.scratch(flat) if flat.dtype == torch.float32 else torch.empty_like(flat)
        # centred values divided by the largest magnitude lie in [-2, 2]: squaring them in float32
        # cannot overflow, whatever the scale of the data (x^2 would above ~1.8e19)
        scale = torch.clamp(torch.maximum(lo.abs(), hi.abs()), min=torch.finfo(flat.dtype).tiny)
        torch.sub(flat, mean, out=buf).div_(scale)
        std = (torch.dot(buf, buf).to(acc) / n).sqrt() * scale.to(acc)  # scale^2 would overflow float32
        # counts summed as int64: a float32 sum of 0/1 values stops being exact above 2^24
        zero_count = torch.eq(flat, 0, out=buf).sum(dtype=torch.int64) if zeros else torch.zeros((), device=device)
        nan_count = torch.ne(flat, flat, out=buf).sum(dtype=torch.int64)
        inf_count = torch.eq(flat.abs(), math.inf, out=buf).sum(dtype=torch.int64)
        numel = torch.full((), n, dtype=torch.int64, device=device)
        parts = (mean, std, lo, hi, zero_count, nan_count, inf_count, numel)
        return torch.stack([p.to(acc) for p in parts])


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


def _norm_of(mean: float, std: float, nan_count: float, inf_count: float, numel: float) -> float:
    """L2 norm from population mean and std: sqrt(n * (std^2 + mean^2)), in float64."""
    if nan_count:
        return math.nan
    if inf_count:
        return math.inf
    if not numel:
        return 0.0  # an empty sum of squares, as torch.linalg.vector_norm of an empty tensor
    return math.sqrt(numel * (std ** 2 + mean ** 2))


def _norm(v: dict[str, float]) -> float:
    """``_norm_of`` a vector as a dict by ``_VECTOR`` names."""
    return _norm_of(v["mean"], v["std"], v["nan_count"], v["inf_count"], v["numel"])


def activation_stats(values: Sequence[float]) -> dict[str, float | int | None]:
    """Turn a host copy of ``reduce_tensor``'s vector into the activation stats dict (``STAT_KEYS``).

    Runs once per reported row: unpacked by position (``_VECTOR``'s order), not through a dict.
    """
    mean, std, lo, hi, zero_count, nan_count, inf_count, numel = values
    return {
        "mean": float(mean),
        "std": float(std),
        "min": float(lo),
        "max": float(hi),
        "norm": _norm_of(mean, std, nan_count, inf_count, numel),
        "zero_fraction": (zero_count / int(numel)) if int(numel) else None,
        "nan_count": int(nan_count),
        "inf_count": int(inf_count),
    }


assert tuple(activation_stats((0.0,) * 7 + (1.0,))) == STAT_KEYS  # one order, by position


def gradient_stats(values: Sequence[float], *, abs_max: bool = False) -> dict[str, float | int | None]:
    """Turn a host copy of ``reduce_tensor``'s vector into the gradient stats dict (``GRAD_KEYS``)."""
    v = dict(zip(_VECTOR, values))
    stats: dict[str, float | int | None] = {key: float(v[key]) for key in ("mean", "std", "min", "max")}
    stats["norm"] = _norm(v)
    stats["nan_count"] = int(v["nan_count"])
    stats["inf_count"] = int(v["inf_count"])
    assert tuple(stats) == GRAD_KEYS
    if abs_max:
        stats["abs_max"] = max(abs(v["min"]), abs(v["max"])) if int(v["numel"]) else None
    return stats


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
