"""timm:NAME and hf:TYPE|DIR|ORG/NAME model sources, the inputs each model expects, keyword inputs
and ModelOutput outputs (issue 13).

Tiny offline models only: timm with pretrained=False at small sizes, transformers built from configs
with 2 layers and small hidden sizes, hand-written sequence models (tests/seq_models.py). Every
number is checked against plain torch: forward hooks on the same model built the same way (hookcli
seeds the random init with --seed, as ``torch.manual_seed(seed)`` would), and ``torch.autograd.grad``
of the loss for gradients.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookcli
from hookcli.options import InputSpec, parse_input_shape

pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning")  # nn.Transformer's own

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")

GPT2 = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 1000}
BERT = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64,
        "vocab_size": 500}
T5 = {"num_layers": 2, "d_model": 32, "d_ff": 64, "num_heads": 2, "d_kv": 16, "vocab_size": 200}
VIT = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64,
       "image_size": 32, "patch_size": 8}
#: model type -> (config fields, the Auto class hookcli documents for it)
HF_MODELS = {
    "gpt2": (GPT2, "AutoModelForCausalLM"),
    "bert": (BERT, "AutoModelForMaskedLM"),
    "t5": (T5, "AutoModelForSeq2SeqLM"),
    "vit": (VIT, "AutoModelForImageClassification"),
}
STAT_KEYS = ("mean", "std", "min", "max", "norm")


def model_args(args: Mapping[str, Any]) -> list[str]:
    return [a for k, v in args.items() for a in ("--model-arg", f"{k}={v}")]


def build_hf(model_type: str, seed: int = 0) -> nn.Module:
    """The model hf:TYPE builds, made here with transformers directly (seeded as hookcli seeds)."""
    fields, auto = HF_MODELS[model_type]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        config = transformers.AutoConfig.for_model(model_type, **fields)
        return getattr(transformers, auto).from_config(config).eval()


def build_timm(name: str, seed: int = 0, **kwargs: Any) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return timm.create_model(name, pretrained=False, **kwargs).eval()


def walk(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors in an output with the documented paths: ``['key']`` for mappings (ModelOutput too),
    ``[i]`` for tuples and lists."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from walk(value, f"{path}[{key!r}]")
    elif isinstance(obj, (tuple, list)):
        for i, value in enumerate(obj):
            yield from walk(value, f"{path}[{i}]")


def reference_outputs(model: nn.Module, *args: Any, grad_of: str | None = None, **kwargs: Any
                      ) -> tuple[dict[tuple[str, int, str], torch.Tensor], dict[tuple[str, int, str], torch.Tensor]]:
    """Outputs of the model's direct children (hookcli's default selection) by (name, call, path),
    with plain forward hooks; and, with ``grad_of`` (an output key), the gradients of the mean of
    that output w.r.t. each of them (``torch.autograd.grad``)."""
    outputs: dict[tuple[str, int, str], torch.Tensor] = {}
    calls: dict[str, int] = {}
    handles = []
    for name, child in model.named_children():
        def hook(_m: nn.Module, _a: Any, out: Any, name: str = name) -> None:
            call = calls.get(name, 0)
            calls[name] = call + 1
            for path, t in walk(out):  # cloned for values: a later in-place ReLU would change them
                outputs[(name, call, path)] = t if grad_of is not None else t.detach().clone()
        handles.append(child.register_forward_hook(hook))
    try:
        with torch.set_grad_enabled(grad_of is not None):
            out = model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    grads: dict[tuple[str, int, str], torch.Tensor] = {}
    if grad_of is not None:
        loss = out[grad_of].float().mean()
        keys = [k for k, t in outputs.items() if t.requires_grad]
        for key, g in zip(keys, torch.autograd.grad(loss, [outputs[k] for k in keys], allow_unused=True)):
            if g is not None:
                grads[key] = g
    return outputs, grads


def expected_stats(t: torch.Tensor) -> dict[str, float]:
    t = t.detach().double()
    return {"mean": t.mean().item(), "std": t.std(correction=0).item(), "min": t.min().item(),
            "max": t.max().item(), "norm": t.norm().item()}


def assert_layers_match(layers: list[dict[str, Any]], reference: dict[tuple[str, int, str], torch.Tensor],
                        key: str) -> None:
    """Every float row's ``key`` ("stats" or "grad") equals plain torch's numbers; every reference
    tensor has its row."""
    rows = {(r["name"], r["call"], r["output"]): r for r in layers if r.get("called", True)}
    checked = 0
    for where, tensor in reference.items():
        if not tensor.is_floating_point():
            continue
        assert where in rows, f"no row for {where}; rows: {sorted(rows)}"
        got = rows[where][key]
        want = expected_stats(tensor)
        for k in STAT_KEYS:
            assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), (where, k)
        checked += 1
    assert checked, "nothing compared"


def run_json(cli: Any, *args: str) -> dict[str, Any]:
    result = cli(*args, "-f", "json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


# --------------------------------------------------------------------------- no flags: exit 0


SMOKE = [
    ("timm:test_resnet", []),  # timm's own tiny test models, at their pretrained_cfg input sizes
    ("timm:test_vit", []),
    *[(f"hf:{t}", model_args(fields)) for t, (fields, _) in HF_MODELS.items()],
    ("seq_models:EmbedLSTM", []),
    ("seq_models:GRUFirst", []),
    ("seq_models:EncoderFirst", []),
    ("seq_models:tiny_transformer", []),
]


@pytest.mark.parametrize(("spec", "args"), SMOKE, ids=[s for s, _ in SMOKE])
def test_shapes_stats_grads_check_exit_0_with_no_flags_beyond_the_name(cli: Any, spec: str, args: list[str]) -> None:
    """Healthy models, randomly initialised: every command works with the default inputs, loss and rules."""
    for command in ("shapes", "stats", "grads", "check"):
        result = cli(command, spec, *args)
        assert result.exit_code == 0, (command, result.stderr)
        assert result.stdout.startswith(spec), result.stdout[:200]  # the header names the spec as given
        assert "Error" not in result.stderr


# --------------------------------------------------------------------------- timm


def test_timm_default_input_follows_pretrained_cfg_and_stats_match_torch(cli: Any) -> None:
    model = build_timm("resnet10t")
    size = tuple(model.pretrained_cfg["input_size"])
    report = run_json(cli, "stats", "timm:resnet10t")
    assert report["model"]["spec"] == "timm:resnet10t" and report["model"]["class"] == type(model).__name__
    assert report["inputs"][0]["shape"] == [1, *size] and report["inputs"][0]["dtype"] == "float32"
    x = torch.randn((1, *size), generator=torch.Generator().manual_seed(0))
    outputs, _ = reference_outputs(model, x)
    assert_layers_match(report["layers"], outputs, "stats")


def test_timm_model_args_and_img_size(cli: Any) -> None:
    report = run_json(cli, "shapes", "timm:vit_tiny_patch16_224", "--model-arg", "img_size=32",
                      "--model-arg", "num_classes=7")
    assert report["inputs"][0]["shape"] == [1, 3, 32, 32]
    assert report["layers"][-1]["shape"] == [1, 7]


def test_timm_image_input_uses_the_models_mean_and_std(cli: Any, tmp_path: Any) -> None:
    from PIL import Image
    import numpy as np

    pixels = np.random.default_rng(0).integers(0, 256, (40, 40, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "img.png")
    model = build_timm("resnet10t")
    cfg = model.pretrained_cfg
    report = run_json(cli, "stats", "timm:resnet10t", "--input", tmp_path / "img.png", "--layers", "conv1")
    assert report["inputs"][0]["shape"] == [1, *cfg["input_size"]]
    # the same preprocessing in plain torch: resize shorter side to size / crop_pct, centre crop, normalise
    import torchvision.transforms.v2.functional as F

    size = cfg["input_size"][1]
    img = torch.from_numpy(pixels).permute(2, 0, 1)
    img = F.center_crop(F.resize(img, [int(size / cfg["crop_pct"] + 1e-6)], antialias=True), [size, size])
    x = F.normalize(F.to_dtype(img, torch.float32, scale=True), list(cfg["mean"]), list(cfg["std"]))[None]
    with torch.no_grad():
        want = expected_stats(model.conv1(x))
    got = report["layers"][0]["stats"]
    for k in STAT_KEYS:
        assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k


def test_unknown_timm_name_is_exit_2_with_close_matches(cli: Any) -> None:
    result = cli("shapes", "timm:resnet10")
    assert result.exit_code == 2 and result.stdout == ""
    assert "unknown timm model 'resnet10'" in result.stderr and "resnet10t" in result.stderr


def test_models_lists_timm_names(cli: Any) -> None:
    report = run_json(cli, "models", "convnext*", "--source", "timm")
    assert report["source"] == "timm"
    assert [m["name"] for m in report["models"]] == [f"timm:{n}" for n in sorted(timm.list_models("convnext*"))]
    table = cli("models", "convnext_a*", "--source", "timm")
    assert table.exit_code == 0 and "timm:convnext_atto" in table.stdout


# --------------------------------------------------------------------------- transformers


@pytest.mark.parametrize("model_type", ["gpt2", "t5"])
def test_hf_text_inputs_and_stats_match_torch(cli: Any, model_type: str) -> None:
    model = build_hf(model_type)
    fields, _ = HF_MODELS[model_type]
    report = run_json(cli, "stats", f"hf:{model_type}", *model_args(fields))
    assert report["model"]["class"] == type(model).__name__
    vocab = fields["vocab_size"]
    names = ["input_ids", "attention_mask"] + (["decoder_input_ids"] if model_type == "t5" else [])
    assert [i["name"] for i in report["inputs"]] == names
    assert all(i["shape"] == [1, 128] and i["dtype"] == "int64" for i in report["inputs"])
    # the documented default: randint(0, vocab_size) ids from a generator seeded with --seed, a mask of ones
    gen = torch.Generator().manual_seed(0)
    kwargs = {"input_ids": torch.randint(0, vocab, (1, 128), generator=gen), "attention_mask": torch.ones(1, 128, dtype=torch.long)}
    if model_type == "t5":
        kwargs["decoder_input_ids"] = torch.randint(0, vocab, (1, 128), generator=gen)
    outputs, _ = reference_outputs(model, **kwargs)
    assert_layers_match(report["layers"], outputs, "stats")


def test_hf_vision_input_is_pixel_values_at_the_config_image_size(cli: Any) -> None:
    model = build_hf("vit")
    report = run_json(cli, "stats", "hf:vit", *model_args(VIT))
    assert [(i["name"], i["shape"]) for i in report["inputs"]] == [("pixel_values", [1, 3, 32, 32])]
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    outputs, _ = reference_outputs(model, pixel_values=x)
    assert_layers_match(report["layers"], outputs, "stats")


def test_hf_grads_on_model_output_key_match_autograd(cli: Any, tmp_path: Any) -> None:
    """Keyword inputs from a .safetensors file; the loss is the mean of the ModelOutput's logits."""
    from safetensors.torch import save_file

    model = build_hf("gpt2")
    ids = torch.randint(0, GPT2["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(5))
    save_file({"input_ids": ids}, str(tmp_path / "batch.safetensors"))
    report = run_json(cli, "grads", "hf:gpt2", *model_args(GPT2), "--input", tmp_path / "batch.safetensors",
                      "--output-key", "logits", "--loss", "mean", "--params", "all")
    assert [(i["name"], i["shape"], i["dtype"]) for i in report["inputs"]] == [("input_ids", [2, 12], "int64")]
    outputs, grads = reference_outputs(model, grad_of="logits", input_ids=ids)
    assert_layers_match(report["layers"], grads, "grad")
    loss = model(input_ids=ids).logits.float().mean()
    named = dict(model.named_parameters())
    want = dict(zip(named, torch.autograd.grad(loss, list(named.values()), allow_unused=True)))
    rows = {p["name"]: p for p in report["params"]}
    compared = [n for n in want if n in rows and want[n] is not None]
    assert len(compared) >= len(named) - 1
    for name in compared:
        assert rows[name]["grad"]["norm"] == pytest.approx(want[name].norm().item(), rel=1e-4, abs=1e-7), name


def test_output_key_names_model_output_fields(cli: Any) -> None:
    bad = cli("grads", "hf:gpt2", *model_args(GPT2), "--seq-len", "4", "--output-key", "logit")
    assert bad.exit_code == 2 and "--output-key 'logit' is not in the model output" in bad.stderr
    assert "['logits']" in bad.stderr  # the paths a ModelOutput's tensors have


def test_keyword_input_shapes_on_the_command_line(cli: Any) -> None:
    report = run_json(cli, "shapes", "hf:gpt2", *model_args(GPT2), "--input-shape", "input_ids=2x7",
                      "--input-shape", "attention_mask=2x7:int64", "--device", "cpu")
    assert [(i["name"], i["shape"], i["dtype"]) for i in report["inputs"]] == [
        ("input_ids", [2, 7], "int64"), ("attention_mask", [2, 7], "int64")]
    assert report["layers"][-1]["shape"] == [2, 7, GPT2["vocab_size"]]
    unknown = cli("shapes", "seq_models:EmbedLSTM", "--input-shape", "idz=1x4:int64")
    assert unknown.exit_code == 2 and "idz" in unknown.stderr and "forward(ids" in unknown.stderr


def test_positional_and_keyword_input_shapes_mix(cli: Any) -> None:
    import hookcli

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
            return self.fc(x) * (scale if scale is not None else 1)

    report = hookcli.stats(Scaled(), input_shapes=["4x3", "scale=4x1"])
    assert [(i.name, i.shape) for i in report.inputs] == [("0", [4, 3]), ("scale", [4, 1])]


@settings(max_examples=25, deadline=None)
@given(name=st.one_of(st.none(), st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True)),
       shape=st.lists(st.integers(1, 999), min_size=1, max_size=5),  # < MAX_NUMEL elements
       dtype=st.sampled_from([None, "float32", "int64", "bfloat16"]))
def test_parse_input_shape_names_and_positions(name: str | None, shape: list[int], dtype: str | None) -> None:
    text = "x".join(map(str, shape)) + (f":{dtype}" if dtype else "")
    spec = parse_input_shape(f"{name}={text}" if name else text)
    assert spec == InputSpec(tuple(shape), dtype, name)


@pytest.mark.parametrize("text", ["1x=2", "in-put=1x2", "=1x2", "x=1xa"])
def test_bad_keyword_input_shape_is_a_usage_error(cli: Any, text: str) -> None:
    result = cli("shapes", "seq_models:EmbedLSTM", "--input-shape", text)
    assert result.exit_code == 2 and result.stdout == "" and "hint:" in result.stderr


def test_hf_directory_from_save_pretrained_loads_its_weights(cli: Any, tmp_path: Any) -> None:
    model = build_hf("gpt2", seed=123)  # not the weights hookcli's own seed would give
    model.save_pretrained(tmp_path / "tiny-gpt2")
    report = run_json(cli, "stats", f"hf:{tmp_path / 'tiny-gpt2'}", "--seq-len", "9")
    assert report["model"]["class"] == "GPT2LMHeadModel"
    ids = torch.randint(0, GPT2["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(0))
    outputs, _ = reference_outputs(model, input_ids=ids, attention_mask=torch.ones_like(ids))
    assert_layers_match(report["layers"], outputs, "stats")


def _no_sockets(monkeypatch: Any) -> list[str]:
    """Make every name lookup and connection fail, and record it (patching the OS interface, not torch)."""
    import socket

    opened: list[str] = []

    def lookup(host: Any, *args: Any, **kwargs: Any) -> Any:
        opened.append(f"getaddrinfo {host}")
        raise OSError("this test allows no network")

    def connect(self: Any, address: Any) -> Any:
        opened.append(f"connect {address}")
        raise OSError("this test allows no network")

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    monkeypatch.setattr(socket.socket, "connect", connect)
    return opened


#: What transformers, huggingface_hub and torch.hub print on their own while a model loads and runs.
CHATTER = ("[transformers]", "bos_token_id", "Loading weights", "Loading checkpoint shards", "it/s]",
           "Downloading")


def test_third_party_logging_and_progress_bars_stay_off_the_terminal(cli: Any, capfd: Any, tmp_path: Any) -> None:
    """A tiny GPT-2 (vocabulary 1000: its config's bos/eos token 50256 makes transformers warn) saved with
    save_pretrained (loading it draws a progress bar): hookcli's CLI and API print none of that, and
    the Python caller's transformers verbosity and progress-bar setting are as they were after."""
    from transformers.utils import logging

    build_hf("gpt2").save_pretrained(tmp_path / "tiny-gpt2")
    spec = f"hf:{tmp_path / 'tiny-gpt2'}"
    capfd.readouterr()
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tiny-gpt2")  # the premise: it is noisy
    noisy = capfd.readouterr().err
    assert any(c in noisy for c in CHATTER), noisy
    result = cli("stats", spec, "--seq-len", "6")
    assert result.exit_code == 0 and result.stderr == ""
    assert "GPT2LMHeadModel" in result.stdout
    for command in ("shapes", "grads"):
        assert cli(command, spec, "--seq-len", "6").stderr == ""
    logging.set_verbosity_info()
    logging.enable_progress_bar()
    try:
        hookcli.stats(spec, seq_len=6)
        assert (logging.get_verbosity(), logging.is_progress_bar_enabled()) == (logging.INFO, True)
    finally:
        logging.set_verbosity_warning()
    captured = capfd.readouterr()
    assert not [c for c in CHATTER if c in captured.err], captured.err


def test_torch_hub_download_line_is_dropped_only_inside_a_run(capfd: Any, tmp_path: Any) -> None:
    from hookcli.engine.quiet import quiet

    state = tmp_path / "weights-0123abcd.pth"
    torch.save({"w": torch.ones(2)}, state)
    url = state.as_uri()  # torch.hub fetches a file:// URL as it fetches https://
    with quiet():
        got = torch.hub.load_state_dict_from_url(url, model_dir=str(tmp_path / "hub"), progress=False)
        print("kept", file=sys.stderr)
    assert torch.equal(got["w"], torch.ones(2))
    captured = capfd.readouterr()
    assert "Downloading" not in captured.out + captured.err and "kept" in captured.err
    torch.hub.load_state_dict_from_url(url, model_dir=str(tmp_path / "hub2"), progress=False)
    captured = capfd.readouterr()  # the premise: torch.hub writes it (stdout or stderr); both are back
    assert 'Downloading: "' in captured.out + captured.err


def test_hub_name_not_in_the_local_cache_is_exit_2_without_network(cli: Any, monkeypatch: Any, tmp_path: Any) -> None:
    """Issue #20: ``hf:ORG/NAME`` not in the cache opened a connection (DNS and TCP) while saying that
    network access is not attempted. The run is offline: no socket at all."""
    import huggingface_hub.constants as hub

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # an empty cache: nothing to find locally
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)  # as a process that imported it online has it
    opened = _no_sockets(monkeypatch)
    result = cli("shapes", "hf:no-such-org/no-such-model-xyz")
    assert result.exit_code == 2 and result.stdout == ""
    assert "not in the local Hugging Face cache" in result.stderr and "network access is not attempted" in result.stderr
    assert "hint:" in result.stderr and "Traceback" not in result.stderr
    import hookcli
    from hookcli.errors import ModelNotFoundError

    with pytest.raises(ModelNotFoundError):
        hookcli.modules("hf:no-such-org/no-such-model-xyz")
    assert opened == []
    # the Python caller's process is handed back as it was: online, environment untouched
    assert hub.HF_HUB_OFFLINE is False and "HF_HUB_OFFLINE" not in os.environ and "TRANSFORMERS_OFFLINE" not in os.environ


def test_unknown_model_type_and_config_field_are_exit_2(cli: Any) -> None:
    typo = cli("shapes", "hf:gtp2")
    assert typo.exit_code == 2 and "gpt2" in typo.stderr  # a close match
    field = cli("shapes", "hf:gpt2", "--model-arg", "n_layers=2")
    assert field.exit_code == 2 and "no field 'n_layers'" in field.stderr and "n_layer" in field.stderr


@pytest.mark.parametrize(("spec", "package", "extra"), [("timm:resnet10t", "timm", "timm"),
                                                        ("hf:gpt2", "transformers", "hf")])
def test_missing_extra_is_exit_2_with_the_install_line(cli: Any, monkeypatch: Any, spec: str, package: str,
                                                       extra: str) -> None:
    monkeypatch.setitem(sys.modules, package, None)  # import fails as if it were not installed
    result = cli("shapes", spec)
    assert result.exit_code == 2 and result.stdout == ""
    assert f"pip install 'hookcli[{extra}]'" in result.stderr


# --------------------------------------------------------------------------- sequence models


def test_embedding_first_model_gets_tokens_below_num_embeddings(cli: Any) -> None:
    import seq_models

    report = run_json(cli, "stats", "seq_models:EmbedLSTM", "--seq-len", "20")
    assert [(i["shape"], i["dtype"]) for i in report["inputs"]] == [([1, 20], "int64")]
    assert "randint(0, 50," in report["inputs"][0]["source"]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = seq_models.EmbedLSTM().eval()
    ids = torch.randint(0, 50, (1, 20), generator=torch.Generator().manual_seed(0))
    outputs, _ = reference_outputs(model, ids)
    assert ("lstm", 0, "[1][0]") in outputs  # (output, (h, c)) walked as a tuple
    assert_layers_match(report["layers"], outputs, "stats")


def test_transformer_encoder_first_model_gets_batch_seq_features_and_grads_match(cli: Any) -> None:
    import seq_models

    report = run_json(cli, "grads", "seq_models:EncoderFirst", "--seq-len", "6", "--loss", "mean")
    assert report["inputs"][0]["shape"] == [1, 6, 16]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = seq_models.EncoderFirst().eval()
    x = torch.randn(1, 6, 16, generator=torch.Generator().manual_seed(0))
    outputs = {}
    hooks = [m.register_forward_hook(lambda _m, _a, out, n=n: outputs.__setitem__((n, 0, ""), out))
             for n, m in model.named_children()]
    loss = model(x).mean()
    for h in hooks:
        h.remove()
    grads = dict(zip(outputs, torch.autograd.grad(loss, list(outputs.values()))))
    assert_layers_match(report["layers"], grads, "grad")


def test_seq_first_rnn_and_nn_transformer_inputs() -> None:
    import hookcli
    import seq_models

    gru = hookcli.shapes(seq_models.GRUFirst(), seq_len=5)
    assert [i.shape for i in gru.inputs] == [[5, 1, 6]]  # batch_first=False: [seq, batch, features]
    both = hookcli.shapes(seq_models.tiny_transformer(), seq_len=3, batch_size=2)
    assert [i.shape for i in both.inputs] == [[3, 2, 8], [3, 2, 8]]  # src and tgt


@pytest.mark.parametrize("as_tuple", [False, True], ids=["dataclass", "namedtuple"])
def test_output_key_picks_a_dataclass_or_namedtuple_field(cli: Any, as_tuple: bool) -> None:
    import seq_models

    report = run_json(cli, "grads", "seq_models:StructuredOut", "--model-arg", f"as_tuple={as_tuple}",
                      "--input-shape", "2x4", "--output-key", "logits", "--loss", "sum", "--all", "--params", "none")
    assert report["loss"]["output"] == ".logits"
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = seq_models.StructuredOut(as_tuple).eval()
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    fc_out = {}
    handle = model.fc.register_forward_hook(lambda _m, _a, out: fc_out.setdefault("t", out))
    loss = model(x).logits.sum()
    handle.remove()
    (want,) = torch.autograd.grad(loss, [fc_out["t"]])
    got = {(r["name"], r["output"]): r for r in report["layers"]}[("fc", "")]["grad"]
    for k, v in expected_stats(want).items():
        assert got[k] == pytest.approx(v, rel=1e-4, abs=1e-7), k


def test_named_weights_for_timm_and_hf_are_refused_offline(cli: Any) -> None:
    result = cli("shapes", "timm:test_resnet", "--weights", "DEFAULT")
    assert result.exit_code == 2 and "never downloads" in result.stderr and "hint:" in result.stderr


def test_timm_weights_file_is_loaded(cli: Any, tmp_path: Any) -> None:
    from safetensors.torch import save_file

    model = build_timm("test_vit", seed=7)  # weights hookcli's own seed (0) would not give
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "w.safetensors"))
    report = run_json(cli, "stats", "timm:test_vit", "--weights", tmp_path / "w.safetensors")
    assert report["model"]["weights"] == f"file: {tmp_path / 'w.safetensors'}"
    x = torch.randn((1, *model.pretrained_cfg["input_size"]), generator=torch.Generator().manual_seed(0))
    outputs, _ = reference_outputs(model, x)
    assert_layers_match(report["layers"], outputs, "stats")


