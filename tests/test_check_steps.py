"""``hookcli check --steps N`` (issue #23 part A): the training rules init_loss, overfit_batch,
params_update and determinism, on a seeded-bug zoo (tests/training_bugs.py) and healthy models.

Expected numbers come from plain torch (the same model, input, loss and optimiser, trained here);
expected offenders from how each bug was planted, never from hookcli's own output.
"""

from __future__ import annotations

import copy
import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import broken_models as bm
import hookcli
import training_bugs as tb
from hookcli.errors import UsageError

TRAINING_RULES = ["init_loss", "overfit_batch", "params_update", "determinism"]


def fixed_input(tmp_path: Path, rows: int = 8, features: int = 8) -> Path:
    torch.manual_seed(1)
    path = tmp_path / "x.pt"
    torch.save(torch.randn(rows, features), path)
    return path


def check(model: nn.Module, tmp_path: Path, steps: int = 30, **kwargs):
    return hookcli.check(model, inputs=[fixed_input(tmp_path)], steps=steps, **kwargs)


def rows(result) -> dict[str, object]:
    return {r.rule: r for r in result.rules}


def plain_losses(model: nn.Module, x: torch.Tensor, lr: float, steps: int) -> list[float]:
    """Adam on a copy, cross-entropy against class 0, the loss before each step (plain torch)."""
    clone = copy.deepcopy(model).train()
    opt = torch.optim.Adam([p for p in clone.parameters() if p.requires_grad], lr=lr)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        logits = clone(x)
        loss = F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long))
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


# --------------------------------------------------------------------------- healthy


def test_healthy_classifier_passes_and_numbers_match_plain_torch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = tb.Classifier()
    result = check(model, tmp_path)
    assert result.ok, result
    got = rows(result)
    names = [r.rule for r in result.rules]
    assert [name for name in names if name in TRAINING_RULES] == TRAINING_RULES
    assert {"batch_independence", "input_dependence", "grad_accumulation"} <= set(names)  # --steps turns them on
    assert "params_change" not in got  # superseded by params_update at --steps N
    x = torch.load(tmp_path / "x.pt")
    # init_loss: the first loss is plain torch's cross-entropy at init; chance is ln 10
    first = F.cross_entropy(model(x), torch.zeros(8, dtype=torch.long)).item()
    assert got["init_loss"].value == pytest.approx(first, rel=1e-5)
    assert got["init_loss"].limit == pytest.approx([0.5 * math.log(10), 1.5 * math.log(10)])
    # overfit_batch: hookcli's sweep (5 steps at each lr, lowest loss wins) then 30 steps, replayed here
    sweep = {lr: min(plain_losses(model, x, lr, 5)) for lr in (1e-4, 1e-3, 1e-2)}
    lr = min(sweep, key=lambda k: (sweep[k], k))
    losses = plain_losses(model, x, lr, 30)
    assert got["overfit_batch"].value == pytest.approx((losses[0] - min(losses)) / losses[0], rel=1e-4)
    assert f"lr {lr:g}" in got["overfit_batch"].message
    assert got["determinism"].status == "PASS"


def test_healthy_cnn_passes_check_steps_30_on_the_cli(cli) -> None:
    out = cli("check", "broken_models:Healthy", "--input-shape", "4x3x16x16", "--steps", "30", "-f", "json")
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    statuses = {r["rule"]: r["status"] for r in data["rules"]}
    assert all(statuses[r] == "PASS" for r in TRAINING_RULES), statuses
    assert any(n.startswith("training: 30 steps of Adam") for n in data["notes"]), data["notes"]


def test_tiny_gpt2_passes_check_steps_30() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                                     eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    result = hookcli.check(model, steps=30)
    got = rows(result)
    assert all(got[r].status == "PASS" for r in TRAINING_RULES), [(r, got[r].message) for r in TRAINING_RULES]
    assert "per-token" in got["init_loss"].message and got["init_loss"].limit == pytest.approx(
        [0.5 * math.log(64), 1.5 * math.log(64)])


