"""The rules of ``hookcli.watch`` (docs/watch.md#rules): pure functions of the logged steps' records.

Each rule is one ``WatchRule`` in ``SPECS``: its name, its settings (defaults and validators), its
evaluator (a function of a ``WatchStep`` record, its settings and its own ``RuleState``, returning
``Finding`` records; no torch, no hooks) and its row of docs/watch.md's table. ``RULES``, the
validation of ``rules={...}`` and ``[watch.rules]``, the hint and the docs table are derived from them.
The defaults are chosen so the healthy runs of tests/test_watch_rules.py stay quiet.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hookcli.commands.check.rules import overflowed_update, rounded_away
from hookcli.commands.watch_transformer_rules import TRANSFORMER_SPECS
from hookcli.commands.watch_spec import RuleState, Settings, Validator, WatchRule
from hookcli.config import Invalid, boolean, describe_value, integer, number
from hookcli.errors import ConfigError, did_you_mean
from hookcli.records import Finding, WatchParam, WatchStep, peak_ratio


@dataclass
class _NonfiniteState(RuleState):
    nonfinite_seen: bool = False
    #: logged steps in a row that the optimizer skipped with NaN/Inf gradients (since it last stepped)
    skipped_nonfinite: int = 0


@dataclass
class _FrozenState(RuleState):
    frozen_runs: dict[str, int] = field(default_factory=dict)  # logged steps in a row with no update


@dataclass
class _LossState(RuleState):
    losses: list[float] = field(default_factory=list)
    spiking: bool = False  # the previous logged step was a loss spike


@dataclass
class _GradState(RuleState):
    grad_norms: deque[float] = field(default_factory=deque)


@dataclass
class _DeadState(RuleState):
    dead_runs: dict[str, int] = field(default_factory=dict)  # logged steps in a row mostly zeros
    #: per channel of a layer's output: logged steps in a row that channel was mostly zeros
    channel_runs: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class _HistoryState(RuleState):
    #: per parameter or layer: its previous logged values (at most the rule's ``window``)
    history: dict[str, deque[float]] = field(default_factory=dict)
    runs: dict[str, int] = field(default_factory=dict)  # logged steps in a row over the limit


#: ``dead_units`` judges an output per channel when each channel held at least this many values in the
#: step (a channel of a few values, a Linear's on a small batch, is all zeros by chance): else as a whole.
CHANNEL_VALUES = 100


def _ordered(low: str, high: str, example: str, *, equal: bool = False) -> Callable[[str], Callable[[Settings], None]]:
    """A ``finish``: ``low`` must be below ``high`` (or not above it, ``equal``)."""
    def finish_for(rule: str) -> Callable[[Settings], None]:
        def finish(settings: Settings) -> None:
            if settings[low] > settings[high] or (not equal and settings[low] == settings[high]):
                relation = "must not exceed" if equal else "must be below"
                raise ConfigError(f"rules: {rule}'s {low} ({settings[low]:g}) {relation} its {high} "
                                  f"({settings[high]:g})", hint=f"e.g. {example}")
        return finish
    return finish_for


def _valid(rule: str, key: str, value: Any, validate: Callable[[Any], Any]) -> Any:
    try:
        return validate(value)
    except Invalid as exc:
        raise ConfigError(f"rules: {rule}.{key} expects {exc.expected}, got {describe_value(value)}",
                          hint=RULES_HINT) from None


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _bad(stats: Mapping[str, Any] | None) -> bool:
    return stats is not None and bool(stats["nan_count"] or stats["inf_count"])


def _norm(stats: Mapping[str, Any] | None) -> float | None:
    """The L2 norm of the values that ``stats`` describe (rms * sqrt(count)); None when not finite."""
    if stats is None or _bad(stats) or not _finite(stats["rms"]):
        return None
    return float(stats["rms"]) * math.sqrt(stats["count"])


def _median(values: list[float]) -> float:
    """The median of sorted ``values`` (not empty)."""
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


def _applied_finite(rec: WatchStep) -> bool:
    """The optimizer updated every watched parameter at this step from a finite gradient: a NaN/Inf in an
    output's gradient of the step did not reach the update (a GradScaler's skipped iteration, whose
    gradients the loop zeroed, merged into the step that ``optimizer.step()`` ended)."""
    return bool(rec.params) and all(p.update_norm is not None and p.grad is not None and not _bad(p.grad)
                                    for p in rec.params)


def _unscheduled(p: WatchParam) -> float:
    """``p``'s update ratio at its configured learning rate: divided by ``lr_scale`` where a scheduler
    has the rate below it (a warmup, an annealed tail)."""
    ratio = float(p.update_ratio)  # type: ignore[arg-type]
    return ratio / p.lr_scale if p.lr_scale is not None and 0 < p.lr_scale < 1 else ratio


def _frozen_cause(p: WatchParam) -> str:
    """Why a parameter did not change, as its gradient tells."""
    if p.grad is None:
        return "no gradient reached it: detached, unused, or zero_grad() before the step?"
    if p.grad["abs_max"] == 0:
        return "its gradient is exactly 0: a loss at its minimum, or a dead path?"
    rounding = rounded_away(p.dtype)
    return "it has a gradient: not in the optimizer? a learning rate of 0?" + (f" {rounding}" if rounding else "")


def _nonfinite(rec: WatchStep, cfg: Settings, state: Any) -> list[Finding]:
    """The first NaN/Inf of the run: the first output in execution order; else the first gradient in
    backward order (the last output in forward order); else a parameter's gradient; else an update
    that made finite weights NaN/Inf; else the loss. Gradients are not judged at a step the optimizer
    did not take (``skipped``), unless such steps with NaN/Inf gradients go on for ``skipped`` logged
    steps in a row: a GradScaler's start skips a few while it lowers its scale; a NaN that no scale
    removes makes it skip every step from then on (the parameters silently stop changing)."""
    if state.nonfinite_seen:
        return []
    where: tuple[str | None, str, Mapping[str, Any] | None] | None = None
    forward = [layer for layer in rec.layers if _bad(layer.stats)]
    backward = [layer for layer in rec.layers if _bad(layer.grad)]
    params = [p for p in rec.params if _bad(p.grad)]
    skipped_in_a_row = 0
    if not rec.skipped:
        if not rec.flight:  # the optimizer stepped: a run of skipped steps ends
            state.skipped_nonfinite = 0
    elif backward or params:
        state.skipped_nonfinite += 1
        skipped_in_a_row = state.skipped_nonfinite
        if skipped_in_a_row < cfg["skipped"]:
            # a step the optimizer did not take: a GradScaler skips the step when the scaled gradients
            # overflow (by design: it lowers its scale), so only its outputs and loss are judged
            backward, params = [], []
    if backward and _applied_finite(rec):
        backward = []  # an output gradient thrown away before the update (a GradScaler's skipped iteration)
    if forward:
        where = (_layer_name(forward[0]), "forward", forward[0].stats)
    elif backward:
        where = (_layer_name(backward[-1]), "backward", backward[-1].grad)
    elif params:
        where = (params[-1].name, "backward", params[-1].grad)
    elif updates := [p for p in rec.params if p.update_norm is not None and not _finite(p.update_norm)
                     and _finite(p.norm) and p.grad is not None]:
        # finite weights and gradients, yet the optimizer's step made the weights NaN/Inf (float16 Adam)
        state.nonfinite_seen = True
        p = updates[0]
        return [Finding("nonfinite", "error", rec.step, p.name, "update", float(p.update_norm), 0.0,  # type: ignore[arg-type]
                        f"first NaN/Inf of the run at step {rec.step}: {p.name}'s update; the optimizer's step "
                        f"made it NaN/Inf while its gradient was finite: {overflowed_update(p.dtype)}")]
    elif rec.loss is not None and not math.isfinite(rec.loss):
        where = (None, "loss", None)
    if where is None:
        return []
    state.nonfinite_seen = True
    name, direction, stats = where
    count = float(stats["nan_count"] + stats["inf_count"]) if stats is not None else None
    what = {"forward": "output", "backward": "gradient", "loss": "loss"}[direction]
    at = (f"{name}'s {what}" if name is not None else "the loss") + \
        (f" ({count:g} non-finite values)" if count is not None else f" is {rec.loss}")
    skips = (f", at {skipped_in_a_row} logged steps in a row that the optimizer skipped (a GradScaler skips "
             "a few while it lowers its scale at the start; this many means the gradients stay NaN/Inf "
             "and the parameters no longer change)") if skipped_in_a_row and direction == "backward" else ""
    # the loss's first non-finite step is not the NaN's first when the weights its forward used already
    # held one: an earlier unlogged step's NaN gradient (its loss finite) made them NaN at its update. A
    # norm tells that only when taken at the optimizer's pre-step (its update measured); without an
    # optimizer it is taken when the step ends, after the user's own update
    stale = [p.name for p in rec.params if p.norm is not None and not _finite(p.norm) and p.update_norm is not None]
    first = (rec.flight or rec.step == 0 or state.last_logged == rec.step - 1
             or (rec.loss_nonfinite_at == rec.step and not stale))
    if not first:  # a later step's victim: not called the first of the run
        since = (f"the loss turned non-finite at step {rec.loss_nonfinite_at}"
                 if rec.loss_nonfinite_at is not None and rec.loss_nonfinite_at < rec.step
                 else f"it appeared between steps {state.last_logged} and {rec.step}")
        if stale and rec.loss_nonfinite_at == rec.step:  # the loss turned at this step, its weights before it
            since += f" ({stale[0]} was already NaN/Inf in this step's forward)"
        return [Finding("nonfinite", "error", rec.step, name, direction, count, 0.0,
                        f"first NaN/Inf seen at logged step {rec.step}: {at}; {since}" + skips)]
    if rec.cause is not None and direction != "loss":  # the module whose code made it (engine.cause)
        seen = (f"its {what}: {count:g} non-finite values" if rec.cause.layer == name and count is not None
                and rec.cause.direction == direction else None)
        if rec.cause.layer is not None:  # (None: the batch or the loss, no module: the first seen is named)
            name, direction = rec.cause.layer, rec.cause.direction
        at = f"{rec.cause.text} ({seen})" if seen else f"{rec.cause.text}; first seen in {at}"
    return [Finding("nonfinite", "error", rec.step, name, direction, count, 0.0,
                    f"first NaN/Inf of the run at step {rec.step}: {at}" + skips)]

def _frozen(rec: WatchStep, cfg: Settings, state: Any) -> list[Finding]:
    """A trainable parameter whose update is exactly 0 at ``steps`` logged steps in a row; the message
    says what its gradient was (none, exactly 0, or one the optimizer did not apply). When no watched
    parameter changed at the step, one finding tells it for the whole model (a loss at its minimum, a
    learning rate of 0) instead of one per parameter."""
    runs = state.frozen_runs
    stuck: list[WatchParam] = []
    moved = False
    for p in rec.params:
        if not p.requires_grad:  # frozen on purpose since (requires_grad_(False) mid-run)
            runs[p.name] = 0
            continue
        if p.update_norm is None:
            continue
        runs[p.name] = runs.get(p.name, 0) + 1 if p.update_norm == 0 else 0
        moved = moved or p.update_norm != 0
        if runs[p.name] >= cfg["steps"] and state.new(p.name):
            stuck.append(p)
    if not moved and len(stuck) > 1:
        causes = {_frozen_cause(p) for p in stuck}
        cause = causes.pop() if len(causes) == 1 else "not in the optimizer? a learning rate of 0? no gradient?"
        return [Finding("frozen", "warning", rec.step, stuck[0].name, "update", 0.0, 0.0,
                        f"no parameter changed in {runs[stuck[0].name]} logged steps ({len(stuck)} parameters, "
                        f"{stuck[0].name} first; {cause})")]
    return [Finding("frozen", "warning", rec.step, p.name, "update", 0.0, 0.0,
                    f"{p.name} requires grad but did not change in {runs[p.name]} logged steps ({_frozen_cause(p)})")
            for p in stuck]

def _update_ratio(rec: WatchStep, cfg: Settings, state: Any) -> list[Finding]:
    """The median update / norm ratio over the weights (parameters of 2 dimensions or more) out of
    [low, high]: a learning rate far too high or too low. The median, as one weight of a healthy run
    can move a lot (a token initialised near 0, a first convolution at a random init); the finding
    names the weight furthest out."""
    weights = [p for p in rec.params if len(p.shape) >= 2
               and p.update_ratio is not None and math.isfinite(p.update_ratio) and p.update_ratio > 0]
    if not weights:
        return []  # no optimizer, or nothing moved (the frozen rule's)
    ratios = sorted((p.update_ratio, p.name) for p in weights)  # type: ignore[misc]
    median = _median([r for r, _ in ratios])
    # "too low" at the learning rate the weights were configured with: a scheduler's warmup or annealed
    # tail (cosine to 0, OneCycle's end) lowers it on purpose, and the update is proportional to it
    at_configured = sorted((_unscheduled(p), p.name) for p in weights)
    if median > cfg["high"]:
        high = True
    elif (low_median := _median([r for r, _ in at_configured])) < cfg["low"]:
        high, median, ratios = False, low_median, at_configured
    else:
        return []
    if not state.new("(high)" if high else "(low)"):
        return []  # told once a run: not at each logged step while the learning rate stays off
    limit = cfg["high"] if high else cfg["low"]
    worst, name = ratios[-1] if high else ratios[0]
    return [Finding("update_ratio", "warning", rec.step, name, "update", median, limit,
                    f"the weights' median update is {median:.3g} of their norm, {'above' if high else 'below'} "
                    f"{limit:g} (learning rate too {'high' if high else 'low'}?); {name}'s: {worst:.3g}")]

def _loss_spike(rec: WatchStep, cfg: Settings, state: Any) -> list[Finding]:
    """The loss above its recent level by more than ``z`` times its recent spread (a robust z-score:
    the median and 1.4826 x the median absolute deviation of the previous ``window`` logged losses,
    after ``warmup`` of them) and at least ``ratio`` x that median; told again only after a logged
    step without a spike (a loss that stays up is one spike)."""
    losses = state.losses
    if rec.loss is None or not math.isfinite(rec.loss):
        return []
    history = sorted(losses[-cfg["window"]:])
    losses.append(rec.loss)
    del losses[:-cfg["window"]]
    if len(history) < cfg["warmup"]:
        return []
    median = _median(history)
    spread = max(1.4826 * _median(sorted(abs(v - median) for v in history)), 1e-3 * abs(median), 1e-12)
    z = (rec.loss - median) / spread
    spiking = z > cfg["z"] and (median <= 0 or rec.loss >= cfg["ratio"] * median)
    told, state.spiking = state.spiking, spiking
    if not spiking or told:
        return []
    return [Finding("loss_spike", "warning", rec.step, None, "loss", z, cfg["z"],
                    f"loss spike at step {rec.step}: {rec.loss:.4g}, {z:.3g} times its recent spread above "
                    f"its recent median {median:.4g} ({rec.loss / median:.3g}x; last {len(history)} logged "
                    "steps)" if median > 0 else
                    f"loss spike at step {rec.step}: {rec.loss:.4g}, {z:.3g} times its recent spread above "
                    f"its recent median {median:.4g} (last {len(history)} logged steps)")]

def _grad_explode(rec: WatchStep, cfg: Settings, state: Any) -> list[Finding]:
    """The gradient's global norm above ``ratio`` times its mean over the previous ``window`` logged
    steps; the finding names the parameter whose gradient grew the most."""
    if any(_bad(p.grad) for p in rec.params):
        return []  # NaN/Inf: the nonfinite rule's
    norms = [(p.name, n) for p in rec.params if (n := _norm(p.grad)) is not None]
    if not norms:
        return []  # no backward reached the parameters
    total = math.sqrt(sum(n * n for _, n in norms))  # type: ignore[operator]
    history = state.grad_norms
    previous = sum(history) / len(history) if history else None
    history.append(total)
    if previous is None or previous <= 0 or total <= cfg["ratio"] * previous:
        return []
    top = max(norms, key=lambda item: item[1])  # type: ignore[arg-type,return-value]
    return [Finding("grad_explode", "warning", rec.step, top[0], "backward", total / previous, cfg["ratio"],
                    f"gradient norm {total:.4g} at step {rec.step}, {total / previous:.3g}x its recent mean; "
                    f"largest: {top[0]}'s")]

def _grad_depth(rec: WatchStep, cfg: Settings, state: Any) -> list[Finding]:
    """The gradient's RMS at the first selected output (in forward order) over the last's out of
    [low, high]: gradients vanishing (or exploding) across depth; names the first layer. Outputs
    whose gradient is exactly 0 are not judged: none came back through them (a zero-initialised
    head at step 0, as timm's Mixer's), which is not a gradient that shrank over depth."""
    rms = [(_layer_name(layer), float(layer.grad["rms"])) for layer in rec.layers
           if layer.grad is not None and not _bad(layer.grad) and layer.grad["count"]
           and _finite(layer.grad["rms"]) and layer.grad["rms"] != 0]
    if len(rms) < 2 or rms[-1][1] <= 0:
        return []
    (first, value), last = rms[0], rms[-1][0]
    ratio = value / rms[-1][1]
    if cfg["low"] <= ratio <= cfg["high"]:
        return []
    low = ratio < cfg["low"]
    if not state.new("(low)" if low else "(high)"):
        return []  # told once a run: not at each logged step while the gradients still vanish
    return [Finding("grad_depth", "warning", rec.step, first, "backward", ratio, cfg["low"] if low else cfg["high"],
                    f"gradients {'vanish' if low else 'explode'} across depth: {first}'s output gradient RMS is "
                    f"{ratio:.3g}x {last}'s")]

def _dead_units(rec: WatchStep, cfg: Settings, state: Any) -> list[Finding]:
    """Channels of an output that are zero in at least ``fraction`` of their values at ``steps`` logged
    steps in a row (the finding's value: how many channels); an output without channels counted, or whose channels held fewer than
    ``CHANNEL_VALUES`` values each: the whole output, likewise (its value: its zero fraction)."""
    runs = state.dead_runs
    found = []
    for layer in rec.layers:
        if layer.channel_zero_fraction and layer.stats is not None and layer.channels \
                and layer.stats["count"] >= CHANNEL_VALUES * layer.channels:
            found += _dead_channels(rec.step, _layer_name(layer), layer.channel_zero_fraction, cfg, state)
            continue
        if layer.stats is None or not layer.stats["count"] or not _finite(layer.stats["zero_fraction"]):
            continue
        name = _layer_name(layer)
        dead = layer.stats["zero_fraction"] >= cfg["fraction"]
        runs[name] = runs.get(name, 0) + 1 if dead else 0
        if runs[name] >= cfg["steps"] and state.new(name):
            found.append(Finding("dead_units", "warning", rec.step, name, "forward",
                                 float(layer.stats["zero_fraction"]), cfg["fraction"],
                                 f"{name}'s output is {layer.stats['zero_fraction']:.1%} zeros in "
                                 f"{runs[name]} logged steps in a row (dead units)"))
    return found

def _dead_channels(step: int, name: str, fractions: list[float], cfg: Settings, state: Any) -> list[Finding]:
    runs = state.channel_runs.get(name)
    if runs is None or len(runs) != len(fractions):
        runs = state.channel_runs[name] = [0] * len(fractions)
    for i, fraction in enumerate(fractions):
        runs[i] = runs[i] + 1 if _finite(fraction) and fraction >= cfg["fraction"] else 0
    dead = [i for i, run in enumerate(runs) if run >= cfg["steps"]]
    if not dead or not state.new(name):
        return []
    first = ", ".join(map(str, dead[:8])) + (", ..." if len(dead) > 8 else "")
    return [Finding("dead_units", "warning", step, name, "forward", float(len(dead)), cfg["fraction"],
                    f"{len(dead)} of the {len(runs)} channels of {name}'s output are at least "
                    f"{cfg['fraction']:.0%} zeros in {cfg['steps']} logged steps in a row (dead units): "
                    f"channels {first}")]

def _activation_growth(rec: WatchStep, cfg: Settings, state: Any) -> list[Finding]:
    """An output whose largest magnitude is above ``ratio`` times its RMS (massive activations)."""
    found = []
    for layer in rec.layers:
        stats, name = layer.stats, _layer_name(layer)
        if stats is None or _bad(stats) or not _finite(stats["rms"]) or not stats["rms"] \
                or not _finite(stats["abs_max"]):
            continue
        ratio = float(stats["abs_max"]) / float(stats["rms"])
        if ratio > cfg["ratio"] and state.new(name):
            found.append(Finding("activation_growth", "warning", rec.step, name, "forward", ratio, cfg["ratio"],
                                 f"{name}'s output has a value {ratio:.3g}x its RMS (massive activations)"))
    return found


def _adam_rms(rec: WatchStep, cfg: Settings, state: Any) -> list[Finding]:
    """Adam's normalised gradient g / (sqrt(v_hat) + eps): its median RMS over the parameters below
    ``low`` of the same without eps (eps dominates the second moment: eps too large for gradients
    of this size), told once a run; or a parameter's RMS above ``ratio`` x the largest of its previous
    ``window`` logged values (after ``warmup`` of them): its gradient grew faster than the second
    moment follows (the update is that many times any recent one), told once a parameter. The largest,
    not the median: a healthy run whose batches differ (one harder than the others, every few steps)
    has a few parameters' RMS 7.7x its median at that batch, never above 2.3x its recent largest."""
    measured = [p for p in rec.params if _finite(p.adam_rms) and _finite(p.adam_rms_without_eps)
                and p.adam_rms_without_eps > 0]  # type: ignore[operator]
    found: list[Finding] = []
    shares = sorted((p.adam_rms / p.adam_rms_without_eps, p.name) for p in measured)  # type: ignore[operator]
    if shares and (median := _median([v for v, _ in shares])) < cfg["low"] and state.new("(eps)"):
        share, name = shares[0]
        found.append(Finding("adam_rms", "warning", rec.step, name, "update", median, cfg["low"],
                             f"Adam's eps dominates: its normalised gradient's RMS is {median:.3g} of what it is "
                             f"without eps (median of {len(shares)} parameters; {name}'s: {share:.3g}): eps too "
                             "large for gradients of this size, the updates shrink to lr * g / eps"))
    jumps = []
    for p in measured:
        history = state.history.setdefault(p.name, deque(maxlen=cfg["window"]))
        level = max(history) if len(history) >= cfg["warmup"] else None
        history.append(float(p.adam_rms))  # type: ignore[arg-type]
        if level and p.adam_rms > cfg["ratio"] * level and state.new(p.name):  # type: ignore[operator]
            jumps.append((p.adam_rms / level, p.name, p.adam_rms, level))  # type: ignore[operator]
    if jumps:
        ratio, name, value, level = max(jumps)
        who = f"{name}'s" if len(jumps) == 1 else f"{len(jumps)} parameters' (the most: {name}'s)"
        found.append(Finding("adam_rms", "warning", rec.step, name, "update", ratio, cfg["ratio"],
                             f"{who} Adam normalised gradient RMS jumped to {value:.3g}, {ratio:.3g}x its recent "
                             f"largest {level:.3g}: the gradient grew faster than Adam's second moment follows (the "
                             "update is that many times any recent one; a loss spike ahead?)"))
    return found


def _update_grad_cosine(rec: WatchStep, cfg: Settings, state: Any) -> list[Finding]:
    """The weights' (parameters of 2 dimensions or more) median cosine between update and gradient,
    averaged over the last ``window`` logged steps that had one, above ``high`` (near 0 or positive:
    the updates no longer follow the gradient; SGD's is -1, Adam's clearly negative); told once a run,
    naming the weight whose cosine is highest. The median, as a small or near-converged weight's
    can be near 0 in a healthy run (Adam's momentum lagging a gradient that changes sign)."""
    cosines = sorted((p.update_grad_cosine, p.name) for p in rec.params
                     if len(p.shape) >= 2 and _finite(p.update_grad_cosine))
    if not cosines:
        return []
    history = state.history.setdefault("(median)", deque(maxlen=cfg["window"]))
    history.append(_median([c for c, _ in cosines]))
    mean = sum(history) / len(history)
    if len(history) < cfg["window"] or mean <= cfg["high"] or not state.new("(median)"):
        return []
    top, name = cosines[-1]
    return [Finding("update_grad_cosine", "warning", rec.step, name, "update", mean, cfg["high"],
                    f"the weights' median cosine between update and gradient is {mean:.3g} on average over "
                    f"{cfg['window']} logged steps, above {cfg['high']:g}: the updates do not follow the gradient "
                    f"(an optimizer bug? weight decay or noise dominating?); {name}'s: {top:.3g}")]


def _massive_activation(rec: WatchStep, cfg: Settings, state: Any) -> list[Finding]:
    """An output whose largest per-channel magnitude is above ``ratio`` times the median channel's
    (``records.peak_ratio``) at ``steps`` logged steps in a row: a channel of massive activations."""
    found = []
    for layer in rec.layers:
        name = _layer_name(layer)
        ratio, channel = peak_ratio(layer.channel_abs_max)
        if ratio is None:
            continue
        run = state.runs[name] = state.runs.get(name, 0) + 1 if ratio > cfg["ratio"] else 0
        if run >= cfg["steps"] and state.new(name):
            found.append(Finding("massive_activation", "warning", rec.step, name, "forward", ratio, cfg["ratio"],
                                 f"channel {channel} of {name}'s output reaches {ratio:.3g}x the median channel's "
                                 f"largest magnitude, {run} logged steps in a row (massive activations)"))
    return found


SPECS: tuple[WatchRule, ...] = (
    WatchRule("nonfinite", {"skipped": (32, integer(1))}, _nonfinite, (
        "the run's first NaN or Inf (severity `error`), named by the module whose code [made it](#where-a-naninf-was-made) "
        "when the step was traced, and seen first at: the first output in execution order that has one; else the first "
        "gradient in backward order (the last selected output, in forward order, whose gradient has one); else a "
        "parameter's gradient; else an update that made finite weights NaN/Inf from a finite gradient (direction "
        "`update`: float16 Adam, whose eps 1e-8 is 0 in float16); else the loss. At a `skipped` step only outputs and "
        "the loss: a `GradScaler` skips the steps whose scaled gradients overflow, by design; but `skipped` logged "
        "steps in a row with NaN/Inf gradients (the optimizer never stepping between) are the first NaN/Inf, at the "
        "last of them: a NaN that no scale removes makes the scaler skip every step, and the parameters silently stop "
        "changing. Nor an output's gradient when the optimizer updated every watched parameter from a finite gradient "
        "(a skipped iteration in the step `optimizer.step()` ends). `value`: how many non-finite values"),
        state=lambda _cfg: _NonfiniteState(), flight=True),
    WatchRule("frozen", {"steps": (3, integer(1))}, _frozen, (
        "a parameter that requires grad (one frozen mid-run by `requires_grad_(False)` does not) whose update is "
        "exactly 0 at `steps` logged steps in a row: not given to the optimizer, a learning rate of 0, no gradient "
        "reaching it, bfloat16 or float16 weights whose updates round away; the message says which its gradient "
        "suggests. When no parameter changed at all (a loss at its minimum, a learning rate of 0 everywhere) it is one "
        "finding for the model, naming the first parameter and the count"),
        state=lambda _cfg: _FrozenState()),
    WatchRule("update_ratio", {"low": (1e-6, number(0)), "high": (1.0, number(0, low_open=True))}, _update_ratio, (
        "the weights' (parameters of 2 dimensions or more) **median** `update_ratio` above `high` or below `low`: a "
        "learning rate far too high or too low; names the weight furthest out. \"Too low\" is judged at the learning "
        "rate a torch LR scheduler started from (its group's `initial_lr`): a warmup from near 0 or an annealed tail "
        "(cosine to 0, OneCycle's end) is low by design (`ReduceLROnPlateau` sets no `initial_lr`: the rates it "
        "lowers are judged as they are)"),
        finish=_ordered("low", "high", "{'low': 1e-7, 'high': 0.5}")("update_ratio")),
    WatchRule("loss_spike", {"z": (8.0, number(0, low_open=True)), "ratio": (1.4, number(1, low_open=True)),
                             "window": (20, integer(3)), "warmup": (5, integer(3))}, _loss_spike, (
        "the loss above its recent level by more than `z` times its recent spread (a robust z-score: the median and "
        "1.4826 × the median absolute deviation of the previous `window` logged losses, after `warmup` of them) and "
        "at least `ratio` × that median; told again only after a logged step without a spike. A cross-entropy around "
        "2.45 (spread 0.05) that jumps to 4.0 is one; a healthy noisy run is not (tests/test_watch_loss.py: a "
        "char-level bigram model, 150 steps all logged: its largest outlier was 6.5 spreads and 1.34x; with its "
        "learning rate raised 100x at step 100, a spike there)"),
        state=lambda _cfg: _LossState(), finish=_ordered("warmup", "window", "{'warmup': 5, 'window': 20}",
                                                         equal=True)("loss_spike")),
    WatchRule("grad_explode", {"ratio": (10.0, number(1, low_open=True)), "window": (5, integer(1))}, _grad_explode, (
        "the gradient's global norm (all watched parameters) above `ratio` × its mean over the previous `window` "
        "logged steps; names the parameter with the largest gradient"),
        state=lambda cfg: _GradState(grad_norms=deque(maxlen=cfg["window"]))),
    WatchRule("grad_depth", {"low": (1e-6, number(0, low_open=True)), "high": (1e6, number(1, low_open=True))},
              _grad_depth, (
        "the gradient's RMS at the first selected output (forward order) over the last's below `low` (vanishing "
        "across depth: a deep sigmoid stack) or above `high` (exploding); names the first. Outputs whose gradient is "
        "exactly 0 are left out: none came back through them (a zero-initialised head at step 0, as timm's Mixer's)"),
        finish=_ordered("low", "high", "{'low': 1e-6, 'high': 1e6}")("grad_depth")),
    WatchRule("dead_units", {"fraction": (0.99, number(0, 1)), "steps": (3, integer(1))}, _dead_units, (
        "channels of an output each at least `fraction` zeros at `steps` logged steps in a row (a ReLU killed by its "
        "init); `value`: how many channels; the message names the first indices. An output whose channels hold fewer "
        "than 100 values each in the step (a Linear's on a small batch), or without channels: the whole output at "
        "least `fraction` zeros, `value` its zero fraction"),
        state=lambda _cfg: _DeadState(), needs="channels"),
    WatchRule("activation_growth", {"ratio": (40.0, number(1, low_open=True))}, _activation_growth,
              "an output whose largest magnitude is above `ratio` × its RMS (massive activations)"),
    WatchRule("adam_rms", {"low": (0.1, number(0, 1, low_open=True)), "ratio": (5.0, number(1, low_open=True)),
                           "window": (10, integer(1)), "warmup": (3, integer(1))}, _adam_rms, (
        "Adam's (and AdamW's) normalised gradient g / (sqrt(v̂) + eps), whose RMS is the log's `adam_rms` (arXiv "
        "2304.13013): its median over the parameters below `low` of the same without eps (eps dominates v̂: eps too "
        "large for the gradients, the updates shrink to lr·g/eps), told once; or a parameter's above `ratio` × the "
        "largest of its previous `window` logged values, after `warmup` of them (its gradient grew faster than the "
        "second moment follows; the largest, as a batch harder than the others makes healthy jumps of 7x the "
        "median, below 2.3x the largest), told once a parameter; several at a step are one finding, naming the largest jump"),
        state=lambda _cfg: _HistoryState(), finish=_ordered("warmup", "window", "{'warmup': 3, 'window': 10}",
                                                            equal=True)("adam_rms"), needs="adam"),
    WatchRule("update_grad_cosine", {"high": (-0.05, number(-1, 1)), "window": (5, integer(1))}, _update_grad_cosine, (
        "the weights' (parameters of 2 dimensions or more) **median** `update_grad_cosine` (the cosine between a "
        "parameter's update and its gradient: -1 for SGD, clearly negative for Adam), averaged over the last `window` "
        "logged steps, above `high`: the updates do not follow the gradient (arXiv 2304.09871); names the weight "
        "whose cosine is highest; told once a run. The median, as a bias or a near-converged weight can be near 0 "
        "in a healthy run (Adam's momentum lagging a gradient that changes sign)"),
        state=lambda _cfg: _HistoryState(), needs="cosines"),
    WatchRule("massive_activation", {"ratio": (100.0, number(1, low_open=True)), "steps": (3, integer(1))},
              _massive_activation, (
        "an output whose `channel_peak_ratio` (its channels' largest magnitudes: the largest over the median) is "
        "above `ratio` at `steps` logged steps in a row: one channel of massive activations (Sun et al. 2024); names "
        "the channel. Outputs whose median channel is all zeros are left out (`dead_units`' case)"),
        state=lambda _cfg: _HistoryState(), needs="peaks"),
    *TRANSFORMER_SPECS,  # attention_entropy, attn_logit_growth, output_logit_drift
)

#: rule -> {key: (default, validator)} (every rule also takes ``enabled``), from ``SPECS``
RULES: dict[str, dict[str, tuple[Any, Validator]]] = {spec.name: dict(spec.settings) for spec in SPECS}
_SPEC = {spec.name: spec for spec in SPECS}

RULES_HINT = "e.g. rules={'loss_spike': {'ratio': 3.0}, 'dead_units': False}; the rules: " + ", ".join(RULES)


def rule_settings(rules: Mapping[str, Any] | None) -> dict[str, Settings]:
    """The enabled rules' settings: the defaults with ``rules`` over them (a rule's table of keys, or a
    boolean that switches it on or off). ConfigError for an unknown rule or key or a value out of range."""
    if rules is not None and not isinstance(rules, Mapping):
        raise ConfigError(f"rules must be a dict of rule settings, got {type(rules).__name__}", hint=RULES_HINT)
    given = dict(rules or {})
    for name in given:
        if name not in RULES:
            near = did_you_mean(str(name), RULES)
            raise ConfigError(f"rules: unknown rule {name!r}" + (f" ({near})" if near else ""), hint=RULES_HINT)
    out: dict[str, Settings] = {}
    for spec in SPECS:
        settings, enabled = _settings(spec, given.get(spec.name, {}))
        if spec.finish is not None:
            spec.finish(settings)
        if enabled:
            out[spec.name] = settings
    return out


def _settings(spec: WatchRule, raw: Any) -> tuple[Settings, bool]:
    """One rule's settings (its defaults with ``raw`` over them) and whether it is enabled."""
    if isinstance(raw, bool):
        raw = {"enabled": raw}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"rules: {spec.name!r} expects a dict of its keys or a boolean, got {describe_value(raw)}",
                          hint=RULES_HINT)
    settings = {key: default for key, (default, _) in spec.settings.items()}
    enabled = True
    for key, value in raw.items():
        if key == "enabled":
            enabled = _valid(spec.name, key, value, boolean)
        elif key in spec.settings:
            settings[key] = _valid(spec.name, key, value, spec.settings[key][1])
        else:
            valid = ", ".join(["enabled", *spec.settings])
            raise ConfigError(f"rules: {spec.name!r} has no key {key!r}", hint=f"its keys: {valid}")
    return settings, enabled


