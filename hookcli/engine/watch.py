"""The engine side of ``hookcli.watch``: the engine's hooks over the user's own training loop.

A ``HookSet`` stays installed for the whole loop and is idle on unlogged steps (its hooks return at
once: no statistics, no tensor hooks, no host synchronisation). Steps end at ``optimizer.step()``
(the optimizer's own step hooks, registered through the engine) or at ``Watch.step()``; a logged
step's records (every selected output's calls merged with ``merge``, the parameters' norms,
gradients and updates, the loss) reach the host in one transfer and are handed to ``on_step``.
"""

from __future__ import annotations

import math
import numbers
from collections import deque
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import nn

from hookcli.engine import distributed, rank_stats, reduction
from hookcli.engine.attention import AttentionProbe
from hookcli.engine.cause import CauseTrace, CauseTracer, compiled_cause
from hookcli.engine.channels import ChannelDims, channel_abs_max, has_channels
from hookcli.engine.flight import Entry, FlightRecorder, flight_records
from hookcli.engine.roots import BackwardRoots
from hookcli.engine.watch_params import ParamWatch
from hookcli.engine.hooks import HookSet, ParamVectors, stale_graph_error
from hookcli.engine.session import HookSession, Call, OutputEntry
from hookcli.engine.taps import ChannelCounts, Gradients, Statistics, Tap
from hookcli.engine.step_rows import Groups, merged_channels, merged_outputs, watch_layers, watch_param
from hookcli.engine.stats import Transfer, Vector, to_host
from hookcli.errors import (CheckFailedError, HookcliError, InternalError, RanksFailed, UnsupportedError, UsageError,
                            internal_error)
from hookcli.records import Histogram, NonfiniteCause, WatchStep

#: What a logged step can gather for the rules besides the statistics (``WatchRule.needs``): each output's
#: per-channel largest magnitudes, Adam's normalised-gradient RMS, the cosines of update and gradient
SIGNALS = ("peaks", "adam", "cosines")


#: What the watch tells about a loop that calls ``w.step()`` where its steps come out shifted against
#: the optimizer's (docs/watch.md "What a step is"). Not told: a ``w.step()`` with no
#: ``optimizer.step()`` since the last, as a ``GradScaler`` that skips an overflowing step makes it.
STEP_ORDER = {
    "before": "optimizer.step() ran right after w.step(), with no forward or backward between: "
              "w.step() is called before optimizer.step(), so each logged line pairs one step's "
              "activations with the next step's update",
    "twice": "optimizer.step() ran twice without a w.step() between: w.step() is called in only "
             "some steps, so a logged step spans several optimizer steps",
    "some": "w.step() was called after optimizer.step() had ended the steps without it: w.step() is "
            "called in only some steps, so the logged steps are shifted",
    "empty": "w.step() ended step 0 before anything of it ran (no watched forward, no backward, no "
             "optimizer.step()): w.step() is called at the start of each step, so each logged line holds "
             "the step before its number",
}
#: What to do about any of them.
STEP_ORDER_FIX = "call w.step() after optimizer.step(), in every step or in none (docs/watch.md#what-a-step-is)"

#: What the watch raises into the loop rather than turning into a WatchWarning: a finding under
#: ``on_finding="raise"`` and a deliberate refusal (``UnsupportedError``: a watch that would record
#: nothing, such as ``stale_graph_error``). hookcli's own failures stop the watch instead (``_fail``).
_RAISED = (CheckFailedError, UnsupportedError)


