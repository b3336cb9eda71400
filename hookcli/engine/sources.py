"""Model sources from optional extras: ``timm:NAME`` and ``hf:TYPE|PATH|ORG/NAME`` (transformers).

Both build with random initialisation and never touch the network: timm with ``pretrained=False``,
transformers from a config (``AutoConfig.for_model`` + ``from_config``), or from a local directory or
the local Hugging Face cache with ``local_files_only=True``. A missing extra is a UsageError (exit 2)
that gives the install line.
"""

from __future__ import annotations

import fnmatch
import importlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hookcli.errors import (
    ModelNotFoundError, UnsupportedError, UsageError, WeightsError, describe_exception, did_you_mean,
)
from hookcli import limits
from hookcli.options import HF, TIMM
from hookcli.engine.quiet import quiet_imported

EXTRAS = {"timm": ("timm", "timm"), "transformers": ("hf", "transformers")}


def require_extra(module: str) -> Any:
    """Import the package of an optional source, or raise a UsageError with the install line."""
    extra, package = EXTRAS[module]
    try:
        imported = importlib.import_module(module)
        quiet_imported()  # inside a run: its logging and progress bars off from the start
        return imported
    except ImportError as exc:
        raise UsageError(f"this model source needs the {package} package, which is not installed "
                         f"({describe_exception(exc, 80)})",
                         hint=f"pip install 'hookcli[{extra}]' (or pip install {package})") from exc


def _args_text(model_args: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in model_args.items())


# --------------------------------------------------------------------------- timm


def list_timm_models(pattern: str | None = None) -> list[str]:
    """timm's architecture names, filtered by a case-insensitive glob."""
    timm = require_extra("timm")
    names = sorted(timm.list_models())
    if pattern:
        names = [n for n in names if fnmatch.fnmatchcase(n.lower(), pattern.lower())]
    return names


def timm_input_config(model: nn.Module, model_args: Mapping[str, Any]) -> dict[str, Any]:
    """Input size ``(C, H, W)``, mean, std and crop fraction for a timm model: its ``pretrained_cfg``,
    corrected by what it was built with (``img_size``, ``in_chans``) since the cfg describes the
    pretrained variant."""
    cfg = dict(getattr(model, "pretrained_cfg", None) or {})
    channels, height, width = tuple(cfg.get("input_size") or (3, 224, 224))
    size = model_args.get("img_size")
    if size is None:
        size = getattr(getattr(model, "patch_embed", None), "img_size", None)
    if isinstance(size, int):
        height = width = size
    elif isinstance(size, (tuple, list)) and len(size) == 2:
        height, width = int(size[0]), int(size[1])
    channels = int(model_args.get("in_chans", channels))
    mean, std = list(cfg.get("mean") or (0.485, 0.456, 0.406)), list(cfg.get("std") or (0.229, 0.224, 0.225))
    if len(mean) != channels:
        mean, std = [sum(mean) / len(mean)] * channels, [sum(std) / len(std)] * channels
    return {"input_size": (channels, int(height), int(width)), "mean": mean, "std": std,
            "crop_pct": float(cfg.get("crop_pct") or 0.875)}


#: ``timm.create_model`` keywords that load weights rather than shape the model.
TIMM_LOADER_ARGS = frozenset({"pretrained", "checkpoint_path", "pretrained_cfg_overlay", "cache_dir"})


def build_timm(name: str, model_args: Mapping[str, Any]) -> nn.Module:
    """``timm.create_model(name, pretrained=False, **model_args)``; unknown names get close matches."""
    timm = require_extra("timm")
    name = name.strip()
    if not name:
        raise UsageError("timm: needs a model name", hint="e.g. timm:resnet18; 'hookcli models --source timm' lists them")
    if not timm.is_model(name):
        hint = did_you_mean(name, timm.list_models()) or "run 'hookcli models --source timm' to list them"
        raise ModelNotFoundError(f"unknown timm model {name!r}", hint=hint)
    loader = sorted(set(model_args) & TIMM_LOADER_ARGS)
    if loader:  # each would download or read a file past --weights and its checks
        raise UsageError(f"timm models are built with pretrained=False and no checkpoint (hookcli never downloads); "
                         f"--model-arg {loader[0]} is not a model argument",
                         hint=f"drop --model-arg {loader[0]}; give a weights file with --weights FILE")
    try:
        _refuse_too_large(lambda: timm.create_model(name, pretrained=False, **model_args), f"{TIMM.prefix}{name}")
        return timm.create_model(name, pretrained=False, **model_args)
    except (TypeError, ValueError, AssertionError, RuntimeError) as exc:
        with_args = f" with {_args_text(model_args)}" if model_args else ""
        if not model_args:
            raise
        raise UsageError(f"could not build timm model {name!r}{with_args}: {describe_exception(exc)}",
                         hint=f"check the --model-arg values against timm.create_model({name!r}, ...)") from exc


# --------------------------------------------------------------------------- transformers

