"""The loss a backward pass starts from, built from the model's output.

``build_loss`` picks it (``--loss auto``: the model's own losses or loss, a per-token cross-entropy for
a sequence's logits, a cross-entropy for class logits, else the mean of squares) or builds the one
asked for; ``loss_for`` is that for a run, where a failure to build one is hookcli's, never the
model's. Every command that runs backward (``grads``, ``check``, ``diff``, ``watch MODEL``) takes its
loss from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hookcli.engine.stats import iter_tensors, shape_of
from hookcli.errors import HookcliError, UnsupportedError, UsageError
from hookcli.options import Loss, output_key_path

LOSS_NAMES = {Loss.ce: "cross_entropy", Loss.nll: "nll", Loss.mean_square: "mean_square", Loss.sum: "sum",
              Loss.mean: "mean"}

@dataclass
class LossChoice:
    """The loss a backward pass starts from, and what it was built from (``report.loss``)."""

    kind: str  # model_loss | cross_entropy | nll | mean_square | sum | mean
    output: str  # path of the tensor in the model output the loss was built from
    target: int | None  # the class index of a (batch, classes) cross-entropy, else None
    value: torch.Tensor
    targets: str | None = None  # what the targets were, in words ("next token of input_ids", ...)

    def info(self, value: float) -> dict[str, Any]:
        return {"kind": self.kind, "output": self.output, "target": self.target, "targets": self.targets,
                "value": value}

    def unused_target(self, target: int) -> str | None:
        """A report note when the user gave ``--target`` (a class other than the default 0) and this loss
        does not use it (a per-token next-token loss, the model's own loss, a mean of squares...)."""
        if not target or self.target is not None:
            return None
        against = f" against the {self.targets}" if self.targets else ""
        return (f"--target {target} is not used: the loss is {self.kind} of {self.output or 'the output'}{against} "
                "(--target picks the class of a cross-entropy over (batch, classes) output)")


def _is_model_loss(path: str, tensor: torch.Tensor) -> bool:
    """A scalar float entry named ``loss`` at the top of the output (``ModelOutput.loss``, ``{'loss': ...}``)."""
    return tensor.dim() == 0 and path in ("['loss']", ".loss")


def loss_collection(output: Any) -> list[tuple[str, torch.Tensor]] | None:
    """The entries of a dict, list or tuple output that holds only scalar float losses (torchvision
    detection in train mode: ``loss_classifier``, ``loss_box_reg``, ...), two or more; else None.
    Scalars that do not require grad (a metric such as an accuracy beside the loss) are left out when
    some do: they are not losses training would sum."""
    if not isinstance(output, (Mapping, list, tuple)) or isinstance(output, torch.Tensor):
        return None
    tensors = list(iter_tensors(output))
    if len(tensors) < 2 or not all(t.dim() == 0 and t.is_floating_point() for _, t in tensors):
        return None
    return [(path, t) for path, t in tensors if t.requires_grad] or tensors


def pick_output(output: Any, key: str | None, *, skip_loss: bool = False) -> tuple[str, torch.Tensor]:
    """The tensor the loss is built from: the output itself, ``--output-key``, or the first float tensor
    that holds values (an empty one, such as no detections, would give a NaN loss). The model's own
    scalar ``loss`` entry comes first, unless ``skip_loss`` (an explicitly chosen loss)."""
    tensors = [(path, t if t.layout == torch.strided else t.to_dense())  # a sparse output: its dense values
               for path, t in iter_tensors(output) if t.is_floating_point()]
    if not tensors:
        raise UnsupportedError("the model output holds no floating-point tensor to build a loss from",
                               hint="gradients need a float output; run hookcli stats or shapes on this model")
    if key is None:
        filled = [(p, t) for p, t in tensors if t.numel() > 0]
        if not filled:
            shown = ", ".join(f"{p or '(output)'} {shape_of(t)}" for p, t in tensors[:4])
            raise UnsupportedError(
                f"every floating tensor of the model output is empty ({shown}{', ...' if len(tensors) > 4 else ''}): "
                "a loss over no values would be NaN, with all gradients zero",
                hint="give an input the model outputs values for; a detection model in --train mode with "
                "targets (an --input .pt file holding the images and their targets) returns its losses")
        if skip_loss:
            return next(((p, t) for p, t in filled if not _is_model_loss(p, t)), filled[0])
        return next(((p, t) for p, t in filled if _is_model_loss(p, t)), filled[0])
    path = output_key_path(key, (p for p, _ in tensors))
    if path is not None:
        return path, dict(tensors)[path]
    raise UsageError(
        f"--output-key {key!r} is not in the model output",
        hint="floating tensors in the output: " + ", ".join(p or "(output)" for p in (p for p, _ in tensors)),
    )


#: Keyword inputs that hold the tokens a sequence's logits predict, most specific first.
_TOKEN_NAMES = ("decoder_input_ids", "input_ids")


def _token_inputs(inputs: Any) -> list[tuple[str, torch.Tensor]]:
    """Integer ``[batch, seq]`` tensors among the model inputs ``(args, kwargs)``, named ones first."""
    if inputs is None:
        return []
    args, kwargs = inputs
    named = [(n, kwargs[n]) for n in _TOKEN_NAMES if isinstance(kwargs.get(n), torch.Tensor)]
    rest = [(f"input {path}", t) for path, t in iter_tensors((args, {k: v for k, v in kwargs.items()
                                                                    if k not in _TOKEN_NAMES}))]
    return [(n, t) for n, t in named + rest
            if t.dim() == 2 and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool]


def _vocab_sizes(model: nn.Module | None) -> set[int]:
    return {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)} if model is not None else set()


