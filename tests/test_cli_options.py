"""Option plumbing (issue 12): Click parameters named like RunOptions fields, config -> Click's
default_map through one function, closed vocabularies as enums, and facts kept in one place."""

from __future__ import annotations

import json
import re
from dataclasses import fields
from pathlib import Path

import click
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import hookcli
from hookcli.cli import main
from hookcli.config import KEY_EXCEPTIONS, OPTION_KEYS, Config, config_options, load_config, option_keys
from hookcli.options import (
    DTYPES, LISTED_SOURCES, DType, Fill, Loss, OutputFormat, ParamScope, RunOptions, looks_like_weights_file,
    option_flags, output_key_path, parse_dtype, values_of,
)
from hookcli.records import FailureInfo


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def commands() -> list[click.Command]:
    return list(main.commands.values())


# --------------------------------------------------------------------------- names


def test_parameters_named_like_run_options_fields_have_the_fields_flag() -> None:
    flags = option_flags()
    seen = set()
    for command in commands():
        for param in command.params:
            if param.name in flags:
                seen.add(param.name)
                assert flags[param.name] in [*param.opts, *param.secondary_opts], (command.name, param.name)
    # every field the command line can set is some command's parameter, under the field's name
    assert seen == set(flags)


def test_every_config_key_sets_a_parameter_of_some_command() -> None:
    config = Config({key: None for key in OPTION_KEYS}, None, "config")
    names: set[str] = set()
    keys: set[str] = set()
    for command in commands():
        specs = {p.name: [o for o in (*p.opts, *p.secondary_opts) if o.startswith("--") or not o.startswith("-")]
                 for p in command.params}
        names |= set(config_options(config, specs))
        keys |= set(option_keys(config, specs).values())
    assert names <= {p.name for c in commands() for p in c.params}
    # every key sets a parameter (``width``: every command's --width); ``mode`` (-> train) is the one
    # key that is no flag's name
    assert set(OPTION_KEYS) - keys == set()
    assert set(KEY_EXCEPTIONS) == {"mode"} and "train" in names


def test_the_api_reads_a_config_into_run_options_fields(tmp_path: Path) -> None:
    cfg = write(tmp_path / "h.toml", 'input_shape = "2x4"\ninput = []\nall = true\nmode = "eval"\nfill = "ones"\n'
                                     'model_args = ["width=3"]\nformat = "json"\nwidth = 80\n')
    got = config_options(load_config(cfg))
    assert got == {"input_shapes": ["2x4"], "inputs": [], "all_modules": True, "train": False, "fill": "ones",
                   "model_args": {"width": 3}}
    field_names = {f.name for f in fields(RunOptions)}
    assert set(got) <= field_names


# --------------------------------------------------------------------------- config through default_map


def test_config_values_go_through_the_flags_click_type_and_name_the_file(cli, tmp_path: Path) -> None:
    cfg = write(tmp_path / "h.toml", f'model = "tiny_models:Scaled"\ninput_shape = "2x4"\nseed = {2**64}\n')
    result = cli("stats", "--config", cfg)
    assert result.exit_code == 2 and result.stdout == ""
    assert str(cfg) in result.stderr and "'seed'" in result.stderr and "Traceback" not in result.stderr
    result = cli("stats", "--config", cfg, "--seed", "3", "-f", "json")  # the command line wins
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["inputs"][0]["source"] == "randn(seed=3)"


def test_command_line_wins_over_config_and_config_over_defaults(cli, tmp_path: Path) -> None:
    cfg = write(tmp_path / "h.toml", 'model = "tiny_models:Scaled"\ninput_shape = "2x4"\nfill = "zeros"\n'
                                     "model_args = { width = 3 }\n")
    data = json.loads(cli("shapes", "--config", cfg, "-f", "json").stdout)
    assert data["model"]["source"] == "config" and data["inputs"][0]["source"] == "zeros"
    assert data["layers"][0]["shape"] == [2, 3]
    data = json.loads(cli("shapes", "--config", cfg, "--fill", "ones", "--model-arg", "width=5",
                          "--input-shape", "3x4", "-f", "json").stdout)
    assert data["inputs"][0]["source"] == "ones" and data["layers"][0]["shape"] == [3, 5]


def test_check_keeps_its_defaults_under_a_config_and_a_config_mode_wins(cli, tmp_path: Path) -> None:
    plain = write(tmp_path / "p.toml", 'model = "tiny_models:Scaled"\ninput_shape = "2x4"\n')
    data = json.loads(cli("check", "--config", plain, "-f", "json").stdout)
    assert data["report"]["mode"] == "train" and data["report"]["params"]  # check: train mode, every param
    evaluated = write(tmp_path / "e.toml", 'model = "tiny_models:Scaled"\ninput_shape = "2x4"\nmode = "eval"\n')
    assert json.loads(cli("check", "--config", evaluated, "-f", "json").stdout)["report"]["mode"] == "eval"
    data = json.loads(cli("check", "--config", evaluated, "--train", "-f", "json").stdout)
    assert data["report"]["mode"] == "train"
    result = hookcli.check(config=evaluated)  # the API reads the config the same way
    assert result.report.mode == "eval" and result.report.inputs[0].shape == [2, 4]


