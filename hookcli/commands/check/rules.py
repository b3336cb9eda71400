"""Evaluate ``hookcli check`` rules on plain data: the run's Report plus a few extra measurements.

Never imports torch: ``hookcli.commands.check.run`` runs the model and hands over a :class:`Observations`;
every rule here reads only records and Python values, so rules are easy to test and to reason about.
Each rule returns a RuleResult naming its worst offender (or, when it passes, the layer/parameter
closest to its limit) and every violation.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hookcli.commands.check import probe_rules
from hookcli.commands.check.schema import RUNS, SPECS, CheckRules, RuleConfig
from hookcli.errors import ConfigError, one_line
from hookcli.limits import TEXT_BYTES, read_capped
from hookcli.options import output_key_path
from hookcli.records import LayerRecord, Report, RuleResult

LayerKey = tuple[str, int]
TensorKey = tuple[str, int, str]


@dataclass
class Observations:
    """What the check run measured beyond the Report (plain Python values)."""

    #: (module name, call) -> position in forward *completion* order (children finish before parents).
    order: dict[LayerKey, int] = field(default_factory=dict)
    #: The model's output tensors: ``{"path", "shape", "dtype", "nonfinite"}``.
    outputs: list[dict[str, Any]] = field(default_factory=list)
    #: (name, call, output path) -> (dead channels, channels, values per channel, the channel dimension).
    channels: dict[TensorKey, tuple[int, int, int, int]] = field(default_factory=dict)
    #: (name, call, output path) -> (the configured dead_channels dim, the output's number of dims), for outputs
    #: (2+ dims) that have no such dim: not judged.
    out_of_range: dict[TensorKey, tuple[int, int]] = field(default_factory=dict)
    #: parameter -> largest absolute change after the SGD step(s); None: it got no gradient.
    changes: dict[str, float | None] | None = None
    change_error: str | None = None
    baseline: dict[str, Any] | None = None
    #: (name, call, output path) of float outputs that do not require grad: constants (masks, zero
    #: position biases), computed from no parameter and not from the input; never "dead".
    constant: set[TensorKey] = field(default_factory=set)
    #: The same measurements on a copy of the model after one SGD step (the second look), or None.
    stepped: tuple[Report, Observations] | None = None
    #: parameter -> its gradient norm after the second look's small step, for parameters
    #: ``params_change`` saw unchanged without a gradient to move them (nonzero: held by their init).
    grace: dict[str, float | None] = field(default_factory=dict)
    #: parameter -> the largest |gradient| the params_change steps gave it.
    grad_max: dict[str, float] = field(default_factory=dict)
    #: grad_norm's lifted look: the report of a copy whose ``layer_scales`` (tiny-initialised
    #: per-channel parameters) are set to 1, or None when no gradient was below ``min``.
    lifted: Report | None = None
    layer_scales: list[str] = field(default_factory=list)
    #: The probe rules' measurements (``hookcli.commands.check.probes``): rule name -> plain values.
    probes: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: What the training run of ``check --steps N`` measured (None: no --steps).
    training: Training | None = None
    #: Under ``torchrun`` (``check/ranks.py``): ``{"world", "compared", "desync"}``, the parameters compared
    #: across the ranks and each desync as (parameter, "value" or "gradient", rank); None without a process group.
    replicas: dict[str, Any] | None = None


@dataclass
class ParamTrace:
    """One parameter over the N steps of ``check --steps N`` (on a copy of the model)."""

    requires_grad: bool
    #: In the optimiser's parameter groups (hookcli's optimiser holds every trainable parameter).
    in_optimiser: bool
    #: Steps that gave it a ``.grad``; the largest |gradient| over them (NaN/Inf: a non-finite one).
    grad_steps: int = 0
    grad_max: float = 0.0
    #: Largest absolute change of its values from before the first step to after the last.
    change: float = 0.0
    #: Its dtype's name ("float32", "bfloat16"): an update too small for a 16-bit float rounds away.
    dtype: str = "float32"
    #: Its values were NaN/Inf at a backward before any of its gradients was: an optimiser step made them.
    values_first: bool = False


@dataclass
class Training:
    """What the training run of ``check --steps N`` measured, as plain values (``check/steps.py``)."""

    steps: int
    #: The optimiser in words ("Adam, lr 0.001 (best of a 5-step sweep over ...)" or "yours: SGD").
    optimiser: str
    #: The loss before each of the N steps, on the same fixed batch.
    losses: list[float] = field(default_factory=list)
    #: (lr, lowest loss in its sweep steps) for hookcli's learning-rate sweep; empty with your optimiser.
    sweep: list[tuple[float, float]] = field(default_factory=list)
    #: The losses of a second run seeded alike (the first ``len(repeat)`` steps).
    repeat: list[float] = field(default_factory=list)
    #: The first module (completion order) whose output differs between two seeded forward passes.
    differs: str | None = None
    #: The task hookcli knows (e.g. "10-class cross-entropy") and its chance loss, or why it does not.
    task: str | None = None
    chance: float | None = None
    no_task: str | None = None
    #: The cross-entropy's logits are probabilities (non-negative, summing to 1): a softmax before the loss.
    probabilities: bool = False
    #: The module whose output is the model output the loss reads (the last to finish with that shape).
    producer: str | None = None
    params: dict[str, ParamTrace] = field(default_factory=dict)
    #: What lives between modules (``check.between``): stack inputs, dead units, fresh-batch losses.
    between: dict[str, Any] | None = None
    #: Why the training run failed (the model raised on the copy), the module blamed, and the rule
    #: that reports it (the first training rule enabled; the others SKIP), or None.
    error: str | None = None
    error_where: str | None = None
    error_rule: str | None = None
    #: Why there was nothing to train (no trainable parameter), or None: the training rules SKIP.
    skip: str | None = None


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.4g}" if math.isfinite(x) else str(x)


def _shape(s: Any) -> str:
    return "[" + ", ".join(str(d) for d in s) + "]" if isinstance(s, list) else str(s)


def _violation(where: str, value: Any, limit: Any, message: str) -> dict[str, Any]:
    return {"where": where, "value": value, "limit": limit, "message": message}


def _result(rule: RuleConfig, violations: list[dict[str, Any]], *, ok_where: str | None = None,
            ok_value: Any = None, limit: Any = None, ok_message: str, fail_message: str = "") -> RuleResult:
    """PASS (naming the offender closest to the limit), or FAIL/WARN by severity.

    A violation may carry ``"severity": "warn"`` (a parameter never called): it WARNs even under an
    ``error`` rule; the result FAILs when any violation is an error, naming the first error first.
    """
    if not violations:
        return RuleResult(rule.name, "PASS", rule.severity, ok_message, ok_where, ok_value, limit)
    if rule.severity == "error":
        violations = ([v for v in violations if v.get("severity", "error") == "error"]
                      + [v for v in violations if v.get("severity", "error") != "error"])
    first = violations[0]
    more = f" (+{len(violations) - 1} more)" if len(violations) > 1 and not fail_message else ""
    status = "FAIL" if rule.severity == "error" and first.get("severity", "error") == "error" else "WARN"
    return RuleResult(rule.name, status, rule.severity, (fail_message or first["message"]) + more,
                      first["where"], first["value"], first["limit"], violations)


def _layers(report: Report, rule: RuleConfig) -> list[LayerRecord]:
    return [r for r in report.layers if r.called and not r.raised and not rule.ignored(r.name)]


def _by_order(obs: Observations) -> Callable[[LayerRecord], int]:
    return lambda r: obs.order.get((r.name, r.call), len(obs.order))


def _explained(kind: str, labels: list[str]) -> str:
    """The PASS message's tail for offenders the second look showed to be initialised so."""
    if not labels:
        return ""
    shown = ", ".join(labels[:3]) + (f", ... ({len(labels)} in all)" if len(labels) > 3 else "")
    return f"; {kind} at initialisation but live after one SGD step (initialised so, not dead): {shown}"


