"""``hookcli.watch`` names the code that made the run's first NaN/Inf, not the first module that read it
(docs/watch.md#where-a-naninf-was-made): a zoo of seeded causes, each at a known step, unlogged
(``every=50``, ``flight=4``). The ground truth is plain torch computed here: the test's own forward
hooks on every module (containers included) of an unwatched twin, or ``torch.autograd.grad`` for
a backward cause; and the watched run computes what the twin computes, bit for bit."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import hookcli
from hookcli.engine.cause import CauseTracer
from test_watch import no_hooks_left
from training_bugs import NanGrad

STEP = 7  # the step each cause fires at (calls count from 0, one forward per step)


class Trigger(nn.Module):
    """A module whose forward knows its call count (``hit``: this call is the seeded bug's)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def hit(self) -> bool:
        self.calls += 1
        return self.calls - 1 == STEP


class MaskedBlock(Trigger):
    """Its own forward multiplies its output by a NaN mask at STEP; its Linear and GELU stay finite."""

    def __init__(self, bad: bool) -> None:
        super().__init__()
        self.lin, self.act, self.bad = nn.Linear(8, 8), nn.GELU(), bad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.lin(x))
        if self.hit() and self.bad:
            mask = torch.ones_like(y)
            mask[0, 0] = float("nan")
            y = y * mask
        return y


class Tower(nn.Module):
    """embed, four residual blocks (the third seeded), head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([MaskedBlock(i == 2) for i in range(4)])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class Attention(Trigger):
    """Two heads through ``F.scaled_dot_product_attention``; at STEP the queries are scaled so far (a
    temperature gone wrong) that the attention logits overflow inside SDPA: its softmax is NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.reshape(b, t, 2, 4).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        if self.hit():
            q = q.clamp(-1, 1) * 3e38  # finite, but q @ k overflows
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, 8))


class AttentionNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.attn, self.head = nn.Linear(4, 8), Attention(), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(self.embed(x)))


class Gate(Trigger):
    """fc, then its own arithmetic on a value that reaches 0 at STEP, then out: ``log`` (log 0 = -inf),
    ``sqrt`` (of -1: NaN) or ``div`` (by 0: inf)."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.fc, self.out, self.op = nn.Linear(8, 8), nn.Linear(8, 8), op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        s = torch.zeros_like(h[:, :1]) if self.hit() else torch.ones_like(h[:, :1])
        if self.op == "log":
            h = h * torch.log(s)
        elif self.op == "sqrt":
            h = h * torch.sqrt(s * 2 - 1)
        else:
            h = h / s
        return self.out(h)


class GateNet(nn.Module):
    def __init__(self, op: str) -> None:
        super().__init__()
        self.embed, self.gate, self.head = nn.Linear(4, 8), Gate(op), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(self.embed(x)))


class CustomBackward(Trigger):
    """lin, then (at STEP) the custom Function, then act: the forward stays finite."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.act = nn.Linear(8, 8), nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return self.act(NanGrad.apply(y) if self.hit() else y)


class CustomNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.block, self.head = nn.Linear(4, 8), CustomBackward(), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(x)))


class Overflow(Trigger):
    """bfloat16: at STEP its own code scales the input to near bfloat16's largest (finite); its Linear
    of all-ones weights then overflows to Inf."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.lin = nn.Linear(4, 16), nn.Linear(16, 16)
        with torch.no_grad():
            self.lin.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        if self.hit():
            h = h.sign() * 3e38  # finite in bfloat16 (its largest is 3.39e38)
        return self.lin(h)


class OverflowNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.amp, self.head = Overflow(), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.amp(x))


def batch(model: nn.Module, g: torch.Generator) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    shape = (4, 5, 4) if isinstance(model, AttentionNet) else (16, 4)
    return torch.randn(shape, generator=g).to(dtype)


def train(model: nn.Module, steps: int, watch: dict[str, Any] | None) -> tuple[list[torch.Tensor], Any]:
    """``steps`` seeded SGD steps, watched (``watch``: hookcli.watch's keywords) or not; the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    losses: list[torch.Tensor] = []

    def one_step() -> None:
        loss = model(batch(model, g)).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())

    if watch is None:
        for _ in range(steps):
            one_step()
        return losses, None
    with hookcli.watch(model, opt, **watch) as w:
        for _ in range(steps):
            one_step()
            w.step(loss=losses[-1])
    no_hooks_left(model, opt)
    return losses, w


