"""The numbers of ``hookcli diff``: default tolerances, run A's disk-backed store, and the comparison.

``compare`` reduces two tensors to six numbers on the device (no host sync); ``errors_from`` turns
them into the reported errors on the host. Nothing here runs a model.
"""

from __future__ import annotations

import math
import os
import tempfile
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy
import torch

from hookcli.errors import InternalError, OutputError
from hookcli.records import Errors, Tolerance

Key = tuple[str, int, str]  # (module name, call index, output path)

class Limits(NamedTuple):
    """One dtype's default limits (None: that metric is not checked): elementwise ``rtol``/``atol``
    (``|a - b| <= atol + rtol |a|``), ``rel_l2`` (``||a - b|| / ||a||``) and ``cosine_distance`` (1 - cos)."""

    rtol: float | None
    atol: float | None
    rel_l2: float | None = None
    cosine_distance: float | None = None


#: bfloat16's limits: twice the largest error measured on 35 healthy random-init models (every module
#: output; benchmarks/bf16_tolerance.md), rounded up to two digits: rel L2 0.061 and cosine distance
#: 1.8e-3, both in timm's mobilevitv2_050; most models stay below 0.02 and 2e-4.
REL_L2_BF16 = 0.13
COSINE_BF16 = 3.7e-3
#: Default limits by dtype, tightest first: a pair of dtypes gets the later (looser) of its two rows;
#: integer and bool tensors must be equal. float64/float32/float16 are elementwise, looser than
#: torch.testing's per-op defaults because errors add up over layers. bfloat16 (8 significant bits) is
#: judged on the whole tensor: an element near zero after a cancellation carries an error the size of
#: the tensor's, so an elementwise bound either fails healthy models or hides real errors.
DEFAULT_TOLERANCES: dict[str, Limits] = {
    "float64": Limits(1e-7, 1e-7),
    "float32": Limits(1e-5, 1e-5),
    "float16": Limits(1e-2, 1e-3),
    "bfloat16": Limits(None, None, rel_l2=REL_L2_BF16, cosine_distance=COSINE_BF16),
}
#: Any other floating dtype (float8 kinds).
LOOSEST_TOLERANCE = Limits(1e-1, 1e-1)


def _limits(dtype: str) -> tuple[int, Limits]:
    """A floating dtype's row, with its place in the table (any other float comes last)."""
    key = dtype.replace("complex128", "float64").replace("complex64", "float32")
    names = list(DEFAULT_TOLERANCES)
    return (names.index(key), DEFAULT_TOLERANCES[key]) if key in DEFAULT_TOLERANCES else (len(names), LOOSEST_TOLERANCE)


def tolerance_for(a_dtype: str, b_dtype: str, rtol: float | None, atol: float | None) -> Tolerance:
    """The tolerance two tensors are compared with: ``rtol``/``atol`` when either is given (elementwise
    only; the other is the looser elementwise default of the two dtypes, 0 if neither has one), else
    the looser dtype's default limits."""
    floating = [d for d in (a_dtype, b_dtype) if d.startswith(("float", "bfloat", "complex"))]
    if not floating:
        return Tolerance(a_dtype, b_dtype, 0.0, 0.0, "exact")
    ranked = [_limits(d) for d in floating]
    rows = [row for _, row in ranked]
    limits = max(ranked, key=lambda r: r[0])[1]
    if rtol is None and atol is None:
        return Tolerance(a_dtype, b_dtype, limits.rtol, limits.atol, "default", limits.rel_l2, limits.cosine_distance)
    elementwise = [r for r in rows if r.rtol is not None]
    default_rtol = max((r.rtol for r in elementwise), default=0.0)
    default_atol = max((r.atol for r in elementwise), default=0.0)
    return Tolerance(a_dtype, b_dtype, default_rtol if rtol is None else float(rtol),
                     default_atol if atol is None else float(atol), "given")


# --------------------------------------------------------------------------- run A's store


@dataclass(eq=False)
class Stored:
    """One tensor in a DiskStore: where its bytes start in the file, its shape and dtype."""

    offset: int
    shape: list[int]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class SeenTensors:
    """Recognises a tensor seen before: the same object, unchanged since (its version counter).

    A module often returns its last child's output object itself (a Sequential, a residual block
    ending in a ReLU, the model ending in its head): that tensor is then written and compared once.
    Holds weak references only. In-place writes that bypass the version counter (through
    ``.data`` or NumPy) are not seen.
    """

    def __init__(self) -> None:
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], int, Any]] = {}

    def get(self, tensor: torch.Tensor) -> Any:
        """What ``remember`` stored with ``tensor``, or None when it is new or changed since."""
        entry = self._seen.get(id(tensor))
        if entry is None:
            return None
        ref, version, value = entry
        return value if ref() is tensor and _version(tensor) == version else None

    def remember(self, tensor: torch.Tensor, value: Any) -> None:
        version = _version(tensor)
        if version is not None:
            self._seen[id(tensor)] = (weakref.ref(tensor), version, value)