def watched_params(model: nn.Module, selection: Sequence[tuple[str, nn.Module]]) -> list[tuple[str, nn.Parameter]]:
    """The trainable parameters inside the selected modules' subtrees, in ``named_parameters()`` order."""
    roots = {name for name, _ in selection}
    if "" in roots:
        return [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    chosen = []
    for name, p in model.named_parameters():
        parts = name.split(".")[:-1]
        if p.requires_grad and any(".".join(parts[:k]) in roots for k in range(1, len(parts) + 1)):
            chosen.append((name, p))
    return chosen


def compiled_inner(model: nn.Module) -> nn.Module:
    """The module under ``torch.compile(module)``, ``DistributedDataParallel(module)`` and
    ``nn.DataParallel(module)`` wrappers, in any nesting (its modules and parameters keep their own
    names, as in a plain one-process run), or ``model`` itself."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        inner = inner if isinstance(inner, nn.Module) else distributed.unwrap(model)
        if inner is model:
            return model
        model = inner


class StepWatcher:
    """Counts the user's steps and records every ``every``-th (steps 0, every, 2 * every, ...).

    Who ends a step: ``user_step`` (``Watch.step()``) once the user has called it; else the
    optimizer's post-step hook. Until that is known (the first step with an optimizer), the post-step
    hook closes the step and keeps its record pending: a ``user_step`` that follows adds the loss and
    hands it on (from then on ``user_step`` ends steps); the next optimizer step or ``close`` hands it
    on without (from then on the optimizer ends steps).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 selection: Sequence[tuple[str, nn.Module]], every: int,
                 on_step: Callable[[WatchStep], None], flight: int | None = None, histograms: bool = False,
                 channels: bool = True, on_failure: Callable[[str, int], None] | None = None,
                 attention: bool = True, gather: Collection[str] = SIGNALS) -> None:
        self.model, self.optimizer, self.selection = model, optimizer, list(selection)
        #: ``flight=K``: every step's output statistics in a ring of K steps, written (as records marked
        #: ``flight``, through ``on_step``) when a NaN/Inf appears or the loop raises (engine.flight)
        self.flight = FlightRecorder(flight) if flight else None
        #: every module call's finite flags on measured steps (engine.cause): who made a NaN/Inf; the
        #: flight recorder's steps' traces are kept as long as the ring keeps them
        self.cause: CauseTracer | None = None
        self._traces: deque[tuple[int, CauseTrace]] = deque(maxlen=2 * flight if flight else 1)
        #: under torchrun: this rank's flight records up to its own first NaN/Inf (``_agree_flight``)
        self._held: list[WatchStep] | None = None
        #: the attention heads and output logits of logged steps (engine.attention; not compiled, not torchrun)
        self.attention: AttentionProbe | None = None
        self._attention = attention  # (off: every rule that reads them is)
        #: the first step whose loss was not finite: a device scalar updated at every step's end (-1: none
        #: yet; ``torch.where``, no host synchronisation), read at logged steps; or the host's, for a number
        self._loss_first: torch.Tensor | None = None
        self._loss_first_host: int | None = None
        #: the tensors backward() is called on while the watch runs: the step's loss when none is given
        self.roots = BackwardRoots(lambda: self.hooks.accumulations)
        self.logged = True  # the step in progress is logged (else idle, or only flight-recorded)
        self.every = every
        self.hooks = HookSet()
        self.params = watched_params(compiled_inner(model), self.selection)
        backend = reduction.name_for(self.params[0][1].device if self.params else "cpu")

        def named(record: WatchStep) -> None:  # every line says which reduction backend computed it
            record.reduction = backend
            on_step(record)

        self.on_step = named
        self._join_ranks(model)
        #: True: user_step ends steps; False: the optimizer does; None: not known yet
        self.user_steps: bool | None = True if optimizer is None else None
        #: each logged step's per-channel zero counts (the dead_units rule's; under torchrun summed over
        #: the ranks in the step's first SUM)
        self.channel_counts = ChannelCounts(self.selection) if channels else None
        #: each logged step's per-channel largest magnitudes (the massive_activation rule's; not under torchrun)
        self.peaks = ChannelPeaks(self.selection) if "peaks" in gather and self.reduction is None else None
        #: what a logged step reads of the watched parameters at the optimizer's step events (engine.watch_params):
        #: the cosines between update and gradient and Adam's normalised-gradient RMS not under torchrun
        #: (``gather``: which of them); the histograms of the weights and their gradients with
        #: tensorboard_dir= (under torchrun over every rank's part: ``rank_stats.global_histograms``)
        self.param_watch = ParamWatch(self.hooks, optimizer, self.params, reduction=self.reduction,
                                      sharded=self.sharded, owned=self.owned,
                                      histograms=histograms if self.reduction is None else self.reduction.any_rank(histograms),
                                      gather=gather if self.reduction is None else ())
        self._pending: WatchStep | None = None
        self._stepped = False  # the optimizer stepped in the step in progress
        #: the optimizer stepped before any selected module ran or any backward reached a parameter in
        #: the (recorded) step in progress: w.step() before optimizer.step() once modules run after it
        self._early_step = False
        #: The first misuse of ``Watch.step()`` seen (``STEP_ORDER``'s message), until ``take_misuse``
        #: hands it on to be warned about; one per watch.
        self._misuse: str | None = None
        self._misuse_seen = False
        #: A finding raised inside the optimizer's hooks (``on_finding="raise"``; never raised into
        #: optimizer.step): the watch stops and ``raise_error`` raises it at the next ``Watch.step()`` or
        #: the block's end.
        self.error: BaseException | None = None
        #: Why the watch stopped: hookcli's own failure inside the loop (a hook, a statistic, a step's
        #: record), said once through ``on_failure(why, step)``; never raised into the loop (``_fail``).
        self.stopped: str | None = None
        self.on_failure = on_failure or (lambda _why, _step: None)

    def _join_ranks(self, model: nn.Module) -> None:
        """Under torchrun: the step's rows merged over the ranks (docs/distributed.md): ``reduction``,
        which parameters are sharded and which this rank owns; else None and empty."""
        group = distributed.process_group()
        if group is not None:
            distributed.check_supported(model)
        self.sharded = [distributed.is_sharded(name, p) for name, p in self.params] if group is not None else []
        self.reduction = rank_stats.StepReduction(group, distributed.tp_groups(model, self.params)) \
            if group is not None else None
        self.owned = [distributed.owns(p, self.reduction.tp_first) for _, p in self.params] \
            if self.reduction is not None else []

    @property
    def step(self) -> int:
        """The step in progress (0-based)."""
        return self.hooks.step

    def start(self) -> None:
        """Install the hooks (and the optimizer's step hooks): the loop's first step begins."""
        # (training_root: the model's .eval() with no_grad is a validation forward, left out)
        taps: list[Tap] = [Statistics(), *([self.channel_counts] if self.channel_counts else []), Gradients(zeros=True),
                           *([self.peaks] if self.peaks else [])]
        self.hooks.install(self.model, self.selection, taps, params=self.params,
                           training_root=compiled_inner(self.model))
        assert self.hooks.session is not None
        if not self.hooks.compiled:  # (compiled: no hooks beyond the selected modules', see docs/watch.md)
            self.cause = CauseTracer(compiled_inner(self.model), self.hooks.session.validating)
            if self.reduction is None and self._attention:
                self.attention = AttentionProbe(compiled_inner(self.model), self.hooks.session.validating)
        try:
            if self.optimizer is not None:
                self.hooks.hook_optimizer(self.optimizer, self._guarded(self._pre_step),
                                          self._guarded(self._post_step))
                returned = self._guarded(self.param_watch.closure_returned)
                self.hooks.observe_closures(self.optimizer, lambda: self.param_watch.taken,
                                            lambda: returned(self.optimizer, (), {}))
            self._begin()
            self.roots.install()
        except BaseException:
            self.hooks.remove()
            if self.cause is not None:
                self.cause.remove()
            if self.attention is not None:
                self.attention.remove()
            raise

    def _begin(self) -> None:
        """A step begins: the hooks record it when it is logged (or with ``flight``) and are idle otherwise."""
        assert self.hooks.session is not None
        halted = self.error is not None or self.stopped is not None
        self.logged = not halted and self.step % self.every == 0
        # (channel counts and peaks at the logged steps only, not at the flight recorder's others)
        self.hooks.session.begin_step(recording=self.logged or (not halted and self.flight is not None),
                                      full=self.logged)
        if self.cause is not None:
            self.cause.arm(not self.hooks.session.idle)
        if self.attention is not None:
            self.attention.arm(self.logged)
        if self.logged:
            self.hooks.mark_grads()  # under a process group: a .grad DDP writes without this rank's backward
        self.param_watch.begin()
        self._stepped = self._early_step = False

    def _guarded(self, fn: Callable[[], None]) -> Callable[..., None]:
        def hook(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
            if self.error is not None or self.stopped is not None:
                return
            try:
                fn()
            except _RAISED as exc:  # a finding (on_finding="raise") or a refusal: raised at the next w.step()
                self.error = exc    # or the block's end
                self._begin()  # idle from now on
            except Exception as exc:  # hookcli's failure: never the optimizer's
                self._fail(exc, "hookcli.watch's optimizer step hook")

        return hook

    def _fail(self, exc: Exception, where: str, step: int | None = None) -> None:
        """hookcli's own failure inside the user's loop (at ``step``, by default the one in progress): the
        watch stops (idle from now on: the loop runs on as unwatched, its numbers unchanged) and says why
        once, through ``on_failure``."""
        if self.stopped is not None:
            return
        if not isinstance(exc, HookcliError):
            exc = internal_error(exc, where)
        # (an internal error's hint, --debug, is the command line's)
        self.stopped = exc.message if isinstance(exc, InternalError) else f"{exc.message} ({exc.hint})"
        self.logged = False
        if self.hooks.session is not None:
            self.hooks.session.go_idle()
        self.on_failure(self.stopped, self.step if step is None else step)

    def _pre_step(self) -> None:
        if self.user_steps and self._stepped:
            self._misused("twice")
        if self._pending is not None:  # no user_step followed the first step: the optimizer ends steps
            self.user_steps = False
            self._hand_on()
        if self.logged:
            self.param_watch.pre_step()

    def _post_step(self) -> None:
        self._stepped = True
        self.param_watch.post_step()
        if self.user_steps:
            session = self.hooks.session
            # nothing of the step ran before the optimizer's step (an LBFGS closure runs inside it)
            self._early_step = (session is not None and not session.idle and not session.calls
                                and not self.hooks.backward_reached)
            return
        record = self._close(None)
        if self.user_steps is None:
            self._pending = record or WatchStep(-1)  # step -1: an unlogged step, nothing to hand on
        elif record is not None:
            self.on_step(record)

    def user_step(self, loss: Any = None) -> None:
        """``Watch.step()``: end the step in progress (or add ``loss`` to the first step, which the
        optimizer's post-step closed already) and hand its record on when it is logged. Raises a finding
        (``on_finding="raise"``) and a bad ``loss`` only: hookcli's own failure stops the watch (``_fail``)."""
        self.raise_error()
        check_loss(loss)
        try:
            self._end_by_user(loss)
        except _RAISED:
            raise
        except Exception as exc:
            self._fail(exc, "hookcli.watch's w.step()")

    def _end_by_user(self, loss: Any) -> None:
        pending, self._pending = self._pending, None
        if self.user_steps is False:
            self._misused("some")
        session = self.hooks.session
        if (self.step == 0 and self.optimizer is not None and pending is None and not self._stepped
                and session is not None and not session.idle and not session.calls
                and not self.hooks.backward_reached):
            self._misused("empty")  # w.step() at the top of the loop: the log's steps are one behind
        self.user_steps = True
        self.note_loss(loss, pending.step if pending is not None else self.step)
        if self._early_step and self.hooks.session is not None and self.hooks.session.calls:
            self._misused("before")  # the step's modules ran after its optimizer step, not before
        if pending is not None:
            if pending.step >= 0:
                if loss is not None:  # (else the loss backward() was called on, if any)
                    pending.loss = to_host([_loss_vector(loss)])[0][0]
                if self.reduction is not None:  # the ranks' mean, as _collect gives it
                    pending.loss = self.reduction.rank_mean(pending.loss)
                self.on_step(pending)
            return
        skipped = self.optimizer is not None and not self._stepped  # GradScaler skipped it, or a micro-batch
        record = self._close(loss)
        if record is not None:
            record.skipped = skipped
            self.on_step(record)

    def note_loss(self, loss: Any, step: int) -> None:
        """Keep the first step whose loss is not finite (every step, logged or not): on the loss's device
        for a tensor (two small ops, no host synchronisation), on the host for a number."""
        if loss is None or self.error is not None or self._loss_first_host is not None:
            return
        if not isinstance(loss, torch.Tensor):
            if not math.isfinite(_loss_vector(loss)[0]):
                self._loss_first_host = step
            return
        with torch.no_grad():
            bad = torch.isfinite(loss.detach()).all().logical_not()
            first = self._loss_first
            if first is None or first.device != bad.device:
                first = self._loss_first = torch.full((), -1, dtype=torch.int64, device=bad.device)
            first.copy_(torch.where(bad & (first < 0), step, first))

    def _loss_first_step(self, values: list[float] | None) -> int | None:
        """The first step whose loss was not finite, from the device scalar's host value (``values``)."""
        if self._loss_first_host is not None:
            return self._loss_first_host
        return int(values[0]) if values is not None and values[0] >= 0 else None

    def _misused(self, kind: str) -> None:
        """Note the loop's first misuse of ``Watch.step()`` (``STEP_ORDER``'s ``kind``); nothing else changes."""
        if not self._misuse_seen:
            self._misuse, self._misuse_seen = f"hookcli.watch: {STEP_ORDER[kind]}; {STEP_ORDER_FIX}", True

    def take_misuse(self) -> str | None:
        """The message of a misuse of ``Watch.step()`` not handed on yet (once), else None."""
        message, self._misuse = self._misuse, None
        return message

    def _hand_on(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None and pending.step >= 0:
            self.on_step(pending)

    def close(self, raised: bool = False) -> None:
        """Remove every hook; hand on a pending record, or the record of a step that ``user_step`` would
        have ended after the optimizer's step (also when the loop raised). With ``flight``: the loop
        ``raised``: the ring's steps not written yet, the step in progress included, are written;
        else they are when a NaN/Inf appeared."""
        try:
            if self.error is None and self.stopped is None:
                self._hand_on()
                if self.user_steps and self._stepped and (record := self._close(None)) is not None:
                    self.on_step(record)
                elif raised and self.flight is not None and self.hooks.session is not None \
                        and self.hooks.session.calls:
                    self.flight.push(self.step, merged_outputs(self.hooks.session.calls), None)
                if self.flight is not None and self.reduction is not None and not raised:
                    self._agree_flight()  # every rank ends its block: the ranks agree there
                elif self.flight is not None:
                    if not raised:
                        self.flight.read()
                    for record in self._held or ():  # (under torchrun, not agreed: this rank's own)
                        self.on_step(record)
                    self._write_flight(everything=raised)
        except _RAISED:
            raise
        except Exception as exc:
            self._fail(exc, "hookcli.watch's end")
        finally:
            self.hooks.remove()
            self.roots.remove()
            if self.cause is not None:
                self.cause.remove()
            if self.attention is not None:
                self.attention.remove()
            self.param_watch.begin()  # (the pre-step's copies go)

    def raise_error(self) -> None:
        """Raise the finding raised inside the optimizer's hooks (``on_finding="raise"``), once."""
        exc, self.error = self.error, None
        if exc is not None:
            raise exc

    def _close(self, loss: Any) -> WatchStep | None:
        """End the step in progress; its record when it is logged (one host transfer). The next step begins."""
        session = self.hooks.session
        assert session is not None
        captured = self.roots.take()
        if loss is None and captured is not None:  # the script gave none: the one backward() was called on
            loss = captured
            self.note_loss(loss, self.step)
        if session.idle:
            self.hooks.end_step()
            self._begin()
            return None
        step = self.step
        trace = self.cause.take() if self.cause is not None else None
        try:
            if self.reduction is None:
                session.raise_error()
            groups = merged_outputs(session.calls)
            if self.flight is not None:
                if trace is not None:
                    self._traces.append((step, trace))
                self.flight.push(step, groups, _loss_vector(loss) if loss is not None else None)
                if not self.logged:
                    self._flight_found()
                    return None
                self.flight.read()  # a logged step transfers anyway
                self._flight_found(before=step)
                self.flight.written = step
            params, histograms = self.param_watch.at_close()
            # a backward reached the model, yet none of its hooks fired (under torchrun: not checked, a
            # rank that raised here alone would leave the others waiting in the step's collectives)
            if (self.reduction is None and self.hooks.compiled and not session.calls
                    and any(p.grad is not None for p in params)):
                raise stale_graph_error()
            record = self._collect(step, groups, params, self.param_watch.updates, loss, histograms, trace)
            if self.reduction is not None and self.flight is not None and self.reduction.flagged:
                self._agree_flight(record)  # a rank's flight recorder found a NaN/Inf (every rank knows it)
            if self.reduction is not None and self.cause is not None and _nonfinite(record):
                record.cause = self._ranks_cause(trace)  # (every rank gets here: the record is every rank's)
            for entry, scale in zip(record.params, self.param_watch.lr_scales or ()):
                entry.lr_scale = scale
            for entry, (_, p) in zip(record.params, self.params):
                entry.requires_grad = p.requires_grad
        except RanksFailed as failed:  # under torchrun: every rank stops at the step, none waits
            try:
                session.raise_error()  # this rank's own failure, if it had one
            except Exception as own:
                self._fail(own, "hookcli.watch's step record", step)
            self._fail(failed, "hookcli.watch's step record", step)
            return None
        except _RAISED:  # on_finding="raise" at a flight recorder's line; a refusal (stale_graph_error)
            raise
        except Exception as exc:  # hookcli's own failure: this step is not logged, the watch stops
            self._fail(exc, "hookcli.watch's step record", step)
            return None
        finally:
            self.hooks.end_step()
            self._begin()
        return record

    def _ranks_cause(self, trace: CauseTrace | None) -> NonfiniteCause | None:
        """Under torchrun, at a logged step whose merged record holds a NaN/Inf: the maker in the lowest
        rank whose own trace found one (its causes gathered: every rank's record stays the same)."""
        assert self.reduction is not None
        causes: list[Any] = [None] * self.reduction.world
        torch.distributed.all_gather_object(causes, trace.cause() if trace is not None else None,
                                            group=self.reduction.group)
        self.reduction.collectives += 2  # (the objects' sizes, then the objects)
        return next((cause for cause in causes if cause is not None), None)

    def _write_flight(self, *, before: int | None = None, everything: bool = False) -> None:
        """Hand on the ring's steps not written yet (before ``before``: that step's own line follows) as
        flight records: once, when the first NaN/Inf is known, and when the loop raised (``everything``)."""
        flight = self.flight
        assert flight is not None
        if not everything and (flight.first_bad is None or flight.dumped):
            return
        flight.dumped = flight.first_bad is not None
        upto = None if everything else flight.first_bad  # the K steps up to the first NaN/Inf, as on CPU
        for record in self._flight_lines(flight.unwritten(before, upto)):
            self.on_step(record)

    def _flight_lines(self, entries: list[Entry]) -> list[WatchStep]:
        """The ring's ``entries`` as flight records, the first NaN/Inf's step with its maker."""
        assert self.flight is not None
        traces = dict(self._traces)
        records = flight_records(entries)
        for record in records:
            if record.step == self.flight.first_bad and (trace := traces.get(record.step)) is not None:
                record.cause = trace.cause()  # one more transfer, once a run
            elif record.step == self.flight.first_bad and self.hooks.compiled:
                record.cause = compiled_cause(record)
        return records

    def _flight_found(self, before: int | None = None) -> None:
        """The ring's steps up to the first NaN/Inf, once known: written; under torchrun held, as the ranks
        agree where they meet (``_agree_flight``)."""
        if self.reduction is None:
            self._write_flight(before=before)
        else:
            self._hold_flight(before)

    def _hold_flight(self, before: int | None = None) -> None:
        """Under torchrun, once this rank's flight recorder knows its first NaN/Inf: the K steps up to it
        as records (before ``before``: that step's own line follows), held, not written: the NaN may have
        been made earlier on another rank (DDP's averaged gradient carries it to every rank's weights)."""
        flight = self.flight
        assert flight is not None
        if flight.first_bad is not None and not flight.dumped and self._held is None:
            self._held = self._flight_lines(flight.unwritten(before, flight.first_bad))

    def _agree_flight(self, record: WatchStep | None = None) -> None:
        """Under torchrun, where every rank meets (a logged step at which a rank's flight recorder had
        found a NaN/Inf, said in the step's first SUM; the block's end): the ranks agree on the run's
        first NaN/Inf step and the lowest rank that had it (one MIN ``all_reduce``); every rank then
        writes that rank's held records (one ``all_gather_object``): the same maker, step and rank on all.
        At a logged step (``record``) after the agreed one, the step's ``nonfinite_rank`` goes: the flight
        line named the rank that made the run's first NaN/Inf, not this step's lowest rank with one."""
        flight, ranks = self.flight, self.reduction
        assert flight is not None and ranks is not None
        if flight.dumped:
            return
        flight.read()
        self._hold_flight()
        found = ranks.first_rank(flight.first_bad)
        if found is None:
            return
        step, maker = found
        held: list[Any] = [None] * ranks.world
        torch.distributed.all_gather_object(held, self._held if ranks.rank == maker else None, group=ranks.group)
        ranks.collectives += 2  # (the objects' sizes, then the objects)
        flight.first_bad, flight.dumped, self._held = step, True, None
        ranks.nonfinite_seen = True  # (a later logged step's nonfinite_rank would name a later rank's)
        for line in held[maker]:
            if line.step == step and (cause := line.cause) is not None:
                line.cause = NonfiniteCause(cause.layer, cause.direction, f"{cause.text} on rank {maker}")
            self.on_step(line)
        if record is not None and step < record.step:
            record.findings = [f for f in record.findings if f.rule != "nonfinite_rank"]

    def _collect(self, step: int, groups: Groups, params: list[ParamVectors], updates: list[Vector] | None,
                 loss: Any, histograms: list[tuple[torch.Tensor | None, torch.Tensor | None]] | None = None,
                 trace: CauseTrace | None = None) -> WatchStep:
        if self.reduction is not None:  # under torchrun: over every rank
            # this rank's flight recorder found a NaN/Inf not yet agreed on: the first SUM tells every rank
            flagged = self.flight is not None and self.flight.first_bad is not None and not self.flight.dumped
            return rank_stats.watch_step(self.reduction, step, groups, params, self.sharded, updates,
                                          _loss_vector(loss) if loss is not None else None,
                                          failed=self.hooks.session.error is not None, owned=self.owned,
                                          flag=flagged,
                                          channels=merged_channels(self.hooks.session.calls) if self.channel_counts is not None else None,
                                          histograms=histograms, partial=self.param_watch.partial)  # type: ignore[arg-type]
        transfer = Transfer()
        slot = transfer.slot
        layer_slots = [(key, group, slot(group[4]), slot(group[5])) for key, group in groups.items()]
        channels = merged_channels(self.hooks.session.calls)
        channel_slots = {key: (slot(nonzeros), per) for key, (nonzeros, per) in channels.items()}
        param_slots = [(p, slot(p.grad), slot(p.norm), slot(updates[i]) if updates else None)
                       for i, p in enumerate(params)]
        loss_slot = slot(_loss_vector(loss)) if loss is not None else None
        histogram_slots = [(slot(v), slot(g)) for v, g in histograms] if histograms is not None else []
        cause_slots = [slot(v) for v in trace.vectors()] if trace is not None else []
        loss_first_slot = slot(self._loss_first.reshape(1)) if self._loss_first is not None else None
        attention = self.attention.slots(slot) if self.attention is not None else None
        dot_slots, adam_slots = ([[slot(v) for v in vectors] if vectors is not None else None
                                  for vectors in self.param_watch.signals] if self.param_watch.signals is not None
                                 else (None, None))
        peak_slots = {key: slot(peak) for key, peak in self.peaks.take().items()} if self.peaks is not None else {}
        values = transfer.run()  # the step's one transfer
        host = transfer.row
        layers = watch_layers(groups.items(), [(host(s), host(g)) for _, _, s, g in layer_slots],
                              {key: (per, values[index]) for key, (index, per) in channel_slots.items()})  # type: ignore[index]
        out = WatchStep(step, values[loss_slot][0] if loss_slot is not None else None, layers)
        if trace is not None:
            out.cause = trace.cause([values[i] for i in cause_slots])  # type: ignore[index]
        elif self.hooks.compiled:
            out.cause = compiled_cause(out)
        if attention is not None:
            out.attention, out.output_logits = attention(values)
        out.loss_nonfinite_at = self._loss_first_step(values[loss_first_slot] if loss_first_slot is not None else None)
        for p, g, n, u in param_slots:
            out.params.append(watch_param(p, values[n][0], host(g), values[u][0] if u is not None else None))  # type: ignore[index]
        for entry, (v, g) in zip(out.params, histogram_slots):
            entry.values_histogram = Histogram.from_values(values[v]) if v is not None else None
            entry.grad_histogram = Histogram.from_values(values[g]) if g is not None else None
        _attach_signals(out, values, dot_slots, adam_slots, peak_slots)
        return out


class ChannelPeaks(Tap):
    """Each selected output's largest magnitude per channel on a logged step (the massive_activation
    rule's), on the device, the largest over the step's calls: a tap (``engine.taps``), measuring only
    while ``active``. ``take()`` hands the step's peaks on by (module, output path)."""

    def __init__(self, selection: Sequence[tuple[str, nn.Module]]) -> None:
        self.dims = ChannelDims(dict(selection))
        self.active = False
        self.peaks: dict[tuple[str, str], torch.Tensor | None] = {}

    def output(self, session: HookSession, call: Call, entry: OutputEntry, tensor: torch.Tensor) -> None:
        if not self.active or not has_channels(tensor):
            return
        key, peak = (call.name, entry.path), channel_abs_max(tensor, self.dims(call.name, tensor))
        if key not in self.peaks:
            self.peaks[key] = peak
        elif (had := self.peaks[key]) is not None:  # an output whose channel count differs between calls: left out
            self.peaks[key] = torch.maximum(had, peak) if had.shape == peak.shape else None

    def step_begins(self, full: bool) -> None:
        """A step begins: measured when it is logged (in ``full``)."""
        self.active, self.peaks = full, {}

    def take(self) -> dict[tuple[str, str], torch.Tensor]:
        peaks, self.peaks = self.peaks, {}
        return {key: peak for key, peak in peaks.items() if peak is not None}


def _attach_signals(record: WatchStep, values: list[list[float]], dots: list[int | None] | None,
                    adam: list[int | None] | None, peaks: dict[tuple[str, str], int | None]) -> None:
    """Set the record's update-gradient cosines (the dot products over the update's and the gradient's
    norms), Adam RMS and per-channel peaks from the step's transfer (a value that is not finite, a
    parameter without one, stays None)."""
    def finite(slots: list[int | None] | None, i: int, at: int = 0) -> float | None:
        value = values[index][at] if slots is not None and i < len(slots) and (index := slots[i]) is not None \
            else math.nan
        return value if math.isfinite(value) else None

    for i, entry in enumerate(record.params):
        dot, norms = finite(dots, i), (entry.update_norm or 0.0) * _grad_norm(entry.grad)
        entry.update_grad_cosine = max(-1.0, min(1.0, dot / norms)) if dot is not None and norms > 0 else None
        entry.adam_rms, entry.adam_rms_without_eps = finite(adam, i), finite(adam, i, 1)
    for layer in record.layers:
        if (index := peaks.get((layer.name, layer.output))) is not None:
            layer.channel_abs_max = values[index]


def _grad_norm(grad: dict[str, Any] | None) -> float:
    """A gradient's L2 norm from its statistics (rms * sqrt(count)); 0 when not finite or not known."""
    if grad is None or grad.get("nan_count") or grad.get("inf_count") or not isinstance(grad.get("rms"), float):
        return 0.0
    norm = grad["rms"] * math.sqrt(grad["count"])
    return norm if math.isfinite(norm) else 0.0


def _nonfinite(record: WatchStep) -> bool:
    """Whether a record holds a NaN/Inf in an output, a gradient or the loss."""
    stats = [layer.stats for layer in record.layers] + [layer.grad for layer in record.layers]
    return any(s is not None and (s.get("nan_count") or s.get("inf_count")) for s in stats) or \
        (record.loss is not None and not math.isfinite(record.loss))


def check_loss(loss: Any) -> None:
    """A loss is a number or a one-element tensor (UsageError otherwise); it is not read here."""
    if loss is None or isinstance(loss, numbers.Real) and not isinstance(loss, bool):
        return
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and not loss.is_complex():
        return
    what = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
    raise UsageError(f"watch.step(loss=...) takes a number or a one-element tensor, got {what}",
                     hint="pass the scalar loss you called backward() on (e.g. loss_fn(...).mean())")


def _loss_vector(loss: Any) -> Vector:
    if isinstance(loss, torch.Tensor):
        return loss.detach().reshape(1)
    try:
        return (float(loss),)  # type: ignore[return-value]
    except OverflowError:  # an int beyond float's range: the infinity float arithmetic makes of it
        return (math.inf if loss > 0 else -math.inf,)  # type: ignore[return-value]
