"""Audio and time-series models run with no flags: their inputs from what the config says.

``hf:encodec`` got ``1x16000`` (a codec takes ``[batch, audio_channels, time]``) and ``hf:patchtst`` a
``1x1`` guess (a forecaster takes ``past_values`` of ``[batch, context_length, num_input_channels]``).
Tiny configs; statistics checked against plain torch on the inputs made here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from test_model_sources import assert_layers_match, reference_outputs, run_json

transformers = pytest.importorskip("transformers")

WAVE = {"conv_dim": [8, 8], "conv_stride": [5, 2], "conv_kernel": [10, 3], "num_conv_pos_embeddings": 16,
        "num_conv_pos_embedding_groups": 2}
#: model type -> (tiny config fields, the input the config says: name, shape)
MODELS: dict[str, tuple[dict[str, Any], str, list[int]]] = {
    "encodec": ({"num_filters": 4, "hidden_size": 16, "codebook_dim": 16, "codebook_size": 32,
                 "num_lstm_layers": 1, "target_bandwidths": [1.5], "audio_channels": 2, "sampling_rate": 800},
                "input_values", [1, 2, 800]),
    "patchtst": ({"d_model": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "ffn_dim": 16, "context_length": 24,
                  "num_input_channels": 3, "patch_length": 4, "patch_stride": 4}, "past_values", [1, 24, 3]),
    "patchtsmixer": ({"d_model": 8, "num_layers": 1, "context_length": 16, "num_input_channels": 2, "patch_length": 4,
                      "patch_stride": 4}, "past_values", [1, 16, 2]),
    "hubert": (dict(WAVE, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16),
               "input_values", [1, 16000]),
    "speecht5": (dict(WAVE, hidden_size=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                      decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16), "input_values", [1, 16000]),
}


def _args(fields: dict[str, Any]) -> list[str]:
    return [a for k, v in fields.items() for a in ("--model-arg", f"{k}={v!r}")]


@pytest.mark.parametrize("model_type", list(MODELS))
def test_stats_with_no_flags_gets_the_input_the_config_says(cli: Any, model_type: str) -> None:
    fields, name, shape = MODELS[model_type]
    report = run_json(cli, "stats", f"hf:{model_type}", *_args(fields))
    inputs = {i["name"]: i for i in report["inputs"]}
    assert inputs[name]["shape"] == shape
    if model_type not in ("encodec", "patchtst", "patchtsmixer"):
        return
    torch.manual_seed(0)  # as hookcli builds it
    config = transformers.AutoConfig.for_model(model_type, **fields)
    model = getattr(transformers, report["model"]["class"])(config).eval()
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    outputs, _ = reference_outputs(model, **{name: x})
    assert_layers_match(report["layers"], outputs, "stats")
