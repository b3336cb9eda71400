"""The statistics reducer, branch by branch, against float64 references computed in the test."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch

from hookcli.engine import reduction
from hookcli.engine.kernel import NO_KERNEL_ENV
from hookcli.engine.stats import (
    Reducer,
    _fastreduce,
    activation_stats,
    device_float,
    device_vector,
    flat_view,
    gradient_stats,
    iter_tensors,
    kernel_available,
    to_host,
)
from reference import aten_ops, float64_stats


def seeded(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


#: The CPU statistics paths: the one-pass C kernel, torch reductions, and the accelerator path run on
#: CPU, accumulating in float64 (CUDA) or in float32 (Apple's MPS has no float64).
PATHS = ["kernel", "torch", "device", "device-float32"]
#: Relative tolerance per path: float32 accumulation of a mean loses digits on offset data.
REL = {"kernel": 2e-5, "torch": 2e-5, "device": 2e-5, "device-float32": 2e-4}
needs_kernel = pytest.mark.skipif(_fastreduce is None, reason="hookcli.engine._fastreduce was not built here")


def stats_of(t: torch.Tensor, path: str = "torch") -> dict:
    if path == "kernel" and _fastreduce is None:
        pytest.skip("hookcli.engine._fastreduce was not built here")
    if path == "device":  # the branch-free accelerator path, exercised on CPU tensors
        vec = reduction.reduce(t, reducer=Reducer(backend="device"))
        assert isinstance(vec, torch.Tensor) and vec.dtype == torch.float64
    elif path == "device-float32":  # as on Apple's MPS, which has no float64
        vec = device_vector(t.detach().float().reshape(-1), True, torch.float32)
        assert vec.dtype == torch.float32
    else:
        vec = Reducer(kernel=path == "kernel").reduce(t)
    return activation_stats(to_host([vec])[0])


CASES = {
    "relu": lambda: seeded(4, 64, 30, 30).relu(),
    "gaussian": lambda: seeded(3_000_000) * 0.3 + 0.05,
    "offset (ill-conditioned)": lambda: seeded(100_000) * 0.01 + 1000.0,
    "huge values (x^2 overflows float32)": lambda: seeded(10_000) * 1e20,
    "tiny values (subnormal float32)": lambda: seeded(1_000) * 1e-41,
    "all zero": lambda: torch.zeros(5, 7),
    "one element": lambda: torch.tensor([2.5]),
    "channels-last relu": lambda: seeded(2, 16, 9, 7).relu().to(memory_format=torch.channels_last),
    "transposed (not dense)": lambda: seeded(300, 70).t()[5:],
    "float64": lambda: seeded(10_001).double() * 3 - 1,
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", list(CASES))
def test_statistics_match_float64_float64_stats(name: str, path: str) -> None:
    t = CASES[name]()
    got, exp = stats_of(t, path), float64_stats(t)
    for key in ("mean", "std", "min", "max", "norm", "zero_fraction"):
        assert got[key] == pytest.approx(exp[key], rel=REL[path], abs=1e-9), key
    assert got["nan_count"] == 0 and got["inf_count"] == 0


@pytest.mark.parametrize("path", PATHS)
def test_nan_and_inf_are_counted_exactly(path: str) -> None:
    t = torch.tensor([0.0, 1.0, math.nan, -math.inf, math.inf, 0.0, math.nan, 2.0, math.nan])
    got = stats_of(t, path)
    assert (got["nan_count"], got["inf_count"]) == (3, 2)
    assert got["zero_fraction"] == pytest.approx(2 / 9)
    assert math.isnan(got["mean"]) and math.isnan(got["norm"])
    assert math.isnan(got["min"]) and math.isnan(got["max"])  # as torch.aminmax reports them


@pytest.mark.parametrize("path", PATHS)
def test_zeros_are_counted_with_a_nan_present(path: str) -> None:
    """A NaN makes min/max NaN, so "no zero outside [min, max]" must not skip the count."""
    t = torch.cat([torch.zeros(7), torch.tensor([math.nan]), torch.ones(2)])
    assert stats_of(t, path)["zero_fraction"] == pytest.approx(0.7)


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_inf_without_nan_gives_infinite_norm(path: str) -> None:
    got = stats_of(torch.tensor([1.0, math.inf, 0.0]), path)
    assert got["inf_count"] == 1 and got["nan_count"] == 0 and got["norm"] == math.inf
    assert got["max"] == math.inf and got["min"] == 0.0


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_half_precision_and_empty(path: str) -> None:
    for t in (seeded(1000).half(), seeded(1000).bfloat16()):
        got, exp = stats_of(t, path), float64_stats(t.float())
        assert got["std"] == pytest.approx(exp["std"], rel=1e-5)
        assert got["max"] == exp["max"]
    empty = stats_of(torch.empty(0, 3), path)
    assert empty["zero_fraction"] is None and math.isnan(empty["mean"])


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_lazy_negation_and_sparse_outputs_are_read_as_their_values(path: str) -> None:
    """A tensor's memory is not always its values: a negative view (the lazy ``-x`` that ``conj``
    machinery produces) stores ``x``, and a sparse tensor stores only its non-zeros."""
    values = seeded(1000) + 0.25
    got = stats_of(torch._neg_view(values), path)
    assert got["mean"] == pytest.approx(-float(values.double().mean()), rel=1e-6)
    assert got["max"] == -float(values.min())
    dense = torch.tensor([[0.0, 2.0, 0.0], [0.0, -1.0, 4.0]])
    got = stats_of(dense.to_sparse(), path)
    assert got["zero_fraction"] == pytest.approx(0.5) and got["mean"] == pytest.approx(5 / 6)


# -- the C kernel on its own ---------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("numel", [1, 15, 16, 17, 1000, (1 << 15) - 3, (1 << 16) + 5, 3 * (1 << 16) + 77])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernel_matches_float64_sums_at_every_length_and_thread_count(numel: int, threads: int) -> None:
    """Lengths around the 16-lane blocks and the per-thread minimum; thread ranges must tile exactly."""
    x = seeded(numel) * 2 + 0.5
    x[:: max(numel // 7, 1)] = 0.0  # zeros scattered over every thread's range
    total, squares, cubes, fourths, lo, hi, zeros = _fastreduce.reduce(x.numpy(), "float32", threads)
    d = x.double()
    assert total == pytest.approx(float(d.sum()), rel=1e-12, abs=1e-9)
    assert squares == pytest.approx(float(d.square().sum()), rel=1e-12)
    assert cubes == pytest.approx(float(d.pow(3).sum()), rel=1e-12, abs=1e-9)
    assert fourths == pytest.approx(float(d.pow(4).sum()), rel=1e-12)
    assert (lo, hi) == (float(x.min()), float(x.max()))
    assert zeros == int((x == 0).sum())


@needs_kernel
@pytest.mark.parametrize("numel", [1, 17, 1000, (1 << 16) + 5, 3 * (1 << 16) + 77])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_centred_pass_matches_float64_at_every_length_thread_count_and_dtype(
        numel: int, threads: int, dtype: torch.dtype) -> None:
    """The second pass for offset data: sums of ``d = x - shift``, d^2, d^3, d^4, in float64."""
    x = (seeded(numel) * 0.01 + 300.0).to(dtype)
    shift = 299.99
    d = x.double() - shift
    memory = x.view(torch.int16) if dtype == torch.bfloat16 else x
    total, squares, cubes, fourths = _fastreduce.centred(memory.numpy(), str(dtype).removeprefix("torch."),
                                                         threads, shift)
    assert total == pytest.approx(float(d.sum()), rel=1e-12, abs=1e-12)
    assert squares == pytest.approx(float(d.square().sum()), rel=1e-12)
    assert cubes == pytest.approx(float(d.pow(3).sum()), rel=1e-9, abs=1e-12)
    assert fourths == pytest.approx(float(d.pow(4).sum()), rel=1e-12)


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("numel", [7, 240, 100_000, 300_001])
@pytest.mark.parametrize("offset", [0.5, -1e4, 3e6])
def test_near_constant_data_keeps_its_small_std_to_many_digits(path: str, dtype: torch.dtype, numel: int,
                                                              offset: float) -> None:
    """A large offset over a small spread (a squeeze-and-excite gate near 0.5, a feature with a big
    bias): ``E[x^2] - mean^2`` would cancel every digit of the variance, so the corrected two-pass
    formula runs. Std and mean are checked relative to the std itself, not to the values."""
    spread = abs(offset) * (1e-5 if dtype == torch.float64 else 1e-2)
    t = (seeded(numel).double() * spread + offset).to(dtype)
    d = t.double()
    got = stats_of(t, path)
    std = float(d.std(correction=0))
    assert std > 0
    assert got["std"] == pytest.approx(std, rel=1e-9)
    assert got["mean"] == pytest.approx(float(d.mean()), abs=1e-9 * std)


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_nan_and_inf_in_a_large_tensor_are_counted_across_threads(path: str) -> None:
    """Non-finite values in the second thread's range of a multi-threaded reduction."""
    t = seeded(400_000)
    t[300_001], t[350_000], t[399_999] = math.nan, math.inf, -math.inf
    t[:1000] = 0.0
    got = stats_of(t, path)
    assert (got["nan_count"], got["inf_count"]) == (1, 2)
    assert math.isnan(got["min"]) and math.isnan(got["std"])
    assert got["zero_fraction"] == pytest.approx(float((t == 0).sum()) / t.numel())


