"""The ``[checks]`` table of ``hookcli check``: rule names, defaults, a strict schema, overrides.

Never imports torch. ``parse_checks(table, source=...)`` validates a raw table (from TOML or from a
Python dict) up front: unknown rules or keys and values of the wrong type raise ConfigError (exit 2)
naming the key and the file. Rules that are not mentioned keep their defaults (``DEFAULTS``).

Each rule is a sub-table, or a shorthand on the ``[checks]`` line itself::

    [checks]
    finite = true                      # bool: enable/disable with the default thresholds
    max_abs_activation = 1e3           # number: the rule's ``value``
    output_shape = [1, 1000]           # array: output_shape's ``value``
    baseline = "resnet18_baseline.json"  # string: baseline's ``file``

    [checks.grad_norm]
    min = 1e-12
    max = 1e4
    severity = "error"                 # "error" fails the run, "warn" reports only
    ignore = ["*.bn*"]                 # names or globs the rule skips
    overrides = { "fc" = { max = 1e5 } }

Override keys and ``ignore`` entries are matched against layer names (``layer4.0.relu``; the model
itself is ``(model)``) or parameter names (``fc.weight``; a pattern also matches a parameter through
its module's name, so ``fc`` covers ``fc.weight`` and ``fc.bias``). ``*`` also matches dots.
An exact name wins over globs; among globs the first one written wins.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from hookcli.config import Invalid, boolean, describe_value, integer, number
from hookcli.errors import ConfigError, did_you_mean
from hookcli.options import values_of

SEVERITIES = ("error", "warn")

class Rule(StrEnum):
    """The rules of ``[checks]`` (members are their names; ``RUNS`` is the pseudo-rule every check has)."""

    finite = "finite"
    output_shape = "output_shape"
    max_abs_activation = "max_abs_activation"
    max_zero_fraction = "max_zero_fraction"
    dead_channels = "dead_channels"
    grad_norm = "grad_norm"
    params_change = "params_change"
    baseline = "baseline"
    # probe rules (off by default; hookcli.commands.check.probes measures, probe_rules judges)
    batch_independence = "batch_independence"
    input_dependence = "input_dependence"
    grad_accumulation = "grad_accumulation"


#: Every rule with its default settings. ``enabled`` False: off unless the config mentions it.
DEFAULTS: dict[str, dict[str, Any]] = {
    Rule.finite: {"enabled": True, "severity": "error"},
    Rule.output_shape: {"enabled": False, "severity": "error", "value": None},
    Rule.max_abs_activation: {"enabled": True, "severity": "warn", "value": 1e4},
    Rule.max_zero_fraction: {"enabled": True, "severity": "error", "value": 0.99},
    Rule.dead_channels: {"enabled": True, "severity": "warn", "value": 0.5, "dim": "auto", "min_values": 16},
    Rule.grad_norm: {"enabled": True, "severity": "error", "min": 1e-12, "max": 1e4},
    Rule.params_change: {"enabled": True, "severity": "error", "lr": 0.1, "steps": 1},
    Rule.baseline: {"enabled": False, "severity": "error", "file": None},
    # value: the largest cross-sample gradient, relative to the sample's own
    Rule.batch_independence: {"enabled": False, "severity": "error", "value": 1e-4},
    # value: the smallest relative change of the loss when the input is zeroed
    Rule.input_dependence: {"enabled": False, "severity": "error", "value": 1e-4},
    # value: the largest relative difference of accumulated half-batch gradients from the full batch's
    Rule.grad_accumulation: {"enabled": False, "severity": "error", "value": 1e-3},
}
RULES: tuple[str, ...] = values_of(Rule)
#: The pseudo-rule every check reports first: forward and backward ran without raising.
RUNS = "runs"

#: Rules that read layers (ignore/overrides match layer names) or parameters (parameter names).
LAYER_RULES = (Rule.finite, Rule.max_abs_activation, Rule.max_zero_fraction, Rule.dead_channels, Rule.baseline)
PARAM_RULES = (Rule.grad_norm, Rule.params_change)

_COMMON = ("enabled", "severity")
#: Keys each rule's table accepts (besides ``enabled`` and ``severity``).
RULE_KEYS: dict[str, tuple[str, ...]] = {
    "finite": ("ignore",),
    "output_shape": ("value",),
    "max_abs_activation": ("value", "ignore", "overrides"),
    "max_zero_fraction": ("value", "ignore", "overrides"),
    "dead_channels": ("value", "dim", "min_values", "ignore", "overrides"),
    "grad_norm": ("min", "max", "ignore", "overrides"),
    "params_change": ("lr", "steps", "ignore"),
    "baseline": ("file", "ignore"),
    "batch_independence": ("value",),
    "input_dependence": ("value",),
    "grad_accumulation": ("value",),
}
#: Keys an override may set (a bare number sets the first one; grad_norm needs a table).
OVERRIDE_KEYS: dict[str, tuple[str, ...]] = {
    "max_abs_activation": ("value",),
    "max_zero_fraction": ("value",),
    "dead_channels": ("value", "dim", "min_values"),
    "grad_norm": ("min", "max"),
}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


#: The most SGD steps ``params_change`` takes (each is a forward and a backward of the model).
MAX_STEPS = 1000
#: The numeric thresholds, each through ``number``: finite (``inf`` would make a failing gate pass)
#: and in range.
_positive = number(0, low_open=True)
_non_negative = number(0)
_fraction = number(0, 1)


def _severity(value: Any) -> str:
    if value not in SEVERITIES:
        raise Invalid('"error" or "warn"')
    return str(value)


def _patterns(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) and v for v in value):
        return list(value)
    raise Invalid("a name/glob or an array of them")


def _shape(value: Any) -> list[int]:
    if isinstance(value, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= -1 for d in value):
        return [int(d) for d in value]
    raise Invalid("a shape (array of integers, -1 for any size)")


_SHAPES = "a shape like [1, 1000], an array of shapes, or a table of shapes keyed by output path"


def _output_shape(value: Any) -> list[int] | list[list[int]] | dict[str, list[int]]:
    try:
        if isinstance(value, dict) and value:
            return {str(k): _shape(v) for k, v in value.items()}
        if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
            return [_shape(v) for v in value]
        return _shape(value)
    except Invalid:
        raise Invalid(_SHAPES) from None


def _dim(value: Any) -> int | str:
    if value == "auto":
        return "auto"
    try:
        return integer(None)(value)
    except Invalid:
        raise Invalid('"auto" or an integer (1 for [B, C, ...], -1 for [B, T, C])') from None


def _file(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise Invalid("a file path (string)")
    return value


VALIDATORS: dict[str, Callable[[Any], Any]] = {
    "enabled": boolean,
    "severity": _severity,
    "ignore": _patterns,
    "min": _non_negative,
    "max": _positive,
    "lr": _positive,
    "steps": integer(1, MAX_STEPS),
    "dim": _dim,
    "min_values": integer(1),
    "file": _file,
}
VALUE_VALIDATORS: dict[str, Callable[[Any], Any]] = {
    "output_shape": _output_shape,
    "max_abs_activation": _positive,
    "max_zero_fraction": _fraction,
    "dead_channels": _fraction,
    "batch_independence": _positive,
    "input_dependence": _positive,
    "grad_accumulation": _positive,
}


def _validator(rule: str, key: str) -> Callable[[Any], Any]:
    return VALUE_VALIDATORS[rule] if key == "value" else VALIDATORS[key]


@dataclass
class RuleConfig:
    """One rule's validated settings: thresholds in ``settings``, plus ignore and overrides."""

    name: str
    enabled: bool
    severity: str
    settings: dict[str, Any]
    ignore: list[str] = field(default_factory=list)
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    used_patterns: set[str] = field(default_factory=set, repr=False, compare=False)

    def __getitem__(self, key: str) -> Any:
        return self.settings[key]

    def _matches(self, pattern: str, name: str, kind: str) -> bool:
        names = [name or "(model)"]
        if kind == "param" and "." in name:
            names.append(name.rsplit(".", 1)[0])
        return any(pattern == n or fnmatch.fnmatchcase(n, pattern) for n in names)

    def ignored(self, name: str, kind: str = "layer") -> bool:
        """True when ``name`` matches an ``ignore`` pattern."""
        for pattern in self.ignore:
            if self._matches(pattern, name, kind):
                self.used_patterns.add(f"ignore:{pattern}")
                return True
        return False

    def limits(self, name: str, kind: str = "layer") -> dict[str, Any]:
        """The settings for ``name``: the rule's, updated by the override that matches it."""
        label = name or "(model)"
        chosen = next((p for p in self.overrides if p == label), None)
        if chosen is None and kind == "param" and "." in name:
            chosen = next((p for p in self.overrides if p == name.rsplit(".", 1)[0]), None)
        if chosen is None:
            chosen = next((p for p in self.overrides if self._matches(p, name, kind)), None)
        if chosen is None:
            return self.settings
        self.used_patterns.add(f"overrides:{chosen}")
        return {**self.settings, **self.overrides[chosen]}

    def unused_patterns(self) -> list[str]:
        """``ignore``/``overrides`` entries that matched nothing (likely typos)."""
        keys = [f"ignore:{p}" for p in self.ignore] + [f"overrides:{p}" for p in self.overrides]
        return [k for k in keys if k not in self.used_patterns]


