"""Turn a model spec into an ``nn.Module``.

A spec is a torchvision model name (``resnet50``, ``torchvision:resnet50``), an import path
(``package.module:attr``) or a Python file (``path/to/net.py:attr``). torchvision models are always
built with ``weights=None`` (and ``weights_backbone=None``) unless the user names weights: nothing
downloads behind the user's back. Weights may also come from a local state-dict file, read with
``torch.load(weights_only=True)`` unless the caller trusts the file (``trust_pickle``).
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib
import importlib.util
import inspect
import os
import pickle
import re
import sys
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hookcli.options import (
    HF, MODEL_SOURCES, TIMM, TORCHVISION, WEIGHT_FILE_SUFFIXES, looks_like_weights_file, short as _short, source_of,
    strip_prefix,
)
from hookcli.errors import (
    HookcliError, ModelImportError, ModelNotFoundError, ModelRaisedError, UnsupportedError, UsageError, WeightsError,
    describe_exception, did_you_mean, exit_status, one_line, safe_str,
)
from hookcli.targets import OWN_CODE_HINT, is_inside, is_stdlib_module, is_stdlib_path

FAMILIES = ("classification", "detection", "segmentation", "video", "optical_flow", "quantization")
TRUST_PICKLE_HINT = "pass --trust-pickle if you trust the file (unpickling runs code from it)"
UNPICKLE_IMPORT_HINT = "unpickling imports the classes the file names: run where their modules are importable"
TORCHSCRIPT_HINT = ("use the eager nn.Module the TorchScript was made from (the Python class or factory: "
                    "pkg.mod:Net or net.py:build), with its weights via --weights")


def model_exited(exc: SystemExit, what: str) -> ModelRaisedError:
    """The error for user model code that called ``sys.exit`` while ``what`` (exit 1, never silent)."""
    return ModelRaisedError(f"the model exited with {exit_status(exc.code)} while {what} (it called sys.exit)",
                            phase="build", hint="the model's code ended the process; remove the sys.exit call")


@dataclass
class LoadedModel:
    """A built model plus where it came from (read by build_inputs.py and the report header)."""

    model: nn.Module
    spec: str  # the spec as the user gave it
    kind: str  # "torchvision" | "import" | "file" | "instance" | "timm" | "hf"
    family: str | None  # torchvision family; None for user models
    tv_name: str | None  # canonical torchvision name
    weights_enum: Any | None  # WeightsEnum entry for metadata/transforms only (no download)
    weights: str | None  # what was loaded: None, "DEFAULT", "IMAGENET1K_V2", "file: PATH"
    #: timm: input_size (C, H, W), mean, std, crop_pct from its pretrained_cfg; None for other sources
    input_config: dict[str, Any] | None = None


def _shown_args(model_args: Mapping[str, Any]) -> str:
    return _short(", ".join(f"{k}={v!r}" for k, v in model_args.items()), 120)


# --------------------------------------------------------------------------- torchvision


@lru_cache(maxsize=1)
def _family_map() -> dict[str, str]:
    """torchvision model name -> family, from the per-submodule model registries."""
    import torchvision.models as tvm

    modules = {"classification": tvm, "detection": tvm.detection,
               "segmentation": tvm.segmentation, "video": tvm.video,
               "optical_flow": tvm.optical_flow, "quantization": tvm.quantization}
    mapping: dict[str, str] = {}
    for family, module in modules.items():
        for name in tvm.list_models(module=module):
            mapping.setdefault(name, family)
    return mapping


def list_torchvision_models(pattern: str | None = None) -> list[tuple[str, str]]:
    """All torchvision models as ``(name, family)``, sorted, filtered by a case-insensitive glob."""
    rows = sorted(_family_map().items())
    if pattern:
        rows = [(n, f) for n, f in rows if fnmatch.fnmatchcase(n.lower(), pattern.lower())]
    return rows


def _resolve_weights_name(tv_name: str, weights: str) -> Any:
    """Map ``DEFAULT`` / ``IMAGENET1K_V2`` / ``ResNet50_Weights.IMAGENET1K_V2`` to an enum entry."""
    import torchvision.models as tvm

    enum = tvm.get_model_weights(tv_name)
    key = weights.strip().removeprefix(enum.__name__ + ".")
    members = enum.__members__
    for candidate in (key, key.upper()):
        if candidate in members:
            return members[candidate]
    raise WeightsError(f"unknown weights {weights!r} for {tv_name}; valid: {', '.join(members)}",
                       hint=did_you_mean(key, members) or "e.g. --weights DEFAULT, or a file")


def _load_torchvision(spec: str, name: str, model_args: Mapping[str, Any],
                      weights: str | None, trust_pickle: bool = False) -> LoadedModel:
    import torchvision.models as tvm

    families = _family_map()
    tv_name = name.strip().lower()
    if tv_name not in families:
        hint = did_you_mean(name, families)
        if "." in name or "/" in name:
            extra = "for a user model use 'package.module:attr' or 'path/to/file.py:attr'"
            hint = f"{hint} ({extra})" if hint else extra
        raise ModelNotFoundError(f"unknown torchvision model {name!r}",
                                 hint=hint or "run 'hookcli models' to list them")
    kwargs: dict[str, Any] = {"weights": None}
    if "weights_backbone" in inspect.signature(tvm.get_model_builder(tv_name)).parameters:
        kwargs["weights_backbone"] = None
    for key in ("weights", "weights_backbone"):  # --weights is the one way in (a config's, or the user's)
        if key in model_args:
            raise UsageError(f"--model-arg {key} would download weights past --weights; hookcli builds {tv_name} "
                             f"with {key}=None", hint="drop it; name pretrained weights with --weights (DEFAULT, "
                             "IMAGENET1K_V1, ...) or give a file")
    kwargs.update(model_args)
    try:  # the DEFAULT entry, for metadata and preset transforms; touching it downloads nothing
        weights_enum = tvm.get_model_weights(tv_name).DEFAULT
    except (ValueError, KeyError, AttributeError):
        weights_enum = None
    named: str | None = None
    if weights is not None and not looks_like_weights_file(weights):
        kwargs["weights"] = weights_enum = _resolve_weights_name(tv_name, weights)
        named = weights
        if "progress" in inspect.signature(tvm.get_model_builder(tv_name)).parameters:
            kwargs.setdefault("progress", False)  # torch.hub's download bar is not hookcli's output
        if families[tv_name] == "quantization":  # quantized weights only fit a quantized model
            kwargs.setdefault("quantize", True)
    try:
        model = tvm.get_model(tv_name, **kwargs)
    except Exception as exc:
        if named is not None and (isinstance(exc, OSError) or (isinstance(exc, RuntimeError) and not model_args)):
            raise WeightsError(f"could not download {tv_name} weights {named!r}; offline? "
                               f"({describe_exception(exc)})",
                               hint="download the file elsewhere and pass it with --weights FILE, "
                               "or leave --weights out for random weights") from exc
        if not model_args and not isinstance(exc, (TypeError, ValueError)):
            raise  # torchvision failed on its own defaults: not the user's input
        with_args = f" with {_shown_args(model_args)}" if model_args else ""
        raise UsageError(f"could not build {tv_name!r}{with_args}: {describe_exception(exc)}",
                         hint=f"check the --model-arg values against torchvision.models.{tv_name}()") from exc
    loaded = named
    if weights is not None and named is None:
        loaded = _load_state_dict_file(model, Path(weights), trust_pickle=trust_pickle)
    return LoadedModel(model, spec, "torchvision", families[tv_name], tv_name, weights_enum, loaded)


# --------------------------------------------------------------------------- user models


@contextmanager
def _on_sys_path(*dirs: str) -> Iterator[None]:
    """Put ``dirs`` at the front of sys.path for the duration of an import, then restore it."""
    added = [d for d in dirs if d not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for d in added:
            if d in sys.path:
                sys.path.remove(d)


def _refuse_stdlib_target(target: str, spec: str, is_file: bool, noun: str = "model") -> None:
    """Refuse a MODEL (or ``--data``) import path into the standard library before importing it
    (``antigravity`` opens a browser on import): such a target is never a model or a data set, and
    from a config it is an attack."""
    if is_stdlib_path(Path(target).expanduser()) if is_file else is_stdlib_module(target):
        raise UsageError(f"refusing {noun} {spec!r}: {target!r} is part of Python's standard library, "
                         f"not a {noun}", hint=OWN_CODE_HINT if noun == "model" else DATA_HINT)


def _origin(obj: Any) -> tuple[str, str]:
    """(module, qualified name) of what callable ``obj`` runs: through ``functools.partial`` to
    what it wraps, through a bound built-in method to its owner; else its ``__module__``."""
    import functools

    for _ in range(100):
        if not isinstance(obj, functools.partial):
            break
        obj = obj.func
    what = getattr(obj, "__qualname__", None)
    what = what if isinstance(what, str) else type(obj).__qualname__
    if isinstance(obj, type):
        return obj.__module__, what
    name = getattr(obj, "__module__", None)
    if isinstance(name, str):
        return name, what
    owner = getattr(obj, "__self__", None)
    if inspect.ismodule(owner):
        return owner.__name__, what
    return (type(owner).__module__ if owner is not None else type(obj).__module__), what


def check_target(obj: Any, label: str) -> None:
    """Refuse, before anything is called, a MODEL target that cannot be the user's model builder.

    Refused (UsageError, exit 2): a class that is not an ``nn.Module`` subclass (instantiating it
    cannot give a model), and a callable defined in Python's standard library or builtins
    (``os:system``, ``subprocess:run``, ``builtins:eval``, ``functools:partial``, also re-exported by
    a user module: ``mymod:system`` after ``from os import system``, or wrapped in a
    ``functools.partial``) or a function of PyTorch itself (``torch:load`` would unpickle a file
    without ``--trust-pickle``; ``torch.hub:load`` downloads and runs code). ``nn.Module`` classes
    from anywhere and factories from any other package stay allowed.
    """
    if isinstance(obj, type):
        if issubclass(obj, nn.Module):
            return
        raise UsageError(f"{label!r} is the class {obj.__module__}.{obj.__qualname__}, not an nn.Module "
                         "subclass; refusing to instantiate it", hint=OWN_CODE_HINT)
    origin, what = _origin(obj)
    if origin == "builtins" or is_stdlib_module(origin):
        raise UsageError(f"refusing model {label!r}: it names {origin}.{what} from Python's standard "
                         "library or builtins, not a model class or factory", hint=OWN_CODE_HINT)
    if origin.partition(".")[0] == "torch":
        raise UsageError(f"refusing model {label!r}: it names the PyTorch function {origin}.{what}, not "
                         "a model class or factory (load weights with --weights FILE)", hint=OWN_CODE_HINT)


def _import_module(module_name: str) -> Any:
    with _on_sys_path(os.getcwd()):
        try:
            return importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            missing = exc.name or ""
            if missing and (module_name == missing or module_name.startswith(missing + ".")):
                raise ModelNotFoundError(
                    f"could not import {module_name!r}: {safe_str(exc)}",
                    hint="check the spelling, and that the package is installed or in the "
                    "current directory") from exc
            raise ModelImportError(f"importing {module_name!r} failed: {type(exc).__name__}: {safe_str(exc)}",
                                   hint="a module it imports is missing; install it") from exc
        except Exception as exc:
            raise ModelImportError(f"importing {module_name!r} failed: {type(exc).__name__}: {safe_str(exc)}",
                                   hint="the module raised while importing: run again with --debug for its traceback") from exc
        except SystemExit as exc:
            raise model_exited(exc, f"importing {module_name!r}") from exc


def _import_file(path_text: str, noun: str = "model") -> Any:
    """Import a .py file under a unique module name, its folder on sys.path for sibling imports."""
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise ModelNotFoundError(f"{noun} file not found: {path_text}", hint="give an existing .py file")
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    stem = "".join(c if c.isalnum() else "_" for c in resolved.stem)
    module_name = f"_hookcli_file_{stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    if spec is None or spec.loader is None:
        raise ModelImportError(f"cannot import {path_text!r} as a Python file", hint="give a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses, pickling and typing look the module up
    try:
        with _on_sys_path(str(resolved.parent)):
            spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise ModelImportError(f"importing {path_text!r} failed: {type(exc).__name__}: {safe_str(exc)}",
                               hint="the file raised while importing: run again with --debug for its traceback") from exc
    except SystemExit as exc:
        sys.modules.pop(module_name, None)
        raise model_exited(exc, f"importing {path_text!r}") from exc
    return module


def _is_module_like(value: Any) -> bool:
    return isinstance(value, nn.Module) or (
        isinstance(value, type) and issubclass(value, nn.Module))


def _resolve_attr(module: Any, attr: str, where: str) -> Any:
    """Follow a dotted attribute; a missing part gives close matches among model-like names."""
    obj = module
    for depth, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            owner = where if depth == 0 else f"{where}:{'.'.join(attr.split('.')[:depth])}"
            public = [n for n in dir(obj) if not n.startswith("_")]
            models = [n for n in public if _is_module_like(getattr(obj, n, None))]
            others = [n for n in public if callable(getattr(obj, n, None))]
            hint = did_you_mean(part, models) or did_you_mean(part, others)
            if hint is None and models:
                hint = "nn.Module classes there: " + ", ".join(models[:10])
            raise ModelNotFoundError(f"{owner!r} has no attribute {part!r}", hint=hint)
        obj = getattr(obj, part)
    return obj


def _build(obj: Any, label: str, model_args: Mapping[str, Any]) -> nn.Module:
    """Instantiate a class / call a factory with ``model_args``, or take an instance as is."""
    if isinstance(obj, nn.Module):
        if model_args:
            raise UsageError(f"{label!r} is an already-built model instance; --model-arg "
                             "cannot apply", hint="point the spec at the class or a factory")
        return obj
    if not callable(obj):
        raise ModelImportError(
            f"{label!r} is a {type(obj).__name__}, not an nn.Module class, factory or instance",
            hint=OWN_CODE_HINT)
    check_target(obj, label)  # before the call: the call is what would run a shell command
    try:
        result = obj(**model_args)
    except SystemExit as exc:
        raise model_exited(exc, f"building {label!r}") from exc
    except HookcliError:  # the factory called hookcli, and hookcli refused (re-entry): its own message
        raise
    except Exception as exc:
        hint = "the model's own code raised: run again with --debug for its traceback"
        if isinstance(exc, TypeError) or model_args:
            hint = "pass arguments with --model-arg KEY=VALUE"
            try:
                hint = f"signature: {getattr(obj, '__name__', label)}{_short(str(inspect.signature(obj)), 200)}; {hint}"
            except (TypeError, ValueError):
                pass
        with_args = f" with {_shown_args(model_args)}" if model_args else ""
        raise ModelImportError(f"building {label!r}{with_args} failed: {describe_exception(exc)}",
                               hint=hint) from exc
    if not isinstance(result, nn.Module):
        raise ModelImportError(f"{label!r} returned an object of type {type(result).__name__}, not an nn.Module",
                               hint=OWN_CODE_HINT)
    return result


def check_own_code(obj: Any, label: str, roots: Sequence[str], noun: str = "model") -> None:
    """A model a config names must be the repository's own code (``roots``: its directories).

    The config reader has checked the module's location before the import; this checks what the
    attribute resolves to: a function or method re-exported from elsewhere (``mymod:load`` after
    ``from numpy import load``) is refused before it is called. An ``nn.Module`` class from anywhere
    stays allowed: building a module is what a MODEL spec is for."""
    if not roots or isinstance(obj, nn.Module) or (isinstance(obj, type) and issubclass(obj, nn.Module)):
        return
    origin, what = _origin(obj)
    where = getattr(sys.modules.get(origin), "__file__", None)
    if where is None or not is_inside(where, roots):
        raise UsageError(f"refusing {noun} {label!r} from a config: it names {origin}.{what}, which is not the "
                         "repository's own code", hint="a config may name only the repository's own code (its "
                         f"{'model class or factory' if noun == 'model' else 'data set or loader function'}); "
                         "name any other code on the command line")


#: The hint of a refused or unusable ``--data`` import path.
DATA_HINT = ("--data names a folder of images, a tensor file, or an iterable of batches in your own code "
             "(package.module:loader or path/to/data.py:loader, e.g. a DataLoader), or a function of no "
             "arguments that returns one (a generator function, a make_loader())")


def import_attr(spec: str, target: str, attr: str, *, noun: str = "model") -> Any:
    """What an import path names (``target`` a module or a ``.py`` file, ``attr`` dotted), imported
    the one way MODEL specs and ``--data`` are: Python's own modules refused before the import, the
    working directory (a file's folder) first on sys.path, close matches for a missing attribute."""
    is_file = target.endswith(".py")
    if not attr or not target:
        example = ("path/to/net.py:Net" if is_file else "package.module:Net") if noun == "model" else (
            "path/to/data.py:loader" if is_file else "package.module:loader")
        raise UsageError(f"{noun} spec {spec!r} needs both a module and an attribute",
                         hint=f"e.g. {example}")
    _refuse_stdlib_target(target, spec, is_file, noun)
    module = _import_file(target, noun) if is_file else _import_module(target)
    return _resolve_attr(module, attr, target)


def _load_user(spec: str, target: str, attr: str, model_args: Mapping[str, Any],
               weights: str | None, trust_pickle: bool = False, own_code: Sequence[str] = ()) -> LoadedModel:
    is_file = target.endswith(".py")
    obj = import_attr(spec, target, attr)
    if own_code:  # the general refusal first (it names the standard library or PyTorch), then the config's
        check_target(obj, spec)
        check_own_code(obj, spec, own_code)
    model = _build(obj, spec, model_args)
    loaded: str | None = None
    if weights is not None:
        if not looks_like_weights_file(weights):
            raise UsageError(
                f"--weights {weights!r} is not a file; weight names apply only to torchvision "
                "models", hint="pass a state-dict file (.pt, .pth, .bin, .safetensors, .ckpt)")
        loaded = _load_state_dict_file(model, Path(weights), trust_pickle=trust_pickle)
    family = _torchvision_family_of(model)  # a torchvision detection model of the user's: its inputs fit it
    return LoadedModel(model, spec, "file" if is_file else "import", family if family in _OWN_INPUT_FAMILIES else None,
                       tv_name=None, weights_enum=None, weights=loaded)


# --------------------------------------------------------------------------- weights files


def _is_tensor_dict(obj: Any) -> bool:
    return isinstance(obj, Mapping) and bool(obj) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())


