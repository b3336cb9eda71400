"""Which named modules get hooks: direct children by default, or --depth / --all / --layers / --types."""

from __future__ import annotations

import re
from collections.abc import Sequence

from torch import nn

from hookcli.engine.distributed import type_name as class_name  # FSDP2's FSDPLinear is a Linear
from hookcli.errors import LayerNotFoundError, UsageError, close_matches
from hookcli.options import layer_matches, split_patterns  # torch-free, for hookcli report too


def module_depth(name: str) -> int:
    """Depth of a dotted module name: the root is 0, its children 1, and so on."""
    return 0 if not name else name.count(".") + 1


def _match_layer(pattern: str, names: list[str]) -> list[str]:
    return [n for n in dict.fromkeys(names) if layer_matches(pattern, n)]


def select_modules(
    model: nn.Module,
    *,
    layers: Sequence[str] | str | None = None,
    types: Sequence[str] | str | None = None,
    depth: int | None = None,
    all_modules: bool = False,
    named: Sequence[tuple[str, nn.Module]] | None = None,
) -> list[tuple[str, nn.Module]]:
    """Return the ``(name, module)`` pairs to hook, in ``named_modules()`` order.

    - default: the model's direct children (the seeds' VerboseExecution); the model itself when it
      has none;
    - ``depth=N``: every module with 1 <= depth <= N (``depth=0``: the model itself);
    - ``all_modules``: every module but the root;
    - ``layers``: exact names or globs (``layer4``, ``layer1.*``, ``*.relu``); ``(model)`` is the root;
    - ``types``: class names (``Conv2d,ReLU``); alone they pick every module of those types, with
      ``layers`` they keep the modules of those types inside the chosen layers' subtrees.

    ``named``: ``model.named_modules()`` when the caller has listed them already (``ModelIndex``).
    Raises LayerNotFoundError (with close matches) for a pattern or type that matches nothing.
    """
    named = list(model.named_modules()) if named is None else list(named)
    names = [n for n, _ in named]
    by_name = dict(named)
    layer_patterns = split_patterns(layers)
    type_names = split_patterns(types)
    if depth is not None and depth < 0:
        raise UsageError(f"--depth must be 0 or more, got {depth}", hint="--depth 0 is the model itself")

    if layer_patterns:
        chosen: list[str] = []
        for pattern in layer_patterns:
            hits = _match_layer(pattern, names)
            if not hits:
                raise LayerNotFoundError(
                    f"no module named {pattern!r} in {type(model).__name__}",
                    hint=_layer_hint(pattern, names),
                )
            chosen.extend(hits)
        chosen_set = set(chosen)
        if type_names:
            _check_types(type_names, named)
            roots = chosen_set
            selected = [
                n for n in names
                if class_name(by_name[n]) in type_names and any(_within(n, r) for r in roots)
            ]
            if not selected:
                raise LayerNotFoundError(
                    f"no module of type {', '.join(type_names)} inside {', '.join(layer_patterns)}",
                    hint="run 'hookcli modules MODEL' to see the types inside each layer",
                )
        else:
            selected = [n for n in names if n in chosen_set]
    elif type_names:
        _check_types(type_names, named)
        selected = [n for n, m in named if n and class_name(m) in type_names]
        if not selected:  # only the root has that type
            selected = [""]
    elif all_modules:
        selected = [n for n in names if n] or [""]
    elif depth is not None:
        selected = [n for n in names if module_depth(n) <= depth and (n or depth == 0)]
        if depth > 0 and not selected:
            selected = [""]
    else:
        selected = [n for n, _ in model.named_children()] or [""]
    wanted = set(selected)  # from ``named``, not ``by_name``: two modules may share a name (``_modules["a.b"]``)
    return [(n, m) for n, m in named if n in wanted]


def _within(name: str, root: str) -> bool:
    return root == "" or name == root or name.startswith(root + ".")


def _check_types(type_names: list[str], named: list[tuple[str, nn.Module]]) -> None:
    present = sorted({class_name(m) for _, m in named})
    for type_name in type_names:
        if type_name not in present:
            matches = close_matches(type_name, present)
            hint = ("did you mean: " + ", ".join(matches) + "?") if matches else (
                "types in this model: " + ", ".join(present[:12]) + (", ..." if len(present) > 12 else "")
            )
            raise LayerNotFoundError(f"no module of type {type_name!r} in the model", hint=hint)


def _layer_hint(pattern: str, names: list[str]) -> str:
    matches = close_matches(pattern, [n for n in names if n])
    if matches:
        return "did you mean: " + ", ".join(matches) + "?  (`hookcli modules MODEL` lists every name)"
    return "run `hookcli modules MODEL` to list the module names"


def owners_and_activations(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module that owns parameters directly, plus every activation function module, in
    ``named_modules()`` order: ``hookcli.watch``'s default, like fastai's ActivationStats. Activation
    functions are the classes of an ``activation``/``activations`` module (torch.nn's, transformers',
    timm's: ``_ACTIVATION_MODULE``). The model itself when none is either."""
    selected = [(n, m) for n, m in model.named_modules()
                if next(m.parameters(recurse=False), None) is not None
                or _ACTIVATION_MODULE.match(type(m).__module__.rsplit(".", 1)[-1])]
    return selected or [("", model)]


#: The last part of the name of a module that defines activation functions: torch.nn.modules.activation,
#: transformers.activations, timm.layers.activations (and its activations_me, activations_jit).
_ACTIVATION_MODULE = re.compile(r"activations?(_\w+)?$")
