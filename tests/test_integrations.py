"""The Lightning and Hugging Face callbacks (hookcli.integrations): the log of ``hookcli.watch`` from
inside the trainers, every number against plain torch, the trainer's loss bit for bit, a seeded NaN at
its step, and a watched fit that computes what the unwatched one does (docs/integrations.md)."""

from __future__ import annotations

import copy
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from test_watch import assert_same_state, no_hooks_left, read_log
from timeouts import scaled_timeout


def _rms(t: torch.Tensor) -> float:
    return t.detach().double().pow(2).mean().sqrt().item()


def _param(line: dict[str, Any], name: str) -> dict[str, Any]:
    return next(p for p in line["params"] if p["name"] == name)


# -- importing ---------------------------------------------------------------------------------------------------


def test_hookcli_imports_without_the_training_libraries_and_a_missing_one_names_its_extra() -> None:
    code = ("import sys\n"
            "sys.modules['lightning'] = sys.modules['pytorch_lightning'] = sys.modules['transformers'] = None\n"
            "import hookcli, hookcli.integrations\n"
            "for name, extra in (('lightning', 'lightning'), ('transformers', 'hf')):\n"
            "    try:\n"
            "        __import__('hookcli.integrations.' + name)\n"
            "    except ImportError as exc:\n"
            "        assert f\"pip install 'hookcli[{extra}]'\" in str(exc), exc\n"
            "    else:\n"
            "        raise AssertionError(name)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled_timeout(120))
    assert result.returncode == 0, result.stderr


# -- Lightning ---------------------------------------------------------------------------------------------------


def _lightning_module(nan_at: int | None = None) -> Any:
    pl = pytest.importorskip("lightning.pytorch")

    class MLP(pl.LightningModule):
        """A small regression MLP that records each training batch's loss and, at each optimizer step,
        its first layer's gradient (float64): the test's own hook. ``nan_at``: the training call whose
        hidden output is NaN."""

        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
            self.losses: list[torch.Tensor] = []
            self.grads: list[torch.Tensor] = []
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.net[1](self.net[0](x))
            if self.training and self.calls == nan_at:
                h = h * float("nan")
            self.calls += self.training
            return self.net[2](h)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self(x), y)
            self.losses.append(loss.detach().clone())
            return loss

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.grads.append(self.net[0].weight.grad.detach().double().clone())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    return MLP


def _loader() -> Any:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    return torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)


def _fit(module: Any, callbacks: list[Any], steps: int = 6, accumulate: int = 1) -> None:
    import lightning.pytorch as pl

    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         accumulate_grad_batches=accumulate)
    trainer.fit(module, _loader())


def test_lightning_callback_logs_the_fit_and_changes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hookcli.integrations.lightning import HookcliCallback

    MLP = _lightning_module()
    torch.manual_seed(0)
    plain = MLP()
    watched = copy.deepcopy(plain)
    torch.manual_seed(2)
    _fit(plain, [])
    callback = HookcliCallback(every=2, out=tmp_path / "log.jsonl")
    torch.manual_seed(2)
    _fit(watched, [callback])

    assert [loss.item() for loss in watched.losses] == [loss.item() for loss in plain.losses]
    assert_same_state(plain, watched)
    no_hooks_left(watched, None)
    lines = read_log(tmp_path / "log.jsonl")
    assert [line["step"] for line in lines] == [0, 2, 4]
    assert [line["loss"] for line in lines] == [watched.losses[s].item() for s in (0, 2, 4)]
    for line in lines:
        grad = _param(line, "net.0.weight")["grad"]
        want = watched.grads[line["step"]]
        assert grad["rms"] == pytest.approx(_rms(want), rel=1e-6)
        assert grad["max"] == pytest.approx(want.max().item(), rel=1e-6)
        assert [layer["name"] for layer in line["layers"]] == ["net.0", "net.1", "net.2"]
    err = capsys.readouterr().err
    assert "hookcli watch: watching MLP (97 parameters) stepped by SGD" in err
    assert f"hookcli watch: MLP, SGD: 6 steps, 3 logged to {tmp_path / 'log.jsonl'}; 0 findings" in err
    assert callback.run is not None and callback.run.findings == []


def test_lightning_callback_finds_a_seeded_nan_at_its_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hookcli.integrations.lightning import HookcliCallback

    torch.manual_seed(0)
    module = _lightning_module(nan_at=3)()
    callback = HookcliCallback(out=tmp_path / "log.jsonl")
    _fit(module, [callback])  # the fit goes on: a monitor never stops the run
    errors = [(f.rule, f.step, f.layer, f.direction) for f in callback.run.errors]
    # the NaN is made in the LightningModule's own forward (h * nan between net.1 and net.2): the root
    # is the maker, net.2's output is only where it is first seen
    assert errors == [("nonfinite", 3, "", "forward")]
    assert [f.rule for f in callback.findings] == ["nonfinite"]
    lines = read_log(tmp_path / "log.jsonl")
    assert [f["rule"] for f in lines[3]["findings"]] == ["nonfinite"]
    assert math.isnan(float(lines[3]["loss"])) and lines[2]["findings"] == []
    err = capsys.readouterr().err
    assert ("hookcli watch: step 3: error nonfinite: first NaN/Inf of the run at step 3: made in (model)'s own "
            "forward (between net.1 and net.2); first seen in net.2's output") in err


