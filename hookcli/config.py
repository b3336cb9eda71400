"""TOML configuration: defaults for the CLI options of ``OPTION_KEYS``, from ``--config FILE`` or ``[tool.hookcli]``.

A config is flat: option keys at the top level (or in ``[tool.hookcli]`` of a pyproject.toml),
plus a ``[checks]`` table kept raw for the ``check`` command. Keys may use ``-`` or ``_``.
Relative paths (``input``, ``weights``, ``output``, a ``file.py:attr`` model) are resolved against
the config file's directory, so a config works from any working directory. Never imports torch.

A config may come from someone else's repository (bare ``hookcli check`` reads ./pyproject.toml), so
it names only what that repository is entitled to (docs/options.md, "What a config may name"):
``trust_pickle`` and ``trust_remote_code`` are refused (as keys and in ``model_args``: only the command
line or a Python keyword opts in to running code from files); files it writes lie in its own
directory tree (``confine_write``), files it reads in that tree or the working directory's
(``confine_read``), and its model is the repository's own code (``_confine_model``, then
``hookcli.engine.loading.check_own_code``).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from hookcli.errors import ConfigError, did_you_mean
from hookcli.targets import is_inside
from hookcli.limits import TEXT_BYTES, read_capped
from hookcli.options import (
    DType, Fill, Mode, OutputFormat, Shard, check_path_text, looks_like_weights_file, option_flags, option_help, parse_dtype, source_of,
    strip_prefix, values_of,
)

FILLS = values_of(Fill)
MODES = values_of(Mode)
SHARDS = values_of(Shard)
FORMATS = values_of(OutputFormat)
DTYPE_NAMES = values_of(DType)


class Invalid(Exception):
    """A TOML value of the wrong type or out of range; ``expected`` says what was wanted (``an integer
    >= 1``). The validators here serve the option keys and the ``[checks]`` schema alike."""

    def __init__(self, expected: str = "") -> None:
        super().__init__(expected)
        self.expected = expected


@dataclass(frozen=True)
class KeySpec:
    """What a config key accepts: ``expected`` (human-readable type), a description, a validator."""

    expected: str
    description: str
    validate: Callable[[Any], Any] = field(repr=False)


def _type_name(value: Any) -> str:
    names = {bool: "boolean", int: "integer", float: "float", str: "string", list: "array",
             dict: "table"}
    return names.get(type(value), type(value).__name__)


def describe_value(value: Any) -> str:
    """``boolean true``, ``integer 0``, ``string 'x'``, ``array``: for error messages."""
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"{_type_name(value)} {value}"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"string {shown!r}"
    if isinstance(value, list) and value:
        return "array of " + " and ".join(sorted({_type_name(v) for v in value}))
    return _type_name(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise Invalid
    return value


def _str_list(value: Any) -> list[str]:
    """A string or an array of strings, normalised to a list."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise Invalid


def integer(minimum: int | None = None, maximum: int | None = None) -> Callable[[Any], int]:
    """A validator of a TOML integer (not a boolean) from ``minimum`` to ``maximum``."""
    expected = "an integer" + (f" >= {minimum}" if minimum is not None else "") + (
        f" and <= {maximum}" if maximum is not None else "")

    def check(value: Any) -> int:
        if not _is_int(value) or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            raise Invalid(expected)
        return int(value)

    return check


def number(low: float, high: float = math.inf, *, low_open: bool = False) -> Callable[[Any], float]:
    """A validator of a finite TOML number (integer or float, not a boolean) from ``low`` to
    ``high`` (``low`` excluded when ``low_open``). Every numeric threshold goes through it: ``inf``
    would turn a failing gate into a pass, and ``nan`` compares false with everything."""
    expected = (f"a finite number > {low:g}" if low_open else f"a finite number >= {low:g}") + (
        f" and <= {high:g}" if high < math.inf else "")
    if low == 0 and high == 1 and not low_open:
        expected = "a number from 0 to 1"

    def check(value: Any) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                or not (value > low if low_open else value >= low) or not value <= high:
            raise Invalid(expected)
        return float(value)

    return check