def _version(tensor: torch.Tensor) -> int | None:
    try:
        return int(tensor._version)
    except (RuntimeError, AttributeError):  # an inference tensor has no version counter
        return None


class DiskStore:
    """Tensors kept in one unnamed temporary file, written and read with plain file I/O.

    Holding run A's activations here costs page cache, which the kernel can drop or write out, not
    process memory: nothing is memory-mapped, and reads go through one chunk-sized buffer. The file
    has no name (it is gone even if the process is killed); ``close`` frees it.
    """

    def __init__(self) -> None:
        self.file = tempfile.TemporaryFile(prefix="hookcli-diff-")
        self.size = 0
        self.items: dict[Key, Stored] = {}
        self._seen = SeenTensors()
        self._buffer: torch.Tensor | None = None

    def put(self, name: str, call: int, path: str, tensor: torch.Tensor) -> None:
        """Keep ``tensor`` under (name, call, path): a ``Keep`` tap's function. A tensor seen
        before and unchanged since is not written again."""
        key = (name, call, path)
        item = self._seen.get(tensor)
        if item is None:
            t = plain_tensor(tensor)
            item = Stored(self.size, list(t.shape), t.dtype)
            try:
                for piece in pieces(t, WRITE_CHUNK):
                    raw = memoryview(_bytes_of(piece.cpu()))
                    while raw:
                        written = os.pwrite(self.file.fileno(), raw, self.size)
                        raw = raw[written:]
                        self.size += written
            except OSError as exc:  # the disk is full, or a file size limit
                raise OutputError(
                    f"diff: cannot keep run A's outputs in {tempfile.gettempdir()} ({exc.strerror or exc}; "
                    f"{self.size / 2**20:.0f} MB written)",
                    hint="set TMPDIR to a folder with more room, or select fewer modules (--layers, --types)") from exc
            self._seen.remember(tensor, item)
        self.items[key] = item

    def source(self, item: Stored) -> Source:
        """A reader of ``item``'s values, chunk by chunk (through this store's one buffer)."""
        return _FileSource(self, item)

    def read(self, item: Stored, start: int, count: int) -> torch.Tensor:
        """Elements ``start:start+count`` of ``item`` (flat, row-major) as a 1-D CPU tensor that
        lives in a buffer reused by the next read."""
        size = count * item.dtype.itemsize
        if self._buffer is None or self._buffer.numel() < size:
            self._buffer = torch.empty(max(size, READ_BUFFER), dtype=torch.uint8)
        view = self._buffer[:size]
        raw = memoryview(view.numpy())
        offset, done = item.offset + start * item.dtype.itemsize, 0
        while done < size:
            got = os.preadv(self.file.fileno(), [raw[done:]], offset + done)
            if got <= 0:
                raise InternalError(f"diff store: read {done} of {size} bytes at {offset}")
            done += got
        return view.view(item.dtype)

    def close(self) -> None:
        self.file.close()
        self._buffer = None


def _bytes_of(flat: torch.Tensor) -> Any:
    """A dense 1-D CPU tensor's memory as a buffer-protocol object (no copy)."""
    return flat.view(torch.uint8).numpy()


