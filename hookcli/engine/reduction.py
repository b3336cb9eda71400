"""The reduction backend: how tensors become statistics vectors, chosen in one place (``choose``).

A backend reduces a tensor to the accumulators of ``records.statistics`` (``engine.stats.Moments``, then
any declared extra one). ``BACKENDS`` holds them by name:

* ``kernel``: CPU tensors, the one-pass C kernel (``engine/_fastreduce.c``) where it reads the dtype,
  else cache-sized torch chunks or numpy (``engine.stats.Reducer``); host ``Moments``, no tensor kept.
* ``torch``: CPU tensors, the same without the kernel (``HOOKCLI_NO_KERNEL=1``, or no C compiler).
* ``device``: any tensor, branch-free torch ops on its own device, no host synchronisation
  (``engine.stats.device_vector``, about 71 torch ops a tensor): a vector tensor in the layout
  ``MEAN .. INFS, SCALE``, read once at the end of a run (``engine.stats.to_host``). The reference of the
  two below; on CPU it is there for tests and debugging.
* ``triton``: the fused Triton kernel (``engine.reduce_triton``): one custom op (one or two kernel
  launches) a tensor, and one for a whole list (a step's gradients); CUDA tensors, or CPU tensors when
  Triton was imported under ``TRITON_INTERPRET=1`` (how CI tests it).
* ``lean``: the same vector in a fixed, small number of torch ops (``engine.reduce_lean``), for
  accelerators without Triton (Apple's MPS, Intel's XPU).

Another device implementation of that layout is one more entry of ``engine.backends.BACKENDS``:
``Backend(name, host=False, vector="module:fn")`` with ``fn(flat, zeros) -> vector`` for a non-empty 1-D
float tensor, and a line in ``choose`` if ``auto`` should pick it.
``HOOKCLI_REDUCTION=auto|kernel|torch|device|triton|lean`` forces one (``auto``, the default: ``kernel``
on CPU where it is built and not switched off, else ``torch``; on accelerators ``triton`` where CUDA and
Triton are here, else ``lean``). A host backend reads CPU memory only: with it forced, an accelerator's
tensors still take ``auto``'s choice; ``name_for`` says which one a run's device used, the ``reduction``
of every JSON report and watch log line.

The public face: ``reduce`` (one tensor), ``reduce_many`` (a step's tensors), ``norms``,
``histograms``, ``extremes`` and ``channel_counts`` (many at once: ``norms`` in one op on an accelerator,
``histograms`` in a fixed number of launches with the ``triton`` backend; the others loop).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hookcli.engine import stats
from hookcli.engine.backends import BACKENDS, REDUCTION_ENV, Backend, choose, name_for
from hookcli.engine.channels import channel_nonzeros

__all__ = ["BACKENDS", "REDUCTION_ENV", "Backend", "channel_counts", "choose", "extremes", "histograms", "name_for",
           "norms", "reduce", "reduce_many"]


def reduce(t: torch.Tensor, *, zeros: bool = True, reducer: stats.Reducer | None = None) -> stats.Vector:
    """``t``'s statistics vector: host ``Moments`` (then extra accumulators) from a host backend, else a
    tensor on ``t``'s device; ``zeros=False`` leaves the zero count at 0. ``reducer``: one that reuses
    what it saw and its scratch buffers over a run (default: a one-off)."""
    return (reducer or stats.Reducer()).reduce(t, zeros=zeros)


def reduce_many(tensors: Sequence[torch.Tensor], *, zeros: bool = True, reducer: stats.Reducer | None = None
                ) -> list[stats.Vector]:
    """Each tensor's vector (``reduce``), e.g. a step's gradients; read them with one ``to_host``."""
    reducer = reducer or stats.Reducer()
    tensors = [t.detach() if t.requires_grad else t for t in tensors]
    if len(tensors) > 1 and reducer.device_backend.name == "triton" and _one_triton_device(tensors):
        from hookcli.engine import reduce_triton

        return list(reduce_triton.reduce_moments_many(list(tensors), zeros).unbind(0))  # one op for all
    return [reducer.reduce(t, zeros=zeros) for t in tensors]


def _one_triton_device(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every tensor is one the fused kernel reads, all on one device (its many-tensor op)."""
    from hookcli.engine import reduce_triton

    device = tensors[0].device
    return all(t.device == device and t.numel() and not t.requires_grad and reduce_triton.available(t)
               for t in tensors)


