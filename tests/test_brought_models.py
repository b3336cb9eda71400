"""Models people bring (issue #20, part 4a): inputs that fit the model, whatever it is.

Real tiny-config models only (transformers ``from_config``, torchvision with ``weights=None``), every
number checked against plain torch computed here.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


# --------------------------------------------------------------------------- check on wav2vec2


def tiny_wav2vec2() -> torch.nn.Module:
    config = transformers.Wav2Vec2Config(
        **TINY, conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2, vocab_size=20)
    return transformers.Wav2Vec2Model(config).eval()


def test_check_on_wav2vec2_passes_in_train_and_eval_mode(cli: Any, tmp_path: Any) -> None:
    """Its feature encoder sets requires_grad on a tensor made from the input in train mode (hookcli
    used to make the input require grad, so it raised); in eval mode masked_spec_embed (training-time
    masking only) is never read: a warning that says so, not "a .detach()?"."""
    spec = _saved(tmp_path, "w2v", tiny_wav2vec2())
    train = cli("check", spec, "-f", "json")
    assert train.exit_code == 0, train.stderr
    assert json.loads(train.stdout)["ok"] is True
    evaluated = cli("check", spec, "--eval")
    assert evaluated.exit_code == 0, evaluated.stderr
    assert "masked_spec_embed gets no gradient: this forward never reads it (eval mode" in evaluated.stdout
    assert "detach" not in evaluated.stdout + evaluated.stderr


def test_wav2vec2_parameter_gradients_match_autograd_without_input_grad(cli: Any, tmp_path: Any) -> None:
    model = tiny_wav2vec2()
    report = run_json(cli, "grads", _saved(tmp_path, "w2v", model), "--params", "all")
    x = torch.randn((1, 16000), generator=torch.Generator().manual_seed(0))
    loss = model(input_values=x).last_hidden_state.float().square().mean()  # hookcli's auto loss here
    assert report["loss"]["kind"] == "mean_square" and report["loss"]["value"] == pytest.approx(loss.item(), rel=1e-5)
    named = dict(model.named_parameters())
    used = [n for n in named if n != "masked_spec_embed"]
    grads = dict(zip(used, torch.autograd.grad(loss, [named[n] for n in used])))
    rows = {p["name"]: p for p in report["params"]}
    for name in ("feature_extractor.conv_layers.0.conv.weight", "encoder.layers.1.final_layer_norm.weight"):
        assert rows[name]["grad"]["norm"] == pytest.approx(grads[name].double().norm().item(), rel=1e-4)
    assert rows["masked_spec_embed"]["grad"] is None
    assert report["inputs"][0]["shape"] == [1, 16000]


class Spare(torch.nn.Module):
    """One parameter never read (only its dtype: ``spare``), two read but cut off (``cut``, ``values``),
    one layer that learns."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.cut = torch.nn.Parameter(torch.ones(3))
        self.spare = torch.nn.Parameter(torch.ones(3))
        self.values = torch.nn.Parameter(torch.ones(3))  # read through .data: cut off too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.cut.detach() + self.values.data * (self.spare.dtype == torch.float32)


def test_never_read_parameter_warns_and_a_cut_off_one_fails(cli: Any) -> None:
    result = cli("check", "test_brought_models:Spare", "--input-shape", "2x4", "-f", "json")
    assert result.exit_code == 1 and "Error: check failed" in result.stderr
    rules = {r["rule"]: r for r in json.loads(result.stdout)["rules"]}
    found = {v["where"]: v for v in rules["grad_norm"]["violations"]}
    assert found["spare"]["severity"] == "warn" and "never reads it" in found["spare"]["message"]
    for name in ("cut", "values"):  # errors
        assert "severity" not in found[name] and "never reads" not in found[name]["message"]


# --------------------------------------------------------------------------- detection losses

FRCNN = "fasterrcnn_mobilenet_v3_large_320_fpn"