def _zero_rows(rule: RuleConfig, report: Report, obs: Observations) -> list[tuple[Any, ...]]:
    rows = []
    for r in _layers(report, rule):
        frac = (r.stats or {}).get("zero_fraction")
        if frac is None or (r.name, r.call, r.output) in obs.constant:
            continue
        limit = rule.limits(r.name)["value"]
        rows.append((frac - limit, -obs.order.get((r.name, r.call), 0), r.label, frac, limit))
    rows.sort(reverse=True)
    return rows


def _channel_rows(rule: RuleConfig, report: Report, obs: Observations) -> list[tuple[Any, ...]]:
    labels = {(r.name, r.call, r.output): r for r in _layers(report, rule)}
    rows = []
    for key, (dead, channels, per_channel, dim) in obs.channels.items():
        rec = labels.get(key)
        if rec is None or not channels or key in obs.constant:
            continue
        limits = rule.limits(rec.name)
        if per_channel < limits["min_values"]:
            continue
        frac = dead / channels
        rows.append((frac - limits["value"], -obs.order.get(key[:2], 0), rec.label, frac, limits["value"],
                     dead, channels, dim))
    rows.sort(reverse=True)
    return rows


def _grad_value(p: Any) -> float:
    return float((p.grad or {}).get("norm") or 0.0) if p.grad is not None else 0.0


def _too_small(rule: RuleConfig, p: Any) -> bool:
    """A gradient that exists but is below ``min`` (zero included)."""
    return p.grad is not None and _grad_value(p) < rule.limits(p.name, "param")["min"]


def _grown(rule: RuleConfig, p: Any) -> bool:
    """``p`` (a parameter record of another look, or None) has a gradient of at least ``min``."""
    return p is not None and p.grad is not None and not _too_small(rule, p)


def suspects(rules: CheckRules, report: Report, obs: Observations, grads_only: bool = False) -> bool:
    """True when a rule sees zeros that a zero or tiny initialisation could explain (a second look
    at a stepped copy tells them apart): all-zero outputs, zero channels, gradients below ``min``.
    ``grads_only``: gradients below ``min`` that the second look (``obs.stepped``) did not explain."""
    zero, chans, norm = rules.get("max_zero_fraction"), rules.get("dead_channels"), rules.get("grad_norm")
    if grads_only:
        if norm is None:
            return False
        later = {p.name: p for p in (obs.stepped[0].params or [])} if obs.stepped is not None else {}
        return any(p.requires_grad and not norm.ignored(p.name, "param") and _too_small(norm, p)
                   and not _grown(norm, later.get(p.name)) for p in report.params or [])
    return bool((zero is not None and any(row[3] > row[4] for row in _zero_rows(zero, report, obs)))
                or (chans is not None and any(row[3] > row[4] for row in _channel_rows(chans, report, obs)))
                or (norm is not None and any(p.requires_grad and not norm.ignored(p.name, "param")
                                             and _too_small(norm, p) for p in report.params or [])))


