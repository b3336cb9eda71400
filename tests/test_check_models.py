"""Issue 13: ``check`` passes healthy timm/transformers models out of the box and still fails real bugs;
the default loss is the documented one (gradients equal ``torch.autograd.grad`` of it, computed here).

Tiny offline models only: timm at 32x32, transformers from configs with 2 layers and hidden size 32.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookcli

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")


class Tokens(nn.Module):
    """A transformers model called with keyword token inputs (decoder tokens too for encoder-decoders)."""

    def __init__(self, model: nn.Module, decoder: bool = False) -> None:
        super().__init__()
        self.m, self.decoder = model, decoder

    def forward(self, input_ids: torch.Tensor):  # noqa: ANN201 - the model's own output type
        if self.decoder:
            return self.m(input_ids=input_ids, decoder_input_ids=input_ids)
        return self.m(input_ids=input_ids)


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64, bos_token_id=0, eos_token_id=0)
    return Tokens(GPT2LMHeadModel(cfg))


def _bert() -> nn.Module:
    from transformers import BertConfig, BertModel

    return Tokens(BertModel(BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                       intermediate_size=64, vocab_size=100)))


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(num_layers=2, d_model=32, d_ff=64, num_heads=2, d_kv=16, vocab_size=100)
    return Tokens(T5ForConditionalGeneration(cfg), decoder=True)


HEALTHY = {
    "resnet10t_zero_init_last": (lambda: timm.create_model("resnet10t", pretrained=False, zero_init_last=True),
                                 ["2x3x32x32"]),
    "convnext_atto_layer_scale": (lambda: timm.create_model("convnext_atto", pretrained=False), ["2x3x32x32"]),
    "gpt2": (_gpt2, ["2x16:int64"]),
    "bert": (_bert, ["2x16:int64"]),
    "t5": (_t5, ["2x16:int64"]),
}


@pytest.mark.parametrize("name", list(HEALTHY))
def test_healthy_models_pass_with_default_rules(name: str) -> None:
    torch.manual_seed(0)
    build, shapes = HEALTHY[name]
    result = hookcli.check(build(), input_shapes=shapes)
    assert result.ok, str(result)


def test_zero_init_last_gamma_is_initialised_so_not_dead() -> None:
    torch.manual_seed(0)
    model = timm.create_model("resnet10t", pretrained=False, zero_init_last=True)
    assert all(float(m.bn2.weight.detach().abs().max()) == 0 for m in model.modules() if hasattr(m, "bn2"))
    result = hookcli.check(model, input_shapes=["2x3x32x32"])
    zero = result.rule("max_zero_fraction")
    assert zero.status == "PASS" and "initialised so" in zero.message and "bn2" in zero.message
    assert result.rule("grad_norm").status == "PASS"
    assert result.rule("params_change").status == "PASS"


def test_bert_pooler_unused_by_the_loss_is_a_warning_naming_it() -> None:
    torch.manual_seed(0)
    result = hookcli.check(_bert(), input_shapes=["2x16:int64"])
    rule = result.rule("grad_norm")
    assert result.ok and rule.status == "WARN"
    assert {v["where"] for v in rule.violations} == {"m.pooler.dense.weight", "m.pooler.dense.bias"}
    assert "pooler_output" in rule.message
    pooler = next(p for p in result.report.params if p.name == "m.pooler.dense.weight")
    assert pooler.grad is None and pooler.other_outputs == ["['pooler_output']"]


# --------------------------------------------------------------------------- injected bugs


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc2(self.relu(self.fc1(x))))


class Detached(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc2(self.relu(self.fc1(x)).detach()))


class MakesNaN(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(self.relu(self.fc1(x)))
        return self.head(h * torch.tensor(float("nan")))


class Unused(Net):
    """A healthy net with a branch its forward never calls: a warning, never a failure."""

    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.Linear(32, 32)
        self.blocks = nn.ModuleList([nn.Linear(32, 32), nn.Linear(32, 32)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(self.relu(self.fc1(x)))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _dead_relu() -> nn.Module:
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        net.fc1.bias.fill_(-10.0)  # a bad init: every pre-activation is negative, the ReLU never fires
    return net


def _exploding() -> nn.Module:
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        net.fc2.weight.mul_(1e6)
    return net


def test_healthy_net_and_never_called_branch_pass() -> None:
    torch.manual_seed(0)
    assert hookcli.check(Net(), input_shapes=["8x16"]).ok
    result = hookcli.check(Unused(), input_shapes=["8x16"])
    assert result.ok, str(result)
    rule = result.rule("grad_norm")
    assert rule.status == "WARN" and {v["where"] for v in rule.violations} == {"spare.weight", "spare.bias"}
    assert "never called" in rule.message


@pytest.mark.parametrize("build, rule, where", [
    (_dead_relu, "max_zero_fraction", "relu"),
    (_dead_relu, "grad_norm", "fc1."),
    (_dead_relu, "params_change", "fc1."),
    (lambda: Detached(), "grad_norm", "fc1."),
    (lambda: MakesNaN(), "finite", "head"),
    (_exploding, "grad_norm", "head."),  # fc2 weights x 1e6: the head gets the exploding gradient
])
def test_injected_bugs_fail_naming_the_module(build, rule: str, where: str) -> None:
    torch.manual_seed(0)
    result = hookcli.check(build(), input_shapes=["8x16"])
    assert not result.ok
    failed = result.rule(rule)
    assert failed.status == "FAIL", str(result)
    assert failed.offender.startswith(where), failed


def test_exploding_activation_warns_by_default_and_fails_as_an_error(tmp_path) -> None:
    torch.manual_seed(0)
    net = _exploding()
    x = torch.randn(8, 16)
    peaks = {}
    hooks = [m.register_forward_hook(lambda m, i, o, n=n: peaks.__setitem__(n, o.abs().max().item()))
             for n, m in net.named_children()]
    with torch.no_grad():
        net(x)
    for h in hooks:
        h.remove()
    worst = max(peaks, key=peaks.get)
    assert peaks[worst] > 1e4
    torch.save(x, tmp_path / "x.pt")
    rule = hookcli.check(net, inputs=[tmp_path / "x.pt"]).rule("max_abs_activation")
    assert rule.status == "WARN" and rule.offender == worst == "fc2"
    strict = hookcli.check(net, inputs=[tmp_path / "x.pt"], checks={"max_abs_activation": {"severity": "error"}})
    assert strict.rule("max_abs_activation").status == "FAIL" and not strict.ok


def test_detach_is_cut_off_not_never_called() -> None:
    torch.manual_seed(0)
    result = hookcli.check(Detached(), input_shapes=["8x16"])
    assert "cut off" in result.rule("grad_norm").message
    assert result.rule("params_change").status == "FAIL"


USER_FILE = """
import torch
from torch import nn
import timm


