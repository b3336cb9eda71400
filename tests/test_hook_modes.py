"""Process-wide hooks for large selections (issue 14) record exactly what per-module hooks record.

``attach`` hooks a selection of most of a model's modules with two process-wide hooks instead of two
per module (registering hundreds of hooks cost a tenth of a small model's forward). Every test here
runs the same forward both ways and compares the records field by field, and checks the calls against
hooks the test registers itself.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.modules import module as torch_module

import hookcli
from hookcli.engine import hooks as engine_hooks
from hookcli.engine.selection import select_modules
from hookcli.engine.hooks import attach
from hookcli.engine.taps import InputGradients, Statistics
from hookcli.records import LayerRecord

from tests.reference import float64_stats, forward_with
from tiny_models import Checkpointed


class Block(nn.Module):
    """Takes its second input by keyword, returns a tuple, and calls a shared activation."""

    def __init__(self, width: int, act: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.act = act
        self.gate = nn.Sigmoid()

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.act(self.lin(x)) * self.gate(scale)
        return h, self.act(h)


class Tree(nn.Module):
    """``blocks`` Blocks sharing one in-place ReLU (one object under many names), each called
    ``repeat`` times; an outside module the model calls but does not own."""

    def __init__(self, blocks: int, repeat: int, width: int = 6) -> None:
        super().__init__()
        self.relu = nn.ReLU(inplace=True)
        self.blocks = nn.ModuleList(Block(width, self.relu) for _ in range(blocks))
        self.repeat = repeat
        self.head = nn.Linear(width, 2)
        self.__dict__["outsider"] = nn.Tanh()  # called in forward, not a submodule

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        for block in self.blocks:
            for _ in range(self.repeat):
                x, _side = block(x, scale=x.detach() * 0.5)
        return {"out": self.head(self.outsider(x))}


def run(model: nn.Module, x: torch.Tensor, *, globally: bool, fail_at: int | None = None) -> list[LayerRecord]:
    selection = select_modules(model, all_modules=True)
    count = len(list(model.modules()))
    with attach(model, selection, [Statistics()], model_modules=count if globally else None) as session:
        assert bool(torch_module._global_forward_hooks) is globally
        assert any(m._forward_hooks for _, m in selection) is not globally
        try:
            with torch.no_grad():
                model(x)
        except RuntimeError:
            assert fail_at is not None
    assert not torch_module._global_forward_hooks and not torch_module._global_forward_pre_hooks
    assert not torch_module._global_forward_hooks_with_kwargs  # torch's handle leaves this one behind
    assert not torch_module._global_forward_hooks_always_called
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    records, _ = session.records()
    return records


@pytest.fixture(autouse=True)
def small_models_hook_globally(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test models are small: let them take the process-wide path too."""
    monkeypatch.setattr(engine_hooks, "GLOBAL_MIN_MODULES", 1)