@needs_kernel
def test_kernel_reads_only_the_given_range() -> None:
    """A view starts at its storage offset; values around it (here huge ones) must not leak in."""
    base = torch.full((100,), 1e30)
    base[10:60] = torch.arange(50, dtype=torch.float32)
    total, _squares, _cubes, _fourths, lo, hi, zeros = _fastreduce.reduce(base[10:60].numpy(), "float32", 2)
    assert (total, lo, hi, zeros) == (float(sum(range(50))), 0.0, 49.0, 1)


@needs_kernel
def test_kernel_takes_no_address_and_refuses_memory_that_is_not_one_dense_block() -> None:
    """The kernel reads only what a buffer's exporter vouches for: C-contiguous, of the declared
    format, aligned. Every other layout raises before a byte is read."""
    x = torch.arange(12, dtype=torch.float32)
    with pytest.raises(TypeError):  # an integer address is not a buffer
        _fastreduce.reduce(x.data_ptr(), "float32", 1)
    not_dense = {
        "expanded (stride 0)": torch.tensor(4.5).expand(4096),
        "stepped slice": x[::2],
        "transposed": x.reshape(3, 4).t(),
        "expanded rows": x[:4].expand(3, 4),
    }
    for t in not_dense.values():
        with pytest.raises((ValueError, BufferError), match="contiguous"):
            _fastreduce.reduce(t.numpy(), "float32", 1)
        with pytest.raises((ValueError, BufferError), match="contiguous"):  # the second pass: same checks
            _fastreduce.centred(t.numpy(), "float32", 1, 0.0)
    with pytest.raises(ValueError, match="format"):  # float64 memory read as float32
        _fastreduce.reduce(x.double().numpy(), "float32", 1)
    with pytest.raises(ValueError, match="format"):  # float32 memory read as bfloat16
        _fastreduce.reduce(x.numpy(), "bfloat16", 1)
    with pytest.raises(ValueError, match="format"):  # bytes are no float32 values
        _fastreduce.reduce(b"\0" * 16, "float32", 1)
    with pytest.raises(ValueError, match="aligned"):
        _fastreduce.reduce(np.zeros(9, dtype=np.uint8)[1:].view(np.float32), "float32", 1)
    with pytest.raises(ValueError, match="aligned"):
        _fastreduce.centred(np.zeros(9, dtype=np.uint8)[1:].view(np.float32), "float32", 1, 0.0)
    with pytest.raises(ValueError, match="format"):
        _fastreduce.centred(x.double().numpy(), "float32", 1, 0.0)
    with pytest.raises(ValueError, match="unsupported dtype"):
        _fastreduce.reduce(x.double().numpy(), "float64", 1)
    assert _fastreduce.reduce(torch.empty(0).numpy(), "float32", 1)[6] == 0


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_widens_every_half_precision_value_exactly(dtype: torch.dtype) -> None:
    """All 65,536 bit patterns (normals, subnormals, signed zeros, infinities, NaNs), one at a time,
    against torch's own conversion to float32."""
    patterns = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    widened = patterns.float().tolist()
    name = str(dtype).removeprefix("torch.")
    wrong = []
    for i, expected in enumerate(widened):
        one = patterns[i:i + 1]
        raw = one.view(torch.int16) if dtype == torch.bfloat16 else one
        total, squares, cubes, fourths, lo, hi, zeros = _fastreduce.reduce(raw.numpy(), name, 1)
        if math.isnan(expected):
            ok = math.isnan(total)  # min/max ignore NaN; the sum carries it
        else:
            ok = (total, lo, hi, zeros) == (expected, expected, expected, int(expected == 0)) and (
                squares == expected * expected) and (cubes, fourths) == (expected ** 3, expected ** 4)
        if not ok:
            wrong.append((hex(int(patterns[i:i + 1].view(torch.int16))), expected, total, lo, hi))
    assert not wrong, wrong[:5]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_activations_are_reduced_without_a_float32_copy(dtype: torch.dtype) -> None:
    """The kernel reads 2-byte values in place: no float32 tensor is allocated for them."""
    x = (seeded(300_000) * 3).relu().to(dtype)
    vectors = []
    ops = aten_ops(lambda: vectors.append(Reducer(kernel=True).reduce(x)))
    assert "aten._to_copy" not in ops, ops  # what x.float() runs
    vector = vectors[0]
    got = activation_stats(to_host([vector])[0])
    exp = float64_stats(x.float())
    for key in ("mean", "std", "min", "max", "zero_fraction"):
        assert got[key] == pytest.approx(exp[key], rel=1e-6, abs=1e-12), key