def _state_dict_of(obj: Any) -> dict[str, torch.Tensor] | None:
    """The state dict in ``obj``: a name -> tensor dict, or a whole pickled ``nn.Module``."""
    if isinstance(obj, nn.Module):
        obj = obj.state_dict()
    return dict(obj) if _is_tensor_dict(obj) else None


def _read_state_dict(path: Path, *, trust_pickle: bool = False) -> dict[str, torch.Tensor]:
    """Read a state dict from a file: safetensors, or torch.load with weights_only unless
    ``trust_pickle`` (then a whole pickled ``nn.Module`` gives its ``state_dict()``)."""
    if not path.is_file():
        if path.exists():  # /dev/null, a FIFO, a folder: "not found" would send the user looking for it
            raise WeightsError(f"weights file {str(path)!r} is not a regular file (a folder, device or pipe)",
                               hint="give a state-dict file (.pt, .pth, .safetensors) written by torch.save or "
                               "safetensors")
        raise WeightsError(f"weights file not found: {path}", hint="give an existing state-dict file")
    if path.suffix.lower() == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError as exc:
            raise WeightsError(f"reading {path} needs the safetensors package",
                               hint="pip install safetensors") from exc
        try:
            return dict(load_file(str(path), device="cpu"))
        except Exception as exc:
            raise WeightsError(f"could not read {path}: {describe_exception(exc)}",
                               hint="is it a complete .safetensors file? re-save it with safetensors.torch.save_file") from exc
    if is_torchscript_archive(path):
        if not trust_pickle:
            raise WeightsError(
                f"{path} is a TorchScript archive, not a state dict",
                hint="save its weights with torch.save(torch.jit.load(FILE).state_dict(), 'weights.pt'), or "
                "pass --trust-pickle to let hookcli read them (loading TorchScript runs code from the file)")
        try:
            return dict(torch.jit.load(str(path), map_location="cpu").state_dict())
        except Exception as exc:
            raise WeightsError(f"could not read the TorchScript archive {path}: {describe_exception(exc)}",
                               hint="is the archive complete? re-save it with torch.jit.save") from exc
    try:
        obj = torch.load(path, map_location="cpu", weights_only=not trust_pickle)
    except Exception as exc:
        message, hint = torch_load_failure(exc, str(path), trust_pickle,
                                           resave="torch.save(model.state_dict(), PATH)")
        raise WeightsError(message, hint=hint) from exc
    if (state := _state_dict_of(obj)) is not None:
        return state
    if isinstance(obj, Mapping):
        for key in ("state_dict", "model"):
            if (state := _state_dict_of(obj.get(key))) is not None:
                return state
        raise WeightsError(
            f"{path} is a dict but not a state dict (keys: {', '.join(map(repr, list(obj)[:8]))})",
            hint="expected name -> tensor, or a checkpoint with a 'state_dict' or 'model' entry")
    raise WeightsError(f"{path} holds a {type(obj).__name__}, not a state dict",
                       hint="save weights with torch.save(model.state_dict(), PATH)")


