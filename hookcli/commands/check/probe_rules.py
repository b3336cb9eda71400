"""The probe rules of ``hookcli check`` on plain data (never imports torch): ``batch_independence``,
``input_dependence`` and ``grad_accumulation``, judged from ``Observations.probes`` (measured by
``hookcli.commands.check.probes``). Off by default: a config or ``checks={...}`` enables them.
"""

from __future__ import annotations

import math
from typing import Any

from hookcli.commands.check.schema import RuleConfig
from hookcli.records import Report, RuleResult


def _fmt(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else str(x)


def _skip(rule: RuleConfig, data: dict[str, Any] | None) -> RuleResult | None:
    if data is None:
        return RuleResult(rule.name, "SKIP", rule.severity, "not measured")
    if "skip" in data:
        return RuleResult(rule.name, "SKIP", rule.severity, f"skipped: {data['skip']}")
    return None


def _fail(rule: RuleConfig, where: str, value: Any, limit: Any, message: str) -> RuleResult:
    status = "FAIL" if rule.severity == "error" else "WARN"
    return RuleResult(rule.name, status, rule.severity, message, where, value, limit,
                      [{"where": where, "value": value, "limit": limit, "message": message}])


def batch_independence(rule: RuleConfig, report: Report, obs: Any) -> RuleResult:
    """Sample i's output does not depend on sample j's input (i != j), in eval mode."""
    data = obs.probes.get(rule.name)
    skipped = _skip(rule, data)
    if skipped is not None:
        return skipped
    limit = rule["value"]
    source = data["source"]
    if data["ratio"] > limit:
        where, sample = data.get("where", "(model)"), data["sample"]
        located = (f"; first mixing module: {where}" if where != "(model)" else
                   "; no selected module's output mixes them (the mix is in the model's own forward)")
        return _fail(rule, where, data["ratio"], limit,
                     f"the output of sample {sample} depends on other samples of the batch (gradient w.r.t. "
                     f"{source} of other samples {_fmt(data['ratio'])} x its own, limit {_fmt(limit)}; eval mode)"
                     + located)
    return RuleResult(rule.name, "PASS", rule.severity,
                      f"each sample's output depends on its own sample of {source} only (eval mode)",
                      None, data["ratio"], limit)


def input_dependence(rule: RuleConfig, report: Report, obs: Any) -> RuleResult:
    """The loss with the first input zeroed differs clearly (relative ``value``) from the real one."""
    data = obs.probes.get(rule.name)
    skipped = _skip(rule, data)
    if skipped is not None:
        return skipped
    loss, zeroed, limit = data["loss"], data["zeroed"], rule["value"]
    change = abs(loss - zeroed) / max(abs(loss), abs(zeroed), 1e-30)
    lifted = data.get("lifted")
    if not change > limit and lifted is not None:  # layer scales of 1e-5 hide the input at init
        lifted_change = abs(lifted["loss"] - lifted["zeroed"]) / max(abs(lifted["loss"]), abs(lifted["zeroed"]), 1e-30)
        if lifted_change > limit:
            return RuleResult(rule.name, "PASS", rule.severity,
                              f"the loss changes by {change:.2g} with the input zeroed, {lifted_change:.2%} with the "
                              f"{lifted['scales']} layer scales (initialised below 1e-3) set to 1", None, change, limit)
    if not change > limit:  # NaN fails too
        return _fail(rule, "(model)", change, limit,
                     f"the loss with the input zeroed ({_fmt(zeroed)}) is the loss with the real input "
                     f"({_fmt(loss)}) within {_fmt(limit)}: the model ignores its input")
    return RuleResult(rule.name, "PASS", rule.severity,
                      f"the loss changes by {change:.2%} with the input zeroed ({_fmt(loss)} -> {_fmt(zeroed)})",
                      None, change, limit)


#: ``grad_accumulation``'s limit is at least this many epsilons of the gradients' dtype: in bfloat16
#: (epsilon 0.0078) a healthy model's halves differ from the full batch by about 0.2 epsilon by rounding
#: (0.0015 to 0.0026 for probe_bugs.MeanLoss, a tiny Llama 0.0019), above the default 1e-3; a loss that
#: does not accumulate differs by 0.03 to 1 (tests/test_check_probes.py).
ROUNDING_EPS = 2


def grad_accumulation(rule: RuleConfig, report: Report, obs: Any) -> RuleResult:
    """The parameter gradients of two half batches, averaged, equal those of the full batch."""
    data = obs.probes.get(rule.name)
    skipped = _skip(rule, data)
    if skipped is not None:
        return skipped
    limit, why = rule["value"], ""
    floor = ROUNDING_EPS * data.get("eps", 0.0)
    if floor > limit:  # bfloat16 / float16 gradients differ by their rounding alone
        limit, why = floor, f"; {ROUNDING_EPS} x the epsilon of the {data['dtype']} gradients, above `value`"
    error = data["diff"] / data["norm"] if data["norm"] > 0 else (0.0 if data["diff"] == 0 else math.inf)
    rows = sorted(data["params"], key=lambda r: -r["diff"])
    if error > limit:
        worst = rows[0]
        return _fail(rule, worst["name"], error, limit,
                     f"the mean of the gradients of two half batches differs from the full batch's by "
                     f"{_fmt(error)} of its norm (limit {_fmt(limit)}{why}), most in {worst['name']}: the loss "
                     "depends on the batch size (a reduction that is not a mean over samples?)")
    return RuleResult(rule.name, "PASS", rule.severity,
                      f"two half batches accumulate to the full batch's gradients (relative difference "
                      f"{_fmt(error)}, batch {data['batch']}{', limit ' + _fmt(limit) + why if why else ''})",
                      None, error, limit)