def boolean(value: Any) -> bool:
    """A validator of a TOML boolean."""
    if not isinstance(value, bool):
        raise Invalid("a boolean")
    return value


def _choice(choices: tuple[str, ...]) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if not isinstance(value, str) or value not in choices:
            raise Invalid
        return value

    return check


_MODEL_ARG = re.compile(r"^\s*[A-Za-z_][A-Za-z0-9_]*\s*=")


def _model_args(value: Any) -> dict[str, Any] | list[str]:
    """A table (kept as a dict) or an array of ``"KEY=VALUE"`` strings (kept as written, so the
    CLI parses them exactly like ``--model-arg``)."""
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, list) and all(isinstance(v, str) and _MODEL_ARG.match(v) for v in value):
        return list(value)
    raise Invalid


def _table(value: Any) -> dict[str, Any]:
    """A TOML table, kept as a dict."""
    if not isinstance(value, dict):
        raise Invalid
    return dict(value)


def _spec(expected: str, description: str, validate: Callable[[Any], Any]) -> KeySpec:
    return KeySpec(expected, description, validate)


STR, STRS = "string", "string or array of strings"


def _dtype(value: Any) -> str:
    """A dtype spelling ``--dtype`` takes (``parse_dtype``), kept as written for Click and RunOptions."""
    if not isinstance(value, str) or parse_dtype(value) is None:
        raise Invalid
    return value


#: Every option a config may set (normalised names), with the type it takes. A key that sets a
#: RunOptions field shows that field's help (``option_help``), the same text as its CLI option.
OPTION_KEYS: dict[str, KeySpec] = {
    "model": _spec(STR, option_help("model"), _str),
    "weights": _spec(STR, option_help("weights"), _str),
    "model_args": _spec("table, or array of \"KEY=VALUE\" strings", option_help("model_args"), _model_args),
    "input_shape": _spec(STRS, option_help("input_shapes"), _str_list),
    "input": _spec(STRS, option_help("inputs"), _str_list),
    "batch_size": _spec("integer > 0", option_help("batch_size"), integer(1)),
    "data": _spec(STR, option_help("data") + " A config's data is the repository's own.", _str),
    "batches": _spec("integer > 0", option_help("batches"), integer(1)),
    "fill": _spec(" | ".join(FILLS), option_help("fill"), _choice(FILLS)),
    "seed": _spec("integer >= 0", option_help("seed"), integer(0)),
    "seq_len": _spec("integer > 0", option_help("seq_len"), integer(1)),
    "layers": _spec(STRS, option_help("layers"), _str_list),
    "types": _spec(STRS, option_help("types"), _str_list),
    "depth": _spec("integer >= 0", option_help("depth"), integer(0)),
    "all": _spec("boolean", option_help("all_modules"), boolean),
    "device": _spec(STR, option_help("device"), _str),
    "dtype": _spec(" | ".join(DTYPE_NAMES), option_help("dtype"), _dtype),
    "mode": _spec(" | ".join(MODES), option_help("train"), _choice(MODES)),
    "shard": _spec(" | ".join(SHARDS), option_help("shard"), _choice(SHARDS)),
    "format": _spec(" | ".join(FORMATS), "output format", _choice(FORMATS)),
    "output": _spec(STR, "file to write the report to", _str),
    "width": _spec("integer > 0", "table width in columns", integer(1)),
}
#: Tables kept raw for later validation (by the ``check`` command).
RAW_TABLES = ("checks",)
#: The ``[watch]`` table (``hookcli watch``): its option keys, and ``[watch.rules.<rule>]`` tables kept
#: raw for the watch's rules to validate (``rules={...}`` of ``hookcli.watch``).
WATCH_KEYS: dict[str, KeySpec] = {
    "every": _spec("integer > 0", "log steps 0, every, 2 * every, ...", integer(1)),
    "out": _spec(STR, "the watch's log file (JSON Lines), appended to", _str),
    "flight": _spec("integer > 0", "the flight recorder's steps (docs/watch.md#flight-recorder)", integer(1)),
    "layers": _spec(STRS, option_help("layers"), _str_list),
    "types": _spec(STRS, option_help("types"), _str_list),
    "rules": _spec("table of [watch.rules.<rule>] tables", "the rules' thresholds (docs/watch.md#rules)",
                   lambda value: _table(value)),
}
#: Options a config may never set (key -> the command-line flag): configs often come from someone
#: else's repository, so opting in to running code from a file must be the user's own.
CLI_ONLY_KEYS: dict[str, str] = {"trust_pickle": "--trust-pickle", "trust_remote_code": "--trust-remote-code"}


