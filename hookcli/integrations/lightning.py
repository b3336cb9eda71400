"""``HookcliCallback``: ``hookcli.watch`` as a Lightning ``Callback`` (docs/integrations.md#lightning).

    trainer = lightning.Trainer(callbacks=[HookcliCallback(every=50, out="runs/exp.jsonl")])

``on_fit_start`` watches the ``LightningModule`` and its optimizer; a step is one optimizer step (the
micro-batches of ``accumulate_grad_batches`` are one step), ended at the ``on_train_batch_end`` that
follows it with the step's loss (``outputs["loss"]`` summed over its micro-batches: the loss whose
gradient the step applied); ``on_fit_end`` closes the watch, ``on_exception`` too (the flight recorder
writes its ring). Manual optimization works the same way with one optimizer; with several, the module
is watched with no optimizer (every training batch a step).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from hookcli.integrations.session import WatchSession, missing

try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone package
    try:
        from pytorch_lightning import Callback
    except ImportError:
        raise missing("lightning", "lightning") from None


class HookcliCallback(Callback):
    """Watch a Lightning fit: the log, rules and stderr lines of ``hookcli watch -- CMD``.

    The options are ``hookcli.watch``'s (``every``, ``out``, ``layers``, ``types``, ``rules``,
    ``on_finding``, ``flight``, ``tensorboard_dir``); ``quiet=True``: nothing said on stderr. ``run`` is the ``WatchRun`` once the fit has ended (``run.findings``, ``run.errors``).
    """

    def __init__(self, *, every: int = 1, out: str | os.PathLike[str] | None = None,
                 layers: Sequence[str] | str | None = None, types: Sequence[str] | str | None = None,
                 rules: Mapping[str, Any] | None = None, on_finding: str = "warn", flight: int | None = None,
                 tensorboard_dir: str | os.PathLike[str] | None = None, quiet: bool = False) -> None:
        super().__init__()
        self.session = WatchSession(every=every, out=out, layers=layers, types=types, rules=rules,
                                    on_finding=on_finding, flight=flight, tensorboard_dir=tensorboard_dir, quiet=quiet)
        self._losses: list[Any] = []
        self._stepped = False
        self.run = None

    @property
    def findings(self) -> list[Any]:
        """Every finding of the rules so far."""
        return self.session.findings

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        optimizers = list(trainer.optimizers)
        self._losses, self._stepped, self.run = [], False, None
        self.session.start(pl_module, optimizers[0] if len(optimizers) == 1 else None)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._stepped = True  # (also when a GradScaler then skips the step: its line says skipped)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.session.open:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        self._losses.append(loss if _is_scalar(loss) else None)
        if not self._stepped and len(trainer.optimizers) == 1:
            return  # a micro-batch of gradient accumulation: the step goes on
        self._stepped = False
        losses, self._losses = self._losses, []
        # a sum of micro-batches' losses only where it is read: a logged step, or every step for the flight recorder
        wanted = self.session.steps % self.session.options["every"] == 0 or self.session.options["flight"] is not None
        self.session.step(_total(losses) if wanted or len(losses) == 1 else None)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self.run = self.session.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.session.open:
            self.run = self.session.close(exception)


def _is_scalar(loss: Any) -> bool:
    import torch

    return isinstance(loss, torch.Tensor) and loss.numel() == 1


def _total(losses: list[Any]) -> Any:
    """The step's loss: its one micro-batch's as it is (bit for bit), or the sum of its micro-batches'
    (Lightning divides each by accumulate_grad_batches); None when a micro-batch gave none."""
    if not losses or any(loss is None for loss in losses):
        return None
    if len(losses) == 1:
        return losses[0]
    total = losses[0].detach().double()
    for loss in losses[1:]:
        total = total + loss.detach().double()
    return total