def forward_events(model: nn.Module, x: torch.Tensor) -> list[tuple[str, str, bool]]:
    """Plain torch: (module, "in" or "out", finite) for every module call in order, containers included."""
    events: list[tuple[str, str, bool]] = []
    handles = []
    finite = (lambda v: all(bool(torch.isfinite(t).all()) for t in (v if isinstance(v, tuple) else (v,))
                            if isinstance(t, torch.Tensor)))
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda m, a, n=name: events.append((n, "in", finite(a)))))
        handles.append(module.register_forward_hook(lambda m, a, o, n=name: events.append((n, "out", finite(o)))))
    try:
        model(x)
    finally:
        for h in handles:
            h.remove()
    return events


def reference(factory: Callable[[], nn.Module]) -> tuple[nn.Module, torch.Tensor]:
    """An unwatched twin trained to just before STEP, and STEP's batch."""
    torch.manual_seed(0)
    model = factory()
    train(model, STEP, None)
    g = torch.Generator().manual_seed(0)
    for _ in range(STEP):
        batch(model, g)
    return model, batch(model, g)


# (factory, the module named, direction, the message's words, plain torch's first non-finite event)
ZOO = {
    "parent's forward": (Tower, "blocks.2", "forward", "made in blocks.2's own forward (after blocks.2.act); "
                         "first seen in blocks.3.lin's output", ("blocks.2", "out")),
    "sdpa": (AttentionNet, "attn", "forward", "made in attn's own forward (between attn.qkv and attn.proj); "
             "first seen in attn.proj's output", ("attn.proj", "in")),
    "log(0)": (lambda: GateNet("log"), "gate", "forward", "made in gate's own forward (between gate.fc and "
               "gate.out)", ("gate.out", "in")),
    "sqrt(-1)": (lambda: GateNet("sqrt"), "gate", "forward", "made in gate's own forward (between gate.fc and "
                 "gate.out)", ("gate.out", "in")),
    "division by 0": (lambda: GateNet("div"), "gate", "forward", "made in gate's own forward (between gate.fc "
                      "and gate.out)", ("gate.out", "in")),
    "bf16 overflow": (lambda: OverflowNet().to(torch.bfloat16), "amp.lin", "forward",
                      "made by amp.lin (its output:", ("amp.lin", "out")),
}


@pytest.mark.parametrize("case", list(ZOO))
def test_the_code_that_made_a_nan_is_named_with_its_step(case: str) -> None:
    factory, layer, direction, words, truth = ZOO[case]
    model, x = reference(factory)
    events = forward_events(model, x)
    first_bad = next(i for i, (_, _, ok) in enumerate(events) if not ok)
    assert events[first_bad][:2] == truth  # plain torch: where the non-finite value first shows
    assert all(ok for _, _, ok in events[:first_bad])

    torch.manual_seed(0)
    plain, watched = factory(), None
    watched = copy.deepcopy(plain)
    want, _ = train(plain, STEP + 3, None)
    got, w = train(watched, STEP + 3, {"every": 50, "flight": 4})
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=0, atol=0, equal_nan=True)
    assert [(f.rule, f.step, f.layer, f.direction) for f in w.findings] == [("nonfinite", STEP, layer, direction)]
    assert w.findings[0].message.startswith(f"first NaN/Inf of the run at step {STEP}: {words}")


