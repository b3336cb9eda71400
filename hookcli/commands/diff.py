"""``hookcli diff``: run a model twice (A, then B with the ``--vs-*`` changes) and find where they part.

Both runs go through the engine (``prepare`` / ``running`` / ``attach`` with a ``Keep`` tap): run A
writes every selected output tensor to a disk-backed store (one unnamed temporary file, closed in
``finally``; an output that is the same unchanged tensor object as an earlier one is written once);
run B compares each of its outputs with A's stored values as it is produced, a chunk at a time, reduces
the comparison to six numbers and drops both. Neither run's activations are held beyond that and
nothing is memory-mapped, so peak memory is about a bare forward plus a few chunk buffers.
The model's own output is always compared (its rows are ``final``): the exit code is decided on it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hookcli.errors import ModelRaisedError, UnsupportedError, UsageError, describe_exception
from hookcli.engine.loading import refuse_torchscript
from hookcli.engine.run import (
    Prepared,
    failure_message,
    new_report,
    prepare,
    require_values,
    RunPlan,
    run_model,
)
from hookcli.engine.selection import module_depth
from hookcli.engine.taps import Gradients, Keep
from hookcli.engine.state import exclusive
from hookcli.engine.stats import dtype_name
from hookcli.options import DTYPES, RunOptions, model_is_instance
from hookcli.commands.diff_numbers import (
    DiskStore,
    Key,
    SeenTensors,
    compare,
    errors_from,
    plain_tensor,
    tolerance_for,
)
from hookcli.records import DiffReport, DiffRow, Errors, LayerRecord, Tolerance

@dataclass
class VsOptions:
    """What run B changes, and how the runs are compared (``--vs-*``, ``--rtol``, ``--atol``, ``--grads``)."""

    weights: str | None = None
    dtype: str | None = None
    device: str | None = None
    model: Any = None  # a spec string or an nn.Module with the same module names
    compile: bool = False
    rtol: float | None = None
    atol: float | None = None
    grads: bool = False

    def validate(self) -> VsOptions:
        """A checked copy: known dtype, non-negative finite tolerances (UsageError otherwise)."""
        vs = dataclasses.replace(self)
        if vs.dtype is not None:
            key = str(vs.dtype).removeprefix("torch.").lower()
            if key not in DTYPES:
                raise UsageError(f"unsupported --vs-dtype {vs.dtype!r}",
                                 hint="choose one of: float32, float16, bfloat16, float64")
            vs.dtype = DTYPES[key]
        for flag, value in (("--rtol", vs.rtol), ("--atol", vs.atol)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 <= value < math.inf):
                raise UsageError(f"{flag} must be a finite number of 0 or more, got {value!r}",
                                 hint="e.g. --rtol 1e-3 --atol 1e-5")
        if isinstance(vs.model, str) and not vs.model.strip():
            raise UsageError("--vs-model is empty", hint="e.g. --vs-model path/to/refactored.py:Net")
        return vs

    def changes(self) -> list[str]:
        """What run B changes, one item each (empty: B is A again)."""
        out = [f"{what}: {value}" for what, value in (
            ("model", self.model if not model_is_instance(self.model) else type(self.model).__name__),
            ("weights", self.weights), ("dtype", self.dtype), ("device", self.device)) if value is not None]
        return out + (["torch.compile"] if self.compile else [])


class _Comparer:
    """Run B's keep callbacks: compare each output (and gradient) with run A's as it arrives."""

    def __init__(self, store: DiskStore, vs: VsOptions) -> None:
        self.store = store
        self.vs = vs
        self.pending: dict[Key, torch.Tensor] = {}
        self.tolerances: dict[Key, Tolerance] = {}
        self.b_meta: dict[Key, tuple[list[int], str]] = {}  # in the order B produced them
        self.seen = SeenTensors()  # B's tensors compared already: (A's item, tolerance, result)

    def __call__(self, name: str, call: int, path: str, tensor: torch.Tensor) -> None:
        key = (name, call, path)
        b = plain_tensor(tensor)
        self.b_meta[key] = (list(b.shape), dtype_name(tensor.dtype))
        stored = self.store.items.get(key)
        if stored is None or stored.shape != list(b.shape):
            return  # only in B, or another shape: said by the row, nothing to compare
        tol = tolerance_for(dtype_name(stored.dtype), dtype_name(b.dtype), self.vs.rtol, self.vs.atol)
        self.tolerances[key] = tol
        before = self.seen.get(tensor)
        if before is not None and before[0] is stored and before[1] == tol:
            self.pending[key] = before[2]  # the same pair of tensors as an earlier call's
            return
        self.pending[key] = compare(self.store.source(stored), b, tol.rtol or 0.0, tol.atol or 0.0)
        self.seen.remember(tensor, (stored, tol, self.pending[key]))

    def results(self) -> dict[Key, Errors]:
        """Every comparison, with one host transfer."""
        if not self.pending:
            return {}
        keys = list(self.pending)
        host = torch.stack([self.pending[k].cpu() for k in keys]).tolist()
        out = {}
        for key, values in zip(keys, host):
            tol = self.tolerances[key]
            errors = errors_from(values, tol.atol or 0.0)
            out[key] = dataclasses.replace(errors, within=tol.accepts(errors))
        return out


# --------------------------------------------------------------------------- runs


def _with_root(prep: Prepared) -> Prepared:
    """``prep`` with the model itself selected too: its output decides the exit code."""
    if any(name == "" for name, _ in prep.selection):
        return prep
    return dataclasses.replace(prep, selection=[("", prep.loaded.model), *prep.selection])


def _run(prep: Prepared, label: str, keep: Callable[..., None], keep_grad: Callable[..., None] | None,
         *, grads: bool, compile_model: bool) -> tuple[list[LayerRecord], dict[str, Any] | None]:
    """One run with ``keep`` on every selected output (and ``keep_grad`` on their gradients with
    ``grads``); its records and the loss. The model raising is a ModelRaisedError naming the run."""
    from hookcli.commands.grads import no_gradients
    from hookcli.engine.losses import loss_for

    opts = prep.options
    refuse_torchscript(prep.loaded.model, prep.selection)

    def loss(output: Any, args: tuple[Any, ...], kwargs: dict[str, Any], model: nn.Module) -> tuple[torch.Tensor, Any]:
        choice = loss_for(output, opts, (args, kwargs), model)
        if not choice.value.requires_grad:
            raise no_gradients(prep)
        return choice.value, choice

    run = run_model(prep, [Keep(keep), *([Gradients(keep=keep_grad)] if grads else [])],
                    RunPlan(loss=loss if grads else None, compiled=compile_model, show_phase=False))
    if run.failure is not None:
        failure = run.failure
        raise ModelRaisedError(f"run {label}: {failure_message(failure)}", module=failure.module,
                               input_shapes=failure.input_shapes, phase=failure.phase) from run.cause
    return run.layers, run.loss.info(run.loss_value) if run.loss is not None else None


def _options_b(opts: RunOptions, vs: VsOptions) -> RunOptions:
    if vs.weights is not None and model_is_instance(vs.model if vs.model is not None else opts.model):
        raise UsageError("--vs-weights loads a file into a model hookcli builds; run B's model is already built",
                         hint="load the weights into your model B and pass it as vs_model, or give a spec")
    changed: dict[str, Any] = {}
    if vs.model is not None:
        changed.update(model=vs.model, model_source="python" if model_is_instance(vs.model) else "argument",
                       model_args={} if model_is_instance(vs.model) else opts.model_args)
    for name in ("weights", "dtype", "device"):
        if getattr(vs, name) is not None:
            changed[name] = getattr(vs, name)
    return dataclasses.replace(opts, **changed)


def _same_layout(mine: Any, theirs: Any) -> bool:
    """Whether a state-dict entry of A fits B's: tensors of one shape, tuples of such, or equal values."""
    if isinstance(mine, torch.Tensor) or isinstance(theirs, torch.Tensor):
        return isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor) and mine.shape == theirs.shape
    if isinstance(mine, (tuple, list)) and isinstance(theirs, (tuple, list)):
        return len(mine) == len(theirs) and all(_same_layout(m, t) for m, t in zip(mine, theirs))
    return type(mine) is type(theirs) and (mine is None or isinstance(mine, (str, int, float, bool, torch.dtype))
                                           and mine == theirs)