def _owner(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def no_gradient(p: Any, report: Report) -> tuple[str, str]:
    """Why trainable parameter ``p`` got no gradient from the loss, as (severity, message).

    ``warn``: its module was never called, the forward never read it (wav2vec2's ``masked_spec_embed``,
    used only for training-time masking), or it only feeds model outputs the loss does not use (BERT's
    pooler under a loss on ``last_hidden_state``). ``error``: the forward read it, yet nothing it
    computes reaches the loss or any output: cut off (a ``.detach()`` or ``torch.no_grad()`` in forward).
    """
    owner = _owner(p.name)
    calls = [r.called for r in report.layers if r.name == owner]
    if calls and not any(calls):
        return "warn", f"{p.name} gets no gradient: its module {owner or '(model)'} is never called"
    if getattr(p, "unused", None):
        return "warn", (f"{p.name} gets no gradient: this forward never reads it "
                        f"({report.mode} mode; a parameter only some modes or inputs use)")
    if p.other_outputs:
        return "warn", (f"{p.name} gets no gradient: it only feeds the output(s) {', '.join(p.other_outputs)}, "
                        "which the loss does not use")
    if calls:
        return "error", (f"{p.name} gets no gradient although its module {owner or '(model)'} runs: it is cut off "
                         "from the loss (a .detach() or torch.no_grad() in forward?)")
    return "error", f"{p.name} gets no gradient (not used by the loss)"


# --------------------------------------------------------------------------- rules


def runs(report: Report) -> RuleResult:
    failure = report.failure
    if failure is None:
        return RuleResult(RUNS, "PASS", "error", "forward, loss and backward ran")
    where = failure.module or "(model)"
    message = failure.sentence()
    return RuleResult(RUNS, "FAIL", "error", message, where, failure.exception, None,
                      [_violation(where, failure.exception, None, message)])


def finite(rule: RuleConfig, report: Report, obs: Observations) -> RuleResult:
    """No NaN/Inf in activations, the model output, the loss, output gradients or parameters."""
    def bad(data: dict[str, Any] | None) -> int:
        return int((data or {}).get("nan_count") or 0) + int((data or {}).get("inf_count") or 0)

    def what(data: dict[str, Any]) -> str:
        return f"{data.get('nan_count') or 0} NaN, {data.get('inf_count') or 0} Inf"

    layers = sorted(_layers(report, rule), key=_by_order(obs))
    found: list[dict[str, Any]] = []
    for r in layers:
        if bad(r.stats):
            found.append(_violation(r.label, bad(r.stats), 0, f"{what(r.stats or {})} in the output of {r.label}"))
    for out in obs.outputs:
        if out["nonfinite"] and not rule.ignored(""):
            label = "(model)" + out["path"]
            found.append(_violation(label, out["nonfinite"], 0, f"{out['nonfinite']} NaN/Inf in the model output "
                                                                f"{out['path']}".rstrip()))
    loss = (report.loss or {}).get("value")
    if isinstance(loss, float) and not math.isfinite(loss):
        found.append(_violation("loss", loss, 0, f"the loss is {loss}"))
    for r in reversed(layers):  # backward reaches the last layers first
        if bad(r.grad):
            found.append(_violation(r.label, bad(r.grad), 0, f"{what(r.grad or {})} in the gradient w.r.t. the "
                                                             f"output of {r.label}"))
    for p in report.params or []:
        if rule.ignored(p.name, "param"):
            continue
        if bad(p.grad):
            found.append(_violation(p.name, bad(p.grad), 0, f"{what(p.grad or {})} in the gradient of {p.name}"))
        if p.norm is not None and not math.isfinite(p.norm):
            found.append(_violation(p.name, p.norm, 0, f"parameter {p.name} holds NaN/Inf"))
    first = found[0]["message"] if found else ""
    order = (" (first in execution order)" if " in the output of " in first else
             " (the first that backward reaches)" if "gradient w.r.t." in first else "")
    more = f" (+{len(found) - 1} more)" if len(found) > 1 else ""
    return _result(rule, found, ok_value=0, limit=0, fail_message=first + order + more,
                   ok_message=f"no NaN/Inf in {len(layers)} activations, their gradients, "
                              f"{len(report.params or [])} parameter gradients and the loss")


def max_abs_activation(rule: RuleConfig, report: Report, obs: Observations) -> RuleResult:
    rows = []
    for r in _layers(report, rule):
        s = r.stats or {}
        lo, hi = s.get("min"), s.get("max")
        if lo is None or hi is None or math.isnan(lo) or math.isnan(hi):
            continue
        value, limit = max(abs(lo), abs(hi)), rule.limits(r.name)["value"]
        rows.append((value / limit, -obs.order.get((r.name, r.call), 0), r.label, value, limit))
    rows.sort(reverse=True)
    bad = [_violation(w, v, lim, f"|activation| {_fmt(v)} in {w} exceeds {_fmt(lim)}") for _, _, w, v, lim in rows
           if v > lim]
    top = rows[0] if rows else (0, 0, None, None, rule["value"])
    return _result(rule, bad, ok_where=top[2], ok_value=top[3], limit=top[4],
                   ok_message=f"largest |activation| {_fmt(top[3])} in {top[2]}" if rows else "no activation stats")


def _live_later(rows_of: Callable[[Report, Observations], list[tuple[Any, ...]]], obs: Observations,
                bad: list[tuple[Any, ...]]) -> tuple[list[tuple[Any, ...]], list[str]]:
    """Split violating rows into those still violating on the stepped copy and those that recovered."""
    if obs.stepped is None or not bad:
        return bad, []
    later = {row[2] for row in rows_of(*obs.stepped) if row[3] > row[4]}
    return [row for row in bad if row[2] in later], [row[2] for row in bad if row[2] not in later]


def max_zero_fraction(rule: RuleConfig, report: Report, obs: Observations) -> RuleResult:
    rows = _zero_rows(rule, report, obs)
    over, recovered = _live_later(lambda rep, o: _zero_rows(rule, rep, o), obs, [r for r in rows if r[3] > r[4]])
    bad = [_violation(w, v, lim, f"{v:.1%} of the output of {w} is zero (dead layer; limit {lim:.1%})")
           for _, _, w, v, lim in over]
    live = [r for r in rows if r[2] not in recovered]
    top = live[0] if live else (rows[0] if rows else (0, 0, None, None, rule["value"]))
    ok = f"at most {top[3]:.1%} zeros (in {top[2]})" if live else "no activation stats" if not rows else "no dead layer"
    return _result(rule, bad, ok_where=top[2], ok_value=top[3], limit=top[4],
                   ok_message=ok + _explained("all zero", recovered))


def _out_of_range(rule: RuleConfig, report: Report, obs: Observations) -> dict[int, list[tuple[str, int]]]:
    """The configured dims some checked outputs do not have: dim -> [(output label, its rank)]."""
    labels = {(r.name, r.call, r.output): r.label for r in _layers(report, rule)}
    missing: dict[int, list[tuple[str, int]]] = {}
    for key, (dim, rank) in obs.out_of_range.items():
        if key in labels:
            missing.setdefault(dim, []).append((labels[key], rank))
    return missing


def _shown(outputs: list[tuple[str, int]]) -> str:
    ranks = "/".join(f"{r}-D" for r in sorted({rank for _, rank in outputs}))
    names = ", ".join(label for label, _ in outputs[:3]) + (f", ... ({len(outputs)} in all)" if len(outputs) > 3
                                                             else "")
    return f"{names} ({ranks})"


def channel_dims_exist(rules: CheckRules, report: Report, obs: Observations) -> None:
    """ConfigError (exit 2) when a ``dead_channels`` dim (the rule's or an override's) exists in none
    of the outputs it applies to: the rule would judge nothing and pass. A dim that only some outputs
    lack skips those (``dead_channels`` says so)."""
    rule = rules.get("dead_channels")
    if rule is None or not obs.out_of_range:
        return
    missing = _out_of_range(rule, report, obs)
    labels = {(r.name, r.call, r.output): r.name for r in _layers(report, rule)}
    judged = {rule.limits(labels[key])["dim"] for key in obs.channels if key in labels}
    for dim, outputs in missing.items():
        if dim not in judged:
            raise ConfigError(
                f"{rules.source}: [checks.dead_channels] dim = {dim} is out of range for every output it applies "
                f"to: {_shown(outputs)}; an N-D output has dims -N to N-1",
                hint='set dim to one those outputs have (1 for [B, C, ...], -1 for the last) or "auto"; '
                     'overrides = { "name.*" = { dim = N } } sets it for some layers')


def dead_channels(rule: RuleConfig, report: Report, obs: Observations) -> RuleResult:
    skipped = "".join(f"; dim {dim} out of range, not judged: {_shown(outputs)}"
                      for dim, outputs in _out_of_range(rule, report, obs).items())
    rows = _channel_rows(rule, report, obs)
    over, recovered = _live_later(lambda rep, o: _channel_rows(rule, rep, o), obs, [r for r in rows if r[3] > r[4]])
    bad = [_violation(w, f, lim, f"{d} of {c} channels (dim {dim}) of {w} are zero over the whole batch")
           for _, _, w, f, lim, d, c, dim in over]
    live = [r for r in rows if r[2] not in recovered]
    top = live[0] if live else (rows[0] if rows else (0, 0, None, None, rule["value"], 0, 0, 0))
    msg = (f"at most {top[5]} of {top[6]} channels dead (in {top[2]})" if rows else
           f"no output has {rule['min_values']}+ values per channel to judge")
    result = _result(rule, bad, ok_where=top[2], ok_value=top[3], limit=top[4],
                     ok_message=msg + _explained("zero channels", recovered) + skipped)
    if bad:
        result.message += skipped
    return result


def grad_norm(rule: RuleConfig, report: Report, obs: Observations) -> RuleResult:
    """Every trainable parameter's gradient norm within [min, max].

    No gradient at all: a warning when its module is never called or it feeds only outputs the loss
    does not use, a failure when its module runs but is cut off (:func:`no_gradient`). A gradient below
    ``min`` that is above it after one SGD step on a copy (a zero-initialised norm weight further on
    blocks it at first) is initialised so, not vanishing.
    """
    if report.params is None:
        return RuleResult(rule.name, "SKIP", rule.severity, "no parameters reported (--params none)")
    later = {p.name: p for p in (obs.stepped[0].params or [])} if obs.stepped is not None else {}
    lifted = {p.name: p for p in (obs.lifted.params or [])} if obs.lifted is not None else {}
    # modules with a parameter whose gradient is within limits (here or with the layer scales lifted): a
    # sibling far below them (a bias before a softmax or a normalisation) is cancelled downstream
    healthy = {_owner(p.name) for p in [*report.params, *lifted.values()] if p.requires_grad and p.grad is not None
               and len(p.shape) >= 2 and not _too_small(rule, p)}
    rows, recovered, cancelled, scaled = [], [], [], []
    for p in report.params:
        if not p.requires_grad or rule.ignored(p.name, "param"):
            continue
        limits = rule.limits(p.name, "param")
        lo, hi = limits["min"], limits["max"]
        value = _grad_value(p)
        severity = "error"
        if math.isnan(value):
            rows.append((math.inf, p.name, value, [lo, hi], True, f"gradient norm of {p.name} is NaN", severity))
            continue
        below = math.log10(lo / value) if value > 0 and lo > 0 else (math.inf if lo > 0 else -math.inf)
        above = math.log10(value / hi) if value > 0 else -math.inf
        out = value < lo or value > hi
        if p.grad is None:
            severity, msg = no_gradient(p, report)
        elif value < lo:
            msg = f"gradient norm {_fmt(value)} of {p.name} is below {_fmt(lo)} (vanishing)"
            if _grown(rule, later.get(p.name)):
                recovered.append(p.name)
                out = False
            elif _grown(rule, lifted.get(p.name)):  # behind a layer scale of 1e-6: scaled, not vanishing
                scaled.append(p.name)
                out = False
            elif len(p.shape) <= 1 and _owner(p.name) in healthy:  # a bias-like shift, its weight learns
                cancelled.append(p.name)
                out = False
        else:
            msg = f"gradient norm {_fmt(value)} of {p.name} is above {_fmt(hi)} (exploding)"
        explained = p.name in (recovered[-1:] + scaled[-1:] + cancelled[-1:])
        rows.append((-math.inf if explained else max(below, above), p.name, value, [lo, hi], out, msg, severity))
    rows.sort(key=lambda row: -row[0])
    bad = [dict(_violation(name, v, lim, msg), **({"severity": sev} if sev != "error" else {}))
           for _, name, v, lim, out, msg, sev in rows if out]
    if not rows:
        return _result(rule, [], limit=[rule["min"], rule["max"]], ok_message="no trainable parameters to check")
    _, name, value, limit, _, _, _ = rows[0]
    return _result(rule, bad, ok_where=name, ok_value=value, limit=limit,
                   ok_message=f"{len(rows)} gradient norms within limits (closest: {name})"
                   + _explained("gradients below min", recovered)
                   + (f"; {len(scaled)} gradients below min only behind a layer scale (reach min with the "
                      f"{len(obs.layer_scales)} parameters initialised below 1e-3 set to 1, e.g. "
                      f"{obs.layer_scales[0]}): " + ", ".join(scaled[:3]) + (", ..." if len(scaled) > 3 else "")
                      if scaled else "")
                   + (f"; {len(cancelled)} near-zero gradients of parameters whose module's other parameters "
                      "learn (a shift cancelled downstream by a softmax or normalisation): "
                      + ", ".join(cancelled[:3]) + (", ..." if len(cancelled) > 3 else "") if cancelled else ""))


def params_change(rule: RuleConfig, report: Report, obs: Observations) -> RuleResult:
    """Every trainable parameter moves in ``steps`` SGD steps on a copy of the model.

    A parameter without a gradient whose module is never called, or that feeds only outputs the loss
    does not use, is left to grad_norm's warning. One that stays put but moves in one more step (held
    by a zero or tiny initialisation further on, or a first step below float resolution) is initialised so.
    """
    steps = f"{rule['steps']} SGD step{'s' if rule['steps'] > 1 else ''} (lr={rule['lr']:g})"
    if obs.change_error is not None:
        return _result(rule, [_violation("(model)", None, None, obs.change_error)], ok_message="")
    if obs.changes is None:
        return RuleResult(rule.name, "SKIP", rule.severity, "not run (no trainable parameters in scope)")
    records = {p.name: p for p in report.params or []}
    rows, excused, recovered, rounded = [], [], [], []
    for name, change in obs.changes.items():
        if rule.ignored(name, "param"):
            continue
        if change is None and name in records and no_gradient(records[name], report)[0] == "warn":
            excused.append(name)
            continue
        if change == 0 and obs.grace.get(name):
            recovered.append(name)
            change = obs.grace[name]
        elif change == 0 and obs.grad_max.get(name, 0.0) > 0:
            rounded.append(name)  # it has a gradient; lr * gradient is below its values' float resolution
            change = obs.grad_max[name] * rule["lr"]
        rows.append((change if change is not None and not math.isnan(change) else (0.0 if change is None else math.inf),
                     name, change))
    rows.sort(key=lambda row: row[0])
    bad = [_violation(name, 0.0, None, f"{name} did not change after {steps}"
                      + ("" if change is not None else ": it got no gradient")) for _, name, change in rows
           if not change]
    if bad:
        return _result(rule, bad, ok_message="", fail_message=f"{len(bad)} of {len(rows)} trainable parameters "
                       f"unchanged after {steps}, first: {bad[0]['where']}")
    top = rows[0] if rows else (None, None, None)
    tail = f"; {len(excused)} without a gradient are never called or unused by the loss (see grad_norm)" if excused else ""
    return _result(rule, [], ok_where=top[1], ok_value=top[2],
                   ok_message=f"all {len(rows)} trainable parameters changed after {steps}" + tail
                   + (f"; {len(recovered)} get a gradient once a first step has moved what held them "
                      "(initialised so, e.g. behind a zero-initialised norm weight): "
                      + ", ".join(recovered[:3]) + (", ..." if len(recovered) > 3 else "") if recovered else "")
                   + (f"; {len(rounded)} have a gradient whose step is below their float resolution: "
                      + ", ".join(rounded[:3]) + (", ..." if len(rounded) > 3 else "") if rounded else ""))


def _shape_ok(actual: list[int], expected: list[int]) -> bool:
    return len(actual) == len(expected) and all(e == -1 or a == e for a, e in zip(actual, expected))


def output_shape(rule: RuleConfig, report: Report, obs: Observations) -> RuleResult:
    expected = rule["value"]
    outputs = [o for o in obs.outputs if o["shape"] is not None]
    actual = {o["path"]: o["shape"] for o in outputs}
    shown = [o["shape"] for o in outputs]
    value: Any = shown[0] if len(shown) == 1 else (actual if isinstance(expected, dict) else shown)
    bad: list[dict[str, Any]] = []
    if isinstance(expected, dict):
        for key, shape in expected.items():
            path = output_key_path(key, actual)
            if path is None:
                bad.append(_violation(f"(model){key}", None, shape, f"the model output has no {key!r} "
                                      f"(outputs: {', '.join(p or '(output)' for p in actual)})"))
            elif not _shape_ok(actual[path], shape):
                bad.append(_violation(f"(model){path}", actual[path], shape,
                                      f"output {path} has shape {_shape(actual[path])}, expected {_shape(shape)}"))
    else:
        wanted = expected if expected and isinstance(expected[0], list) else [expected]
        if len(shown) != len(wanted):
            bad.append(_violation("(model)", value, expected, f"the model returns {len(shown)} tensor(s), "
                                  f"expected {len(wanted)}: {', '.join(map(_shape, shown))}"))
        else:
            for out, shape in zip(outputs, wanted):
                if not _shape_ok(out["shape"], shape):
                    label = "(model)" + out["path"]
                    bad.append(_violation(label, out["shape"], shape, f"output {label} has shape "
                                          f"{_shape(out['shape'])}, expected {_shape(shape)}"))
    return _result(rule, bad, ok_where="(model)", ok_value=value, limit=expected,
                   ok_message=f"output shape {', '.join(map(_shape, shown))} as expected")


# --------------------------------------------------------------------------- training (check --steps N)


def _training(rule: RuleConfig, obs: Observations) -> Training | RuleResult:
    """The training run's data, or the rule's SKIP/FAIL when there is none to judge."""
    t = obs.training
    if t is None:
        return RuleResult(rule.name, "SKIP", rule.severity, "runs with check --steps N (N > 0): a training run")
    if t.skip is not None:
        return RuleResult(rule.name, "SKIP", rule.severity, t.skip)
    if t.error is not None:
        if t.error_rule not in (None, rule.name):
            return RuleResult(rule.name, "SKIP", rule.severity, f"not evaluated: the training run failed "
                              f"(see {t.error_rule})")
        return _result(rule, [_violation(t.error_where or "(model)", None, None, t.error)], ok_message="")
    return t


def init_loss(rule: RuleConfig, report: Report, obs: Observations) -> RuleResult:
    """The loss at initialisation against chance: ln C for a C-class cross-entropy, per token for
    language-model logits; logits that are probabilities (a softmax before the loss) fail."""
    t = _training(rule, obs)
    if isinstance(t, RuleResult):
        return t
    if t.chance is None or not t.losses:
        return RuleResult(rule.name, "SKIP", rule.severity, f"hookcli does not know the task: {t.no_task}")
    where = t.producer or "(model)"
    loss, lo, hi = t.losses[0], rule["min"] * t.chance, rule["max"] * t.chance
    bad = []
    if t.probabilities:
        bad.append(_violation(where, loss, [lo, hi], f"the logits of the {t.task} are probabilities (non-negative, "
                              f"each row sums to 1; made by {where}): a softmax before the loss? cross-entropy "
                              "applies log-softmax itself"))
    if not lo <= loss <= hi:
        bad.append(_violation(where, loss, [lo, hi], f"the loss at initialisation {_fmt(loss)} is "
                              f"{loss / t.chance:.2f} x chance (ln {round(math.exp(t.chance))} = {_fmt(t.chance)} "
                              f"for the {t.task}), outside [{rule['min']:g}, {rule['max']:g}] x chance: check the "
                              f"scale of the logits {where} makes"))
    return _result(rule, bad, ok_where=where, ok_value=loss, limit=[lo, hi],
                   ok_message=f"loss at initialisation {_fmt(loss)} = {loss / t.chance:.2f} x chance "
                              f"({_fmt(t.chance)}, {t.task})")


#: The fewest steps ``overfit_batch`` judges: a healthy MLP falls by 13% in 3 Adam steps, by 50% in 10 or so.
OVERFIT_MIN_STEPS = 10


def overfit_batch(rule: RuleConfig, report: Report, obs: Observations) -> RuleResult:
    """The loss on one fixed batch falls by at least ``fraction`` of its first value within N steps."""
    t = _training(rule, obs)
    if isinstance(t, RuleResult):
        return t
    if t.steps < OVERFIT_MIN_STEPS:
        return RuleResult(rule.name, "SKIP", rule.severity, f"needs --steps {OVERFIT_MIN_STEPS} or more (a healthy "
                          f"model need not halve its loss in {t.steps})")
    first = t.losses[0]
    finite = [x for x in t.losses if math.isfinite(x)]
    best = min(finite) if finite else math.nan
    fell = (first - best) / abs(first) if math.isfinite(first) and first != 0 and finite else math.nan
    where = t.producer or "(model)"
    how = f"{t.steps} steps of {t.optimiser}"
    if not math.isfinite(first):
        bad = [_violation(where, first, rule["fraction"], f"the loss at the first step is {first}")]
    elif not fell >= rule["fraction"]:
        why = (" (logits of the cross-entropy are probabilities: a softmax before the loss caps how far it "
               "can fall)" if t.probabilities else "")
        bad = [_violation(where, fell, rule["fraction"], f"the loss on one fixed batch fell by {fell:.1%} "
                          f"({_fmt(first)} -> {_fmt(best)}) in {how}; a model that can learn falls by "
                          f"{rule['fraction']:.0%} or more{why}")]
    else:
        bad = []
    return _result(rule, bad, ok_where=where, ok_value=fell, limit=rule["fraction"],
                   ok_message=f"the loss on one fixed batch fell by {fell:.1%} ({_fmt(first)} -> {_fmt(best)}) in "
                              f"{how}")


def params_update(rule: RuleConfig, report: Report, obs: Observations) -> RuleResult:
    """Over the N steps every trainable parameter gets a finite, non-zero gradient and changes; none
    requires grad outside your optimiser, none in it is frozen, no frozen one changes."""
    t = _training(rule, obs)
    if isinstance(t, RuleResult):
        return t
    records = {p.name: p for p in report.params or []}
    steps = f"{t.steps} step{'s' if t.steps > 1 else ''}"
    bad: list[dict[str, Any]] = []
    excused = 0
    trained = 0
    for name, p in t.params.items():
        if rule.ignored(name, "param"):
            continue
        if not p.requires_grad:
            if p.in_optimiser:
                bad.append(_violation(name, False, True, f"{name} is in your optimiser but does not require grad "
                                      "(frozen by accident?): it never trains"))
            elif p.change != 0:
                bad.append(_violation(name, p.change, 0.0, f"{name} does not require grad but changed by "
                                      f"{_fmt(p.change)} in {steps} (written in forward, or stepped by an optimiser)"))
            continue
        trained += 1
        if not p.in_optimiser:
            bad.append(_violation(name, None, None, f"{name} requires grad but is not in your optimiser: "
                                  "it never changes"))
        elif p.grad_steps == 0:
            record = records.get(name)
            severity, why = no_gradient(record, report) if record is not None else ("error", "")
            if severity == "warn":
                excused += 1
                continue
            bad.append(_violation(name, 0.0, None, f"{name} gets no gradient in {steps}"
                                  + (": " + why.split(": ", 1)[1] if ": " in why else "")))
        elif p.values_first:
            bad.append(_violation(name, p.change, None, f"{name} became NaN/Inf in a step of {t.optimiser} while its "
                                  "gradients were finite: " + overflowed_update(p.dtype)))
        elif not math.isfinite(p.grad_max):
            bad.append(_violation(name, p.grad_max, None, f"{name} gets a NaN/Inf gradient in {steps}"))
        elif p.grad_max == 0:
            bad.append(_violation(name, 0.0, None, f"the gradient of {name} is exactly zero in each of {steps}"))
        elif not p.change:
            bad.append(_violation(name, 0.0, None, f"{name} did not change in {steps} of {t.optimiser} although "
                                  f"its gradient is non-zero (largest {_fmt(p.grad_max)}): a learning rate of 0?"
                                  + (f" Or {rounded_away(p.dtype)}" if rounded_away(p.dtype) else "")))
        elif not math.isfinite(p.change):
            bad.append(_violation(name, p.change, None, f"{name} holds NaN/Inf after {steps}"))
    tail = f"; {excused} without a gradient are never called or unused by the loss (see grad_norm)" if excused else ""
    return _result(rule, bad, ok_message=f"all {trained} trainable parameters got a finite gradient and changed "
                   f"in {steps} of {t.optimiser}" + tail)


#: Half the spacing of a 16-bit float's values around 1, relative: a smaller update rounds away.
_HALF_ULP = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


def overflowed_update(dtype: str | None) -> str:
    """Why an optimiser step made a weight NaN/Inf from a finite gradient, with a float16 weight's likely
    cause. Told by ``check --steps``'s ``params_update`` and the watch's ``nonfinite`` rule."""
    return "the update overflowed" + (" (float16 Adam: its eps 1e-8 is 0 in float16; keep the weights in float32)"
                                      if dtype == "float16" else "")


def rounded_away(dtype: str | None) -> str:
    """Why a 16-bit weight with a gradient may not move at all (``""`` for other dtypes): each update
    below half its float's spacing at the weight's value is lost in the rounding (pure bfloat16
    training at a small learning rate: a LayerNorm weight of 1 under AdamW at lr 1e-3). Told by
    ``check --steps``'s ``params_update`` and the watch's ``frozen`` rule."""
    if dtype not in _HALF_ULP:
        return ""
    return (f"updates that round away in {dtype}? one below about {_HALF_ULP[dtype]:.2g} x a weight's magnitude "
            "does; keep the weights in float32, compute under torch.autocast")


def determinism(rule: RuleConfig, report: Report, obs: Observations) -> RuleResult:
    """Two runs seeded alike give identical losses (bit for bit) in their first steps."""
    t = _training(rule, obs)
    if isinstance(t, RuleResult):
        return t
    pairs = list(zip(t.losses, t.repeat))
    for step, (a, b) in enumerate(pairs):
        if a != b and not (math.isnan(a) and math.isnan(b)):
            where = t.differs or "(model)"
            inside = (f"; the first module whose output differs between two seeded forward passes: {where}"
                      if t.differs else "; two seeded forward passes agree, so backward or the step differs")
            return _result(rule, [_violation(where, b, a, f"two runs seeded alike give different losses at step "
                                             f"{step}: {a!r} vs {b!r}{inside} (an unseeded random source, or a "
                                             "non-deterministic op)")], ok_message="")
    return _result(rule, [], ok_where="(model)", ok_value=len(pairs), limit=0,
                   ok_message=f"two runs seeded alike give identical losses in {len(pairs)} steps")


# --------------------------------------------------------------------------- baseline


def load_baseline(path: str, source: str | None = None) -> dict[str, Any]:
    """A saved JSON report (``hookcli shapes MODEL -f json -o FILE``); ConfigError when unusable.

    ``source`` (the config file) prefixes error messages."""
    where = f"{source}: [checks.baseline] " if source else ""
    try:
        data = json.loads(read_capped(Path(path), TEXT_BYTES, f"{where}baseline file {path}"))
    except FileNotFoundError:
        raise ConfigError(f"{where}baseline file {path} does not exist",
                          hint="make one with: hookcli shapes MODEL --format json --output FILE") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise ConfigError(f"{where}baseline file {path} is not a readable JSON report: {one_line(str(exc), 120)}",
                          hint=BASELINE_HINT) from None
    problem = baseline_problem(data)
    if problem is not None:
        raise ConfigError(f"{where}baseline file {path} is not a hookcli JSON report: {problem}", hint=BASELINE_HINT)
    return data


BASELINE_HINT = "make the baseline with: hookcli shapes MODEL --format json --output FILE"


def baseline_problem(data: Any) -> str | None:
    """What makes ``data`` unusable as a baseline report (the fields the rule reads), or None."""
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}, not an object"
    layers = data.get("layers")
    if not isinstance(layers, list):
        return "no 'layers' list"
    for key, kind in (("model", dict), ("inputs", list)):
        if key in data and not isinstance(data[key], kind):
            return f"'{key}' is not a JSON {'object' if kind is dict else 'array'}"
    if any(not isinstance(i, dict) for i in data.get("inputs", [])):
        return "an entry of 'inputs' is not an object"
    for n, row in enumerate(layers):
        if not isinstance(row, dict) or not isinstance(row.get("name"), str):
            return f"layers[{n}] has no 'name' string"
        for key, ok in (("call", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0),
                        ("depth", lambda v: isinstance(v, int) and not isinstance(v, bool)),
                        ("output", lambda v: isinstance(v, str))):
            if key in row and not ok(row[key]):
                return f"layers[{n}].{key} is {one_line(repr(row[key]), 40)}"
    return None