def pieces(t: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    """``t``'s elements in row-major order as 1-D contiguous tensors of at most ``limit`` elements:
    views where ``t`` is contiguous, copies of at most ``limit`` elements where it is not (so a
    transposed or channels-last tensor never costs a copy of itself)."""
    if t.is_contiguous():
        flat = t.reshape(-1)
        for start in range(0, flat.numel(), limit):
            yield flat[start:start + limit]
    elif t.dim() <= 1:
        for start in range(0, t.numel(), limit):
            yield t[start:start + limit].contiguous()
    elif t.numel():
        row = t[0].numel()
        if row <= limit:
            step = limit // row
            for start in range(0, t.shape[0], step):
                yield t[start:start + step].contiguous().view(-1)
        else:
            for i in range(t.shape[0]):
                yield from pieces(t[i], limit)


def plain_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A detached dense real tensor: quantized ones dequantized, complex ones as (..., 2) real, a lazy
    negation resolved (its memory is then read as it is)."""
    t = tensor.detach()
    if t.is_quantized:
        t = t.dequantize()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    return t.resolve_neg()


# --------------------------------------------------------------------------- comparing


#: Elements per chunk where the comparison runs in float64: 2 MB working copies.
CHUNK = 1 << 18
#: Elements per chunk of the CPU float32 path: 128 KB working copies, which stay in cache.
FAST_CHUNK = 1 << 15
#: Elements per write of a tensor that has to be copied first (on another device, or not contiguous).
WRITE_CHUNK = 1 << 20
#: Bytes of the store's read buffer: the largest chunk of the widest dtype.
READ_BUFFER = CHUNK * 8
#: The dtypes the CPU path compares in float32: each converts to it exactly.
FAST_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: A float32 sum of squares below this may have lost terms to underflow (a term loses at most
#: 2**-126, a chunk has at most 2**15 of them): that chunk is compared again in float64.
_TINY = 2.0 ** -80


class Source(Protocol):
    """Run A's values of one tensor, read flat (row-major) a chunk at a time."""

    dtype: torch.dtype
    numel: int

    def read(self, start: int, count: int) -> torch.Tensor:
        """Elements ``start:start+count`` as a 1-D tensor, valid until the next read."""
        ...


class _TensorSource:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.flat = tensor.detach().reshape(-1)
        self.dtype, self.numel = tensor.dtype, tensor.numel()

    def read(self, start: int, count: int) -> torch.Tensor:
        return self.flat[start:start + count]


class _FileSource:
    def __init__(self, store: DiskStore, item: Stored) -> None:
        self.store, self.item = store, item
        self.dtype, self.numel = item.dtype, item.numel

    def read(self, start: int, count: int) -> torch.Tensor:
        return self.store.read(self.item, start, count)


def compare(a: torch.Tensor | Source, b: torch.Tensor, rtol: float, atol: float = 0.0, *,
            chunk: int | None = None) -> torch.Tensor:
    """Six float64 numbers on ``b``'s device: max|a-b|, ||a||^2, ||b||^2, ||a-b||^2, <a,b>, and an
    excess that is <= ``atol`` exactly when every element is within tolerance (equal, or
    |a-b| <= atol + rtol |a|; the excess is max(|a-b| - rtol |a|) where it matters).

    ``a`` is a tensor or a ``Source`` (run A's stored values) with ``b``'s number of elements, read
    in ``b``'s row-major order. Equal values (also equal infinities, and NaN against NaN) differ by 0.
    Nothing activation-sized is allocated: ``b`` is walked in chunks (``pieces``).

    - On the CPU with both sides float32, float16 or bfloat16: in float32, ``FAST_CHUNK`` elements
      at a time. A chunk equal in both runs costs an equality test and one sum of squares; any other
      a difference and four sums of products (float32 cascade sums, each chunk's added in float64).
      A chunk whose float32 numbers could be off (NaN, infinity or overflow; sums so small that
      terms may have underflowed) is compared again in float64, and so is the tolerance check where
      a difference exceeds ``atol``. It reads each chunk's numbers on the host (no cost on the CPU).
    - Otherwise (float64 or integer values, another device): ``CHUNK`` elements at a time in float64
      (float32 on MPS, which has none), on ``b``'s device; the host waits only for copying run A's
      chunks there. Cosine near 1 needs the precision.
    """
    b = plain_tensor(b)
    source: Source = _TensorSource(plain_tensor(a).to(b.device)) if isinstance(a, torch.Tensor) else a
    if source.numel != b.numel():
        raise InternalError(f"diff: comparing {source.numel} elements with {b.numel()}")
    if b.device.type == "cpu" and source.dtype in FAST_DTYPES and b.dtype in FAST_DTYPES:
        return _compare_float32(source, b, rtol, atol, chunk or FAST_CHUNK)
    return _compare_exact(source, b, rtol, chunk or CHUNK)


def _compare_exact(source: Source, b: torch.Tensor, rtol: float, chunk: int) -> torch.Tensor:
    ct = torch.float32 if b.device.type == "mps" else torch.float64
    parts, start = [], 0
    for y in pieces(b, chunk):
        x = source.read(start, y.numel()).to(device=b.device, dtype=ct)
        start += y.numel()
        parts.append(_exact_chunk(x, y.to(ct), rtol))
    if not parts:
        return torch.zeros(6, dtype=torch.float64, device=b.device)
    acc = torch.stack(parts)
    return torch.cat([acc[:, 0].amax().reshape(1), acc[:, 1:5].sum(0), acc[:, 5].amax().reshape(1)]).to(torch.float64)


def _exact_chunk(x: torch.Tensor, y: torch.Tensor, rtol: float) -> torch.Tensor:
    """``compare``'s six numbers for one chunk, in ``x``'s dtype (never written: it may be the
    caller's own tensor)."""
    same = x == y  # also equal infinities, whose difference is NaN
    same |= x.isnan() & y.isnan()
    d = torch.where(same, 0.0, x - y)
    sums = [torch.dot(x, x), torch.dot(y, y), torch.dot(d, d), torch.dot(x, y)]
    d.abs_()
    max_abs = d.amax()
    if rtol:
        d.sub_(x.abs(), alpha=rtol)
        d.masked_fill_(same, 0.0)  # equal is within, also NaN against NaN (NaN - rtol |NaN| is not)
    return torch.stack([max_abs, *sums, d.amax() if rtol else max_abs])


def _compare_float32(source: Source, b: torch.Tensor, rtol: float, atol: float, chunk: int) -> torch.Tensor:
    f32 = torch.float32
    size = min(chunk, b.numel())
    xbuf, ybuf, dbuf, tbuf = (torch.empty(size, dtype=f32) for _ in range(4))
    rows: list[list[float]] = []
    start = 0
    shortcut = atol * (1 - 2.0 ** -20)  # a float32 max|a-b| up to this is an exact one up to atol
    for y in pieces(b, chunk):
        n = y.numel()
        x = source.read(start, n)
        start += n
        equal = x.dtype == y.dtype and _same_bits(x, y)
        x = x if x.dtype == f32 else xbuf[:n].copy_(x)
        t = tbuf[:n]
        if equal:
            s = torch.mul(x, x, out=t).sum().item()
            if not _TINY <= s < math.inf and (s != 0 or bool(x.any())):
                s = torch.dot(x.double(), x.double()).item()  # overflowed, underflowed, or NaN
            rows.append([0.0, s, s, 0.0, s, 0.0])
            continue
        y = y if y.dtype == f32 else ybuf[:n].copy_(y)
        d = torch.sub(x, y, out=dbuf[:n])
        row = torch.stack([torch.mul(x, x, out=t).sum(), torch.mul(y, y, out=t).sum(), torch.mul(d, d, out=t).sum(),
                           torch.mul(x, y, out=t).sum(), d.amax(), d.amin()]).tolist()
        sx, sy, sd, sxy, high, low = row
        max_abs = max(high, -low)
        if not (all(math.isfinite(v) for v in row) and sx >= _TINY and sy >= _TINY and (sd >= _TINY or max_abs == 0)):
            rows.append(_exact_chunk(x.double(), y.double(), rtol).tolist())
            continue
        excess = max_abs
        if max_abs > shortcut:  # the tolerance check, and max|a-b|, in float64
            x64 = x.double()
            e = x64.sub(y.double()).abs_()
            max_abs = e.amax().item()
            excess = e.sub_(x64.abs_(), alpha=rtol).amax().item() if rtol else max_abs
        rows.append([max_abs, sx, sy, sd, sxy, excess])
    if not rows:
        return torch.zeros(6, dtype=torch.float64)
    cols = list(zip(*rows))
    return torch.tensor([_max(cols[0]), *(sum(c) for c in cols[1:5]), _max(cols[5])], dtype=torch.float64)


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether two dense 1-D CPU tensors of one dtype hold the same bytes (faster than torch.equal;
    also NaN against the same NaN, as ``compare`` counts it; not -0.0 against 0.0, which then take
    the path that finds them equal)."""
    xb, yb = _bytes_of(x), _bytes_of(y)
    if xb.size % 8 == 0:
        xb, yb = xb.view(numpy.uint64), yb.view(numpy.uint64)
    return bool(numpy.array_equal(xb, yb))


def _max(values: Sequence[float]) -> float:
    """The largest value, NaN if any is NaN (as torch's amax)."""
    return math.nan if any(math.isnan(v) for v in values) else max(values)


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


__all__ = ["CHUNK", "DEFAULT_TOLERANCES", "FAST_CHUNK", "DiskStore", "Key", "SeenTensors", "Source", "Stored", "compare",
           "errors_from", "pieces", "plain_tensor", "tolerance_for"]
