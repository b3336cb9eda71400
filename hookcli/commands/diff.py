"""``hookcli diff``: run a model twice (A, then B with the ``--vs-*`` changes) and find where they part.

Both runs go through the engine (``prepare`` / ``running`` / ``attach`` with ``HookOptions.keep``): run A
writes every selected output tensor to a disk-backed store (one file-mapped tensor per output, in a
temporary folder removed in ``finally``); run B compares each of its outputs with A's stored tensor as
it is produced, reduces the comparison to six numbers on B's device and drops both. Neither run's
activations are held beyond that, so peak memory is about a bare forward plus two activations.
The model's own output is always compared (its rows are ``final``): the exit code is decided on it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hookcli.errors import HookcliError, ModelRaisedError, UsageError
from hookcli.engine.loading import refuse_torchscript
from hookcli.engine.run import (
    Prepared,
    blame,
    failure_message,
    new_report,
    params_by_module,
    prepare,
    require_values,
    running,
)
from hookcli.engine.selection import module_depth
from hookcli.engine.session import HookOptions, attach
from hookcli.engine.stats import dtype_name, iter_tensors
from hookcli.options import DTYPES, RunOptions, model_is_instance
from hookcli.records import DiffReport, DiffRow, Errors, LayerRecord, Tolerance

Key = tuple[str, int, str]  # (module name, call index, output path)

#: Default (rtol, atol) by dtype. A pair of dtypes gets the looser of its two entries; integer and
#: bool tensors must be equal. Looser than torch.testing's per-op defaults: errors add up over layers.
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-7, 1e-7),
    "float32": (1e-5, 1e-5),
    "float16": (1e-2, 1e-3),
    "bfloat16": (5e-2, 1e-2),
}
#: Any other floating dtype (float8 kinds).
LOOSEST_TOLERANCE = (1e-1, 1e-1)


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


def tolerance_for(a_dtype: str, b_dtype: str, rtol: float | None, atol: float | None) -> Tolerance:
    """The tolerance two tensors are compared with: given values, else the dtypes' defaults."""
    floating = [d for d in (a_dtype, b_dtype) if d.startswith(("float", "bfloat", "complex"))]
    if not floating:
        return Tolerance(a_dtype, b_dtype, 0.0, 0.0, "exact")
    pairs = [DEFAULT_TOLERANCES.get(d.replace("complex128", "float64").replace("complex64", "float32"),
                                    LOOSEST_TOLERANCE) for d in floating]
    default_rtol, default_atol = max(p[0] for p in pairs), max(p[1] for p in pairs)
    source = "given" if rtol is not None or atol is not None else "default"
    return Tolerance(a_dtype, b_dtype, default_rtol if rtol is None else float(rtol),
                     default_atol if atol is None else float(atol), source)


# --------------------------------------------------------------------------- run A's store


@dataclass
class _Stored:
    path: str | None  # None: an empty tensor (nothing to map)
    shape: list[int]
    dtype: torch.dtype


class DiskStore:
    """Tensors kept on disk: each one a file mapped with ``torch.from_file``, read back lazily.

    Holding run A's activations here costs page cache, which the kernel can drop, not process memory.
    ``close`` removes the folder.
    """

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="hookcli-diff-")
        self.items: dict[Key, _Stored] = {}

    def put(self, name: str, call: int, path: str, tensor: torch.Tensor) -> None:
        """Keep ``tensor`` under (name, call, path): a ``HookOptions.keep`` callback."""
        key = (name, call, path)
        t = _plain(tensor)
        file = None
        if t.numel():
            file = os.path.join(self.folder, f"{len(self.items)}.bin")
            disk = torch.from_file(file, shared=True, size=t.numel(), dtype=t.dtype)
            disk.view(t.shape).copy_(t)
            del disk  # unmapped; the values stay in the file
        self.items[key] = _Stored(file, list(t.shape), t.dtype)

    def get(self, key: Key) -> torch.Tensor:
        item = self.items[key]
        if item.path is None:
            return torch.empty(item.shape, dtype=item.dtype)
        return torch.from_file(item.path, shared=False, size=math.prod(item.shape), dtype=item.dtype).view(item.shape)

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """A detached dense real tensor: quantized ones dequantized, complex ones as (..., 2) real."""
    t = tensor.detach()
    if t.is_quantized:
        t = t.dequantize()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    return t


