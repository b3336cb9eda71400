"""Every statistic of every tensor layout a model can produce, against plain float64 torch reductions.

Hypothesis builds tensors of each dtype the statistics accept (float16, bfloat16, float32, float64),
random shapes (zero-size included) and layouts made by chaining the views models make: slices with
steps, transposes and permutations, ``expand`` (stride 0), channels-last 4-D and 5-D, storage offsets,
the lazy negative bit, with NaN, +-Inf and +-0 planted in them. Memory next to a view that is not part
of it holds NaN, so a path that reads past a view's values is caught by its NaN count. Both CPU paths,
the C kernel and the torch reductions (``HOOKCLI_NO_KERNEL=1``), and the accelerator path where CUDA
exists, must give torch's numbers. Then the same through the real engine and CLI.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import hookcli
from hookcli.engine.kernel import NO_KERNEL_ENV
from hookcli.engine.stats import (EMPTY, Moments, Reducer, _fastreduce, activation_stats, empty_vector, merge,
                                  to_host)
from reference import aten_op_counts, aten_ops, float64_stats

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SPECIALS = (math.nan, math.inf, -math.inf, 0.0, -0.0)
#: Relative error allowed in mean, std and norm, against the data's largest finite magnitude (mean,
#: std) or the norm itself. Values widen exactly to float32, so only accumulation errors remain: float32
#: sums over at most ~10^5 values in the torch path.
RTOL = 2e-5

#: kernel / torch: the two CPU paths. device: the accelerator path (branch-free, no host sync), run
#: here on CPU tensors. cuda: the same on a real GPU, where one exists.
PATHS = ["kernel", "torch", "device", "cuda"]


def reducer_for(path: str, monkeypatch: pytest.MonkeyPatch) -> Reducer:
    if path == "kernel":
        if _fastreduce is None:
            pytest.skip("hookcli.engine._fastreduce was not built here")
        monkeypatch.delenv(NO_KERNEL_ENV, raising=False)
        reducer = Reducer(backend="kernel")
        assert reducer.kernel
        return reducer
    if path == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.setenv(NO_KERNEL_ENV, "1")  # what an install without a C compiler gets
    # the device backend on CPU tensors: the accelerator path, branch-free, vectors as tensors
    reducer = Reducer(backend={"torch": "torch", "device": "device"}.get(path))
    assert not reducer.kernel
    return reducer


# -- tensors --------------------------------------------------------------------------------------


def planted(draw: st.DrawFn, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """Contiguous values of ``shape``: a scaled, offset Gaussian (optionally ReLU'd) with specials."""
    numel = math.prod(shape)
    seed = draw(st.integers(0, 2**31 - 1))
    big = dtype in (torch.float32, torch.float64)
    scale = draw(st.sampled_from([1e-3, 1.0, 1e3] + ([1e-30, 1e30] if big else [])))
    offset = draw(st.sampled_from([0.0, 0.0, 1.0, -50.0] + ([1e4] if big else [])))
    values = torch.randn(numel, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale + offset
    if draw(st.booleans()):
        values = values.relu()  # many zeros, as after a ReLU
    if numel:
        for special in draw(st.lists(st.sampled_from(SPECIALS), max_size=4)):
            values[draw(st.integers(0, numel - 1))] = special
    return values.to(dtype).reshape(shape)


def garbage_around(t: torch.Tensor, before: int, after: int) -> torch.Tensor:
    """``t``'s values at storage offset ``before``, with NaN on both sides of them in memory."""
    storage = torch.full((before + t.numel() + after,), math.nan, dtype=t.dtype, device=t.device)
    storage[before:before + t.numel()] = t.reshape(-1)
    return storage[before:before + t.numel()].view(t.shape)


@st.composite
def transform(draw: st.DrawFn, t: torch.Tensor) -> torch.Tensor:
    """One view a model could produce from ``t`` (its values may be a subset or repeats of ``t``'s)."""
    kind = draw(st.sampled_from(["step", "transpose", "permute", "expand", "channels_last", "offset", "neg"]))
    if kind == "step" and t.dim():
        dim = draw(st.integers(0, t.dim() - 1))
        step, start = draw(st.integers(1, 3)), draw(st.integers(0, 2))
        shape = list(t.shape)
        shape[dim] = t.shape[dim] * step + start
        big = torch.full(shape, math.nan, dtype=t.dtype, device=t.device)
        index = [slice(None)] * t.dim()
        index[dim] = slice(start, None, step)
        big[tuple(index)] = t
        return big[tuple(index)]
    if kind == "transpose" and t.dim() >= 2:
        a, b = draw(st.permutations(range(t.dim())))[:2]
        return t.transpose(a, b)
    if kind == "permute" and t.dim() >= 2:
        return t.permute(*draw(st.permutations(range(t.dim()))))
    if kind == "expand":
        if t.dim() and draw(st.booleans()):  # repeat a size-1 dimension (a broadcast bias, a mask)
            dim = draw(st.integers(0, t.dim() - 1))
            t = t.narrow(dim, 0, min(1, t.shape[dim]))
            sizes = [-1] * t.dim()
            sizes[dim] = draw(st.integers(0, 5)) if t.shape[dim] == 1 else -1
            return t.expand(*sizes)
        if t.dim() == 0 or draw(st.booleans()):
            t = t.sum() if t.numel() else t.reshape(-1)[:0].sum()  # a scalar, as x.sum().expand(n)
            return t.expand(draw(st.integers(0, 4096)))
        return t.unsqueeze(0).expand(draw(st.integers(0, 4)), *t.shape)
    if kind == "channels_last" and t.dim() in (4, 5):
        fmt = torch.channels_last if t.dim() == 4 else torch.channels_last_3d
        return t.contiguous(memory_format=fmt)
    if kind == "offset":
        return garbage_around(t.contiguous(), draw(st.integers(1, 7)), draw(st.integers(0, 7)))
    if kind == "neg":
        return torch._neg_view(t)  # memory holds t, the values are -t: numpy() and raw reads refuse it
    return t


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(FLOATS))
    ndim = draw(st.sampled_from([0, 1, 2, 3, 4, 4, 5, 5]))
    shape = draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim))
    if draw(st.integers(0, 19)) == 0:  # now and then one large enough for two of the kernel's threads
        shape = [draw(st.integers(66_000, 90_000))]
    t = planted(draw, dtype, shape)
    if t.dim() in (4, 5) and draw(st.booleans()):  # channels-last, as conv nets produce
        t = t.contiguous(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d)
    for _ in range(draw(st.integers(0, 3))):
        t = draw(transform(t))
    assume(t.numel() <= 400_000)
    return t


