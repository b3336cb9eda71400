"""``check --steps N``'s rules on what lives between modules: residual_growth (a residual stream is only
ever a module's input), dead_units (units dead behind a functional relu) and target_leak (targets that
reach the inputs), each on a seeded bug of tests/training_bugs.py and its fixed twin; numbers against
plain torch."""

from __future__ import annotations

import copy
import json
import math
import tomllib
from pathlib import Path

import pytest
import torch

import hookcli
import training_bugs as tb
from hookcli.commands.check import schema

ROOT = Path(__file__).resolve().parent.parent
NEW_RULES = ("residual_growth", "dead_units", "target_leak")


def fixed_input(tmp_path: Path, rows: int) -> Path:
    torch.manual_seed(1)
    path = tmp_path / "x.pt"
    torch.save(torch.randn(rows, 8), path)
    return path


def rows(result) -> dict[str, object]:
    return {r.rule: r for r in result.rules}


def block_inputs(model: tb.Residual, x: torch.Tensor, doubled: bool) -> list[torch.Tensor]:
    """The input of each block and of the final norm, in float64, as the parent's forward hands it on."""
    model = copy.deepcopy(model).double()
    seen = []
    with torch.no_grad():
        h = model.embed(x.double())
        for block in model.blocks:
            seen.append(h)
            h = h + block(h) if doubled else block(h)
    return [*seen, h]


# --------------------------------------------------------------------------- residual_growth


