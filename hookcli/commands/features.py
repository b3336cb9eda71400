"""``hookcli features``: save the outputs of the selected modules to .safetensors, .pt or .npz.

The seeds' FeatureExtractor, through the hook engine: ``engine.run.run_step`` (one batch
with the session's hooks, and the model's failure located) with a ``keep`` callback that gets
every output tensor of every selected call; only those are kept (detached, copied to CPU), so
memory grows with what is selected, not with the model. Entries are named like the JSON report's
rows (``LayerRecord.label``): ``layer4``, ``layer1.0.relu#1`` for the second call of a reused
module, ``split[0]`` / ``heads['out']`` for tensors inside tuple or dict outputs, ``(model)`` for
the root. Names are unique by construction (:func:`feature_key`): where a module's own name could
read as one of these (``act#1``, ``split[0]``, ``(model)``, ``__metadata__``) its characters are
percent-encoded (``act%231``), so no module name can produce another entry's key.

A folder of images runs in batches of ``batch_size`` (default 32) images; each entry is copied into
one tensor preallocated for all images after the first batch, so the result equals one run over
all images at once.

File formats (by extension) and where the metadata goes (the same ``str -> str`` dict in each):

- ``.safetensors``: the entries, metadata in the file's metadata header;
- ``.pt`` / ``.pth``: ``{"tensors": {label: tensor}, "metadata": {...}}`` via ``torch.save``
  (loads with ``torch.load(path, weights_only=True)``);
- ``.npz``: one array per entry plus ``__metadata__``, a 0-d string array holding the metadata as
  JSON (loads with ``numpy.load(path)``; bfloat16 and float8 entries are stored as float32).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

import torch

from hookcli._version import __version__
from hookcli.progress import bar as progress_bar
from hookcli.engine.run import (
    Prepared,
    new_report,
    place_inputs,
    prepare,
    raise_failure,
    require_values,
    RunPlan,
    run_step,
    running,
)
from hookcli.errors import InputError, InternalError, OutputError, UnsupportedError
from hookcli.engine.taps import Keep
from hookcli.engine.read_inputs import list_input_files
from hookcli.engine.build_inputs import make_inputs
from hookcli.engine.loading import refuse_torchscript
from hookcli.options import MemoryInputs, RunOptions
from hookcli.engine.state import exclusive
from hookcli.engine.stats import dtype_name
from hookcli.records import FeatureExport, InputInfo, LayerRecord, SavedTensor

#: Extension -> format name.
FEATURE_FORMATS: dict[str, str] = {
    ".safetensors": "safetensors",
    ".pt": "torch",
    ".pth": "torch",
    ".npz": "numpy",
}
#: Images per batch when ``--input`` names more images than this and no ``--batch-size`` is given.
DEFAULT_IMAGE_BATCH = 32
#: Families whose images are not one batch item each (one clip, one frame pair, a list of images):
#: their images always run at once.
_UNBATCHED_FAMILIES = ("video", "optical_flow", "detection")
#: The ``format`` metadata value: what wrote the file and its layout version.
METADATA_FORMAT = "hookcli.features/1"

Key = tuple[str, int, str]  # (module name, call index, output path)

#: Characters of a module name percent-encoded in an entry key: ``%`` (the escape itself), ``#``
#: (starts the call index), ``[`` (starts an output path), ``/`` and ``\\`` (folders inside an .npz).
_KEY_SPECIAL = frozenset("%#[/\\")
#: The key the root module gets; a module name starting with ``(`` has its ``(`` encoded.
ROOT_KEY = "(model)"
#: Keys the file formats reserve (safetensors' header and hookcli's .npz metadata array).
RESERVED_KEYS = frozenset({"__metadata__"})


def _encode_name(name: str) -> str:
    """A module name as the first part of a key: ``%#[/\\``, a leading ``(``, every non-printable
    character and the first ``_`` of a reserved key percent-encoded (UTF-8 bytes)."""
    if not name:
        return ROOT_KEY
    out = []
    for index, ch in enumerate(name):
        if ch in _KEY_SPECIAL or not ch.isprintable() or (index == 0 and (ch == "(" or name in RESERVED_KEYS)):
            out.append("".join(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass")))
        else:
            out.append(ch)
    return "".join(out)


def feature_key(name: str, call: int, calls: int, path: str) -> str:
    """The entry name of one output tensor in a features file; unique by construction.

    ``<name>[#<call>]<path>``: the module name (:func:`_encode_name`: it holds no ``#`` and no
    ``[``), then ``#call`` when the module ran more than once *or* the path is a field (``.x``, which
    a dotted module name could otherwise end with), then the output path as the report writes it
    (``""``, ``[0]``, ``['out']``, ``.logits``). Reading a key back: the name is everything before
    the first ``#`` or ``[``, and a call index is digits, so two different (name, call, path)
    never share a key, and no key is ``__metadata__``.
    """
    shown_call = calls > 1 or path.startswith(".")
    return _encode_name(name) + (f"#{call}" if shown_call else "") + path


def check_output(path: str | os.PathLike[str]) -> tuple[Path, str]:
    """Validate a features output path up front: a supported extension and a writable directory.

    Returns the absolute target and the format name; raises OutputError (exit 2).
    """
    from hookcli.output import ensure_writable

    text = os.fspath(path)
    suffix = Path(text).suffix.lower()
    fmt = FEATURE_FORMATS.get(suffix)
    if fmt is None:
        shown = suffix or "no extension"
        raise OutputError(f"cannot save features to {text}: unsupported file type ({shown})",
                          hint="use one of: " + ", ".join(FEATURE_FORMATS))
    if fmt == "safetensors":
        try:
            import safetensors.torch  # noqa: F401
        except ImportError:
            raise OutputError("saving .safetensors needs the safetensors package",
                              hint="pip install safetensors, or save to .pt or .npz") from None
    return ensure_writable(text), fmt


# --------------------------------------------------------------------------- collecting


@dataclass
class _Entry:
    key: Key
    label: str
    type: str
    shape: list[int]  # of one batch (dim 0 replaced by the total when batched)
    dtype: torch.dtype
    tensor: torch.Tensor


class FeatureStore:
    """The ``keep`` callback and the kept tensors, over one or more batches.

    ``keep`` copies each selected output tensor to CPU as its module returns it (before a later
    in-place op can change it). ``end_batch`` checks the batch against the first one and, when the
    run is batched, copies it into the tensors preallocated for all ``total`` items.
    """

    def __init__(self, total: int | None = None) -> None:
        self.total = total  # items over all batches; None: one run, nothing to append
        self.entries: dict[Key, _Entry] = {}
        self.not_called: list[str] = []
        self.no_tensor: list[str] = []  # labels of calls that returned no tensor (None, ints, ...)
        self._batch: dict[Key, torch.Tensor] = {}
        self._offset = 0
        self._first = True
        self._same_path: list[Key] = []

    def keep(self, name: str, call: int, path: str, tensor: torch.Tensor) -> None:
        key = (name, call, path)
        if key in self._batch:  # two dict keys with one repr: said after the run, never in the hook
            self._same_path.append(key)
        self._batch[key] = tensor.detach().to(
            device="cpu", copy=True, memory_format=torch.contiguous_format)

    def end_batch(self, records: Sequence[LayerRecord], size: int) -> None:
        """Take the batch of ``size`` items whose calls ``records`` describes."""
        batch, self._batch = self._batch, {}
        if self._same_path:
            name, call, path = self._same_path[0]
            raise UnsupportedError(
                f"two output tensors of {name or '(model)'} (call {call}) have the same path {path}: "
                "a dict output whose keys print the same", hint="give the output dict keys that print "
                "differently (strings, ints), or select other modules with --layers")
        keys: list[Key] = []
        labels: dict[Key, tuple[str, str]] = {}
        not_called: list[str] = []
        for rec in records:
            if not rec.called:
                not_called.append(rec.name)
                continue
            key = (rec.name, rec.call, rec.output)
            if key in batch:
                keys.append(key)
                labels[key] = (feature_key(rec.name, rec.call, rec.calls, rec.output), rec.type)
            elif self._first and rec.shape is None:
                self.no_tensor.append(rec.label)
        if self._first:
            self._first = False
            self.not_called = not_called
            for key in keys:
                t = batch[key]
                if self.total is not None:
                    self._check_batch_dim(labels[key][0], t, size)
                    full = torch.empty((self.total, *t.shape[1:]), dtype=t.dtype)
                    full[:size].copy_(t)
                    t = full
                self.entries[key] = _Entry(key, labels[key][0], labels[key][1], list(t.shape), t.dtype, t)
        else:
            if set(keys) != set(self.entries) or not_called != self.not_called:
                raise InputError(
                    "the selected modules ran differently on this batch than on the first "
                    f"(items {self._offset}-{self._offset + size - 1})",
                    hint="the model's control flow depends on its input; give --batch-size at least "
                    f"{self.total} to run all images at once")
            for key in keys:
                entry, t = self.entries[key], batch[key]
                self._check_batch_dim(entry.label, t, size)
                if list(t.shape[1:]) != entry.shape[1:] or t.dtype != entry.dtype:
                    raise InputError(
                        f"{entry.label}: output {dtype_name(t.dtype)} {list(t.shape)} on this batch "
                        f"does not match {dtype_name(entry.dtype)} {[size, *entry.shape[1:]]} of the first",
                        hint=f"give --batch-size at least {self.total} to run all images at once")
                entry.tensor[self._offset:self._offset + size].copy_(t)
        self._offset += size

    def _check_batch_dim(self, label: str, t: torch.Tensor, size: int) -> None:
        if t.dim() == 0 or t.shape[0] != size:
            raise InputError(
                f"{label}: output shape {list(t.shape)} does not start with the batch "
                f"({size} images), so batches cannot be appended",
                hint=f"give --batch-size at least {self.total} to run all images at once")


# --------------------------------------------------------------------------- saving


def _numpy_array(t: torch.Tensor) -> tuple[Any, bool]:
    """A numpy array of ``t``; dtypes numpy lacks (bfloat16, float8) become float32 (flag True)."""
    try:
        return t.numpy(), False
    except TypeError:
        return t.float().numpy(), True


def _write_npz(path: str | os.PathLike[str] | IO[bytes], arrays: dict[str, Any]) -> None:
    """``numpy.savez`` without its keyword arguments: an entry named ``file`` or ``allow_pickle``
    is an array like any other (``np.savez(fh, **arrays)`` fails on one and drops the other)."""
    import zipfile

    import numpy as np

    with zipfile.ZipFile(path, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for key, array in arrays.items():
            with zf.open(key + ".npy", mode="w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)


def _dequantized(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``tensors`` with each quantized tensor (a quantized model's outputs) as its float values
    (``dequantize``), and a note for each: a format without quantized dtypes stores those."""
    notes = [f"{label}: {dtype_name(t.dtype)} (quantized) saved dequantized as float32"
             for label, t in tensors.items() if t.is_quantized]
    if not notes:
        return tensors, notes
    return {label: t.dequantize() if t.is_quantized else t for label, t in tensors.items()}, notes