def baseline(rule: RuleConfig, report: Report, obs: Observations) -> RuleResult:
    """Same model size, inputs and per-layer shapes, dtypes and parameter counts as the saved report."""
    base = obs.baseline or {}
    diffs: list[dict[str, Any]] = []

    def differ(where: str, got: Any, want: Any, what: str) -> None:
        if got != want:
            diffs.append(_violation(where, got, want, f"{where}: {what} {_show(want)} -> {_show(got)}"))

    model = base.get("model") or {}
    for key in ("class", "params", "trainable_params"):
        if key in model:
            differ("(model)", report.model.to_dict()[key], model[key], key.replace("_", " "))
    inputs = base.get("inputs")
    if isinstance(inputs, list):
        differ("(inputs)", [[i.shape, i.dtype] for i in report.inputs],
               [[i.get("shape"), i.get("dtype")] for i in inputs if isinstance(i, dict)], "input shapes/dtypes")
    run = {(r.name, r.call, r.output): r for r in report.layers if not rule.ignored(r.name)}
    seen = set()
    for old in base.get("layers", []):
        key = (old["name"], int(old.get("call", 0)), old.get("output", ""))
        if rule.ignored(key[0]):
            continue
        seen.add(key)
        label = (key[0] or "(model)") + (f"#{key[1]}" if key[1] else "") + key[2]
        new = run.get(key)
        if new is None:
            diffs.append(_violation(label, None, old.get("shape"), f"{label}: missing (in the baseline, not in this run)"))
            continue
        differ(label, new.called, old.get("called", True), "called")
        for attr in ("shape", "dtype", "params"):
            if attr in old:
                differ(label, getattr(new, attr), old[attr], attr)
    depth = max((int(r.get("depth", 1)) for r in base.get("layers", [])), default=0)
    for key, new in run.items():
        if key not in seen and 1 <= new.depth <= depth and new.called:
            diffs.append(_violation(new.label, new.shape, None, f"{new.label}: new (not in the baseline)"))
    return _result(rule, diffs, ok_where=None, ok_value=0, limit=0,
                   ok_message=f"{len(seen)} layers match the baseline {os.path.basename(str(rule['file']))}",
                   fail_message=f"{len(diffs)} difference(s) from the baseline: {diffs[0]['message']}" if diffs else "")


