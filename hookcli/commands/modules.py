"""``modules`` and ``models``: the module tree of one model, and the model names hookcli can build."""

from __future__ import annotations

import fnmatch

from hookcli._version import __version__
from hookcli.errors import UsageError, did_you_mean
from hookcli.engine.loading import list_torchvision_models
from hookcli.engine.run import load, model_info
from hookcli.engine.selection import module_depth
from hookcli.engine.state import exclusive
from hookcli.options import HF, LISTED_SOURCES, TIMM, RunOptions
from hookcli.records import ModelList, ModuleRow, ModuleTree


def module_tree(options: RunOptions, depth: int | None = None) -> ModuleTree:
    """Every named module of the model (down to ``depth``: 0 is the model itself, 1 its children, ...):
    type, depth, parameters (in its subtree and its own), children."""
    with exclusive(options.model):
        return _module_tree(options.validate(), depth)


def _module_tree(opts: RunOptions, depth: int | None) -> ModuleTree:
    loaded = load(opts)
    rows = [
        ModuleRow(
            name=name,
            type=type(module).__name__,
            depth=module_depth(name),
            params=sum(p.numel() for p in module.parameters()),
            own_params=sum(p.numel() for p in module.parameters(recurse=False)),
            children=len(module._modules),
        )
        for name, module in loaded.model.named_modules()
        if depth is None or module_depth(name) <= depth
    ]
    return ModuleTree(model=model_info(loaded, opts.model_source, opts.model_args), modules=rows, version=__version__)


def model_list(pattern: str | None = None, source: str = "torchvision") -> ModelList:
    """Model names a source can build, filtered by a case-insensitive glob like ``resnet*``:
    torchvision's (with their family), timm's (``timm:NAME``) or transformers' model types
    (``hf:TYPE``); timm and hf need their extras installed."""
    if source not in LISTED_SOURCES:
        raise UsageError(f"unknown model source {source!r}", hint=did_you_mean(str(source), LISTED_SOURCES)
                         or f"choose one of: {', '.join(LISTED_SOURCES)}")
    if source == TIMM.kind:
        from hookcli.engine.sources import list_timm_models

        rows = [{"name": f"{TIMM.prefix}{n}", "family": "timm"} for n in list_timm_models(pattern)]
    elif source == HF.kind:
        from hookcli.engine.sources import model_types

        rows = [{"name": f"{HF.prefix}{n}", "family": "transformers"} for n in model_types()
                if not pattern or fnmatch.fnmatchcase(n.lower(), pattern.lower())]
    else:  # torchvision's plain names (``torchvision:`` is optional; listed without it)
        rows = [{"name": n, "family": f} for n, f in list_torchvision_models(pattern)]
    return ModelList(pattern=pattern, models=rows, version=__version__, source=source)