def save_features(path: str | os.PathLike[str], fmt: str, tensors: dict[str, torch.Tensor],
                  metadata: dict[str, str]) -> tuple[int, list[str]]:
    """Write ``tensors`` and ``metadata`` to ``path``; return (bytes written, notes).

    A new or regular file is replaced atomically (temporary file + rename; nothing is left behind
    when writing fails or the run is interrupted); a FIFO or device is written in place, streamed
    (see hookcli.output). A full disk or another OSError is OutputError (exit 2).
    """
    from hookcli.output import atomic_path, open_output, resolve_target

    if fmt not in ("safetensors", "torch", "numpy"):  # pragma: no cover - check_output rejects it first
        raise OutputError(f"unknown features format {fmt!r}", hint="save to .safetensors, .pt or .npz")
    target = resolve_target(path)
    notes: list[str] = []
    if fmt != "torch":  # torch.save keeps quantized tensors; safetensors and numpy have no such dtype
        tensors, notes = _dequantized(tensors)
    if fmt == "safetensors" and not target.in_place:
        from safetensors.torch import save_file

        with atomic_path(target) as tmp:  # save_file streams from the tensors: no copy in memory
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
            size = os.path.getsize(tmp)
        return size, notes
    with open_output(target) as out:
        if fmt == "safetensors":  # into a pipe or device: save_file would replace it by a file
            from safetensors.torch import save

            out.write(save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata))
        elif fmt == "torch":
            torch.save({"tensors": tensors, "metadata": metadata}, out)
        else:
            import numpy as np

            arrays: dict[str, Any] = {}
            for label, tensor in tensors.items():
                arrays[label], cast = _numpy_array(tensor)
                if cast:
                    notes.append(f"{label}: {dtype_name(tensor.dtype)} saved as float32 (numpy has no "
                                 f"{dtype_name(tensor.dtype)})")
            arrays["__metadata__"] = np.array(json.dumps(metadata))
            _write_npz(out, arrays)
    return out.bytes_written, notes


