"""``hookcli diff``: two runs of a model compared call by call.

Every expected number is computed here with plain torch: the model run twice with the test's own
forward hooks (outputs cloned as each call finishes), gradients with ``torch.autograd.grad``, and
the errors from those tensors in float64. Inputs reach hookcli through a .pt file, so both sides
run on exactly the same tensor.
"""

from __future__ import annotations

import copy
import json
import math
import os
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
import torchvision
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookcli
from hookcli.commands.diff_numbers import DiskStore, compare, errors_from, pieces
from reference import outputs_by_call
from timeouts import scaled_timeout

# --------------------------------------------------------------------------- plain-torch references




def reference_errors(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """max |a-b|, ||a-b||/||a||, cosine, SQNR (dB), computed directly in float64."""
    a, b = a.double().flatten(), b.double().flatten()
    d = a - b
    return {
        "max_abs": d.abs().max().item(),
        "rel_l2": (d.norm() / a.norm()).item(),
        "cosine": (a @ b / (a.norm() * b.norm())).item(),
        "sqnr_db": (10 * torch.log10(a.pow(2).sum() / d.pow(2).sum())).item() if d.abs().max() > 0 else math.inf,
    }


def reference_within(a: torch.Tensor, b: torch.Tensor, tol) -> bool:
    """Every limit ``tol`` sets, checked in float64: elementwise |a-b| <= atol + rtol |a|, and the
    whole tensor's ||a-b|| / ||a|| and 1 - cosine (None: not checked)."""
    a, b = a.double().flatten(), b.double().flatten()
    ok = True
    if tol.rtol is not None:
        ok &= bool(((a - b).abs() <= tol.atol + tol.rtol * a.abs()).all())
    if tol.rel_l2 is not None:
        ok &= bool((a - b).norm() <= tol.rel_l2 * a.norm())
    if tol.cosine_distance is not None:
        ok &= bool(1 - a @ b / (a.norm() * b.norm()) <= tol.cosine_distance)
    return ok


def save_input(tmp_path: Path, x: torch.Tensor) -> str:
    path = tmp_path / "x.pt"
    torch.save(x, path)
    return str(path)


def rows_by_key(data: dict) -> dict[tuple[str, int, str], dict]:
    return {(r["name"], r["call"], r["output"]): r for r in data["rows"]}


@pytest.fixture(scope="module")
def resnet() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet18(weights=None).eval()


# --------------------------------------------------------------------------- float32 vs bfloat16


def test_resnet18_float32_vs_bfloat16_every_row_matches_plain_torch(resnet: nn.Module, tmp_path: Path) -> None:
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    report = hookcli.diff(resnet, inputs=[save_input(tmp_path, x)], all_modules=True, vs_dtype="bfloat16")
    ref_a = outputs_by_call(resnet, x)
    model_b = copy.deepcopy(resnet).to(torch.bfloat16)
    ref_b = outputs_by_call(model_b, x.to(torch.bfloat16))
    assert next(resnet.parameters()).dtype == torch.float32  # handed back as it came

    rows = [r for r in report.rows]
    assert {(r.name, r.call) for r in rows} == set(ref_a)  # every call of every module, the root included
    (tol,) = report.tolerances
    assert (tol.a_dtype, tol.b_dtype, tol.source) == ("float32", "bfloat16", "default")
    for row in rows:
        a, b = ref_a[(row.name, row.call)], ref_b[(row.name, row.call)]
        assert (row.a_shape, row.b_shape) == (list(a.shape), list(b.shape))
        assert (row.a_dtype, row.b_dtype) == ("float32", "bfloat16")
        want = reference_errors(a, b)
        got = row.errors
        assert got is not None, row.label
        assert got.max_abs == pytest.approx(want["max_abs"], rel=1e-5, abs=1e-9), row.label
        assert got.rel_l2 == pytest.approx(want["rel_l2"], rel=1e-3), row.label
        assert got.cosine == pytest.approx(want["cosine"], abs=1e-6), row.label
        assert got.sqnr_db == pytest.approx(want["sqnr_db"], abs=0.01), row.label
        within = reference_within(a, b, tol)
        assert got.within == within and row.status == ("ok" if within else "diverged"), row.label
    finals = [r for r in rows if r.final]
    assert [r.name for r in finals] == [""]
    assert report.ok == finals[0].errors.within


@pytest.mark.parametrize("spec, args", [
    ("resnet50", ["--input-shape", "1x3x64x64"]),  # its output failed the elementwise rtol 5e-2, atol 1e-2
    ("timm:test_vit", []),
    ("hf:gpt2", ["--model-arg", "n_layer=2", "--model-arg", "n_embd=32", "--model-arg", "n_head=2",
                 "--model-arg", "vocab_size=1000", "--seq-len", "8"]),
    ("seq_models:EmbedLSTM", ["--seq-len", "12"]),
])
def test_healthy_models_pass_bfloat16_with_the_default_limits(cli, spec: str, args: list[str]) -> None:
    pytest.importorskip({"timm": "timm", "hf": "transformers"}.get(spec.split(":")[0], "torch"))
    result = cli("diff", spec, *args, "--vs-dtype", "bfloat16", "--all")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "tolerance float32 vs bfloat16: rel L2 <= 0.13, cosine distance <= 0.0037 (default)" in result.stdout
    assert "PASSED" in result.stdout and result.stderr == ""


def test_a_pair_of_dtypes_takes_the_looser_row_and_given_rtol_atol_replace_it() -> None:
    from hookcli.commands.diff_numbers import tolerance_for

    bf16 = tolerance_for("float32", "bfloat16", None, None)
    assert (bf16.rtol, bf16.atol, bf16.rel_l2, bf16.cosine_distance) == (None, None, 0.13, 3.7e-3)
    assert tolerance_for("bfloat16", "float16", None, None).rel_l2 == 0.13  # bfloat16's row is below float16's
    f64 = tolerance_for("float64", "float32", None, None)
    assert (f64.rtol, f64.atol, f64.rel_l2, f64.cosine_distance) == (1e-5, 1e-5, None, None)
    assert (tolerance_for("float8_e4m3fn", "bfloat16", None, None).rtol) == 0.1  # any other float: last row
    given = tolerance_for("float32", "bfloat16", 0.1, None)
    assert (given.rtol, given.atol, given.rel_l2, given.cosine_distance, given.source) == (0.1, 1e-5, None, None,
                                                                                        "given")
    exact = tolerance_for("int64", "int64", 0.5, 0.5)
    assert (exact.rtol, exact.atol, exact.source) == (0.0, 0.0, "exact")


def test_a_wrong_bfloat16_path_fails_the_default_limits(cli, tmp_path: Path) -> None:
    from tiny_models import BrokenInBfloat16

    torch.manual_seed(0)
    model = BrokenInBfloat16().eval()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    report = hookcli.diff(model, inputs=[save_input(tmp_path, x)], all_modules=True, vs_dtype="bfloat16")
    ref_a = outputs_by_call(model, x)
    ref_b = outputs_by_call(copy.deepcopy(model).to(torch.bfloat16), x.to(torch.bfloat16))
    (tol,) = report.tolerances
    for row in report.rows:  # each verdict is the limits applied to plain torch's tensors
        a, b = ref_a[(row.name, row.call)], ref_b[(row.name, row.call)]
        assert row.errors.within == reference_within(a, b, tol), row.label
        assert row.errors.rel_l2 == pytest.approx(reference_errors(a, b)["rel_l2"], rel=1e-3), row.label
    assert reference_within(ref_a[("fc1", 0)], ref_b[("fc1", 0)], tol)  # the layers before are healthy
    assert not reference_within(ref_a[("fc2", 0)], ref_b[("fc2", 0)], tol)
    assert not report.ok and report.first_divergence.name == "fc2"
    out = cli("diff", "tiny_models:BrokenInBfloat16", "--input-shape", "8x16", "--vs-dtype", "bfloat16")
    assert out.exit_code == 1
    assert "first divergence: fc2" in out.stdout and "FAILED" in out.stdout
    assert out.stderr.startswith("Error: diff: final outputs differ beyond tolerance; first divergence: fc2")
    assert "Traceback" not in out.stderr


def test_run_b_gets_run_a_weights_also_for_a_versioned_state_dict(cli) -> None:
    """torchvision's MNASNet refuses a state dict without its modules' versions (``_metadata``): run B
    gets run A's weights through one (was: ValueError, exit 3)."""
    report = hookcli.diff("mnasnet0_5", vs_model="mnasnet0_5", input_shapes=["1x3x32x32"])
    assert report.ok and report.rows[0].final
    assert report.rows[0].errors.max_abs == 0  # B runs A's weights: the same numbers
    out = cli("diff", "mnasnet0_5", "--input-shape", "1x3x32x32", "--vs-dtype", "bfloat16")
    assert out.exit_code == 0 and out.stderr == ""


# --------------------------------------------------------------------------- two checkpoints


def test_checkpoints_differing_in_one_conv_first_divergence_is_that_conv(cli, resnet: nn.Module,
                                                                         tmp_path: Path) -> None:
    state = resnet.state_dict()
    torch.save(state, tmp_path / "a.pt")
    changed = dict(state)
    changed["layer3.0.conv1.weight"] = state["layer3.0.conv1.weight"] * 1.5
    torch.save(changed, tmp_path / "b.pt")
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))

    result = cli("diff", "resnet18", "--weights", tmp_path / "a.pt", "--vs-weights", tmp_path / "b.pt", "--all",
                 "--input", save_input(tmp_path, x), "-f", "json")
    assert result.exit_code == 1, result.stderr
    assert result.stderr.startswith("Error: diff: final outputs differ beyond tolerance")
    data = json.loads(result.stdout)
    assert data["ok"] is False
    assert data["first_divergence"] == {"name": "layer3.0.conv1", "call": 0, "output": "", "status": "diverged"}
    assert data["vs"]["changes"] == [f"weights: {tmp_path / 'b.pt'}"]

    # independently: with plain hooks, which calls finish before layer3.0.conv1, and which differ
    model_b = copy.deepcopy(resnet)
    model_b.load_state_dict(changed)
    ref_a, ref_b = outputs_by_call(resnet, x), outputs_by_call(model_b, x)
    rows = rows_by_key(data)
    order = list(ref_a)  # in the order calls finished
    before = order[: order.index(("layer3.0.conv1", 0))]
    assert before  # conv1, bn1, layer1, layer2, ... all finish before it
    for name, call in before:
        assert torch.equal(ref_a[(name, call)], ref_b[(name, call)])  # the test's own premise
        row = rows[(name, call, "")]
        assert row["errors"]["max_abs"] == 0 and row["errors"]["rel_l2"] == 0, name
        assert row["errors"]["sqnr_db"] == "inf" and row["status"] == "ok", name
    conv = rows[("layer3.0.conv1", 0, "")]
    want = reference_errors(ref_a[("layer3.0.conv1", 0)], ref_b[("layer3.0.conv1", 0)])
    assert conv["errors"]["rel_l2"] == pytest.approx(want["rel_l2"], rel=1e-4)
    assert conv["errors"]["max_abs"] == pytest.approx(want["max_abs"], rel=1e-5)