@dataclass
class Config:
    """Option defaults read from a config file."""

    values: dict[str, Any]
    path: Path | None
    origin: str  # "config" (--config FILE) | "pyproject" (./pyproject.toml) | "none"
    checks: dict[str, Any] = field(default_factory=dict)
    #: the ``[watch]`` table, validated (``out`` resolved and confined); ``rules`` raw
    watch: dict[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key`` (``-`` or ``_`` spelling), or ``default``."""
        return self.values.get(normalize_key(key), default)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and normalize_key(key) in self.values

    def roots(self) -> tuple[str, ...]:
        """The directories the model this config names must come from (``read_roots``)."""
        return tuple(read_roots(self.path)) if self.path is not None else ()


def normalize_key(key: str) -> str:
    """``input-shape`` -> ``input_shape``."""
    return key.replace("-", "_")


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(read_capped(path, TEXT_BYTES, f"config file {path}").decode("utf-8"))
    except RecursionError:  # tomllib recurses once per nested array or inline table
        raise ConfigError(f"config file {path} nests arrays or tables too deeply to read",
                          hint="a hookcli config is a few flat tables: fix or replace the file") from None
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist",
                          hint="check the --config path (relative paths start at the current directory)") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory", hint="give the TOML file inside it") from None
    except PermissionError:
        raise ConfigError(f"config file {path}: permission denied", hint="make the file readable") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}",
                          hint="fix the syntax at that line (strings need quotes: fill = \"ones\")") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid UTF-8: {exc.reason}",
                          hint="save the file as UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}",
                          hint="check that the file exists and is readable") from None


def _is_pyproject(path: Path, data: dict[str, Any]) -> bool:
    return path.name == "pyproject.toml" or "tool" in data or "project" in data


def _resolve(value: str, base: Path) -> str:
    """A path a config names, absolute: ``~`` expanded, relative to the config's directory. Every
    value is a path (``-`` too: a file of that name), so what is checked is what gets opened."""
    if not value:
        return value
    p = Path(os.path.expanduser(value))  # (not Path(value).expanduser(): Path drops a leading ./, and
    # ./~/x, a folder named ~ in the repository, would become the user's home)
    return str(p if p.is_absolute() else (base / p).resolve())


_KEYWORD_INPUT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.+)$")


def _resolve_input(value: str, base: Path) -> str:
    """A file input, or ``name=file`` for a keyword input: the file part resolved."""
    match = _KEYWORD_INPUT.match(value)
    if match:
        return f"{match.group(1)}={_resolve(match.group(2), base)}"
    return _resolve(value, base)


def _resolve_model(spec: str, base: Path) -> str:
    index = spec.find(".py:")
    if index < 0:
        return _resolve(spec, base) if spec.endswith(".py") else spec
    return _resolve(spec[: index + 3], base) + spec[index + 3 :]


def _resolve_weights(value: str, base: Path) -> str:
    """Resolve a weights *file*; keep a torchvision weights name (``DEFAULT``, ``X_Weights.V1``)."""
    return _resolve(value, base) if looks_like_weights_file(value, base) else value


#: The flag that names each path key on the command line, where the user's own choice may go anywhere.
PATH_FLAGS = {"output": "-o FILE", "watch.out": "--out FILE", "input": "--input FILE", "weights": "--weights FILE", "model": "MODEL",
              "baseline": "--baseline FILE", "data": "--data"}


def confine_write(path: Path, key: str, used: str) -> None:
    """A path a config makes hookcli *write* must lie inside the config's own directory tree (after
    symlinks and ``..``): a config may come from someone else's repository, and ``output =
    "~/.bashrc"`` must not replace a file of the user's. The command line's ``-o`` stays free."""
    root = os.path.realpath(path.parent)
    if not is_inside(os.path.expanduser(used), [root]):
        raise ConfigError(
            f"{path}: key {key!r} names {used!r}, outside the config's directory {root}; a config may only write "
            "files inside its own directory tree",
            hint=f"give a path under {root}, or pass {PATH_FLAGS.get(key, key)} on the command line")


def read_roots(path: Path) -> list[str]:
    """Where the files a config names may be read from: the config's directory tree and the working
    directory's (the repository being checked)."""
    return list(dict.fromkeys([os.path.realpath(path.parent), os.path.realpath(os.getcwd())]))


