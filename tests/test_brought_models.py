"""Models people bring (issue #20, part 4a): inputs that fit the model, whatever it is.

Real tiny-config models only (transformers ``from_config``, torchvision with ``weights=None``), every
number checked against plain torch computed here.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from test_model_sources import assert_layers_match, reference_outputs, run_json

transformers = pytest.importorskip("transformers")

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 37}


def _saved(tmp_path: Any, name: str, model: torch.nn.Module) -> str:
    """``hf:DIR`` of ``model`` saved with save_pretrained (its weights, not hookcli's seed)."""
    model.save_pretrained(tmp_path / name)
    return f"hf:{tmp_path / name}"


def tiny_clip() -> torch.nn.Module:
    config = transformers.CLIPConfig(
        text_config=dict(TINY, vocab_size=100),  # max_position_embeddings: CLIP's 77
        vision_config=dict(TINY, image_size=32, patch_size=8), projection_dim=16)
    return transformers.CLIPModel(config).eval()


def tiny_whisper(source: int = 30, target: int = 40) -> torch.nn.Module:
    config = transformers.WhisperConfig(
        d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=37, decoder_ffn_dim=37, num_mel_bins=8, max_source_positions=source,
        max_target_positions=target, vocab_size=100, pad_token_id=1, bos_token_id=2, eos_token_id=3,
        decoder_start_token_id=2, suppress_tokens=None, begin_suppress_tokens=None)
    return transformers.WhisperForConditionalGeneration(config).eval()


# --------------------------------------------------------------------------- position limits


def test_clip_text_gets_at_most_its_77_positions_and_stats_match_torch(cli: Any, tmp_path: Any) -> None:
    model = tiny_clip()
    report = run_json(cli, "stats", _saved(tmp_path, "clip", model))
    inputs = {i["name"]: i for i in report["inputs"]}
    assert inputs["input_ids"]["shape"] == [1, 77]
    assert "text_config.max_position_embeddings" in inputs["input_ids"]["source"]
    gen = torch.Generator().manual_seed(0)  # one seeded generator, inputs drawn in order
    pixels = torch.randn((1, 3, 32, 32), generator=gen)
    ids = torch.randint(0, 100, (1, 77), generator=gen)
    outputs, _ = reference_outputs(model, input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels)
    assert_layers_match(report["layers"], outputs, "stats")


@pytest.mark.parametrize(("source", "target"), [(30, 40), (60, 24)])
def test_whisper_decoder_ids_fit_every_position_limit(cli: Any, tmp_path: Any, source: int, target: int) -> None:
    spec = _saved(tmp_path, "whisper", tiny_whisper(source, target))
    for command in ("shapes", "stats", "grads", "check"):
        result = cli(command, spec, "-f", "json")
        assert result.exit_code == 0, (command, result.stderr)
    inputs = {i["name"]: i for i in json.loads(cli("stats", spec, "-f", "json").stdout)["inputs"]}
    assert inputs["decoder_input_ids"]["shape"] == [1, min(source, target)]
    assert inputs["input_features"]["shape"] == [1, 8, 2 * source]


def test_explicit_seq_len_is_kept(cli: Any, tmp_path: Any) -> None:
    report = run_json(cli, "shapes", _saved(tmp_path, "clip", tiny_clip()), "--seq-len", "9")
    inputs = {i["name"]: i for i in report["inputs"]}
    assert inputs["input_ids"]["shape"] == [1, 9] and "max_position" not in inputs["input_ids"]["source"]


def test_shapes_of_a_large_hf_config_runs_on_meta(cli: Any) -> None:
    """mistral's own config (hidden 4096, vocabulary 32000; one layer keeps the build short): built and run
    on the meta device, no 2 GB of weights on the CPU."""
    report = run_json(cli, "shapes", "hf:mistral", "--model-arg", "num_hidden_layers=1")
    assert report["device"] == "meta"
    assert report["model"]["params"] > 400_000_000
    assert not any("ran on cpu" in n for n in report["notes"])
    rows = {r["name"]: r for r in report["layers"]}
    assert rows["lm_head"]["shape"] == [1, 128, 32000]


# --------------------------------------------------------------------------- train mode: batch 2


class BatchNormHead(torch.nn.Module):
    """A Linear then BatchNorm1d: in train mode a batch of 1 makes BatchNorm raise."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 6)
        self.bn = torch.nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x))


@pytest.mark.parametrize("command", ["stats", "shapes", "grads"])
def test_train_mode_gets_a_batch_of_2_said_in_the_header(cli: Any, command: str) -> None:
    result = cli(command, "test_brought_models:BatchNormHead", "--train", "--device", "cpu")
    assert result.exit_code == 0, result.stderr
    assert "[2, 4] float32" in result.stdout and "batch of 2 in train mode" in result.stdout
    assert result.stderr == ""


def test_train_mode_stats_match_torch_in_train_mode(cli: Any) -> None:
    report = run_json(cli, "stats", "test_brought_models:BatchNormHead", "--train")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = BatchNormHead().train()
    x = torch.randn((2, 4), generator=torch.Generator().manual_seed(0))
    outputs, _ = reference_outputs(model, x)
    assert_layers_match(report["layers"], outputs, "stats")


def test_batch_size_and_input_shapes_win_over_the_train_batch(cli: Any) -> None:
    report = run_json(cli, "stats", "test_brought_models:BatchNormHead", "--train", "--batch-size", "3")
    assert report["inputs"][0]["shape"] == [3, 4] and "train mode" not in report["inputs"][0]["source"]
    bad = cli("stats", "test_brought_models:BatchNormHead", "--train", "--input-shape", "1x4")
    assert bad.exit_code == 1 and bad.stdout and "Error:" in bad.stderr  # the model raised on the batch asked for
