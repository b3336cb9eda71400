"""Run ``hookcli check``: forward, loss and backward once with hooks on every module, then the rules.

What the engine's Report does not hold is measured here (``Probe``, called by the engine session:
no hooks of its own), on the device, with one host transfer: the order in which module calls
*finish* (so the finite rule can name the first layer that made a NaN), the model's output shapes,
and per-channel dead counts for the ``dead_channels`` rule. The
``params_change`` rule steps a ``copy.deepcopy`` of the model with SGD: the user's model is never
stepped. Rules themselves are evaluated on plain data in ``hookcli.commands.check.rules``.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from hookcli.engine import run as engine
from hookcli._version import __version__
from hookcli.commands.check.schema import RUNS, CheckRules, RuleConfig, parse_checks
from hookcli.config import Config, config_options, load_config
from hookcli.errors import ConfigError, ModelRaisedError, exit_status
from hookcli.commands.grads import backward_report, build_loss
from hookcli.engine.session import CompletionOrder, RunObserver
from hookcli.options import RunOptions, check_option_names
from hookcli.engine.stats import dtype_name, iter_tensors, nested_values, shape_of, to_host
from hookcli.records import CheckResult, Report, RuleResult
from hookcli.commands.check.rules import Observations, evaluate, load_baseline
from hookcli.engine.state import exclusive


class Probe(RunObserver):
    """What the check run measures beyond the report, on the device: completion order, the model's
    outputs (shapes, non-finite counts) and per-channel dead counts. No hooks of its own: the engine
    session calls it (``RunObserver``), so its failures are hookcli's (InternalError after the run)."""

    def __init__(self, channel_dim: Callable[[str], int] | None) -> None:
        self.channel_dim = channel_dim
        self.wants_tensors = channel_dim is not None  # no per-call work unless dead_channels is on
        self.order: CompletionOrder = {}
        self._channels: list[tuple[tuple[str, int, str], int, int, torch.Tensor]] = []
        self._outputs: list[tuple[str, list[int], str, torch.Tensor | None]] = []

    def tensor(self, name: str, call: int, path: str, t: torch.Tensor) -> None:
        """Count the dead channels of one selected output tensor (``dead_channels``)."""
        if self.channel_dim is None:
            return
        if t.is_nested or not t.is_floating_point() or t.dim() < 2 or t.numel() == 0 or t.device.type == "meta":
            return  # (a nested tensor has no channel dimension to speak of)
        dim = self.channel_dim(name)
        d = dim + t.dim() if dim < 0 else dim
        if not 0 <= d < t.dim() or t.shape[d] == 0:
            return
        x = t.detach() if t.layout == torch.strided else t.detach().to_dense()
        others = [i for i in range(x.dim()) if i != d]
        # a channel is dead when its max and min are both 0: two reductions on the device, no
        # activation-sized temporary (x.abs() would be one); NaN makes either differ from 0
        dead = (x.amax(dim=others) == 0) & (x.amin(dim=others) == 0)
        channels = int(t.shape[d])
        self._channels.append(((name, call, path), channels, t.numel() // channels, dead.sum()))

    def output(self, output: Any) -> None:
        """The model's output tensors: path, shape, dtype and (floats) the count of non-finite values."""
        self._outputs = []
        for path, t in iter_tensors(output):
            bad = None
            if t.is_floating_point() and t.device.type != "meta":
                x = nested_values(t.detach()) if t.is_nested else t.detach()
                x = x if x.layout == torch.strided else x.to_dense()  # sparse: implicit zeros are finite
                bad = x.numel() - torch.isfinite(x).sum()
            self._outputs.append((path, shape_of(t), dtype_name(t.dtype), bad))

    def finished(self, order: CompletionOrder) -> None:
        self.order = order

    def fill(self, obs: Observations) -> None:
        """Move every measurement to the host in one transfer and store it in ``obs``."""
        vectors = [v.reshape(1) for *_, v in self._channels]
        vectors += [b.reshape(1) for *_, b in self._outputs if b is not None]
        host = iter(row[0] for row in to_host(vectors))
        obs.order = dict(self.order)
        obs.channels = {key: (int(next(host)), channels, per) for key, channels, per, _ in self._channels}
        obs.outputs = [{"path": path, "shape": shape, "dtype": dtype,
                        "nonfinite": int(next(host)) if bad is not None else 0}
                       for path, shape, dtype, bad in self._outputs]


def params_change(prep: engine.Prepared, names: list[str], rule: RuleConfig) -> tuple[dict[str, float | None] | None, str | None]:
    """Step a deep copy of the model with SGD; the largest absolute change of each named parameter.

    Returns ``(changes, None)``, ``(None, None)`` when no parameter is trainable, or ``(None, why)``
    when the copy or its step fails. The user's model is only read (by ``copy.deepcopy``).
    """
    opts = prep.options
    try:
        clone = copy.deepcopy(prep.loaded.model)
    except Exception as exc:  # noqa: BLE001 - any failure to copy is reported as the rule's failure
        return None, (f"cannot deep-copy the model ({type(exc).__name__}: {exc}); params_change steps a copy so "
                      "that your model is never modified: disable it with [checks.params_change] enabled = false")
    params = dict(clone.named_parameters())
    tracked = [(n, params[n]) for n in names if n in params and params[n].requires_grad]
    if not tracked:
        return None, None
    with engine.running(replace(prep, loaded=replace(prep.loaded, model=clone))) as (model, args, kwargs):
        before = [p.detach().clone() for _, p in tracked]
        optimizer = torch.optim.SGD([p for _, p in tracked], lr=rule["lr"])
        try:
            for _ in range(rule["steps"]):
                optimizer.zero_grad(set_to_none=True)
                with torch.enable_grad():
                    output = model(*args, **kwargs)
                    loss = build_loss(output, loss=opts.loss, target=opts.target, output_key=opts.output_key)
                    loss.value.backward()
                optimizer.step()
        except Exception as exc:  # noqa: BLE001 - the main run passed; report this rule's own failure
            return None, f"the SGD step on the copy raised {type(exc).__name__}: {exc}"
        except SystemExit as exc:  # the model's code called sys.exit on the copy's step
            return None, f"the model exited with {exit_status(exc.code)} during the SGD step on the copy"
        with torch.no_grad():
            deltas = [(p.detach().float() - b.float()).abs().max().reshape(1) for (_, p), b in zip(tracked, before)]
        values = to_host(deltas)
        return {n: (v[0] if p.grad is not None else None) for (n, p), v in zip(tracked, values)}, None


def run_check(options: RunOptions, rules: CheckRules) -> CheckResult:
    """Forward and backward once, the extra measurements, the SGD step on a copy, then the rules.

    Every module is hooked unless ``layers``/``types``/``depth`` choose some; each run (the checked
    one and the SGD step on the copy) starts its RNGs from ``options.seed`` (``engine.running``), so both
    see the same dropout masks and the verdict is reproducible. A model that raises
    gives a FAIL for the ``runs`` pseudo-rule (other rules SKIP) and the partial report; bad options
    or rules raise UsageError/ConfigError before anything runs.
    """
    started = time.perf_counter()
    # inference_mode(False): gradients, also when called under torch.inference_mode
    with exclusive(options.model), torch.inference_mode(False):
        return _run_check(options, rules, started)


def _run_check(options: RunOptions, rules: CheckRules, started: float) -> CheckResult:
    opts = options
    if opts.layers is None and opts.types is None and opts.depth is None and not opts.all_modules:
        opts = replace(opts, all_modules=True)
    base_rule = rules.get("baseline")
    obs = Observations(baseline=load_baseline(base_rule["file"], rules.source) if base_rule else None)
    prep = engine.prepare(opts, default_batch=2)
    dead = rules.get("dead_channels")
    probe = Probe((lambda name: dead.limits(name)["dim"]) if dead else None)
    cause: BaseException | None = None
    run_started = time.perf_counter()
    try:
        report = backward_report(prep, "check", stats=True, observer=probe)
    except ModelRaisedError as exc:
        if exc.report is None:
            raise
        report, cause = exc.report, exc
    probe.fill(obs)
    run_seconds = time.perf_counter() - run_started
    step_seconds: float | None = None
    change_rule = rules.get("params_change")
    if report.failure is None and change_rule is not None and report.params is not None:
        names = [p.name for p in report.params if p.requires_grad and not change_rule.ignored(p.name, "param")]
        step_started = time.perf_counter()
        obs.changes, obs.change_error = params_change(prep, names, change_rule)
        step_seconds = time.perf_counter() - step_started
    results, notes = evaluate(rules, report, obs)
    if report.failure is None and not any(r.called for r in report.layers):
        results = nothing_observed(report, results)
    for result in results:  # the rule's share of the time: its evaluation plus what it alone ran
        if result.rule == RUNS:
            result.seconds = run_seconds
        elif result.rule == "params_change" and step_seconds is not None:
            result.seconds = (result.seconds or 0.0) + step_seconds
    source = rules.source if rules.source != "checks" else None
    return CheckResult(report, results, config=source, notes=notes, version=__version__, cause=cause,
                       seconds=time.perf_counter() - started)


def nothing_observed(report: Report, results: list[RuleResult]) -> list[RuleResult]:
    """The rules when the model ran but no selected module was called: ``runs`` FAILs, the rest SKIP.

    Rules over layers would pass on no data; a gate that saw nothing must not pass. (A selection is
    never empty: ``select_modules`` falls back to the model itself or raises for a pattern that
    matches nothing, so "nothing observed" is never the user's choice.)
    """
    names = [r.name or "(model)" for r in report.layers]
    shown = ", ".join(names[:5]) + (f", ... ({len(names)} in all)" if len(names) > 5 else "")
    message = (f"the model ran, but none of the {len(names)} selected module(s) was called ({shown}): "
               "nothing was checked; select modules its forward calls (hookcli shapes shows them)")
    failed = RuleResult(RUNS, "FAIL", "error", message, "(selection)", 0, None,
                        [{"where": "(selection)", "value": 0, "limit": None, "message": message}])
    return [failed] + [r if r.rule == RUNS else RuleResult(r.rule, "SKIP", r.severity,
                                                            "not evaluated: no selected module was called")
                       for r in results if r.rule != RUNS]


# --------------------------------------------------------------------------- setup (CLI and API)

def check_rules(config: Config | None, *, checks: Mapping[str, Any] | None = None,
                baseline: str | os.PathLike[str] | None = None) -> CheckRules:
    """The validated rules: the config's ``[checks]``, rule entries of ``checks`` over them, and a
    ``baseline`` file (relative to the working directory) over both."""
    table: dict[str, Any] = dict(config.checks) if config is not None else {}
    source: str | None = os.fspath(config.path) if config is not None and config.path is not None else None
    section = "tool.hookcli.checks" if config is not None and config.path is not None and (
        config.path.name == "pyproject.toml") else "checks"
    if checks is not None:
        if not isinstance(checks, Mapping):
            raise ConfigError(f"checks must be a dict of rules, got {type(checks).__name__}",
                              hint="e.g. checks={'output_shape': [2, 10], 'grad_norm': {'max': 1e3}}")
        parse_checks(checks, source="checks")  # errors name the dict, not the file
        table.update(checks)
    if baseline is not None:
        entry = table.get("baseline")
        entry = dict(entry) if isinstance(entry, dict) else {}
        table["baseline"] = {**entry, "enabled": True, "file": str(Path(os.fspath(baseline)).resolve())}
    base_dir = config.path.parent if config is not None and config.path is not None else None
    return parse_checks(table, source=source, base_dir=base_dir, section=section)


def api_check(model: Any, *, checks: Mapping[str, Any] | None, config: str | os.PathLike[str] | None,
              baseline: str | os.PathLike[str] | None, options: dict[str, Any]) -> CheckResult:
    """``hookcli.check``: options from ``config`` (if given), keyword options over them."""
    cfg = load_config(config) if config is not None else None
    fields = config_options(cfg) if cfg is not None else {}
    if "model" in fields:
        fields["model_source"] = cfg.origin if cfg is not None else None
    if model is not None:
        fields.pop("model_source", None)
        fields["model"] = model
    if isinstance(fields.get("model_args"), dict) and isinstance(options.get("model_args"), dict):
        options = {**options, "model_args": {**fields["model_args"], **options["model_args"]}}  # key by key
    fields.update(options)
    fields.setdefault("params", "all")
    fields.setdefault("train", True)  # check the model as training sees it (BatchNorm batch statistics)
    source = fields.pop("model_source", None) or ("python" if not isinstance(fields.get("model"), (str, type(None)))
                                                  else "argument")
    rules = check_rules(cfg, checks=checks, baseline=baseline)
    check_option_names(fields)
    return run_check(RunOptions(model_source=source, **fields), rules)