def test_a_config_format_yields_to_the_output_extension(cli, tmp_path: Path) -> None:
    cfg = write(tmp_path / "h.toml", 'model = "tiny_models:Scaled"\ninput_shape = "2x4"\nformat = "json"\n')
    assert json.loads(cli("shapes", "--config", cfg).stdout)["command"] == "shapes"
    out = tmp_path / "r.md"
    assert cli("shapes", "--config", cfg, "-o", out).exit_code == 0
    assert out.read_text(encoding="utf-8").startswith("### shapes")


# --------------------------------------------------------------------------- vocabularies


@pytest.mark.parametrize(("vocabulary", "flag"), [(Fill, "--fill"), (Loss, "--loss"), (ParamScope, "--params"),
                                                  (OutputFormat, "--format")])
def test_cli_choices_and_config_schema_come_from_the_enum(vocabulary, flag: str) -> None:
    for command in commands():
        for param in command.params:
            if flag in param.opts:
                assert tuple(param.type.choices) == values_of(vocabulary)
    key = flag.lstrip("-")
    if key in OPTION_KEYS:
        assert OPTION_KEYS[key].expected == " | ".join(values_of(vocabulary))


@pytest.mark.parametrize("fill", list(Fill))
def test_api_takes_an_enum_member_or_its_string(fill: Fill) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    by_member = hookcli.stats(model, input_shapes=["2x4"], fill=fill, seed=5)
    by_string = hookcli.stats(model, input_shapes=["2x4"], fill=fill.value, seed=5)
    assert by_member.to_dict() == by_string.to_dict()
    if fill in (Fill.ones, Fill.zeros):  # numbers against plain torch
        x = torch.ones(2, 4) if fill == Fill.ones else torch.zeros(2, 4)
        with torch.no_grad():
            expected = model(x)
        row = by_member.layers[0]
        assert row.stats["mean"] == pytest.approx(expected.mean().item(), rel=1e-6, abs=1e-7)
        assert row.stats["max"] == pytest.approx(expected.max().item(), rel=1e-6, abs=1e-7)


def test_a_bad_vocabulary_value_from_the_api_is_a_usage_error() -> None:
    with pytest.raises(hookcli.errors.UsageError, match="unknown --fill 'randm'") as info:
        hookcli.stats(torch.nn.Linear(4, 2), input_shapes=["1x4"], fill="randm")
    assert "randn" in (info.value.hint or "")
    with pytest.raises(hookcli.errors.UsageError, match="unknown --params"):
        hookcli.grads(torch.nn.Linear(4, 2), input_shapes=["1x4"], params="some")


# --------------------------------------------------------------------------- facts in one place


@given(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True))
def test_output_key_path_names_each_spelling_of_a_key(key: str) -> None:
    for path in (key, f"[{key}]", f"['{key}']", f".{key}"):
        assert output_key_path(key, ["[zz9]", path]) == path
    assert output_key_path(key, ["", "[zz9]"]) is None or key == "zz9"


def test_output_key_path_on_real_outputs() -> None:
    assert output_key_path("0", ["[0]", "[1]"]) == "[0]"
    assert output_key_path("out", ["['out']", "['aux']"]) == "['out']"
    assert output_key_path("logits", [".loss", ".logits"]) == ".logits"
    assert output_key_path("2", ["[0]", "[1]"]) is None


def test_weights_files_and_weights_names(tmp_path: Path) -> None:
    for name in ("model.pt", "w.PTH", "x.safetensors", "a/b", "ckpt.ckpt", "m.bin", "old.pkl", "w.tar"):
        assert looks_like_weights_file(name)
    for name in ("DEFAULT", "ResNet18_Weights.IMAGENET1K_V1", "IMAGENET1K_V2"):
        assert not looks_like_weights_file(name, tmp_path)
    (tmp_path / "weights").write_bytes(b"")
    assert looks_like_weights_file("weights", tmp_path) and not looks_like_weights_file("DEFAULT", tmp_path)


def test_the_failure_sentence_is_the_same_in_every_output(cli) -> None:
    result = cli("stats", "tiny_models:Raises", "--input-shape", "2x4")
    assert result.exit_code == 1
    error = result.stderr.splitlines()[0].removeprefix("Error: ")
    assert error.startswith("the model raised in forward at bad (CheckedLinear) with input shape(s) 2x6: RuntimeError")
    assert error in " ".join(result.stdout.split())  # the table's footer says the same sentence
    check = cli("check", "tiny_models:Raises", "--input-shape", "2x4", "-f", "json")
    runs = json.loads(check.stdout)["rules"][0]
    assert runs["rule"] == "runs" and runs["message"] == error


def test_failure_sentence_of_an_exit() -> None:
    info = FailureInfo("forward", "fc", "Linear", [[2, 4], None], "SystemExit", "exited with code 3")
    assert info.sentence() == "the model exited with code 3 in forward at fc (Linear) with input shape(s) 2x4, ? " \
                              "(it called sys.exit)"