def confine_read(path: Path, key: str, used: str) -> None:
    """A file a config makes hookcli *read* (or import) must lie in the repository: the config's
    directory tree or the working directory's, after symlinks and ``..``. Reading elsewhere would
    put facts about the runner's other files in a public CI log, and ``--trust-pickle`` vouches for
    the repository's files, not for any file a config picks."""
    roots = read_roots(path)
    if not is_inside(os.path.expanduser(used), roots):
        raise ConfigError(
            f"{path}: key {key!r} names {used!r}, outside the config's directory and the working directory; a "
            "config may only name files of the repository it comes from",
            hint=f"move the file into the repository, or pass {PATH_FLAGS.get(key, key)} on the command line")
    leak = _link_out(os.path.expanduser(used), roots)
    if leak is not None:
        raise ConfigError(
            f"{path}: key {key!r} names the folder {used!r}, whose {leak!r} is a symlink leading outside the "
            "config's directory and the working directory; a config may only name files of the repository it "
            "comes from", hint=f"move the file into the repository, or pass {PATH_FLAGS.get(key, key)} on the "
                               "command line")


def _link_out(folder: str, roots: list[str]) -> str | None:
    """The first symlink inside the folder ``folder`` (any depth; its files are what a folder of images or a
    model directory reads) that leads outside ``roots``; None for a file, or a folder with none."""
    if not os.path.isdir(folder):
        return None
    for where, dirs, files in os.walk(folder):  # (followlinks=False: a linked folder is judged, not entered)
        for name in sorted(dirs + files):
            entry = os.path.join(where, name)
            if os.path.islink(entry) and not is_inside(entry, roots):
                return os.path.relpath(entry, folder)
    return None


def _confine_model(spec: str, path: Path, key: str = "model") -> None:
    """A config's model must be the repository's own code: a ``file.py`` inside it, an import path
    whose top-level package is found inside it (``numpy:load``, ``pickle:loads``, ``torch:load``
    and ``transformers:...`` are not), or an ``hf:DIR`` inside it. Judged before anything is
    imported; the loader checks what the attribute resolves to (``hookcli.engine.loading``)."""
    from hookcli.targets import import_target_module, module_locations

    text = spec.strip()
    source = source_of(text)
    if source.config == "any":
        return
    if source.config == "own folder":
        folder = strip_prefix(text, source)
        if folder and os.path.isdir(os.path.expanduser(folder)):
            confine_read(path, key, folder)
        return
    module = import_target_module(text) if source.config == "own module" else None
    if module is not None:
        roots = read_roots(path)
        outside = [w for w in module_locations(module) if w == "built-in" or not is_inside(w, roots)]
        if outside:
            where = outside[0]
            raise ConfigError(
                f"{path}: key {key!r} names {spec!r}, whose module {module.partition('.')[0]!r} is not the "
                f"repository's own code ({where}); refusing to import or call it from a config",
                hint=f"a config may name {_OWN[key]}; name any other code on the command line")
        return
    if source.config == "own file":
        confine_read(path, key, text.rpartition(":")[0].strip() if ":" in text else text)


