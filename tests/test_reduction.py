"""The reduction backend's public face (hookcli.engine.reduction): the backend chosen in one place,
forced by HOOKCLI_REDUCTION, named in every JSON report and watch log line; many tensors at once;
against float64 torch."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import hookcli
from hookcli.engine import reduction
from hookcli.engine.kernel import NO_KERNEL_ENV
from hookcli.engine.stats import Reducer, _fastreduce, activation_stats, gradient_stats, to_host
from hookcli.errors import UsageError

needs_kernel = pytest.mark.skipif(_fastreduce is None, reason="hookcli.engine._fastreduce was not built here")


def seeded(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))) * 1.5 + 0.25


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv(reduction.REDUCTION_ENV, raising=False)
    monkeypatch.delenv(NO_KERNEL_ENV, raising=False)
    return monkeypatch


#: what auto reduces an accelerator's tensors with here: the fused kernel needs CUDA and Triton
ACCELERATOR = "triton" if torch.cuda.is_available() and reduction.BACKENDS["triton"].unavailable() is None else "lean"


def triton_runs_here(name: str) -> None:
    """Skip a test of the ``triton`` backend where its kernels cannot run on CPU tensors (no interpreter)."""
    if name == "triton" and reduction.BACKENDS["triton"].unavailable() is not None:
        pytest.skip(f"triton: {reduction.BACKENDS['triton'].unavailable()}")


@pytest.mark.parametrize("name", ["auto", "kernel", "torch", "device", "triton", "lean"])
def test_stats_json_names_the_backend(cli, env: pytest.MonkeyPatch, name: str) -> None:
    if name == "kernel" and _fastreduce is None:
        pytest.skip("hookcli.engine._fastreduce was not built here")
    triton_runs_here(name)
    env.setenv(reduction.REDUCTION_ENV, name)
    result = cli("stats", "tiny_models:Reused", "--input-shape", "3x4", "--format", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    auto = "kernel" if _fastreduce is not None else "torch"
    assert report["reduction"] == (auto if name == "auto" else name)
    # (each backend's numbers against float64 torch: tests/test_stats_properties.py, and the reference
    # outputs under HOOKCLI_REDUCTION=device in .ci/run)


@pytest.mark.parametrize("name", ["torch", "device"])
@pytest.mark.parametrize("command", ["diff", "features"])
def test_diff_and_features_json_name_the_backend_in_force(cli, env: pytest.MonkeyPatch, tmp_path: Path,
                                                           command: str, name: str) -> None:
    env.setenv(reduction.REDUCTION_ENV, name)
    extra = (["--vs-dtype", "float64"] if command == "diff"
             else ["--output", str(tmp_path / "f.safetensors")])
    result = cli(command, "tiny_models:Reused", "--input-shape", "3x4", *extra, "--format", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["reduction"] == name


def test_kernel_forced_where_it_is_off_is_one_line_exit_2(cli, env: pytest.MonkeyPatch) -> None:
    env.setenv(reduction.REDUCTION_ENV, "kernel")
    env.setenv(NO_KERNEL_ENV, "1")
    result = cli("stats", "tiny_models:Reused", "--input-shape", "3x4")
    assert result.exit_code == 2
    assert "HOOKCLI_REDUCTION=kernel: the C statistics kernel is switched off by HOOKCLI_NO_KERNEL" in result.stderr
    assert "Traceback" not in result.output


def test_an_unknown_backend_is_exit_2_naming_the_choices(cli, env: pytest.MonkeyPatch) -> None:
    env.setenv(reduction.REDUCTION_ENV, "gpu")
    result = cli("stats", "tiny_models:Reused", "--input-shape", "3x4")
    assert result.exit_code == 2 and "use one of auto, kernel, torch, device" in result.stderr


def test_no_kernel_env_makes_auto_torch(env: pytest.MonkeyPatch) -> None:
    env.setenv(NO_KERNEL_ENV, "1")
    assert reduction.choose("cpu").name == "torch"
    assert reduction.choose("cuda").name == ACCELERATOR
    env.setenv(reduction.REDUCTION_ENV, "torch")
    assert reduction.choose("cuda").name == ACCELERATOR  # a host backend reads CPU memory only
    env.setenv(reduction.REDUCTION_ENV, "kernel")
    with pytest.raises(UsageError, match="switched off by HOOKCLI_NO_KERNEL"):
        reduction.choose("cpu")
    if _fastreduce is not None:  # a caller's own choice takes the built kernel (as Reducer(kernel=True))
        assert reduction.choose("cpu", "kernel").name == "kernel"


def test_device_backend_runs_on_cpu_tensors(env: pytest.MonkeyPatch) -> None:
    t = seeded(40, 30)
    vector = reduction.reduce(t, reducer=Reducer(backend="device"))
    assert isinstance(vector, torch.Tensor) and vector.device.type == "cpu"
    got = activation_stats(to_host([vector])[0])
    want = t.double()
    assert math.isclose(got["mean"], float(want.mean()), rel_tol=1e-9)
    assert math.isclose(got["std"], float(want.std(correction=0)), rel_tol=1e-9)


@pytest.mark.parametrize("name", ["kernel", "torch", "device", "triton", "lean"])
def test_many_tensors_at_once_equal_float64_torch(env: pytest.MonkeyPatch, name: str) -> None:
    if name == "kernel" and _fastreduce is None:
        pytest.skip("hookcli.engine._fastreduce was not built here")
    triton_runs_here(name)
    env.setenv(reduction.REDUCTION_ENV, name)
    tensors = [seeded(7, 5), seeded(300), seeded(2, 3, 4).bfloat16(), seeded(1)]
    rows = to_host(reduction.reduce_many(tensors, zeros=False))
    for t, row in zip(tensors, rows):
        got, want = gradient_stats(row, abs_max=True), t.double()
        assert math.isclose(got["mean"], float(want.mean()), rel_tol=1e-6, abs_tol=1e-12)
        assert math.isclose(got["std"], float(want.std(correction=0)), rel_tol=1e-6)
        assert math.isclose(got["norm"], float(want.norm()), rel_tol=1e-7)  # float32 data: the device path sums d^2 of scaled values
        assert got["abs_max"] == float(want.abs().max())
    for t, norm in zip(tensors, to_host(reduction.norms(tensors))):
        assert math.isclose(norm[0], float(t.double().norm()), rel_tol=1e-12)
    for t, hist in zip(tensors, to_host(reduction.histograms(tensors))):
        want = torch.histc(t.double(), bins=30, min=float(t.min()), max=float(t.max())) if t.numel() > 1 else None
        if want is not None:
            assert hist[5:] == want.tolist()
    for t, (high, negated_low) in zip(tensors, to_host(reduction.extremes(tensors))):
        assert (high, -negated_low) == (float(t.double().max()), float(t.double().min()))
    bounds = [(float(t.min()) - 1.0, float(t.max()) + 0.5) for t in tensors]  # wider than each tensor's own
    for t, (lo, hi), hist in zip(tensors, bounds, to_host(reduction.histograms(tensors, bounds=bounds))):
        want = torch.histc(t.double(), bins=30, min=lo, max=hi)
        assert hist[:2] == [lo, hi] and hist[5:] == want.tolist()
    x = seeded(4, 6, 5).relu()
    counts = to_host(reduction.channel_counts([(x, 1)]))[0]
    assert counts == [float((x[:, c] != 0).sum()) for c in range(6)]


@pytest.mark.parametrize("name", ["device", "triton", "lean"])
def test_every_watch_line_names_the_backend(env: pytest.MonkeyPatch, tmp_path: Path, name: str) -> None:
    triton_runs_here(name)
    env.setenv(reduction.REDUCTION_ENV, name)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 4)
    log = tmp_path / "w.jsonl"
    with hookcli.watch(model, opt, out=log) as w:
        for _ in range(3):
            loss = model(x).square().mean()
            loss.backward()
            before = model[0].weight.detach().double().clone()  # the logged norm is the one before the update
            opt.step()
            opt.zero_grad()
            w.step(loss=loss)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == 3 and {line["reduction"] for line in lines} == {name}
    logged = {param["name"]: param for param in lines[-1]["params"]}
    assert math.isclose(logged["0.weight"]["norm"], float(before.norm()), rel_tol=1e-6)


@needs_kernel
def test_the_kernel_backend_is_the_default_on_cpu(env: pytest.MonkeyPatch) -> None:
    assert reduction.choose("cpu").name == "kernel" and reduction.name_for("cpu") == "kernel"


#: The torch ops the device backend runs per reduced tensor, counted with a TorchDispatchMode
#: (benchmarks/README.md): a count, not a timing, so it holds on any machine. Lower it when the path gets
#: leaner; never raise it without saying why there.
DEVICE_OPS_PER_TENSOR = 71


@pytest.mark.parametrize("shape", [(1000,), (4, 64, 30, 30), (300, 70)])
def test_the_device_backend_runs_at_most_its_measured_op_count_per_tensor(env: pytest.MonkeyPatch,
                                                                         shape: tuple[int, ...]) -> None:
    from reference import aten_op_counts

    x = seeded(*shape)
    reducer = Reducer(backend="device")
    counts = aten_op_counts(lambda: reduction.reduce(x, reducer=reducer))
    assert 0 < sum(counts.values()) <= DEVICE_OPS_PER_TENSOR, counts
    # zeros=False (gradients): one op less, and never more
    y = x * 1  # another tensor: not the one the reducer saw
    again = aten_op_counts(lambda: reduction.reduce(y, zeros=False, reducer=reducer))
    assert sum(again.values()) <= DEVICE_OPS_PER_TENSOR, again


def test_histograms_with_triton_take_a_fixed_number_of_ops_and_equal_float64_torch(env: pytest.MonkeyPatch) -> None:
    """With the ``triton`` backend the float16/bfloat16/float32 tensors of a step share the kernel's
    launches: the compute ops (views apart) for eight tensors are those for two; each row equals float64
    torch (buckets as torch.histc over the tensor's own range, min, max and count exactly, the sums to
    float32 accuracy); float64, empty, integer and None entries keep their per-tensor answer."""
    triton_runs_here("triton")
    env.setenv(reduction.REDUCTION_ENV, "triton")

    def ops(ts: list[torch.Tensor]) -> int:
        reduction.histograms(ts)  # address tables are built (and cached) once
        return sum(compute_ops(lambda: reduction.histograms(ts)).values())

    floats = [seeded(3 + k, 5) for k in range(8)]
    assert ops(floats) == ops(floats[:2])
    tensors = [seeded(40, 3), None, seeded(7, 5).bfloat16(), torch.empty(0), torch.arange(6), seeded(9, 2).double(),
               seeded(6, 6).half().t()]
    rows = reduction.histograms(tensors)
    assert rows[1] is None and rows[3] is None and rows[4] is None
    for t, row in zip(tensors, rows):
        if t is None or not t.numel() or not t.is_floating_point():
            continue
        got, d = row.tolist(), t.double()
        assert got[5:] == torch.histc(d, bins=30, min=float(d.min()), max=float(d.max())).tolist()
        assert got[:3] == [float(d.min()), float(d.max()), float(d.numel())]
        assert math.isclose(got[3], float(d.sum()), rel_tol=1e-6, abs_tol=1e-6 * float(d.abs().sum()))
        assert math.isclose(got[4], float(d.square().sum()), rel_tol=1e-6)


def compute_ops(fn) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """How many times ``fn()`` runs each aten op that is not a view (views launch nothing)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts: Counter[str] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if not func.is_view:
                self.counts[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        fn()
    return dict(ops.counts)


@pytest.mark.parametrize("name", ["triton", "lean"])
def test_an_activation_takes_the_backends_fixed_ops_through_the_public_face(env: pytest.MonkeyPatch,
                                                                              name: str) -> None:
    """Through ``reduction.reduce`` (what a hook calls), every layout and dtype: the ``triton`` backend is
    one op to torch (its custom op) and the ``lean`` one at most 12, as the backends alone: an expanded
    tensor is not reduced to its base and scaled after (two more ops), a gapped one not copied first
    (the custom op copies it inside); each equals float64 torch."""
    from reference import assert_moments_match

    triton_runs_here(name)
    env.setenv(reduction.REDUCTION_ENV, name)
    base = seeded(4, 6, 5, 5)
    for x in (seeded(50, 7), base.contiguous(memory_format=torch.channels_last), seeded(30).bfloat16(),
              base[:, :, ::2], seeded(3, 1).expand(3, 40), base.transpose(0, 2).half()):
        reduction.reduce(x, reducer=Reducer())  # constants and tables are built (and cached) once
        ops = compute_ops(lambda x=x: reduction.reduce(x, reducer=Reducer()))
        if name == "triton":
            assert ops == {"hookcli.reduce_moments": 1}, ops
        else:
            assert sum(ops.values()) <= 12, ops
        assert_moments_match(to_host([reduction.reduce(x, reducer=Reducer())])[0], x, centre_error=2.0 ** -23)


def test_all_parameters_of_a_step_take_at_most_three_ops_with_triton(env: pytest.MonkeyPatch) -> None:
    """Every parameter's statistics and norm for a step, through ``reduction`` (what a watch calls):
    ``reduce_many`` and ``norms`` are at most 3 ops to torch with the ``triton`` backend, parameters that
    require grad included; each equals float64 torch."""
    triton_runs_here("triton")
    env.setenv(reduction.REDUCTION_ENV, "triton")
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 2))
    params = list(model.parameters())
    reducer = Reducer()
    reduction.reduce_many(params, reducer=reducer)
    ops = compute_ops(lambda: (reduction.reduce_many(params, reducer=reducer, zeros=False), reduction.norms(params)))
    assert sum(ops.values()) <= 3, ops
    rows = to_host(reduction.reduce_many(params, reducer=reducer, zeros=False))
    for p, row, norm in zip(params, rows, to_host(reduction.norms(params))):
        want = p.detach().double()
        got = gradient_stats(row)
        assert math.isclose(got["mean"], float(want.mean()), rel_tol=1e-6, abs_tol=1e-12)
        assert math.isclose(got["std"], float(want.std(correction=0)), rel_tol=1e-6, abs_tol=1e-12)
        assert math.isclose(norm[0], float(want.norm()), rel_tol=1e-12)