@pytest.mark.parametrize("help_flag", ["--help", "-h"])
def test_help_is_shown_whatever_the_config_holds(cli, tmp_path: Path, help_flag: str) -> None:
    cfg = write(tmp_path / "bad.toml", 'seed = "x"\n')
    result = cli("stats", "--config", cfg, help_flag)
    assert result.exit_code == 0 and result.stdout.startswith("Usage:") and result.stderr == ""
    result = cli("stats", "--config", cfg)
    assert result.exit_code == 2 and "'seed'" in result.stderr and str(cfg) in result.stderr


def test_a_config_key_and_its_cli_option_show_the_run_options_fields_one_help() -> None:
    """Config descriptions were written apart from the CLI's help and drifted (``all``: "not only
    leaves"; ``dtype``: three of the four dtypes): both now come from the field's own help."""
    config = Config({key: None for key in OPTION_KEYS}, None, "config")
    field_help = {f.name: f.metadata["help"] for f in fields(RunOptions) if "help" in f.metadata}
    for name, key in option_keys(config).items():
        assert OPTION_KEYS[key].description.startswith(field_help[name]), key
    for command in commands():
        for param in command.params:
            own = (command.name, param.name) in {("check", "train"), ("watch", "train"), ("fmaps", "output_key")}  # their own default
            if param.name in field_help and isinstance(param, click.Option) and not own:
                assert param.help == field_help[param.name], (command.name, param.name)
    # every field a config sets has its help; the help names every dtype --dtype takes
    assert set(option_keys(config)) <= set(field_help)
    assert all(d in field_help["dtype"] for d in values_of(DType))


def test_a_config_accepts_exactly_the_dtypes_the_command_line_takes(cli, tmp_path: Path) -> None:
    for spelling in DTYPES:
        assert load_config(write(tmp_path / "ok.toml", f'dtype = "{spelling}"\n')).values["dtype"] == spelling
    cfg = write(tmp_path / "bad.toml", 'model = "tiny_models:Scaled"\ninput_shape = "2x4"\ndtype = "int8"\n')
    result = cli("stats", "--config", cfg)
    assert result.exit_code == 2 and result.stdout == "" and "Traceback" not in result.stderr
    assert str(cfg) in result.stderr and "'dtype'" in result.stderr
    assert " | ".join(values_of(DType)) in result.stderr
    ok = write(tmp_path / "h.toml", 'model = "tiny_models:Scaled"\ninput_shape = "2x4"\ndtype = "bf16"\n')
    result = cli("shapes", "--config", ok, "--device", "cpu", "-f", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["layers"][0]["dtype"] == "bfloat16"


@given(st.sampled_from(sorted(DTYPES)), st.booleans(), st.booleans())
def test_parse_dtype_reads_any_case_and_torch_prefix(spelling: str, upper: bool, prefixed: bool) -> None:
    text = ("torch." if prefixed else "") + (spelling.upper() if upper else spelling)
    assert parse_dtype(text) is DTYPES[spelling]
    assert getattr(torch, parse_dtype(text).value).is_floating_point


def test_docs_list_every_dtype_and_fill() -> None:
    text = (Path(__file__).resolve().parents[1] / "docs" / "options.md").read_text(encoding="utf-8")
    assert "--fill " + "|".join(values_of(Fill)) in text
    listed = text.split("`--dtype ", 1)[1].split("`", 1)[0].split("|")
    assert sorted(listed) == sorted(values_of(DType))


def test_docs_name_every_config_key_and_every_command_line_only_option() -> None:
    """docs/options.md said "any option but --trust-pickle" could come from a config; the loss options
    never could. It now lists the keys and the command-line-only flags, checked against the code."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "options.md").read_text(encoding="utf-8")
    section = " ".join(text.split("## Config files", 1)[1].split("```", 1)[0].split())
    keys_part, _, cli_part = section.partition("command line wins.")[2].partition("each takes")
    assert set(re.findall(r"`([^`]+)`", keys_part)) - {'"train"', '"eval"'} == set(OPTION_KEYS)
    config = Config({key: None for key in OPTION_KEYS}, None, "config")
    cli_only = {flag for name, flag in option_flags().items() if name not in option_keys(config) and name != "model"}
    cli_only_part = cli_part.split("are command-line only")[0]
    assert set(re.findall(r"`(--[a-z-]+)`", cli_only_part)) == cli_only


def test_models_sources_are_one_list_for_the_cli_and_the_api(cli) -> None:
    (source,) = [p for p in main.commands["models"].params if p.name == "source"]
    assert tuple(source.type.choices) == LISTED_SOURCES
    with pytest.raises(hookcli.errors.UsageError) as info:
        hookcli.models(source="tim")
    assert "timm" in (info.value.hint or "")
    result = cli("models", "--source", "timm", "resnet18", "-f", "json")
    assert result.exit_code == 0 and result.stderr == ""
    names = [row["name"] for row in json.loads(result.stdout)["models"]]
    assert names == ["timm:resnet18"]
