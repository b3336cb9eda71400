"""``HookcliTrainerCallback``: ``hookcli.watch`` as a Hugging Face ``TrainerCallback``
(docs/integrations.md#hugging-face-trainer).

    trainer = Trainer(model, args, train_dataset=data, callbacks=[HookcliTrainerCallback(every=50, out="runs/exp.jsonl")])

``on_train_begin`` watches the model and the Trainer's optimizer (the torch optimizer inside
accelerate's wrapper); a step is one optimizer step (``gradient_accumulation_steps`` micro-batches are
one step). Its loss is the Trainer's own, bit for bit: the ``loss`` the Trainer logs for that step alone
(``logging_steps=1``, or a step that the log's previous loss entry directly precedes); a step the
Trainer logs no loss of its own for has the one ``backward()`` was called on (the watch's own). A step ends at the Trainer's log of it, else when the next
step begins, else at ``on_train_end``, which closes the watch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from hookcli.integrations.session import WatchSession, missing

try:
    from transformers import TrainerCallback
except ImportError:
    raise missing("transformers", "hf") from None


class HookcliTrainerCallback(TrainerCallback):
    """Watch a ``transformers.Trainer`` run: the log, rules and stderr lines of ``hookcli watch -- CMD``.

    The options are ``hookcli.watch``'s (``every``, ``out``, ``layers``, ``types``, ``rules``,
    ``on_finding``, ``flight``, ``tensorboard_dir``); ``quiet=True``: nothing said on stderr. ``run`` is
    the ``WatchRun`` once training has ended (``run.findings``, ``run.errors``).
    """

    def __init__(self, *, every: int = 1, out: str | os.PathLike[str] | None = None,
                 layers: Sequence[str] | str | None = None, types: Sequence[str] | str | None = None,
                 rules: Mapping[str, Any] | None = None, on_finding: str = "warn", flight: int | None = None,
                 tensorboard_dir: str | os.PathLike[str] | None = None, quiet: bool = False) -> None:
        self.session = WatchSession(every=every, out=out, layers=layers, types=types, rules=rules,
                                    on_finding=on_finding, flight=flight, tensorboard_dir=tensorboard_dir, quiet=quiet)
        self._pending = False
        self._loss_logged_at = 0
        self.run = None

    @property
    def findings(self) -> list[Any]:
        """Every finding of the rules so far."""
        return self.session.findings

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        self._pending, self._loss_logged_at, self.run = False, state.global_step, None
        self.session.start(model, _torch_optimizer(optimizer))

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._end_step(None)  # the previous step, which the Trainer logged no loss of

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._pending = True  # its optimizer.step() has returned; its loss may come in on_log

    def on_log(self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None,
               **kwargs: Any) -> None:
        if not logs or "loss" not in logs:
            return
        alone = state.global_step - self._loss_logged_at == 1  # the mean over that one step: its own loss
        self._loss_logged_at = state.global_step
        if alone:
            self._end_step(logs["loss"])

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._end_step(None)
        self.run = self.session.close()

    def _end_step(self, loss: Any) -> None:
        if self._pending:
            self._pending = False
            self.session.step(loss)


def _torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer the Trainer steps: accelerate's ``AcceleratedOptimizer`` holds it as ``.optimizer``."""
    import torch

    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer
