"""The watch's transformer signals on a logged step (docs/watch.md#attention-and-output-logits).

While armed (a logged step, until its record is taken), ``F.scaled_dot_product_attention`` is wrapped:
the wrapper calls the function it replaced with the same arguments and returns its result unchanged,
then, with autograd and autocast off, recomputes the logits ``q . k^T * scale`` (plus the additive mask,
``-inf`` where a boolean mask or ``is_causal`` hides a key) of up to ``ROWS`` query rows per head,
spread evenly over the batch and the positions, and keeps per head the largest logit and the sum of the
rows' softmax entropies, on the device (no host synchronisation). ``nn.MultiheadAttention`` with
``need_weights=False`` (torchvision's ViT) reaches it through ``F.multi_head_attention_forward``. Each
call is named by the innermost module running it (forward hooks on every module while armed). The
model's output, when it holds logits (``OUTPUT_LOGITS``), adds the sums over its rows of the largest
logit and of the log-partition. Everything reaches the host in the step's one transfer (``slots``).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from hookcli.engine.hooks import hook_calls
from hookcli.engine.stats import Vector
from hookcli.records import AttentionLayer, OutputLogits

#: Query rows sampled per head and call: the per-head maximum and entropy are over these rows only.
ROWS = 64

#: The output logits are read this many values at a time (float32 temporaries of at most 64 MiB, not
#: one the size of a large vocabulary's logits).
CHUNK = 1 << 24

#: -1 unless autograd's engine runs a backward pass in this thread (a checkpoint's recomputation)
_graph_task_id = torch._C._current_graph_task_id

#: torch's own function.
_TORCH_SDPA = torch._C._nn.scaled_dot_product_attention
#: The armed probes (one wrapper for any number of watches, each probe its own model's calls).
_ARMED: list[AttentionProbe] = []
#: The function the wrapper replaced (restored when the last probe disarms), while one is installed.
_replaced: list[Callable[..., Any]] = []


def _wrapper(*args: Any, **kwargs: Any) -> Any:
    # (a reference to the wrapper kept past the watch, taken from torch.nn.functional while it was in
    # place, calls torch's own)
    out = (_replaced[0] if _replaced else _TORCH_SDPA)(*args, **kwargs)
    for probe in tuple(_ARMED):  # (each watch's probe measures the calls inside its own model)
        probe.saw(args, kwargs)
    return out


def _install(probe: AttentionProbe) -> None:
    if not _ARMED:
        current = torch.nn.functional.scaled_dot_product_attention
        if current is not _wrapper:
            _replaced[:] = [current]
            torch.nn.functional.scaled_dot_product_attention = _wrapper
    _ARMED.append(probe)


def _uninstall(probe: AttentionProbe) -> None:
    if probe in _ARMED:
        _ARMED.remove(probe)
    if not _ARMED and _replaced:
        if torch.nn.functional.scaled_dot_product_attention is _wrapper:  # (not if someone replaced it since)
            torch.nn.functional.scaled_dot_product_attention = _replaced[0]
        _replaced.clear()


def _sdpa_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """(query, key, attn_mask, is_causal, scale, enable_gqa) of an ``F.scaled_dot_product_attention`` call."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    given = dict(zip(names, args)) | kwargs
    return (given["query"], given["key"], given.get("attn_mask"), bool(given.get("is_causal", False)),
            given.get("scale"), bool(given.get("enable_gqa", False)))


def _rows(batch: int, length: int, device: torch.device) -> torch.Tensor:
    """Which query row each of a call's samples reads, per batch element: ``(batch, r)`` positions
    with ``r * batch`` about ``ROWS``, stratified over the batch and the positions (deterministic)."""
    r = min(length, max(1, math.ceil(ROWS / batch)))
    slot = torch.arange(r, device=device)[None, :] * batch + torch.arange(batch, device=device)[:, None]
    return ((2 * slot + 1) * length) // (2 * r * batch)


