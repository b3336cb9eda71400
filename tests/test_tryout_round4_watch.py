"""Round-4 tryout of ``hookcli.watch``: training loops the other watch tests do not run, written as a
new user would (a timm Swin with accumulation, bfloat16 autocast, clipping and a scheduler; a
transformers Mistral with a frozen backbone whose learning rate blows up). Each watched run is checked
bit for bit against its unwatched twin and its logged numbers against plain float64 torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hookcli


def _swin_run(out: Path | None) -> tuple[nn.Module, Any, dict[str, Any]]:
    """12 AdamW steps of a tiny Swin: 2 micro-batches a step under bfloat16 autocast, gradient
    clipping, a cosine schedule, ``zero_grad(set_to_none=False)``; step 9 captured in float64."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=32, patch_size=4,
                              window_size=4, embed_dim=16, depths=(1, 1), num_heads=(1, 2), num_classes=5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20)
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 3, 32, 32, generator=gen), torch.randint(0, 5, (4,), generator=gen)) for _ in range(24)]
    acts: list[torch.Tensor] = []
    fc1 = model.layers[0].blocks[0].mlp.fc1
    handle = fc1.register_forward_hook(lambda mod, args, out: acts.append(out.detach().double().flatten()))
    ref: dict[str, Any] = {}
    watch = hookcli.watch(model, opt, every=3, out=out) if out is not None else None
    w = watch.__enter__() if watch is not None else None
    for step in range(12):
        acts.clear()
        for k in range(2):
            x, y = data[step * 2 + k]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x), y) / 2
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = model.head.fc.weight.detach().double().clone()
        if step == 9:
            ref.update(grad=model.head.fc.weight.grad.double(), acts=torch.cat(acts))
        opt.step()
        if step == 9:
            ref["update"] = (model.head.fc.weight.detach().double() - before).norm().item()
        sched.step()
        opt.zero_grad(set_to_none=False)
        if w is not None:
            w.step(loss=loss)
    if watch is not None:
        watch.__exit__(None, None, None)
    handle.remove()
    return model, w, ref


def test_swin_accumulation_autocast_clipping_scheduler(tmp_path: Path) -> None:
    """The watched Swin loop ends on the unwatched weights bit for bit; the log's step 9 holds the
    float64 numbers of the clipped gradient, the update and fc1's bfloat16 outputs over both calls."""
    plain, _, _ = _swin_run(None)
    log = tmp_path / "swin.jsonl"
    watched, w, ref = _swin_run(log)
    a, b = plain.state_dict(), watched.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert w.findings == []
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 3, 6, 9]
    param = next(p for p in lines[-1]["params"] if p["name"] == "head.fc.weight")
    grad = ref["grad"]
    assert param["grad"]["rms"] == pytest.approx(grad.pow(2).mean().sqrt().item(), rel=1e-9)
    assert param["update_norm"] == pytest.approx(ref["update"], rel=1e-9)
    layer = next(entry for entry in lines[-1]["layers"] if entry["name"] == "layers.0.blocks.0.mlp.fc1")
    assert (layer["calls"], layer["dtype"]) == (2, "bfloat16")
    assert layer["stats"]["count"] == ref["acts"].numel()
    assert layer["stats"]["mean"] == pytest.approx(ref["acts"].mean().item(), rel=1e-9, abs=1e-12)
    assert layer["stats"]["std"] == pytest.approx(ref["acts"].std(unbiased=False).item(), rel=1e-9)
    assert hookcli.report(log, stat="update_ratio").ok


def _mistral_run(out: Path | None) -> tuple[nn.Module, Any, list[tuple[float, bool]]]:
    """10 AdamW steps of a tiny Mistral whose backbone is frozen but for its last layer; the learning
    rate is set to 1e6 at step 4. Returns each step's (loss, every trained gradient finite)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     sliding_window=8, attn_implementation="sdpa")
    model = transformers.MistralForCausalLM(cfg)
    for p in model.model.parameters():
        p.requires_grad_(False)
    for p in model.model.layers[1].parameters():
        p.requires_grad_(True)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    seen: list[tuple[float, bool]] = []
    watch = hookcli.watch(model, opt, every=2, out=out, on_finding="warn") if out is not None else None
    w = watch.__enter__() if watch is not None else None
    for step in range(10):
        ids = torch.randint(0, 64, (2, 16), generator=gen)
        if step == 4:
            for group in opt.param_groups:
                group["lr"] = 1e6
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        seen.append((loss.item(), all(bool(p.grad.isfinite().all()) for p in trained)))
        opt.step()
        opt.zero_grad(set_to_none=False)
    if watch is not None:
        watch.__exit__(None, None, None)
    return model, w, seen


def test_mistral_lr_blowup_nan_made_at_an_unlogged_step(tmp_path: Path) -> None:
    """lr=1e6 at logged step 4: at unlogged step 5 the loss is still finite but the gradients are NaN,
    so the step-5 update makes the weights NaN and step 6's loss is the first non-finite one. Step 6
    is not the first NaN/Inf of the run (its forward used weights already NaN): the finding says it was
    first seen there, since step 4, and names no module's code as its maker."""
    plain, _, seen = _mistral_run(None)
    first_bad_grad = next(step for step, (_, finite) in enumerate(seen) if not finite)
    first_bad_loss = next(step for step, (loss, _) in enumerate(seen) if loss != loss)
    assert (first_bad_grad, first_bad_loss) == (5, 6)  # the premise, in plain torch
    log = tmp_path / "mistral.jsonl"
    watched, w, _ = _mistral_run(log)
    for (name, a), b in zip(plain.state_dict().items(), watched.state_dict().values()):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), name
    assert [f.rule for f in w.findings] == ["update_ratio", "nonfinite"]
    nonfinite = w.findings[1]
    assert nonfinite.step == 6
    assert "first NaN/Inf of the run" not in nonfinite.message
    assert nonfinite.message.startswith("first NaN/Inf seen at logged step 6: ")
    assert "appeared between steps 4 and 6 (model.layers.1." in nonfinite.message
    assert not hookcli.report(log).ok