def replica_desync(rule: RuleConfig, report: Report, obs: Observations) -> RuleResult:
    """Every replicated parameter (and the ``.grad`` it holds) equal on every rank (under ``torchrun``);
    SKIP without a process group, as there are no replicas to compare."""
    found = obs.replicas
    if found is None:
        return RuleResult(rule.name, "SKIP", rule.severity, "runs under torchrun (a process group of 2 or more "
                          "ranks): compares the ranks' copies of each parameter")
    rtol = rule["rtol"]
    compared = [name for name in found["compared"] if not rule.ignored(name, "param")]
    bad = [_violation(name, rank, rtol, f"the {what} of parameter {name} (layer {_owner(name) or '(model)'}) on rank "
                                        f"{rank} differs from rank 0's by more than {rtol:g} (relative): data-parallel "
                                        "replicas are out of sync")
           for name, what, rank in found["desync"] if not rule.ignored(name, "param")]
    return _result(rule, bad, limit=rtol, ok_message=f"{len(compared)} parameters equal on all {found['world']} ranks "
                   "(values, and gradients where .grad is set; sharded parameters are not replicas)")


def _show(value: Any) -> str:
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return _shape(value)
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


# --------------------------------------------------------------------------- between modules (check.between)


def _growth(values: list[float]) -> float:
    """The least growth from one block's input to the next (NaN when an input is not positive): a stream
    that every block multiplies, not one that grows by what the blocks add."""
    if len(values) < 2 or not all(v > 0 for v in values[:-1]):
        return math.nan
    return min(b / a for a, b in zip(values, values[1:]))


