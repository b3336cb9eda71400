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
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from hookcli.config import Invalid, boolean, describe_value, integer, number
from hookcli.errors import ConfigError, did_you_mean
from hookcli.options import values_of

SEVERITIES = ("error", "warn")

#: The pseudo-rule every check reports first: forward and backward ran without raising.
RUNS = "runs"

_COMMON = ("enabled", "severity")

#: The most SGD steps ``params_change`` takes (each is a forward and a backward of the model).
MAX_STEPS = 1000


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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


#: A rule's extra check of its merged settings: (settings, overrides, enabled, where, section) -> None,
#: raising ConfigError; it may normalise ``settings`` in place (a path resolved against the config).
Finish = Callable[[dict[str, Any], dict[str, dict[str, Any]], bool, str, str, "Path | None"], None]


@dataclass(frozen=True)
class RuleSpec:
    """Everything about one rule of ``[checks]``, in one place (issue #21 part 5).

    ``keys``: the keys its table accepts besides ``enabled``/``severity``, each with its validator
    (``ignore`` and ``overrides`` included); ``defaults``: ``enabled``, ``severity`` and every threshold;
    ``override_keys``: what an override may set (a bare number sets the first, unless
    ``table_overrides``); ``shorthands``: the key a non-table, non-bool entry of that type sets
    (``number`` for ``value`` when the rule has one); ``table_enables``: a table entry turns the rule on
    (a rule that is off until given); ``kind``: what ``ignore``/``overrides`` match, layer or parameter
    names; ``evaluator``: the function of ``check.rules`` (or ``check.probe_rules``) that evaluates it on plain
    data (named, so this module never imports the rules or torch); ``finish``: a check of the merged
    settings; ``default_doc``/``doc``/``offender``: its row of the table in docs/check.md (tested)."""

    name: str
    defaults: Mapping[str, Any]
    keys: Mapping[str, Callable[[Any], Any]]
    doc: str
    offender: str
    default_doc: str
    kind: str | None = None
    override_keys: tuple[str, ...] = ()
    table_overrides: bool = False
    shorthands: Mapping[type, str] = field(default_factory=dict)
    shorthand_doc: str = "a table, a boolean or a number"
    table_enables: bool = False
    evaluator: str = ""
    finish: Finish | None = None
    #: Evaluated on the training run of ``check --steps N`` (N > 0); SKIP without one.
    needs_steps: bool = False

    def doc_row(self) -> str:
        """Its row of the "Rules and defaults" table of docs/check.md."""
        return f"| `{self.name}` | {self.default_doc} | {self.doc} | {self.offender} |"


def _grad_norm_finish(settings: dict[str, Any], overrides: dict[str, dict[str, Any]], enabled: bool, where: str,
                      sub: str, base: Path | None) -> None:
    for pattern, limits in [("", settings), *overrides.items()]:
        lo, hi = {**settings, **limits}["min"], {**settings, **limits}["max"]
        if lo >= hi:
            label = f"override {pattern!r}" if pattern else "min/max"
            raise _fail(where, f"[{sub}] {label}: min ({lo:g}) must be below max ({hi:g})")


def _output_shape_finish(settings: dict[str, Any], overrides: dict[str, dict[str, Any]], enabled: bool, where: str,
                         sub: str, base: Path | None) -> None:
    if enabled and settings["value"] is None:
        raise _fail(where, f"[{sub}] needs 'value' (the expected output shape)")


def _baseline_finish(settings: dict[str, Any], overrides: dict[str, dict[str, Any]], enabled: bool, where: str,
                     sub: str, base: Path | None) -> None:
    if enabled and settings["file"] is None:
        raise _fail(where, f"[{sub}] needs 'file' (a JSON report: hookcli shapes MODEL -f json -o FILE)")
    if settings["file"] is not None:
        settings["file"] = _resolve(settings["file"], base)


_IGNORE = {"ignore": _patterns}
_OVERRIDES = {"overrides": dict}  # validated entry by entry (``_override``)

