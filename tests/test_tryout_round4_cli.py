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
from hookcli.engine.build_inputs import detection_targets
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


# ---------------------------------------------------------------- models no other test builds

MODELS_FILE = '''
import torch


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                        max_position_embeddings=64))


def whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    torch.manual_seed(0)
    return WhisperForConditionalGeneration(WhisperConfig(
        d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=20,
        max_target_positions=16, vocab_size=100, decoder_start_token_id=1, pad_token_id=0, bos_token_id=1,
        eos_token_id=2))


def effnet():
    import timm
    torch.manual_seed(0)
    return timm.create_model("efficientnet_b0", pretrained=False, num_classes=10)
'''


@pytest.fixture
def zoo(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``zoo.py`` with the models above, importable here too, in a scratch working directory."""
    (tmp_path / "zoo.py").write_text(MODELS_FILE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    import zoo as module

    return importlib.reload(module)


def _hooked(model: torch.nn.Module, names: list[str]) -> dict[str, Any]:
    outputs: dict[str, Any] = {}
    for name in names:
        model.get_submodule(name).register_forward_hook(lambda m, a, o, n=name: outputs.__setitem__(n, o))
    return outputs


def _first(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]


def _next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize(("name", "inputs", "layers"), [
    ("llama", lambda g: {"input_ids": torch.randint(0, 100, (2, 8), generator=g)}, ["model.layers.0", "lm_head"]),
    ("whisper", lambda g: {"input_features": torch.randn(1, 16, 40, generator=g),
                           "decoder_input_ids": torch.randint(0, 100, (1, 6), generator=g)},
     ["model.encoder.layers.0", "proj_out"]),
], ids=["llama-gqa", "whisper"])
def test_stats_and_grads_of_tiny_transformers_match_float64_torch(cli: Any, zoo: Any, name: str, inputs: Any,
                                                                  layers: list[str]) -> None:
    x = inputs(torch.Generator().manual_seed(1))
    torch.save(x, "x.pt")
    common = (f"zoo.py:{name}", "--input", "x.pt", "--layers", ",".join(layers), "-f", "json")
    stats, grads = cli("stats", *common), cli("grads", *common, "--params", "none")
    assert stats.exit_code == 0 and grads.exit_code == 0, stats.stderr + grads.stderr
    model = getattr(zoo, name)().eval()
    outputs = _hooked(model, layers)
    logits = model(**x).logits
    loss = _next_token_loss(logits, x["decoder_input_ids"] if "decoder_input_ids" in x else x["input_ids"])
    report = json.loads(grads.stdout)
    assert report["loss"]["value"] == pytest.approx(loss.item(), rel=1e-6)
    wanted = torch.autograd.grad(loss, [_first(outputs[n]) for n in layers])
    assert len(json.loads(stats.stdout)["layers"]) == len(report["layers"]) == len(layers)
    for row, grad_row, layer, g in zip(json.loads(stats.stdout)["layers"], report["layers"], layers, wanted):
        assert row["name"] == grad_row["name"] == layer
        _close(row["stats"], expected_stats(_first(outputs[layer])))
        _close(grad_row["grad"], expected_stats(g))


def test_efficientnet_stats_grads_and_check_hand_the_model_back(zoo: Any) -> None:
    model = zoo.effnet().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    layers = ["conv_stem", "blocks.6"]
    stats = hookcli.stats(model, inputs=x, layers=layers)
    grads = hookcli.grads(model, inputs=x, layers=layers, params="none")
    hookcli.check(model, inputs=x)  # train mode and an SGD step, all undone
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    assert all(m.training for m in model.modules()) and all(p.grad is None for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in model.modules())
    ref = zoo.effnet().eval()
    outputs = _hooked(ref, layers)
    loss = torch.nn.functional.cross_entropy(ref(x), torch.zeros(2, dtype=torch.long))
    assert grads.loss["value"] == pytest.approx(loss.item(), rel=1e-6)
    wanted = torch.autograd.grad(loss, [outputs[n] for n in layers])
    assert [r.name for r in stats.layers] == [r.name for r in grads.layers] == layers
    for row, grad_row, layer, g in zip(stats.layers, grads.layers, layers, wanted):
        _close(row.stats, expected_stats(outputs[layer]))
        _close(grad_row.grad, expected_stats(g))


@pytest.mark.parametrize("name", ["tiny_fasterrcnn", "tiny_maskrcnn"])
def test_a_detection_models_input_shape_gets_targets_in_train_mode(cli: Any, name: str) -> None:
    """``check --input-shape`` (and ``grads --train``) on a detection model: its default images got
    synthetic targets, a batch of the user's shape none, so the model stopped with "targets should not be
    none when in training mode" (exit 1, blamed on the model). The loss is the model's own, from plain torch."""
    check = cli("check", f"tiny_models:{name}", "--input-shape", "2x3x64x48", "-f", "json")
    assert check.exit_code in (0, 1), check.stderr  # (1: a rule's verdict on a tiny random model)
    rules = {r["rule"]: r for r in json.loads(check.stdout)["rules"]}
    assert rules["runs"]["status"] == "PASS", rules["runs"]
    result = cli("grads", f"tiny_models:{name}", "--train", "--input-shape", "2x3x64x48", "-f", "json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["failure"] is None and report["loss"]["kind"] == "model_loss"
    torch.manual_seed(0)  # as hookcli builds and runs it (seed 0)
    model = getattr(tiny_models, name)().train()
    gen = torch.Generator().manual_seed(0)
    images = list(torch.randn(2, 3, 64, 48, generator=gen).unbind(0))
    targets, _ = detection_targets(model, 48, 2, gen, 0)
    assert all((t["boxes"][:, 2:] <= 48).all() for t in targets)
    torch.manual_seed(0)
    want = sum(model(images, targets).values()).item()
    assert report["loss"]["value"] == pytest.approx(want, rel=1e-5)