def test_detection_output_without_detections_is_refused_not_a_nan_loss(cli: Any) -> None:
    result = cli("grads", FRCNN)
    assert result.exit_code == 2 and result.stdout == ""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[0].startswith("Error: every floating tensor of the model output is empty")
    assert lines[1].lstrip().startswith("hint:") and "Traceback" not in result.stderr


def test_detection_losses_with_targets_are_summed_and_gradients_match_autograd(cli: Any, tmp_path: Any) -> None:
    import torchvision

    gen = torch.Generator().manual_seed(1)
    images = [torch.rand((3, 320, 320), generator=gen)]
    targets = [{"boxes": torch.tensor([[10.0, 20.0, 100.0, 200.0]]), "labels": torch.tensor([1])}]
    torch.save((images, targets), tmp_path / "batch.pt")
    report = run_json(cli, "grads", FRCNN, "--train", "--input", str(tmp_path / "batch.pt"), "--params", "all")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(
            weights=None, weights_backbone=None).train()
        torch.manual_seed(0)  # the run's RNG (the RPN's and ROI heads' box sampling) seeded as hookcli seeds it
        losses = model(images, targets)
    assert len(losses) == 4
    total = sum(losses.values())
    assert report["loss"]["kind"] == "model_loss" and report["loss"]["output"].startswith("sum of ")
    assert all(f"['{k}']" in report["loss"]["output"] for k in losses)
    assert report["loss"]["value"] == pytest.approx(total.item(), rel=1e-5)
    named = dict(model.named_parameters())
    names = ["roi_heads.box_predictor.cls_score.weight", "rpn.head.conv.0.0.weight"]
    grads = torch.autograd.grad(total, [named[n] for n in names])
    rows = {p["name"]: p for p in report["params"]}
    for name, g in zip(names, grads):
        assert rows[name]["grad"]["norm"] == pytest.approx(g.double().norm().item(), rel=1e-4)


class LossAndAccuracy(torch.nn.Module):
    """Returns (loss, accuracy), as many training modules do: the accuracy is a metric, not a loss."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.fc(x)
        target = torch.zeros(x.shape[0], dtype=torch.long)
        accuracy = (logits.argmax(-1) == target).float().mean()
        return torch.nn.functional.cross_entropy(logits, target), accuracy + 100.0


def test_a_metric_beside_the_loss_is_not_summed_into_it(cli: Any) -> None:
    report = run_json(cli, "grads", "test_brought_models:LossAndAccuracy", "--input-shape", "3x4")
    torch.manual_seed(0)
    model = LossAndAccuracy()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    loss, _ = model(x)
    assert report["loss"]["value"] == pytest.approx(loss.item(), rel=1e-5)  # not loss + accuracy + 100
    (g,) = torch.autograd.grad(loss, [model.fc.weight])
    rows = {p["name"]: p for p in report["params"]}
    assert rows["fc.weight"]["grad"]["norm"] == pytest.approx(g.double().norm().item(), rel=1e-4)


# --------------------------------------------------------------------------- dtypes of --input-shape


class TextAndImage(torch.nn.Module):
    """Token ids into an Embedding (its first layer) and an image into a Conv2d."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.conv = torch.nn.Conv2d(3, 8, 3)

    def forward(self, ids: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        return self.embed(ids).mean(1) + self.conv(image).mean((2, 3))


@pytest.mark.parametrize("shapes", [("2x5", "2x3x8x8"), ("2x5:int64", "2x3x8x8"), ("ids=2x7", "image=2x3x8x8")])
def test_an_input_without_dtype_beside_an_embedding_first_layer_is_refused(cli: Any, shapes: tuple[str, ...]) -> None:
    args = [a for s in shapes for a in ("--input-shape", s)]
    result = cli("stats", "test_brought_models:TextAndImage", *args)
    assert result.exit_code == 2 and result.stdout == ""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 2 and lines[0].startswith("Error: cannot tell the dtype") and "2x3x8x8" in lines[0]
    assert lines[1].lstrip().startswith("hint:")


def test_inputs_with_their_dtypes_run_and_match_torch(cli: Any) -> None:
    report = run_json(cli, "stats", "test_brought_models:TextAndImage", "--input-shape", "2x5:int64",
                      "--input-shape", "2x3x8x8:float32")
    assert [i["dtype"] for i in report["inputs"]] == ["int64", "float32"]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = TextAndImage().eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 10, (2, 5), generator=gen)
    image = torch.randn((2, 3, 8, 8), generator=gen)
    outputs, _ = reference_outputs(model, ids, image)
    assert_layers_match(report["layers"], outputs, "stats")