def calls_by_hand(model: nn.Module, x: torch.Tensor) -> list[tuple[str, list[list[int]], list[torch.Tensor]]]:
    """(name, input shapes positional then keyword, output tensors) per selected call, in start order,
    from module hooks registered here."""
    names: dict[int, str] = {}
    for name, module in model.named_modules():
        if name:
            names.setdefault(id(module), name)
    rows: list[Any] = []
    open_rows: dict[str, list[Any]] = {}

    def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        tensors = [a for a in args if isinstance(a, torch.Tensor)] + [v for v in kwargs.values()
                                                                       if isinstance(v, torch.Tensor)]
        row = (names[id(module)], [list(t.shape) for t in tensors], [])
        rows.append(row)
        open_rows.setdefault(row[0], []).append(row)

    def post(module: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
        row = open_rows[names[id(module)]].pop()
        outs = out if isinstance(out, tuple) else tuple(out.values()) if isinstance(out, dict) else (out,)
        row[2].extend(o.detach().clone() for o in outs)

    modules = dict(model.named_modules())
    handles = []
    for name in names.values():
        handles.append(modules[name].register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(modules[name].register_forward_hook(post, with_kwargs=True))
    forward_with(model, x, handles)
    return rows


@settings(max_examples=15, deadline=None)
@given(blocks=st.integers(1, 4), repeat=st.integers(1, 3), batch=st.integers(1, 3))
def test_process_wide_hooks_record_what_module_hooks_record(blocks: int, repeat: int, batch: int) -> None:
    torch.manual_seed(blocks * 10 + repeat)
    model = Tree(blocks, repeat).eval()
    x = torch.randn(batch, 6)
    per_module = run(model, x, globally=False)
    process_wide = run(model, x, globally=True)
    assert process_wide == per_module

    expected = calls_by_hand(model, x)
    called = [r for r in process_wide if r.called]
    by_call: dict[tuple[str, int], list[LayerRecord]] = {}
    for r in called:
        by_call.setdefault((r.name, r.call), []).append(r)
    assert [name for name, _ in by_call] == [name for name, _, _ in expected]  # start order
    for ((name, _), rows), (_, shapes, outputs) in zip(by_call.items(), expected):
        assert rows[0].input_shapes == shapes, name  # keyword inputs included
        assert len(rows) == len(outputs)
        for row, tensor in zip(rows, outputs):
            want = float64_stats(tensor)
            assert row.stats is not None
            for key in ("mean", "std", "min", "max"):
                assert row.stats[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (name, key)
    assert "outsider" not in {r.name for r in process_wide}


class Raises(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(4, 3)  # the wrong width: raises
        self.c = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


def test_a_call_that_raises_is_recorded_alike_and_every_hook_is_removed() -> None:
    model = Raises()
    x = torch.randn(2, 3)
    per_module = run(model, x, globally=False, fail_at=1)
    process_wide = run(model, x, globally=True, fail_at=1)
    assert process_wide == per_module
    assert [(r.name, r.raised, r.called) for r in process_wide] == [
        ("a", False, True), ("b", True, True), ("c", False, False)]


def test_small_or_partial_selections_keep_module_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_hooks, "GLOBAL_MIN_MODULES", 32)
    assert not engine_hooks.hooked_globally(31, 40)
    assert not engine_hooks.hooked_globally(32, 100)  # most modules unselected
    assert not engine_hooks.hooked_globally(200, None)  # the caller did not say
    assert not engine_hooks.hooked_globally(200, 208, [Statistics(), InputGradients()])
    assert engine_hooks.hooked_globally(200, 208, [Statistics()])


def test_the_public_api_reports_the_same_rows_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = Tree(3, 2).eval()
    spec = ["2x6"]
    process_wide = hookcli.stats(model, input_shapes=spec, all_modules=True).to_dict()
    monkeypatch.setattr(engine_hooks, "GLOBAL_MIN_MODULES", 10**9)
    per_module = hookcli.stats(model, input_shapes=spec, all_modules=True).to_dict()
    assert process_wide["layers"] == per_module["layers"]


def test_a_compiled_model_keeps_module_hooks_run_eagerly(recwarn: pytest.WarningsRecorder) -> None:
    """torch.compile'd models get per-module hooks outside the graph: the same rows as the eager model
    (prefixed by the wrapper's ``_orig_mod``), and no warning from torch about process-wide hooks."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3))).eval()
    eager = hookcli.stats(model, input_shapes=["2x8"], all_modules=True).to_dict()["layers"]
    compiled = hookcli.stats(torch.compile(model), input_shapes=["2x8"], all_modules=True).to_dict()["layers"]
    inner = [dict(r, name=r["name"].removeprefix("_orig_mod").removeprefix("."),
                  depth=r["depth"] - 1) for r in compiled if r["name"] != "_orig_mod"]
    assert inner == [r for r in eager]
    assert not [w for w in recwarn if "global hooks" in str(w.message)]


def test_process_wide_hooks_skip_checkpoint_recomputation_and_give_torch_gradients(tmp_path: Any) -> None:
    torch.manual_seed(0)
    model = Checkpointed().eval()
    x = torch.randn(3, 6)
    path = tmp_path / "x.pt"
    torch.save(x, path)
    names = ["a", "block", "block.0", "block.1", "head"]
    outputs: dict[str, torch.Tensor] = {}
    handles = [model.get_submodule(n).register_forward_hook(lambda m, a, o, n=n: outputs.setdefault(n, o))
               for n in names]
    with torch.enable_grad():
        out = model(x)
        want = dict(zip(names, torch.autograd.grad(out.sum(), [outputs[n] for n in names])))
    for h in handles:
        h.remove()

    rows = hookcli.grads(model, inputs=[str(path)], all_modules=True, loss="sum").to_dict()["layers"]
    assert [(r["name"], r["call"]) for r in rows] == [(n, 0) for n in names]  # no rerun rows
    assert all(r["called"] and not r.get("raised") for r in rows)
    for r in rows:
        g = want[r["name"]].double()
        assert r["grad"]["norm"] == pytest.approx(g.norm().item(), rel=1e-5, abs=1e-7)


def test_a_model_compiled_before_the_hooks_were_attached_is_refused_not_reported_as_not_called() -> None:
    """torch.compile reuses a graph compiled before hookcli's hooks existed (it does not guard on
    hooks): no hook fires. That is said, exit 2, instead of a report of modules "not called"."""
    torch.compiler.reset()  # what earlier tests compiled would decide which graph runs
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(3))).eval()
    compiled = torch.compile(model)
    with torch.no_grad():
        compiled(torch.randn(2, 8))
    with pytest.raises(hookcli.errors.UnsupportedError, match="no hook fired") as info:
        hookcli.stats(compiled, input_shapes=["2x8"], all_modules=True)
    assert "torch.compiler.reset()" in (info.value.hint or "")
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in compiled.modules())


@pytest.mark.parametrize("case", ["timm resnet18", "hf gpt2", "hf t5"])
def test_third_party_models_give_the_same_rows_both_ways(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Models nobody here wrote, with keyword calls inside (Hugging Face), reused modules and tuple
    outputs: process-wide and per-module hooks give the same rows for stats and grads."""
    transformers = pytest.importorskip("transformers")
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    if case == "timm resnet18":
        model, spec = timm.create_model("resnet18", pretrained=False).eval(), ["1x3x64x64"]
    elif case == "hf gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100)
        model, spec = transformers.GPT2LMHeadModel(config).eval(), ["input_ids=1x8:int64"]
    else:
        config = transformers.T5Config(num_layers=2, d_model=32, num_heads=2, d_ff=64, vocab_size=100, d_kv=16)
        model = transformers.T5ForConditionalGeneration(config).eval()
        spec = ["input_ids=1x8:int64", "decoder_input_ids=1x4:int64"]
    for command in (hookcli.stats, hookcli.grads):
        monkeypatch.setattr(engine_hooks, "GLOBAL_MIN_MODULES", 1)
        process_wide = command(model, input_shapes=spec, all_modules=True).to_dict()["layers"]
        monkeypatch.setattr(engine_hooks, "GLOBAL_MIN_MODULES", 10**9)
        per_module = command(model, input_shapes=spec, all_modules=True).to_dict()["layers"]
        assert json.dumps(process_wide, sort_keys=True) == json.dumps(per_module, sort_keys=True)
        assert any(len(r["input_shapes"]) > 1 for r in process_wide) or case == "timm resnet18"


def test_a_compiled_model_whose_selected_modules_are_unused_is_reported_not_refused() -> None:
    """Only a model whose own top module never fired is refused: a selection of modules the forward
    does not use gives "not called" rows, compiled or not."""
    torch.compiler.reset()

    class WithSpare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(8, 8)
            self.spare = nn.Linear(8, 8)  # never called

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    compiled = torch.compile(WithSpare().eval())
    rows = hookcli.stats(compiled, input_shapes=["2x8"], layers="_orig_mod.spare").to_dict()["layers"]
    assert [(r["name"], r["called"]) for r in rows] == [("_orig_mod.spare", False)]