# -- reference: plain torch, float64 ---------------------------------------------------------------


def assert_matches(got: dict, exp: dict, t: torch.Tensor) -> None:
    finite = t.detach().to("cpu", torch.float64).reshape(-1)
    finite = finite[torch.isfinite(finite)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    for key in ("nan_count", "inf_count", "zero_fraction"):
        if key not in got:  # gradient statistics have no zero fraction
            continue
        assert got[key] == exp[key], (key, got[key], exp[key])
    for key in ("min", "max"):  # values of the tensor itself: exact
        assert got[key] == exp[key] or (math.isnan(got[key]) and math.isnan(exp[key])), (key, got[key], exp[key])
    for key, tol in (("mean", RTOL * scale), ("std", RTOL * scale), ("norm", RTOL * exp["norm"])):
        g, e = got[key], exp[key]
        if not math.isfinite(e):
            assert g == e or (math.isnan(g) and math.isnan(e)), (key, g, e)
        else:
            assert abs(g - e) <= tol + 1e-300, (key, g, e, tol)


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(data=st.data())
def test_every_statistic_matches_float64_torch_on_any_layout(path: str, data: st.DataObject,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    reducer = reducer_for(path, monkeypatch)
    t = data.draw(tensors())
    if path == "cuda":
        t = t.cuda()  # dense layouts keep their strides; the transforms above ran on CPU
    vector = reducer.reduce(t)
    if path == "device":
        assert isinstance(vector, torch.Tensor) and vector.dtype == torch.float64
    got = activation_stats(to_host([vector])[0])
    assert_matches(got, float64_stats(t), t)


@pytest.mark.parametrize("path", ["kernel", "torch"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_both_paths_agree_with_each_other_and_repeat_themselves(path: str, data: st.DataObject,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A second reduction of the same (unchanged) tensor gives the same numbers, and so does a fresh
    Reducer: results never depend on what was reduced before (the scratch buffer, the seen-cache)."""
    reducer = reducer_for(path, monkeypatch)
    t = data.draw(tensors())
    first = activation_stats(to_host([reducer.reduce(t)])[0])
    reducer.reduce(data.draw(tensors()))  # something else in between
    again = activation_stats(to_host([reducer_for(path, monkeypatch).reduce(t)])[0])
    assert json.dumps(first, sort_keys=True) == json.dumps(again, sort_keys=True)


# -- merging: statistics of many tensors (calls, batches, steps, ranks) ---------------------------------


def kurtosis_of(values: torch.Tensor) -> float:
    """Pearson's kurtosis of float64 ``values``: n * sum(d^4) / sum(d^2)^2, d the deviations from the mean."""
    d = values - values.mean()
    return float(values.numel() * d.pow(4).sum() / d.square().sum() ** 2)


@st.composite
def pieces(draw: st.DrawFn) -> list[torch.Tensor]:
    """1-4 tensors of any layouts and dtypes, each maybe cut into views along a dimension at random points."""
    out: list[torch.Tensor] = []
    for t in draw(st.lists(tensors(), min_size=1, max_size=4)):
        if t.dim() and t.shape[0] > 1 and draw(st.booleans()):
            cuts = sorted(draw(st.lists(st.integers(0, t.shape[0]), max_size=3)))
            out.extend(torch.tensor_split(t, cuts, dim=0))  # views: the layouts stay as they were
        else:
            out.append(t)
    return out


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_merged_statistics_of_random_chunks_equal_float64_torch_over_their_concatenation(
        path: str, data: st.DataObject, monkeypatch: pytest.MonkeyPatch) -> None:
    """What training-time and multi-rank statistics rely on: reduce each piece, merge in a random order
    and grouping, and get the statistics of all values at once (counts and extremes exactly)."""
    reducer = reducer_for(path, monkeypatch)
    parts = data.draw(pieces())
    if path == "cuda":
        parts = [p.cuda() for p in parts]
    vectors = [reducer.reduce(p) for p in parts]
    if path == "device":
        assert all(isinstance(v, torch.Tensor) for v in vectors)
    while len(vectors) > 1:  # a random merge tree: any two neighbours, either side first
        i = data.draw(st.integers(0, len(vectors) - 2))
        a, b = vectors[i], vectors[i + 1]
        vectors[i:i + 2] = [merge(a, b) if data.draw(st.booleans()) else merge(b, a)]
    got = activation_stats(to_host(vectors)[0])
    everything = torch.cat([p.detach().to("cpu", torch.float64).reshape(-1) for p in parts])
    assert_matches(got, float64_stats(everything), everything)
    finite = everything[torch.isfinite(everything)]
    if finite.numel() < everything.numel() or not finite.numel():
        assert math.isnan(got["kurtosis"])
    elif float(finite.std(correction=0)) > 1e-3 * float(finite.abs().max()):  # (else kurtosis is ill-posed)
        assert got["kurtosis"] == pytest.approx(kurtosis_of(finite), rel=1e-3)


def test_merge_is_exact_for_counts_and_extremes_and_has_an_identity() -> None:
    """EMPTY changes nothing; counts add; min/max ignore NaN and keep the infinities seen."""
    reducer = Reducer()
    a = reducer.reduce(torch.tensor([0.0, 2.0, math.nan, -1.0]))
    b = reducer.reduce(torch.tensor([math.inf, 0.0, 5.0]))
    assert merge(EMPTY, a) == a and merge(a, EMPTY) == a
    both = merge(a, b)
    assert isinstance(both, Moments)
    assert (both.count, both.zeros, both.nans, both.infs, both.min, both.max) == (5, 2, 1, 1, -1.0, math.inf)
    assert both.mean == pytest.approx(float(torch.tensor([0.0, 2.0, -1.0, 0.0, 5.0], dtype=torch.float64).mean()))
    with pytest.raises(TypeError):
        merge(a, empty_vector(torch.device("cpu")))


# -- through the engine and the CLI ----------------------------------------------------------------

EXPAND_MODEL = """
import torch
from torch import nn

class Expand(nn.Module):
    def forward(self, x):
        return x.sum().expand(4096)

def build():
    return Expand()
"""

MLP_MODEL = """
import torch
from torch import nn

def build():
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
"""


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def load_module(path: str) -> Callable[[], torch.nn.Module]:
    import importlib.util

    spec = importlib.util.spec_from_file_location(Path(path).stem + "_ref", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module.build


@pytest.fixture(params=["kernel", "torch"])
def stats_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    reducer_for(request.param, monkeypatch)  # sets or clears HOOKCLI_NO_KERNEL, skips without a build
    return request.param


def test_expanded_output_reports_its_values_through_the_cli(cli, tmp_path: Path, stats_path: str) -> None:
    """``x.sum().expand(4096)``: 4096 copies of one value, whose min and max are that value."""
    model = write(tmp_path, "expand_model.py", EXPAND_MODEL)
    x = torch.randn(64, generator=torch.Generator().manual_seed(3))
    torch.save(x, tmp_path / "x.pt")
    result = cli("stats", f"{model}:build", "--input", tmp_path / "x.pt", "-f", "json")
    assert result.exit_code == 0, result.stderr
    assert result.stderr == "" or "Error" not in result.stderr
    (layer,) = json.loads(result.stdout)["layers"]
    expected = float64_stats(x.sum().expand(4096))
    assert layer["shape"] == [4096]
    assert_matches(layer["stats"], expected, x.sum().expand(4096))
    assert layer["stats"]["min"] == layer["stats"]["max"] == float(x.sum())


def test_kurtosis_is_in_the_json_report_and_in_no_table_format(cli, tmp_path: Path, stats_path: str) -> None:
    """JSON gains ``kurtosis`` (schema 1: keys are only added); CSV, the one machine format with a column
    per statistic, keeps today's columns."""
    model = write(tmp_path, "mlp_model.py", MLP_MODEL)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(5))
    torch.save(x, tmp_path / "x.pt")
    result = cli("stats", f"{model}:build", "--input", tmp_path / "x.pt", "--layers", "1", "-f", "json")
    assert result.exit_code == 0 and result.stderr == "", result.stderr
    (layer,) = json.loads(result.stdout)["layers"]
    reference = load_module(model)()
    with torch.no_grad():
        hidden = torch.relu(reference[0](x)).double()
    assert layer["stats"]["kurtosis"] == pytest.approx(kurtosis_of(hidden.reshape(-1)), rel=1e-6)
    csv = cli("stats", f"{model}:build", "--input", tmp_path / "x.pt", "--layers", "1", "-f", "csv")
    assert csv.exit_code == 0 and csv.stderr == "", csv.stderr
    header = csv.stdout.splitlines()[0]
    assert "stat_inf_count" in header and "kurtosis" not in header


def test_sum_loss_gradients_of_an_mlp_match_autograd(cli, tmp_path: Path, stats_path: str) -> None:
    """``grads --loss sum``: the gradient reaching the last layer is ones expanded (stride 0)."""
    model = write(tmp_path, "mlp_model.py", MLP_MODEL)
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(5))
    torch.save(x, tmp_path / "x.pt")
    result = cli("grads", f"{model}:build", "--input", tmp_path / "x.pt", "--loss", "sum", "--all",
                 "--params", "all", "-f", "json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)

    net = load_module(model)()
    h0 = net[0](x)
    h1 = net[1](h0)
    out = net[2](h1)
    params = dict(net.named_parameters())
    wanted = [h0, h1, out, *params.values()]
    grads = torch.autograd.grad(out.sum(), wanted)
    by_output = dict(zip(["0", "1", "2"], grads[:3]))
    by_param = dict(zip(params, grads[3:]))

    layers = {layer["name"]: layer for layer in report["layers"] if layer["name"]}
    assert set(layers) == set(by_output)
    for name, g in by_output.items():
        assert_matches(layers[name]["grad"], float64_stats(g), g)
    reported = {p["name"]: p for p in report["params"]}
    assert set(reported) == set(by_param)
    for name, g in by_param.items():
        assert_matches(reported[name]["grad"], float64_stats(g), g)


def test_integer_bool_and_complex_outputs_get_shape_and_dtype_only(tmp_path: Path, stats_path: str) -> None:
    """Statistics are for floating tensors: a complex one's are of its magnitude |z| (conjugate views
    included); integer and bool tensors are described only."""

    class Mixed(torch.nn.Module):
        def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
            c = torch.complex(x, -x)
            return {"f": x.t(), "i": x.long()[::2], "b": (x > 0).expand(3, *x.shape), "c": c.conj(),
                    "h": torch._neg_view(x.half())}

    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    torch.save(x, tmp_path / "x.pt")
    report = hookcli.stats(Mixed(), inputs=[tmp_path / "x.pt"])
    rows = {layer.output: layer for layer in report.layers}
    assert {k: (r.shape, r.dtype) for k, r in rows.items()} == {
        "['f']": ([6, 4], "float32"), "['i']": ([2, 6], "int64"), "['b']": ([3, 4, 6], "bool"),
        "['c']": ([4, 6], "complex64"), "['h']": ([4, 6], "float16")}
    for key in ("['i']", "['b']"):
        assert rows[key].stats is None, key
    assert_matches(dict(rows["['f']"].stats), float64_stats(x), x)
    magnitude = torch.complex(x, -x).conj().abs()  # |z|, computed by torch
    assert_matches(dict(rows["['c']"].stats), float64_stats(magnitude), magnitude)
    neg_half = torch._neg_view(x.half())
    assert_matches(dict(rows["['h']"].stats), float64_stats(neg_half), neg_half)


# -- what is read, and what is copied ---------------------------------------------------------------


def copies_made(fn: Callable[[], object]) -> set[str]:
    """The aten ops among those ``fn`` runs that copy tensor data."""
    return aten_ops(fn) & {"aten.clone", "aten._to_copy", "aten.copy_", "aten.contiguous", "aten._reshape_copy"}


@pytest.mark.parametrize("layout", ["transposed", "permuted", "channels-last", "channels-last-3d", "offset"])
def test_dense_layouts_go_to_the_kernel_in_memory_order_without_a_copy(layout: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    reducer = reducer_for("kernel", monkeypatch)
    base = torch.randn(2, 6, 5, 4, 3, generator=torch.Generator().manual_seed(2)).relu()
    make = {"transposed": lambda: base[0, 0, 0].t(), "permuted": lambda: base.permute(3, 1, 4, 0, 2),
            "channels-last": lambda: base[0].contiguous(memory_format=torch.channels_last),
            "channels-last-3d": lambda: base.contiguous(memory_format=torch.channels_last_3d),
            "offset": lambda: garbage_around(base, 5, 3)}
    t = make[layout]()
    assert not t.is_contiguous() or t.storage_offset()
    assert not copies_made(lambda: reducer.reduce(t))
    assert_matches(activation_stats(to_host([reducer.reduce(t)])[0]), float64_stats(t), t)


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_an_expanded_tensor_is_never_materialised(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """2^40 repeats of one value (8 TB if copied): reduced from the one value, counts scaled."""
    reducer = reducer_for(path, monkeypatch)
    t = torch.tensor(-4.5).expand(1 << 20, 1 << 20)
    got = activation_stats(to_host([reducer.reduce(t)])[0])
    assert (got["mean"], got["std"], got["min"], got["max"], got["zero_fraction"]) == (-4.5, 0.0, -4.5, -4.5, 0.0)
    assert got["norm"] == pytest.approx(4.5 * (1 << 20), rel=1e-12)  # sqrt(2^40 * 4.5^2)
    rows = torch.tensor([0.0, math.nan, 2.0]).unsqueeze(1).expand(3, 1 << 30)  # a broadcast column
    got = activation_stats(to_host([reducer.reduce(rows)])[0])
    assert (got["nan_count"], got["inf_count"], got["zero_fraction"]) == (1 << 30, 0, pytest.approx(1 / 3))


# -- the torch path without the kernel: what each chunk costs ---------------------------------------

#: The ops that read a whole chunk (or the scratch buffer of its squares) in the torch path.
CHUNK_PASSES = ("aten.sum", "aten.aminmax", "aten.amin", "aten.amax", "aten.mul", "aten.dot", "aten.eq")


@pytest.mark.parametrize("data", ["straddling", "relu", "tiny", "tiny with a zero"])
def test_without_the_kernel_a_chunk_is_zero_counted_only_where_zeros_can_be(data: str,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #21: the zero count (``eq`` and a ``sum``) was the torch path's dearest statistic, run on every
    chunk straddling 0. Data on both sides of 0 with no zero (conv and norm outputs) now skips it after
    one cheap ``amin`` of the squares: 7 passes per chunk instead of 8. A ReLU's output (min 0) and
    data whose squares underflow to 0 are still counted, exactly."""
    reducer = reducer_for("torch", monkeypatch)
    chunks = 3
    t = torch.randn(chunks * reducer.CHUNK - 1000, generator=torch.Generator().manual_seed(5))
    if data == "relu":
        t = t.relu()
    elif data.startswith("tiny"):
        t = t * 1e-30 + torch.sign(t) * 1e-30  # |x| >= 1e-30: every square underflows to 0 in float32
        if data == "tiny with a zero":
            t[reducer.CHUNK + 7] = -0.0
    got: list[Moments] = []
    counts = aten_op_counts(lambda: got.append(reducer.reduce(t)))
    passes = {op: counts[op] for op in CHUNK_PASSES if counts[op]}
    assert activation_stats(got[0])["zero_fraction"] == float64_stats(t)["zero_fraction"]
    if data == "straddling":  # sum x, aminmax, x*x, sum x^2, x^3, x^4 (dots), amin of the squares
        assert passes == {"aten.sum": 2 * chunks, "aten.aminmax": chunks, "aten.mul": chunks,
                          "aten.dot": 2 * chunks, "aten.amin": chunks}
    elif data == "relu":  # zeros are there (min 0): eq and its sum instead of the amin
        assert passes == {"aten.sum": 3 * chunks, "aten.aminmax": chunks, "aten.mul": chunks,
                          "aten.dot": 2 * chunks, "aten.eq": chunks}
    else:  # the squares are 0 (so is the variance from them: a centred float64 pass follows, its own ops)
        assert (passes["aten.amin"], passes["aten.eq"]) == (chunks, chunks)


@pytest.mark.parametrize("chunk", [64, 1000, 4096])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_the_chunked_torch_path_matches_float64_torch_with_chunks_of_any_size(
        chunk: int, data: st.DataObject, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunk-wise path (``Reducer._chunked``, which real activations take without the kernel) on the
    small tensors hypothesis draws: every statistic, the exact zero count among them, over many merged
    chunks, with zeros, underflowing squares (scale 1e-30), offsets and NaN/Inf planted."""
    reducer = reducer_for("torch", monkeypatch)
    reducer.CHUNK, reducer.SMALL = chunk, 0  # (instance attributes: every tensor goes through the chunks)
    t = data.draw(tensors())
    got = activation_stats(to_host([reducer.reduce(t)])[0])
    assert_matches(got, float64_stats(t), t)