def residual_growth(rule: RuleConfig, report: Report, obs: Observations) -> RuleResult:
    """The input of a repeated stack's blocks does not grow by more than ``value`` per block at any step."""
    t = _training(rule, obs)
    if isinstance(t, RuleResult):
        return t
    stacks = [s for s in (t.between or {}).get("stacks", []) if len(s["blocks"]) >= rule["min_blocks"]
              and not any(rule.ignored(b) for b in s["blocks"])]
    if not stacks:
        return RuleResult(rule.name, "SKIP", rule.severity, f"no repeated stack of {rule['min_blocks']}+ blocks "
                          "(consecutive children of one class and input shape in a ModuleList/Sequential)")
    limit, bad, worst = rule["value"], [], (-math.inf, "", 0)
    for s in stacks:
        blocks = s["blocks"]
        for step, (rms, top) in enumerate(zip(s["rms"], s["max"]), 1):
            g = _growth(rms)
            if g > worst[0]:
                worst = (g, blocks[-1], step)
            if g > limit or math.isinf(g):
                norm = f" and of {s['norm']}" if s.get("norm") else ""
                bad.append(_violation(blocks[-1], g, limit, f"at step {step} the input of {blocks[0]} .. "
                                      f"{blocks[-1]}{norm} grows {_fmt(g)}x or more at every block (RMS {_fmt(rms[0])} "
                                      f"-> {_fmt(rms[-1])}, max |x| {_fmt(top[0])} -> {_fmt(top[-1])} over "
                                      f"{len(blocks)} blocks{norm.replace(' of', '')}; limit {limit:g}x): a residual "
                                      "stream that is never normalised or scaled (x = x + block(x) with block(x) as "
                                      "large as x)?"))
                break
    g, where, step = worst
    return _result(rule, sorted(bad, key=lambda v: -v["value"]), ok_where=where, ok_value=g, limit=limit,
                   ok_message=f"in {len(stacks)} repeated stacks the input grows by at most {_fmt(g)}x at its least-growing "
                              f"block (the most at step {step}, up to {where})")