def test_lightning_on_finding_raise_stops_the_fit_at_the_finding_and_leaves_no_hook(tmp_path: Path) -> None:
    from hookcli.errors import CheckFailedError
    from hookcli.integrations.lightning import HookcliCallback

    torch.manual_seed(0)
    module = _lightning_module(nan_at=2)()
    callback = HookcliCallback(out=tmp_path / "log.jsonl", on_finding="raise", flight=4, quiet=True)
    with pytest.raises(CheckFailedError, match="nonfinite"):
        _fit(module, [callback])
    assert len(module.losses) == 3  # the fit stopped at step 2's batch end
    lines = read_log(tmp_path / "log.jsonl")
    assert [line["step"] for line in lines] == [0, 1, 2] and not any(line.get("flight") for line in lines)
    assert callback.run.errors[0].step == 2
    no_hooks_left(module, None)


def test_lightning_gradient_accumulation_an_optimizer_step_is_a_step(tmp_path: Path) -> None:
    from hookcli.integrations.lightning import HookcliCallback

    torch.manual_seed(0)
    module = _lightning_module()()
    callback = HookcliCallback(out=tmp_path / "log.jsonl", quiet=True)
    _fit(module, [callback], steps=3, accumulate=2)
    lines = read_log(tmp_path / "log.jsonl")
    assert [line["step"] for line in lines] == [0, 1, 2] and not any(line.get("skipped") for line in lines)
    # the step's loss: its two micro-batches' losses, each divided by 2 as Lightning does, summed
    for line in lines:
        a, b = module.losses[2 * line["step"]], module.losses[2 * line["step"] + 1]
        assert line["loss"] == (a / 2).double().item() + (b / 2).double().item()
        assert {layer["calls"] for layer in line["layers"]} == {2}


def test_lightning_manual_optimization_each_optimizer_step_is_a_step(tmp_path: Path) -> None:
    from hookcli.integrations.lightning import HookcliCallback

    MLP = _lightning_module()

    class Manual(MLP):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            opt = self.optimizers()
            opt.zero_grad()
            loss = nn.functional.mse_loss(self(batch[0]), batch[1])
            self.manual_backward(loss)
            opt.step()  # (the test's own gradient: on_before_optimizer_step, which manual optimization calls too)
            self.losses.append(loss.detach().clone())
            return loss

    torch.manual_seed(0)
    module = Manual()
    callback = HookcliCallback(out=tmp_path / "log.jsonl", every=2, quiet=True)
    _fit(module, [callback], steps=4)
    lines = read_log(tmp_path / "log.jsonl")
    assert [line["step"] for line in lines] == [0, 2] and callback.run.steps == 4
    for line in lines:
        assert line["loss"] == module.losses[line["step"]].item()
        assert _param(line, "net.0.weight")["grad"]["rms"] == pytest.approx(_rms(module.grads[line["step"]]), rel=1e-6)
        assert _param(line, "net.0.weight")["update_norm"] > 0


def test_lightning_several_optimizers_watch_with_no_optimizer_a_batch_a_step(tmp_path: Path) -> None:
    from hookcli.integrations.lightning import HookcliCallback

    MLP = _lightning_module()

    class TwoOptimizers(MLP):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.norms: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            first, second = self.optimizers()
            loss = nn.functional.mse_loss(self(batch[0]), batch[1])
            self.manual_backward(loss)
            first.step()
            second.step()
            self.norms.append(self.net[0].weight.detach().double().norm().item())
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self) -> list[torch.optim.Optimizer]:
            return [torch.optim.SGD(self.net[0].parameters(), lr=0.05), torch.optim.SGD(self.net[2].parameters(), lr=0.05)]

    torch.manual_seed(0)
    module = TwoOptimizers()
    callback = HookcliCallback(out=tmp_path / "log.jsonl", quiet=True)
    _fit(module, [callback], steps=6)  # Lightning counts each optimizer's step: 3 batches
    lines = read_log(tmp_path / "log.jsonl")
    assert [line["step"] for line in lines] == [0, 1, 2] and callback.run.optimizer is None
    for line in lines:
        assert line["loss"] == module.losses[line["step"]].item()
        weight = _param(line, "net.0.weight")
        assert weight["norm"] == pytest.approx(module.norms[line["step"]], rel=1e-6)  # read at the batch's end
        assert weight["update_norm"] is None