def is_sequence_logits(path: str, out: torch.Tensor, model: nn.Module | None, inputs: Any) -> bool:
    """A ``[batch, seq, vocab]`` output that holds logits: it is named ``logits``, or its last dimension
    is the size of one of the model's ``nn.Embedding`` tables and integer tokens ``[batch, seq]`` are
    among the inputs (a language model's head). Hidden states ``[batch, seq, hidden]`` are neither."""
    if out.dim() != 3 or out.shape[-1] < 2:
        return False
    if "logits" in path.lower():
        return True
    return out.shape[-1] in _vocab_sizes(model) and any(
        tuple(t.shape) == tuple(out.shape[:2]) for _, t in _token_inputs(inputs))


def sequence_targets(out: torch.Tensor, inputs: Any, seed: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Logits and targets for a per-token cross-entropy over ``[batch, seq, vocab]``.

    Next-token targets (position t predicts token t+1, so the last position is dropped) when integer
    tokens of the same ``[batch, seq]`` below ``vocab`` are among the inputs (``decoder_input_ids``, then
    ``input_ids``, then any); else random targets ``randint(0, vocab)`` from a generator seeded with ``seed``.
    """
    batch, seq, vocab = out.shape
    if seq >= 2:
        for name, ids in _token_inputs(inputs):
            if tuple(ids.shape) == (batch, seq) and 0 <= int(ids.min()) and int(ids.max()) < vocab:
                return out[:, :-1], ids[:, 1:].to(out.device, torch.long), f"next token of {name}"
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen).to(out.device)
    return out, labels, f"randint(0, {vocab}, seed={seed}) per token"


def _in_loss_precision(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in the precision the loss is computed in: float32, or float64 for a float64 output
    (a float64 model's loss and gradients were rounded to float32, and its outputs above 3e38 became inf)."""
    return tensor if tensor.dtype == torch.float64 else tensor.float()


def build_loss(output: Any, *, loss: str, target: int, output_key: str | None, inputs: Any = None,
               model: nn.Module | None = None, seed: int = 0) -> LossChoice:
    """The loss to backpropagate from the model's ``output``.

    ``auto`` picks, in order: the sum of a dict/list/tuple output of scalar losses (``loss_collection``,
    as training sums them); the model's own scalar ``loss`` entry (a ModelOutput or dict that has one) or
    a scalar output; per-token cross-entropy over the last dimension for ``[batch, seq, vocab]``
    logits (:func:`is_sequence_logits`; targets from :func:`sequence_targets`); cross-entropy against
    class ``target`` for ``[batch, classes]``; otherwise the mean of squares, ``mean(x**2)`` (its
    gradient ``2x/numel`` never cancels out the way a sum's does after a normalisation layer).
    ``inputs`` is ``(args, kwargs)`` of the run (for next-token targets), ``model`` the model (its
    embedding sizes tell logits from hidden states).
    """
    loss = Loss(loss)
    losses = loss_collection(output) if loss == Loss.auto and output_key is None else None
    if losses is not None:
        value = torch.stack([_in_loss_precision(t) for _, t in losses]).sum()
        return LossChoice("model_loss", "sum of " + ", ".join(p for p, _ in losses), None, value)
    path, out = pick_output(output, output_key, skip_loss=loss != Loss.auto)
    if loss == Loss.auto:
        if out.dim() == 0 and (output_key is not None or _is_model_loss(path, out) or path == ""):
            return LossChoice("model_loss", path, None, _in_loss_precision(out), "the model's own loss")
        if is_sequence_logits(path, out, model, inputs):
            loss = Loss.ce
        elif out.dim() == 2 and out.shape[1] > 1:
            loss = Loss.ce
        else:
            loss = Loss.mean_square
    if loss in (Loss.ce, Loss.nll):
        if out.dim() < 2:
            raise UsageError(f"--loss {loss} needs (batch, classes) output, got shape {shape_of(out)}",
                             hint="use --loss mean_square, sum or mean")
        fn = F.cross_entropy if loss == Loss.ce else F.nll_loss
        if out.dim() == 3:  # [batch, seq, vocab]: per token, classes on the last dimension
            logits, labels, described = sequence_targets(out, inputs, seed)
            value = fn(_in_loss_precision(logits).reshape(-1, out.shape[-1]), labels.reshape(-1))
            return LossChoice(LOSS_NAMES[loss], path, None, value, described)
        if target >= out.shape[1]:
            raise UsageError(f"--target {target} is out of range for {out.shape[1]} classes",
                             hint=f"give --target 0 to {out.shape[1] - 1}")
        # [batch, classes] or [batch, classes, d1, ...] (segmentation): class ``target`` everywhere
        labels = torch.full((out.shape[0], *out.shape[2:]), target, dtype=torch.long, device=out.device)
        value = fn(_in_loss_precision(out), labels)
        return LossChoice(LOSS_NAMES[loss], path, target, value)  # ``target`` says it
    if loss == Loss.mean_square:
        return LossChoice(LOSS_NAMES[loss], path, None, _in_loss_precision(out).square().mean())
    value = _in_loss_precision(out).sum() if loss == Loss.sum else _in_loss_precision(out).mean()
    return LossChoice(LOSS_NAMES[loss], path, None, value)


def loss_for(output: Any, opts: Any, inputs: Any = None, model: nn.Module | None = None) -> LossChoice:
    """``build_loss`` on the model's output; a failure there is hookcli's (it cannot build a loss from
    that output: UnsupportedError), never the model's."""
    try:
        return build_loss(output, loss=opts.loss, target=opts.target, output_key=opts.output_key,
                          inputs=inputs, model=model, seed=opts.seed)
    except HookcliError:
        raise
    except Exception as exc:
        kinds = ", ".join(sorted({f"{t.dtype} {t.layout}".replace("torch.", "") for _, t in iter_tensors(output)}))
        raise UnsupportedError(
            f"cannot build a loss from the model output ({kinds or 'no tensors'}): {type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
            hint="choose the tensor with --output-key and the loss with --loss sum or mean; "
            "stats and shapes need no loss") from exc