def test_a_doubled_residual_stream_fails_residual_growth_at_step_1_naming_the_block(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = tb.DoubledResidual()
    result = hookcli.check(model, inputs=[fixed_input(tmp_path, 8)], steps=12)
    row = rows(result)["residual_growth"]
    assert row.status == "FAIL" and row.offender == "blocks.5", row
    seen = block_inputs(model, torch.load(tmp_path / "x.pt"), doubled=True)
    rms = [float(h.pow(2).mean().sqrt()) for h in seen]
    top = [float(h.abs().max()) for h in seen]
    assert row.value == pytest.approx(min(b / a for a, b in zip(rms, rms[1:])), rel=1e-5)
    assert row.value > 1.9
    assert (f"at step 1 the input of blocks.0 .. blocks.5 and of norm grows {row.value:.4g}x or more at every block"
            in row.message)
    assert f"RMS {rms[0]:.4g} -> {rms[-1]:.4g}, max |x| {top[0]:.4g} -> {top[-1]:.4g} over 6 blocks and norm" in row.message
    # the one-step rules see module outputs only: they pass
    assert all(r.status in ("PASS", "SKIP") for r in result.rules if r.rule != "residual_growth"), result.rules


def test_its_fixed_twin_passes_and_the_growth_is_plain_torchs(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = tb.Residual()
    result = hookcli.check(model, inputs=[fixed_input(tmp_path, 8)], steps=12)
    assert result.ok, [(r.rule, r.message) for r in result.rules if r.status != "PASS"]
    row = rows(result)["residual_growth"]
    assert row.status == "PASS" and row.limit == 1.8
    seen = block_inputs(model, torch.load(tmp_path / "x.pt"), doubled=False)
    rms = [float(h.pow(2).mean().sqrt()) for h in seen]
    at_init = min(b / a for a, b in zip(rms, rms[1:]))
    assert at_init < row.value + 1e-6 < 1.8  # the largest over the steps, the first step's included


def test_residual_growth_is_configurable_and_can_be_turned_off(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = tb.DoubledResidual(), [fixed_input(tmp_path, 8)]
    assert rows(hookcli.check(model, inputs=x, steps=3, checks={"residual_growth": {"value": 2.5}}))[
        "residual_growth"].status == "PASS"
    assert rows(hookcli.check(model, inputs=x, steps=3, checks={"residual_growth": {"min_blocks": 7}}))[
        "residual_growth"].status == "SKIP"
    assert rows(hookcli.check(model, inputs=x, steps=3, checks={"residual_growth": {"ignore": ["blocks.*"]}}))[
        "residual_growth"].status == "SKIP"
    off = hookcli.check(model, inputs=x, steps=3, checks={"residual_growth": False})
    assert "residual_growth" not in rows(off) and off.ok


# --------------------------------------------------------------------------- dead_units


def test_units_dead_behind_a_functional_relu_fail_dead_units_naming_the_layer(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = tb.DeadFunctionalReLU()
    result = hookcli.check(model, inputs=[fixed_input(tmp_path, 32)], steps=12)
    got = rows(result)
    row = got["dead_units"]
    assert row.status == "FAIL" and row.offender == "body", row
    with torch.no_grad():
        pre = copy.deepcopy(model).double().body(torch.load(tmp_path / "x.pt").double())
    dead = torch.nonzero((pre <= 0).all(0)).flatten().tolist()
    assert len(dead) == 12
    assert row.value == pytest.approx(len(dead) / 16)
    assert (f"{len(dead)} of 16 output channels of body (75%; first: channel {dead[0]}) were <= 0 on every sample "
            "at every step 1..12") in row.message
    assert got["dead_channels"].status == "PASS"  # no module outputs what F.relu makes


def test_a_functional_relu_with_live_units_passes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    result = hookcli.check(tb.FunctionalReLU(), inputs=[fixed_input(tmp_path, 32)], steps=30)
    assert result.ok, [(r.rule, r.message) for r in result.rules if r.status != "PASS"]
    assert rows(result)["dead_units"].status == "PASS"


def test_dead_units_thresholds_and_ignore_come_from_the_config(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = tb.DeadFunctionalReLU(), [fixed_input(tmp_path, 32)]
    assert rows(hookcli.check(model, inputs=x, steps=3, checks={"dead_units": {"value": 0.8}}))[
        "dead_units"].status == "PASS"
    assert rows(hookcli.check(model, inputs=x, steps=3, checks={"dead_units": {"overrides": {"body": 0.9}}}))[
        "dead_units"].status == "PASS"
    # 32 values per channel in a step: below min_values = 33 no layer is judged
    assert rows(hookcli.check(model, inputs=x, steps=3, checks={"dead_units": {"min_values": 33}}))[
        "dead_units"].status == "SKIP"


# --------------------------------------------------------------------------- target_leak


def plain_fit(model: tb.TokenModel, ids: torch.Tensor, lr: float, steps: int) -> tuple[list[float], tb.TokenModel]:
    clone = copy.deepcopy(model).train()
    opt = torch.optim.Adam(clone.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = clone(ids)["loss"]
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, clone


def ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 32, (4, 16), generator=torch.Generator().manual_seed(seed))


def test_unshifted_language_model_targets_fail_target_leak_on_fresh_batches() -> None:
    torch.manual_seed(0)
    model = tb.UnshiftedTargets()
    result = hookcli.check(model, input_shapes=["4x16:int64"], steps=30)
    row = rows(result)["target_leak"]
    assert row.status == "FAIL" and row.offender == "(model)", row
    # replayed in plain torch: the lr sweep, 30 Adam steps on the seed-0 batch, then seeds 1 and 2
    sweep = {lr: min(plain_fit(model, ids(0), lr, 5)[0]) for lr in (1e-4, 1e-3, 1e-2)}
    lr = min(sweep, key=lambda k: (sweep[k], k))
    _, trained = plain_fit(model, ids(0), lr, 30)
    with torch.no_grad():
        fresh = [trained(ids(s))["loss"].item() for s in (1, 2)]
    assert row.value == pytest.approx(sum(fresh) / 2, rel=1e-3, abs=1e-4)
    assert row.limit == pytest.approx(0.5 * math.log(32))
    assert "fresh batches (seeds 1, 2) after 30 steps" in row.message and "ln 32 = 3.466" in row.message
    assert rows(result)["overfit_batch"].status == "PASS"  # one batch overfits either way


def test_shifted_targets_pass_target_leak() -> None:
    torch.manual_seed(0)
    result = hookcli.check(tb.TokenModel(), input_shapes=["4x16:int64"], steps=30)
    assert result.ok, [(r.rule, r.message) for r in result.rules if r.status != "PASS"]
    row = rows(result)["target_leak"]
    assert row.status == "PASS" and row.value > math.log(32)


def test_target_leak_skips_without_generated_inputs_or_targets_from_them(tmp_path: Path) -> None:
    torch.manual_seed(0)
    files = rows(hookcli.check(tb.Classifier(), inputs=[fixed_input(tmp_path, 8)], steps=3))["target_leak"]
    assert files.status == "SKIP" and "not generated" in files.message
    fixed_class = rows(hookcli.check(tb.Classifier(), input_shapes=["8x8"], steps=3))["target_leak"]
    assert fixed_class.status == "SKIP" and "not made from the inputs" in fixed_class.message
    torch.manual_seed(0)
    own = tb.UnshiftedTargets()
    own.example_inputs = (ids(0),)  # the model's own example: the same tensor whatever the seed
    example = rows(hookcli.check(own, steps=3))["target_leak"]
    assert example.status == "SKIP" and "example inputs" in example.message
    torch.manual_seed(0)
    loose = hookcli.check(tb.UnshiftedTargets(), input_shapes=["4x16:int64"], steps=30,
                          checks={"target_leak": {"fraction": 0.001, "batches": 1}})
    assert rows(loose)["target_leak"].status == "PASS" and "seeds 1)" in rows(loose)["target_leak"].message


def test_the_cli_fails_a_doubled_residual_stream_exit_1(cli) -> None:
    out = cli("check", "training_bugs:DoubledResidual", "--input-shape", "8x8", "--steps", "3", "-f", "json")
    assert out.exit_code == 1, out.output
    found = {r["rule"]: r for r in json.loads(out.stdout)["rules"]}
    assert found["residual_growth"]["status"] == "FAIL" and found["residual_growth"]["offender"] == "blocks.5"


# --------------------------------------------------------------------------- the config


def test_configs_resnet18_spells_out_every_rule() -> None:
    table = tomllib.loads((ROOT / "configs" / "resnet18.toml").read_text())["checks"]
    assert sorted(table) == sorted(schema.RULES)
    for name in NEW_RULES:  # their defaults, spelled out
        spec = schema.SPEC[name]
        assert {k: v for k, v in table[name].items() if k != "ignore"} == {
            k: v for k, v in spec.defaults.items() if k != "enabled"}


def _tiny_gpt2(doubled: bool) -> torch.nn.Module:
    """A 4-block GPT-2 (random init, seed 0); ``doubled``: each block's output has its input added once
    more (the residual added twice: the stream doubles at every block, up to ``ln_f``'s input)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    class DoubledBlock(GPT2Block):
        def forward(self, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
            return hidden_states + super().forward(hidden_states, *args, **kwargs)

    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=4, n_head=2, bos_token_id=0,
                                     eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    if doubled:
        for i, block in enumerate(model.transformer.h):
            twin = DoubledBlock(config, layer_idx=i)
            twin.load_state_dict(block.state_dict())
            model.transformer.h[i] = twin
    return model


def _stream(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """Plain torch, float64: the input of each block and of ln_f at the model's weights (the test's own
    forward pre-hooks)."""
    model = copy.deepcopy(model).double().train()
    seen: list[torch.Tensor] = []
    modules = [*model.transformer.h, model.transformer.ln_f]
    handles = [m.register_forward_pre_hook(lambda m, args, kwargs: seen.append(args[0] if args else
                                                                              kwargs["hidden_states"]),
                                           with_kwargs=True) for m in modules]
    torch.manual_seed(0)  # (dropout: the stream's scale is what is compared, not its values)
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    return seen


@pytest.mark.parametrize("doubled", [True, False], ids=["doubled", "fixed"])
def test_gpt2s_stream_is_watched_up_to_ln_fs_input(tmp_path: Path, doubled: bool) -> None:
    """A tiny transformers GPT-2: the stream's last value is only ever ln_f's input, and it is part of
    residual_growth. Doubled: it fails, at step 1, naming h.3 and ln_f, the RMS from h.0's input to ln_f's
    (plain torch's, float64, at the initial weights); its fixed twin passes."""
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (4, 12))
    torch.save(ids, tmp_path / "ids.pt")
    model = _tiny_gpt2(doubled)
    result = hookcli.check(model, inputs=[tmp_path / "ids.pt"], steps=6)
    row = rows(result)["residual_growth"]
    if not doubled:
        assert row.status == "PASS" and row.value < 1.8, row
        return
    assert row.status == "FAIL" and row.offender == "transformer.h.3", row
    rms = [float(h.pow(2).mean().sqrt()) for h in _stream(model, ids)]
    assert len(rms) == 5 and min(b / a for a, b in zip(rms, rms[1:])) > 1.8  # the stream doubles, ln_f's input too
    assert ("at step 1 the input of transformer.h.0 .. transformer.h.3 and of transformer.ln_f grows "
            in row.message), row.message
    assert f"(RMS {rms[0]:.4g} -> {rms[-1]:.4g}" in row.message, row.message


def test_the_final_norm_is_the_one_the_stack_flows_into() -> None:
    """Llama's ``model.norm`` after its ``layers``; a norm right after the blocks inside one Sequential;
    none where the module after the stack is no norm."""
    from hookcli.commands.check.between import final_norm, stacks

    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    llama = transformers.LlamaForCausalLM(config)
    assert [(s[-1], final_norm(llama, s)) for s in stacks(llama)] == [("model.layers.2", "model.norm")]
    inline = torch.nn.Sequential(*(tb.ResidualBlock(8) for _ in range(3)), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    assert [final_norm(inline, s) for s in stacks(inline)] == ["3"]
    headless = torch.nn.Sequential(torch.nn.Sequential(*(tb.ResidualBlock(8) for _ in range(3))), torch.nn.Linear(8, 2))
    assert [final_norm(headless, s) for s in stacks(headless)] == [None]
