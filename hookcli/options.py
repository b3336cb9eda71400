"""Every run option, validated in one place before any model is built.

The CLI and the Python API both build a ``RunOptions`` and call ``validate()``: bad values raise
``UsageError`` (exit 2) with a hint, so nothing slow happens before the user learns of a typo.
"""

from __future__ import annotations

import ast
import fnmatch
import math
import operator
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from enum import Enum, StrEnum
from typing import TYPE_CHECKING, Any, TypeVar

from hookcli.errors import InputError, OutputError, UsageError, did_you_mean

if TYPE_CHECKING:
    import torch
    from torch import nn


DEFAULT_MODEL = "resnet50"


@dataclass(frozen=True)
class ModelSource:
    """One form of a MODEL spec. ``MODEL_SOURCES`` is the one table of them: ``source_of`` tells a spec's
    source from it, the loader (``hookcli.engine.loading.LOADERS``) builds by its ``kind``, a config's
    model is confined by its ``config`` rule (``hookcli.config``), ``hookcli models --source`` lists the
    ``listed`` ones, and help texts are written from ``help`` and ``example``."""

    kind: str  #: the source's name: ``LoadedModel.kind`` and the ``models --source`` value
    help: str  #: what help texts call it
    example: str
    prefix: str = ""  #: a spec starting with it (any case) is of this source; "" for none
    listed: bool = False  #: ``hookcli models --source KIND`` lists its model names (``PREFIX + name``)
    #: what a config may name: "any" (a library's model, by name), "own folder" (a directory only when
    #: it is inside the config's repository), "own module" (an import path of the repository's own
    #: package), "own file" (a .py file inside the repository)
    config: str = "any"


TORCHVISION = ModelSource("torchvision", "a torchvision name", DEFAULT_MODEL, "torchvision:", listed=True)
TIMM = ModelSource("timm", "timm:NAME (timm, random init)", "timm:resnet18", "timm:", listed=True)
HF = ModelSource("hf", "hf:TYPE, hf:DIR or hf:ORG/NAME (transformers: a config type, a save_pretrained "
                 "directory or the local cache)", "hf:gpt2", "hf:", listed=True, config="own folder")
IMPORT = ModelSource("import", "an import path", "pkg.mod:Net", config="own module")
FILE = ModelSource("file", "a file", "path/net.py:build", config="own file")
#: Every model source, in the order help texts list them (docs/development.md: how to add one).
MODEL_SOURCES: tuple[ModelSource, ...] = (TORCHVISION, TIMM, HF, IMPORT, FILE)
#: Prefixes of the model sources that optional extras provide (``hookcli.engine.sources``).
TIMM_PREFIX = TIMM.prefix
HF_PREFIX = HF.prefix
#: Whose model names ``hookcli models --source`` lists (the CLI's choices and ``hookcli.models``' check).
LISTED_SOURCES: tuple[str, ...] = tuple(source.kind for source in MODEL_SOURCES if source.listed)


def source_of(spec: str) -> ModelSource:
    """The source a MODEL spec string names: its prefix (any case) if it has one; else a file for
    ``file.py`` or ``file.py:attr``, an import path for ``pkg.mod:attr``, and a torchvision name for a
    plain name (the last ``:`` splits off the attribute, so ``C:\\net.py:Net`` is a file)."""
    text = spec.strip()
    lowered = text.lower()
    for source in MODEL_SOURCES:
        if source.prefix and lowered.startswith(source.prefix):
            return source
    target = text.rpartition(":")[0].strip() if ":" in text else text
    if target.endswith(".py"):
        return FILE
    return IMPORT if ":" in text else TORCHVISION


def strip_prefix(spec: str, source: ModelSource) -> str:
    """``spec`` without ``source``'s prefix (``timm:resnet18`` -> ``resnet18``), stripped; as is without one."""
    text = spec.strip()
    return text[len(source.prefix):].strip() if source.prefix and text.lower().startswith(source.prefix) else text


def model_sources_text() -> str:
    """``a torchvision name (resnet50), timm:NAME (...) (timm:resnet18), ...``: every MODEL form."""
    parts = [f"{source.help} ({source.example})" for source in MODEL_SOURCES]
    return ", ".join(parts[:-1]) + " or " + parts[-1]


# --------------------------------------------------------------------------- closed vocabularies
# Each is a StrEnum: its members are strings (the API takes "randn" as well as Fill.randn), print as
# their value, and are the choices of the CLI option and the values the config schema accepts.
# Member names are the values (Click shows an enum choice by its member name).