def test_hf_trainer_logging_every_2_steps_each_line_has_its_steps_own_loss(tmp_path: Path) -> None:
    """A Qwen2 under the Hugging Face Trainer with logging_steps=2, accumulation, clipping and a cosine
    warmup: every watched line holds its own step's loss (the one backward() was called on, summed over
    the micro-batches), so each pair's mean is the Trainer's logged loss for the two steps; the weights
    are those of the unwatched Trainer bit for bit."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from hookcli.integrations.transformers import HookcliTrainerCallback

    def train(name: str, callbacks: list[Any]) -> Any:
        torch.manual_seed(0)
        cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
        model = transformers.Qwen2ForCausalLM(cfg)
        ids = torch.randint(0, 64, (48, 8), generator=torch.Generator().manual_seed(3))
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / name), max_steps=6, per_device_train_batch_size=4,
            gradient_accumulation_steps=2, learning_rate=1e-3, warmup_steps=2, lr_scheduler_type="cosine",
            max_grad_norm=0.5, logging_steps=2, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids],
                                       callbacks=callbacks)
        trainer.train()
        return trainer

    plain = train("plain", [])
    log = tmp_path / "hf.jsonl"
    watched = train("watched", [HookcliTrainerCallback(every=1, out=log, quiet=True)])
    a, b = plain.model.state_dict(), watched.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    logged = [entry["loss"] for entry in watched.state.log_history if "loss" in entry]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(6))
    losses = [line["loss"] for line in lines]
    assert None not in losses
    assert [(losses[i] + losses[i + 1]) / 2 for i in (0, 2, 4)] == pytest.approx(logged, rel=1e-6)


def test_lightning_convnext_bf16_accumulation_clipping(tmp_path: Path) -> None:
    """A timm ConvNeXt under a Lightning Trainer with bf16-mixed precision, accumulate_grad_batches=2,
    gradient clipping and a StepLR: the weights are the unwatched Trainer's bit for bit, each layer's
    ``calls`` is 2, and step 0's loss is the mean of its two micro-batches' cross-entropies under
    bfloat16 autocast, computed here on the initial weights."""
    lightning = pytest.importorskip("lightning")
    timm = pytest.importorskip("timm")
    from hookcli.integrations.lightning import HookcliCallback

    class Net(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = timm.create_model("convnext_atto", pretrained=False, num_classes=4, dims=(8, 16, 24, 32),
                                         depths=(1, 1, 1, 1))

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 2)}

    gen = torch.Generator().manual_seed(2)
    data = [(torch.randn(3, 32, 32, generator=gen), int(torch.randint(0, 4, (1,), generator=gen))) for _ in range(32)]
    batches = list(torch.utils.data.DataLoader(data, batch_size=4))

    def fit(callbacks: list[Any]) -> nn.Module:
        torch.manual_seed(0)
        model = Net()
        trainer = lightning.Trainer(max_steps=4, accumulate_grad_batches=2, gradient_clip_val=0.5, precision="bf16-mixed",
                                    accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                    enable_model_summary=False, callbacks=callbacks, default_root_dir=str(tmp_path))
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
        return model

    torch.manual_seed(0)
    initial = Net()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = [initial.training_step(batch, i) for i, batch in enumerate(batches[:2])]
    plain = fit([])
    log = tmp_path / "pl.jsonl"
    watched = fit([HookcliCallback(every=2, out=log, quiet=True)])
    a, b = plain.state_dict(), watched.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 2]
    assert all({layer["calls"] for layer in line["layers"]} == {2} for line in lines)
    assert lines[0]["loss"] == (first[0] / 2 + first[1] / 2).item()
    assert lines[0]["findings"] == [] and hookcli.report(log).ok


def test_without_an_optimizer_a_nan_made_at_a_logged_step_is_its_first(tmp_path: Path) -> None:
    """A watch given no optimizer reads the weights' norms when the step ends, after the loop's own
    update: weights that update made NaN are not a sign that the NaN came earlier. A NaN input at
    logged step 4 (every=2) is the first of the run, made by the input."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    finite_before = []
    with hookcli.watch(model, every=2, out=tmp_path / "manual.jsonl") as w:
        for step in range(6):
            x = torch.randn(3, 4)
            if step == 4:
                x[0, 0] = float("nan")
            finite_before.append(all(bool(p.isfinite().all()) for p in model.parameters()))
            loss = model(x).pow(2).mean()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
            w.step(loss=loss)
    assert finite_before == [True] * 5 + [False]  # the premise: NaN weights only after step 4's update
    nonfinite = [f for f in w.findings if f.rule == "nonfinite"]
    assert nonfinite and nonfinite[0].step == 4
    assert nonfinite[0].message.startswith("first NaN/Inf of the run at step 4: already in the model's input")