def test_one_input_of_an_embedding_first_model_is_still_token_ids(cli: Any) -> None:
    report = run_json(cli, "stats", "seq_models:EmbedLSTM", "--input-shape", "2x6")
    assert report["inputs"][0]["dtype"] == "int64"


# --------------------------------------------------------------------------- position limits, any config


@settings(max_examples=25, deadline=None)
@given(text=st.integers(1, 300), vision=st.integers(1, 300), seq=st.one_of(st.none(), st.integers(1, 500)))
def test_generated_length_is_the_default_capped_by_every_declared_limit(text: int, vision: int,
                                                                       seq: int | None) -> None:
    """Limits in sub-configs count (CLIP's text_config); an explicit --seq-len is kept as given."""
    from hookcli.engine.build_inputs import DEFAULT_SEQ_LEN, _hf_seq_len

    config = transformers.CLIPConfig(text_config={"max_position_embeddings": text},
                                     vision_config={"max_position_embeddings": vision})
    length, note = _hf_seq_len(config, seq)
    if seq is not None:
        assert (length, note) == (seq, "")
    else:
        assert length == min(DEFAULT_SEQ_LEN, text, vision)
        assert (note != "") == (length < DEFAULT_SEQ_LEN)


class HugeValueReader(torch.nn.Module):
    """1 TiB of weights, and a forward that reads a value (``.item()``): it cannot run on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(2**38))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w[:1].sum().item()


def test_shapes_never_builds_for_real_a_model_too_large_for_memory(cli: Any) -> None:
    result = cli("shapes", "test_brought_models:HugeValueReader", "--input-shape", "2x4")
    assert result.exit_code == 2 and result.stdout == ""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 2 and lines[0].startswith("Error: the model cannot run on the meta device")
    assert "its weights (1.02e+03 GiB) would not fit" in lines[0]
    assert lines[1].lstrip().startswith("hint:")


def test_shapes_of_an_hf_directory_builds_from_its_config_on_meta(cli: Any, tmp_path: Any) -> None:
    """hf:DIR (and hf:ORG/NAME, the same code) on meta: from the config, no weights read (from_pretrained
    refuses the meta device, so a 7B checkpoint was loaded on the CPU). A config-only directory of a large
    mistral (4 layers of its 4096 hidden size: ~1.1e9 parameters) is enough for shapes."""
    transformers.MistralConfig(num_hidden_layers=4).save_pretrained(tmp_path / "mistral")
    report = run_json(cli, "shapes", f"hf:{tmp_path / 'mistral'}")
    assert report["device"] == "meta" and report["model"]["class"] == "MistralForCausalLM"
    assert report["model"]["params"] > 1_000_000_000
    assert not any("ran on cpu" in n for n in report["notes"])
    small = _saved(tmp_path, "clip", tiny_clip())
    on_meta, on_cpu = run_json(cli, "shapes", small), run_json(cli, "shapes", small, "--device", "cpu")
    assert on_meta["device"] == "meta" and on_cpu["device"] == "cpu"
    assert on_meta["model"]["params"] == on_cpu["model"]["params"] == sum(p.numel() for p in tiny_clip().parameters())
    stats = cli("stats", f"hf:{tmp_path / 'mistral'}")  # values need the weights the directory lacks
    assert stats.exit_code == 2 and stats.stdout == "" and "hint:" in stats.stderr
