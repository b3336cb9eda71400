"""Plain data of the watch's transformer signals (docs/watch.md#attention-and-output-logits): one logged
step's attention heads per attention module, and its output logits' maximum and log-partition."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class AttentionLayer:
    """One module's fused attention calls (``F.scaled_dot_product_attention``) over one logged step,
    per head: the largest attention logit (``q . k * scale`` plus the additive mask, as softmax sees it)
    and the mean softmax entropy in nats, both over ``rows`` sampled query rows per head (None: no row
    of that head attended to anything)."""

    name: str  # the innermost module running the call; "name[sdpa 1]" for a module's second call on
    heads: int
    keys: int  # the keys each query row attends over (the first call's)
    calls: int
    rows: list[int]
    max_logit: list[float | None]
    entropy: list[float | None]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "heads": self.heads, "keys": self.keys, "calls": self.calls, "rows": self.rows,
                "max_logit": self.max_logit, "entropy": self.entropy}


@dataclass
class OutputLogits:
    """The model's output logits at one logged step: over their rows (every position of every sample),
    the mean of the largest logit and of the log-partition (``logsumexp`` over the last dimension)."""

    output: str  # where in the model's output: "" (the output itself), ".logits", "[0]"
    classes: int  # the last dimension (the vocabulary)
    rows: int
    max: float
    logsumexp: float

    def to_dict(self) -> dict[str, Any]:
        return {"output": self.output, "classes": self.classes, "rows": self.rows, "max": self.max,
                "logsumexp": self.logsumexp}