@dataclass
class CheckRules:
    """Every rule's settings (enabled or not) and where they came from."""

    rules: dict[str, RuleConfig]
    source: str  # the config file, or "checks" for a Python dict

    def enabled(self) -> list[RuleConfig]:
        return [r for r in self.rules.values() if r.enabled]

    def get(self, name: str) -> RuleConfig | None:
        """The rule's config when it is enabled, else None."""
        rule = self.rules.get(name)
        return rule if rule is not None and rule.enabled else None


def _fail(where: str, message: str, hint: str | None = None) -> ConfigError:
    return ConfigError(f"{where}: {message}", hint=hint)


def _check_value(where: str, section: str, key: str, value: Any, validate: Callable[[Any], Any]) -> Any:
    try:
        return validate(value)
    except Invalid as exc:
        raise _fail(where, f"[{section}] key {key!r} expects {exc.expected}, got {describe_value(value)}") from None


def _unknown(where: str, section: str, key: str, known: list[str]) -> ConfigError:
    hint = did_you_mean(key, known)
    valid = "valid keys: " + ", ".join(known)
    if section.endswith("output_shape"):
        valid += "; shapes keyed by output path go under value, e.g. value = { out = [1, 21, 64, 64] }"
    return _fail(where, f"[{section}] unknown key {key!r}" + (f" ({hint})" if hint else ""), hint=valid)