class LevelGate(nn.Module):
    """fc, then its own ``log`` of a buffer the loop sets to 0 at STEP (log 0 = -inf; no Python state for
    Dynamo to guard on: one compiled graph for every step), then out."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("level", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc(x)) + torch.log(self.level))


class LevelNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.gate, self.head = nn.Linear(4, 8), LevelGate(), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(self.embed(x)))


def train_level(model: LevelNet, steps: int, watch: dict[str, Any] | None, *, compiled: bool = False,
                scaler: torch.amp.GradScaler | None = None, hooks: bool = False
                ) -> tuple[list[torch.Tensor], Any, list[tuple[int, str, str, bool]]]:
    """``steps`` seeded SGD steps of ``model`` (its gate's level 0 at STEP), through
    ``torch.compile(model, backend="aot_eager")`` or under float16 autocast with ``scaler``; watched
    (``watch``) or not. The losses, the watch, and with ``hooks`` plain torch's ground truth: the test's
    own forward hooks on every module, (step, module, "in"/"out", finite) for each call."""
    torch.compiler.reset()
    run = torch.compile(model, backend="aot_eager") if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    losses: list[torch.Tensor] = []
    events: list[tuple[int, str, str, bool]] = []
    handles = []
    if hooks:
        def finite(v: Any) -> bool:
            return all(bool(torch.isfinite(t).all()) for t in (v if isinstance(v, tuple) else (v,)))

        for name, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(
                lambda m, a, n=name: events.append((len(losses), n, "in", finite(a)))))
            handles.append(module.register_forward_hook(
                lambda m, a, o, n=name: events.append((len(losses), n, "out", finite(o)))))
    with hookcli.watch(run, opt, **watch) if watch else contextlib.nullcontext() as w:
        for step in range(steps):
            model.gate.level.fill_(0.0 if step == STEP else 1.0)
            with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
                loss = run(torch.randn(16, 4, generator=g)).float().pow(2).mean()
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
            if w is not None:
                w.step(loss=losses[-1])
    for handle in handles:
        handle.remove()
    if watch:
        no_hooks_left(model, opt)
    return losses, w, events


def first_bad(events: list[tuple[int, str, str, bool]]) -> tuple[int, str, str]:
    return next((step, name, kind) for step, name, kind, ok in events if not ok)


def test_under_torch_compile_the_first_output_that_holds_a_nan_is_not_blamed() -> None:
    """A compiled model (aot_eager: one graph, the module boundaries inside it gone) is not traced (the
    tracer's hooks on every module would break the graph at each). Plain torch (an eager twin's own
    hooks): the log(0) is made in gate's own forward, between gate.fc (finite) and gate.out (its input
    not finite). The finding is at STEP, located at gate.out's output where it is first seen, and says
    that gate.out or code before it made it, gate.fc's output the last finite one: what the compiled run
    can tell, no module blamed. The watched compiled run computes what the unwatched one does."""
    torch.manual_seed(0)
    _, _, events = train_level(LevelNet(), STEP + 1, None, hooks=True)
    assert first_bad(events) == (STEP, "gate.out", "in")
    assert (STEP, "gate.fc", "out", True) in events

    torch.manual_seed(0)
    plain = LevelNet()
    want, _, _ = train_level(copy.deepcopy(plain), STEP + 3, None, compiled=True)
    for watch in ({"every": 50, "flight": 4}, {"every": 1}):  # a flight recorder's step, a logged one
        got, w, _ = train_level(copy.deepcopy(plain), STEP + 3, {**watch, "on_finding": "warn"}, compiled=True)
        torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=0, atol=0, equal_nan=True)
        nonfinite = [f for f in w.findings if f.rule == "nonfinite"]
        assert [(f.step, f.layer, f.direction) for f in nonfinite] == [(STEP, "gate.out", "forward")]
        assert nonfinite[0].message == (
            f"first NaN/Inf of the run at step {STEP}: not traced under torch.compile: made by gate.out or by code "
            "that ran before it (every output before it is finite, the last gate.fc's); first seen in gate.out's "
            "output (128 non-finite values)")


def test_under_a_grad_scaler_the_maker_of_a_forward_nan_is_named_and_a_skip_is_no_nan_of_the_run() -> None:
    """float16 autocast and a GradScaler on CPU; gate's own log(0) at STEP. Plain torch: the first
    non-finite value is gate.out's input at STEP (an eager twin's own hooks), the scaler skips that step
    (its scale halves there only) and the weights stay finite. With the flight recorder the maker is
    named at STEP; logged every 5 steps (STEP unlogged) nothing is reported: the logged steps and the
    weights are finite, the scaler threw the NaN step away. The watched loop computes the same losses."""
    def scaler() -> torch.amp.GradScaler:
        return torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)

    torch.manual_seed(0)
    twin, twin_scaler = LevelNet(), scaler()
    scales = []
    want, _, events = train_level(twin, STEP + 1, None, scaler=twin_scaler, hooks=True)
    assert first_bad(events) == (STEP, "gate.out", "in")
    assert twin_scaler.get_scale() == 2.0 ** 7  # halved once: the NaN step skipped
    assert all(bool(torch.isfinite(p).all()) for p in twin.parameters())

    for watch, findings in (({"every": 50, "flight": 4}, [("nonfinite", STEP, "gate", "forward")]),
                            ({"every": 5}, [])):
        torch.manual_seed(0)
        model, model_scaler = LevelNet(), scaler()
        got, w, _ = train_level(model, STEP + 3, {**watch, "on_finding": "warn"}, scaler=model_scaler)
        scales.append(model_scaler.get_scale())
        torch.testing.assert_close(torch.stack(got[:STEP + 1]), torch.stack(want), rtol=0, atol=0, equal_nan=True)
        assert [(f.rule, f.step, f.layer, f.direction) for f in w.findings if f.rule == "nonfinite"] == findings
        assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
        if findings:
            assert w.findings[0].message.startswith(
                f"first NaN/Inf of the run at step {STEP}: made in gate's own forward (between gate.fc and gate.out)")
    assert scales == [2.0 ** 7, 2.0 ** 7]


def test_a_grad_scaler_skipping_overflowing_steps_is_no_nan_of_the_run(tmp_path: Any) -> None:
    """float16 autocast, a GradScaler whose first scale (2^30) overflows the scaled gradients for several
    steps: plain torch (the test's own tensor hook) sees the model output's gradient non-finite, the
    scaler halves its scale and the weights stay unchanged and finite. Every step logged and with the
    flight recorder: each line says skipped and holds the infinite output gradients, and there is no
    nonfinite finding: the scaler skipping by design is not a NaN of the run."""
    import json

    def run(watch: dict[str, Any] | None, out: Any = None) -> tuple[list[bool], list[float], nn.Module, Any]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 30)
        g = torch.Generator().manual_seed(0)
        finite_grads, scales = [], []
        with hookcli.watch(model, opt, **watch, out=out) if watch else contextlib.nullcontext() as w:
            for _ in range(4):
                with torch.autocast("cpu", dtype=torch.float16):
                    y = model(torch.randn(16, 4, generator=g))
                y.register_hook(lambda grad: finite_grads.append(bool(torch.isfinite(grad).all())))
                loss = y.float().pow(2).mean()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                scales.append(scaler.get_scale())
                if w is not None:
                    w.step(loss=loss.detach())
        return finite_grads, scales, model, w

    torch.manual_seed(0)
    initial = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    finite_grads, scales, model, _ = run(None)
    assert finite_grads == [False] * 4 and scales == [2.0 ** 29, 2.0 ** 28, 2.0 ** 27, 2.0 ** 26]
    assert all(torch.equal(a, b) for a, b in zip(initial.parameters(), model.parameters()))
    for i, watch in enumerate(({"every": 1}, {"every": 50, "flight": 4})):
        log = tmp_path / f"log{i}.jsonl"
        _, watched_scales, _, w = run({**watch, "on_finding": "warn"}, log)
        assert watched_scales == scales
        assert [f.rule for f in w.findings if f.rule == "nonfinite"] == []
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        assert [line["step"] for line in lines] == ([0, 1, 2, 3] if i == 0 else [0])
        assert all(line["skipped"] for line in lines)
        assert all(line["layers"][-1]["grad"]["inf_count"] > 0 for line in lines)


def test_a_custom_backward_that_makes_a_nan_is_named() -> None:
    """The forward of STEP is finite; plain torch's gradients: finite with respect to the block's output,
    NaN with respect to block.lin's (the custom Function between them, in the block's own code)."""
    model, x = reference(CustomNet)
    out = model.block.lin(model.embed(x))
    block_out = model.block.act(NanGrad.apply(out))
    loss = model.head(block_out).pow(2).mean()
    g_block, g_lin = torch.autograd.grad(loss, [block_out, out])
    assert torch.isfinite(block_out).all() and torch.isfinite(g_block).all() and torch.isnan(g_lin).all()

    torch.manual_seed(0)
    _, w = train(CustomNet(), STEP + 3, {"every": 50, "flight": 4})
    assert [(f.rule, f.step, f.layer, f.direction) for f in w.findings] == [("nonfinite", STEP, "block", "backward")]
    assert w.findings[0].message.startswith(
        f"first NaN/Inf of the run at step {STEP}: made in block's own backward (the gradient of block.lin's "
        "output); first seen in block.lin's gradient")


def test_a_logged_step_names_the_cause_too() -> None:
    """Without the flight recorder, a logged step that holds the run's first NaN/Inf (every=1) names its
    maker the same way."""
    torch.manual_seed(0)
    _, w = train(Tower(), STEP + 1, {"every": 1})
    assert [(f.step, f.layer) for f in w.findings] == [(STEP, "blocks.2")]
    assert "made in blocks.2's own forward (after blocks.2.act)" in w.findings[0].message


def test_unlogged_steps_have_no_cause_hooks() -> None:
    """Without ``flight`` an unlogged step has none of the tracer's hooks (they cost every module call):
    installed for a logged step, gone at the next unlogged one."""
    torch.manual_seed(0)
    model = Tower()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    hooked = []
    with hookcli.watch(model, opt, every=3) as w:
        for _ in range(4):
            hooked.append(sum(len(m._forward_pre_hooks) for m in model.modules()))
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            w.step()
    modules = len(list(model.modules()))
    selected = len(w.last.layers)  # the watch's own per-module hooks: one pre-hook per selected module
    # a logged step: the tracer's pre-hook and the attention probe's (engine.attention) on every module
    assert hooked == [2 * modules + selected, selected, selected, 2 * modules + selected]


def test_a_tracer_on_a_healthy_step_finds_nothing() -> None:
    torch.manual_seed(0)
    model = Tower()
    tracer = CauseTracer(model, lambda: False)
    tracer.arm(True)
    model(torch.randn(3, 4)).sum().backward()
    trace = tracer.take()
    tracer.remove()
    assert trace is not None and trace.cause() is None
    # every call (containers included: the model and each block) has its input and output event
    assert len(trace.calls) == len(list(model.modules())) - 1  # the ModuleList itself is never called
    assert all(m._forward_hooks == {} for m in model.modules())


class HostReads(TorchDispatchMode):
    """Every op that reads a tensor's value to the host (``.item()``, ``bool(t)``: a synchronisation)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        if func.overloadpacket in (torch.ops.aten._local_scalar_dense, torch.ops.aten.item):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_tracer_reads_nothing_to_the_host_during_the_step() -> None:
    """Forward, backward and sealing a NaN step's trace: no value reaches the host (the flags stay on
    the device until a step with a NaN/Inf is read)."""
    torch.manual_seed(0)
    model = Tower()
    model.blocks[2].calls = STEP
    tracer = CauseTracer(model, lambda: False)
    tracer.arm(True)
    with HostReads() as mode:
        model(torch.randn(3, 4)).sum().backward()
        trace = tracer.take()
    tracer.remove()
    assert mode.seen == []
    assert trace is not None and trace.cause() is not None and trace.cause().layer == "blocks.2"