class Detached(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.body(x).detach())


def healthy():
    torch.manual_seed(0)
    return timm.create_model("resnet10t", pretrained=False, zero_init_last=True)


def detached():
    return Detached()
"""


def test_cli_check_exit_codes_on_user_files(cli, tmp_path, monkeypatch) -> None:
    path = tmp_path / "models_i13.py"
    path.write_text(textwrap.dedent(USER_FILE))
    monkeypatch.chdir(tmp_path)
    ok = cli("check", f"{path}:healthy", "--input-shape", "2x3x32x32", "--format", "json")
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)["ok"] is True
    bad = cli("check", f"{path}:detached", "--input-shape", "4x16")
    assert bad.exit_code == 1
    assert "body.weight" in bad.stdout + bad.stderr


# --------------------------------------------------------------------------- the default loss


def _param_grads(model: nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return {n: g for (n, _), g in zip(named, grads)}


def _assert_grads_match(report, expected: dict[str, torch.Tensor]) -> None:
    got = {p.name: p for p in report.params}
    for name, g in expected.items():
        if g is None:
            assert got[name].grad is None
            continue
        assert got[name].grad is not None, name
        assert got[name].grad["norm"] == pytest.approx(float(g.norm()), rel=1e-4, abs=1e-9), name
        assert got[name].grad["max"] == pytest.approx(float(g.max()), rel=1e-4, abs=1e-9), name


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.emb(ids)))


def test_lm_logits_get_next_token_cross_entropy() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    ids = torch.randint(0, 50, (2, 12))
    path = None
    report = hookcli.grads(model, inputs=[_save(ids, "ids")], params="all")
    path = report.loss
    assert path["kind"] == "cross_entropy" and path["targets"] == "next token of input [0][0]"
    logits = model(ids)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, 50), ids[:, 1:].reshape(-1))
    assert report.loss["value"] == pytest.approx(loss.item(), rel=1e-5)
    _assert_grads_match(report, _param_grads(model, loss))


def test_a_target_the_loss_does_not_use_is_said_not_dropped_silently() -> None:
    """``--target`` picks the class of a (batch, classes) cross-entropy; a per-token next-token loss (or a
    mean of squares) has no use for it, and the report says so instead of ignoring it."""
    torch.manual_seed(0)
    model = TinyLM()
    ids = _save(torch.randint(0, 50, (2, 12)), "ids")
    said = hookcli.grads(model, inputs=[ids], target=7)
    assert said.loss["target"] is None
    assert any(n.startswith("--target 7 is not used: the loss is cross_entropy") and "next token" in n
               for n in said.notes), said.notes
    assert not any("--target" in n for n in hookcli.grads(model, inputs=[ids]).notes)  # the default: nothing said
    classifier = nn.Sequential(nn.Flatten(), nn.Linear(12, 10))
    used = hookcli.grads(classifier, input_shapes=["2x12"], target=7)
    assert used.loss["target"] == 7 and not any("--target" in n for n in used.notes)


def _save(t: torch.Tensor, name: str) -> str:
    import tempfile

    folder = tempfile.mkdtemp()
    path = f"{folder}/{name}.pt"
    torch.save(t, path)
    return path


def test_hidden_states_get_mean_of_squares() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16))
    x = torch.randn(3, 5, 8)
    report = hookcli.grads(model, inputs=[_save(x, "x")], params="all")
    assert report.loss["kind"] == "mean_square"
    loss = model(x).square().mean()
    assert report.loss["value"] == pytest.approx(loss.item(), rel=1e-5)
    _assert_grads_match(report, _param_grads(model, loss))


@settings(max_examples=6, deadline=None)
@given(batch=st.integers(1, 3), classes=st.integers(2, 6), target=st.integers(0, 5))
def test_classes_get_cross_entropy_with_the_target(batch: int, classes: int, target: int) -> None:
    target = min(target, classes - 1)
    torch.manual_seed(batch * 10 + classes)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, classes))
    x = torch.randn(batch, 4)
    report = hookcli.grads(model, inputs=[_save(x, "x")], params="all", target=target)
    loss = F.cross_entropy(model(x), torch.full((batch,), target))
    assert report.loss["kind"] == "cross_entropy" and report.loss["target"] == target
    _assert_grads_match(report, _param_grads(model, loss))


class OwnLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.fc(x)
        return {"logits": logits, "loss": (logits - 1).pow(2).sum()}


def test_the_models_own_loss_is_used() -> None:
    torch.manual_seed(0)
    model = OwnLoss()
    x = torch.randn(2, 4)
    report = hookcli.grads(model, inputs=[_save(x, "x")], params="all")
    assert report.loss["kind"] == "model_loss" and report.loss["output"] == "['loss']"
    _assert_grads_match(report, _param_grads(model, model(x)["loss"]))


def test_ce_on_sequence_logits_without_tokens_uses_seeded_random_targets() -> None:
    torch.manual_seed(0)
    model = nn.Linear(6, 9)
    x = torch.randn(2, 5, 6)
    report = hookcli.grads(model, inputs=[_save(x, "x")], params="all", loss="ce", seed=3)
    targets = torch.randint(0, 9, (2, 5), generator=torch.Generator().manual_seed(3))
    loss = F.cross_entropy(model(x).reshape(-1, 9), targets.reshape(-1))
    assert report.loss["targets"] == "randint(0, 9, seed=3) per token"
    _assert_grads_match(report, _param_grads(model, loss))


def test_gpt2_logits_next_token_loss_matches_autograd() -> None:
    torch.manual_seed(0)
    model = _gpt2()
    ids = torch.randint(0, 100, (2, 10))
    report = hookcli.grads(model, inputs=[_save(ids, "ids")], params="all")
    assert report.loss["output"] == "['logits']" and report.loss["kind"] == "cross_entropy"
    model.eval()
    logits = model(ids).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, 100), ids[:, 1:].reshape(-1))
    _assert_grads_match(report, _param_grads(model, loss))
