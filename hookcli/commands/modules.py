"""``modules`` and ``models``: the module tree of one model, and the model names hookcli can build."""

from __future__ import annotations

from hookcli._version import __version__
from hookcli.engine.loading import list_torchvision_models
from hookcli.engine.run import load, model_info
from hookcli.engine.selection import module_depth
from hookcli.options import RunOptions
from hookcli.records import ModelList, ModuleRow, ModuleTree


def module_tree(options: RunOptions, depth: int | None = None) -> ModuleTree:
    """Every named module of the model (down to ``depth``: 0 is the model itself, 1 its children, ...):
    type, depth, parameters (in its subtree and its own), children."""
    opts = options.validate()
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
    return ModuleTree(model=model_info(loaded, opts.model_source), modules=rows, version=__version__)


def model_list(pattern: str | None = None) -> ModelList:
    """torchvision's model names (with their family), filtered by a glob like ``resnet*``."""
    listed = list_torchvision_models(pattern)
    return ModelList(pattern=pattern, models=[{"name": n, "family": f} for n, f in listed], version=__version__)
