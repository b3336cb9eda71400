"""The rules of ``hookcli.watch`` (docs/watch.md#rules): pure functions of the logged steps' records.

Each rule reads ``WatchStep`` records only (no torch, no hooks), keeps what it needs of earlier logged
steps, and returns ``Finding`` records. Thresholds come from ``RULES`` (the defaults, chosen so the
healthy runs of tests/test_watch_rules.py stay quiet) overridden by ``rules={...}``, validated with the
config's validators as ``[checks]`` is.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hookcli.commands.check.rules import overflowed_update, rounded_away
from hookcli.commands.watch_transformer_rules import CHECKS as TRANSFORMER_CHECKS
from hookcli.commands.watch_transformer_rules import TRANSFORMER_RULES, TransformerState
from hookcli.config import Invalid, boolean, describe_value, integer, number
from hookcli.errors import ConfigError, did_you_mean
from hookcli.records import Finding, WatchParam, WatchStep

Settings = dict[str, Any]

#: rule -> {key: (default, validator)}; every rule also takes ``enabled`` (a boolean).
RULES: dict[str, dict[str, tuple[Any, Callable[[Any], Any]]]] = {
    "nonfinite": {"skipped": (32, integer(1))},
    "frozen": {"steps": (3, integer(1))},
    "update_ratio": {"low": (1e-6, number(0)), "high": (1.0, number(0, low_open=True))},
    "loss_spike": {"z": (8.0, number(0, low_open=True)), "ratio": (1.4, number(1, low_open=True)),
                   "window": (20, integer(3)), "warmup": (5, integer(3))},
    "grad_explode": {"ratio": (10.0, number(1, low_open=True)), "window": (5, integer(1))},
    "grad_depth": {"low": (1e-6, number(0, low_open=True)), "high": (1e6, number(1, low_open=True))},
    "dead_units": {"fraction": (0.99, number(0, 1)), "steps": (3, integer(1))},
    "activation_growth": {"ratio": (40.0, number(1, low_open=True))},
    **TRANSFORMER_RULES,  # attention_entropy, attn_logit_growth, output_logit_drift
}

#: ``dead_units`` judges an output per channel when each channel held at least this many values in the
#: step (a channel of a few values, a Linear's on a small batch, is all zeros by chance): else as a whole.
CHANNEL_VALUES = 100

RULES_HINT = "e.g. rules={'loss_spike': {'ratio': 3.0}, 'dead_units': False}; the rules: " + ", ".join(RULES)


def rule_settings(rules: Mapping[str, Any] | None) -> dict[str, Settings]:
    """The enabled rules' settings: the defaults with ``rules`` over them (a rule's table of keys, or a
    boolean that switches it on or off). ConfigError for an unknown rule or key or a value out of range."""
    if rules is not None and not isinstance(rules, Mapping):
        raise ConfigError(f"rules must be a dict of rule settings, got {type(rules).__name__}", hint=RULES_HINT)
    given = dict(rules or {})
    out: dict[str, Settings] = {}
    for name in given:
        if name not in RULES:
            near = did_you_mean(str(name), RULES)
            raise ConfigError(f"rules: unknown rule {name!r}" + (f" ({near})" if near else ""), hint=RULES_HINT)
    for name, keys in RULES.items():
        raw = given.get(name, {})
        if isinstance(raw, bool):
            raw = {"enabled": raw}
        if not isinstance(raw, Mapping):
            raise ConfigError(f"rules: {name!r} expects a dict of its keys or a boolean, got {describe_value(raw)}",
                              hint=RULES_HINT)
        settings = {key: default for key, (default, _) in keys.items()}
        enabled = True
        for key, value in raw.items():
            if key == "enabled":
                enabled = _valid(name, key, value, boolean)
            elif key in keys:
                settings[key] = _valid(name, key, value, keys[key][1])
            else:
                valid = ", ".join(["enabled", *keys])
                raise ConfigError(f"rules: {name!r} has no key {key!r}", hint=f"its keys: {valid}")
        if name == "update_ratio" and settings["low"] >= settings["high"]:
            raise ConfigError(f"rules: update_ratio's low ({settings['low']:g}) must be below its high "
                              f"({settings['high']:g})", hint="e.g. {'low': 1e-7, 'high': 0.5}")
        if name == "grad_depth" and settings["low"] >= settings["high"]:
            raise ConfigError(f"rules: grad_depth's low ({settings['low']:g}) must be below its high "
                              f"({settings['high']:g})", hint="e.g. {'low': 1e-6, 'high': 1e6}")
        if name == "loss_spike" and settings["warmup"] > settings["window"]:
            raise ConfigError(f"rules: loss_spike's warmup ({settings['warmup']}) must not exceed its window "
                              f"({settings['window']})", hint="e.g. {'warmup': 5, 'window': 20}")
        if enabled:
            out[name] = settings
    return out


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


@dataclass
class _State:
    """What the rules keep of earlier logged steps."""

    nonfinite_seen: bool = False
    last_logged: int = -1  # the previous logged step (-1: none yet)
    #: logged steps in a row that the optimizer skipped with NaN/Inf gradients (since it last stepped)
    skipped_nonfinite: int = 0
    losses: list[float] = field(default_factory=list)
    spiking: bool = False  # the previous logged step was a loss spike
    grad_norms: deque[float] = field(default_factory=deque)
    frozen_runs: dict[str, int] = field(default_factory=dict)  # logged steps in a row with no update
    dead_runs: dict[str, int] = field(default_factory=dict)  # logged steps in a row mostly zeros
    #: per channel of a layer's output: logged steps in a row that channel was mostly zeros
    channel_runs: dict[str, list[int]] = field(default_factory=dict)
    told: dict[str, set[str]] = field(default_factory=dict)  # rule -> the layers/parameters it named
    transformer: TransformerState = field(default_factory=TransformerState)  # the transformer rules' early levels


class Rules:
    """The enabled rules over a run's logged steps, in step order: ``observe(step)`` is the findings at
    that step (each fact told once: a layer or parameter a rule has named is not named by it again,
    and the first NaN/Inf is the only one told)."""

    def __init__(self, settings: dict[str, Settings]) -> None:
        self.settings = settings
        self.state = _State(grad_norms=deque(maxlen=settings.get("grad_explode", {}).get("window", 1)))

    def _new(self, rule: str, name: str) -> bool:
        """Whether ``rule`` has not named ``name`` yet (it has from now on)."""
        told = self.state.told.setdefault(rule, set())
        if name in told:
            return False
        told.add(name)
        return True

    def observe(self, record: WatchStep) -> list[Finding]:
        found: list[Finding] = []
        for name, check in (("nonfinite", self._nonfinite), ("frozen", self._frozen),
                            ("update_ratio", self._update_ratio), ("loss_spike", self._loss_spike),
                            ("grad_explode", self._grad_explode), ("grad_depth", self._grad_depth),
                            ("dead_units", self._dead_units),
                            ("activation_growth", self._activation_growth)):
            if name in self.settings:
                found.extend(check(record, self.settings[name]))
        for name, rule in TRANSFORMER_CHECKS:
            if name in self.settings:
                found.extend(rule(self.state.transformer, record, self.settings[name], self._new))
        self.state.last_logged = record.step
        return found

    def observe_flight(self, record: WatchStep) -> list[Finding]:
        """The findings at a flight recorder's step (its outputs and loss only): the first NaN/Inf."""
        return self._nonfinite(record, self.settings["nonfinite"]) if "nonfinite" in self.settings else []

    def _nonfinite(self, rec: WatchStep, cfg: Settings) -> list[Finding]:
        """The first NaN/Inf of the run: the first output in execution order; else the first gradient in
        backward order (the last output in forward order); else a parameter's gradient; else an update
        that made finite weights NaN/Inf; else the loss. Gradients are not judged at a step the optimizer
        did not take (``skipped``), unless such steps with NaN/Inf gradients go on for ``skipped`` logged
        steps in a row: a GradScaler's start skips a few while it lowers its scale; a NaN that no scale
        removes makes it skip every step from then on (the parameters silently stop changing)."""
        if self.state.nonfinite_seen:
            return []
        where: tuple[str | None, str, Mapping[str, Any] | None] | None = None
        forward = [layer for layer in rec.layers if _bad(layer.stats)]
        backward = [layer for layer in rec.layers if _bad(layer.grad)]
        params = [p for p in rec.params if _bad(p.grad)]
        skipped_in_a_row = 0
        if not rec.skipped:
            if not rec.flight:  # the optimizer stepped: a run of skipped steps ends
                self.state.skipped_nonfinite = 0
        elif backward or params:
            self.state.skipped_nonfinite += 1
            skipped_in_a_row = self.state.skipped_nonfinite
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
            self.state.nonfinite_seen = True
            p = updates[0]
            return [Finding("nonfinite", "error", rec.step, p.name, "update", float(p.update_norm), 0.0,  # type: ignore[arg-type]
                            f"first NaN/Inf of the run at step {rec.step}: {p.name}'s update; the optimizer's step "
                            f"made it NaN/Inf while its gradient was finite: {overflowed_update(p.dtype)}")]
        elif rec.loss is not None and not math.isfinite(rec.loss):
            where = (None, "loss", None)
        if where is None:
            return []
        self.state.nonfinite_seen = True
        name, direction, stats = where
        count = float(stats["nan_count"] + stats["inf_count"]) if stats is not None else None
        what = {"forward": "output", "backward": "gradient", "loss": "loss"}[direction]
        at = (f"{name}'s {what}" if name is not None else "the loss") + \
            (f" ({count:g} non-finite values)" if count is not None else f" is {rec.loss}")
        skips = (f", at {skipped_in_a_row} logged steps in a row that the optimizer skipped (a GradScaler skips "
                 "a few while it lowers its scale at the start; this many means the gradients stay NaN/Inf "
                 "and the parameters no longer change)") if skipped_in_a_row and direction == "backward" else ""
        first = (rec.flight or rec.step == 0 or self.state.last_logged == rec.step - 1
                 or rec.loss_nonfinite_at == rec.step)
        if not first:  # a later step's victim: not called the first of the run
            since = (f"the loss turned non-finite at step {rec.loss_nonfinite_at}"
                     if rec.loss_nonfinite_at is not None and rec.loss_nonfinite_at < rec.step
                     else f"it appeared between steps {self.state.last_logged} and {rec.step}")
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

    def _frozen(self, rec: WatchStep, cfg: Settings) -> list[Finding]:
        """A trainable parameter whose update is exactly 0 at ``steps`` logged steps in a row; the message
        says what its gradient was (none, exactly 0, or one the optimizer did not apply). When no watched
        parameter changed at the step, one finding tells it for the whole model (a loss at its minimum, a
        learning rate of 0) instead of one per parameter."""
        runs = self.state.frozen_runs
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
            if runs[p.name] >= cfg["steps"] and self._new("frozen", p.name):
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

    def _update_ratio(self, rec: WatchStep, cfg: Settings) -> list[Finding]:
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
        if not self._new("update_ratio", "(high)" if high else "(low)"):
            return []  # told once a run: not at each logged step while the learning rate stays off
        limit = cfg["high"] if high else cfg["low"]
        worst, name = ratios[-1] if high else ratios[0]
        return [Finding("update_ratio", "warning", rec.step, name, "update", median, limit,
                        f"the weights' median update is {median:.3g} of their norm, {'above' if high else 'below'} "
                        f"{limit:g} (learning rate too {'high' if high else 'low'}?); {name}'s: {worst:.3g}")]

    def _loss_spike(self, rec: WatchStep, cfg: Settings) -> list[Finding]:
        """The loss above its recent level by more than ``z`` times its recent spread (a robust z-score:
        the median and 1.4826 x the median absolute deviation of the previous ``window`` logged losses,
        after ``warmup`` of them) and at least ``ratio`` x that median; told again only after a logged
        step without a spike (a loss that stays up is one spike)."""
        losses = self.state.losses
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
        told, self.state.spiking = self.state.spiking, spiking
        if not spiking or told:
            return []
        return [Finding("loss_spike", "warning", rec.step, None, "loss", z, cfg["z"],
                        f"loss spike at step {rec.step}: {rec.loss:.4g}, {z:.3g} times its recent spread above "
                        f"its recent median {median:.4g} ({rec.loss / median:.3g}x; last {len(history)} logged "
                        "steps)" if median > 0 else
                        f"loss spike at step {rec.step}: {rec.loss:.4g}, {z:.3g} times its recent spread above "
                        f"its recent median {median:.4g} (last {len(history)} logged steps)")]

    def _grad_explode(self, rec: WatchStep, cfg: Settings) -> list[Finding]:
        """The gradient's global norm above ``ratio`` times its mean over the previous ``window`` logged
        steps; the finding names the parameter whose gradient grew the most."""
        if any(_bad(p.grad) for p in rec.params):
            return []  # NaN/Inf: the nonfinite rule's
        norms = [(p.name, n) for p in rec.params if (n := _norm(p.grad)) is not None]
        if not norms:
            return []  # no backward reached the parameters
        total = math.sqrt(sum(n * n for _, n in norms))  # type: ignore[operator]
        history = self.state.grad_norms
        previous = sum(history) / len(history) if history else None
        history.append(total)
        if previous is None or previous <= 0 or total <= cfg["ratio"] * previous:
            return []
        top = max(norms, key=lambda item: item[1])  # type: ignore[arg-type,return-value]
        return [Finding("grad_explode", "warning", rec.step, top[0], "backward", total / previous, cfg["ratio"],
                        f"gradient norm {total:.4g} at step {rec.step}, {total / previous:.3g}x its recent mean; "
                        f"largest: {top[0]}'s")]

    def _grad_depth(self, rec: WatchStep, cfg: Settings) -> list[Finding]:
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
        if not self._new("grad_depth", "(low)" if low else "(high)"):
            return []  # told once a run: not at each logged step while the gradients still vanish
        return [Finding("grad_depth", "warning", rec.step, first, "backward", ratio, cfg["low"] if low else cfg["high"],
                        f"gradients {'vanish' if low else 'explode'} across depth: {first}'s output gradient RMS is "
                        f"{ratio:.3g}x {last}'s")]

    def _dead_units(self, rec: WatchStep, cfg: Settings) -> list[Finding]:
        """Channels of an output that are zero in at least ``fraction`` of their values at ``steps`` logged
        steps in a row (the finding's value: how many channels); an output without channels counted, or whose channels held fewer than
        ``CHANNEL_VALUES`` values each: the whole output, likewise (its value: its zero fraction)."""
        runs = self.state.dead_runs
        found = []
        for layer in rec.layers:
            if layer.channel_zero_fraction and layer.stats is not None and layer.channels \
                    and layer.stats["count"] >= CHANNEL_VALUES * layer.channels:
                found += self._dead_channels(rec.step, _layer_name(layer), layer.channel_zero_fraction, cfg)
                continue
            if layer.stats is None or not layer.stats["count"] or not _finite(layer.stats["zero_fraction"]):
                continue
            name = _layer_name(layer)
            dead = layer.stats["zero_fraction"] >= cfg["fraction"]
            runs[name] = runs.get(name, 0) + 1 if dead else 0
            if runs[name] >= cfg["steps"] and self._new("dead_units", name):
                found.append(Finding("dead_units", "warning", rec.step, name, "forward",
                                     float(layer.stats["zero_fraction"]), cfg["fraction"],
                                     f"{name}'s output is {layer.stats['zero_fraction']:.1%} zeros in "
                                     f"{runs[name]} logged steps in a row (dead units)"))
        return found

    def _dead_channels(self, step: int, name: str, fractions: list[float], cfg: Settings) -> list[Finding]:
        runs = self.state.channel_runs.get(name)
        if runs is None or len(runs) != len(fractions):
            runs = self.state.channel_runs[name] = [0] * len(fractions)
        for i, fraction in enumerate(fractions):
            runs[i] = runs[i] + 1 if _finite(fraction) and fraction >= cfg["fraction"] else 0
        dead = [i for i, run in enumerate(runs) if run >= cfg["steps"]]
        if not dead or not self._new("dead_units", name):
            return []
        first = ", ".join(map(str, dead[:8])) + (", ..." if len(dead) > 8 else "")
        return [Finding("dead_units", "warning", step, name, "forward", float(len(dead)), cfg["fraction"],
                        f"{len(dead)} of the {len(runs)} channels of {name}'s output are at least "
                        f"{cfg['fraction']:.0%} zeros in {cfg['steps']} logged steps in a row (dead units): "
                        f"channels {first}")]

    def _activation_growth(self, rec: WatchStep, cfg: Settings) -> list[Finding]:
        """An output whose largest magnitude is above ``ratio`` times its RMS (massive activations)."""
        found = []
        for layer in rec.layers:
            stats, name = layer.stats, _layer_name(layer)
            if stats is None or _bad(stats) or not _finite(stats["rms"]) or not stats["rms"] \
                    or not _finite(stats["abs_max"]):
                continue
            ratio = float(stats["abs_max"]) / float(stats["rms"])
            if ratio > cfg["ratio"] and self._new("activation_growth", name):
                found.append(Finding("activation_growth", "warning", rec.step, name, "forward", ratio, cfg["ratio"],
                                     f"{name}'s output has a value {ratio:.3g}x its RMS (massive activations)"))
        return found


def _layer_name(layer: Any) -> str:
    """The module's name, with the output's path when it is not the whole output (``attn[0]``)."""
    return layer.name + layer.output