def _share_weights(a: nn.Module, b: nn.Module) -> list[str]:
    """Copy A's parameters and buffers into B where name and shape match; the names that did not.
    A quantized model's state dict also holds non-tensors (a packed weight and bias, a dtype)."""
    own = b.state_dict()
    theirs = a.state_dict()
    fits = type(theirs)((k, v) for k, v in theirs.items() if k in own and _same_layout(own[k], v))
    # the modules' state-dict versions travel along: a module may refuse a state without its version
    # (torchvision's MNASNet raises ValueError)
    fits._metadata = getattr(theirs, "_metadata", None)  # type: ignore[attr-defined]
    try:
        b.load_state_dict(fits, strict=False)
    except Exception as exc:  # noqa: BLE001 - a module's own loader (a quantized Linear wants all its keys)
        raise UnsupportedError(
            f"run B cannot take run A's weights: loading them raised {describe_exception(exc)}",
            hint="save A's weights (torch.save(model.state_dict(), PATH)) and give them to B with --vs-weights PATH",
        ) from exc
    return sorted(set(own) - set(fits))


def run_diff(opts: RunOptions, vs: VsOptions) -> DiffReport:
    """``diff`` under the run lock for both models, with gradients possible (``inference_mode(False)``)."""
    with exclusive(opts.model), exclusive(vs.model), torch.inference_mode(False):
        return diff_report(opts, vs)


