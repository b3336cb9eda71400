"""The lean torch reduction (``hookcli.engine.reduce_lean``, for devices without Triton) against plain
float64 torch, and its op count as torch's dispatcher sees it."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from hookcli.engine import stats
from hookcli.engine.reduce_lean import reduce_lean
from hookcli.engine.stats import merge, to_host
from reference import hard_cases, assert_moments_match
from test_stats_properties import FLOATS, planted, tensors

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: How far the centre of the moments may be from the float64 mean, relative to the largest magnitude:
#: the mean rounded to float32 (the working dtype of every dtype but float64).
CENTRE = 2.0 ** -23


def accelerator_vector(flat: torch.Tensor, zeros: bool = True) -> torch.Tensor:
    """The accelerator path of ``engine.stats`` on a 1-D tensor (``device_vector``, the ``device`` backend)."""
    return stats.device_vector(flat, zeros)


def host(t: torch.Tensor, zeros: bool = True) -> list[float]:
    vector = reduce_lean(t, zeros=zeros)
    assert vector.dtype == stats.device_float(vector.device) and vector.shape == (stats.SCALE + 1,)
    return to_host([vector])[0]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_any_tensor_any_layout_equals_float64_torch(data: st.DataObject) -> None:
    """Hypothesis' tensors of ``test_stats_properties`` (every float dtype, zero-size to ~10^5 values, every
    layout models make, NaN/+-Inf/-0.0 planted, offsets and scales from 1e-30 to 1e30)."""
    t = data.draw(tensors()).to(DEVICE)
    zeros = data.draw(st.booleans())
    assert_moments_match(host(t, zeros), t, zeros=zeros, centre_error=CENTRE)


@pytest.mark.parametrize("n", [1, 2, 1000, 1_000_000])
@pytest.mark.parametrize("dtype", FLOATS)
def test_sizes_up_to_a_million_equal_float64_torch(n: int, dtype: torch.dtype) -> None:
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64) * 2 - 1).to(dtype)
    x = x.to(DEVICE)
    assert_moments_match(host(x), x, centre_error=CENTRE)
    assert host(x, zeros=False)[stats.ZEROS] == 0.0


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
def test_extreme_values_denormals_constants_and_nonfinite(dtype: torch.dtype) -> None:
    info = torch.finfo(dtype)
    cases = {
        "near the limit": torch.tensor([info.max, info.max * 0.5, info.max * 0.75, -info.max * 0.25], dtype=dtype),
        **hard_cases(dtype),
        "expanded": torch.tensor([[1.0], [math.nan], [0.0]], dtype=dtype).expand(3, 5),
    }
    for name, x in cases.items():
        x = x.to(DEVICE)
        assert_moments_match(host(x), x, centre_error=CENTRE), name
    assert host(torch.empty(0, 3, device=DEVICE)) == list(stats.empty_vector(torch.device("cpu")))


def test_a_span_beyond_float32_gives_exact_moments_where_the_device_has_float64() -> None:
    """Values near float32's limit of both signs: x - mean overflows float32, in ``stats``' accelerator
    path (NaN moments); the lean path centres and raises to powers in float64 where the device has it, so
    its moments equal float64 torch's (on MPS, float32 only, they are infinite)."""
    big = torch.finfo(torch.float32).max
    x = torch.tensor([big, -big, big * 0.5, -big], device=DEVICE)
    accelerator = to_host([accelerator_vector(x)])[0]
    assert not math.isfinite(accelerator[stats.M2])
    assert_moments_match(host(x), x, centre_error=CENTRE)


def test_layouts_transposed_channels_last_expanded_sliced() -> None:
    g = torch.Generator().manual_seed(1)
    base = torch.randn(8, 16, 12, 12, generator=g) + 3
    for t in (base.transpose(1, 3), base.contiguous(memory_format=torch.channels_last), base.permute(3, 1, 0, 2),
              base[:, :, ::2], base[:, :1].expand(8, 40, 12, 12), base.bfloat16().transpose(0, 2),
              torch._neg_view(base)):
        t = t.to(DEVICE)
        assert_moments_match(host(t), t, centre_error=CENTRE)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_merging_two_vectors_equals_the_vector_of_their_concatenation(data: st.DataObject) -> None:
    dtype = data.draw(st.sampled_from(FLOATS))
    a = planted(data.draw, dtype, [data.draw(st.integers(0, 5000))]).to(DEVICE)
    b = planted(data.draw, dtype, [data.draw(st.integers(0, 300))]).to(DEVICE)
    merged = merge(reduce_lean(a), reduce_lean(b))
    assert_moments_match(to_host([merged])[0], torch.cat([a, b]), centre_error=CENTRE, merged=True)


class Ops(TorchDispatchMode):
    """Every op torch dispatches, views apart (they launch nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.compute: list[str] = []
        self.views: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        (self.views if func.is_view else self.compute).append(str(func))
        return func(*args, **(kwargs or {}))


#: The most torch ops (views apart: they launch nothing) the lean path may take per tensor.
MOST_OPS = 12


@pytest.mark.parametrize("dtype", FLOATS)
def test_op_count_per_tensor(dtype: torch.dtype) -> None:
    """At most 12 compute ops per tensor, every dtype (the widening of float16/bfloat16 included) and every
    layout (contiguous, channels-last, transposed, expanded, sliced with gaps, in memory order or not, 0-d), where the accelerator
    path of ``engine.stats`` takes 71 ops in all; views are counted apart and stay few."""
    base = torch.randn(4, 6, 5, 5)
    for t in (torch.randn(64, 33), base.contiguous(memory_format=torch.channels_last), base.transpose(1, 3),
              torch.randn(7, 1).expand(7, 9), base[:, :, ::2], base.transpose(1, 3)[:, ::2], torch.tensor(2.5)):
        t = t.to(dtype=dtype, device=DEVICE)
        reduce_lean(t)  # the constants are built (and cached) once per device and size
        with Ops() as ops:
            reduce_lean(t)
        assert len(ops.compute) <= MOST_OPS, ops.compute
        assert len(ops.views) <= 24, ops.views
    x = torch.randn(64, 33, device=DEVICE)
    with Ops() as before:
        accelerator_vector(x.view(-1))
    assert len(before.compute) + len(before.views) >= 60, before.compute


def test_a_vector_does_not_change_when_the_next_tensor_is_reduced() -> None:
    """The ops write into one scratch vector per device and thread; each returned vector is the last op's
    own, so reducing another tensor (of another size, on another thread) leaves it as it was."""
    import threading

    a, b = torch.randn(300, device=DEVICE) + 5, torch.tensor([math.nan, -1.0, math.inf], device=DEVICE)
    first = reduce_lean(a)
    kept = first.clone()
    reduce_lean(b)
    worker = threading.Thread(target=lambda: reduce_lean(b * 3))
    worker.start()
    worker.join()
    assert torch.equal(first, kept)
    assert_moments_match(to_host([first])[0], a, centre_error=CENTRE)
    assert_moments_match(host(b), b, centre_error=CENTRE)
