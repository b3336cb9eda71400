"""The watch, check and the distributed reduction on a real CUDA GPU (skipped without one: CI has none).

The CPU suite runs the accelerator code paths on CPU tensors (the ``device`` backend, the flight
recorder's device flag); here they run where they were written for, and every number is checked
against plain torch in float64 as on CPU.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import hookcli
from test_watch import assert_stats, no_hooks_left, read_log
from test_watch_flight import Poisoned
from torchrun_launch import launch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def net() -> nn.Sequential:
    """Linear, BatchNorm, ReLU, Linear, Tanh, Linear: float32 on the GPU."""
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 2)).cuda()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(32, 6, generator=g).cuda(), torch.randn(32, 2, generator=g).cuda()


def test_a_logged_step_on_cuda_equals_plain_torch(tmp_path: Path) -> None:
    """Step 1 of an Adam run on the GPU: every layer's output and output gradient, every parameter's
    gradient, norm and update, against the test's own hooks, ``torch.autograd.grad`` and float64."""
    torch.manual_seed(0)
    model = net().train()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=0.05) for m in (model, ref))
    names = [str(i) for i in range(6)]
    for step in range(2):
        seen: dict[str, torch.Tensor] = {}
        handles = [ref[int(n)].register_forward_hook(lambda _m, _i, out, n=n, seen=seen: seen.__setitem__(n, out))
                   for n in names]
        x, y = batch(step)
        ref_loss = (ref(x) - y).pow(2).mean()
        for h in handles:
            h.remove()
        grads = dict(zip(names, torch.autograd.grad(ref_loss, [seen[n] for n in names], retain_graph=True)))
        ref_loss.backward()
        before = {n: p.detach().clone() for n, p in ref.named_parameters()}
        pgrads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        ref_opt.step()
        ref_opt.zero_grad()

    log = tmp_path / "log.jsonl"
    with hookcli.watch(model, opt, out=log) as w:
        for step in range(2):
            x, y = batch(step)
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            w.step(loss=loss)
    no_hooks_left(model, opt)
    line = read_log(log)[-1]
    assert line["step"] == 1 and line["loss"] == pytest.approx(ref_loss.item(), rel=1e-6)
    layers = {entry["name"]: entry for entry in line["layers"]}
    assert list(layers) == names
    for n in names:
        assert_stats(layers[n]["stats"], [seen[n]])
        assert_stats(layers[n]["grad"], [grads[n]])
    for entry in line["params"]:
        n = entry["name"]
        p = dict(ref.named_parameters())[n]
        assert_stats(entry["grad"], [pgrads[n]])
        norm = float(before[n].double().norm())
        assert entry["norm"] == pytest.approx(norm, rel=1e-6)
        assert entry["update_norm"] == pytest.approx(float((p.detach().double() - before[n].double()).norm()), rel=1e-4)


@pytest.mark.parametrize("backward", [False, True])
def test_the_flight_recorder_names_a_nan_at_an_unlogged_step_on_cuda(tmp_path: Path, backward: bool) -> None:
    """every=50, flight=8: a NaN at step 13 (forward at layer 2's output, or backward into its input)
    is found by the device flag, which is read every K - 1 steps without a sync per step."""
    torch.manual_seed(0)
    model = nn.Sequential(Poisoned(4, 8), nn.ReLU(), Poisoned(8, 8), nn.Tanh(), nn.Linear(8, 1)).cuda()
    setattr(model[2], "grad_at" if backward else "at", 13)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    with hookcli.watch(model, opt, every=50, flight=8, out=tmp_path / "log.jsonl") as w:
        for _ in range(20):
            loss = model(torch.randn(16, 4, generator=g).cuda()).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            w.step(loss=loss)
    named = "1" if backward else "2"
    assert [(f.rule, f.layer, f.step, f.direction) for f in w.findings] == [
        ("nonfinite", named, 13, "backward" if backward else "forward")]
    steps = [line["step"] for line in read_log(tmp_path / "log.jsonl") if line.get("flight")]
    assert steps == list(range(6, 14))


def test_check_steps_on_cuda_leaves_the_model_as_it_was() -> None:
    """``check(steps=3)`` on a GPU model: it trains copies; the user's weights and mode stay."""
    torch.manual_seed(0)
    model = net().eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    result = hookcli.check(model, inputs=[batch(0)[0]], steps=3)
    assert any(rule.rule == "overfit_batch" for rule in result.rules), result
    assert not model.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k


WORKER = """
import sys, traceback, torch, torch.distributed as dist
from torch import nn
import hookcli
dist.init_process_group("gloo")
rank = dist.get_rank()
out = sys.argv[1]
try:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)).cuda())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hookcli.watch(model, opt, out=out + "/log.jsonl") as w:
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(8, 4, generator=g)[rank * 4:(rank + 1) * 4].cuda()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            w.step(loss=loss)
except BaseException:
    open(f"{out}/rank{rank}.err", "w").write(traceback.format_exc())
    raise
dist.destroy_process_group()
"""


def test_a_ddp_watch_on_the_gpu_under_torchrun_equals_one_process(tmp_path: Path) -> None:
    """Two ranks, both on the one GPU here (gloo: NCCL refuses two ranks on one device), a DDP model on
    CUDA: step 1's activations over the global batch equal plain torch in one process."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    done = launch([str(script), str(tmp_path)], 2)
    errors = {p.name: p.read_text()[-3000:] for p in tmp_path.glob("rank*.err")}
    assert done.returncode == 0, errors or done.stderr[-4000:]
    line = [json.loads(s) for s in (tmp_path / "log.jsonl").read_text().splitlines()][-1]
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        seen: dict[str, torch.Tensor] = {}
        handles = [m.register_forward_hook(lambda _m, _i, o, n=n, seen=seen: seen.__setitem__(n, o))
                   for n, m in ref.named_children()]
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        loss = ref(x).pow(2).mean()
        for h in handles:
            h.remove()
        loss.backward()
        opt.step()
        opt.zero_grad()
    layers = {entry["name"]: entry for entry in line["layers"]}
    for n in ("0", "1", "2"):
        assert_stats(layers[n]["stats"], [seen[n]])
