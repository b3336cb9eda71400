"""The flight recorder of ``hookcli.watch(flight=K)`` (docs/watch.md#flight-recorder).

Every step's merged output and output-gradient statistics (the vectors a logged step makes, see
``engine.step_rows.merged_outputs``) go into a ring of the last steps, where they are: host ``Moments``
on CPU, small tensors on an accelerator (no transfer). Whether a step held a NaN or Inf is known at
once on CPU (the ring holds K steps); on an accelerator a device scalar keeps the first such step
(``torch.where``, no host synchronisation) and is read when the watch transfers anyway (a logged step,
the block's end, the loop raising) and at the latest every ``K`` steps, and the ring holds ``2K - 1``
steps, so that the K steps up to the first non-finite one are all still there when it is read. What
is written is the same on both: those K steps, turned into records (one transfer) for the log.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from hookcli.engine.stats import INFS, NANS, Transfer, Vector, to_host
from hookcli.engine.step_rows import Groups, watch_layers
from hookcli.records import WatchStep

#: One step in the ring: (step, its merged outputs as ``merged_outputs`` gives them, its loss vector or None).
Entry = tuple[int, Groups, Vector | None]


class FlightRecorder:
    """A ring of the last steps' statistics, and the first step where one was not finite: ``size`` steps
    are written, up to the first non-finite one (with device vectors the ring keeps ``2 * size - 1``: a
    device flag is read up to ``size - 1`` steps after that step)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.ring: deque[Entry] = deque(maxlen=size)
        #: The first step that held a NaN or Inf, once read on the host (None: none seen yet).
        self.first_bad: int | None = None
        #: The last step written to the log (a logged step's line or a flight line): never written twice.
        self.written = -1
        #: The ring was written for the first NaN/Inf (later it is written again only if the loop raises).
        self.dumped = False
        self._device_first: dict[torch.device, torch.Tensor] = {}  # per device: first bad step, -1: none
        self._unread = 0  # steps pushed since the device flags were last read

    def push(self, step: int, groups: Groups, loss: Vector | None) -> None:
        """Keep ``step``'s statistics (the oldest step drops out) and note whether one is not finite.

        A step's device vectors are stacked into one tensor per device (``groups`` then holds its rows):
        one allocation per step in the ring instead of one per vector."""
        self.ring.append((step, groups, loss))
        places: dict[torch.device, list[tuple[list[Any], int]]] = {}
        host_bad = False
        for group in groups.values():
            for index in (4, 5):
                vector = group[index]
                if isinstance(vector, tuple):
                    host_bad = host_bad or bool(vector[NANS] or vector[INFS])
                elif vector is not None:
                    places.setdefault(vector.device, []).append((group, index))
        device_bad: dict[torch.device, torch.Tensor] = {}
        if places and self.ring.maxlen == self.size:  # flags read late: keep the K steps before them too
            self.ring = deque(self.ring, maxlen=2 * self.size - 1)
        for device, where in places.items():
            block = torch.stack([group[index] for group, index in where])
            for row, (group, index) in enumerate(where):
                group[index] = block[row]
            device_bad[device] = (block[:, NANS] + block[:, INFS]).sum() > 0
        if isinstance(loss, torch.Tensor) and not loss.is_cpu:
            nonfinite = torch.isfinite(loss).logical_not().any()
            device_bad[loss.device] = device_bad[loss.device] | nonfinite if loss.device in device_bad else nonfinite
        elif loss is not None:
            host_bad = host_bad or not all(map(math.isfinite, loss.tolist() if isinstance(loss, torch.Tensor) else loss))
        if self.first_bad is not None:
            return
        if host_bad:
            if self.read() is None:  # (a device's flag may hold an earlier step)
                self.first_bad = step
            return
        for device, bad in device_bad.items():
            first = self._device_first.get(device)
            if first is None:
                first = self._device_first[device] = torch.full((), -1, dtype=torch.int64, device=device)
            first.copy_(torch.where(bad & (first < 0), step, first))
        if self._device_first:
            self._unread += 1
            if self._unread >= self.size:  # read while the K steps up to a bad one are in the ring
                self.read()

    def read(self) -> int | None:
        """The first non-finite step, reading the device flags (a host synchronisation: call it where the
        watch transfers anyway)."""
        self._unread = 0
        if self.first_bad is None and self._device_first:
            found = [int(row[0]) for row in to_host([v.reshape(1) for v in self._device_first.values()])
                     if row[0] >= 0]
            if found:
                self.first_bad = min(found)
        return self.first_bad

    def unwritten(self, before: int | None = None, upto: int | None = None) -> list[Entry]:
        """The last ``size`` of the ring's steps not written yet, before ``before`` (the step whose own
        line follows) and up to ``upto`` (the first non-finite step); they count as written from now on."""
        entries = [e for e in self.ring if e[0] > self.written and (before is None or e[0] < before)
                   and (upto is None or e[0] <= upto)][-self.size:]
        if entries:
            self.written = entries[-1][0]
        return entries


def flight_records(entries: Sequence[Entry]) -> list[WatchStep]:
    """The ring's steps as ``WatchStep`` records marked ``flight`` (layers and loss; no parameters),
    with one transfer for them all."""
    transfer = Transfer()
    slot, row = transfer.slot, transfer.row
    plan = [(step, groups, [(slot(group[4]), slot(group[5])) for group in groups.values()], slot(loss))
            for step, groups, loss in entries]
    values = transfer.run()
    records = []
    for step, groups, layers, loss_slot in plan:
        record = WatchStep(step, values[loss_slot][0] if loss_slot is not None else None, flight=True)
        record.layers = watch_layers(groups.items(), [(row(s), row(g)) for s, g in layers])
        records.append(record)
    return records