#: What a config's code-naming key may name (``_confine_model``'s hint).
_OWN = {"model": "a model of its repository (pkg.mod:Net, net.py:build) or a torchvision, timm: or hf: model",
        "data": "a data set of its repository (a folder, a tensor file, pkg.mod:loader or data.py:loader)"}


def _confine_data(spec: str, path: Path) -> None:
    """A config's ``data`` is the repository's: a folder or tensor file inside it, or an import path of its
    own code, judged as a config's model is (``_confine_model``) before anything is imported."""
    from hookcli.targets import stdlib_target

    if ":" not in spec or os.path.exists(spec):
        confine_read(path, "data", spec)
        return
    found = stdlib_target(spec)
    if found is not None:
        raise ConfigError(f"{path}: key 'data' names {spec!r}, from Python's standard library ({found}), not a data "
                          "set; refusing to import it", hint=f"a config may name {_OWN['data']}")
    _confine_model(spec, path, "data")


def _refuse_stdlib_model(spec: str, path: Path) -> None:
    """A config's ``model`` naming Python's own module or file (``os:system``) is refused as the
    file is read, before anything is imported or called; the error names the file. (The loader
    checks again what any import path resolves to, for re-exports.)"""
    from hookcli.targets import OWN_CODE_HINT, stdlib_target

    found = stdlib_target(spec)
    if found is not None:
        raise ConfigError(f"{path}: key 'model' names {spec!r}, from Python's standard library ({found}), not a "
                          "model; refusing to import or call it", hint=OWN_CODE_HINT)


def _model_arg_names(model_args: dict[str, Any] | list[str] | tuple[()]) -> list[str]:
    """The keys of a config's ``model_args``: a table's keys, or the KEY of each ``"KEY=VALUE"``."""
    if isinstance(model_args, dict):
        return [str(k) for k in model_args]
    return [text.partition("=")[0].strip() for text in model_args]