# --------------------------------------------------------------------------- identical runs


@pytest.mark.parametrize("spec, shape", [("tiny_models:Reused", "3x4"), ("tiny_models:TupleOut", "2x4")])
def test_identical_runs_all_differences_zero_exit_0(cli, spec: str, shape: str) -> None:
    result = cli("diff", spec, "--all", "--input-shape", shape, "-f", "json")
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""
    data = json.loads(result.stdout)
    assert data["ok"] is True and data["first_divergence"] is None
    assert data["vs"]["changes"] == []
    assert any("changes nothing" in n for n in data["notes"])
    compared = [r for r in data["rows"] if r["errors"] is not None]
    assert len(compared) == len(data["rows"])
    for row in compared:
        assert row["status"] == "ok"
        assert row["errors"] == {"max_abs": 0.0, "rel_l2": 0.0, "cosine": 1.0, "sqnr_db": "inf", "within": True}
        assert row["a"] == row["b"]
    if spec.endswith("Reused"):  # a reused module: one row per call
        assert [r["call"] for r in data["rows"] if r["name"] == "act"] == [0, 1, 2]
    else:  # tuple and dict outputs, an integer mask compared exactly
        assert {r["output"] for r in data["rows"] if r["name"] == "split"} == {"[0]", "[1]", "[2]"}
        assert {r["output"] for r in data["rows"] if r["final"]} == {"['out']", "['aux']"}
        assert {"a_dtype": "int64", "b_dtype": "int64", "rtol": 0.0, "atol": 0.0, "rel_l2": None,
                "cosine_distance": None, "source": "exact"} \
            in data["tolerances"]


