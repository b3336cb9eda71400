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
from hookcli.commands.diff_numbers import compare, errors_from
from reference import outputs_by_call

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
        within = bool(((a.double() - b.double()).abs() <= tol.atol + tol.rtol * a.double().abs()).all())
        assert got.within == within and row.status == ("ok" if within else "diverged"), row.label
    finals = [r for r in rows if r.final]
    assert [r.name for r in finals] == [""]
    assert report.ok == finals[0].errors.within


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
        assert {"a_dtype": "int64", "b_dtype": "int64", "rtol": 0.0, "atol": 0.0, "source": "exact"} \
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
        loss = nn.functional.cross_entropy(out.float(), torch.full((inp.shape[0],), 1))
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
