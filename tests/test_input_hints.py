"""When hookcli's own default input does not fit the model, the hint names forward's arguments and
the ``--input-shape NAME=SHAPE`` flags that fit, from the model's config or first layer, or says which
argument needs a shape hookcli cannot know. The hints are tested by running the flags they suggest.
Tiny configs, random init.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hookcli.engine.input_hints import argument_shapes
from test_model_sources import assert_layers_match, reference_outputs, run_json

transformers = pytest.importorskip("transformers")

HERE = "tests/hint_models.py"
#: a tiny time-series transformer: forward requires past_values, past_time_features, past_observed_mask
SERIES = {"context_length": 8, "prediction_length": 4, "d_model": 8, "encoder_layers": 1, "decoder_layers": 1,
          "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 8, "decoder_ffn_dim": 8,
          "num_time_features": 2, "lags_sequence": [1, 2, 3]}


def _args(fields: dict[str, Any]) -> list[str]:
    return [a for k, v in fields.items() for a in ("--model-arg", f"{k}={v!r}")]


def _hint(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("Error: ") and lines[1].startswith("  hint: "), stderr
    return lines[1].removeprefix("  hint: ")


def _flags(hint: str) -> list[str]:
    """The --input-shape flags the hint suggests."""
    return shlex.split(" ".join(re.findall(r"--input-shape \S+", hint)))


@pytest.mark.parametrize(("model_type", "input_size"), [
    ("informer", 1), ("time_series_transformer", 1), ("autoformer", 2)])
def test_time_series_hint_names_the_arguments_and_its_flags_run(cli: Any, model_type: str, input_size: int) -> None:
    fields = dict(SERIES, input_size=input_size)
    result = cli("stats", f"hf:{model_type}", *_args(fields))
    assert result.exit_code == 2, result.stderr  # a default input forward cannot take: bad input, as before
    hint = _hint(result.stderr)
    assert hint.startswith("forward takes (past_values, past_time_features, past_observed_mask): try ")
    past = 8 + 3  # context_length + max(lags_sequence); univariate (input_size 1): [batch, length]
    series = f"1x{past}" if input_size == 1 else f"1x{past}x{input_size}"
    flags = _flags(hint)
    assert flags == ["--input-shape", f"past_values={series}", "--input-shape", f"past_time_features=1x{past}x2",
                     "--input-shape", f"past_observed_mask={series}"]
    assert "context_length + max(lags_sequence), " in hint and "num_time_features" in hint
    report = run_json(cli, "stats", f"hf:{model_type}", *_args(fields), *flags)  # the hint's flags run
    torch.manual_seed(0)  # as hookcli builds it
    config = transformers.AutoConfig.for_model(model_type, **fields)
    model = getattr(transformers, report["model"]["class"])(config).eval()
    gen = torch.Generator().manual_seed(0)  # the inputs in flag order, from one seeded generator; masks all ones
    inputs = {}
    for flag in flags[1::2]:
        name, shape = flag.split("=")
        dims = [int(d) for d in shape.split("x")]
        inputs[name] = torch.ones(dims, dtype=torch.int64) if "mask" in name else torch.randn(dims, generator=gen)
    outputs, _ = reference_outputs(model, **inputs)
    assert_layers_match(report["layers"], outputs, "stats")


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(context=st.integers(2, 6), lags=st.lists(st.integers(1, 4), min_size=1, max_size=3, unique=True),
       time_features=st.integers(1, 3), input_size=st.integers(1, 3), batch=st.integers(1, 2))
def test_suggested_time_series_shapes_fit_forward(context: int, lags: list[int], time_features: int,
                                                  input_size: int, batch: int) -> None:
    config = transformers.TimeSeriesTransformerConfig(
        context_length=context, prediction_length=2, lags_sequence=lags, num_time_features=time_features,
        input_size=input_size, d_model=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=8, decoder_ffn_dim=8)
    model = transformers.TimeSeriesTransformerModel(config).eval()
    shapes = argument_shapes(model, batch)
    assert shapes is not None and [name for name, _, _ in shapes] == [
        "past_values", "past_time_features", "past_observed_mask"]
    inputs = {name: torch.randn(shape) if "mask" not in name else torch.ones(shape) for name, shape, _ in shapes}
    with torch.no_grad():
        out = model(**inputs)  # the shapes the hint suggests are the ones forward takes
    assert out.last_hidden_state.shape[0] == batch


def test_unknown_argument_is_named_and_the_known_one_runs(cli: Any) -> None:
    result = cli("stats", f"{HERE}:Masked")
    assert result.exit_code == 2, result.stderr
    hint = _hint(result.stderr)
    assert hint.startswith("forward takes (x, mask): try --input-shape x=1x8 --input-shape mask=SHAPE ")
    assert "x's guessed from proj (Linear)" in hint
    assert "hookcli cannot tell the shape of mask: give the one forward expects" in hint
    flags = [f.replace("SHAPE", "1") for f in _flags(hint)]  # the user gives mask's shape, the rest as suggested
    report = run_json(cli, "stats", f"{HERE}:Masked", *flags)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    from hint_models import Masked

    model = Masked().eval()
    x = torch.randn(1, 8, generator=gen)
    outputs, _ = reference_outputs(model, x=x, mask=torch.ones(1, dtype=torch.int64))
    assert_layers_match(report["layers"], outputs, "stats")


@pytest.mark.parametrize("command", ["stats", "grads"])
def test_model_raising_on_the_guess_says_what_forward_takes(cli: Any, command: str) -> None:
    result = cli(command, f"{HERE}:DictBatch")
    assert result.exit_code == 1, result.stderr  # the model raised: exit 1, as for any model failure
    error = [line for line in result.stderr.splitlines() if line.startswith(("Error: ", "  hint: "))]
    assert len(error) == 2 and "the model raised in forward" in error[0], result.stderr
    hint = error[1].removeprefix("  hint: ")
    assert hint.startswith("the input was hookcli's default; forward takes (batch): try --input-shape batch=SHAPE ")
    assert "the guess batch 1x8 did not fit" in hint  # not suggested again: it is what the model raised on
    assert "hookcli cannot tell the shape of batch" in hint and hint.endswith("--debug for the model's traceback")


def test_model_raising_on_given_shapes_keeps_the_debug_hint(cli: Any) -> None:
    result = cli("stats", f"{HERE}:DictBatch", "--input-shape", "1x8")
    assert result.exit_code == 1
    assert "  hint: run again with --debug for the model's traceback" in result.stderr
    assert "forward takes" not in result.stderr