# --------------------------------------------------------------------------- refactored copies


MODEL_A = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.act(self.fc2(self.act(self.fc1(x)))))
"""

# the same names and parameters; fc2 computes something else (a refactor that went wrong)
MODEL_B = MODEL_A.replace("self.fc2 = nn.Linear(8, 8)", "self.fc2 = Leaky(8, 8)") + """

class Leaky(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 1.01
"""

# fc2 has another output width (head follows it)
MODEL_C = MODEL_A.replace("self.fc2 = nn.Linear(8, 8)", "self.fc2 = nn.Linear(8, 6)").replace(
    "self.head = nn.Linear(8, 3)", "self.head = nn.Linear(6, 3)")


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(text))
    return f"{path}:Net"


def _load_net(spec: str) -> nn.Module:
    import importlib.util

    path = spec.rsplit(":", 1)[0]
    module_spec = importlib.util.spec_from_file_location(Path(path).stem + "_ref", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.Net().eval()


def test_refactored_copy_first_divergence_is_the_changed_layer(cli, tmp_path: Path) -> None:
    spec_a, spec_b = _write(tmp_path, "model_a", MODEL_A), _write(tmp_path, "model_b", MODEL_B)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(3))
    result = cli("diff", spec_a, "--vs-model", spec_b, "--all", "--input", save_input(tmp_path, x), "-f", "json")
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert data["first_divergence"]["name"] == "fc2"
    rows = rows_by_key(data)
    # plain torch: model B with model A's weights (hookcli seeds A's build with --seed 0), call by call
    torch.manual_seed(0)
    net_a = _load_net(spec_a)
    net_b = _load_net(spec_b)
    net_b.load_state_dict(net_a.state_dict())
    ref_a, ref_b = outputs_by_call(net_a, x), outputs_by_call(net_b, x)
    for (name, call), a in ref_a.items():
        row = rows[(name, call, "")]
        want = reference_errors(a, ref_b[(name, call)])
        assert row["errors"]["max_abs"] == pytest.approx(want["max_abs"], rel=1e-6, abs=0), name
        assert row["errors"]["rel_l2"] == pytest.approx(want["rel_l2"], rel=1e-6, abs=0), name
    assert rows[("fc1", 0, "")]["errors"]["max_abs"] == 0 and rows[("act", 0, "")]["status"] == "ok"
    assert rows[("fc2", 0, "")]["status"] == "diverged" and rows[("head", 0, "")]["status"] == "diverged"
    assert rows[("fc2", 0, "")]["errors"]["cosine"] == pytest.approx(1.0, abs=1e-9)  # B's fc2 is 1.01 x A's
    assert any("run A's weights" in n for n in data["notes"])


def test_vs_model_with_another_output_shape_is_a_divergence(cli, tmp_path: Path) -> None:
    spec_a, spec_c = _write(tmp_path, "model_a", MODEL_A), _write(tmp_path, "model_c", MODEL_C)
    result = cli("diff", spec_a, "--vs-model", spec_c, "--all", "--input-shape", "2x8")
    assert result.exit_code == 1
    assert "SHAPE" in result.stdout and "[2, 8] -> [2, 6]" in result.stdout
    assert "first divergence: fc2 (Linear, SHAPE)" in result.stdout
    assert result.stderr.startswith("Error: diff:")
    data = json.loads(cli("diff", spec_a, "--vs-model", spec_c, "--all", "--input-shape", "2x8",
                          "-f", "json").stdout)
    fc2 = rows_by_key(data)[("fc2", 0, "")]
    assert (fc2["status"], fc2["a"]["shape"], fc2["b"]["shape"], fc2["errors"]) == ("shape", [2, 8], [2, 6], None)
    assert any("fc2.weight" in n and "head.weight" in n for n in data["notes"])  # kept B's own init


# --------------------------------------------------------------------------- gradients


def test_grads_compare_output_gradients_with_autograd(tmp_path: Path) -> None:
    import tiny_models

    torch.manual_seed(0)
    model = tiny_models.Reused().eval()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(4))
    report = hookcli.diff(model, inputs=[save_input(tmp_path, x)], all_modules=True, vs_dtype="float64",
                          grads=True, loss="ce", target=1)

    def output_grads(m: nn.Module, inp: torch.Tensor) -> dict[tuple[str, int], torch.Tensor]:
        outs: dict[tuple[str, int], torch.Tensor] = {}
        counts: dict[str, int] = {}

        def hook(name: str):
            def record(_m, _i, out):
                index = counts.get(name, 0)
                counts[name] = index + 1
                outs[(name, index)] = out
            return record

        handles = [mod.register_forward_hook(hook(n)) for n, mod in m.named_modules()]
        try:
            out = m(inp)
        finally:
            for h in handles:
                h.remove()
        # (hookcli's loss keeps float64 outputs in float64; half precision goes up to float32)
        loss = nn.functional.cross_entropy(out if out.dtype == torch.float64 else out.float(),
                                           torch.full((inp.shape[0],), 1))
        keys = list(outs)
        return dict(zip(keys, torch.autograd.grad(loss, [outs[k] for k in keys])))

    grads_a = output_grads(model, x)
    grads_b = output_grads(copy.deepcopy(model).double(), x.double())
    assert {(r.name, r.call) for r in report.rows} == set(grads_a)
    for row in report.rows:
        want = reference_errors(grads_a[(row.name, row.call)], grads_b[(row.name, row.call)])
        assert row.grad is not None, row.label
        assert row.grad.rel_l2 == pytest.approx(want["rel_l2"], rel=1e-3, abs=1e-12), row.label
        assert row.grad.max_abs == pytest.approx(want["max_abs"], rel=1e-3, abs=1e-12), row.label
        assert row.grad_status == ("ok" if row.grad.within else "diverged")
    assert report.loss["kind"] == "cross_entropy" and report.loss["target"] == 1
    assert report.to_dict()["first_grad_divergence"] is None or report.first_grad_divergence is not None


# --------------------------------------------------------------------------- the numbers themselves


finite = st.floats(-1e3, 1e3, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(finite, finite), min_size=1, max_size=40), st.sampled_from([0.0, 1e-3, 0.1]))
def test_compare_matches_direct_float64(pairs: list[tuple[float, float]], rtol: float) -> None:
    a = torch.tensor([p[0] for p in pairs], dtype=torch.float64)
    b = torch.tensor([p[1] for p in pairs], dtype=torch.float64)
    errors = errors_from(compare(a, b, rtol).tolist(), atol=1e-4)
    d = (a - b).abs()
    assert errors.max_abs == pytest.approx(d.max().item(), rel=1e-12, abs=1e-300)
    assert errors.within == bool((d <= 1e-4 + rtol * a.abs()).all())
    if d.max() == 0:
        assert (errors.rel_l2, errors.sqnr_db) == (0.0, math.inf)
    elif a.norm() == 0:
        assert (errors.rel_l2, errors.sqnr_db) == (math.inf, -math.inf)
    else:
        assert errors.rel_l2 == pytest.approx((d.norm() / a.norm()).item(), rel=1e-9)
        assert errors.sqnr_db == pytest.approx(20 * math.log10(a.norm().item() / d.norm().item()), rel=1e-9,
                                               abs=1e-9)
    if a.norm() > 0 and b.norm() > 0:
        want = (a @ b / (a.norm() * b.norm())).clamp(-1, 1).item()
        assert errors.cosine == pytest.approx(want, abs=1e-12)


def test_zero_signal_and_nan_conventions() -> None:
    zero = torch.zeros(4)
    same = errors_from(compare(zero, zero.clone(), 0.0).tolist(), atol=0.0)
    assert (same.max_abs, same.rel_l2, same.cosine, same.sqnr_db, same.within) == (0.0, 0.0, 1.0, math.inf, True)
    off = errors_from(compare(zero, torch.ones(4), 0.0).tolist(), atol=0.0)
    assert (off.rel_l2, off.cosine, off.sqnr_db, off.within) == (math.inf, 0.0, -math.inf, False)
    nan_both = torch.tensor([1.0, math.nan])
    both = errors_from(compare(nan_both, nan_both.clone(), 0.0).tolist(), atol=0.0)
    assert both.max_abs == 0.0 and both.within is True  # NaN in the same place in both runs: equal
    one = errors_from(compare(torch.tensor([1.0, 2.0]), nan_both, 0.0).tolist(), atol=1.0)
    assert math.isnan(one.max_abs) and one.within is False


# --------------------------------------------------------------------------- CLI edges


def test_formats_table_markdown_csv(cli, tmp_path: Path) -> None:
    spec_a, spec_b = _write(tmp_path, "model_a", MODEL_A), _write(tmp_path, "model_b", MODEL_B)
    table = cli("diff", spec_a, "--vs-model", spec_b, "--input-shape", "2x8", "--all")
    assert table.exit_code == 1
    assert "first divergence: fc2 (Linear -> Leaky, DIVERGED)" in table.stdout
    assert "tolerance float32 vs float32: rtol 1e-05, atol 1e-05 (default)" in table.stdout
    assert "FAILED: the model's final outputs differ beyond tolerance" in table.stdout
    md = cli("diff", spec_a, "--vs-model", spec_b, "--input-shape", "2x8", "-f", "markdown")
    assert md.stdout.startswith("### hookcli diff:") and "| Layer | Type |" in md.stdout
    csv_out = cli("diff", spec_a, "--vs-model", spec_b, "--input-shape", "2x8", "-f", "csv", "--rtol", "0.1",
                  "--atol", "0").stdout.splitlines()
    header = csv_out[0].split(",")
    assert header[:5] == ["name", "call", "output", "final", "type"] and "sqnr_db" in header
    fc2 = dict(zip(header, next(line for line in csv_out[1:] if line.startswith("fc2,")).split(",")))
    assert fc2["status"] == "ok"  # 1% off is within --rtol 0.1
    assert fc2["a_shape"] == fc2["b_shape"] == "2x8"


def test_bad_usage_exits_2(cli) -> None:
    result = cli("diff", "tiny_models:Reused", "--input-shape", "2x4", "--vs-dtype", "int8")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("Error: unsupported --vs-dtype 'int8'")
    assert "  hint:" in result.stderr
    assert cli("diff", "tiny_models:Reused", "--rtol", "-1").exit_code == 2


def test_store_is_removed_also_when_run_b_raises(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec_a = _write(tmp_path, "model_a", MODEL_A)
    spec_bad = _write(tmp_path, "model_bad", MODEL_A.replace("return self.head(", "raise ValueError('boom')\n"
                                                             "        return self.head("))
    store_root = tmp_path / "tmp"
    store_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(store_root))
    result = cli("diff", spec_a, "--vs-model", spec_bad, "--input-shape", "2x8")
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: run B: the model raised in forward")
    assert os.listdir(store_root) == []
    assert cli("diff", spec_a, "--input-shape", "2x8").exit_code == 0
    assert os.listdir(store_root) == []


# --------------------------------------------------------------------------- the CPU float32 path and run A's store


FAST = [torch.float32, torch.float16, torch.bfloat16]
#: finite, overflowing, underflowing (float32 squares below its smallest normal), signed zeros, NaN, inf
any_value = st.one_of(st.floats(-1e4, 1e4, width=32), st.floats(width=32),
                      st.sampled_from([0.0, -0.0, 1e-30, -3e-25, 1e-40, 1e25, -3e38, math.nan, math.inf, -math.inf]))


def float64_reference(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> dict[str, float | bool]:
    """compare's numbers computed directly in float64: equal values (NaN against NaN, equal
    infinities) differ by 0 and are always within tolerance; an infinite or NaN difference never is
    (as torch.isclose)."""
    a, b = a.double().flatten(), b.double().flatten()
    same = (a == b) | (a.isnan() & b.isnan())
    d = torch.where(same, 0.0, a - b)
    return {"max_abs": d.abs().max().item(), "sa": a.dot(a).item(), "sb": b.dot(b).item(), "sd": d.dot(d).item(),
            "sab": a.dot(b).item(), "within": bool((same | (d.isfinite() & (d.abs() <= atol + rtol * a.abs()))).all())}


def assert_compare_matches(got: list[float], want: dict[str, float | bool], atol: float) -> None:
    max_abs, sa, sb, sd, sab, excess = got
    assert (not math.isnan(excess) and excess <= atol) == want["within"]
    for value, ref in ((max_abs, want["max_abs"]), (sa, want["sa"]), (sb, want["sb"]), (sd, want["sd"])):
        if math.isnan(ref) or math.isinf(ref):
            assert value == ref or (math.isnan(value) and math.isnan(ref))
        else:
            assert value == pytest.approx(ref, rel=1e-6, abs=1e-300)
    if math.isfinite(want["sab"]):
        assert abs(sab - want["sab"]) <= 1e-6 * math.sqrt(want["sa"] * want["sb"]) + 1e-300
    else:
        assert sab == want["sab"] or (math.isnan(sab) and math.isnan(want["sab"]))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(FAST), st.sampled_from(FAST), st.lists(any_value, min_size=1, max_size=50), st.data(),
       st.sampled_from([1, 3, 8, 64]), st.sampled_from([(0.0, 0.0), (1e-3, 1e-5), (0.1, 1e-2), (0.0, 0.5)]),
       st.booleans())
def test_float32_path_matches_float64_torch(dtype_a: torch.dtype, dtype_b: torch.dtype, values: list[float],
                                            data: st.DataObject, chunk: int, tolerance: tuple[float, float],
                                            stored: bool) -> None:
    a = torch.tensor(values, dtype=torch.float64).to(dtype_a)
    b = a.to(dtype_b)  # b: a with some elements changed (so that some chunks are equal, others not)
    for i, v in data.draw(st.dictionaries(st.integers(0, len(values) - 1), any_value, max_size=len(values))).items():
        b[i] = v
    rtol, atol = tolerance
    store = DiskStore()
    try:
        if stored:
            store.put("m", 0, "", a)
        source = store.source(store.items[("m", 0, "")]) if stored else a
        got = compare(source, b, rtol, atol, chunk=chunk).tolist()
    finally:
        store.close()
    assert_compare_matches(got, float64_reference(a, b, rtol, atol), atol)


@pytest.mark.parametrize("make_b", [lambda a: a.clone(), lambda a: a * (1 + 1e-4), lambda a: a.to(torch.bfloat16)])
def test_float32_path_sums_keep_float64_precision_over_many_elements(make_b) -> None:
    # a constant: the worst case of a plain float32 running sum (it is off by ~1e-3 here)
    a = torch.full((3 << 20,), 0.1) + torch.arange(3 << 20) % 7 * 1e-3
    b = make_b(a)
    got = compare(a, b, 1e-5, 1e-5).tolist()
    assert_compare_matches(got, float64_reference(a, b, 1e-5, 1e-5), 1e-5)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=0, max_size=4), st.data(), st.integers(1, 40))
def test_pieces_walk_any_layout_in_row_major_order(shape: list[int], data: st.DataObject, limit: int) -> None:
    base = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    order = data.draw(st.permutations(range(len(shape))))
    t = base.permute(tuple(order))  # transposed, channels-last-like, or contiguous
    if t.dim() and data.draw(st.booleans()):
        t = t[..., ::2]  # strided
    parts = list(pieces(t, limit))
    assert all(p.dim() == 1 and p.is_contiguous() and 0 < p.numel() <= limit for p in parts)
    joined = torch.cat(parts) if parts else torch.empty(0)
    assert torch.equal(joined, t.reshape(-1))


def test_store_round_trips_every_dtype_and_layout() -> None:
    g = torch.Generator().manual_seed(5)
    tensors = {
        "float32": torch.randn(3, 5, generator=g),
        "transposed": torch.randn(4, 6, generator=g).t(),
        "channels_last": torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
        "bfloat16": torch.randn(7, generator=g).to(torch.bfloat16),
        "float64": torch.randn(2, 2, generator=g).double(),
        "int64": torch.arange(-5, 5),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "complex": torch.randn(3, dtype=torch.complex64, generator=g),
        "lazily negated": torch.randn(4, dtype=torch.complex64, generator=g).conj().imag,  # neg bit set
    }
    store = DiskStore()
    try:
        for name, t in tensors.items():
            store.put(name, 0, "", t)
        for name, t in tensors.items():
            item = store.items[(name, 0, "")]
            want = torch.view_as_real(t.resolve_conj()) if t.is_complex() else t.resolve_neg()
            assert item.shape == list(want.shape) and item.dtype == want.dtype, name
            assert torch.equal(store.source(item).read(0, item.numel), want.reshape(-1)), name
            max_abs, sa, sb, sd, sab, excess = compare(store.source(item), t, 0.0).tolist()  # with itself
            want64 = want.double().reshape(-1)
            assert (max_abs, sd, excess) == (0, 0, 0) and sa == sb == sab, name
            assert sa == pytest.approx(want64.dot(want64).item(), rel=1e-6), name
    finally:
        store.close()


def test_store_writes_a_repeated_tensor_once_and_a_changed_one_again() -> None:
    store = DiskStore()
    try:
        t = torch.arange(6.0)
        store.put("child", 0, "", t)
        size = store.size
        store.put("parent", 0, "", t)  # the same object, unchanged: a Sequential and its last child
        assert store.items[("parent", 0, "")] is store.items[("child", 0, "")] and store.size == size
        store.put("view", 0, "", t[:])  # another tensor object on the same memory: written
        assert store.size == 2 * size
        t.add_(1)  # changed in place since (as an in-place ReLU does to its input)
        store.put("after", 0, "", t)
        assert store.size == 3 * size
        read = {k: store.source(v).read(0, 6).clone() for k, v in store.items.items()}
        assert torch.equal(read[("child", 0, "")], torch.arange(6.0))  # as it was when kept
        assert torch.equal(read[("after", 0, "")], torch.arange(6.0) + 1)
    finally:
        store.close()


class _AddInPlace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(1)  # the same object, changed: must be compared anew


class _Transposed(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.t()  # a non-contiguous view


class PassThrough(nn.Module):
    """Outputs that are other calls' output objects: a Sequential and its in-place ReLU, an Identity
    (called twice), a module that changes its input in place and returns it, a transposed view."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 6), nn.ReLU(inplace=True))
        self.keep = nn.Identity()
        self.bump = _AddInPlace()
        self.flip = _Transposed()
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.keep(self.bump(self.keep(self.body(x))))
        return self.head(self.flip(h))


