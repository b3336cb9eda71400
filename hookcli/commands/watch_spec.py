"""What a watch rule is (``WatchRule``) and what it keeps between logged steps (``RuleState``): the
spec types the rule modules (``watch_rules``, ``watch_transformer_rules``) declare their rules with."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hookcli.records import Finding, WatchStep

Settings = dict[str, Any]


Validator = Callable[[Any], Any]


@dataclass
class RuleState:
    """What one rule keeps of earlier logged steps: the step before this one that was logged (-1: none
    yet) and the layers or parameters it has named (each told once)."""

    last_logged: int = -1
    told: set[str] = field(default_factory=set)

    def new(self, name: str) -> bool:
        """Whether the rule has not named ``name`` yet (it has from now on)."""
        if name in self.told:
            return False
        self.told.add(name)
        return True


Evaluator = Callable[[WatchStep, Settings, Any], list[Finding]]


@dataclass(frozen=True)
class WatchRule:
    """Everything about one watch rule, in one place. ``settings``: key -> (default, validator) (every
    rule also takes ``enabled``); ``evaluate(record, settings, state)``: its findings at a logged step;
    ``state(settings)``: a new ``RuleState`` for a run; ``doc``: what it flags (its docs row);
    ``finish(settings)``: a ConfigError for settings that are valid one by one but not together;
    ``flight``: also evaluated on a flight recorder's lines; ``needs``: what the engine gathers for it
    only while it is enabled (``"channels"``: each output's per-channel zero counts; one of the
    engine's ``SIGNALS``: ``"peaks"``, ``"adam"``, ``"cosines"``; ``"attention"``: the attention heads
    and output logits)."""

    name: str
    settings: Mapping[str, tuple[Any, Validator]]
    evaluate: Evaluator
    doc: str
    state: Callable[[Settings], RuleState] = lambda _cfg: RuleState()
    finish: Callable[[Settings], None] | None = None
    flight: bool = False
    needs: str | None = None

    def doc_row(self) -> str:
        """Its row of the rules table of docs/watch.md."""
        defaults = ", ".join(f"`{key} = {_doc_value(default)}`" for key, (default, _) in self.settings.items())
        return f"| `{self.name}` | {self.doc} | {defaults} |"


def _doc_value(value: Any) -> str:
    """A default as the docs write it: ``32``, ``1.4``, ``1e-6``, ``1e6``."""
    if isinstance(value, float) and value and not 1e-3 <= abs(value) < 1e5:
        mantissa, exponent = f"{value:g}".split("e")
        return f"{mantissa}e{int(exponent)}"
    return repr(value)