_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_WEIGHTS_ONLY_REASON = re.compile(r"WeightsUnpickler error:\s*(.+)")


def torch_load_failure(exc: BaseException, label: str, trust_pickle: bool, resave: str) -> tuple[str, str]:
    """Message and hint for a failed ``torch.load`` of ``label``: a file weights_only loading
    refuses (naming the object it holds) is told apart from a corrupt or truncated file."""
    text = str(exc)
    found = _GLOBAL.search(text)
    if not trust_pickle and isinstance(exc, pickle.UnpicklingError) and found:
        return (f"{label} holds non-tensor Python objects ({found.group(1)}) that weights_only loading refuses",
                f"re-save it with {resave}, or {TRUST_PICKLE_HINT}")
    reason = _WEIGHTS_ONLY_REASON.search(text)
    detail = one_line(reason.group(1), 120) if reason else describe_exception(exc, 120)
    if "PytorchStreamReader" in text or isinstance(exc, (EOFError, pickle.UnpicklingError)) or reason:
        if "PytorchStreamReader" in text:
            detail = "not a complete zip archive"
        return (f"could not read {label}: not a PyTorch file, or corrupt or truncated ({detail})",
                f"a .pt/.pth file must be written by torch.save; re-save it with {resave}")
    if trust_pickle and isinstance(exc, (AttributeError, ImportError)):
        return f"could not read {label}: {describe_exception(exc)}", UNPICKLE_IMPORT_HINT
    return (f"could not read {label}: {describe_exception(exc)}",
            f"a .pt/.pth file must be written by torch.save; re-save it with {resave}")