def test_a_nan_in_the_batch_is_not_blamed_on_a_module() -> None:
    """A NaN already in the model's input: the first output that holds it is named, and the message
    says where it came from (plain torch: the batch itself is not finite)."""
    torch.manual_seed(0)
    model = Tower()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with hookcli.watch(model, opt, every=50, flight=2) as w:
        for step in range(4):
            x = torch.randn(8, 4)
            if step == 2:
                x[1, 1] = float("nan")
                assert not torch.isfinite(x).all()
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            w.step()
    assert [(f.step, f.layer, f.direction) for f in w.findings] == [(2, "embed", "forward")]
    assert w.findings[0].message.startswith("first NaN/Inf of the run at step 2: already in the model's input; "
                                            "first seen in embed's output")


@pytest.mark.parametrize("mode", ["w.step(loss=)", "backward()", "non-scalar backward"])
def test_without_the_flight_recorder_a_victim_step_is_not_called_the_first(mode: str) -> None:
    """every=5, no flight: blocks.2 makes a NaN at step 7 (unlogged); the optimizer writes NaN weights,
    and logged step 10 sees them first. With a loss (given to w.step, or the one backward() is called
    on), the device flag on every step's loss says step 7 (plain torch: the loop's own loss is first
    non-finite there); with none (a non-scalar backward), "between steps 5 and 10"."""

    def run(model: nn.Module, w: Any) -> list[torch.Tensor]:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(12):
            out = model(batch(model, g))
            loss = out.pow(2).mean()
            if mode == "non-scalar backward":
                (out.pow(2) / out.numel()).backward(torch.ones_like(out))
            else:
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
            if w is not None:
                w.step(loss=loss if mode == "w.step(loss=)" else None)
        return losses

    torch.manual_seed(0)
    plain = Tower()
    watched = copy.deepcopy(plain)
    want = run(plain, None)
    assert [bool(torch.isfinite(loss)) for loss in want].index(False) == STEP
    with hookcli.watch(watched, None, every=5) as w:
        got = run(watched, w)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=0, atol=0, equal_nan=True)
    for (name, a), b in zip(plain.state_dict().items(), watched.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True, msg=name)
    assert [(f.rule, f.step) for f in w.findings] == [("nonfinite", 10)]
    message = w.findings[0].message
    assert message.startswith("first NaN/Inf seen at logged step 10: ") and "of the run" not in message
    assert message.endswith("it appeared between steps 5 and 10" if mode == "non-scalar backward" else
                            "the loss turned non-finite at step 7")


