"""Complex-valued models: statistics of the magnitude |z|, never an internal error.

An FNO-style spectral network (``tiny_models.TinyFNO``: a complex ``nn.Parameter``, rfft2/irfft2, a
submodule returning a complex spectrum) gave exit 3 in ``grads`` and ``check`` ("linalg.vector_norm: dtype
should be complex"). Every number here is checked against plain torch's ``|z|`` in float64.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import hookcli
import tiny_models
from hookcli.engine.run import COMPLEX_NOTE
from test_model_sources import expected_stats, reference_outputs

SPEC = "tiny_models:TinyFNO"


def _model() -> tiny_models.TinyFNO:
    torch.manual_seed(0)  # as hookcli builds it (seed 0)
    return tiny_models.TinyFNO()


def _close(got: dict[str, Any], want: dict[str, float]) -> None:
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_stats_of_a_complex_output_are_of_its_magnitude(cli: Any) -> None:
    result = cli("stats", SPEC, "-f", "json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert COMPLEX_NOTE in report["notes"]
    model = _model()
    outputs, _ = reference_outputs(model, *model.example_inputs)
    rows = {r["name"]: r for r in report["layers"]}
    assert rows["spectrum"]["dtype"] == "complex64"
    for (name, _call, _path), tensor in outputs.items():
        _close(rows[name]["stats"], expected_stats(tensor.abs() if tensor.is_complex() else tensor))


def test_grads_of_a_complex_parameter_are_of_its_magnitude(cli: Any) -> None:
    result = cli("grads", SPEC, "-f", "json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    model = _model()
    x = model.example_inputs[0]
    loss = F.cross_entropy(model(x), torch.zeros(x.shape[0], dtype=torch.long))
    assert report["loss"]["value"] == pytest.approx(loss.item(), rel=1e-5)
    params = dict(model.named_parameters())
    grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
    rows = {r["name"]: r for r in report["params"]}
    weight = rows["spectral.weight"]
    assert weight["norm"] == pytest.approx(torch.linalg.vector_norm(params["spectral.weight"].detach().cdouble()).item())
    for name, g in grads.items():
        want = expected_stats(g.abs() if g.is_complex() else g)
        _close(rows[name]["grad"], {k: want[k] for k in ("mean", "std", "min", "max", "norm")})


@pytest.mark.filterwarnings("error:Casting complex values to real")  # (the imaginary part is judged too)
@pytest.mark.parametrize("args", [(), ("--steps", "10")], ids=["check", "check --steps 10"])
def test_check_judges_a_complex_model(cli: Any, args: tuple[str, ...]) -> None:
    result = cli("check", SPEC, *args, "-f", "json")
    assert result.exit_code in (0, 1), result.stderr  # (1: a rule's verdict on a tiny random model)
    report = json.loads(result.stdout)
    rules = {r["rule"]: r for r in report["rules"]}
    assert rules["runs"]["status"] == "PASS" and rules["finite"]["status"] == "PASS"
    changed = rules.get("params_change") or rules["params_update"]
    assert changed["status"] == "PASS", changed
    assert report["report"]["failure"] is None


def test_watch_model_runs_a_complex_model(cli: Any) -> None:
    result = cli("watch", SPEC, "--steps", "3")
    assert result.exit_code == 0, result.stderr
    assert "3 steps, 3 logged" in result.stdout


def test_hookcli_watch_in_a_loop_is_bit_for_bit_and_logs_magnitudes(tmp_path: Path) -> None:
    plain, watched = _model(), _model()
    x = plain.example_inputs[0]
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in (plain, watched)]

    def step(model: Any, opt: Any) -> float:
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        return loss.item()

    want = [step(plain, opts[0]) for _ in range(4)]
    grads, norms = [], []
    with hookcli.watch(watched, opts[1], every=1, out=tmp_path / "log.jsonl"):
        got = []
        for _ in range(4):
            norms.append(torch.linalg.vector_norm(watched.spectral.weight.detach().cdouble()).item())
            got.append(step(watched, opts[1]))
            grads.append(watched.spectral.weight.grad.clone())
    assert got == want
    for a, b in zip(plain.state_dict().values(), watched.state_dict().values()):
        assert torch.equal(a, b)
    lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2, 3]
    for line, g, norm in zip(lines, grads, norms):
        row = next(p for p in line["params"] if p["name"] == "spectral.weight")
        want_stats = expected_stats(g.abs())
        _close(row["grad"], {k: want_stats[k] for k in ("mean", "std", "min", "max")})
        assert row["norm"] == pytest.approx(norm, rel=1e-5)