#: Auto classes tried, in order, for a bare model type: a head whose output means something
#: (language-model or class logits) before the bare backbone.
_AUTO_ORDER = ("AutoModelForSeq2SeqLM", "AutoModelForSpeechSeq2Seq", "AutoModelForMaskedLM", "AutoModelForCausalLM",
               "AutoModelForImageClassification", "AutoModel")
NOT_CACHED_HINT = ("download it where the network is reachable (huggingface-cli download NAME) or save it with "
                   "model.save_pretrained(DIR) and pass hf:DIR; hf:MODEL_TYPE builds a random model offline")


def _auto_class(transformers: Any, config: Any) -> Any:
    """The first Auto class of ``_AUTO_ORDER`` that knows ``config``'s type."""
    for auto_name in _AUTO_ORDER:
        auto = getattr(transformers, auto_name, None)
        mapping = getattr(auto, "_model_mapping", None)
        try:
            if mapping is not None and type(config) in mapping:
                return auto
        except Exception:  # a mapping entry whose module cannot import
            continue
    return transformers.AutoModel


def _class_from_config(transformers: Any, config: Any) -> Any:
    """The class ``config.architectures`` names when transformers has it, else an Auto class."""
    for arch in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, str(arch), None)
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            return cls
    return _auto_class(transformers, config)


def model_types() -> list[str]:
    """The model types transformers can build from a config (``hf:TYPE``)."""
    transformers = require_extra("transformers")
    return sorted(transformers.CONFIG_MAPPING.keys())


#: The hint wherever a model's own code would be needed: the user's explicit, command-line-only opt-in.
TRUST_REMOTE_CODE_HINT = ("pass --trust-remote-code on the command line if you trust the code in that folder (a config "
                          "cannot set it, and hookcli never asks on stdin)")


def build_hf(name: str, model_args: Mapping[str, Any], *, trust_remote_code: bool = False) -> nn.Module:
    """A transformers model: random init from a model type's config, or a local directory / the
    local cache (``local_files_only``). ``model_args`` set config fields, nothing else: loader
    settings (``trust_remote_code``, ``cache_dir``, ``revision``...) are no config field. A model
    with its own code (``auto_map``) is built only with ``trust_remote_code``, which is always passed
    explicitly so transformers never prompts."""
    transformers = require_extra("transformers")
    if "trust_remote_code" in model_args:
        raise UsageError("--model-arg trust_remote_code cannot run a model's own code", hint=TRUST_REMOTE_CODE_HINT)
    text = name.strip()
    if not text:
        raise UsageError("hf: needs a model type, a directory or ORG/NAME", hint="e.g. hf:gpt2, hf:./my_model")
    path = Path(text).expanduser()
    types = transformers.CONFIG_MAPPING.keys()
    if path.is_dir():
        return _from_pretrained(transformers, str(path), model_args, local=True, trust_remote_code=trust_remote_code)
    if text in types and os.sep not in text and "/" not in text:
        try:
            config = transformers.AutoConfig.for_model(text, **model_args)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"could not make a {text} config with {_args_text(model_args)}: "
                             f"{describe_exception(exc)}", hint="--model-arg sets config fields, e.g. num_hidden_layers=2") from exc
        _check_config_args(config, model_args, text)
        cls = _auto_class(transformers, config)
        try:
            _refuse_too_large(lambda: cls.from_config(config), f"{HF.prefix}{text}")
            return cls.from_config(config)
        except (TypeError, ValueError, AttributeError, AssertionError, RuntimeError) as exc:
            with_args = f" with {_args_text(model_args)}" if model_args else ""
            raise UsageError(f"could not build hf:{text}{with_args}: {describe_exception(exc)}",
                             hint="check the --model-arg config fields") from exc
    if text.startswith((".", "~", os.sep)) or text.endswith(os.sep):
        raise ModelNotFoundError(f"no model directory {text!r}",
                                 hint="give a directory written by save_pretrained (config.json and weights)")
    if "/" not in text:
        hint = did_you_mean(text, types)
        raise ModelNotFoundError(f"{text!r} is not a transformers model type or a local directory",
                                 hint=f"{hint}; or ORG/NAME from the local cache" if hint else
                                 "e.g. hf:gpt2, hf:bert (model types), hf:DIR or hf:ORG/NAME (local cache)")
    return _from_pretrained(transformers, text, model_args, local=False, trust_remote_code=trust_remote_code)