def diff_report(opts: RunOptions, vs: VsOptions) -> DiffReport:
    """Run A (``opts``) then B (``opts`` with ``vs``'s changes) on the same input and compare them."""
    vs = vs.validate()
    opts_b = _options_b(opts, vs)
    batch = 2 if opts.train and vs.grads else None
    prep_a = _with_root(prepare(opts, default_batch=batch))
    require_values(prep_a, "diff")
    prep_b = _with_root(prepare(opts_b, default_batch=batch))
    require_values(prep_b, "diff")
    prep_b = dataclasses.replace(prep_b, inputs=prep_a.inputs)  # the same input, cast as B runs
    notes: list[str] = []
    if vs.weights is None and prep_b.loaded.model is not prep_a.loaded.model:
        # B gets A's weights: building a model twice need not give the same random weights (an
        # import that draws random numbers the first time only), and a refactor is compared as such
        if prep_b.loaded.kind == "instance":
            notes.append("run B's model was passed in: it runs with its own weights")
        else:
            kept = _share_weights(prep_a.loaded.model, prep_b.loaded.model)
            if vs.model is not None:
                notes.append("run B runs with run A's weights" + (
                    f" (except {', '.join(kept[:5])}{', ...' if len(kept) > 5 else ''}: no tensor of that "
                    "name and shape in A)" if kept else ""))
    if not vs.changes():
        notes.append("run B changes nothing (no --vs-* option): every difference should be 0")
    if vs.compile:
        notes.append("run B is torch.compile'd; hooks on its modules split the compiled graph at each "
                     "selected module")
    report = DiffReport(model=prep_a.info, vs_model=prep_b.info, changes=vs.changes(), grads=vs.grads,
                        notes=notes)
    head_a, head_b = new_report(prep_a, "diff"), new_report(prep_b, "diff")
    report.inputs, report.device, report.mode, report.version, report.reduction = (
        head_a.inputs, head_a.device, head_a.mode, head_a.version, head_a.reduction)
    report.vs_device = head_b.device
    store, grad_store = DiskStore(), DiskStore()
    try:
        records_a, loss_a = _run(prep_a, "A", store.put, grad_store.put if vs.grads else None,
                                 grads=vs.grads, compile_model=False)
        outputs, gradients = _Comparer(store, vs), _Comparer(grad_store, vs)
        records_b, loss_b = _run(prep_b, "B", outputs, gradients if vs.grads else None,
                                 grads=vs.grads, compile_model=vs.compile)
        report.rows = _rows(records_a, records_b, outputs, gradients if vs.grads else None,
                            set(grad_store.items))
        report.tolerances = _distinct(list(outputs.tolerances.values()) + list(gradients.tolerances.values()))
    finally:
        store.close()
        grad_store.close()
    if loss_a is not None and loss_b is not None:
        report.loss = {**{k: loss_a[k] for k in ("kind", "output", "target")},
                       "a": loss_a["value"], "b": loss_b["value"]}
    return report