def _validate(table: dict[str, Any], path: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The config's option values (checked against ``OPTION_KEYS``, paths resolved and confined), its
    raw ``[checks]`` table and its ``[watch]`` table; ConfigError naming ``path`` and the key for anything wrong."""
    _refuse_nul(table, path, "")
    table = dict(table)
    watch = _watch_table(table.pop("watch", {}), path)
    values, checks = _check_keys(table, path)
    _resolve_and_confine(values, path)
    return values, checks, watch


def _refuse_nul(value: Any, path: Path, key: str) -> None:
    """ConfigError naming the key of the first string (a value, or a key itself) anywhere in the config that
    holds a NUL byte: none is a file name, and a path with one fails deep in a run (``check_path_text``)."""
    if isinstance(value, str):
        check_path_text(value, f"{path}: key {key!r} =", ConfigError)
    elif isinstance(value, dict):
        for name, item in value.items():
            check_path_text(name, f"{path}: a key of [{key}]" if key else f"{path}: key", ConfigError)
            _refuse_nul(item, path, f"{key}.{name}" if key else name)
    elif isinstance(value, list):
        for item in value:
            _refuse_nul(item, path, key)


def _watch_table(table: Any, path: Path) -> dict[str, Any]:
    """``[watch]``: each key of ``WATCH_KEYS`` of its type; ``out`` resolved against the config's folder and
    confined to its tree (``confine_write``)."""
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [watch] must be a table, got {_type_name(table)}",
                          hint="write it as a [watch] section (every, out, layers, types, [watch.rules.<rule>])")
    watch: dict[str, Any] = {}
    for raw_key, value in table.items():
        key = normalize_key(raw_key)
        spec = WATCH_KEYS.get(key)
        if spec is None:
            near = did_you_mean(key, list(WATCH_KEYS))
            raise ConfigError(f"{path}: unknown key {raw_key!r} in [watch]" + (f" ({near})" if near else ""),
                              hint="valid keys: " + ", ".join(WATCH_KEYS))
        try:
            watch[key] = spec.validate(value)
        except Invalid:
            raise ConfigError(f"{path}: key 'watch.{raw_key}' expects {spec.expected}, got {describe_value(value)}",
                              hint=f"{raw_key}: {spec.description}") from None
    if "out" in watch:
        watch["out"] = _resolve(watch["out"], path.parent)
        confine_write(path, "watch.out", watch["out"])
    return watch


def _check_keys(table: dict[str, Any], path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each key known, given once and not command-line only, each value of its key's type."""
    values: dict[str, Any] = {}
    checks: dict[str, Any] = {}
    seen: dict[str, str] = {}
    known = list(OPTION_KEYS) + list(RAW_TABLES) + ["watch"]
    for raw_key, value in table.items():
        key = normalize_key(raw_key)
        if key in seen:
            raise ConfigError(f"{path}: key {raw_key!r} given twice (also as {seen[key]!r})",
                              hint="keep one spelling: '-' and '_' in keys mean the same")
        seen[key] = raw_key
        if key in RAW_TABLES:
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: [{raw_key}] must be a table, got {_type_name(value)}",
                                  hint=f"write it as a [{raw_key}] section with one key per rule")
            checks = value
            continue
        if key in CLI_ONLY_KEYS:
            raise ConfigError(
                f"{path}: key {raw_key!r} cannot be set in a config file; pass {CLI_ONLY_KEYS[key]} "
                "on the command line instead",
                hint="it runs code from files, and a config may come from someone else's repository")
        spec = OPTION_KEYS.get(key)
        if spec is None:
            hint = did_you_mean(key, known)
            msg = f"{path}: unknown key {raw_key!r}"
            raise ConfigError(msg + (f" ({hint})" if hint else ""),
                              hint="valid keys: " + ", ".join(known))
        try:
            values[key] = spec.validate(value)
        except Invalid:
            got = describe_value(value)
            raise ConfigError(
                f"{path}: key {raw_key!r} expects {spec.expected}, got {got}",
                hint=f"{raw_key}: {spec.description}") from None
    for name in _model_arg_names(values.get("model_args", ())):
        if name in CLI_ONLY_KEYS:  # model_args = { trust_remote_code = true } is the same opt-in
            raise ConfigError(
                f"{path}: model_args key {name!r} cannot be set in a config file; pass {CLI_ONLY_KEYS[name]} on the "
                "command line instead", hint="it runs code from files, and a config may come from someone else's "
                "repository")
    return values, checks


def _resolve_and_confine(values: dict[str, Any], path: Path) -> None:
    """Resolve the paths ``values`` name against the config's directory, in place, and refuse those a
    config may not name (``confine_read``, ``confine_write``, ``_confine_model``, ``_confine_data``)."""
    base = path.parent
    if "model" in values:
        values["model"] = _resolve_model(values["model"], base)
        _refuse_stdlib_model(values["model"], path)
        _confine_model(values["model"], path)
    if "data" in values:
        data = values["data"]
        values["data"] = _resolve_model(data, base) if ".py:" in data else data if ":" in data else _resolve(data, base)
        _confine_data(values["data"], path)
    if "weights" in values:
        values["weights"] = _resolve_weights(values["weights"], base)
        if looks_like_weights_file(values["weights"], base):
            confine_read(path, "weights", values["weights"])
    if "output" in values:
        values["output"] = _resolve(values["output"], base)
        confine_write(path, "output", values["output"])
    if "input" in values:
        values["input"] = [_resolve_input(v, base) for v in values["input"]]
        for value in values["input"]:
            match = _KEYWORD_INPUT.match(value)
            confine_read(path, "input", match.group(2) if match else value)