def norms(tensors: Sequence[torch.Tensor]) -> list[stats.Vector]:
    """Each tensor's L2 norm as a one-element vector (``engine.stats.l2_norm``: the C kernel's float64 sum
    of squares where the ``kernel`` backend reduces CPU tensors, else ``vector_norm`` on the device; for
    several tensors of an accelerator, or of the CPU where the ``triton`` backend runs there under
    Triton's interpreter, one ``torch._foreach_norm``)."""
    if len(tensors) > 1 and all((not t.is_cpu or choose("cpu").name == "triton") and t.layout == torch.strided
                                and t.is_floating_point() and t.device == tensors[0].device for t in tensors):
        # an accelerator's: one multi-tensor op (torch._foreach_norm), not a launch per tensor
        return [n.reshape(1) for n in torch._foreach_norm([t.detach() for t in tensors], 2,
                                                          dtype=stats.device_float(tensors[0].device))]
    use_kernel = choose("cpu").name == "kernel"
    return [stats.l2_norm(t, use_kernel=use_kernel) for t in tensors]


def histograms(tensors: Sequence[torch.Tensor | None], bins: int = stats.HISTOGRAM_BINS,
               bounds: Sequence[tuple[float, float]] | None = None) -> list[torch.Tensor | None]:
    """Each tensor's ``engine.stats.histogram`` vector on its device (None for None, an empty or a
    non-float tensor). ``bounds``: each tensor's buckets' ``(min, max)`` instead of its own (parts whose
    counts add up: ``engine.rank_stats.global_histograms``). Without ``bounds``, where the ``triton``
    backend reduces their device, the float16/bfloat16/float32 tensors of one device take a fixed number
    of launches together (``reduce_triton.histograms``: one counting launch per dtype, whatever their
    number; its sum and sum of squares are float32's); the others one ``stats.histogram`` each."""
    spans: Sequence[tuple[float, float] | None] = bounds if bounds is not None else [None] * len(tensors)
    batched = [bounds is None and t is not None and _batched_histogram(t) for t in tensors]
    out = [stats.histogram(t, bins, span) if t is not None and not together else None
           for t, span, together in zip(tensors, spans, batched)]
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if batched[i]:
            by_device.setdefault(t.device, []).append(i)  # type: ignore[union-attr]
    for batch in by_device.values():
        from hookcli.engine import reduce_triton

        rows = reduce_triton.histograms([tensors[i].detach() for i in batch], bins)  # type: ignore[union-attr]
        for i, row in zip(batch, rows.unbind(0)):
            out[i] = row
    return out


def _batched_histogram(t: torch.Tensor) -> bool:
    """Whether ``t``'s histogram is counted by the Triton kernel with others': the ``triton`` backend
    reduces its device, the kernel reads it, and its buckets are float32's (float64 ones are not)."""
    if not t.numel() or t.dtype == torch.float64 or t.device.type == "meta" or choose(t.device).name != "triton":
        return False
    from hookcli.engine import reduce_triton

    return reduce_triton.available(t)


def extremes(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each non-empty tensor's ``[max, -min]`` on its device, no transfer (MIN as MAX of ``-x``: exact, so
    one MAX merges them over ranks: ``engine.rank_stats.global_histograms``)."""
    out = []
    for t in tensors:
        lo, hi = torch.aminmax(t.detach().reshape(-1))
        out.append(torch.stack([hi, -lo]))
    return out


def channel_counts(tensors: Sequence[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
    """The nonzero values in each channel of each ``(tensor, channel dimension)`` (``channel_nonzeros``)."""
    return [channel_nonzeros(t, dim) for t, dim in tensors]