def head_stats(query: torch.Tensor, key: torch.Tensor, attn_mask: torch.Tensor | None = None,
               is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False
               ) -> tuple[torch.Tensor, int]:
    """Per head, over the sampled query rows of one call: ``[max logit] * H + [entropy sum] * H +
    [rows] * H`` (float32, on the call's device; a row that attends to nothing counts in none), and H."""
    lead, length, width = query.shape[:-2], query.shape[-2], query.shape[-1]
    heads = lead[-1] if len(lead) >= 2 else 1
    batch = math.prod(lead) // heads
    if enable_gqa and key.dim() >= 3 and key.shape[-3] != heads:
        key = key.repeat_interleave(heads // key.shape[-3], dim=-3)
    keys = key.shape[-2]
    q = query.reshape(batch, heads, length, width)
    k = key.expand(*lead, keys, width).reshape(batch, heads, keys, width)
    chosen = torch.arange(min(batch, ROWS), device=q.device) * batch // min(batch, ROWS)  # batch elements
    rows = _rows(len(chosen), length, q.device)
    picked = chosen[:, None].expand_as(rows)
    qs = q[picked, :, rows, :].permute(0, 2, 1, 3).float()  # (chosen, heads, r, width)
    k = k if len(chosen) == batch else k[chosen]
    logits = qs @ k.float().transpose(-1, -2) * (1 / math.sqrt(width) if scale is None else scale)
    if attn_mask is not None:
        mask = attn_mask.expand(*lead, length, keys).reshape(batch, heads, length, keys)
        mask = mask[picked, :, rows, :].permute(0, 2, 1, 3)
        logits = logits.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else logits + mask.float()
    if is_causal:  # (top-left aligned, as the function's own: row i sees keys 0..i)
        hidden = torch.arange(keys, device=q.device)[None, None, :] > rows[:, :, None]
        logits = logits.masked_fill(hidden[:, None], -math.inf)
    top = logits.amax(-1)
    valid = top > -math.inf
    logp = logits - torch.logsumexp(logits, -1, keepdim=True)
    p = logp.exp()
    entropy = -torch.where(p > 0, p * logp, 0).sum(-1)
    entropy = torch.where(valid, entropy, 0)
    return torch.cat([top.amax((0, 2)), entropy.sum((0, 2)), valid.sum((0, 2)).float()]), heads


def logit_sums(output: Any) -> tuple[str, torch.Tensor, int, int] | None:
    """The model's output logits (``OUTPUT_LOGITS``): where they are, ``[sum of row max, sum of row
    logsumexp]`` (float32, on their device), the rows and the classes; None when the output holds none."""
    found = _logits_in(output)
    if found is None:
        return None
    where, t = found
    z = t.detach().reshape(-1, t.shape[-1])
    step = max(1, CHUNK // z.shape[-1])  # rows at a time: a temporary of at most CHUNK floats
    parts = [torch.stack([c.amax(-1).sum(), torch.logsumexp(c, -1).sum()])
             for c in (z[i:i + step].float() for i in range(0, z.shape[0], step))]
    return where, torch.stack(parts).sum(0) if len(parts) > 1 else parts[0], z.shape[0], z.shape[-1]


def _logits_in(output: Any) -> tuple[str, torch.Tensor] | None:
    """``OUTPUT_LOGITS``: a ``logits`` key or attribute (Hugging Face outputs, dicts), else the output
    itself or its first element (a ``(logits, loss)`` tuple), when it is a floating tensor of 2 or 3
    dimensions whose last holds at least 2 classes."""
    if isinstance(output, Mapping):
        where, t = "['logits']", output.get("logits")
    elif hasattr(output, "logits"):
        where, t = ".logits", getattr(output, "logits", None)
    elif isinstance(output, (tuple, list)):
        where, t = "[0]", output[0] if output else None
    else:
        where, t = "", output
    if type(t) is torch.Tensor and t.is_floating_point() and t.dim() in (2, 3) and t.shape[-1] >= 2 \
            and t.numel() and not t.is_nested and t.layout == torch.strided:
        return where, t
    return None


#: What the output logits signal reads (docs/watch.md).
OUTPUT_LOGITS = _logits_in.__doc__


class AttentionProbe:
    """The signals of one watch's logged steps: ``arm(True)`` at a logged step's start, ``slots`` and
    ``records`` when its record is made, ``arm(False)`` after. What its code raises is kept in ``error``
    (never raised into the model) and raised by ``slots``."""

    def __init__(self, model: nn.Module, skip: Callable[[], bool]) -> None:
        self.model = model
        self.names: dict[int, str] = {}
        for name, module in model.named_modules():
            self.names.setdefault(id(module), name)
        self.modules = [m for _, m in model.named_modules()]
        self.skip = skip  # a validation forward: not measured (as the session's hooks)
        self.error: Exception | None = None
        self._stack: list[list[Any]] = []  # [name, calls of the function so far] of each module running
        self._handles: list[Any] = []
        #: name -> [heads, keys, calls, vector] of the step so far; the output logits' (where, sums, rows, classes)
        self.layers: dict[str, list[Any]] = {}
        self.logits: list[Any] | None = None

    def arm(self, on: bool) -> None:
        """A step begins: measure it (``on``) or not; the hooks and the wrapper come and go with it."""
        self.layers, self.logits, self._stack, self.error = {}, None, [], None
        if on and not self._handles:
            self._handles = hook_calls(self.modules, self._pre, self._post)
            _install(self)
        elif not on:
            self.remove()

    def remove(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        _uninstall(self)

    def _measuring(self) -> bool:
        return bool(self._handles) and _graph_task_id() == -1 and not self.skip()

    def _pre(self, module: nn.Module, _args: Any, _kwargs: Any) -> None:
        if self._measuring():
            self._stack.append([self.names.get(id(module), "?"), 0])

    def _post(self, module: nn.Module, _args: Any, _kwargs: Any, output: Any = None) -> None:
        if not self._measuring() or not self._stack:
            return
        self._stack.pop()
        if module is self.model and not self._stack:
            try:
                self._add_logits(output)
            except Exception as exc:  # hookcli's failure: kept, never raised into the model
                self.error = self.error or exc

    def saw(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """One call of the wrapped function (its output already made): its heads' statistics."""
        if not self._measuring():
            return
        try:
            query, key, mask, causal, scale, gqa = _sdpa_args(args, kwargs)
            if not all(type(t) is torch.Tensor and not t.is_nested and t.layout == torch.strided
                       and t.is_floating_point() and t.dim() >= 2 and t.numel()
                       for t in (query, key)):
                return
            if not self._stack:  # (not inside the watched model: another model's, the loss's)
                return
            owner = self._stack[-1]
            name = owner[0] + (f"[sdpa {owner[1]}]" if owner[1] else "")
            owner[1] += 1
            device = query.device.type
            cast = torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else nullcontext()
            with torch.no_grad(), cast:
                vector, heads = head_stats(query.detach(), key.detach(), mask, causal, scale, gqa)
            self._merge(name, heads, key.shape[-2], vector)
        except Exception as exc:
            self.error = self.error or exc

    def _merge(self, name: str, heads: int, keys: int, vector: torch.Tensor) -> None:
        entry = self.layers.get(name)
        if entry is None:
            self.layers[name] = [heads, keys, 1, vector]
        elif entry[0] == heads:
            top = torch.maximum(entry[3][:heads], vector[:heads])
            entry[2], entry[3] = entry[2] + 1, torch.cat([top, entry[3][heads:] + vector[heads:]])

    def _add_logits(self, output: Any) -> None:
        with torch.no_grad():
            found = logit_sums(output)
        if found is None:
            return
        where, sums, rows, classes = found
        if self.logits is None:
            self.logits = [where, sums, rows, classes]
        elif self.logits[3] == classes:  # (micro-batches: one entry)
            self.logits[1], self.logits[2] = self.logits[1] + sums, self.logits[2] + rows

    def slots(self, slot: Callable[[Vector | None], int | None]) -> Callable[[list[list[float]]], tuple[
            list[AttentionLayer], OutputLogits | None]]:
        """The step's vectors into a transfer (``Transfer.slot``); the function that makes the records
        from its host values. Raises what the probe's code raised during the step."""
        if self.error is not None:
            raise self.error
        layers = [(name, heads, keys, calls, slot(vector)) for name, (heads, keys, calls, vector) in self.layers.items()]
        logits = self.logits
        logit_slot = slot(logits[1]) if logits is not None else None

        def records(values: list[list[float]]) -> tuple[list[AttentionLayer], OutputLogits | None]:
            out = []
            for name, heads, keys, calls, index in layers:
                row = values[index]  # type: ignore[index]
                counts = [int(c) for c in row[2 * heads:3 * heads]]
                out.append(AttentionLayer(name, heads, keys, calls, counts,
                                          [m if c else None for m, c in zip(row[:heads], counts)],
                                          [e / c if c else None for e, c in zip(row[heads:2 * heads], counts)]))
            if logits is None:
                return out, None
            top, lse = values[logit_slot]  # type: ignore[index]
            return out, OutputLogits(logits[0], logits[3], logits[2], top / logits[2], lse / logits[2])

        return records
