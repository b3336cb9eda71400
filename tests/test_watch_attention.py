"""The watch's transformer signals (docs/watch.md#attention-and-output-logits): each attention head's max
logit and entropy under fused attention, the output logits' log-partition, and their rules.

Every number is checked against the explicit softmax of ``q k^T * scale`` in float64, from q and k that
a plain forward hook captured (or the module's weights recomputed); the seeded faults are named at the
step, layer and head that the same plain-torch numbers give.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookcli
from hookcli.commands.watch_rules import SPECS, rule_settings
from hookcli.engine.attention import ROWS, head_stats
from hookcli.errors import ConfigError

NEW_RULES = ("attention_entropy", "attn_logit_growth", "output_logit_drift")


# -- models -------------------------------------------------------------------------------------------
class Attn(nn.Module):
    """nanoGPT's causal self-attention through ``F.scaled_dot_product_attention``; ``temp`` scales each
    head's queries (1: untouched; the seeded faults raise one head's)."""

    def __init__(self, width: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.register_buffer("temp", torch.ones(heads))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, t, c3 = qkv.shape
        c = c3 // 3
        return tuple(z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in qkv.split(c, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(self.qkv(x))
        if bool((self.temp != 1).any()):
            q = q * self.temp[:, None, None]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).flatten(2))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(width), Attn(width, heads, dropout)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """A nanoGPT-style decoder returning ``(logits, None)``; ``shift`` is added to its logits (0: untouched)."""

    def __init__(self, vocab: int = 50, width: int = 32, heads: int = 4, layers: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(64, width)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)
        self.shift = 0.0

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, None]:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return (logits + self.shift if self.shift else logits), None


def tokens(steps: int, batch: int = 4, length: int = 17, vocab: int = 50, seed: int = 0) -> list[torch.Tensor]:
    """``steps`` batches cycling over 4 fixed ones (the model learns them: attention sharpens)."""
    g = torch.Generator().manual_seed(seed)
    fixed = [torch.randint(0, vocab, (batch, length), generator=g) for _ in range(4)]
    return [fixed[i % 4] for i in range(steps)]


def lm_step(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits, _ = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def log_lines(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


# -- plain torch ----------------------------------------------------------------------------------------
def explicit(q: torch.Tensor, k: torch.Tensor, scale: float | None = None, causal: bool = True,
             mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head (q and k of shape (B, H, L, E)), over every query row: the max logit and the mean entropy of the
    explicit softmax in float64 (rows that attend to nothing left out)."""
    q, k = q.double(), k.double()
    z = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if mask is not None:
        z = z.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else z + mask.double()
    if causal:
        z = z.masked_fill(torch.ones(z.shape[-2:], dtype=torch.bool).tril().logical_not(), -math.inf)
    valid = (z > -math.inf).any(-1)
    p = torch.softmax(z, -1)
    ent = -torch.where(p > 0, p * torch.log(p), torch.zeros(()).double()).sum(-1)
    top = torch.where(valid, z.amax(-1), -math.inf).amax((0, 2))  # (B, H, L) -> per head
    ent_mean = torch.where(valid, ent, 0).sum((0, 2)) / valid.sum((0, 2))
    return top, ent_mean