def build_metadata(result: FeatureExport, prep: Prepared) -> dict[str, str]:
    """The metadata stored with the tensors (``str -> str``; nested values as JSON)."""
    opts = prep.options
    return {
        "format": METADATA_FORMAT,
        "hookcli": __version__,
        "model": result.model.spec,
        "model_class": result.model.class_name,
        "model_source": result.model.source,
        "weights": result.model.weights or "",
        "model_args": json.dumps(result.model.to_dict()["model_args"]),
        "inputs": json.dumps([i.to_dict() for i in result.inputs]),
        "device": result.device,
        "dtype": opts.dtype or "",
        "mode": result.mode,
        "layers": json.dumps([name for name, _ in prep.selection]),
        "entries": json.dumps([e.to_dict() for e in result.entries]),
    }


# --------------------------------------------------------------------------- running


def _plan(opts: RunOptions) -> tuple[RunOptions, list[list[Path]], str]:
    """Split ``--input`` images into batches: (options for the first run, batches, source label).

    No batches (``[]``) when the inputs are not images, or fit in one batch.
    """
    if not opts.inputs or isinstance(opts.inputs[0], MemoryInputs):
        return opts, [], ""
    kind, paths, label = list_input_files(opts.inputs)
    size = opts.batch_size or DEFAULT_IMAGE_BATCH
    if kind != "images" or len(paths) <= size:
        return opts, [], label
    batches = [paths[i:i + size] for i in range(0, len(paths), size)]
    return replace(opts, inputs=[os.fspath(p) for p in batches[0]]), batches, label