def dead_units(rule: RuleConfig, report: Report, obs: Observations) -> RuleResult:
    """At most ``value`` of a Linear/Conv layer's channels are never positive and never get a gradient."""
    t = _training(rule, obs)
    if isinstance(t, RuleResult):
        return t
    rows = []
    for name, u in ((t.between or {}).get("units") or {}).items():
        limits = rule.limits(name)
        if not rule.ignored(name) and u["values"] >= limits["min_values"]:
            rows.append((len(u["dead"]) / u["channels"], name, u, limits["value"]))
    if not rows:
        return RuleResult(rule.name, "SKIP", rule.severity, f"no Linear/Conv output has {rule['min_values']}+ "
                          "values per channel in a step")
    rows.sort(key=lambda r: -r[0])
    steps = (t.between or {}).get("steps", t.steps)
    bad = [_violation(name, frac, limit, f"{len(u['dead'])} of {u['channels']} output channels of {name} "
                      f"({frac:.0%}; first: channel {u['dead'][0]}) were <= 0 on every sample at every step 1..{steps} "
                      f"and their weights never got a gradient: units dead behind a ReLU (F.relu?) from step 1; "
                      f"limit {limit:.0%}")
           for frac, name, u, limit in rows if frac > limit]
    frac, name, u, limit = rows[0]
    return _result(rule, bad, ok_where=name, ok_value=frac, limit=rule["value"],
                   ok_message=f"at most {len(u['dead'])} of {u['channels']} output channels dead over "
                              f"{steps} steps (in {name})")