def _expand(rule: str, raw: Any, where: str, section: str) -> dict[str, Any]:
    """A rule's entry as a table: shorthands (bool, number, array, string) become their key."""
    if isinstance(raw, dict):
        table = dict(raw)
        if rule in ("output_shape", "baseline") and "enabled" not in table:
            table["enabled"] = True
        return table
    if isinstance(raw, bool):
        return {"enabled": raw}
    if rule == "output_shape" and isinstance(raw, list):
        return {"enabled": True, "value": raw}
    if rule == "baseline" and isinstance(raw, str):
        return {"enabled": True, "file": raw}
    if _number(raw) and "value" in RULE_KEYS[rule]:
        return {"enabled": True, "value": raw}
    shorthand = {"output_shape": "a table, a boolean or a shape array", "baseline": "a table, a boolean or a file name",
                 "grad_norm": "a table {min = ..., max = ...} or a boolean"}.get(rule, "a table, a boolean or a number")
    raise _fail(where, f"[{section}] {rule!r} expects {shorthand}, got {describe_value(raw)}")


def _override(rule: str, pattern: str, raw: Any, where: str, section: str) -> dict[str, Any]:
    keys = OVERRIDE_KEYS[rule]
    if _number(raw) and rule != "grad_norm":
        return {keys[0]: _check_value(where, section, f"overrides.{pattern}", raw, _validator(rule, keys[0]))}
    if not isinstance(raw, dict):
        expected = "a table of " + ", ".join(keys) if rule == "grad_norm" else f"a number or a table of {', '.join(keys)}"
        raise _fail(where, f"[{section}] override {pattern!r} expects {expected}, got {describe_value(raw)}")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in keys:
            raise _unknown(where, f"{section}.overrides.{pattern}", key, list(keys))
        out[key] = _check_value(where, f"{section}.overrides", f"{pattern}.{key}", value, _validator(rule, key))
    return out