def _few(keys: Sequence[str], n: int = 5) -> str:
    return ", ".join(keys[:n]) + (f", ... ({len(keys)} in all)" if len(keys) > n else "")


def _load_state_dict_file(model: nn.Module, path: Path, *, trust_pickle: bool = False) -> str:
    """Load a state-dict file into ``model`` (strict, checked first so nothing half-loads)."""
    sd = _read_state_dict(path, trust_pickle=trust_pickle)
    own = model.state_dict()
    prefix = "module."  # saved from DataParallel / DistributedDataParallel
    if all(k.startswith(prefix) for k in sd) and not all(k.startswith(prefix) for k in own):
        sd = {k[len(prefix):]: v for k, v in sd.items()}
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    wrong = [f"{k} {list(sd[k].shape)} vs {list(own[k].shape)}"
             for k in own if k in sd and sd[k].shape != own[k].shape]
    problems = [f"{what}: {_few(keys)}" for what, keys in (
        ("missing keys", missing), ("unexpected keys", unexpected),
        ("shape mismatch (file vs model)", wrong)) if keys]
    if problems:
        raise WeightsError(f"weights in {path} do not fit {type(model).__name__}: " + "; ".join(problems),
                           hint="are these weights for this model (and the same --model-arg values)?")
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as exc:
        raise WeightsError(f"loading {path} failed: {describe_exception(exc)}",
                           hint="are these weights for this model (and the same --model-arg values)?") from exc
    return f"file: {path}"