def _refuse_too_large(build: Any, what: str) -> None:
    """UnsupportedError (exit 2) when the model ``build()`` makes (built here on the meta device, which
    costs no memory) has weights over half this machine's memory: hf:llama's default config is 7B
    parameters (25 GiB), and building it for real was killed by the system (exit 137) after minutes
    of swapping. Nothing is refused when the default device is already meta (``shapes``), or when the
    model cannot be built there."""
    if torch.get_default_device().type == "meta":
        return
    memory = limits.memory_bytes()
    if memory is None:
        return
    try:
        with torch.device("meta"):
            model = build()
    except Exception:  # an init that reads values cannot run on meta: the real build says what it says
        return
    size = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    if size > memory // 2:
        raise UnsupportedError(
            f"{what} has {size / 2**30:.3g} GiB of weights, more than half this machine's memory "
            f"({memory / 2**30:.3g} GiB): building it would exhaust the memory",
            hint="hookcli shapes runs it on the meta device; for the other commands give a smaller config "
                 f"(e.g. {smaller_config(model.config)})" if hasattr(model, "config") else
                 "hookcli shapes runs it on the meta device; for the other commands give a smaller config")


#: Config fields that say how many layers a transformers model stacks (the first one a config has).
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers")


def smaller_config(config: Any) -> str:
    """The ``--model-arg`` that makes a transformers ``config`` smaller by its layer count, where the
    config keeps it: itself (``num_hidden_layers=2``), else a sub-config (a vision-language model's
    ``text_config={'num_hidden_layers': 2}``, which sets that field over the sub-config's defaults)."""
    for field in LAYER_FIELDS:
        if isinstance(getattr(config, field, None), int):
            return f"--model-arg {field}=2"
    for key, sub in sorted(vars(config).items(), key=lambda item: item[0] != "text_config"):  # the text model first
        if hasattr(sub, "model_type") and hasattr(sub, "to_dict"):  # a nested PretrainedConfig
            for field in LAYER_FIELDS:
                if isinstance(getattr(sub, field, None), int):
                    return f"--model-arg \"{key}={{'{field}': 2}}\""
    return "--model-arg num_hidden_layers=2"


def _check_config_args(config: Any, model_args: Mapping[str, Any], what: str) -> None:
    """Refuse config fields the config does not have (a typo would otherwise be silently kept)."""
    defaults = type(config)()
    unknown = [k for k in model_args if not hasattr(defaults, k)]
    if unknown:
        known = [k for k in defaults.to_dict() if not k.startswith("_")]
        raise UsageError(f"{what} config has no field {unknown[0]!r}",
                         hint=did_you_mean(unknown[0], known) or f"fields: {', '.join(sorted(known)[:20])}, ...")


def _from_pretrained(transformers: Any, name: str, model_args: Mapping[str, Any], *, local: bool,
                     trust_remote_code: bool = False) -> nn.Module:
    """Config and weights from a directory or the local cache, never the network; ``model_args``
    then set fields of the config (each one it has). On the meta device (``torch.device("meta")`` as
    the default device) the config only."""
    where = f"directory {name}" if local else f"{name}"
    try:
        config = transformers.AutoConfig.from_pretrained(name, local_files_only=True,
                                                         trust_remote_code=trust_remote_code)
    except OSError as exc:
        if local:
            raise ModelNotFoundError(f"{where} is not a transformers model directory: {describe_exception(exc, 120)}",
                                     hint="give a directory written by save_pretrained (config.json and weights)") from exc
        raise ModelNotFoundError(f"{HF.prefix}{name} is not in the local Hugging Face cache; network access is "
                                 "not attempted",
                                 hint=NOT_CACHED_HINT) from exc
    except (ValueError, KeyError) as exc:
        if "trust_remote_code" in str(exc):
            raise UsageError(f"{HF.prefix}{name} comes with its own Python code (auto_map in its config.json), which "
                             "hookcli runs only when told to", hint=TRUST_REMOTE_CODE_HINT) from exc
        raise UsageError(f"could not read the config of {where}: {describe_exception(exc, 160)}",
                         hint="is config.json from a transformers model (with a model_type)?") from exc
    _check_config_args(config, model_args, f"{HF.prefix}{name}")
    for key, value in model_args.items():
        setattr(config, key, value)
    cls = _class_from_config(transformers, config)
    auto = {"trust_remote_code": trust_remote_code} if cls.__name__.startswith("Auto") else {}
    if torch.get_default_device().type == "meta":
        # a build on the meta device (shapes) needs no weights, and from_pretrained refuses it: the model
        # from its config, so a 7B checkpoint is never read into memory to print its shapes
        build = getattr(cls, "from_config", None) or cls._from_config  # (Auto classes | model classes)
        return build(config, **auto)
    build = getattr(cls, "from_config", None) or cls._from_config
    _refuse_too_large(lambda: build(config, **auto), f"{HF.prefix}{name}")
    try:
        return cls.from_pretrained(name, config=config, local_files_only=True, **auto)
    except OSError as exc:
        raise WeightsError(f"could not load the weights of {where}: {describe_exception(exc, 160)}",
                           hint="the directory needs model.safetensors or pytorch_model.bin from save_pretrained"
                           if local else NOT_CACHED_HINT) from exc
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise UsageError(f"{HF.prefix}{name} comes with its own Python code (auto_map in its config.json), which "
                             "hookcli runs only when told to", hint=TRUST_REMOTE_CODE_HINT) from exc
        raise