#: THE registry: every rule of ``[checks]``, in the order rows are shown. Each other list of rules
#: (``Rule``, ``DEFAULTS``, ``RULE_KEYS``, ``OVERRIDE_KEYS``, ``LAYER_RULES``, ``PARAM_RULES``, the
#: evaluators, the docs table) is derived from it or tested against it.
SPECS: tuple[RuleSpec, ...] = (
    RuleSpec(
        "finite", {"enabled": True, "severity": "error"}, {**_IGNORE}, kind="layer", evaluator="finite",
        default_doc="on, error",
        doc="a NaN/Inf in any activation, the model output, the loss, an output gradient, a parameter gradient or "
            "a parameter",
        offender="the **first layer in execution order** that output a non-finite value (by the order calls "
                 "*finish*, so a NaN made inside a `Sequential` names the inner layer, not the container); for "
                 "gradients only, the one backward reaches first"),
    RuleSpec(
        "output_shape", {"enabled": False, "severity": "error", "value": None}, {"value": _output_shape},
        shorthands={list: "value"}, shorthand_doc="a table, a boolean or a shape array", table_enables=True,
        evaluator="output_shape", finish=_output_shape_finish, default_doc="only when given, error",
        doc="the model's output shape(s) differ from `value`", offender="`(model)` + output path"),
    RuleSpec(
        "max_abs_activation", {"enabled": True, "severity": "warn", "value": 1e4},
        {"value": _positive, **_IGNORE, **_OVERRIDES}, kind="layer", override_keys=("value",),
        evaluator="max_abs_activation", default_doc="on, **warn**, `value = 1e4`",
        doc="an activation's `max(|min|, |max|)` exceeds `value`", offender="the layer with the largest ratio to its limit"),
    RuleSpec(
        "max_zero_fraction", {"enabled": True, "severity": "error", "value": 0.99},
        {"value": _fraction, **_IGNORE, **_OVERRIDES}, kind="layer", override_keys=("value",),
        evaluator="max_zero_fraction", default_doc="on, error, `value = 0.99`",
        doc="more than 99% of a layer's output is exactly zero (a dead layer)",
        offender="the most-zero layer (first in execution order on ties)"),
    RuleSpec(
        "dead_channels", {"enabled": True, "severity": "warn", "value": 0.5, "dim": "auto", "min_values": 16},
        {"value": _fraction, "dim": _dim, "min_values": integer(1), **_IGNORE, **_OVERRIDES}, kind="layer",
        override_keys=("value", "dim", "min_values"), evaluator="dead_channels",
        default_doc='on, **warn**, `value = 0.5`, `dim = "auto"`, `min_values = 16`',
        doc="more than half of a layer's channels are zero over the whole batch and every position",
        offender="the layer with the most dead channels"),
    RuleSpec(
        "grad_norm", {"enabled": True, "severity": "error", "min": 1e-12, "max": 1e4},
        {"min": _non_negative, "max": _positive, **_IGNORE, **_OVERRIDES}, kind="param",
        override_keys=("min", "max"), table_overrides=True, shorthand_doc="a table {min = ..., max = ...} or a boolean",
        evaluator="grad_norm", finish=_grad_norm_finish, default_doc="on, error, `min = 1e-12`, `max = 1e4`",
        doc="a trainable parameter's gradient norm is below `min` (vanishing; no gradient at all counts as 0) or "
            "above `max` (exploding); below `min` only behind a layer scale is no failure ([below](#layer-scale))",
        offender="the parameter furthest outside (or, passing, closest to) its range"),
    RuleSpec(
        "params_change", {"enabled": True, "severity": "error", "lr": 0.1, "steps": 1},
        {"lr": _positive, "steps": integer(1, MAX_STEPS), **_IGNORE}, kind="param", evaluator="params_change",
        default_doc="on, error, `lr = 0.1`, `steps = 1`",
        doc="a trainable parameter is bit-identical after `steps` SGD steps on a `copy.deepcopy` of the model (the "
            "torchtest check)",
        offender="the first unchanged parameter"),
    RuleSpec(
        "baseline", {"enabled": False, "severity": "error", "file": None}, {"file": _file, **_IGNORE}, kind="layer",
        shorthands={str: "file"}, shorthand_doc="a table, a boolean or a file name", table_enables=True,
        evaluator="baseline", finish=_baseline_finish, default_doc="only when given, error",
        doc="layers, output shapes, dtypes, parameter counts, model size or inputs differ from a saved JSON report",
        offender="the first difference; all are listed"),
)