# --------------------------------------------------------------------------- entry points


def load_model(spec: str, *, model_args: Mapping[str, Any] | None = None,
               weights: str | None = None, trust_pickle: bool = False, own_code: Sequence[str] = (),
               trust_remote_code: bool = False) -> LoadedModel:
    """Build the model a spec names, with random weights unless ``weights`` says otherwise.

    ``weights`` is a state-dict file (any model) or a torchvision weights name such as ``DEFAULT``
    (torchvision models only; that one downloads, and fails with a WeightsError when offline).
    ``trust_pickle`` lets torch.load unpickle arbitrary objects from a weights file (it runs code
    from the file); a whole pickled ``nn.Module`` then gives its ``state_dict()``.
    """
    text = spec.strip()
    if not text:
        raise UsageError("empty model spec", hint="e.g. resnet18, package.module:Net or net.py:Net")
    source = source_of(text)
    return LOADERS[source.kind](spec, text, dict(model_args or {}), weights, trust_pickle, tuple(own_code),
                                trust_remote_code)


def _load_torchvision_spec(spec: str, text: str, args: dict[str, Any], weights: str | None, trust_pickle: bool,
                           own_code: tuple[str, ...], trust_remote_code: bool) -> LoadedModel:
    """``torchvision:NAME`` or a plain ``NAME`` (a file of that name is refused, not guessed at)."""
    if text == strip_prefix(text, TORCHVISION) and os.path.isfile(text):
        _refuse_model_file(Path(text))
    return _load_torchvision(spec, strip_prefix(text, TORCHVISION), args, weights, trust_pickle)