def test_kernel_is_built_wherever_a_c_compiler_is() -> None:
    """setup.py builds the kernel optionally; with a compiler on the machine a missing build is a bug."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler: the torch reductions are used")
    assert _fastreduce is not None, "hookcli.engine._fastreduce failed to build; see the pip install log"


def test_environment_switches_the_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NO_KERNEL_ENV, "1")
    assert not kernel_available() and not Reducer().kernel
    monkeypatch.setenv(NO_KERNEL_ENV, "0")
    assert kernel_available() == (_fastreduce is not None)


@needs_kernel
def test_a_stale_kernel_build_is_ignored_and_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """An editable install keeps an old .so after a checkout changes _fastreduce.c: never call it."""
    from hookcli.engine import kernel

    monkeypatch.setattr(_fastreduce, "ABI", kernel.ABI - 1)
    assert kernel.load.__wrapped__() is None
    assert kernel.status() == "stale build, run pip install -e . again"


def test_version_status_says_when_the_kernel_is_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from hookcli.engine import kernel

    monkeypatch.setenv(NO_KERNEL_ENV, "1")
    expected = "built, switched off by HOOKCLI_NO_KERNEL" if _fastreduce else "not built, CPU statistics use torch reductions"
    assert kernel.status() == expected


def test_channels_last_activation_is_reduced_without_a_copy() -> None:
    t = seeded(2, 8, 5, 5).to(memory_format=torch.channels_last)
    assert flat_view(t).data_ptr() == t.data_ptr() and flat_view(t).numel() == t.numel()
    assert sorted(flat_view(t).tolist()) == sorted(t.reshape(-1).tolist())


def test_gradient_stats_have_abs_max() -> None:
    t = torch.tensor([-3.0, 1.0, 2.0])
    got = gradient_stats(to_host([Reducer().reduce(t, zeros=False)])[0], abs_max=True)
    assert got["abs_max"] == 3.0 and "zero_fraction" not in got


def test_unchanged_tensor_is_reduced_once_and_in_place_change_is_seen() -> None:
    reducer = Reducer()
    t = seeded(100)
    first = reducer.reduce(t)
    assert reducer.reduce(t) is first  # an aliased output (Bottleneck == its last ReLU) costs nothing
    t.relu_()  # a new version: must be recomputed
    again = activation_stats(to_host([reducer.reduce(t)])[0])
    assert again["min"] >= 0 and again["zero_fraction"] > 0


def test_iter_tensors_paths() -> None:
    from collections import namedtuple

    NT = namedtuple("NT", "a b")
    x = torch.zeros(1)
    out = {"out": (x, [x, None]), "nt": NT(x, 3)}
    assert [p for p, _ in iter_tensors(out)] == ["['out'][0]", "['out'][1][0]", "['nt'].a"]


def test_device_path_counts_exactly_above_float32_integers() -> None:
    """2^24 + 8 elements, all but five zero: 2^24 + 3 zeros, a count float32 cannot hold (it is odd)."""
    n = (1 << 24) + 8
    t = torch.zeros(n)
    t[:5] = 1.0
    got = stats_of(t, "device")
    assert got["zero_fraction"] * n == n - 5 and got["mean"] == 5 / n


def test_devices_without_float64_reduce_in_float32() -> None:
    assert device_float(torch.device("cpu")) == device_float(torch.device("cuda", 0)) == torch.float64
    assert device_float(torch.device("mps")) == torch.float32


def test_to_host_takes_host_tuples_and_tensors_of_any_length_in_order() -> None:
    vectors = [(1.0, 2.0), torch.tensor([3.0, 4.0, 5.0], dtype=torch.float64), torch.tensor([6.0]), (7.0,)]
    assert to_host(vectors) == [[1.0, 2.0], [3.0, 4.0, 5.0], [6.0], [7.0]]
    assert to_host([]) == []


def test_cpu_statistics_are_host_values_not_tensors() -> None:
    """A run keeps one vector per call until its end: small tensors there fragment the heap between
    activations (measured: +5% peak memory on resnet50), plain floats do not."""
    for backend in ("kernel", "torch") if kernel_available() else ("torch",):  # the host backends
        vector = Reducer(backend=backend).reduce(seeded(100))
        assert isinstance(vector, tuple) and all(isinstance(v, float) for v in vector)