class Fill(StrEnum):
    """How a dummy input is filled (``--fill``)."""

    randn = "randn"
    rand = "rand"
    ones = "ones"
    zeros = "zeros"


class Loss(StrEnum):
    """The loss ``grads`` and ``check`` backpropagate (``--loss``)."""

    auto = "auto"
    ce = "ce"
    nll = "nll"
    mean_square = "mean_square"
    sum = "sum"
    mean = "mean"


class ParamScope(StrEnum):
    """Which parameters are reported (``--params``)."""

    selected = "selected"
    all = "all"
    none = "none"


class GradSort(StrEnum):
    """How ``grads`` orders its layer and parameter rows (``--sort``): gradient norm or largest
    |gradient| (descending), or name."""

    norm = "norm"
    max = "max"
    name = "name"


class Shard(StrEnum):
    """How ``--shard`` splits the model over torchrun's ranks (docs/distributed.md)."""

    ddp = "ddp"
    fsdp2 = "fsdp2"
    tp = "tp"


#: The environment ``torchrun`` gives every rank it starts.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def torchrun_env() -> bool:
    """Whether this process is a rank that ``torchrun`` started (its environment is there)."""
    return all(os.environ.get(name) for name in TORCHRUN_ENV)


def torchrun_rank() -> int:
    """This process's rank as torchrun says (0 outside torchrun): who prints the report."""
    return int(os.environ.get("RANK", "0") or 0) if torchrun_env() else 0


class Mode(StrEnum):
    """The module mode of a run (``--train/--eval``; a config's ``mode``)."""

    train = "train"
    eval = "eval"


class DType(StrEnum):
    """The dtypes a model may be cast to (``--dtype``); ``DTYPES`` maps accepted spellings to them."""

    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"
    float64 = "float64"


class OutputFormat(StrEnum):
    """The output formats of every command (``--format``)."""

    TABLE = "table"
    JSON = "json"
    CSV = "csv"
    MARKDOWN = "markdown"

    @classmethod
    def parse(cls, value: OutputFormat | str) -> OutputFormat:
        """``OutputFormat`` from a member or its (case-insensitive) name; ``md`` means markdown."""
        if isinstance(value, OutputFormat):
            return value
        text = str(value).strip().lower()
        text = _FORMAT_ALIASES.get(text, text)
        try:
            return cls(text)
        except ValueError:
            names = [m.value for m in cls]
            raise OutputError(
                f"unknown output format {value!r} (choose from {', '.join(names)})",
                hint=did_you_mean(text, names),
            ) from None


_FORMAT_ALIASES = {"md": "markdown", "txt": "table", "text": "table"}

E = TypeVar("E", bound=Enum)


def split_patterns(values: Sequence[str] | str | None) -> list[str]:
    """Flatten repeated and comma-separated option values: ``["a,b", "c"]`` -> ``["a", "b", "c"]``."""
    if values is None:
        return []
    if isinstance(values, str):
        values = [values]
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


#: The names a ``--layers`` pattern gives the model itself (the root module, whose name is "").
ROOT_LABELS = ("", "(model)")


def layer_matches(pattern: str, name: str) -> bool:
    """Whether the module ``name`` matches one ``--layers`` pattern: its exact name, a glob (``layer1.*``:
    never the root), or ``(model)`` for the root. The one matcher of module names, for the commands that
    hook modules and for ``hookcli report`` (torch-free, as this module is)."""
    if pattern in ROOT_LABELS:
        return name == ""
    if any(ch in pattern for ch in "*?["):
        return bool(name) and fnmatch.fnmatchcase(name, pattern)
    return pattern == name


def values_of(vocabulary: type[Enum]) -> tuple[str, ...]:
    """The string values of a closed vocabulary, in declaration order (CLI choices, config schema)."""
    return tuple(str(member.value) for member in vocabulary)


def member(vocabulary: type[E], value: Any, flag: str) -> E:
    """``value`` (a member or its string) as a member of ``vocabulary``, else a UsageError naming ``flag``."""
    try:
        return vocabulary(value)
    except (ValueError, TypeError):
        names = values_of(vocabulary)
        raise UsageError(f"unknown {flag} {value!r}",
                         hint=did_you_mean(str(value), names) or f"choose one of: {', '.join(names)}") from None