def target_leak(rule: RuleConfig, report: Report, obs: Observations) -> RuleResult:
    """After the N steps, the loss on fresh batches is not far below chance (the targets reach the inputs)."""
    t = _training(rule, obs)
    if isinstance(t, RuleResult):
        return t
    leak = (t.between or {}).get("leak")
    if leak is None or "skip" in leak:
        return RuleResult(rule.name, "SKIP", rule.severity, leak["skip"] if leak else "not measured")
    fresh, chance = sum(leak["losses"]) / len(leak["losses"]), leak["chance"]
    limit, where = rule["fraction"] * chance, t.producer or "(model)"
    said = (f"the loss on {len(leak['losses'])} fresh batches (seeds {', '.join(map(str, leak['seeds']))}) after "
            f"{t.steps} steps on one batch is {_fmt(fresh)} = {fresh / chance:.2f} x chance (ln "
            f"{round(math.exp(chance))} = {_fmt(chance)}, {leak['task']})")
    bad = [] if fresh >= limit else [_violation(where, fresh, limit, said + f", below {rule['fraction']:g} x chance: "
                                                "the model predicts targets it never saw, so the targets reach the "
                                                "inputs (language-model targets not shifted? a label among the inputs?)")]
    return _result(rule, bad, ok_where=where, ok_value=fresh, limit=limit, ok_message=said)


#: Each rule's evaluator, as its spec names it (``schema.SPECS`` is the only list of rules): a function
#: of this module, or of ``probe_rules`` for the probe rules.
EVALUATORS: dict[str, Callable[[RuleConfig, Report, Observations], RuleResult]] = {
    spec.name: globals().get(spec.evaluator) or getattr(probe_rules, spec.evaluator) for spec in SPECS}


def evaluate(rules: CheckRules, report: Report, obs: Observations) -> tuple[list[RuleResult], list[str]]:
    """``runs`` then every enabled rule (SKIP when the model raised); notes on unused patterns."""
    results = [runs(report)]
    notes: list[str] = []
    for rule in rules.enabled():
        if report.failure is not None:
            results.append(RuleResult(rule.name, "SKIP", rule.severity, "not evaluated: the model raised"))
            continue
        start = time.perf_counter()
        result = EVALUATORS[rule.name](rule, report, obs)
        result.seconds = time.perf_counter() - start
        results.append(result)
        notes += [f"[checks.{rule.name}] {kind} {pattern!r} matches nothing" for kind, pattern in
                  (u.split(":", 1) for u in rule.unused_patterns())]
    return results, notes