def test_lightning_gradient_accumulation_logs_the_accumulated_gradient(tmp_path: Path) -> None:
    from hookcli.integrations.lightning import HookcliCallback

    torch.manual_seed(0)
    module = _lightning_module()()
    callback = HookcliCallback(out=tmp_path / "log.jsonl", quiet=True)
    _fit(module, [callback], steps=2, accumulate=2)
    for line in read_log(tmp_path / "log.jsonl"):
        assert _param(line, "net.0.weight")["grad"]["rms"] == pytest.approx(_rms(module.grads[line["step"]]), rel=1e-6)


# -- Hugging Face Trainer ----------------------------------------------------------------------------------------


def _hf_trainer(tmp_path: Path, callbacks: list[Any], nan_at: int | None = None, steps: int = 6,
                accumulate: int = 1) -> Any:
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")

    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, n_positions=16, vocab_size=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    if nan_at is not None:
        calls = {"n": 0}
        original = model.transformer.h[1].mlp.act.forward

        def poisoned(x: torch.Tensor) -> torch.Tensor:
            y = original(x)
            if model.training:
                calls["n"] += 1
                if calls["n"] - 1 == nan_at:
                    return y * float("nan")
            return y

        model.transformer.h[1].mlp.act.forward = poisoned
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (32, 8), generator=g)
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=4,
                                          learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no",
                                          use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0,
                                          gradient_accumulation_steps=accumulate)
    return transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)


class _Grads:
    """The test's own callback: the gradient of one weight at each optimizer pre-step (after clipping), float64."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        outer = self
        self.grads: list[torch.Tensor] = []

        class Recorder(TrainerCallback):
            def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
                outer.grads.append(model.transformer.h[0].mlp.c_fc.weight.grad.detach().double().clone())

        self.callback = Recorder()


def test_hf_callback_logs_the_trainers_loss_bit_for_bit_and_changes_nothing(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from hookcli.integrations.transformers import HookcliTrainerCallback

    plain = _hf_trainer(tmp_path / "plain", [])
    plain.train()
    grads = _Grads()
    callback = HookcliTrainerCallback(every=2, out=tmp_path / "log.jsonl", quiet=True)
    watched = _hf_trainer(tmp_path / "watched", [callback, grads.callback])
    watched.train()

    losses = [entry["loss"] for entry in watched.state.log_history if "loss" in entry]
    assert losses == [entry["loss"] for entry in plain.state.log_history if "loss" in entry] and len(losses) == 6
    assert_same_state(plain.model, watched.model)
    lines = read_log(tmp_path / "log.jsonl")
    assert [line["step"] for line in lines] == [0, 2, 4]
    assert [line["loss"] for line in lines] == [losses[0], losses[2], losses[4]]
    for line in lines:
        grad = _param(line, "transformer.h.0.mlp.c_fc.weight")["grad"]
        assert grad["rms"] == pytest.approx(_rms(grads.grads[line["step"]]), rel=1e-6)
    assert "transformer.h.0.mlp.act" in {layer["name"] for layer in lines[1]["layers"]}
    assert callback.run.steps == 6 and callback.run.findings == []
    no_hooks_left(watched.model, None)


def test_hf_gradient_accumulation_an_optimizer_step_is_a_step(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from hookcli.integrations.transformers import HookcliTrainerCallback

    grads = _Grads()
    callback = HookcliTrainerCallback(out=tmp_path / "log.jsonl", quiet=True)
    trainer = _hf_trainer(tmp_path, [callback, grads.callback], steps=3, accumulate=2)
    trainer.train()
    lines = read_log(tmp_path / "log.jsonl")
    assert [line["step"] for line in lines] == [0, 1, 2] and not any(line.get("skipped") for line in lines)
    assert [line["loss"] for line in lines] == [e["loss"] for e in trainer.state.log_history if "loss" in e]
    for line in lines:
        assert {layer["calls"] for layer in line["layers"]} == {2}
        grad = _param(line, "transformer.h.0.mlp.c_fc.weight")["grad"]
        assert grad["rms"] == pytest.approx(_rms(grads.grads[line["step"]]), rel=1e-6)


def test_hf_callback_finds_a_seeded_nan_at_its_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("accelerate")
    from hookcli.integrations.transformers import HookcliTrainerCallback

    callback = HookcliTrainerCallback(out=tmp_path / "log.jsonl")
    _hf_trainer(tmp_path, [callback], nan_at=2, steps=4).train()
    errors = [(f.rule, f.step, f.layer, f.direction) for f in callback.run.errors]
    assert errors == [("nonfinite", 2, "transformer.h.1.mlp.act", "forward")]
    assert [f.rule for f in callback.findings] == ["nonfinite"]
    err = capsys.readouterr().err
    assert "hookcli watch: watching GPT2LMHeadModel" in err and "step 2: error nonfinite" in err


def test_bad_options_are_refused_when_the_callback_is_made() -> None:
    pytest.importorskip("lightning")
    from hookcli.errors import ConfigError, UsageError
    from hookcli.integrations.lightning import HookcliCallback

    with pytest.raises(UsageError, match="every must be a whole number"):
        HookcliCallback(every=0)
    with pytest.raises(ConfigError):
        HookcliCallback(rules={"no_such_rule": {}})