def _load_user_spec(spec: str, text: str, args: dict[str, Any], weights: str | None, trust_pickle: bool,
                    own_code: tuple[str, ...], trust_remote_code: bool) -> LoadedModel:
    """``pkg.mod:attr`` or ``file.py:attr``: the user's own code."""
    if ":" not in text:
        raise UsageError(f"model spec {spec!r} names a file but no attribute",
                         hint=f"e.g. {text}:Net (the nn.Module class or factory in that file)")
    target, _, attr = text.rpartition(":")  # the last ':' keeps C:\\ drive letters in the path
    return _load_user(spec, target.strip(), attr.strip(), args, weights, trust_pickle, own_code)


def _load_extra_source_spec(spec: str, text: str, args: dict[str, Any], weights: str | None, trust_pickle: bool,
                            own_code: tuple[str, ...], trust_remote_code: bool) -> LoadedModel:
    return _load_extra_source(spec, text, args, weights, trust_pickle, trust_remote_code)


#: How each model source (``hookcli.options.MODEL_SOURCES``, by kind) is built from its spec.
LOADERS: dict[str, Callable[[str, str, dict[str, Any], str | None, bool, tuple[str, ...], bool], LoadedModel]] = {
    "torchvision": _load_torchvision_spec, "timm": _load_extra_source_spec, "hf": _load_extra_source_spec,
    "import": _load_user_spec, "file": _load_user_spec,
}
assert set(LOADERS) == {source.kind for source in MODEL_SOURCES}, "a model source without a loader"


