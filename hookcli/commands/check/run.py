"""Run ``hookcli check``: forward, loss and backward once with hooks on every module, then the rules.

What the engine's Report does not hold is measured here (``Probe``, called by the engine session:
no hooks of its own), on the device, with one host transfer: the order in which module calls
*finish* (so the finite rule can name the first layer that made a NaN), the model's output shapes,
and per-channel dead counts for the ``dead_channels`` rule. The
``params_change`` rule steps a ``copy.deepcopy`` of the model with SGD: the user's model is never
stepped. Rules themselves are evaluated on plain data in ``hookcli.commands.check.rules``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hookcli.engine import run as engine
from hookcli._version import __version__
from hookcli.commands.check.schema import RUNS, SPEC, CheckRules, parse_checks
from hookcli.commands.check.steps import StepOptions, train
from hookcli.config import Config, config_options, confine_read
from hookcli.errors import (
    ConfigError, HookcliError, InternalError, ModelRaisedError, RanksFailed, UnsupportedError, describe_exception,
    exit_status,
)
from hookcli.commands.grads import backward_report, data_backward_report
from hookcli.engine.channels import ChannelDims
from hookcli.engine.losses import build_loss
from hookcli.engine.session import CompletionOrder, RunObserver, widened
from hookcli.options import RunOptions, check_option_names, check_path_text
from hookcli.engine.stats import dtype_name, iter_tensors, nested_values, shape_of, to_host
from hookcli.records import CheckResult, Report, RuleResult
from hookcli.commands.check.rules import Observations, channel_dims_exist, evaluate, load_baseline, suspects
from hookcli.engine.state import copy_model, exclusive
from hookcli.commands.check.probes import LAYER_SCALE_LIFT, layer_scales, measure_probes
from hookcli.commands.check import ranks as check_ranks


class Probe(RunObserver):
    """What the check run measures beyond the report, on the device: completion order, the model's
    outputs (shapes, non-finite counts) and per-channel dead counts. No hooks of its own: the engine
    session calls it (``RunObserver``), so its failures are hookcli's (InternalError after the run)."""

    def __init__(self, channel_dim: Callable[[str], int | str] | None,
                 modules: Mapping[str, nn.Module] | None = None, frozen: set[str] | None = None) -> None:
        self.channel_dim = channel_dim
        self.auto_dims = ChannelDims(modules or {})
        #: Frozen modules (parameters, none trainable): their outputs are computed, never constants.
        self.frozen = frozen or set()
        # every selected output: constants are told apart (cheap: no reduction unless dead_channels is on)
        self.wants_tensors = True
        self.wants_param_reads = True  # a parameter without a gradient: unused, or cut off (no_gradient)
        self.order: CompletionOrder = {}
        self._channels: list[tuple[tuple[str, int, str], int, int, int, torch.Tensor]] = []
        #: (name, call, output path) -> (the configured channel dim, the output's number of dims): a dim it lacks.
        self.out_of_range: dict[tuple[str, int, str], tuple[int, int]] = {}
        self._outputs: list[tuple[str, list[int], str, torch.Tensor | None]] = []
        #: Float outputs that do not require grad in this grad-enabled run, of modules that are not
        #: frozen: constants (masks, zero position biases) computed from no trainable parameter. (The
        #: input does not require grad, as in training: a frozen module's output is checked.)
        self.constant: set[tuple[str, int, str]] = set()

    def tensor(self, name: str, call: int, path: str, t: torch.Tensor) -> None:
        """Note a constant output (``constant``); count the dead channels of one selected output
        tensor (``dead_channels``)."""
        if not t.is_floating_point():
            return
        if not t.requires_grad and name not in self.frozen:
            self.constant.add((name, call, path))
        if self.channel_dim is None:
            return
        if t.is_nested or t.dim() < 2 or t.numel() == 0 or t.device.type == "meta":
            return  # (a nested tensor has no channel dimension to speak of)
        dim = self.channel_dim(name)
        if dim == "auto":
            dim = self.auto_dims(name, t)
        assert isinstance(dim, int)
        d = dim + t.dim() if dim < 0 else dim
        if not 0 <= d < t.dim():  # not judged; the rule says so, or refuses a dim no output has
            self.out_of_range[(name, call, path)] = (dim, t.dim())
            return
        if t.shape[d] == 0:
            return
        x = t.detach() if t.layout == torch.strided else t.detach().to_dense()
        others = [i for i in range(x.dim()) if i != d]
        # a channel is dead when its max and min are both 0: two reductions on the device, no
        # activation-sized temporary (x.abs() would be one); NaN makes either differ from 0
        dead = (x.amax(dim=others) == 0) & (x.amin(dim=others) == 0)
        channels = int(t.shape[d])
        self._channels.append(((name, call, path), channels, t.numel() // channels, d, dead))

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

    def fill(self, obs: Observations, ranks: bool = False,
             shape: Callable[[list[int] | None], list[int] | None] | None = None) -> None:
        """Move every measurement to the host in one transfer and store it in ``obs``; ``ranks``: merged
        over every rank's batch (under ``torchrun``: ``check_ranks.merge_probe``, one collective);
        ``shape``: the outputs' shapes as the report shows them (``engine.global_shape_of``), before
        rank 0's are taken."""
        vectors = [v.sum().reshape(1) for *_, v in self._channels]
        vectors += [b.reshape(1) for *_, b in self._outputs if b is not None]
        host = iter(row[0] for row in to_host(vectors))
        obs.order = dict(self.order)
        obs.constant = set(self.constant)
        obs.out_of_range = dict(self.out_of_range)
        obs.channels = {key: (int(next(host)), channels, per, dim) for key, channels, per, dim, _ in self._channels}
        obs.outputs = [{"path": path, "shape": shape(seen) if shape is not None else seen, "dtype": dtype,
                        "nonfinite": int(next(host)) if bad is not None else 0}
                       for path, seen, dtype, bad in self._outputs]
        if ranks:
            check_ranks.merge_probe(obs, {key: dead.cpu() for key, *_, dead in self._channels})


def _no_copy(why: str) -> UnsupportedError:
    """The check cannot step a copy of this model (exit 2: hookcli cannot, the model did not fail)."""
    return UnsupportedError(f"params_change steps a copy of the model (so that yours is never modified), and the "
                            f"model cannot be deep-copied: {why}",
                            hint="disable the rule with [checks.params_change] enabled = false, or make the model "
                                 "copyable with copy.deepcopy")


class SteppedCopy:
    """A ``copy.deepcopy`` of the model that SGD steps (``params_change``, the second look): the
    user's model is only read. ``error`` says why a step failed (then nothing more runs); a model that
    cannot be copied raises UnsupportedError."""

    def __init__(self, prep: engine.Prepared, names: list[str], lr: float) -> None:
        self.prep, self.error = prep, None
        self.clone: nn.Module | None = None
        self.tracked: list[tuple[str, nn.Parameter]] = []
        self.before: list[torch.Tensor] = []
        self.lr = lr
        self.got_grad: dict[str, bool] = {}
        #: parameter -> the largest |gradient| any step gave it (an update below float resolution leaves
        #: a parameter as it was although it has a gradient: that is not "stuck")
        self.grad_max: dict[str, float] = {}
        model = prep.loaded.model
        try:
            clone = copy_model(model)
        except Exception as exc:  # noqa: BLE001 - any failure to copy
            raise _no_copy(describe_exception(exc)) from exc
        if type(clone) is not type(model):  # a __deepcopy__ (or a catch-all __getattr__) that gave something else
            raise _no_copy(f"copy.deepcopy gave a {type(clone).__name__}, not a {type(model).__name__}")
        self.clone = clone
        params = dict(clone.named_parameters())
        self.tracked = [(n, params[n]) for n in names if n in params and params[n].requires_grad]
        self.before = [p.detach().clone() for _, p in self.tracked]

    def prepared(self) -> engine.Prepared:
        """``prep`` with the copy as its model and the copy's modules as the selection."""
        assert self.clone is not None
        modules = dict(self.clone.named_modules(remove_duplicate=False))
        selection = [(name, modules[name]) for name, _ in self.prep.selection if name in modules]
        return replace(self.prep, loaded=replace(self.prep.loaded, model=self.clone), selection=selection)

    def step(self, steps: int) -> dict[str, float | None] | None:
        """``steps`` SGD steps on the copy (same inputs, loss and seed as the checked run: the engine's
        run loop with ``OptimiserSteps``, no hooks); the largest absolute change of each tracked
        parameter since the copy was made (None: it never got a gradient)."""
        if self.error is not None or not self.tracked:
            return None
        opts = self.prep.options
        gmax: dict[str, torch.Tensor] = {}
        changes: list[list[float]] = []

        def loss(output: Any, args: tuple[Any, ...], kwargs: dict[str, Any], model: nn.Module) -> tuple[torch.Tensor, None]:
            return build_loss(output, loss=opts.loss, target=opts.target, output_key=opts.output_key,
                              inputs=(args, kwargs), model=model, seed=opts.seed).value, None

        def after_backward() -> None:
            for n, p in self.tracked:
                if p.grad is not None:
                    self.got_grad[n] = True
                    g = p.grad.detach().abs().max().float()
                    gmax[n] = torch.maximum(gmax[n], g) if n in gmax else g

        def finished() -> None:  # the copy is still placed (as the run put it)
            with torch.no_grad():
                deltas = [(widened(p.detach()) - widened(b)).abs().max().reshape(1)
                          for (_, p), b in zip(self.tracked, self.before)]
            changes.extend(to_host(deltas + [gmax[n].reshape(1) for n in gmax]))

        plan = engine.OptimiserSteps(lambda: torch.optim.SGD([p for _, p in self.tracked], lr=self.lr), steps,
                                     after_backward, finished)
        try:
            run = engine.run_model(replace(self.prepared(), selection=[]), [],
                                   engine.RunPlan(loss=loss, steps=plan, show_phase=False))
        except HookcliError as exc:  # building the loss failed, or hookcli's own code raised on the copy
            cause = exc.__cause__ if isinstance(exc, InternalError) and isinstance(exc.__cause__, Exception) else exc
            self.error = f"the SGD step on the copy raised {describe_exception(cause)}"
            return None
        if isinstance(run.cause, SystemExit):  # the model's code called sys.exit on the copy's step
            self.error = f"the model exited with {exit_status(run.cause.code)} during the SGD step on the copy"
            return None
        if run.cause is not None:  # the main run passed; report this rule's own failure
            self.error = f"the SGD step on the copy raised {describe_exception(run.cause)}"
            return None
        named = list(gmax)
        self.grad_max.update({n: max(self.grad_max.get(n, 0.0), v[0])
                              for n, v in zip(named, changes[len(self.tracked):])})
        return {n: (v[0] if self.got_grad.get(n) else None) for (n, _), v in zip(self.tracked, changes)}


def measure(prep: engine.Prepared, rules: CheckRules) -> tuple[Report, Observations, BaseException | None]:
    """One forward, loss and backward with every hook: the Report and the probe's Observations (under
    ``torchrun``, both over every rank's batch)."""
    obs = Observations()
    dead = rules.get("dead_channels")
    frozen = {name for name, module in prep.index.named
              if next(module.parameters(), None) is not None and not any(p.requires_grad for p in module.parameters())}
    probe = Probe((lambda name: dead.limits(name)["dim"]) if dead else None, dict(prep.selection), frozen)
    cause: BaseException | None = None
    try:
        report = backward_report(prep, "check", stats=True, observer=probe)
    except ModelRaisedError as exc:
        if exc.report is None:
            raise
        report, cause = exc.report, exc
    # a failed rank's peers raised RanksFailed; under --shard ddp, shapes as one process over the whole batch
    probe.fill(obs, ranks=cause is None and check_ranks.active(), shape=lambda s: engine.global_shape_of(prep, s))
    return report, obs, cause


def measure_again(prep: engine.Prepared, rules: CheckRules) -> tuple[Report | None, Observations | None,
                                                                     BaseException | None]:
    """``measure`` for a second look at a copy: the model raising there (on any rank: the others get
    ``RanksFailed``) is that look's cause, on every rank, never the check's failure."""
    try:
        return measure(prep, rules)
    except RanksFailed as exc:
        return None, None, exc


#: The learning rate of the second look's single SGD step: enough to move a zero-initialised weight off
#: zero, small enough that the loss does not saturate (a saturated loss has no gradient to look at).
NUDGE_LR = 1e-3


def _second_look(prep: engine.Prepared, rules: CheckRules, report: Report, obs: Observations) -> None:
    """``params_change``'s SGD step(s) on a copy and, when a rule sees zeros that a zero or tiny
    initialisation could explain, a second look at another copy after one small SGD step (``NUDGE_LR``).

    An output that is all zero, channels that are zero, a gradient below ``grad_norm.min`` or a
    parameter that did not move are "initialised so" (a zero-initialised norm weight, a layer scale of
    1e-6) when that step brings them to life, and "dead" when it does not (a ReLU behind a bias of -10
    gets no gradient, so no step changes it). The rules read ``obs.stepped`` (the nudged copy's
    measurements) and ``obs.grace`` (the nudged gradient norm of each parameter params_change saw unchanged).
    """
    change_rule = rules.get("params_change")
    trainable = [p.name for p in report.params or [] if p.requires_grad]
    names = [n for n in trainable if change_rule is None or not change_rule.ignored(n, "param")]
    unchanged: list[str] = []
    if change_rule is not None:
        stepped = SteppedCopy(prep, trainable, change_rule["lr"])
        changes = stepped.step(change_rule["steps"])
        obs.change_error = stepped.error
        obs.changes = None if changes is None or not names else {n: changes[n] for n in names if n in changes}
        obs.grad_max = dict(stepped.grad_max)
        if check_ranks.active():
            check_ranks.merge_changes(obs)
        unchanged = [n for n, c in (obs.changes or {}).items() if c == 0 and not obs.grad_max.get(n)]
        del stepped
    if not (suspects(rules, report, obs) or unchanged):
        return
    try:
        nudged: SteppedCopy | None = SteppedCopy(prep, trainable, NUDGE_LR)
    except UnsupportedError:  # no copy, no second look: the rules judge the first run alone
        nudged = None
    if nudged is not None:
        nudged.step(1)  # under torchrun each rank steps its copy on its own batch
    if check_ranks.any_rank(nudged is None or nudged.error is not None):  # every rank looks, or none
        return
    assert nudged is not None
    later, later_obs, later_cause = measure_again(nudged.prepared(), rules)
    if later_cause is None and later is not None and later_obs is not None:
        obs.stepped = (later, later_obs)
        norms = {p.name: float((p.grad or {}).get("norm") or 0.0) for p in later.params or [] if p.grad is not None}
        obs.grace = {n: norms[n] for n in unchanged if norms.get(n)}
    del nudged
    if suspects(rules, report, obs, grads_only=True):
        _lifted_look(prep, rules, trainable, obs)


def _lifted_look(prep: engine.Prepared, rules: CheckRules, trainable: list[str], obs: Observations) -> None:
    """``grad_norm``'s look at a copy whose layer scales are set to ``LAYER_SCALE_LIFT``: a gradient
    below ``min`` only because a layer scale of 1e-6 multiplies everything behind it (edgenext's
    attention temperatures, CaiT's talking-heads projections) reaches ``min`` there; one of a detached
    or saturated block does not. Fills ``obs.lifted`` (the copy's report) and ``obs.layer_scales``."""
    scales = layer_scales(prep.loaded.model)
    if not scales:
        return
    try:
        lifted = SteppedCopy(prep, trainable, NUDGE_LR)
    except UnsupportedError:
        return
    assert lifted.clone is not None
    params = dict(lifted.clone.named_parameters())
    with torch.no_grad():
        for name in scales:
            params[name].fill_(LAYER_SCALE_LIFT)
    report, _, cause = measure_again(lifted.prepared(), rules)
    if cause is None and report is not None:
        obs.lifted, obs.layer_scales = report, scales


#: What ``check --data`` says about the rules that see the first batch alone.
FIRST_BATCH_NOTE = ("dead_channels, output_shape, params_change and the output's NaN/Inf count judge the first batch; "
                    "the rules on layer statistics, gradients and the loss see every batch")


def over_data(prep: engine.Prepared, first: Report) -> tuple[Report, BaseException | None]:
    """``check --data``: ``first`` (the checked run of the first batch) with its layer rows, parameter
    gradients and loss replaced by those of a run over every batch (``data_backward_report``: statistics
    merged, parameter gradients of the mean loss). What the rules measure beyond the report (dead
    channels, the output, the SGD step on a copy) stays the first batch's (``FIRST_BATCH_NOTE``). The
    model raising on a later batch is the run's failure (the ``runs`` rule), with the rows merged so far."""
    cause: BaseException | None = None
    try:
        merged = data_backward_report(prep, "check", stats=True)
    except ModelRaisedError as exc:
        if exc.report is None:
            raise
        merged, cause = exc.report, exc
    grads = {p.name: p.grad for p in merged.params or []}
    params = [replace(p, grad=grads.get(p.name, p.grad)) for p in first.params] if first.params is not None else None
    report = replace(first, inputs=merged.inputs, layers=merged.layers, params=params, loss=merged.loss or first.loss,
                     failure=merged.failure, notes=[*first.notes, *merged.notes, FIRST_BATCH_NOTE])
    return report, cause


def run_check(options: RunOptions, rules: CheckRules, training: StepOptions | None = None) -> CheckResult:
    """Forward and backward once, the extra measurements, the SGD step on a copy, then the rules.

    Every module is hooked unless ``layers``/``types``/``depth`` choose some; each run (the checked
    one and the SGD step on the copy) starts its RNGs from ``options.seed`` (``engine.running``), so both
    see the same dropout masks and the verdict is reproducible. A model that raises
    gives a FAIL for the ``runs`` pseudo-rule (other rules SKIP) and the partial report; bad options
    or rules raise UsageError/ConfigError before anything runs. ``training`` (``steps`` > 0): the
    training rules on N optimiser steps of a copy (``check/steps.py``; ``params_update`` supersedes
    ``params_change`` unless the config sets it).
    """
    started = time.perf_counter()
    training = training or StepOptions()
    if training.steps and check_ranks.active():
        raise UnsupportedError("check --steps N does not train under torchrun yet: its copy would take steps on "
                               "this rank's batch alone, without the gradients DDP averages over the ranks",
                               hint="run check --steps N in one process (without torchrun), or check without "
                                    "--steps under torchrun (every other rule is over the ranks)")
    rules = rules.for_steps(training.steps).for_ranks(check_ranks.active())
    # inference_mode(False): gradients, also when called under torch.inference_mode
    with exclusive(options.model), torch.inference_mode(False):
        return _run_check(options, rules, started, training)


def _run_check(options: RunOptions, rules: CheckRules, started: float, training: StepOptions) -> CheckResult:
    opts = options
    if opts.layers is None and opts.types is None and opts.depth is None and not opts.all_modules:
        opts = replace(opts, all_modules=True)
    base_rule = rules.get("baseline")
    baseline = load_baseline(base_rule["file"], rules.source) if base_rule else None
    prep = engine.prepare(opts, default_batch=2, batched=True)
    run_started = time.perf_counter()
    report, obs, cause = measure(prep, rules)
    if report.failure is None:
        channel_dims_exist(rules, report, obs)  # before anything more runs
    if prep.data is not None and cause is None:
        report, cause = over_data(prep, report)
    if check_ranks.active() and cause is None:  # every rank is here: a failed run on one raised on the others
        check_ranks.merge_norms(report)
    obs.baseline = baseline
    run_seconds = time.perf_counter() - run_started
    step_seconds: float | None = None
    if report.failure is None and report.params is not None:
        step_started = time.perf_counter()
        _second_look(prep, rules, report, obs)
        step_seconds = time.perf_counter() - step_started
    if report.failure is None:
        measure_probes(prep, rules, obs)
        if check_ranks.active():  # every rank reaches here: a failed run on one rank raised on the others
            check_ranks.merge_probes(rules, obs)
            obs.replicas = check_ranks.replicas(prep.index.named_parameters(), rules)
    train_seconds: float | None = None
    if (training.steps and report.failure is None
            and any(r.enabled and SPEC[r.name].needs_steps for r in rules.rules.values())):
        train_started = time.perf_counter()
        obs.training = train(prep, rules, training, report, obs.order)
        train_seconds = time.perf_counter() - train_started
    results, notes = evaluate(rules, report, obs)
    if obs.training is not None and obs.training.error is None and obs.training.losses:
        t = obs.training
        notes.insert(0, f"training: {t.steps} steps of {t.optimiser} on a copy; loss {t.losses[0]:.4g} -> "
                        f"{t.losses[-1]:.4g}")
    if report.failure is None and not any(r.called for r in report.layers):
        results = nothing_observed(report, results)
    for result in results:  # the rule's share of the time: its evaluation plus what it alone ran
        if result.rule == RUNS:
            result.seconds = run_seconds
        elif result.rule == "params_change" and step_seconds is not None:
            result.seconds = (result.seconds or 0.0) + step_seconds
        elif result.rule == "overfit_batch" and train_seconds is not None:  # the training run's time
            result.seconds = (result.seconds or 0.0) + train_seconds
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
    base_dir = config.path.parent if config is not None and config.path is not None else None
    if config is not None and config.path is not None:  # the config's own baseline file: in its repository
        own = parse_checks(table, source=source, base_dir=base_dir, section=section).rules["baseline"]["file"]
        if own is not None:
            confine_read(config.path, "baseline", own)
    if checks is not None:
        if not isinstance(checks, Mapping):
            raise ConfigError(f"checks must be a dict of rules, got {type(checks).__name__}",
                              hint="e.g. checks={'output_shape': [2, 10], 'grad_norm': {'max': 1e3}}")
        parse_checks(checks, source="checks")  # errors name the dict, not the file
        table.update(checks)
    if baseline is not None:
        check_path_text(baseline, "--baseline", ConfigError)
        entry = table.get("baseline")
        entry = dict(entry) if isinstance(entry, dict) else {}
        table["baseline"] = {**entry, "enabled": True, "file": str(Path(os.fspath(baseline)).resolve())}
    return parse_checks(table, source=source, base_dir=base_dir, section=section)


def api_check(model: Any, *, checks: Mapping[str, Any] | None, config: Config | None,
              baseline: str | os.PathLike[str] | None, options: dict[str, Any],
              training: StepOptions | None = None) -> CheckResult:
    """``hookcli.check``: options from ``config`` (a Config the API loaded, if any), keyword options
    over them; ``training``: the run of ``steps=N``."""
    cfg = config
    fields = config_options(cfg) if cfg is not None else {}
    if "model" in fields and cfg is not None:
        fields["model_source"], fields["model_roots"] = cfg.origin, cfg.roots()
    if "data" in fields and cfg is not None and "data" not in options:
        fields["data_roots"] = cfg.roots()
    if model is not None:
        fields.pop("model_source", None)
        fields.pop("model_roots", None)
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
    return run_check(RunOptions(model_source=source, **fields), rules, training)