@pytest.mark.parametrize("vs_dtype", [None, "bfloat16", "float64"])
@pytest.mark.parametrize("chunk", [None, 7])
def test_repeated_and_in_place_outputs_each_row_matches_plain_torch(vs_dtype: str | None, chunk: int | None,
                                                                    tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import hookcli.commands.diff_numbers as numbers

    if chunk is not None:  # chunk boundaries inside every tensor
        monkeypatch.setattr(numbers, "FAST_CHUNK", chunk)
        monkeypatch.setattr(numbers, "CHUNK", chunk)
    torch.manual_seed(0)
    model = PassThrough().eval()
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(6))
    report = hookcli.diff(model, inputs=[save_input(tmp_path, x)], all_modules=True, vs_dtype=vs_dtype)
    ref_a = outputs_by_call(model, x)
    dtype = {None: torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}[vs_dtype]
    ref_b = outputs_by_call(copy.deepcopy(model).to(dtype), x.to(dtype))
    assert {(r.name, r.call) for r in report.rows} == set(ref_a)
    assert torch.equal(ref_a[("keep", 1)], ref_a[("keep", 0)] + 1)  # the test's premise: changed in place
    for row in report.rows:
        a, b = ref_a[(row.name, row.call)], ref_b[(row.name, row.call)]
        want = reference_errors(a, b)
        got = row.errors
        assert got is not None, row.label
        assert got.max_abs == pytest.approx(want["max_abs"], rel=1e-6, abs=1e-12), row.label
        if want["max_abs"] == 0:
            assert (got.rel_l2, got.cosine, got.sqnr_db, got.within) == (0.0, 1.0, math.inf, True), row.label
        else:
            assert got.rel_l2 == pytest.approx(want["rel_l2"], rel=1e-5), row.label
            assert got.cosine == pytest.approx(want["cosine"], abs=1e-6), row.label
            assert got.sqnr_db == pytest.approx(want["sqnr_db"], abs=1e-4), row.label
        (tol,) = [t for t in report.tolerances if t.b_dtype == row.b_dtype]
        within = reference_within(a, b, tol)
        assert got.within == within, row.label