def load_config(
    path: str | os.PathLike[str] | None = None, *, cwd: str | os.PathLike[str] | None = None
) -> Config:
    """Read ``path`` (hookcli TOML or pyproject.toml), else ``[tool.hookcli]`` of ./pyproject.toml.

    Returns ``Config({}, None, "none", {})`` when no path is given and the working directory has no
    pyproject.toml with a ``[tool.hookcli]`` table. Raises ConfigError (naming the file) for a
    missing or unreadable file, TOML syntax errors, unknown keys, keys only the command line may
    set (``trust_pickle``) and values of the wrong type.
    List-valued options (``input``, ``input_shape``, ``layers``, ``types``) are always lists;
    ``model_args`` is a dict (from a table) or a list of ``"KEY=VALUE"`` strings (from an array).
    """
    base = Path(os.fspath(cwd)) if cwd is not None else Path.cwd()
    if path is not None:
        check_path_text(path, "config file", ConfigError)
        file = Path(os.fspath(path)).expanduser()
        file = (file if file.is_absolute() else base / file).resolve()
        data = _read_toml(file)
        if _is_pyproject(file, data):
            tool = data.get("tool", {})
            table = tool.get("hookcli") if isinstance(tool, dict) else None
            if not isinstance(table, dict):
                raise ConfigError(f"{file} has no [tool.hookcli] table",
                                  hint="add a [tool.hookcli] table, or give a hookcli TOML file")
            data = table
        values, checks, watch = _validate(data, file)
        return Config(values, file, "config", checks, watch)
    file = (base / "pyproject.toml").resolve()
    if not file.is_file():
        return Config({}, None, "none", {})
    data = _read_toml(file)
    tool = data.get("tool", {})
    table = tool.get("hookcli") if isinstance(tool, dict) else None
    if table is None:
        return Config({}, None, "none", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{file}: [tool.hookcli] must be a table",
                          hint="write it as a [tool.hookcli] section")
    values, checks, watch = _validate(table, file)
    return Config(values, file, "pyproject", checks, watch)


#: The config keys that are no flag's name: ``mode = "train" | "eval"`` sets ``--train/--eval``. Every
#: other key is the name of the flag it sets (``input_shape``: ``--input-shape``, ``all``: ``--all``;
#: ``model``: the MODEL argument; ``model_args``: ``--model-arg``, named like the option; ``width``:
#: ``--width``).
KEY_EXCEPTIONS: dict[str, tuple[str, Callable[[Any], Any]]] = {"mode": ("train", lambda mode: mode == Mode.train)}


def option_name(key: str, flags: Mapping[str, Sequence[str]]) -> str | None:
    """The option a config ``key`` sets: the one whose long flag (or name) is ``key``, ``-`` or ``_``.

    ``flags``: option name -> its flags (Click's declarations, or RunOptions' ``option_flags``).
    """
    key = normalize_key(key)
    for name, names in flags.items():
        if key == name or any(normalize_key(flag.lstrip("-")) == key for flag in names):
            return name
    return None


def option_keys(config: Config, flags: Mapping[str, Sequence[str]] | None = None) -> dict[str, str]:
    """Option name -> the config key that sets it, for the keys of ``config`` that set an option of
    ``flags`` (option name -> its flags: Click's declarations, or by default RunOptions' fields)."""
    if flags is None:
        flags = {name: (flag,) for name, flag in option_flags().items()}
    keys: dict[str, str] = {}
    for key in config.values:
        name = KEY_EXCEPTIONS[key][0] if key in KEY_EXCEPTIONS else option_name(key, flags)
        if name is not None and name in flags:
            keys[name] = key
    return keys


def config_options(config: Config, flags: Mapping[str, Sequence[str]] | None = None) -> dict[str, Any]:
    """The config's values keyed by the option each sets: the one function that reads a config's
    options, for the CLI (``flags`` from its Click parameters, giving Click's ``default_map``) and for
    the Python API (``flags`` None: RunOptions fields, each with the flag written beside it).

    ``mode`` becomes ``train``; a ``model_args`` array of ``"KEY=VALUE"`` strings is parsed as
    ``--model-arg`` parses them; keys that set no option of ``flags`` are left out.
    """
    from hookcli.options import parse_model_args

    options: dict[str, Any] = {}
    for name, key in option_keys(config, flags).items():
        value = config.values[key]
        options[name] = KEY_EXCEPTIONS[key][1](value) if key in KEY_EXCEPTIONS else value
    if isinstance(options.get("model_args"), list):
        options["model_args"] = parse_model_args(options["model_args"])
    return options