def _resolve(path: str, base: Path | None) -> str:
    p = Path(path).expanduser()
    if not p.is_absolute() and base is not None:
        p = base / p
    return os.fspath(p)


def parse_checks(
    table: Mapping[str, Any] | None,
    *,
    source: str | os.PathLike[str] | None = None,
    base_dir: str | os.PathLike[str] | None = None,
    section: str = "checks",
) -> CheckRules:
    """Validate a raw ``[checks]`` table and merge it over the defaults.

    ``source`` names the file in error messages (``"checks"`` for a Python dict); relative
    ``baseline`` files are resolved against ``base_dir`` (the config file's directory), else the
    working directory. Raises ConfigError for unknown rules/keys, wrong types and bad ranges.
    """
    where = os.fspath(source) if source is not None else "checks"
    base = Path(os.fspath(base_dir)) if base_dir is not None else None
    if table is not None and not isinstance(table, Mapping):
        raise _fail(where, f"[{section}] must be a table, got {describe_value(table)}")
    rules: dict[str, RuleConfig] = {}
    given = dict(table or {})
    for name in given:
        if name not in DEFAULTS:
            hint = did_you_mean(name, RULES)
            raise _fail(where, f"unknown check {name!r} in [{section}]" + (f" ({hint})" if hint else ""),
                        hint="checks: " + ", ".join(RULES))
    for name, defaults in DEFAULTS.items():
        sub = f"{section}.{name}"
        settings = {k: v for k, v in defaults.items() if k not in _COMMON}
        enabled, severity = defaults["enabled"], defaults["severity"]
        ignore: list[str] = []
        overrides: dict[str, dict[str, Any]] = {}
        if name in given:
            entry = _expand(name, given[name], where, section)
            known = list(_COMMON + RULE_KEYS[name])
            for key, value in entry.items():
                if key not in known:
                    raise _unknown(where, sub, key, known)
                if key == "overrides":
                    if not isinstance(value, dict):
                        raise _fail(where, f"[{sub}] key 'overrides' expects a table of name/glob = "
                                           f"threshold, got {describe_value(value)}")
                    overrides = {str(p): _override(name, str(p), v, where, sub) for p, v in value.items()}
                    continue
                checked = _check_value(where, sub, key, value, _validator(name, key))
                if key == "enabled":
                    enabled = checked
                elif key == "severity":
                    severity = checked
                elif key == "ignore":
                    ignore = checked
                else:
                    settings[key] = checked
        if name == "grad_norm":
            for pattern, limits in [("", settings), *overrides.items()]:
                lo, hi = {**settings, **limits}["min"], {**settings, **limits}["max"]
                if lo >= hi:
                    label = f"override {pattern!r}" if pattern else "min/max"
                    raise _fail(where, f"[{sub}] {label}: min ({lo:g}) must be below max ({hi:g})")
        if enabled and name == "output_shape" and settings["value"] is None:
            raise _fail(where, f"[{sub}] needs 'value' (the expected output shape)")
        if enabled and name == "baseline" and settings["file"] is None:
            raise _fail(where, f"[{sub}] needs 'file' (a JSON report: hookcli shapes MODEL -f json -o FILE)")
        if name == "baseline" and settings["file"] is not None:
            settings["file"] = _resolve(settings["file"], base)
        rules[name] = RuleConfig(name, enabled, severity, settings, ignore, overrides)
    return CheckRules(rules, where)


__all__ = ["DEFAULTS", "RULES", "RUNS", "SEVERITIES", "CheckRules", "RuleConfig", "parse_checks"]