# --------------------------------------------------------------------------- comparing


#: Elements compared at a time: the float64 working copies never exceed this (8 MB each).
CHUNK = 1 << 20


def compare(a: torch.Tensor, b: torch.Tensor, rtol: float) -> torch.Tensor:
    """Six numbers on ``b``'s device, no host sync: max|a-b|, ||a||^2, ||b||^2, ||a-b||^2, <a,b>, and
    max(|a-b| - rtol |a|) (within tolerance when it is <= atol).

    Equal values (also equal infinities, and NaN against NaN) differ by 0. Computed in float64 (float32
    on MPS, which has none; cosine near 1 needs the precision), CHUNK elements at a time, so the
    working copies stay small next to the activations; sums of squares as dot products (no temporaries).
    """
    ct = torch.float32 if b.device.type == "mps" else torch.float64
    a = a.to(device=b.device).reshape(-1)
    b = b.reshape(-1)
    zero = torch.zeros((), dtype=ct, device=b.device)
    parts = []
    for start in range(0, a.numel(), CHUNK):
        x = a[start:start + CHUNK].to(ct)
        y = b[start:start + CHUNK].to(ct)
        same = x == y  # also equal infinities, whose difference is NaN
        same |= x.isnan() & y.isnan()
        d = torch.where(same, zero, x - y)
        low, high = torch.aminmax(d)
        sums = [torch.dot(x, x), torch.dot(y, y), torch.dot(d, d), torch.dot(x, y)]
        d.abs_()
        if rtol:
            d.sub_(x.abs(), alpha=rtol)  # x may be the caller's own tensor: never in place
        parts.append(torch.stack([torch.maximum(-low, high), *sums, d.amax()]))
    if not parts:
        return torch.zeros(6, dtype=torch.float64, device=b.device)
    acc = torch.stack(parts)
    return torch.cat([acc[:, 0].amax().reshape(1), acc[:, 1:5].sum(0), acc[:, 5].amax().reshape(1)]).to(torch.float64)


def errors_from(values: list[float], atol: float) -> Errors:
    """The reported errors from ``compare``'s six numbers (host floats).

    rel_l2 = ||a-b|| / ||a|| (0 when both are 0, inf when only ||a|| is); cosine = <a,b> / (||a|| ||b||)
    computed as (||a||^2 + ||b||^2 - ||a-b||^2) / (2 ||a|| ||b||) when the norms are within 100x of
    each other (precise near 1, exactly 1 for equal tensors), clamped to [-1, 1] (1 when both are all
    zeros, 0 when one is); sqnr_db = 20 log10(||a|| / ||a-b||)
    (inf when a == b, also both zero; -inf when a is zero and b is not). NaN in, NaN out.
    """
    max_abs, sa, sb, sd, dot, excess = values
    na, nb, nd = math.sqrt(sa), math.sqrt(sb), math.sqrt(sd)
    within = not math.isnan(excess) and excess <= atol  # NaN/inf in the same places in both: equal
    if any(math.isnan(v) or math.isinf(v) for v in (sa, sb, sd, dot)):
        nan = math.nan
        return Errors(max_abs, nan, nan, nan, within)
    if nd == 0:
        rel, sqnr = 0.0, math.inf
    elif na == 0:
        rel, sqnr = math.inf, -math.inf
    else:
        rel = nd / na
        sqnr = 10 * math.log10(sa / sd) if math.isfinite(sa / sd) and sa / sd > 0 else 20 * math.log10(na / nd)
    if na == 0 and nb == 0:
        cos = 1.0
    elif na == 0 or nb == 0:
        cos = 0.0
    else:
        product = sa * sb  # sqrt(x * x) == x exactly: equal tensors give exactly 1
        denom = math.sqrt(product) if math.isfinite(product) and product > 0 else na * nb
        if 1e-4 < sa / sb < 1e4:
            # 2<a,b> = ||a||^2 + ||b||^2 - ||a-b||^2: exact for equal tensors and precise near 1, where
            # the summed <a,b> loses the digits that matter (not for norms far apart: cancellation)
            cos = (sa + sb - sd) / (2 * denom)
        else:
            cos = dot / denom
        cos = max(-1.0, min(1.0, cos))
    return Errors(max_abs, rel, cos, sqnr, within)