def run_features(options: RunOptions, *, output: str | os.PathLike[str] | None = None,
                 progress: bool | None = None) -> FeatureExport:
    """Run the model, keep the selected outputs, save them to ``output`` (if given).

    ``output`` is checked (extension, writable directory) before the model is built. The result
    lists every saved entry; its ``tensors`` dict holds the tensors (CPU) for Python callers.
    Raises ModelRaisedError (with the partial report) when the model raises or exits, InternalError
    when hookcli's hooks fail, UnsupportedError for TorchScript; nothing is written then. Sparse
    outputs are saved as dense tensors. Holds the run lock (``exclusive``) throughout.
    """
    with exclusive(options.model):
        return _run_features(options.validate(), output=output, progress=progress)


def _run_features(opts: RunOptions, *, output: str | os.PathLike[str] | None, progress: bool | None) -> FeatureExport:
    target, fmt = check_output(output) if output is not None else (None, None)
    first_opts, batches, label = _plan(opts)
    prep = prepare(first_opts)
    require_values(prep, "features")
    refuse_torchscript(prep.loaded.model, prep.selection)
    if batches and prep.loaded.family in _UNBATCHED_FAMILIES:
        prep.inputs = make_inputs(prep.loaded, files=opts.inputs)  # its images are one input
        batches = []
    total = sum(len(b) for b in batches) if batches else None
    store = FeatureStore(total)
    report = new_report(prep, "features")
    bar, advance = progress_bar("features", total or 0, "images",
                                enabled=progress if progress is not None else sys.stderr.isatty())
    with bar, running(prep) as (model, args, kwargs):
        for index in range(max(1, len(batches))):
            if index > 0:
                args, kwargs = place_inputs(prep, make_inputs(prep.loaded, files=batches[index]))
            run = run_step(prep, model, args, kwargs, [Keep(store.keep)], RunPlan(show_phase=False))
            if run.failure is not None:  # the user's model raised or exited: nothing is saved
                report.layers = run.layers
                if batches:
                    report.notes.append(f"batch {index + 1} of {len(batches)}")
                raise_failure(report, run.failure, run.cause, input_hint=None if batches else prep.input_hint)
            size = len(batches[index]) if batches else 0
            store.end_batch(run.layers, size)
            advance(size)
    result = FeatureExport(
        model=prep.info,
        inputs=_inputs(prep, batches, label),
        device=report.device,
        mode=report.mode,
        reduction=report.reduction,
        not_called=store.not_called,
        batches=max(1, len(batches)),
        batch_size=len(batches[0]) if batches else None,
        version=__version__,
    )
    for entry in store.entries.values():
        name, call, path = entry.key
        result.entries.append(SavedTensor(
            label=entry.label, name=name, call=call, output=path, type=entry.type,
            shape=list(entry.tensor.shape), dtype=dtype_name(entry.dtype),
            nbytes=entry.tensor.numel() * entry.tensor.element_size()))
        result.tensors[entry.label] = entry.tensor
    if len(result.tensors) != len(result.entries):  # feature_key is injective; this guards it
        raise InternalError("internal error: two features entries got the same name",
                            hint="run again with --debug for the traceback, and please report it")
    result.notes += [f"{name} was not called; nothing saved for it" for name in store.not_called]
    result.notes += [f"{label} returned no tensor; nothing saved for it" for label in store.no_tensor]
    if not result.entries:
        result.notes.append("no tensors to save: no selected module returned a tensor")
    if target is not None and fmt is not None:
        result.path, result.format = os.fspath(output), fmt  # type: ignore[arg-type]
        result.file_bytes, notes = save_features(target, fmt, result.tensors, build_metadata(result, prep))
        result.notes += notes
    return result


def _inputs(prep: Prepared, batches: list[list[Path]], label: str) -> list[InputInfo]:
    """The input infos; for a batched run one info for all images, shape as if run at once."""
    if not batches:
        return list(prep.inputs.infos)
    first = prep.inputs.infos[0]
    total = sum(len(b) for b in batches)
    shape = [total, *first.shape[1:]] if first.shape else None
    source = f"{label}, {len(batches)} batches of {len(batches[0])}"
    return [InputInfo(first.name, shape, first.dtype, source)]


__all__ = [
    "DEFAULT_IMAGE_BATCH",
    "FEATURE_FORMATS",
    "FeatureStore",
    "check_output",
    "run_features",
    "save_features",
]