#: The opt-in probe rules (``check/probes.py`` measures them with extra runs, ``check/probe_rules.py``
#: judges): off by default, turned on by ``check --steps N`` (``STEP_RULES``) or a config.
PROBE_SPECS: tuple[RuleSpec, ...] = (
    RuleSpec(
        "batch_independence", {"enabled": False, "severity": "error", "value": 1e-4}, {"value": _positive},
        evaluator="batch_independence", default_doc="off (on with `--steps`), error, `value = 1e-4`",
        doc="in eval mode, the gradient of sample i's output w.r.t. the other samples' input exceeds `value` times "
            "that w.r.t. its own ([probe rules](#probe-rules))",
        offender="the first module (in the order calls finish) whose output mixes the samples"),
    RuleSpec(
        "input_dependence", {"enabled": False, "severity": "error", "value": 1e-4}, {"value": _positive},
        evaluator="input_dependence", default_doc="off (on with `--steps`), error, `value = 1e-4`",
        doc="the loss with the first input zeroed differs from the real one by at most `value` (relative)",
        offender="`(model)`"),
    RuleSpec(
        "grad_accumulation", {"enabled": False, "severity": "error", "value": 1e-3}, {"value": _positive},
        evaluator="grad_accumulation", default_doc="off (on with `--steps`), error, `value = 1e-3`",
        doc="the mean of two half batches' parameter gradients differs from the full batch's by more than `value` "
            "of its norm",
        offender="the parameter that differs most"),
)


#: The rules of a check under ``torchrun`` (a process group of 2+ ranks: docs/distributed.md): on there
#: unless the table sets ``enabled`` (``CheckRules.for_ranks``); when enabled without one, SKIP.
RANK_SPECS: tuple[RuleSpec, ...] = (
    RuleSpec(
        "replica_desync", {"enabled": False, "severity": "error", "rtol": 1e-9},  # rtol: rank_stats.DESYNC_RTOL
        {"rtol": _positive, **_IGNORE}, kind="param", evaluator="replica_desync",
        default_doc="under torchrun, error, `rtol = 1e-9`",
        doc="a parameter's values, or the `.grad` it holds, differ between the data-parallel replicas (ranks) by more "
            "than `rtol` relative ([under torchrun](distributed.md#hookclicheck-under-torchrun))",
        offender="the parameter and the highest rank whose copy differs from rank 0's"),
)


def _lrs(value: Any) -> list[float]:
    if isinstance(value, list) and value and len(value) <= 8:
        try:
            return [_positive(v) for v in value]
        except Invalid:
            pass
    raise Invalid("an array of 1 to 8 finite learning rates > 0")


def _init_loss_finish(settings: dict[str, Any], overrides: dict[str, dict[str, Any]], enabled: bool, where: str,
                      sub: str, base: Path | None) -> None:
    if settings["min"] >= settings["max"]:
        raise _fail(where, f"[{sub}] min ({settings['min']:g}) must be below max ({settings['max']:g})")