# --------------------------------------------------------------------------- a model's own code (issue #20)

REMOTE_CONFIG = '''
from transformers import PretrainedConfig

open({sentinel!r}, "a").close()  # importing this file is running the folder's code


class RemoteConfig(PretrainedConfig):
    model_type = "hookcli-remote-test"

    def __init__(self, width=4, **kwargs):
        self.width = width
        super().__init__(**kwargs)
'''
REMOTE_MODEL = '''
import torch
from transformers import PreTrainedModel

from .configuration_remote import RemoteConfig


class RemoteModel(PreTrainedModel):
    config_class = RemoteConfig

    def __init__(self, config):
        super().__init__(config)
        self.lin = torch.nn.Linear(config.width, 2)
        self.post_init()

    def forward(self, x):
        return self.lin(x)
'''


@pytest.fixture
def remote_code_dir(tmp_path: Any) -> Any:
    """A save_pretrained-style folder whose config.json points at its own Python code (auto_map)."""
    from safetensors.torch import save_file

    folder = tmp_path / "remote"
    folder.mkdir()
    sentinel = tmp_path / "code-ran"
    (folder / "configuration_remote.py").write_text(REMOTE_CONFIG.format(sentinel=str(sentinel)))
    (folder / "modeling_remote.py").write_text(REMOTE_MODEL)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "hookcli-remote-test", "width": 4, "architectures": ["RemoteModel"],
        "auto_map": {"AutoConfig": "configuration_remote.RemoteConfig", "AutoModel": "modeling_remote.RemoteModel"}}))
    weight = torch.arange(8, dtype=torch.float32).reshape(2, 4) / 8
    save_file({"lin.weight": weight, "lin.bias": torch.tensor([0.5, -0.5])}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return folder, sentinel, weight


@pytest.mark.parametrize("how", ["no flag", "model-arg", "config model_args", "config key"])
def test_a_models_own_code_runs_only_with_the_flag_and_never_asks(cli: Any, remote_code_dir: Any, tmp_path: Any,
                                                                  how: str) -> None:
    """Issue #20: ``--model-arg trust_remote_code=True`` (or a config's ``model_args``) ran the folder's
    code, and transformers' "[y/N]" prompt went to stdout, answered by ``yes |`` on stdin."""
    folder, sentinel, _ = remote_code_dir
    argv = ["stats", f"hf:{folder}", "--input-shape", "1x4"]
    if how == "model-arg":
        argv += ["--model-arg", "trust_remote_code=True"]
    elif how.startswith("config"):
        line = "model_args = { trust_remote_code = true }" if how == "config model_args" else "trust_remote_code = true"
        config = tmp_path / "hookcli.toml"
        config.write_text(f'model = "hf:{folder}"\ninput_shape = "1x4"\n{line}\n')
        argv = ["stats", "--config", config]
    result = cli(*argv, input="y\ny\ny\n")  # as `yes | hookcli ...`
    assert result.exit_code == 2 and result.stdout == "", result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("Error: ") and "--trust-remote-code" in result.stderr
    assert not sentinel.exists()


def test_trust_remote_code_flag_builds_the_model_and_numbers_match_torch(cli: Any, remote_code_dir: Any,
                                                                         tmp_path: Any) -> None:
    folder, sentinel, weight = remote_code_dir
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(5))
    torch.save(x, tmp_path / "x.pt")
    result = cli("stats", f"hf:{folder}", "--trust-remote-code", "--input", tmp_path / "x.pt", "-f", "json",
                 input="")  # nothing on stdin: nothing is asked
    assert result.exit_code == 0, result.output
    assert sentinel.exists()
    row = json.loads(result.stdout)["layers"][0]
    expected = (x.double() @ weight.double().T + torch.tensor([0.5, -0.5], dtype=torch.float64))
    assert row["name"] == "lin" and row["shape"] == [3, 2]
    assert row["stats"]["mean"] == pytest.approx(expected.mean().item(), rel=1e-5, abs=1e-6)
    assert row["stats"]["max"] == pytest.approx(expected.max().item(), rel=1e-5, abs=1e-6)
