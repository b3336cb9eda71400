"""The watch's rules over its transformer signals (docs/watch.md#attention-and-output-logits): attention
entropy collapsing, attention logits growing, the output logits' log-partition drifting.

Pure functions of the logged steps' records (``WatchStep.attention``, ``WatchStep.output_logits``). Each
judges a value against its early level: its mean over the first ``warmup`` logged steps that had it.
``watch_rules.Rules`` calls them with their settings (``TRANSFORMER_RULES``) and its ``told`` check
(each layer named once a rule).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hookcli.config import integer, number
from hookcli.records import AttentionLayer, Finding, WatchStep

Settings = dict[str, Any]
#: ``Rules._new``: whether a rule has not named a layer yet (it has from now on)
Told = Callable[[str, str], bool]

#: rule -> {key: (default, validator)}, as ``watch_rules.RULES``
TRANSFORMER_RULES: dict[str, dict[str, tuple[Any, Callable[[Any], Any]]]] = {
    "attention_entropy": {"fraction": (0.1, number(0, 1, low_open=True)), "warmup": (3, integer(1))},
    "attn_logit_growth": {"bound": (50.0, number(0, low_open=True)), "ratio": (25.0, number(1, low_open=True)),
                          "warmup": (3, integer(1))},
    "output_logit_drift": {"shift": (20.0, number(0, low_open=True)), "warmup": (3, integer(1))},
}


@dataclass
class TransformerState:
    """What the transformer rules keep of earlier logged steps: each value's early samples, by rule and
    key (a layer and head; the output)."""

    early: dict[str, dict[Any, list[float]]] = field(default_factory=dict)

    def level(self, rule: str, key: Any, value: float, warmup: int) -> float | None:
        """The early level of ``key`` once ``warmup`` samples are in (this one joins while they are not)."""
        samples = self.early.setdefault(rule, {}).setdefault(key, [])
        if len(samples) < warmup:
            samples.append(value)
            return None
        return sum(samples) / len(samples)


def _heads(layer: AttentionLayer, values: list[float | None]) -> list[tuple[int, float]]:
    return [(h, v) for h, v in enumerate(values) if v is not None and math.isfinite(v)]


def attention_entropy(state: TransformerState, rec: WatchStep, cfg: Settings, new: Told) -> list[Finding]:
    """A head whose attention entropy fell below ``fraction`` of its early level (entropy collapse: its
    softmax attends to ever fewer keys, Zhai et al. 2023); one finding per layer, naming its lowest
    head and how many heads are below."""
    found = []
    for layer in rec.attention:
        low = []
        for head, entropy in _heads(layer, layer.entropy):
            early = state.level("attention_entropy", (layer.name, head), entropy, cfg["warmup"])
            if early is not None and early > 0 and entropy < cfg["fraction"] * early:
                low.append((entropy / early, head, entropy, early))
        if not low or not new("attention_entropy", layer.name):
            continue
        share, head, entropy, early = min(low)
        found.append(Finding("attention_entropy", "warning", rec.step, layer.name, "forward", entropy,
                             cfg["fraction"] * early,
                             f"{layer.name} head {head}'s attention entropy collapsed to {entropy:.3g} nats at step "
                             f"{rec.step}, {share:.1%} of its early level {early:.3g} (its softmax attends to ever "
                             f"fewer keys; {len(low)} of {layer.heads} heads below {cfg['fraction']:.0%}; over "
                             f"{layer.rows[head]} sampled query rows)"))
    return found


def attn_logit_growth(state: TransformerState, rec: WatchStep, cfg: Settings, new: Told) -> list[Finding]:
    """A head whose largest attention logit is above ``bound``, or above ``ratio`` times its early level
    (at least 1): attention logits growing until softmax saturates (Dehghani et al. 2023, Wortsman et al.
    2023); one finding per layer, naming its largest head."""
    found = []
    for layer in rec.attention:
        high = []
        for head, top in _heads(layer, layer.max_logit):
            early = state.level("attn_logit_growth", (layer.name, head), top, cfg["warmup"])
            limit = min(cfg["bound"], cfg["ratio"] * max(early, 1.0)) if early is not None else cfg["bound"]
            if top > limit:
                high.append((top, head, early, limit))
        if not high or not new("attn_logit_growth", layer.name):
            continue
        top, head, early, limit = max(high, key=lambda item: item[0])
        since = f", {top / max(early, 1.0):.3g}x its early level {early:.3g}" if early is not None else ""
        found.append(Finding("attn_logit_growth", "warning", rec.step, layer.name, "forward", top, limit,
                             f"{layer.name} head {head}'s largest attention logit is {top:.4g} at step {rec.step}"
                             f"{since}, above {limit:.3g} (attention logits growing until softmax saturates: "
                             f"QK-layernorm or a lower learning rate?; {len(high)} of {layer.heads} heads)"))
    return found


def output_logit_drift(state: TransformerState, rec: WatchStep, cfg: Settings, new: Told) -> list[Finding]:
    """The output logits' mean log-partition (``logsumexp``) more than ``shift`` nats from its early
    level: the logits drifting as a whole (what z-loss holds near 0)."""
    logits = rec.output_logits
    if logits is None or not math.isfinite(logits.logsumexp):
        return []
    early = state.level("output_logit_drift", logits.output, logits.logsumexp, cfg["warmup"])
    if early is None or abs(logits.logsumexp - early) <= cfg["shift"]:
        return []
    if not new("output_logit_drift", logits.output or "(output)"):
        return []
    drift = logits.logsumexp - early
    return [Finding("output_logit_drift", "warning", rec.step, None, "forward", drift, cfg["shift"],
                    f"the output logits' log-partition drifted to {logits.logsumexp:.4g} at step {rec.step}, "
                    f"{drift:+.3g} nats from its early level {early:.4g} (mean over {logits.rows} rows; their "
                    f"largest logit: {logits.max:.4g}): the logits drift as a whole, z-loss holds it near 0")]


#: The rules in the order ``Rules.observe`` runs them.
CHECKS = (("attention_entropy", attention_entropy), ("attn_logit_growth", attn_logit_growth),
          ("output_logit_drift", output_logit_drift))