# -- defaults: findings printed, watch -- CMD's every and --flight, the loss of an unchanged script ------------


def test_findings_are_printed_on_stderr_once_by_default(capfd: pytest.CaptureFixture[str]) -> None:
    """``hookcli.watch`` prints each finding as it is found (``on_finding="print"``, the default), once;
    ``on_finding="warn"`` only records it."""
    for on_finding in ("print", "warn"):
        torch.manual_seed(0)
        _, w = train(Tower(), STEP + 3, {"every": 50, "flight": 4, "on_finding": on_finding})
        err = capfd.readouterr().err
        if on_finding == "warn":
            assert err == "" and len(w.findings) == 1
            continue
        assert err == f"hookcli.watch: {w.findings[0].line()}\n"
        assert err.startswith(f"hookcli.watch: step {STEP}: error nonfinite (blocks.2): first NaN/Inf of the run at "
                              f"step {STEP}: made in blocks.2's own forward (after blocks.2.act)")


TOWER_SCRIPT = '''
import sys
import torch
sys.path.insert(0, {tests!r})
from test_watch_cause import Tower

torch.manual_seed(0)
model = Tower()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(0)
for step in range(12):
    loss = model(torch.randn(16, 4, generator=g)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(repr(loss.item()))
'''


@pytest.mark.parametrize("where", ["--flight", "[watch] flight"])
def test_watch_cmd_with_the_flight_recorder_names_the_maker_and_logs_the_scripts_loss(
        cli: Any, tmp_path: Any, where: str) -> None:
    """An unchanged script, the default --every (10): --flight 4 (or the config's) names blocks.2 at step 7;
    the log's loss is the script's own, bit for bit (what it printed), from step 1 on."""
    import json
    from pathlib import Path

    script = tmp_path / "train.py"
    script.write_text(TOWER_SCRIPT.format(tests=str(Path(__file__).parent)))
    log = tmp_path / "log.jsonl"
    flags = ["--flight", "4"]
    if where != "--flight":
        (tmp_path / "hookcli.toml").write_text("[watch]\nflight = 4\n")
        flags = ["--config", str(tmp_path / "hookcli.toml")]
    result = cli("watch", *flags, "--out", log, "--", "python", script)
    assert result.exit_code == 0, result.stderr
    printed = [float(line) for line in result.stdout.split()]
    assert f"step {STEP}: error nonfinite (blocks.2): first NaN/Inf of the run at step {STEP}: made in blocks.2's " \
           "own forward (after blocks.2.act)" in result.stderr
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(line["step"], line.get("flight", False)) for line in lines] == [
        (0, False), (4, True), (5, True), (6, True), (7, True), (10, False)]
    assert lines[0]["loss"] is None  # step 0's backward ran before the model was known
    assert [line["loss"] for line in lines[1:4]] == printed[4:7]
    assert lines[4]["loss"] == "nan" and printed[7] != printed[7]