def test_the_model_and_the_callers_rng_are_unchanged(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.ReLU(), nn.Linear(16, 4)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    path = fixed_input(tmp_path)  # (seeds the RNG itself: before the state is taken)
    rng = torch.get_rng_state()
    result = hookcli.check(model, inputs=[path], steps=3)
    assert rows(result)["params_update"].status == "PASS", result
    assert torch.equal(torch.get_rng_state(), rng)
    assert list(model.parameters()) == params and all(p.grad is None for p in params)
    assert not model.training
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


# --------------------------------------------------------------------------- the zoo


def test_softmax_before_cross_entropy_fails_init_loss_and_overfit_batch_at_the_softmax(tmp_path: Path) -> None:
    result = check(tb.SoftmaxBeforeCE(), tmp_path)
    got = rows(result)
    assert got["init_loss"].status == "FAIL" and got["init_loss"].offender == "softmax"
    assert "probabilities" in got["init_loss"].message
    assert got["overfit_batch"].status == "FAIL" and got["overfit_batch"].offender == "softmax"
    assert got["overfit_batch"].value < 0.5 and not result.ok


def test_hot_logits_fail_init_loss_at_the_scaling_module(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = tb.HotLogits()
    result = check(model, tmp_path)
    got = rows(result)["init_loss"]
    x = torch.load(tmp_path / "x.pt")
    first = F.cross_entropy(model(x), torch.zeros(8, dtype=torch.long)).item()
    assert first > 1.5 * math.log(10)  # the bug as planted
    assert got.status == "FAIL" and got.offender == "scale" and got.value == pytest.approx(first, rel=1e-5)


def test_a_detach_in_the_middle_fails_params_update_naming_the_cut_off_parameter(tmp_path: Path) -> None:
    got = rows(check(tb.DetachedMiddle(), tmp_path))["params_update"]
    assert got.status == "FAIL" and got.offender == "body.weight"
    assert {v["where"] for v in got.violations} == {"body.weight", "body.bias"}
    assert "no gradient" in got.message


def test_unseeded_dropout_fails_determinism_naming_the_module(tmp_path: Path) -> None:
    got = rows(check(tb.UnseededDropout(), tmp_path, steps=5))["determinism"]
    assert got.status == "FAIL" and got.offender == "noise", got.message


def test_a_frozen_parameter_written_in_forward_fails_params_update(tmp_path: Path) -> None:
    got = rows(check(tb.WritesFrozen(), tmp_path, steps=3))["params_update"]
    assert got.status == "FAIL" and got.offender == "offset" and "does not require grad but changed" in got.message


def test_a_parameter_left_out_of_the_optimiser_fails_params_update(tmp_path: Path) -> None:
    model = tb.Classifier()
    opt = torch.optim.Adam([p for n, p in model.named_parameters() if n != "head.bias"], lr=1e-2)
    got = rows(check(model, tmp_path, optimizer=opt))["params_update"]
    assert got.status == "FAIL" and got.offender == "head.bias" and "not in your optimiser" in got.message
    assert len(got.violations) == 1


def test_a_learning_rate_of_zero_fails_params_update_and_overfit_batch(tmp_path: Path) -> None:
    model = tb.Classifier()
    got = rows(check(model, tmp_path, optimizer=torch.optim.SGD(model.parameters(), lr=0.0)))
    assert got["params_update"].status == "FAIL" and got["params_update"].offender == "body.weight"
    assert "learning rate of 0" in got["params_update"].message
    assert "round away" not in got["params_update"].message  # float32: no rounding to blame
    assert got["overfit_batch"].status == "FAIL" and got["overfit_batch"].value == 0


def _critic() -> nn.Module:
    """A GAN critic as the SN-GAN papers write it: spectral_norm (its ``weight`` is a tensor computed
    with autograd, kept as a plain attribute) and the old weight_norm (the same from the start)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.utils.spectral_norm(nn.Linear(8, 16)), nn.LeakyReLU(0.2),
                         nn.utils.weight_norm(nn.Linear(16, 4)))


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch deprecates the old weight_norm
def test_a_spectral_norm_critic_after_a_training_forward_is_copied_and_trained(tmp_path: Path) -> None:
    # Such a model cannot be copy.deepcopy'd (not a graph leaf): check said "cannot be deep-copied", exit 2.
    model, twin = _critic(), _critic()
    path = fixed_input(tmp_path)
    x = torch.load(path)
    for m in (model, twin):
        m(x).sum()  # the user's own forward, as a training loop leaves the model
    with pytest.raises(RuntimeError):
        copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = hookcli.check(model, inputs=[path], steps=12, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2))
    got = rows(result)
    assert got["params_update"].status == "PASS" and got["determinism"].status == "PASS", result
    opt = torch.optim.Adam(twin.parameters(), lr=1e-2)  # plain torch: the same 12 steps on the twin
    losses = []
    for _ in range(12):
        opt.zero_grad()
        loss = F.cross_entropy(twin(x), torch.zeros(8, dtype=torch.long))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert got["overfit_batch"].value == pytest.approx((losses[0] - min(losses)) / losses[0], rel=1e-4)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_float16_adam_whose_update_overflows_blames_the_update_not_the_gradient(tmp_path: Path) -> None:
    # Pure float16 AdamW: eps 1e-8 is 0 in float16, a tiny second moment rounds to 0 and the first step
    # divides by 0. Plain torch: step 0's gradients are finite, its update makes the weights Inf/NaN. The
    # rule said "gets a NaN/Inf gradient" (the later gradients are NaN because the weights are).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).half()
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)).half()
    path = tmp_path / "x.pt"
    torch.save(x, path)
    clone = copy.deepcopy(model)
    opt = torch.optim.AdamW(clone.parameters(), lr=1e-3)
    F.cross_entropy(clone(x).float(), torch.zeros(8, dtype=torch.long)).backward()
    assert all(torch.isfinite(p.grad).all() for p in clone.parameters())
    opt.step()
    overflowed = [n for n, p in clone.named_parameters() if not torch.isfinite(p).all()]
    assert overflowed
    got = rows(hookcli.check(model, inputs=[path], steps=3, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3)))
    update = got["params_update"]
    assert update.status == "FAIL" and update.offender == overflowed[0]
    said = {v["where"]: v["message"] for v in update.violations}
    assert all("became NaN/Inf in a step of your optimiser (AdamW) while its gradients were finite" in said[n]
               and "eps" in said[n] for n in overflowed)


def test_a_bfloat16_weight_whose_updates_round_away_fails_params_update_saying_why(tmp_path: Path) -> None:
    # Pure bfloat16 training: AdamW's first steps move each weight by about lr = 1e-3, less than half
    # bfloat16's spacing at 1 (2**-8), so a LayerNorm weight of 1 never changes (plain torch agrees).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)).to(torch.bfloat16)
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    path = tmp_path / "x.pt"
    torch.save(x, path)
    clone = copy.deepcopy(model)
    opt = torch.optim.AdamW(clone.parameters(), lr=1e-3)
    for _ in range(12):
        opt.zero_grad()
        F.cross_entropy(clone(x).float(), torch.zeros(8, dtype=torch.long)).backward()
        opt.step()
    assert torch.equal(clone[1].weight, model[1].weight) and clone[1].weight.grad.abs().max() > 0
    got = rows(hookcli.check(model, inputs=[path], steps=12, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3)))
    update = got["params_update"]
    assert update.status == "FAIL" and update.offender == "1.weight"
    message = next(v["message"] for v in update.violations if v["where"] == "1.weight")
    assert "round away in bfloat16" in message and "float32" in message


def test_a_parameter_frozen_by_accident_fails_params_update(tmp_path: Path) -> None:
    model = tb.Classifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # meant to train everything...
    model.head.weight.requires_grad_(False)  # ...but a freeze meant for another run stayed in
    got = rows(check(model, tmp_path, optimizer=opt))["params_update"]
    assert got.status == "FAIL" and got.offender == "head.weight" and "frozen by accident" in got.message
    assert model.head.weight.requires_grad is False  # the user's model as it was


def test_a_dead_layer_fails_params_update_and_overfit_batch(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    torch.manual_seed(0)
    torch.save(torch.randn(4, 4), path)
    got = rows(hookcli.check(bm.DeadLayer(), inputs=[path], steps=10))
    assert got["params_update"].status == "FAIL" and got["params_update"].offender == "hidden.weight"
    assert got["overfit_batch"].status == "FAIL"


def test_your_loss_fn_is_used_and_init_loss_skips(tmp_path: Path) -> None:
    calls = []

    def loss_fn(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape)
        return out.pow(2).mean()

    got = rows(check(tb.Classifier(), tmp_path, steps=4, loss_fn=loss_fn))
    assert got["init_loss"].status == "SKIP" and "loss_fn" in got["init_loss"].message
    assert got["params_update"].status == "PASS" and calls and all(s == torch.Size([8, 8]) for s in calls)


def test_a_factory_optimiser_is_used(tmp_path: Path) -> None:
    made = []

    def factory(params):
        made.append(torch.optim.SGD(params, lr=0.5))
        return made[-1]

    got = rows(check(tb.Classifier(), tmp_path, steps=4, optimizer=factory))
    assert made and got["params_update"].status == "PASS" and "your optimiser (factory)" in got["params_update"].message


# --------------------------------------------------------------------------- usage


def test_steps_minus_one_exits_2_with_one_line_and_a_hint(cli) -> None:
    out = cli("check", "broken_models:Healthy", "--input-shape", "2x3x8x8", "--steps", "-1")
    assert out.exit_code == 2 and out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("Error: ") and "--steps" in lines[0]
    assert lines[1].startswith("  hint: ") and "Traceback" not in out.stderr


@given(bad=st.one_of(st.text(max_size=5), st.integers(), st.floats(allow_nan=False), st.lists(st.integers(),
                                                                                              max_size=2)))
@settings(max_examples=25, deadline=None)
def test_an_optimizer_that_is_not_one_is_usage_error_exit_2(bad: object) -> None:
    with pytest.raises(UsageError) as info:
        hookcli.check(tb.Classifier(), input_shapes=["2x8"], steps=2, optimizer=bad)
    assert info.value.exit_code == 2 and "optimizer" in str(info.value)


def test_a_factory_that_returns_no_optimiser_is_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not a torch.optim.Optimizer") as info:
        check(tb.Classifier(), tmp_path, steps=2, optimizer=lambda params: list(params))
    assert info.value.exit_code == 2


def test_optimizer_without_steps_is_usage_error() -> None:
    model = tb.Classifier()
    with pytest.raises(UsageError, match="steps") as info:
        hookcli.check(model, input_shapes=["2x8"], optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert info.value.exit_code == 2


def test_training_rules_skip_without_steps_and_can_be_turned_off(tmp_path: Path) -> None:
    got = rows(hookcli.check(tb.Classifier(), input_shapes=["2x8"], checks={"determinism": True}))
    assert got["determinism"].status == "SKIP" and "--steps" in got["determinism"].message
    got = rows(check(tb.UnseededDropout(), tmp_path, steps=3, checks={"determinism": False, "params_change": True}))
    assert "determinism" not in got and got["params_change"].status == "PASS"


def test_junit_and_github_outputs_carry_the_training_rules(cli, tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    out = cli("check", "training_bugs:HotLogits", "--input-shape", "8x8", "--steps", "3", "-f", "json",
              "--junit", junit, "--github")
    assert out.exit_code == 1
    assert json.loads(out.stdout)["ok"] is False  # stdout stays pure JSON
    cases = ET.parse(junit).getroot().findall("./testsuite/testcase")
    names = [c.get("name") for c in cases]
    assert [name for name in names if name in TRAINING_RULES] == TRAINING_RULES and "params_change" not in names
    assert [c.get("name") for c in cases if c.find("failure") is not None] == ["init_loss"]
    errors = [line for line in out.stderr.splitlines() if line.startswith("::error")]
    assert len(errors) == 1 and "hookcli check init_loss at scale" in errors[0]


def test_overfit_batch_skips_below_10_steps_and_training_runs_with_params_none(tmp_path: Path) -> None:
    got = rows(check(tb.Classifier(), tmp_path, steps=9, params="none"))
    assert got["overfit_batch"].status == "SKIP" and "--steps 10" in got["overfit_batch"].message
    assert got["params_update"].status == "PASS" and got["init_loss"].status == "PASS"


def test_a_model_raising_in_the_training_run_fails_one_rule_exit_1(cli) -> None:
    out = cli("check", "training_bugs:RaisesInTraining", "--input-shape", "8x8", "--steps", "10", "-f", "json")
    assert out.exit_code == 1, out.output
    statuses = {r["rule"]: (r["status"], r["message"]) for r in json.loads(out.stdout)["rules"]}
    assert statuses["runs"][0] == "PASS" and statuses["init_loss"][0] == "FAIL"
    assert "boom in training" in statuses["init_loss"][1]
    assert [statuses[r][0] for r in TRAINING_RULES[1:]] == ["SKIP"] * 3
    assert "Traceback" not in out.stderr


def test_nothing_to_train_skips_the_training_rules(tmp_path: Path) -> None:
    model = tb.Classifier().requires_grad_(False)
    result = check(model, tmp_path, steps=10)
    got = rows(result)
    assert all(got[r].status == "SKIP" and "no trainable parameter" in got[r].message for r in TRAINING_RULES)


def test_with_data_the_steps_train_on_the_first_batch() -> None:
    torch.manual_seed(0)
    model = tb.Classifier()
    data = torch.randn(16, 8)
    got = rows(hookcli.check(model, data=data, batch_size=4, steps=10))
    first = F.cross_entropy(model(data[:4]), torch.zeros(4, dtype=torch.long)).item()
    assert got["init_loss"].value == pytest.approx(first, rel=1e-5)
    assert got["init_loss"].value != pytest.approx(F.cross_entropy(model(data), torch.zeros(16, dtype=torch.long)).item(),
                                                   rel=1e-5)