#: The rules of ``check --steps N`` (N > 0): a training run of N optimiser steps on a copy of the model.
TRAINING_SPECS: tuple[RuleSpec, ...] = (
    RuleSpec(
        "init_loss", {"enabled": False, "severity": "error", "min": 0.5, "max": 1.5},
        {"min": _positive, "max": _positive}, evaluator="init_loss", finish=_init_loss_finish, needs_steps=True,
        shorthand_doc="a table {min = ..., max = ...} or a boolean", default_doc="with `--steps`, error, "
        "`min = 0.5`, `max = 1.5`",
        doc="the first step's loss is outside [`min`, `max`] × chance (ln C for a C-class cross-entropy, ln V per "
            "token for language-model logits), or the logits the cross-entropy gets are probabilities (a softmax "
            "before the loss); SKIP when hookcli does not know the task",
        offender="the module that makes the model output"),
    RuleSpec(
        "overfit_batch", {"enabled": False, "severity": "error", "fraction": 0.5, "lrs": [1e-4, 1e-3, 1e-2]},
        {"fraction": number(0, 1, low_open=True), "lrs": _lrs}, evaluator="overfit_batch", needs_steps=True,
        shorthand_doc="a table {fraction = ..., lrs = [...]} or a boolean",
        default_doc="with `--steps`, error, `fraction = 0.5`, `lrs = [1e-4, 1e-3, 1e-2]`",
        doc="the loss on the fixed batch does not fall by `fraction` of its first value within the N steps (Adam at "
            "the best of `lrs` by a 5-step sweep, or your optimiser); SKIP below 10 steps",
        offender="the module that makes the model output"),
    RuleSpec(
        "params_update", {"enabled": False, "severity": "error"}, {**_IGNORE}, kind="param",
        evaluator="params_update", needs_steps=True, default_doc="with `--steps`, error",
        doc="a trainable parameter gets no gradient, a NaN/Inf or an all-zero one, or does not change in the N "
            "steps; requires grad but is not in your optimiser, or is in it but does not require grad; does "
            "not require grad but changed",
        offender="the parameter"),
    RuleSpec(
        "determinism", {"enabled": False, "severity": "error"}, {}, evaluator="determinism", needs_steps=True,
        default_doc="with `--steps`, error",
        doc="two runs seeded alike give different losses in their first (up to 5) steps",
        offender="the first module whose output differs between two seeded forward passes"),
    RuleSpec(
        "residual_growth", {"enabled": False, "severity": "error", "value": 1.8, "min_blocks": 3},
        {"value": number(1, low_open=True), "min_blocks": integer(2), **_IGNORE}, kind="layer",
        evaluator="residual_growth", needs_steps=True,
        default_doc="with `--steps`, error, `value = 1.8`, `min_blocks = 3`",
        doc="at some step, the RMS of the input of every block of a repeated stack (`min_blocks`+ consecutive "
            "children of one class with one input shape in a `ModuleList`/`Sequential`), and of the final norm "
            "after it, is more than `value` times the previous one's: a residual stream multiplied at every "
            "block ([between modules](#between-modules))",
        offender="the stack's last block, and the first step"),
    RuleSpec(
        "dead_units", {"enabled": False, "severity": "error", "value": 0.5, "min_values": 16},
        {"value": _fraction, "min_values": integer(1), **_IGNORE, **_OVERRIDES}, kind="layer",
        override_keys=("value", "min_values"), evaluator="dead_units", needs_steps=True,
        default_doc="with `--steps`, error, `value = 0.5`, `min_values = 16`",
        doc="more than `value` of a `Linear`/`Conv` layer's output channels are <= 0 on every sample and "
            "position of every step and their weights never get a gradient: units dead behind a ReLU, also a "
            "functional `F.relu` (layers with fewer than `min_values` values per channel are not judged)",
        offender="the layer with the most dead units"),
    RuleSpec(
        "target_leak", {"enabled": False, "severity": "error", "fraction": 0.5, "batches": 2},
        {"fraction": number(0, 1, low_open=True), "batches": integer(1, 8)}, evaluator="target_leak",
        needs_steps=True, shorthand_doc="a table {fraction = ..., batches = ...} or a boolean",
        default_doc="with `--steps`, error, `fraction = 0.5`, `batches = 2`",
        doc="after the N steps, the mean loss on `batches` fresh batches (the same input builder, seeds "
            "`seed + 1`, ...) is below `fraction` × chance (ln V for next-token targets or the model's own loss "
            "beside `logits`): the targets reach the inputs (unshifted language-model targets); SKIP when the "
            "targets are not made from the inputs or the inputs are not generated",
        offender="the module that makes the model output"),
)
#: The rules ``check --steps N`` (N > 0) turns on unless the config sets their ``enabled``: these seven,
#: and part B's opt-in rules (a name without a spec yet is skipped: ``CheckRules.for_steps``).
STEP_RULES: tuple[str, ...] = ("init_loss", "overfit_batch", "params_update", "determinism",
                               "residual_growth", "dead_units", "target_leak",
                               "batch_independence", "input_dependence", "grad_accumulation")
SPECS = SPECS + TRAINING_SPECS + PROBE_SPECS + RANK_SPECS
SPEC: dict[str, RuleSpec] = {spec.name: spec for spec in SPECS}

