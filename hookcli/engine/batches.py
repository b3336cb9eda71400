"""A data set as batches: the one iterator a run over many batches (``--data``) takes its inputs from.

Every source gives the same thing, ``ModelInputs`` on the CPU one batch at a time (the run places
each on its device in its dtype, as a single ``--input``): a folder of images (read ``batch_size``
images at a time, preprocessed as ``--input`` preprocesses them), a tensor file whose tensors share a
leading batch dimension (sliced into ``batch_size`` pieces), an import path naming an iterable of
batches (``pkg.mod:attr`` / ``path/file.py:attr``, resolved as MODEL import paths are), or, from
Python, any iterable, or a tensor / tuple of tensors / dict of tensors to slice. An item of an
iterable is a tensor (one positional input), a tuple or list (positional inputs) or a dict with
string keys (keyword inputs), as the inputs of ``--input`` files are. Only one batch is held at a
time (a tensor file is read whole, within ``limits.TENSOR_BYTES``, and sliced): memory does not grow
with the number of batches.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from hookcli.engine import rank_stats
from hookcli.engine.loading import DATA_HINT, LoadedModel, check_own_code, import_attr
from hookcli.engine.input_types import (
    IMAGE_SUFFIXES,
    TENSOR_SUFFIXES,
    ModelInputs,
    pack_inputs,
    plural,
)
from hookcli.engine.stats import (Vector, activation_stats, gradient_stats, iter_tensors, map_tensors, merged,
                                  to_host)
from hookcli.errors import InputError, UnsupportedError, describe_exception
from hookcli.records import LayerRecord

#: Images (or tensor rows) per batch when ``--batch-size`` is not given.
DEFAULT_DATA_BATCH = 32
#: Families whose images are not one batch item each (one clip, one frame pair): not a data set of images.
_UNBATCHED_FAMILIES = ("video", "optical_flow")


@dataclass
class DataBatches:
    """The batches of a data set: ``first`` (already read: it decides the report's input rows and is
    checked against the model's signature before anything runs), then ``rest``; ``label`` says
    where they come from; ``total`` how many batches there will be (None when not known up front)."""

    first: ModelInputs
    rest: Iterator[ModelInputs]
    label: str
    total: int | None
    #: The hint when a batch does not fit forward's signature (None: ``build_inputs.DATA_SIGNATURE_HOW``).
    how: str | None = None


def batch_size_of(inputs: ModelInputs) -> int:
    """The samples in one batch: the leading dimension of its first tensor (a list of images: its
    length); 1 when it has no tensor with a dimension."""
    for value in (*inputs.args, *inputs.kwargs.values()):
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
            return len(value)  # detection: one list of images
        for _, t in iter_tensors(value):
            return int(t.shape[0]) if t.dim() > 0 else 1
    return 1


def open_data(loaded: LoadedModel, data: Any, *, batch_size: int | None = None, batches: int | None = None,
              trust_pickle: bool = False, dtype: torch.dtype | None = None,
              own_code: Sequence[str] = ()) -> DataBatches:
    """The batches of ``data`` (see the module's docstring) for ``loaded.model``, at most ``batches``.
    ``dtype``: the floating dtype of the run (``--dtype``; None: the model's), which a tensor file's
    floating tensors are cast to, as ``--input`` files are (``build_inputs.file_floats``). ``own_code``:
    a config named ``data`` (its repository's directories): a function it names is called only if it is
    that repository's own code.

    Raises InputError (exit 2) for a source that cannot be read, gives no batch, or has no length
    while ``batches`` is not given (an endless iterable would never end the run), and, while the run
    reads them, for an item of an unsupported type (naming the batch).
    """
    size = batch_size or DEFAULT_DATA_BATCH
    tensor_file = False
    if isinstance(data, (str, os.PathLike)):
        items, label, total = _from_text(loaded, os.fspath(data), size, trust_pickle, dtype, own_code)
        tensor_file = _is_tensor_file(Path(os.fspath(data)).expanduser())
    elif isinstance(data, (torch.Tensor, Mapping)) or (
            isinstance(data, tuple) and data and all(isinstance(v, torch.Tensor) for v in data)):
        whole = _as_inputs(data, "data", copy=False)
        items, total = _sliced(whole, size, "data", copy=True), -(-_leading(whole, "data") // size)
        label = f"data: a {type(data).__name__} (Python)"
    elif isinstance(data, Iterable):
        items, label, total = _from_iterable(data, type(data).__name__)
    else:
        raise InputError(f"data is a {type(data).__name__}, not an iterable of batches", hint=DATA_HINT)
    if total is None and batches is None:
        raise InputError(f"{label.removeprefix('data: ')} has no length (an endless iterable?), so the run "
                         "would not know when to stop", hint="give --batches N (batches=N) to run N batches of it")
    if batches is not None:
        items = itertools.islice(items, batches)
        total = min(total, batches) if total is not None else None
    first = next(items, None)
    if first is None:
        raise InputError(f"{label.removeprefix('data: ')} gave no batches", hint="give a data set with at least one batch")
    listed = tensor_file and len(first.args) > 1 and not first.kwargs  # a list in a file: positional inputs
    return DataBatches(first, items, label, total, LIST_OF_BATCHES_HINT if listed else None)


#: The hint for a tensor file of several positional tensors whose batch forward cannot take: most
#: often a list of batches, which cannot be told from one batch of positional inputs (both are a list
#: of tensors with a leading dimension), so it is refused, saying how to save a data set.
LIST_OF_BATCHES_HINT = ("a list in a --data file is one batch of positional inputs, cut along their first "
                        "dimension; save a list of batches as one tensor, torch.save(torch.cat(batches), PATH) "
                        "(--batch-size cuts it again), or a dict of forward's inputs, torch.save({'x': "
                        "torch.cat(xs)}, PATH)")


def _is_tensor_file(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in TENSOR_SUFFIXES


def _from_text(loaded: LoadedModel, text: str, size: int, trust_pickle: bool, dtype: torch.dtype | None = None,
               own_code: Sequence[str] = ()) -> tuple[Iterator[ModelInputs], str, int | None]:
    """A folder of images, a tensor file, or an import path of an iterable (what ``--data`` takes)."""
    path = Path(text).expanduser()
    if path.is_dir():
        images = image_tree(path)
        if not images:
            raise InputError(f"folder {text!r} has no images (nor its subfolders)",
                             hint="supported images: " + " ".join(IMAGE_SUFFIXES))
        if loaded.family in _UNBATCHED_FAMILIES:
            raise UnsupportedError(f"a {loaded.family} model takes its images as one input, not as a data set "
                                   "of images", hint="give them with --input instead")
        chunks = [images[i:i + size] for i in range(0, len(images), size)]
        label = f"data: {text.rstrip('/' + os.sep)}/ ({plural(len(images), 'image')})"
        return _images(loaded, chunks), label, len(chunks)
    if _is_tensor_file(path):
        from hookcli.engine.build_inputs import cast_note, file_floats, model_float_dtype
        from hookcli.engine.read_inputs import tensor_inputs

        whole = tensor_inputs(loaded, [path], trust_pickle=trust_pickle)
        listed = len(whole.args) > 1 and not whole.kwargs
        n = _leading(whole, f"data file {text}", hint=LIST_OF_BATCHES_HINT if listed else None)
        target = dtype or model_float_dtype(loaded.model)  # each batch cast as it is cut: one held at a time
        casts = sorted({note for _, t in iter_tensors((whole.args, whole.kwargs)) if (note := cast_note(t.dtype, target))})
        label = f"data: {text}" + (f" ({', '.join(casts)})" if casts else "")
        return (file_floats(b, target) for b in _sliced(whole, size, text)), label, -(-n // size)
    if path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES:
        raise InputError(f"--data takes a folder of images, not one image file ({text!r})",
                         hint="give the folder that holds the images, or --input FILE for one image")
    if path.exists():
        raise InputError(f"unsupported data file {text!r}", hint=f"{DATA_HINT}; tensor files: {' '.join(TENSOR_SUFFIXES)}")
    if ":" not in text:
        raise InputError(f"data not found: {text}", hint=DATA_HINT)
    target, _, attr = text.rpartition(":")
    obj = import_attr(text, target.strip(), attr.strip(), noun="data set")
    called = callable(obj) and not isinstance(obj, Iterable)
    if called:
        if own_code:  # a config's data: never call what its module only re-exports (from os import fork)
            check_own_code(obj, text, own_code, noun="data")
        obj = _called(obj, text)
    if isinstance(obj, (str, bytes, Mapping)) or not isinstance(obj, Iterable):
        raise InputError(f"--data {text!r} {'returned' if called else 'is'} a {type(obj).__name__}, not an "
                         "iterable of batches", hint=DATA_HINT)
    if called:
        text += "()"
    return _from_iterable(obj, text)


def _called(factory: Any, text: str) -> Any:
    """What a ``--data`` function gives when called with no arguments: a generator function's
    generator, a ``make_loader()``'s DataLoader (what people write to build a data set). InputError
    when it needs arguments (hookcli has none to give) or raises (the data set's code, not the model)."""
    import inspect

    try:
        signature = inspect.signature(factory)
        signature.bind()
    except TypeError:
        raise InputError(f"--data {text!r} takes arguments {signature}, which hookcli has none to give",
                         hint=DATA_HINT) from None
    except ValueError:  # no signature to read (a builtin): calling it says what it says
        pass
    try:
        return factory()
    except Exception as exc:
        raise InputError(f"calling --data {text}() raised {describe_exception(exc)}",
                         hint="the data set's code raised: run again with --debug for its traceback") from exc


def image_tree(folder: Path) -> list[Path]:
    """The images in ``folder`` and its subfolders (one per class, as torchvision's ``ImageFolder``
    lays a data set out), sorted by path. Symlinked folders and hidden ones (``.ipynb_checkpoints``)
    are not entered: a link to a parent folder would loop, and hidden copies are not the data set."""
    found: list[Path] = []
    for root, dirs, files in os.walk(folder):  # (followlinks=False)
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [p for p in (Path(root, f) for f in files) if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()]
    return sorted(found)


def _images(loaded: LoadedModel, chunks: list[list[Path]]) -> Iterator[ModelInputs]:
    from hookcli.engine.build_inputs import make_inputs  # (it imports the image decoders only when reading)

    for chunk in chunks:
        yield make_inputs(loaded, files=chunk)


def _from_iterable(data: Iterable[Any], label: str) -> tuple[Iterator[ModelInputs], str, int | None]:
    try:
        total: int | None = len(data)  # type: ignore[arg-type]
    except TypeError:  # a generator, an IterableDataset's loader: no length
        total = None

    def items() -> Iterator[ModelInputs]:
        try:
            iterator = iter(data)
        except Exception as exc:
            raise InputError(f"iterating over {label} raised {describe_exception(exc)}", hint=DATA_HINT) from exc
        for index in itertools.count():
            try:
                item = next(iterator)
            except StopIteration:
                return
            except Exception as exc:  # the data set's own code (a Dataset's __getitem__): not the model
                raise InputError(f"reading batch {index} of {label} raised {describe_exception(exc)}",
                                 hint="the data set's code raised: run again with --debug for its traceback") from exc
            yield _as_inputs(item, f"batch {index}")

    return items(), f"data: {label}", total


def _as_inputs(item: Any, where: str, *, copy: bool = True) -> ModelInputs:
    """One item of a data set as inputs: a tensor, a tuple/list of positional inputs, a dict of
    keyword inputs (string keys). InputError naming ``where`` for anything else. ``copy``: each
    tensor copied (the caller's own: a model changing its input in place must leave them as they were)."""
    if copy:
        item = _copy(item)
    if isinstance(item, torch.Tensor):
        made = pack_inputs([(item, where)])
    elif isinstance(item, (tuple, list)):
        made = pack_inputs([(v, f"{where}[{i}]") for i, v in enumerate(item)])
    elif isinstance(item, Mapping):
        if bad := [k for k in item if not isinstance(k, str) or not k.isidentifier()]:
            raise InputError(f"{where} is a dict with the key {bad[0]!r}, not a keyword argument name",
                             hint="a dict batch maps forward's argument names to tensors")
        made = pack_inputs([], [(k, v, f"{where}[{k!r}]") for k, v in item.items()])
    else:
        raise InputError(f"{where} is a {type(item).__name__}, not a tensor, tuple or dict of inputs",
                         hint="each batch is a tensor, a tuple of positional inputs or a dict of keyword inputs")
    if next(iter_tensors((made.args, made.kwargs)), None) is None:
        raise InputError(f"{where} holds no tensor", hint="each batch gives the model its input tensors")
    if any(t.is_meta for _, t in iter_tensors((made.args, made.kwargs))):
        raise InputError(f"{where} holds a meta tensor: it has a shape but no values",
                         hint="give tensors with values (tensor.cpu())")
    return made


def _leading(whole: ModelInputs, what: str, *, hint: str | None = None) -> int:
    """The batch dimension every tensor of ``whole`` shares; InputError (with ``hint`` when given)
    when they do not share one."""
    sizes = {name: (int(v.shape[0]) if isinstance(v, torch.Tensor) and v.dim() > 0 else None)
             for name, v in zip((i.name for i in whole.infos), (*whole.args, *whole.kwargs.values()))}
    if None in sizes.values() or len(set(sizes.values())) != 1:
        shown = ", ".join(f"{k}: {v if v is not None else 'no batch dimension'}" for k, v in sizes.items())
        raise InputError(f"{what}: its tensors do not share a leading batch dimension ({shown})",
                         hint=hint or "a data set in one tensor file holds tensors of shape (samples, ...), one per input")
    return next(iter(sizes.values()))  # type: ignore[return-value]


def _copy(item: Any) -> Any:
    """``item`` with every tensor in its tuples, lists and dicts copied."""
    return map_tensors(lambda t: t.detach().clone(), item)


def _sliced(whole: ModelInputs, size: int, what: str, *, copy: bool = False) -> Iterator[ModelInputs]:
    """``whole``'s tensors in pieces of ``size`` samples along the leading dimension (views, or with
    ``copy`` copies: ``whole`` is the caller's own)."""
    n = _leading(whole, what)
    names = list(whole.kwargs)
    cut = (lambda v, a, b: v[a:b].clone()) if copy else (lambda v, a, b: v[a:b])
    for start in range(0, n, size):
        stop = min(start + size, n)
        yield pack_inputs([(cut(v, start, stop), f"{what}[{start}:{stop}]") for v in whole.args],
                          [(k, cut(whole.kwargs[k], start, stop), f"{what}[{start}:{stop}]") for k in names])


def batches_text(count: int) -> str:
    """``1 batch``, ``7 batches``."""
    return f"{count} batch{'' if count == 1 else 'es'}"


#: A row's identity over batches: (module name, call index, output path).
Key = tuple[str, int, str]


class MergedRows:
    """The rows of a run over many batches: one per (module, call index, output path), its statistics
    and output-gradient statistics each merged over every batch that had them (``stats.merged``: exact
    counts and extremes), the rest (shape, input shapes, dtype) as the first batch that had it gave it.

    Holds one row and two statistics vectors per key, and a count: nothing grows with the number of
    batches. ``notes`` says which rows did not run in every batch, and whose output shape changed
    beyond the leading (batch) dimension."""

    def __init__(self) -> None:
        self._rows: dict[Key, LayerRecord] = {}
        self._stats: dict[Key, Vector] = {}
        self._grads: dict[Key, Vector] = {}
        self._seen: dict[Key, int] = {}
        self._varies: set[Key] = set()
        self.batches = 0
        self.samples = 0

    def add(self, layers: list[LayerRecord], vectors: Mapping[Key, tuple[Vector | None, Vector | None]],
            samples: int) -> None:
        """Take one batch's rows and the (statistics, gradient) vectors of its output tensors."""
        self.batches += 1
        self.samples += samples
        for rec in layers:
            key = (rec.name, rec.call, rec.output)
            first = self._rows.get(key)
            if first is None or (not first.called and rec.called):
                self._rows[key] = rec
            elif first.shape is not None and rec.shape is not None and first.shape[1:] != rec.shape[1:]:
                self._varies.add(key)
            if rec.called:
                self._seen[key] = self._seen.get(key, 0) + 1
        for key, pair in vectors.items():
            for into, vector in zip((self._stats, self._grads), pair):
                if vector is not None:
                    into[key] = merged(into.get(key), vector)  # type: ignore[assignment]

    def records(self, *, ranks: bool = False, failed: bool = False, tp: list[list[int]] | None = None
                ) -> list[LayerRecord]:
        """The merged rows (statistics of all their batches), in the order they were first seen.
        ``ranks``: under ``torchrun``, merged over every rank's batches too (``rank_stats.global_rows``;
        ``failed``: this rank's run failed, every rank raises ``RanksFailed``; ``tp``: the model's
        tensor-parallel groups, ``distributed.supported_tp_groups``)."""
        stats, grads = list(self._stats), list(self._grads)
        host = to_host([self._stats[k] for k in stats] + [self._grads[k] for k in grads])
        merged_stats, merged_grads = dict(zip(stats, host)), dict(zip(grads, host[len(stats):]))
        placement: dict[Any, str] = {}
        if ranks:  # under torchrun: over every rank's batches (docs/distributed.md); as they are without one
            merged_stats, merged_grads, placement = rank_stats.global_rows(merged_stats, merged_grads,
                                                                            failed=failed, tp=tp)
        out = []
        for key, rec in self._rows.items():
            values, grad = merged_stats.get(key), merged_grads.get(key)
            out.append(replace(rec, stats=activation_stats(values) if values is not None else rec.stats,
                               grad=gradient_stats(grad) if grad is not None else rec.grad,
                               placement=placement.get(key, rec.placement)))
        return out

    @property
    def notes(self) -> list[str]:
        """What a reader of the merged rows should know: rows not in every batch, shapes that vary."""
        notes = []
        for key, rec in self._rows.items():
            seen = self._seen.get(key, 0)
            if rec.called and seen < self.batches:
                notes.append(f"{rec.label} ran in {seen} of {batches_text(self.batches)}: its statistics "
                             "are over those")
            if key in self._varies:
                notes.append(f"{rec.label}: the output shape varies between batches beyond the first dimension; "
                             "the first batch's is shown")
        return notes


__all__ = ["DEFAULT_DATA_BATCH", "DataBatches", "MergedRows", "batch_size_of", "open_data"]