BIGRAM_SCRIPT = '''
import torch
from torch import nn

torch.manual_seed(0)
vocab = 12
transitions = torch.softmax(torch.randn(vocab, vocab) * 2, dim=1)
model = nn.Sequential(nn.Embedding(vocab, 32), nn.Linear(32, vocab))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for step in range(150):
    if step == {raise_at}:
        for group in opt.param_groups:
            group["lr"] *= 100
    x = torch.randint(0, vocab, (64,))
    y = torch.multinomial(transitions[x], 1).squeeze(1)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
'''


def test_watch_cmd_sees_a_learning_rate_raised_100x_as_a_loss_spike(cli: Any, tmp_path: Any) -> None:
    """The script's loss (what backward() is called on) reaches loss_spike: a learning rate raised 100x
    at step 100 is a spike at a logged step after it; the same script without it has none."""
    for raise_at in (100, -1):
        script = tmp_path / f"bigram{raise_at}.py"
        script.write_text(BIGRAM_SCRIPT.format(raise_at=raise_at))
        result = cli("watch", "--every", "5", "--", "python", script)
        assert result.exit_code == 0, result.stderr
        spikes = [line for line in result.stderr.splitlines() if "warning loss_spike" in line]
        assert (len(spikes) == 1 and int(spikes[0].split("step ")[1].split(":")[0]) in (100, 105)) \
            if raise_at > 0 else spikes == [], result.stderr