#: The rules of ``[checks]`` (members are their names; ``RUNS`` is the pseudo-rule every check has).
Rule = StrEnum("Rule", [(spec.name, spec.name) for spec in SPECS])  # type: ignore[misc]
RULES: tuple[str, ...] = values_of(Rule)
#: Every rule with its default settings. ``enabled`` False: off unless the config mentions it.
DEFAULTS: dict[str, dict[str, Any]] = {spec.name: dict(spec.defaults) for spec in SPECS}
#: Rules that read layers (ignore/overrides match layer names) or parameters (parameter names).
LAYER_RULES = tuple(spec.name for spec in SPECS if spec.kind == "layer")
PARAM_RULES = tuple(spec.name for spec in SPECS if spec.kind == "param")
#: Keys each rule's table accepts (besides ``enabled`` and ``severity``).
RULE_KEYS: dict[str, tuple[str, ...]] = {spec.name: tuple(spec.keys) for spec in SPECS}
#: Keys an override may set (a bare number sets the first one; grad_norm needs a table).
OVERRIDE_KEYS: dict[str, tuple[str, ...]] = {spec.name: spec.override_keys for spec in SPECS if spec.override_keys}
_KEY_VALIDATORS: dict[str, Callable[[Any], Any]] = {"enabled": boolean, "severity": _severity}


def _validator(rule: str, key: str) -> Callable[[Any], Any]:
    return _KEY_VALIDATORS.get(key) or SPEC[rule].keys[key]


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
    #: Rules whose ``enabled`` the table set (explicitly or by a shorthand): ``for_steps`` leaves them be.
    chosen: frozenset[str] = frozenset()

    def enabled(self) -> list[RuleConfig]:
        return [r for r in self.rules.values() if r.enabled]

    def for_steps(self, steps: int) -> CheckRules:
        """The rules of ``check --steps N``: with N > 0 every rule of ``STEP_RULES`` that has a spec is
        on unless the table set its ``enabled``, and ``params_change`` (one SGD step) is off unless
        the table set it, as ``params_update`` over the N steps supersedes it."""
        if steps <= 0:
            return self
        rules = dict(self.rules)
        for name in STEP_RULES:
            if name in rules and name not in self.chosen:
                rules[name] = replace(rules[name], enabled=True)
        if "params_change" not in self.chosen and rules["params_update"].enabled:
            rules["params_change"] = replace(rules["params_change"], enabled=False)
        return replace(self, rules=rules)

    def for_ranks(self, ranks: bool) -> CheckRules:
        """The rules of a check under ``torchrun`` (``ranks``: a process group of 2+ ranks): the
        ``RANK_SPECS`` rules are on unless the table set their ``enabled``."""
        if not ranks:
            return self
        rules = dict(self.rules)
        for spec in RANK_SPECS:
            if spec.name not in self.chosen:
                rules[spec.name] = replace(rules[spec.name], enabled=True)
        return replace(self, rules=rules)

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
    spec = SPEC[rule]
    if isinstance(raw, dict):
        table = dict(raw)
        if spec.table_enables and "enabled" not in table:
            table["enabled"] = True
        return table
    if isinstance(raw, bool):
        return {"enabled": raw}
    for kind, key in spec.shorthands.items():
        if isinstance(raw, kind):
            return {"enabled": True, key: raw}
    if _number(raw) and "value" in spec.keys:
        return {"enabled": True, "value": raw}
    raise _fail(where, f"[{section}] {rule!r} expects {spec.shorthand_doc}, got {describe_value(raw)}")


def _override(rule: str, pattern: str, raw: Any, where: str, section: str) -> dict[str, Any]:
    keys, needs_table = SPEC[rule].override_keys, SPEC[rule].table_overrides
    if _number(raw) and not needs_table:
        return {keys[0]: _check_value(where, section, f"overrides.{pattern}", raw, _validator(rule, keys[0]))}
    if not isinstance(raw, dict):
        expected = "a table of " + ", ".join(keys) if needs_table else f"a number or a table of {', '.join(keys)}"
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
    chosen: set[str] = set()
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
                    chosen.add(name)
                elif key == "severity":
                    severity = checked
                elif key == "ignore":
                    ignore = checked
                else:
                    settings[key] = checked
        finish = SPEC[name].finish
        if finish is not None:
            finish(settings, overrides, enabled, where, sub, base)
        rules[name] = RuleConfig(name, enabled, severity, settings, ignore, overrides)
    return CheckRules(rules, where, frozenset(chosen))


__all__ = ["DEFAULTS", "RULES", "RUNS", "SEVERITIES", "SPECS", "CheckRules", "RuleConfig", "RuleSpec", "parse_checks"]
