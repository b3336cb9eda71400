"""Round-4 tryout of the one-shot commands on models no other test uses, as a new user would.

Every number is checked against plain torch computed here in float64 (``torch.autograd.grad`` for
gradients), on the same input and weights.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import hookcli
import tiny_models
from test_model_sources import expected_stats, reference_outputs

FNO = "tiny_models:TinyFNO"
_COMPLEX_OF = {torch.float32: torch.complex64, torch.float64: torch.complex128}


def _fno(dtype: torch.dtype = torch.float32) -> tiny_models.TinyFNO:
    """TinyFNO as hookcli builds it (seed 0), its real tensors in ``dtype`` and complex ones in the
    complex dtype of that precision, converted by hand (``Module.to`` would drop the imaginary parts)."""
    torch.manual_seed(0)
    model = tiny_models.TinyFNO()
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(_COMPLEX_OF[dtype] if p.is_complex() else dtype)
    return model


def _close(got: dict[str, Any], want: dict[str, Any]) -> None:
    for key in ("mean", "std", "min", "max", "norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), key


@pytest.mark.filterwarnings("error:Casting complex values to real")
def test_dtype_float64_computes_complex_weights_in_complex128(cli: Any) -> None:
    """``--dtype float64`` cast a complex weight to float64 (``Module.to`` keeps only the real part), so
    the model raised at its spectral layer (exit 1, blaming the model). Its complex weights must run in
    complex128, the statistics those of the float64 model."""
    result = cli("stats", FNO, "--dtype", "float64", "-f", "json")
    assert result.exit_code == 0, result.stderr
    rows = {r["name"]: r for r in json.loads(result.stdout)["layers"]}
    model = _fno(torch.float64)
    outputs, _ = reference_outputs(model, model.example_inputs[0].double())
    assert rows["spectrum"]["dtype"] == "complex128"
    for (name, _call, _path), tensor in outputs.items():
        _close(rows[name]["stats"], expected_stats(tensor.abs() if tensor.is_complex() else tensor))


@pytest.mark.filterwarnings("error:Casting complex values to real")
def test_diff_against_float64_of_a_complex_model_passes(cli: Any) -> None:
    result = cli("diff", FNO, "--vs-dtype", "float64")
    assert result.exit_code == 0, result.stderr + result.stdout
    assert "PASSED" in result.stdout


@pytest.mark.filterwarnings("error:Casting complex values to real")
def test_api_dtype_float64_leaves_a_complex_model_as_it_was() -> None:
    model = _fno()
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = hookcli.grads(model, dtype="float64", params="none")
    x = model.example_inputs[0].double()
    ref = _fno(torch.float64).eval()
    out = {}
    ref.spectrum.register_forward_hook(lambda m, a, o: out.__setitem__("z", o))
    logits = ref(x)
    loss = torch.nn.functional.cross_entropy(logits, torch.zeros(x.shape[0], dtype=torch.long))
    (g,) = torch.autograd.grad(loss, out["z"])
    row = next(r for r in report.layers if r.name == "spectrum")
    _close(row.grad, expected_stats(g.abs()))
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    assert model.training and not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