class _Comparer:
    """Run B's keep callbacks: compare each output (and gradient) with run A's as it arrives."""

    def __init__(self, store: DiskStore, vs: VsOptions) -> None:
        self.store = store
        self.vs = vs
        self.pending: dict[Key, torch.Tensor] = {}
        self.tolerances: dict[Key, Tolerance] = {}
        self.b_meta: dict[Key, tuple[list[int], str]] = {}  # in the order B produced them

    def __call__(self, name: str, call: int, path: str, tensor: torch.Tensor) -> None:
        key = (name, call, path)
        b = _plain(tensor)
        self.b_meta[key] = (list(b.shape), dtype_name(tensor.dtype))
        stored = self.store.items.get(key)
        if stored is None or stored.shape != list(b.shape):
            return  # only in B, or another shape: said by the row, nothing to compare
        a = self.store.get(key)
        tol = tolerance_for(dtype_name(stored.dtype), dtype_name(b.dtype), self.vs.rtol, self.vs.atol)
        self.tolerances[key] = tol
        self.pending[key] = compare(a, b, tol.rtol)

    def results(self) -> dict[Key, Errors]:
        """Every comparison, with one host transfer."""
        if not self.pending:
            return {}
        keys = list(self.pending)
        host = torch.stack([self.pending[k].cpu() for k in keys]).tolist()
        return {k: errors_from(v, self.tolerances[k].atol) for k, v in zip(keys, host)}


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
    from hookcli.commands.grads import _loss, no_gradients, require_grad

    opts = prep.options
    refuse_torchscript(prep.loaded.model, prep.selection)
    loss_info: dict[str, Any] | None = None
    with running(prep) as (model, args, kwargs):
        fn: Callable[..., Any] = torch.compile(model) if compile_model else model
        if grads:
            args, kwargs = require_grad(args), require_grad(kwargs)
        options = HookOptions(grads=grads, keep=keep, keep_grad=keep_grad)
        with attach(model, prep.selection, options) as session:
            phase = "forward"
            try:
                with torch.enable_grad() if grads else torch.no_grad():
                    output = fn(*args, **kwargs)
                    session.raise_error()
                    if grads:
                        choice = _loss(output, opts)
                        del output
                        leaves = [p for p in model.parameters() if p.requires_grad]
                        leaves += [t for _, t in iter_tensors((args, kwargs)) if t.requires_grad]
                        if not choice.value.requires_grad:
                            raise no_gradients(prep)
                        phase = "backward"
                        torch.autograd.grad(choice.value, leaves, allow_unused=True)
                        loss_info = choice.info(float(choice.value.detach()))
                session.raise_error()
            except HookcliError:
                raise
            except (Exception, SystemExit) as exc:  # the user's model raised or exited
                session.raise_error()
                failure = blame(exc, model, phase)
                raise ModelRaisedError(f"run {label}: {failure_message(failure)}", module=failure.module,
                                       input_shapes=failure.input_shapes, phase=failure.phase) from exc
            records, _ = session.records(params_by_module(prep.selection))
    return records, loss_info


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


def _share_weights(a: nn.Module, b: nn.Module) -> list[str]:
    """Copy A's parameters and buffers into B where name and shape match; the names that did not."""
    own = b.state_dict()
    theirs = a.state_dict()
    fits = {k: v for k, v in theirs.items() if k in own and own[k].shape == v.shape}
    b.load_state_dict(fits, strict=False)
    return sorted(set(own) - set(fits))


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
    report.inputs, report.device, report.mode, report.version = (head_a.inputs, head_a.device, head_a.mode,
                                                                 head_a.version)
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
        seen.setdefault((t.a_dtype, t.b_dtype, t.rtol, t.atol, t.source), t)
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


__all__ = ["DEFAULT_TOLERANCES", "DiskStore", "VsOptions", "compare", "diff_report", "errors_from",
           "tolerance_for"]
