"""Models nobody here wrote the engine for: patterns found in third-party code (timm, Hugging Face, user
models) that once gave wrong rows, changed the caller's model, or blamed the model for hookcli's limits.

Every number is checked against plain torch (forward hooks and ``torch.autograd.grad`` in the test).
"""

from __future__ import annotations

import torch
from torch import nn

import hookcli
from tiny_models import Checkpointed


class RunningBuffers(nn.Module):
    """Updates a step counter and a moving average in eval mode too (a user's EMA/normaliser)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        y = self.lin(x)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * y.mean(0))
        return y


def _input_file(tmp_path, x: torch.Tensor) -> str:
    path = tmp_path / "x.pt"
    torch.save(x, path)
    return str(path)


def test_checkpointed_modules_give_one_row_per_forward_call_with_torch_gradients(tmp_path) -> None:
    torch.manual_seed(0)
    model = Checkpointed().eval()
    x = torch.randn(3, 6)
    names = ["a", "block", "block.0", "block.1", "head"]
    # plain torch: outputs of each module's (first) forward call, gradients of sum(head output)
    outputs: dict[str, torch.Tensor] = {}
    handles = [model.get_submodule(n).register_forward_hook(
        lambda m, a, o, n=n: outputs.setdefault(n, o)) for n in names]
    with torch.enable_grad():
        out = model(x)
        ref_grads = dict(zip(names, torch.autograd.grad(out.sum(), [outputs[n] for n in names])))
    for h in handles:
        h.remove()

    report = hookcli.grads(model, inputs=[_input_file(tmp_path, x)], layers=names, loss="sum").to_dict()
    rows = report["layers"]
    # the rerun of ``block`` during backward is no call of the forward: no extra row, nothing "raised"
    assert [(r["name"], r["call"]) for r in rows] == [(n, 0) for n in names]
    assert all(r["called"] and not r.get("raised") for r in rows)
    for r in rows:
        g = ref_grads[r["name"]].double()
        assert abs(r["grad"]["norm"] - g.norm().item()) <= 1e-5 * (1 + g.norm().item())
        assert abs(r["grad"]["max"] - g.max().item()) <= 1e-5 * (1 + g.abs().max().item())


def test_reentrant_checkpoint_is_unsupported_not_the_models_fault(cli) -> None:
    # the model itself backpropagates in plain torch; only autograd.grad (hookcli's way) is refused
    model = Checkpointed(reentrant=True)
    model(torch.randn(2, 6, requires_grad=True)).sum().backward()

    for command in ("grads", "check"):
        result = cli(command, "tiny_models:Checkpointed", "--model-arg", "reentrant=True",
                     "--input-shape", "2x6")
        assert result.exit_code == 2, result.stderr
        assert result.stdout == ""
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 2 and lines[0].startswith("Error: ") and "use_reentrant" in lines[0]
        assert lines[1].startswith("  hint: ") and "use_reentrant=False" in lines[1]
        assert "raised" not in result.stderr and "Traceback" not in result.stderr


def test_buffers_a_forward_updates_in_eval_mode_come_back(tmp_path) -> None:
    torch.manual_seed(0)
    model = RunningBuffers().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = _input_file(tmp_path, torch.randn(2, 4))
    for run in (hookcli.stats, hookcli.shapes, hookcli.grads):
        run(model, inputs=[x], all_modules=True)
        after = model.state_dict()
        assert after.keys() == before.keys()
        for key, value in before.items():
            assert torch.equal(after[key], value), (run.__name__, key)
    # the same forward outside hookcli does change them: the test can fail
    model(torch.randn(2, 4))
    assert int(model.steps) == 1
