"""``shapes`` on the meta device for mixture-of-experts and vision-language models.

A meta run has no values: a mixture-of-experts layer's ``grouped_mm`` (whose meta kernel refuses float32)
and a vision-language model's count of image tokens in ``input_ids`` (``.item()``) stopped it, and the
fallback to a real build could not fit. Each family runs here at a tiny config; its parameter count is
checked against the model built with transformers directly, and every row's shape against a real forward
on the CPU of the same model with the inputs made here (image placeholders counted from the config).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from hookcli.commands.shapes import META_NOTE
from hookcli.engine.meta_values import MetaValues
from hookcli.engine.sources import smaller_config
from test_model_sources import reference_outputs, run_json

transformers = pytest.importorskip("transformers")

TEXT = {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "vocab_size": 100}
VISION = {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 2}

#: model type -> (tiny config fields, image placeholders per sample from the config's own formula)
FAMILIES: dict[str, tuple[dict[str, Any], int]] = {
    "qwen3_moe": (dict(TEXT, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2), 0),
    # (experts' widths a multiple of 4 floats: the CPU kernel of grouped_mm wants 16-byte strides)
    "mixtral": (dict(TEXT, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2), 0),
    "olmoe": (dict(TEXT, intermediate_size=32, num_experts=4, num_experts_per_tok=2), 0),
    "deepseek_v3": (dict(TEXT, num_key_value_heads=2, moe_intermediate_size=16, n_routed_experts=4,
                         num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
                         q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8), 0),
    # (32 / 8)^2 patches; llava's default strategy drops the class token
    "llava": ({"text_config": dict(TEXT, vocab_size=200), "image_token_index": 150,
               "vision_config": dict(VISION, image_size=32, patch_size=8)}, 16),
    "paligemma": ({"text_config": dict(TEXT, vocab_size=200, head_dim=16), "image_token_index": 150,
                   "projection_dim": 32, "vision_config": dict(VISION, image_size=32, patch_size=8)}, 16),
    # (64 / 16)^2 patches, pixel-shuffled by scale_factor 2 in each direction
    "idefics3": ({"text_config": dict(TEXT, vocab_size=200), "image_token_id": 150, "scale_factor": 2,
                  "vision_config": dict(VISION, image_size=64, patch_size=16)}, 4),
}


def _args(fields: dict[str, Any]) -> list[str]:
    return [a for k, v in fields.items() for a in ("--model-arg", f"{k}={v!r}")]


def _model(model_type: str, cls_name: str, fields: dict[str, Any], device: str = "cpu") -> nn.Module:
    config = transformers.AutoConfig.for_model(model_type, **fields)
    with torch.device(device):
        return getattr(transformers, cls_name)(config).eval()


def _reference_inputs(model: nn.Module, model_type: str, images: int) -> dict[str, torch.Tensor]:
    """input_ids of 128 text tokens after ``images`` placeholders, pixel_values at the config's size."""
    config = model.config
    text = getattr(config, "text_config", config)
    ids = torch.randint(0, 100, (1, 128))
    if not images:
        return {"input_ids": ids}
    token = getattr(config, "image_token_id", None) or config.image_token_index
    ids = torch.cat([torch.full((1, images), token), ids], dim=1)
    size = config.vision_config.image_size
    pixels = torch.randn(1, 3, size, size) if model_type != "idefics3" else torch.randn(1, 1, 3, size, size)
    assert text.vocab_size > token
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_shapes_runs_on_meta_with_the_configs_params_and_real_shapes(cli: Any, model_type: str) -> None:
    fields, images = FAMILIES[model_type]
    report = run_json(cli, "shapes", f"hf:{model_type}", *_args(fields))
    assert report["device"] == "meta" and META_NOTE in report["notes"], report["notes"]
    cls_name = report["model"]["class"]
    on_meta = _model(model_type, cls_name, fields, "meta")
    assert report["model"]["params"] == sum(p.numel() for p in on_meta.parameters())  # (each tied one once)
    model = _model(model_type, cls_name, fields)
    inputs = _reference_inputs(model, model_type, images)
    ids = next(i for i in report["inputs"] if i["name"] == "input_ids")
    assert ids["shape"] == list(inputs["input_ids"].shape)
    outputs, _ = reference_outputs(model, **inputs)
    rows = {(r["name"], r["call"], r["output"]): r for r in report["layers"] if r["called"]}
    compared = 0
    for where, tensor in outputs.items():
        if where in rows:
            assert rows[where]["shape"] == list(tensor.shape), where
            compared += 1
    assert compared >= 2, (sorted(rows), sorted(outputs))


def test_values_that_follow_from_the_inputs_are_known_on_meta() -> None:
    """``.item()``, ``.tolist()``, ``nonzero`` and a boolean mask of a meta tensor computed from an input
    give what plain torch gives on the CPU; what depends on meta weights still has no value."""
    ids = torch.tensor([[5, 7, 5, 1, 5]])
    weight = nn.Parameter(torch.empty(3, 10, device="meta"))
    with MetaValues():
        on_meta = ids.to("meta")
        mask = on_meta == 5
        assert mask.sum().item() == 3 and bool(mask.any())
        assert (on_meta * 2 + 1).tolist() == (ids * 2 + 1).tolist()
        assert on_meta.nonzero().shape == ids.nonzero().shape
        embedded = torch.randn(1, 5, 4).to("meta")
        assert embedded[mask].shape == (3, 4)
        assert torch.arange(6, device="meta").sum().item() == 15
        logits = nn.functional.linear(torch.randn(1, 10).to("meta"), weight)
        with pytest.raises(RuntimeError):
            logits.argmax().item()  # the weights have no values: no value either
        grows = torch.zeros(4, dtype=torch.long).to("meta")
        grows.add_(logits.sum().long())  # written with unknown values: unknown now
        with pytest.raises(RuntimeError):
            grows[0].item()


def test_grouped_mm_on_meta_in_float32_matches_the_cpu_kernel() -> None:
    if not hasattr(torch.nn.functional, "grouped_mm"):
        pytest.skip("no grouped_mm in this torch")
    a, b = torch.randn(10, 32), torch.randn(3, 32, 8)
    offs = torch.tensor([4, 7, 10], dtype=torch.int32)
    want = torch.nn.functional.grouped_mm(a, b, offs=offs)
    with MetaValues():
        got = torch.nn.functional.grouped_mm(a.to("meta"), b.to("meta"), offs=offs.to("meta"))
    assert got.device.type == "meta" and got.shape == want.shape and got.dtype == want.dtype


def test_the_smaller_config_hint_names_where_the_config_keeps_its_layers() -> None:
    llava = transformers.AutoConfig.for_model("llava")
    assert smaller_config(llava) == "--model-arg \"text_config={'num_hidden_layers': 2}\""
    assert smaller_config(transformers.AutoConfig.for_model("gpt2")) == "--model-arg num_hidden_layers=2"  # (n_layer)


def test_the_smaller_config_hint_builds_a_smaller_model(cli: Any) -> None:
    """The hint's --model-arg is accepted and gives the text model two layers (the hint that is run)."""
    hint = smaller_config(transformers.AutoConfig.for_model("llava"))
    value = hint.removeprefix("--model-arg ").strip('"')
    fields, _ = FAMILIES["llava"]
    report = run_json(cli, "shapes", "hf:llava", "--model-arg", value, "--model-arg",
                      f"vision_config={fields['vision_config']!r}", "--model-arg", "image_token_index=150")
    layers = {r["name"] for r in report["layers"]}
    assert report["model"]["model_args"]["text_config"] == {"num_hidden_layers": 2} and layers