def config_rules(config: Any) -> dict[str, Any] | None:
    """A loaded Config's ``[watch.rules]`` (None without), checked now: a ConfigError names the file."""
    rules = config.watch.get("rules") if config is not None else None
    if rules is None:
        return None
    try:
        rule_settings(rules)
    except ConfigError as exc:
        raise ConfigError(f"{config.path}: [watch] {exc.message}", hint=exc.hint) from None
    return rules


def needed(settings: Mapping[str, Settings], what: str) -> bool:
    """Whether an enabled rule needs the engine to gather ``what`` (a ``WatchRule.needs``)."""
    return any(_SPEC[name].needs == what for name in settings)


class Rules:
    """The enabled rules over a run's logged steps, in step order: ``observe(step)`` is the findings at
    that step (each fact told once: a layer or parameter a rule has named is not named by it again,
    and the first NaN/Inf is the only one told)."""

    def __init__(self, settings: dict[str, Settings]) -> None:
        self.settings = settings
        self.states = {name: _SPEC[name].state(cfg) for name, cfg in settings.items()}

    def observe(self, record: WatchStep) -> list[Finding]:
        found: list[Finding] = []
        for spec in SPECS:
            if spec.name in self.settings:
                found.extend(spec.evaluate(record, self.settings[spec.name], self.states[spec.name]))
        for state in self.states.values():
            state.last_logged = record.step
        return found

    def observe_flight(self, record: WatchStep) -> list[Finding]:
        """The findings at a flight recorder's step (its outputs and loss only): the first NaN/Inf."""
        return [finding for spec in SPECS if spec.flight and spec.name in self.settings
                for finding in spec.evaluate(record, self.settings[spec.name], self.states[spec.name])]


def _layer_name(layer: Any) -> str:
    """The module's name, with the output's path when it is not the whole output (``attn[0]``)."""
    return layer.name + layer.output