FILLS = values_of(Fill)
LOSSES = values_of(Loss)
PARAM_SCOPES = values_of(ParamScope)
#: ``--dtype`` spellings -> the dtype.
DTYPES: dict[str, DType] = {
    **{d.value: d for d in DType}, "float": DType.float32, "fp32": DType.float32, "half": DType.float16,
    "fp16": DType.float16, "bf16": DType.bfloat16, "double": DType.float64, "fp64": DType.float64,
}
#: Seeds torch's generators take as given (``torch.Generator.manual_seed`` reads them as uint64).
MAX_SEED = 2**64 - 1
#: The largest ``fmaps --scale`` (a tile of N x N px per value; the image size is checked as well).
MAX_FMAP_SCALE = 256
SEED_HINT = f"a seed is an integer from 0 to {MAX_SEED} (2**64-1), e.g. --seed 0"



#: A ``--model-arg`` value that is not a Python literal but still a string: a plain word or path
#: (``relu``, ``gelu_new``, ``bert-base-uncased``, ``weights/x.pt``), never something that looks
#: like a broken literal (``[1,2``, ``3x``, ``{a: 1}``).
_BARE_WORD = re.compile(r"[A-Za-z_./~][A-Za-z0-9_.+:/~=@%-]*")
MODEL_ARG_HINT = ("VALUE is a Python literal (10, 0.2, True, None, 'text', [1, 2], {'a': 1}) or a plain word "
                  "taken as a string (relu); quote other strings: --model-arg \"name='a b'\"")


def parse_model_args(items: Sequence[str | tuple[str, Any]]) -> dict[str, Any]:
    """Parse ``KEY=VALUE`` items (``--model-arg``, a config's ``model_args`` array); a ``(key, value)``
    pair (a config's ``model_args`` table) is taken as given.

    A value is a Python literal (``ast.literal_eval``: numbers, ``True``/``None``, quoted strings,
    lists, tuples, dicts). A value that is not a literal is a string only when it is a plain word
    or path (letters, digits, ``_ . - + : / ~ = @ %``, not starting with a digit); anything else, such
    as ``[1,2`` or ``3x``, is a UsageError: a typo never silently becomes a string.
    """
    result: dict[str, Any] = {}
    for item in items:
        if isinstance(item, tuple) and len(item) == 2:  # a config table's (key, value): RunOptions checks the key
            result[item[0]] = item[1]
            continue
        key, sep, raw = str(item).partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise UsageError(f"bad model argument {short(str(item))!r}: expected KEY=VALUE with KEY a name",
                             hint="e.g. --model-arg num_classes=10 --model-arg dropout=0.2")
        if key in result:
            raise UsageError(f"model argument {key!r} given twice", hint="give each --model-arg KEY once")
        text = raw.strip()
        try:
            result[key] = ast.literal_eval(text)
            continue
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            pass
        if not _BARE_WORD.fullmatch(text):
            why = "an empty value" if not text else f"{short(text)!r} is not a Python literal"
            raise UsageError(f"bad model argument {key}: {why}", hint=MODEL_ARG_HINT)
        result[key] = text
    return result


def output_key_path(key: str, paths: Iterable[str]) -> str | None:
    """The path ``--output-key KEY`` names among ``paths`` (written as the engine's ``iter_tensors``
    writes them: ``""``, ``[0]``, ``['out']``, ``.logits``): the path itself, ``[KEY]`` (an index),
    ``['KEY']`` (a dict key) or ``.KEY`` (a field), in that order; None when none is there."""
    present = set(paths)
    return next((p for p in (key, f"[{key}]", f"[{key!r}]", f".{key}") if p in present), None)


def check_path_text(value: Any, what: str, error: type[UsageError] = UsageError) -> None:
    """``error`` (exit 2) when the path ``value`` (a str or os.PathLike) holds a NUL byte, which no file
    name can: the OS would refuse it with a ValueError deep in a run. The one check of every path a
    user, a config or a Python caller gives (read or written)."""
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if isinstance(text, str) and "\0" in text:
        raise error(f"{what} {short(text)!r} holds a NUL byte (\\x00), which no file name can hold",
                    hint="remove the NUL character from the path")