def _load_extra_source(spec: str, text: str, model_args: dict[str, Any], weights: str | None,
                       trust_pickle: bool, trust_remote_code: bool = False) -> LoadedModel:
    """``timm:NAME`` or ``hf:TYPE|DIR|ORG/NAME`` (optional extras), random init unless a weights file."""
    from hookcli.engine import sources

    prefix, _, name = text.partition(":")
    if weights is not None and not looks_like_weights_file(weights):
        raise WeightsError(f"--weights {weights!r} is not a file; hookcli never downloads {prefix} weights",
                           hint="pass a local state-dict file (.safetensors, .pt, .bin), or hf:DIR for a "
                           "save_pretrained directory")
    try:
        if source_of(text) is TIMM:
            model = sources.build_timm(name, model_args)
            kind, config = TIMM.kind, sources.timm_input_config(model, model_args)
        else:
            model, kind, config = sources.build_hf(name, model_args, trust_remote_code=trust_remote_code), HF.kind, None
    except SystemExit as exc:
        raise model_exited(exc, f"building {spec!r}") from exc
    loaded = _load_state_dict_file(model, Path(weights), trust_pickle=trust_pickle) if weights is not None else None
    return LoadedModel(model, spec, kind, None, None, None, loaded, config)


# --------------------------------------------------------------------------- TorchScript