def test_no_room_for_run_a_is_a_clear_error_exit_2(tmp_path: Path) -> None:
    import resource
    import signal
    import subprocess
    import sys

    def small_files() -> None:  # at most 1 MB per file, and a write beyond it fails instead of killing
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    result = subprocess.run([sys.executable, "-m", "hookcli", "diff", "resnet18", "--all", "--input-shape", "1x3x64x64"],
                            capture_output=True, text=True, preexec_fn=small_files, cwd=tmp_path, timeout=scaled_timeout(300))
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines[0].startswith("Error: diff: cannot keep run A's outputs in ") and "File too large" in lines[0]
    assert lines[1].startswith("  hint: set TMPDIR") and len(lines) == 2


def test_vs_compile_compares_every_module_of_the_compiled_run(recwarn: pytest.WarningsRecorder) -> None:
    """Run B under torch.compile: its hooks run eagerly (no warning from torch about hooks), every
    selected module gets a row, and the compiled numbers agree with the eager ones within float32
    tolerance, as plain torch says they do."""
    torch.compiler.reset()  # a graph another test compiled for the same structure would run without hooks
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(3))).eval()
    report = hookcli.diff(model, input_shapes=["2x8"], all_modules=True, vs_compile=True)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))  # the input hookcli made (seed 0)
    with torch.no_grad():
        want = (model(x) - torch.compile(model)(x)).abs().max().item()
    assert report.ok and report.first_divergence is None
    assert {r.name for r in report.rows} == {n for n, _ in model.named_modules()}
    final = next(r for r in report.rows if r.final)
    assert final.errors is not None and final.errors.max_abs == pytest.approx(want, abs=1e-6)
    assert not [w for w in recwarn if "hooks" in str(w.message)]