def short(text: str, limit: int = 60) -> str:
    """``text`` cut to ``limit`` characters with ``...`` (values quoted in messages)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


INPUT_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
DTYPE_ALIASES: dict[str, str] = {**{n: n for n in INPUT_DTYPES}, "float": "float32", "fp32": "float32",
                                 "half": "float16", "fp16": "float16", "bf16": "bfloat16",
                                 "double": "float64", "long": "int64", "int": "int32"}
SHAPE_EXAMPLE = "e.g. 2x3x224x224, 2,3,224,224, 1x16:int64 or input_ids=1x128:int64 (a keyword input)"


@dataclass(frozen=True)
class InputSpec:
    """One input given by shape (and optionally dtype) on the command line."""

    shape: tuple[int, ...]
    dtype: str | None  # canonical torch dtype name; None = the model's default
    name: str | None = None  # keyword argument of forward; None = positional


def parse_input_shape(text: str) -> InputSpec:
    """Parse ``2x3x224x224``, ``2,3,224,224``, ``1x16:int64`` or ``NAME=SHAPE[:DTYPE]`` (a keyword
    input of forward, e.g. ``input_ids=1x128:int64``) into an InputSpec."""
    name: str | None = None
    head, eq, rest = text.strip().partition("=")
    if eq:
        name = head.strip()
        if not name.isidentifier():
            raise UsageError(f"bad input name {short(head)!r} in input shape {short(text)!r}: expected NAME=SHAPE "
                             "with NAME a forward argument", hint=SHAPE_EXAMPLE)
        text = rest
    body, sep, dtype_text = text.strip().partition(":")
    dtype: str | None = None
    if sep:
        dtype = DTYPE_ALIASES.get(dtype_text.strip().lower().removeprefix("torch."))
        if dtype is None:
            raise UsageError(f"unknown dtype {dtype_text!r} in input shape {text!r}",
                             hint=f"valid dtypes: {', '.join(INPUT_DTYPES)}; {SHAPE_EXAMPLE}")
    parts = re.split(r"[xX,*]", body.strip().strip("()[]").replace(" ", ""))
    if not all(p.isdigit() and len(p) <= 19 and int(p) > 0 for p in parts):
        raise UsageError(f"bad input shape {short(text)!r}: dimensions must be positive integers",
                         hint=SHAPE_EXAMPLE)
    shape = tuple(int(p) for p in parts)
    if math.prod(shape) > MAX_NUMEL:
        raise UsageError(f"input shape {short(text)!r} has {math.prod(shape):.3g} elements, more than a tensor can hold",
                         hint=SHAPE_EXAMPLE)
    return InputSpec(shape, dtype, name)


#: The most elements a torch tensor may have (its sizes and strides are int64).
MAX_NUMEL = 2**63 - 1


def _flag(name: str, default: Any = None, *, help: str | None = None, **kwargs: Any) -> Any:  # noqa: A002
    """A RunOptions field that the command line sets with ``name`` (its long flag; a config key is
    the flag's name, ``-`` or ``_``): the one place a field's flag, and the help that the CLI option
    and the config key both show, are written beside the field."""
    if "default_factory" not in kwargs:
        kwargs["default"] = default
    metadata = {"flag": name} if help is None else {"flag": name, "help": help}
    return field(metadata=metadata, **kwargs)


def option_flags() -> dict[str, str]:
    """RunOptions field -> the flag that sets it (``input_shapes`` -> ``--input-shape``; ``model``:
    the MODEL argument)."""
    return {f.name: f.metadata["flag"] for f in fields(RunOptions) if "flag" in f.metadata}


def option_help(name: str) -> str:
    """The help of RunOptions field ``name``: the text of its CLI option and its config key alike."""
    return next(f.metadata["help"] for f in fields(RunOptions) if f.name == name)


def parse_dtype(value: Any) -> DType | None:
    """The DType a ``--dtype`` spelling names (``bf16``, ``torch.float16``, any case), or None: the one
    reading of a dtype, for the command line, the API and a config's ``dtype`` alike."""
    return DTYPES.get(str(value).removeprefix("torch.").lower())


@dataclass
class RunOptions:
    """Options shared by the commands that run a model (shapes, stats, grads, ...).

    Each field the command line sets names its flag (``metadata["flag"]``): the CLI's parameter of
    that flag has the field's name, and a config key is the flag's name (``input_shape`` sets
    ``input_shapes``), see ``config_options``.
    """

    model: Any = _flag("model", help="The model: " + model_sources_text() + ".")  # a spec string, an nn.Module, or None for the default (MODEL argument)
    model_source: str = "argument"
    #: set when a config named the model: the directories its code must come from (the repository),
    #: see ``hookcli.config.read_roots``; empty when the user named it
    model_roots: tuple[str, ...] = ()
    #: set when a config named the data: the directories a function it names (called for its batches)
    #: must come from; empty when the user named it
    data_roots: tuple[str, ...] = ()
    model_args: Mapping[str, Any] = _flag(
        "--model-arg", default_factory=dict,
        help="Argument for the model class/factory: a Python literal (10, 0.2, True, 'a b', [1, 2]) or a plain word "
        "taken as a string (relu); repeatable.")  # config: model_args
    weights: str | None = _flag(
        "--weights",
        help="State dict file (.pt/.pth/.safetensors) or torchvision weights name (DEFAULT; downloads).")
    # let torch.load unpickle arbitrary objects from weights/input files (runs code from them);
    # only the command line or a Python keyword sets it, never a config file
    trust_pickle: bool = _flag("--trust-pickle", False)
    # let an hf: model run the Python code that comes with it (auto_map); command line or Python only
    trust_remote_code: bool = _flag("--trust-remote-code", False)
    input_shapes: Sequence[Any] = _flag(
        "--input-shape", (),
        help="Dummy input shape, e.g. 2x3x224x224 or 1x16:int64; NAME= makes it a keyword input "
        "(input_ids=1x128:int64); repeat for several inputs.")  # strings like "2x3x224x224:float16" or InputSpec
    #: files (paths); from Python also tensors: a tensor, a tuple/list of them, a dict of keyword inputs
    inputs: Any = _flag(
        "--input", (),
        help="Image(s), a folder of images, or a .pt/.npy/.npz/.safetensors tensor file; repeatable.")
    batch_size: int | None = _flag(
        "--batch-size",
        help="Batch size of the dummy input (features: images per batch from --input; --data: images or rows "
        "per batch; default 32).")
    #: a data set to run over in batches (stats, grads, check): a folder of images or a tensor file (a
    #: path), an import path of an iterable of batches (pkg.mod:attr, path/file.py:attr), or (Python
    #: only) any iterable of batches, or a tensor / tuple of tensors / dict of tensors to slice
    data: Any = _flag(
        "--data",
        help="Run a data set in batches, statistics merged over all of them: a folder of images, a tensor file "
        "of (samples, ...) tensors, or pkg.mod:attr / path/data.py:attr naming an iterable of batches (a "
        "DataLoader; each batch a tensor, tuple or dict of inputs).")
    batches: int | None = _flag(
        "--batches", help="Run at most N batches of --data (default: all; needed for an iterable without a length).")  # at most this many batches of ``data`` (None: all)
    fill: Fill | str = _flag("--fill", Fill.randn, help="How the dummy input is filled.")
    seed: int = _flag("--seed", 0, help="Random seed of the dummy input (0 to 2**64-1).")
    seq_len: int | None = _flag(
        "--seq-len",
        help="Sequence length of generated token/sequence inputs (default 128, or less where a transformers "
        "config limits positions).")  # length of generated sequences (None: 128, capped by an HF config)
    layers: Sequence[str] | str | None = _flag(
        "--layers", help="Module names or globs, comma-separated or repeated (layer4, 'layer1.*').")
    types: Sequence[str] | str | None = _flag("--types", help="Module class names, e.g. Conv2d,ReLU.")
    depth: int | None = _flag("--depth", help="Every module down to this depth.")
    all_modules: bool = _flag("--all", False, help="Every module of the model.")
    device: str | None = _flag(
        "--device", help="cpu (default), cuda, cuda:N, mps; `shapes` uses meta when none is given.")
    dtype: DType | str | None = _flag(
        "--dtype", help=f"Cast the model and float inputs: {', '.join(values_of(DType))}.")
    train: bool = _flag("--train", False, help="Run in training or eval mode (default eval).")
    # gradients (grads, check)
    loss: Loss | str = _flag("--loss", Loss.auto)
    target: int = _flag("--target", 0)
    output_key: str | None = _flag("--output-key")
    params: ParamScope | str = _flag("--params", ParamScope.selected)
    clip: float | None = _flag("--clip")
    input_grads: bool = _flag("--input-grads", False)
    # shapes: FLOPs per call; run on the meta device (None: when nothing needs real values)
    flops: bool = _flag("--flops", False)
    meta: bool | None = None
    #: under torchrun: build the model on the meta device, shard it over the ranks, fill it from rank 0
    shard: Shard | str | None = _flag(
        "--shard", help="Under torchrun: shard the model over the ranks (ddp, fsdp2 or tp), built on the meta device "
        "and filled with rank 0's initialisation; the report is that of one process (docs/distributed.md).")

    # filled by validate()
    specs: list[InputSpec] = field(default_factory=list, init=False)

    def validate(self) -> RunOptions:
        """Check and normalise every option; return a new, validated copy (the steps of ``_VALIDATION``,
        in order: the first problem found is the one reported)."""
        opts = replace(self)
        for step in _VALIDATION:
            step(opts)
        return opts

    def torch_dtype(self) -> torch.dtype | None:
        import torch

        return getattr(torch, self.dtype) if self.dtype else None


def _check_int(flag: str, value: Any, low: int, high: int | None = None, *, optional: bool = False,
               hint: str | None = None) -> Any:
    """``value`` as an int in [low, high] (None allowed when ``optional``), else UsageError."""
    if value is None and optional:
        return None
    try:
        number = None if isinstance(value, bool) else operator.index(value)  # int, numpy ints
    except TypeError:
        number = None
    if number is None or number < low or (high is not None and number > high):
        bound = f"from {low} to {high}" if high is not None else f"{low} or more"
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise UsageError(f"{flag} must be an integer {bound}, got {shown}", hint=hint or f"e.g. {flag} {low}")
    return number


def check_option_names(options: Mapping[str, Any]) -> None:
    """Refuse keyword options that are not RunOptions fields (``input_shape=`` for
    ``input_shapes=``): a UsageError with close matches, not a TypeError from the constructor."""
    names = [f.name for f in fields(RunOptions) if f.init]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise UsageError(f"unknown option {unknown[0]!r}",
                         hint=did_you_mean(unknown[0], names) or "options: " + ", ".join(names))


@dataclass(frozen=True)
class MemoryInputs:
    """Inputs given as tensors in Python (``inputs=tensor``, a tuple or list of tensors, a dict of keyword
    inputs): read as the same object saved to a .pt file and given as ``--input`` would be."""

    value: Any


def _in_memory(value: Any) -> bool:
    """Whether ``inputs`` are tensors (not file paths). No torch import: no tensor exists without it."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    if isinstance(value, (torch.Tensor, Mapping)):
        return True
    return isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value)


def _sequence(name: str, value: Any, example: str) -> Sequence[Any]:
    """A list-valued option: None means none; anything not a list or tuple is a UsageError."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise UsageError(f"{name} must be a list, got {type(value).__name__}", hint=f"e.g. {name}={example}")
    return value


def _check_model_args(value: Any) -> dict[str, Any]:
    """Model arguments as a dict of keyword names (the API may pass any mapping)."""
    if not isinstance(value, Mapping):
        raise UsageError(f"model_args must be a dict of keyword arguments, got {type(value).__name__}",
                         hint="e.g. model_args={'num_classes': 10}")
    bad = [k for k in value if not isinstance(k, str) or not k.isidentifier()]
    if bad:
        raise UsageError(f"model_args keys must be argument names, got {', '.join(map(repr, bad[:5]))}",
                         hint="e.g. model_args={'num_classes': 10}")
    return dict(value)


#: Suffixes of weights files (``--weights``): a value with one is a file, never a weights name.
WEIGHT_FILE_SUFFIXES: tuple[str, ...] = (".pt", ".pth", ".bin", ".safetensors", ".ckpt", ".pkl", ".tar")


def looks_like_weights_file(value: str, base: str | os.PathLike[str] | None = None) -> bool:
    """True when ``--weights`` ``value`` names a file rather than a torchvision weights name
    (``DEFAULT``, ``ResNet18_Weights.IMAGENET1K_V1``): it has a path separator or a weights suffix, or
    a file of that name exists (relative to ``base``, default the working directory)."""
    return ("/" in value or os.sep in value or value.lower().endswith(WEIGHT_FILE_SUFFIXES)
            or os.path.isfile(os.path.join(base, value) if base is not None else value))


def _check_device(text: str) -> str:
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise UsageError(f"unknown --device {text!r}", hint="e.g. cpu, cuda, cuda:1, mps") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {text}: CUDA is not available on this machine", hint="use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {text}: only {torch.cuda.device_count()} CUDA device(s) here",
                             hint=f"use --device cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    elif device.type == "mps":
        if not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
            raise UsageError(f"--device {text}: MPS is not available on this machine", hint="use --device cpu")
    elif device.type not in ("cpu", "meta"):
        raise UsageError(f"unsupported --device {text!r}", hint="e.g. cpu, cuda, cuda:1, mps")
    return str(device)


def model_is_instance(model: Any) -> bool:
    """True for an ``nn.Module`` object (Python API), without importing torch for strings."""
    if isinstance(model, (str, type(None))):
        return False
    from torch import nn

    return isinstance(model, nn.Module)


# --------------------------------------------------------------------------- RunOptions.validate's steps


def _default_model(opts: RunOptions) -> None:
    """The default model when none is given; an empty spec string is refused."""
    if opts.model is None:
        opts.model, opts.model_source = DEFAULT_MODEL, "default"
    if isinstance(opts.model, str) and not opts.model.strip():
        raise UsageError("the model spec is empty", hint="e.g. resnet50, pkg.mod:Net or path/to/file.py:build")


def _input_forms(opts: RunOptions) -> None:
    """One input shape, file or in-memory input becomes a list of one."""
    if isinstance(opts.input_shapes, (str, InputSpec)):
        opts.input_shapes = [opts.input_shapes]
    if isinstance(opts.inputs, (str, os.PathLike)):
        opts.inputs = [opts.inputs]
    elif _in_memory(opts.inputs):
        opts.inputs = [MemoryInputs(opts.inputs)]
    opts.input_shapes = _sequence("input_shapes", opts.input_shapes, "['2x3x224x224']")
    opts.inputs = _sequence("inputs", opts.inputs, "['photo.jpg']")


def _path_texts(opts: RunOptions) -> None:
    """No NUL byte in a path: the model's file, weights, input files, data (``check_path_text``)."""
    if isinstance(opts.model, str):
        check_path_text(opts.model, "model")
    check_path_text(opts.weights, "--weights", InputError)
    for value in opts.inputs:
        check_path_text(value, "--input", InputError)
    check_path_text(opts.data, "--data", InputError)


def _selection(opts: RunOptions) -> None:
    """``layers`` and ``types``: a string or a list of strings."""
    for name in ("layers", "types"):
        value = getattr(opts, name)
        if value is not None and not isinstance(value, str) and not (
                isinstance(value, Sequence) and all(isinstance(v, str) for v in value)):
            raise UsageError(f"{name} must be a string or a list of strings, got {type(value).__name__}",
                             hint=f"e.g. {name}='layer1,layer4'" if name == "layers" else "e.g. types='Conv2d,ReLU'")


def _weights_value(opts: RunOptions) -> None:
    """``weights``: a path or a weights name, as a string."""
    if opts.weights is not None:
        if not isinstance(opts.weights, (str, os.PathLike)):
            raise UsageError(f"weights must be a file path or a weights name, got {type(opts.weights).__name__}",
                             hint="e.g. weights='model.pt' or weights='DEFAULT' (torchvision)")
        opts.weights = os.fspath(opts.weights)


def _parsed_inputs(opts: RunOptions) -> None:
    """Input shapes parsed into ``specs``; input paths as strings."""
    opts.specs = [s if isinstance(s, InputSpec) else parse_input_shape(str(s)) for s in opts.input_shapes]
    opts.inputs = [p if isinstance(p, MemoryInputs) else os.fspath(p) for p in opts.inputs]


def _build_options(opts: RunOptions) -> None:
    """What building the model takes: ``model_args`` (only for a spec), the trust flags."""
    opts.model_args = _check_model_args(opts.model_args)
    if opts.model_args and model_is_instance(opts.model):
        raise UsageError("model_args apply when hookcli builds the model; this model is already built",
                         hint="pass the arguments to your model's constructor, or give a spec string")
    if not isinstance(opts.trust_pickle, bool):
        raise UsageError(f"trust_pickle must be True or False, got {opts.trust_pickle!r}",
                         hint="pass trust_pickle=True only for files you trust")
    if not isinstance(opts.trust_remote_code, bool):
        raise UsageError(f"trust_remote_code must be True or False, got {opts.trust_remote_code!r}",
                         hint="pass trust_remote_code=True only for model code you trust")


def _input_sources(opts: RunOptions) -> None:
    """One source of input: shapes, files or ``--data`` (with its batch options), files that exist."""
    if opts.specs and opts.inputs:
        raise UsageError("--input-shape and --input are mutually exclusive", hint="use one way to give the input")
    from hookcli.limits import refuse_special

    for path in opts.inputs:
        if not isinstance(path, MemoryInputs) and not os.path.exists(path):
            raise InputError(f"input file not found: {path}",
                             hint="check the path (relative paths start at the current directory)")
        if not isinstance(path, MemoryInputs):
            refuse_special(path, "input file")
    opts.batch_size = _check_int("--batch-size", opts.batch_size, 1, optional=True)
    opts.batches = _check_int("--batches", opts.batches, 1, optional=True,
                              hint="--batches N runs at most N batches of --data")
    if isinstance(opts.data, os.PathLike):
        opts.data = os.fspath(opts.data)
    if opts.batches is not None and opts.data is None:
        raise UsageError("--batches needs --data (the data set to take the batches from)",
                         hint="e.g. --data images/ --batches 10")
    if opts.data is not None and (opts.specs or opts.inputs):
        raise UsageError("--data and --input / --input-shape are mutually exclusive",
                         hint="--data runs a data set in batches; --input / --input-shape give one batch")
    if isinstance(opts.data, str) and not opts.data.strip():
        raise UsageError("--data is empty", hint="e.g. --data images/ or --data data.py:loader")
    if isinstance(opts.data, str):
        refuse_special(os.path.expanduser(opts.data), "data file")


def _numbers(opts: RunOptions) -> None:
    """Seed, sequence length, target class, fill and depth."""
    opts.seed = _check_int("--seed", opts.seed, 0, MAX_SEED, hint=SEED_HINT)
    opts.seq_len = _check_int("--seq-len", opts.seq_len, 1, optional=True,
                              hint="the sequence length of generated token inputs, e.g. --seq-len 128")
    opts.target = _check_int("--target", opts.target, 0, hint="the class index the ce/nll loss uses, 0 or more")
    opts.fill = member(Fill, opts.fill, "--fill")
    opts.depth = _check_int("--depth", opts.depth, 0, optional=True,
                            hint="--depth N hooks every module down to depth N (0: the model itself)")


def _run_settings(opts: RunOptions) -> None:
    """dtype, device, loss, parameter scope and gradient clipping."""
    if opts.dtype is not None:
        dtype = parse_dtype(opts.dtype)
        if dtype is None:
            key = str(opts.dtype).removeprefix("torch.").lower()
            raise UsageError(f"unsupported --dtype {opts.dtype!r}", hint=did_you_mean(key, DTYPES) or
                             f"choose one of: {', '.join(values_of(DType))}")
        opts.dtype = dtype
    if opts.device is not None:
        opts.device = _check_device(str(opts.device))
    opts.loss = member(Loss, opts.loss, "--loss")
    opts.params = member(ParamScope, opts.params, "--params")
    if opts.clip is not None:
        if isinstance(opts.clip, bool) or not isinstance(opts.clip, (int, float)) or not 0 < opts.clip < math.inf:
            raise UsageError(f"--clip must be a positive finite number, got {opts.clip!r}",
                             hint="gradients are clamped to [-VALUE, VALUE], e.g. --clip 1.0")


def _weights_file(opts: RunOptions) -> None:
    """A weights file that does not exist, before anything is built."""
    if opts.weights is not None and looks_like_weights_file(opts.weights):
        from hookcli.errors import WeightsError
        from hookcli.limits import refuse_special

        if not os.path.exists(opts.weights):
            raise WeightsError(f"weights file not found: {opts.weights}",
                               hint="give an existing state-dict file, or a torchvision weights name such as DEFAULT")
        refuse_special(opts.weights, "weights file", WeightsError)


def _shard(opts: RunOptions) -> None:
    """``shard``: one of ``Shard``, only under torchrun, only for a model hookcli builds."""
    if opts.shard is None:
        return
    opts.shard = member(Shard, opts.shard, "--shard")
    if not torchrun_env():
        raise UsageError(f"--shard {opts.shard} runs under torchrun only (no RANK/WORLD_SIZE/MASTER_ADDR here)",
                         hint=f"torchrun --nproc-per-node N -m hookcli ... --shard {opts.shard}, or leave --shard out")
    if model_is_instance(opts.model):
        raise UsageError("--shard builds the model on the meta device; this model is already built",
                         hint="give a model spec (a name, pkg.mod:attr or file.py:attr), or shard your model yourself")


#: ``RunOptions.validate``'s steps, in the order their errors take precedence.
_VALIDATION = (_default_model, _input_forms, _path_texts, _selection, _weights_value, _parsed_inputs, _build_options, _input_sources,
               _numbers, _run_settings, _weights_file, _shard)


__all__ = ["RunOptions", "check_option_names", "DEFAULT_MODEL", "HF_PREFIX", "MODEL_SOURCES", "ModelSource", "source_of",
           "strip_prefix", "TIMM_PREFIX", "model_sources_text", "MAX_SEED", "MAX_FMAP_SCALE", "FILLS", "LOSSES", "PARAM_SCOPES", "model_is_instance"]

if TYPE_CHECKING:  # keep type checkers aware of the nn import used in annotations
    _ = nn