def sampled_rows(batch: int, length: int) -> list[tuple[int, int]]:
    """The (batch element, query row) pairs docs/watch.md says are sampled, written from the docs."""
    n = min(batch, ROWS)
    chosen = [i * batch // n for i in range(n)]
    r = min(length, max(1, math.ceil(ROWS / n)))
    return [(chosen[b], ((2 * (j * n + b) + 1) * length) // (2 * r * n)) for b in range(n) for j in range(r)]


def qk_capture(model: NanoGPT) -> tuple[list, list]:
    """Forward hooks on each block's ``qkv`` Linear: per forward call, [(q, k) of each layer], temp applied."""
    calls: list[list] = []
    handles = []
    for i, block in enumerate(model.blocks):
        def hook(mod, args, out, i=i, attn=block.attn):
            if i == 0:
                calls.append([])
            q, k, _ = attn.split(out.detach())
            calls[-1].append((q * attn.temp[:, None, None], k))
        handles.append(block.attn.qkv.register_forward_hook(hook))
    return calls, handles


# -- numbers ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("autocast", [False, True])
def test_nanogpt_heads_equal_the_explicit_softmax(tmp_path, autocast):
    """B*L <= 64: every query row is sampled, so the heads' numbers are the exact ones over all rows.
    Under bfloat16 autocast q and k are bfloat16, and the logits are still computed from them in float32."""
    torch.manual_seed(0)
    model = NanoGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    calls, handles = qk_capture(model)
    data = tokens(3)
    with hookcli.watch(model, opt, out=tmp_path / "log.jsonl", on_finding="warn") as w:
        for batch in data:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = lm_step(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            w.step()
    for h in handles:
        h.remove()
    lines = log_lines(tmp_path / "log.jsonl")
    assert len(lines) == 3
    for line, layers in zip(lines, calls):
        got = {a["name"]: a for a in line["attention"]}
        assert list(got) == ["blocks.0.attn", "blocks.1.attn"]
        for i, (q, k) in enumerate(layers):
            top, ent = explicit(q, k)
            entry = got[f"blocks.{i}.attn"]
            assert entry["heads"] == 4 and entry["keys"] == 16 and entry["rows"] == [64] * 4
            assert entry["max_logit"] == pytest.approx(top.tolist(), rel=1e-5, abs=1e-5)
            assert entry["entropy"] == pytest.approx(ent.tolist(), rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("chunk", [None, 120])
def test_output_logits_equal_plain_torch(tmp_path, monkeypatch, chunk):
    """(chunk: the logits read a few rows at a time, 2 rows of 50 classes here, as a large vocabulary's are)"""
    if chunk is not None:
        monkeypatch.setattr("hookcli.engine.attention.CHUNK", chunk)
    torch.manual_seed(1)
    model = NanoGPT()
    outs = []
    model.register_forward_hook(lambda m, a, out: outs.append(out[0].detach().double()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hookcli.watch(model, opt, out=tmp_path / "log.jsonl", on_finding="warn") as w:
        for batch in tokens(2):
            lm_step(model, batch).backward()
            opt.step()
            w.step()
    for line, z in zip(log_lines(tmp_path / "log.jsonl"), outs):
        rows = z.reshape(-1, z.shape[-1])
        assert line["output_logits"]["output"] == "[0]" and line["output_logits"]["rows"] == 64
        assert line["output_logits"]["classes"] == 50
        assert line["output_logits"]["max"] == pytest.approx(rows.amax(-1).mean().item(), rel=1e-6)
        assert line["output_logits"]["logsumexp"] == pytest.approx(torch.logsumexp(rows, -1).mean().item(), rel=1e-6)


def _gpt2(**kwargs):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=50, n_positions=32, **kwargs)
    return transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa")


def test_gpt2_sdpa_heads_equal_the_explicit_softmax(tmp_path):
    torch.manual_seed(2)
    model = _gpt2()
    captured: list = []
    for block in model.transformer.h:
        block.attn.c_attn.register_forward_hook(lambda m, a, out: captured.append(out.detach()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = tokens(1, batch=8, length=16)[0]  # 8 x 16 = 128 rows: 8 of each sample's are sampled
    with hookcli.watch(model, opt, out=tmp_path / "log.jsonl", on_finding="warn") as w:
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        w.step()
    (line,) = log_lines(tmp_path / "log.jsonl")
    got = {a["name"]: a for a in line["attention"]}
    assert list(got) == ["transformer.h.0.attn", "transformer.h.1.attn"]
    rows = sampled_rows(8, 16)
    for i, out in enumerate(captured):
        q, k, _ = (z.view(8, 16, 4, 8).transpose(1, 2) for z in out.split(32, 2))
        z = q.double() @ k.double().transpose(-1, -2) / math.sqrt(8)
        z = z.masked_fill(torch.ones(16, 16, dtype=torch.bool).tril().logical_not(), -math.inf)
        picked = torch.stack([z[b, :, j] for b, j in rows], 1)  # (heads, rows, keys)
        p = torch.softmax(picked, -1)
        ent = -torch.where(p > 0, p * p.log(), torch.zeros((), dtype=torch.float64)).sum(-1).mean(1)
        entry = got[f"transformer.h.{i}.attn"]
        assert entry["rows"] == [len(rows)] * 4 == [64] * 4
        assert entry["max_logit"] == pytest.approx(picked.amax((1, 2)).tolist(), rel=1e-5, abs=1e-5)
        assert entry["entropy"] == pytest.approx(ent.tolist(), rel=1e-5, abs=1e-5)
    assert line["output_logits"]["output"] == "['logits']"


def test_multihead_attention_heads_equal_its_weights_recomputed(tmp_path):
    """``nn.MultiheadAttention`` (need_weights=False, as torchvision's ViT calls it) reaches the function
    through ``F.multi_head_attention_forward``: q and k recomputed from its in_proj weights."""
    torch.manual_seed(3)
    mha = nn.MultiheadAttention(16, 2, batch_first=True)
    model = nn.Sequential()
    model.add_module("mha", mha)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha, self.out = mha, nn.Linear(16, 3)

        def forward(self, x):
            return self.out(self.mha(x, x, x, need_weights=False)[0]).mean(1)

    net = Net()
    x = torch.randn(3, 5, 16)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with hookcli.watch(net, opt, out=tmp_path / "log.jsonl", on_finding="warn") as w:
        net(x).sum().backward()
        w.step()
    (line,) = log_lines(tmp_path / "log.jsonl")
    (entry,) = line["attention"]
    wq, wk, _ = mha.in_proj_weight.detach().double().chunk(3)
    bq, bk, _ = mha.in_proj_bias.detach().double().chunk(3)
    q = (x.double() @ wq.T + bq).view(3, 5, 2, 8).transpose(1, 2)
    k = (x.double() @ wk.T + bk).view(3, 5, 2, 8).transpose(1, 2)
    top, ent = explicit(q, k, causal=False)
    assert entry["name"] == "mha" and entry["heads"] == 2
    # (the weights were read after the step: SGD without a step leaves them as the forward saw them)
    assert entry["max_logit"] == pytest.approx(top.tolist(), rel=1e-5, abs=1e-5)
    assert entry["entropy"] == pytest.approx(ent.tolist(), rel=1e-5, abs=1e-5)


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 70), heads=st.integers(1, 3), length=st.integers(1, 9), keys=st.integers(1, 9),
       width=st.integers(1, 6), mask=st.sampled_from(["none", "bool", "float", "causal"]),
       scale=st.one_of(st.none(), st.floats(0.01, 4.0)), gqa=st.booleans(), seed=st.integers(0, 2**16))
def test_head_stats_equal_the_explicit_softmax_on_the_sampled_rows(batch, heads, length, keys, width, mask, scale,
                                                                   gqa, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads * (2 if gqa else 1), length, width, generator=g) * 3
    k = torch.randn(batch, heads, keys, width, generator=g) * 3
    attn_mask = None
    if mask == "bool":
        attn_mask = torch.rand(batch, 1, length, keys, generator=g) > 0.4
    elif mask == "float":
        attn_mask = torch.randn(length, keys, generator=g)
    vector, h = head_stats(q, k, attn_mask, mask == "causal", scale, gqa)
    assert h == q.shape[1]
    kk = k.repeat_interleave(2, 1) if gqa else k
    z = q.double() @ kk.double().transpose(-1, -2) * (scale if scale is not None else width ** -0.5)
    if attn_mask is not None:
        z = z.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else z + attn_mask.double()
    if mask == "causal":
        z = z.masked_fill(torch.ones(length, keys, dtype=torch.bool).tril().logical_not(), -math.inf)
    picked = torch.stack([z[b, :, j] for b, j in sampled_rows(batch, length)], 1)  # (heads, rows, keys)
    valid = (picked > -math.inf).any(-1)
    p = torch.softmax(picked, -1)
    ent = torch.where(valid, -torch.where(p > 0, p * p.log(), torch.zeros((), dtype=torch.float64)).sum(-1), 0)
    count = valid.sum(1)
    assert vector[2 * h:].tolist() == count.tolist()
    for head in range(h):
        if count[head]:
            assert vector[head].item() == pytest.approx(picked[head].amax().item(), rel=1e-5, abs=1e-4)
            assert vector[h + head].item() == pytest.approx(ent[head].sum().item(), rel=1e-4, abs=1e-4)


# -- the seeded faults ------------------------------------------------------------------------------------
def train_nanogpt(tmp_path, steps: int, every: int, fault=None, dropout: float = 0.0, rules=None):
    """A nanoGPT-style run under the watch (``fault(model, step)`` before each step's forward): the
    findings, each logged step's (q, k) per layer and output logits, as plain hooks saw them."""
    torch.manual_seed(0)
    model = NanoGPT(dropout=dropout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    calls, handles = qk_capture(model)
    outs: list[torch.Tensor] = []
    handles.append(model.register_forward_hook(lambda m, a, out: outs.append(out[0].detach().double())))
    with hookcli.watch(model, opt, every=every, out=tmp_path / "log.jsonl", on_finding="warn", rules=rules) as w:
        for step, batch in enumerate(tokens(steps)):
            if fault is not None:
                fault(model, step)
            loss = lm_step(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            w.step(loss=loss)
    for h in handles:
        h.remove()
    logged = range(0, steps, every)
    return w.findings, [(s, calls[s]) for s in logged], [(s, outs[s]) for s in logged]


def first_crossing(series: list[tuple[int, float]], crossed, warmup: int = 3) -> int | None:
    """The first step whose value crosses (``crossed(value, early)``) against the mean of the first
    ``warmup`` values (early: None while they come in)."""
    for i, (step, value) in enumerate(series):
        early = sum(v for _, v in series[:warmup]) / warmup if i >= warmup else None
        if crossed(value, early):
            return step
    return None


def only(findings, rule):
    found = [f for f in findings if f.rule == rule]
    assert len(found) == 1, [f.line() for f in findings]
    return found[0]


def test_entropy_collapse_is_named_by_layer_head_and_step(tmp_path):
    def hotter(model, step):  # one head's temperature shrinks: its queries grow 1.3x a step
        model.blocks[1].attn.temp[2] = 1.3 ** step

    findings, logged, _ = train_nanogpt(tmp_path, 40, 2, hotter)
    entropy = {(layer, head): [(s, explicit(*qk[layer])[1][head].item()) for s, qk in logged]
               for layer in range(2) for head in range(4)}
    expected = {key: first_crossing(series, lambda v, early: early is not None and v < 0.1 * early)
                for key, series in entropy.items()}
    assert {key for key, step in expected.items() if step is not None} == {(1, 2)}
    finding = only(findings, "attention_entropy")
    assert (finding.layer, finding.step) == ("blocks.1.attn", expected[(1, 2)])
    assert "head 2's attention entropy" in finding.message
    assert finding.value == pytest.approx(dict(entropy[(1, 2)])[finding.step], rel=1e-4)


def test_attention_logit_growth_is_named_by_layer_head_and_step(tmp_path):
    def blow_up(model, step):  # one head's QK scale blows up: 1.25x a step
        model.blocks[0].attn.temp[1] = 1.25 ** step

    findings, logged, _ = train_nanogpt(tmp_path, 40, 2, blow_up)
    tops = {(layer, head): [(s, explicit(*qk[layer])[0][head].item()) for s, qk in logged]
            for layer in range(2) for head in range(4)}
    expected = {key: first_crossing(series, lambda v, early: v > (50 if early is None else min(50, 25 * max(early, 1))))
                for key, series in tops.items()}
    assert {key for key, step in expected.items() if step is not None} == {(0, 1)}
    finding = only(findings, "attn_logit_growth")
    assert (finding.layer, finding.step) == ("blocks.0.attn", expected[(0, 1)])
    assert "head 1's largest attention logit" in finding.message
    assert finding.value == pytest.approx(dict(tops[(0, 1)])[finding.step], rel=1e-4)


def test_output_logit_drift_is_named_at_its_step(tmp_path):
    def drift(model, step):  # every logit moves up by 1.5 a step (the log-partition with them)
        model.shift = 1.5 * step

    findings, _, outs = train_nanogpt(tmp_path, 40, 2, drift)
    lse = [(s, torch.logsumexp(z, -1).mean().item()) for s, z in outs]
    expected = first_crossing(lse, lambda v, early: early is not None and abs(v - early) > 20)
    assert expected is not None
    finding = only(findings, "output_logit_drift")
    early = sum(v for _, v in lse[:3]) / 3
    assert finding.step == expected and finding.value == pytest.approx(dict(lse)[expected] - early, rel=1e-5)
    assert not [f for f in findings if f.rule in ("attention_entropy", "attn_logit_growth")]


def test_the_rules_take_their_settings(tmp_path):
    def drift(model, step):
        model.shift = 1.5 * step

    findings, _, _ = train_nanogpt(tmp_path, 20, 2, drift, rules={"output_logit_drift": {"shift": 5.0, "warmup": 1}})
    assert only(findings, "output_logit_drift").limit == 5.0
    findings, _, _ = train_nanogpt(tmp_path, 20, 2, drift, rules={"output_logit_drift": False})
    assert not [f for f in findings if f.rule == "output_logit_drift"]
    with pytest.raises(ConfigError, match="attn_logit_growth.*no key 'limit'"):
        hookcli.watch(NanoGPT(), rules={"attn_logit_growth": {"limit": 3}})
    with pytest.raises(ConfigError, match="attention_entropy.fraction"):
        hookcli.watch(NanoGPT(), rules={"attention_entropy": {"fraction": 0}})


# -- bit for bit ---------------------------------------------------------------------------------------
def _losses(model: nn.Module, step, batches, watched: bool, tmp_path) -> tuple[list[float], list[torch.Tensor]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []

    def run(w=None):
        torch.manual_seed(123)  # (the dropout's draws)
        for batch in batches:
            loss = step(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if w is not None:
                w.step(loss=loss)

    if watched:
        with hookcli.watch(model, opt, every=1, out=tmp_path / "bits.jsonl", on_finding="warn") as w:
            run(w)
        assert all(line.get("attention") for line in log_lines(tmp_path / "bits.jsonl"))
    else:
        run()
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", ["nanogpt", "nanogpt-bf16-autocast", "gpt2"])
def test_the_watched_loop_computes_bit_for_bit_what_the_unwatched_does(tmp_path, name):
    def build():
        torch.manual_seed(5)
        return _gpt2(attn_pdrop=0.1) if name == "gpt2" else NanoGPT(dropout=0.1)

    def step(model, batch):
        if name == "gpt2":
            return model(input_ids=batch, labels=batch).loss
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=name.endswith("autocast")):
            return lm_step(model, batch)

    batches = tokens(6)
    plain, plain_params = _losses(build(), step, batches, False, tmp_path)
    watched, watched_params = _losses(build(), step, batches, True, tmp_path)
    assert watched == plain
    assert all(torch.equal(a, b) for a, b in zip(plain_params, watched_params))
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention  # put back


# -- healthy runs ------------------------------------------------------------------------------------------
def _hf_lm(config: str, model: str, **kwargs):
    def build():
        transformers = pytest.importorskip("transformers")
        cfg = getattr(transformers, config)(vocab_size=50, **kwargs)
        return getattr(transformers, model)._from_config(cfg, attn_implementation="sdpa")
    return build


def _vit_timm():
    timm = pytest.importorskip("timm")
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32,
                             depth=2, num_heads=4, num_classes=10)


def _vit_torchvision():
    torchvision = pytest.importorskip("torchvision")
    return torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4,
                                                hidden_dim=32, mlp_dim=64, num_classes=10)


def _tokens_step(model, batch):
    return model(input_ids=batch, labels=batch).loss


def _image_step(model, batch):
    g = torch.Generator().manual_seed(int(batch[0, 0]))
    images, labels = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)
    return F.cross_entropy(model(images), labels)


HEALTHY = {  # name: (build, step, attention modules a logged step names)
    "nanogpt": (lambda: NanoGPT(), lm_step, 2),
    "gpt2": (_hf_lm("GPT2Config", "GPT2LMHeadModel", n_embd=32, n_layer=2, n_head=4, n_positions=32),
             _tokens_step, 2),
    "llama": (_hf_lm("LlamaConfig", "LlamaForCausalLM", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32), _tokens_step, 2),
    "bert": (_hf_lm("BertConfig", "BertForMaskedLM", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=64, max_position_embeddings=32), _tokens_step, 2),
    "t5": (_hf_lm("T5Config", "T5ForConditionalGeneration", d_model=32, d_ff=64, d_kv=8, num_layers=2,
                  num_decoder_layers=2, num_heads=4, decoder_start_token_id=0), _tokens_step, 6),
    "vit-timm": (_vit_timm, _image_step, 2),
    "vit-torchvision": (_vit_torchvision, _image_step, 2),
}


HEALTHY_STEPS, HEALTHY_EVERY = 200, 1


@pytest.mark.parametrize("name", list(HEALTHY))
def test_healthy_transformers_train_without_findings(tmp_path, name):
    """200 steps of AdamW at a sane learning rate over 4 fixed batches (they are learnt: attention
    sharpens, logits grow) with every rule at its defaults (the attention rules, adam_rms,
    update_grad_cosine, massive_activation, loss_spike and the others): no rule speaks, every logged step
    measured every attention module, and the signals the rules judge were there to judge."""
    build, step, modules = HEALTHY[name]
    assert set(rule_settings(None)) == {spec.name for spec in SPECS}  # the defaults enable every rule
    torch.manual_seed(0)
    model = build().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with hookcli.watch(model, opt, every=HEALTHY_EVERY, out=tmp_path / "log.jsonl", on_finding="warn") as w:
        for batch in tokens(HEALTHY_STEPS, length=16):
            loss = step(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            w.step(loss=loss)
    assert [f.line() for f in w.findings] == []
    lines = log_lines(tmp_path / "log.jsonl")
    assert len(lines) == HEALTHY_STEPS // HEALTHY_EVERY and lines[-1]["loss"] < lines[0]["loss"]
    assert all(len(line["attention"]) == modules and line["output_logits"] is not None for line in lines)
    heads = [h for line in lines for a in line["attention"] for h in a["entropy"]]
    assert all(h is not None and h >= 0 for h in heads)
    for line in lines[1:]:  # (the first logged step: Adam's first update, its cosine and RMS are measured too)
        assert all(p["adam_rms"] is not None and p["update_grad_cosine"] is not None for p in line["params"])
        assert any(layer.get("channel_peak_ratio") is not None for layer in line["layers"])


def test_unlogged_steps_run_torch_own_function_without_the_probe_hooks(tmp_path):
    """Only a logged step is measured: on the others the function is torch's own and no module carries
    the probe's hooks; and the loop raising puts everything back."""
    torch.manual_seed(0)
    model = NanoGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plain = torch._C._nn.scaled_dot_product_attention
    hooks = len(model.blocks[0].attn._forward_hooks)
    seen = []
    with pytest.raises(RuntimeError, match="the loop's own"):
        with hookcli.watch(model, opt, every=2, out=tmp_path / "log.jsonl", on_finding="warn") as w:
            for step, batch in enumerate(tokens(5)):
                seen.append((F.scaled_dot_product_attention is plain, len(model.blocks[0].attn._forward_hooks) > hooks))
                lm_step(model, batch).backward()
                opt.step()
                opt.zero_grad()
                w.step()
                if step == 4:
                    raise RuntimeError("the loop's own")
    assert seen == [(False, True), (True, False), (False, True), (True, False), (False, True)]
    assert F.scaled_dot_product_attention is plain and len(model.blocks[0].attn._forward_hooks) == hooks
    assert [line["step"] for line in log_lines(tmp_path / "log.jsonl") if line.get("attention")] == [0, 2, 4]


def test_with_their_three_rules_off_the_signals_are_not_measured(tmp_path):
    torch.manual_seed(0)
    model = NanoGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plain = torch._C._nn.scaled_dot_product_attention
    with hookcli.watch(model, opt, out=tmp_path / "log.jsonl", on_finding="warn",
                       rules={rule: False for rule in NEW_RULES}) as w:
        for batch in tokens(2):
            assert F.scaled_dot_product_attention is plain
            lm_step(model, batch).backward()
            opt.step()
            w.step()
    lines = log_lines(tmp_path / "log.jsonl")
    assert len(lines) == 2 and not any("attention" in line or "output_logits" in line for line in lines)


def test_a_failure_of_the_probe_stops_the_watch_not_the_loop(tmp_path, monkeypatch):
    """hookcli's own failure while it measures a head is never raised into the model: the loop runs on
    and computes what it computes unwatched, torch's function is put back, the watch says it stopped."""
    from hookcli.errors import WatchWarning

    def broken(*args, **kwargs):
        raise ValueError("a bug of hookcli's")

    batches = tokens(4)
    torch.manual_seed(0)
    plain, _ = _losses(NanoGPT(), lm_step, batches, False, tmp_path)
    monkeypatch.setattr("hookcli.engine.attention.head_stats", broken)
    torch.manual_seed(0)
    model = NanoGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    with pytest.warns(WatchWarning, match="hookcli.watch stopped at step 0: .*a bug of hookcli's"):
        with hookcli.watch(model, opt, out=tmp_path / "stopped.jsonl", on_finding="warn") as w:
            torch.manual_seed(123)
            for batch in batches:
                loss = lm_step(model, batch)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                w.step(loss=loss)
                assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
    assert losses == plain
    assert not (tmp_path / "stopped.jsonl").exists()  # (nothing logged: it stopped at step 0)


# -- the command line ----------------------------------------------------------------------------------------
SCRIPT = '''\
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(16, 48), nn.Linear(16, 16)
        self.temp = 1.0

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, 2, 8).transpose(1, 2) for z in self.qkv(x).split(16, 2))
        y = F.scaled_dot_product_attention(q * self.temp, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).flatten(2))


model = nn.Sequential(nn.Embedding(20, 16), Attn(), nn.Linear(16, 20))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.randint(0, 20, (4, 9), generator=torch.Generator().manual_seed(1))
for step in range(30):
    model[1].temp = 1.4 ** step  # the bug: the attention's temperature shrinks
    loss = F.cross_entropy(model(data[:, :-1]).flatten(0, 1), data[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print("trained")
'''


def test_watch_cmd_logs_the_heads_and_names_the_collapsing_one(cli, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    log = tmp_path / "log.jsonl"
    result = cli("watch", "--every", "2", "--out", log, "--", "python", script)
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "trained\n"
    lines = log_lines(log)
    measured = [line for line in lines if line.get("attention")]
    assert measured and all([a["name"] for a in line["attention"]] == ["1"] for line in measured)
    assert all(line["output_logits"]["classes"] == 20 for line in measured)
    findings = [f for line in lines for f in line["findings"] if f["rule"] == "attention_entropy"]
    assert len(findings) == 1 and findings[0]["layer"] == "1" and findings[0]["step"] > 4  # (after its early level)
    assert f"step {findings[0]['step']}: warning attention_entropy (1): 1 head " in result.stderr


def test_two_watches_at_once_each_measure_their_own_model(tmp_path):
    torch.manual_seed(0)
    a, b = NanoGPT(layers=1), NanoGPT(layers=2)
    opt_a, opt_b = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (a, b))
    kept = []
    with hookcli.watch(a, opt_a, out=tmp_path / "a.jsonl", on_finding="warn") as wa:
        with hookcli.watch(b, opt_b, out=tmp_path / "b.jsonl", on_finding="warn") as wb:
            for batch in tokens(2):
                kept.append(F.scaled_dot_product_attention)  # a reference taken while the wrapper is in place
                for model, opt, w in ((a, opt_a, wa), (b, opt_b, wb)):
                    lm_step(model, batch).backward()
                    opt.step()
                    opt.zero_grad()
                    w.step()
    assert [[x["name"] for x in line["attention"]] for line in log_lines(tmp_path / "a.jsonl")] == [["blocks.0.attn"]] * 2
    assert [[x["name"] for x in line["attention"]] for line in log_lines(tmp_path / "b.jsonl")] == \
        [["blocks.0.attn", "blocks.1.attn"]] * 2
    q, k, v = torch.randn(3, 1, 2, 4, 8).unbind(0)
    assert kept[0] is not torch._C._nn.scaled_dot_product_attention  # (the wrapper, past the watch:)
    assert torch.equal(kept[0](q, k, v), torch._C._nn.scaled_dot_product_attention(q, k, v))


def test_the_watch_table_of_a_config_sets_the_transformer_rules(cli, tmp_path):
    """``[watch.rules.<rule>]`` as ``rules=``: attention_entropy switched off there is silent (the logit
    growth of the same head still told); a key the rule does not have is exit 2 naming the file."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    config = tmp_path / "hookcli.toml"
    config.write_text('[watch]\nevery = 2\nout = "log.jsonl"\n[watch.rules.attention_entropy]\nenabled = false\n')
    result = cli("watch", "--config", config, "--", "python", script)
    assert result.exit_code == 0, result.stderr
    assert "attention_entropy" not in result.stderr and "warning attn_logit_growth (1)" in result.stderr
    config.write_text('[watch.rules.output_logit_drift]\nnats = 3\n')
    result = cli("watch", "--config", config, "--", "python", script)
    assert result.exit_code == 2
    assert result.stderr.startswith(f"Error: {config}")
    assert "[watch] rules: 'output_logit_drift' has no key 'nats'" in result.stderr.splitlines()[0]