def is_torchscript_archive(path: Path) -> bool:
    """Whether ``path`` is a TorchScript archive (``torch.jit.save``): a zip with compiled code."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (OSError, zipfile.BadZipFile, ValueError):
        return False
    return any(n.endswith("/constants.pkl") or "/code/__torch__" in n for n in names)


def _refuse_model_file(path: Path) -> None:
    """A MODEL spec naming a file that is not Python: a TorchScript archive or a weights file."""
    if is_torchscript_archive(path):
        raise UnsupportedError(
            f"{path} is a TorchScript archive: hookcli cannot hook modules inside TorchScript (its "
            "submodules run in the TorchScript interpreter, where Python hooks never fire)", hint=TORCHSCRIPT_HINT)
    if path.suffix.lower() in WEIGHT_FILE_SUFFIXES:
        raise UsageError(f"{path} is a weights file, not a model",
                         hint="name the model (resnet18, pkg.mod:Net, net.py:build) and pass the file with --weights")


def refuse_torchscript(model: nn.Module, selection: Sequence[tuple[str, nn.Module]]) -> None:
    """Raise UnsupportedError when ``model`` or a selected module is TorchScript (scripted or traced),
    or when ``model`` is a ``torch.export``ed module (no submodule calls; ``train()`` raises).

    Python hooks cannot be registered on a scripted module, and on a traced one they never fire for
    its submodules (the graph runs in the TorchScript interpreter): every module would be reported
    "not called" and a check would see nothing. Refusing says so instead.
    """
    if isinstance(model, torch.fx.GraphModule) and "train" in vars(model):  # ExportedProgram.module()
        raise UnsupportedError(
            "the model is a torch.export program's module (ExportedProgram.module()): its graph is flattened to "
            "operators, so there are no module calls to hook, and its train() and eval() raise",
            hint="use the eager nn.Module it was exported from (pkg.mod:Net or net.py:build)")
    script = torch.jit.ScriptModule
    if isinstance(model, script):
        raise UnsupportedError(
            f"the model is TorchScript ({type(model).__name__}): hookcli cannot hook modules inside TorchScript "
            "(they run in the TorchScript interpreter, where Python hooks never fire)", hint=TORCHSCRIPT_HINT)
    inside = [name for name, module in selection if isinstance(module, script)]
    if inside:
        shown = ", ".join(inside[:5]) + (f", ... ({len(inside)} in all)" if len(inside) > 5 else "")
        raise UnsupportedError(
            f"selected modules are TorchScript ({shown}): hookcli cannot hook modules inside TorchScript",
            hint="select modules outside them with --layers/--types, or use the eager nn.Module they were made from")


#: The torchvision families whose default inputs a model from a file or import path gets (detection: a
#: list of images, and targets in train mode); others keep inputs guessed from their first layer.
_OWN_INPUT_FAMILIES = ("detection",)


def _torchvision_family_of(model: nn.Module) -> str | None:
    """The torchvision family of an instance of a torchvision model class, else None."""
    parts = type(model).__module__.split(".")
    if parts[:2] != ["torchvision", "models"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in FAMILIES else "classification"


def from_instance(model: nn.Module, spec: str | None = None) -> LoadedModel:
    """Wrap an already-built module (Python API).

    Instances of torchvision model classes get their family (so default inputs fit a detection
    model, say); ``tv_name`` and ``weights_enum`` stay None because one class covers many names.
    """
    if not isinstance(model, nn.Module):
        raise UsageError(f"expected an nn.Module, got {type(model).__name__}",
                         hint="pass a model instance, or a spec string such as 'resnet18' or 'net.py:Net'")
    from hookcli.engine.distributed import unwrap

    model = unwrap(model)  # a (Distributed)DataParallel runs as the module it wraps: its layers keep their own names
    return LoadedModel(model, spec if spec is not None else type(model).__name__, "instance",
                       _torchvision_family_of(model), None, None, None)