def _distinct(tolerances: list[Tolerance]) -> list[Tolerance]:
    seen: dict[tuple[Any, ...], Tolerance] = {}
    for t in tolerances:
        seen.setdefault(dataclasses.astuple(t), t)
    return list(seen.values())


def _key(r: LayerRecord) -> Key:
    return (r.name, r.call, r.output)


def _rows(records_a: list[LayerRecord], records_b: list[LayerRecord], outputs: _Comparer,
          gradients: _Comparer | None, grads_a: set[Key]) -> list[DiffRow]:
    """One row per output tensor of run A (execution order), run B's extra calls after their
    predecessor in B's order, then modules neither run called."""
    errors = outputs.results()
    grad_errors = gradients.results() if gradients is not None else {}
    b_called = {_key(r): r for r in records_b if r.called}
    a_called = {_key(r): r for r in records_a if r.called}
    called_names = {r.name for r in records_a + records_b if r.called}
    a_order = {key: i for i, key in enumerate(outputs.store.items)}  # run A's outputs as they were produced
    b_order = {key: i for i, key in enumerate(outputs.b_meta)}
    grad_order = {key: i for i, key in enumerate(gradients.b_meta)} if gradients is not None else {}

    def row_of(ra: LayerRecord | None, rb: LayerRecord | None) -> DiffRow:
        base = ra or rb
        assert base is not None
        row = DiffRow(name=base.name, call=base.call, type=base.type, output=base.output,
                      depth=module_depth(base.name), calls=max(r.calls for r in (ra, rb) if r is not None),
                      final=base.name == "")
        if ra is not None:
            row.a_shape, row.a_dtype = ra.shape, ra.dtype
        if rb is not None:
            row.b_shape, row.b_dtype, row.b_type = rb.shape, rb.dtype, rb.type
        key = _key(base)
        if rb is None:
            row.status = "only_a"
        elif ra is None:
            row.status = "only_b"
        elif ra.shape is None and rb.shape is None:
            row.status = "no_tensor"
        elif ra.shape != rb.shape or ra.shape is None or rb.shape is None:
            row.status = "shape"
        elif key in errors:
            row.errors = errors[key]
            row.status = "ok" if row.errors.within else "diverged"
        else:
            row.status = "no_tensor"
        row.order = a_order.get(key, len(a_order) + b_order.get(key, 0))
        row.grad_order = grad_order.get(key, -1)
        if gradients is not None and ra is not None and rb is not None and row.status != "no_tensor":
            in_a, in_b = key in grads_a, key in gradients.b_meta
            if key in grad_errors:
                row.grad = grad_errors[key]
                row.grad_status = "ok" if row.grad.within else "diverged"
            elif in_a and in_b:
                row.grad_status = "shape"
            elif in_a or in_b:
                row.grad_status = "missing"
        return row

    rows = [row_of(ra, b_called.get(_key(ra))) for ra in records_a if ra.called]
    index = {_key(r): i for i, r in enumerate(ra for ra in records_a if ra.called)}
    after: dict[int, list[DiffRow]] = {}
    anchor = -1
    for rb in records_b:
        if not rb.called:
            continue
        key = _key(rb)
        if key in a_called:
            anchor = index[key]
        else:
            after.setdefault(anchor, []).append(row_of(None, rb))
    merged = after.get(-1, [])
    for i, row in enumerate(rows):
        merged.append(row)
        merged.extend(after.get(i, []))
    for r in records_a:
        if not r.called and r.name not in called_names:
            merged.append(DiffRow(name=r.name, call=0, type=r.type, status="not_called",
                                  depth=module_depth(r.name), calls=0))
    return merged


__all__ = ["VsOptions", "diff_report", "run_diff"]
