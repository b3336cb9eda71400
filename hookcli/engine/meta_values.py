"""A run on the meta device that knows the values it can know (``meta_values``).

The meta device computes shapes without values, so an op that needs a value (``.item()``, ``.tolist()``,
``nonzero``, a boolean mask, ``if tensor:``) cannot run there, and a meta kernel can be stricter than the
real ones (``grouped_mm``'s refuses float32, which CPU and CUDA take). Both stopped ``shapes`` on models
whose forward computes with its inputs' values before it reaches the weights: a vision-language model
counts the image tokens in ``input_ids``, a mixture-of-experts model groups tokens per expert.

During a meta run, ``MetaValues`` (a TorchDispatchMode) keeps, next to each small meta tensor whose value
follows from values it knows, that value on the CPU (a "shadow"): an input moved to meta keeps its
values, and an op whose meta arguments all have shadows is run on them as well (random ops excepted: the
RNG is never touched). ``.item()`` of such a tensor answers its value, an op whose output shape depends on
values (``nonzero``, a boolean index) gets it from the shadows, and everything that depends on the weights
(which meta has not got) stays without values: the op raises as it would on meta. Nothing changes for a
run on a real device (the mode is entered for meta runs only).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

#: Values are kept for tensors of at most this many elements (a mask, token ids, positions, a small
#: input); larger ones (activations) would cost real memory and time, and stay shapes only.
MAX_SHADOW_NUMEL = 1 << 22

aten = torch.ops.aten
_CPU = torch.device("cpu")


def _is_meta(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "meta"


def _grouped_mm(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``_grouped_mm`` on meta (its meta kernel takes bfloat16 with 16-byte aligned strides only; the CPU
    kernel takes float32 and any layout): the output the real kernel gives, from the operands' shapes
    (``a [S, K] @ b [G, K, N] -> [S, N]``, ``a [G, M, K] @ b [G, K, N] -> [G, M, N]``,
    ``a [M, K] @ b [K, N] -> [G, M, N]`` with G groups in ``offs``, ``a [G, M, K] @ b [K, N]`` as the first)."""
    a, b = args[0], args[1]
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    out_dtype = kwargs.get("out_dtype") or a.dtype
    if a.dim() == 2 and b.dim() == 3:
        shape = (a.shape[0], b.shape[-1])
    elif a.dim() == 3 and b.dim() == 3:
        shape = (a.shape[0], a.shape[1], b.shape[-1])
    elif a.dim() == 2 and b.dim() == 2 and offs is not None:
        shape = (offs.shape[0], a.shape[0], b.shape[-1])
    elif a.dim() == 3 and b.dim() == 2:
        shape = (a.shape[1], b.shape[-1])
    else:
        raise ValueError("an operand layout grouped_mm does not take")
    return torch.empty(shape, dtype=out_dtype, device="meta")


#: Ops whose meta kernel refuses what the real kernels take, with how to get their meta output.
META_FIXES: dict[Any, Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]] = {}
if hasattr(aten, "_grouped_mm"):
    META_FIXES[aten._grouped_mm.default] = _grouped_mm


class MetaValues(TorchDispatchMode):
    """The mode of a meta run (module docstring): shadows of the values that follow from known ones."""

    def __init__(self) -> None:
        super().__init__()
        self.values: WeakTensorKeyDictionary = WeakTensorKeyDictionary()

    def shadow(self, x: Any) -> Any:
        """The CPU value standing for ``x`` (a meta tensor with a shadow, a real tensor itself); None when unknown."""
        if not isinstance(x, torch.Tensor):
            return x
        if x.device.type != "meta":
            return x
        return self.values.get(x)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        flat, _ = tree_flatten((args, kwargs))
        metas = [x for x in flat if _is_meta(x)]
        if not metas and not _wants_meta(kwargs):
            return func(*args, **kwargs)  # nothing on meta: the op as it is
        known = all(self.values.get(x) is not None for x in metas)
        if func is aten._local_scalar_dense.default and known:
            return self.values[args[0]].item()
        if known and (torch.Tag.dynamic_output_shape in func.tags or _leaves_meta(func, kwargs)):
            with contextlib.suppress(Exception):  # (else the op raises on meta as it would without values)
                return self._from_values(func, args, kwargs)
        out = None
        if (fix := META_FIXES.get(func)) is not None:
            with contextlib.suppress(Exception):  # (else the meta kernel says why not)
                out = fix(func, args, kwargs)
        if out is None:
            out = func(*args, **kwargs)
        if known and _cheap(func, out):
            self._keep(func, args, kwargs, out)
        else:
            self._forget_written(func, args)
        return out

    def _run_on_values(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        def real(x: Any) -> Any:
            if isinstance(x, torch.device) and x.type == "meta":
                return _CPU
            return self.shadow(x)

        return func(*tree_map(real, args), **tree_map(real, kwargs))

    def _from_values(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """An op whose output shape depends on values (``nonzero``): run on the shadows, its output
        back on meta with the shadow kept. A copy off the meta device (``.tolist()``, ``.cpu()``):
        the values themselves."""
        real = self._run_on_values(func, args, kwargs)
        if _leaves_meta(func, kwargs):
            return real

        def to_meta(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            m = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            if t.numel() <= MAX_SHADOW_NUMEL:
                self.values[m] = t
            return m

        return tree_map(to_meta, real)

    def _keep(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        try:
            real = self._run_on_values(func, args, kwargs)
        except Exception:  # the real kernel refuses what meta took: no values, as before
            self._forget_written(func, args)
            return
        outs, _ = tree_flatten(out)
        reals, _ = tree_flatten(real)
        if len(outs) != len(reals):
            return
        for m, r in zip(outs, reals):
            if _is_meta(m) and isinstance(r, torch.Tensor) and r.shape == m.shape:
                self.values[m] = r

    def _forget_written(self, func: Any, args: tuple[Any, ...]) -> None:
        """An in-place op with unknown values: what it wrote (and every view of it) is unknown now."""
        for arg, spec in zip(args, func._schema.arguments):
            if spec.alias_info is not None and spec.alias_info.is_write and _is_meta(arg) and arg in self.values:
                storage = arg.untyped_storage()._cdata
                for t in [t for t in self.values.keys() if t.untyped_storage()._cdata == storage]:
                    del self.values[t]


_UNINITIALISED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


def _leaves_meta(func: Any, kwargs: dict[str, Any]) -> bool:
    """A copy from the meta device to a real one (``.to("cpu")``, which ``.tolist()`` makes)."""
    device = kwargs.get("device")
    return func is aten._to_copy.default and device is not None and torch.device(device).type != "meta"


def _wants_meta(kwargs: dict[str, Any]) -> bool:
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "meta"


def _cheap(func: Any, out: Any) -> bool:
    """Whether ``func``'s values are worth keeping: not random (the RNG is never touched) or
    uninitialised (``empty``), and small."""
    if torch.Tag.nondeterministic_seeded in func.tags or func.__name__.split(".")[0] in _UNINITIALISED:
        return False
    outs, _ = tree_flatten(out)
    tensors = [t for t in outs if isinstance(t, torch.Tensor)]
    return bool(tensors) and all(_is_meta(t) and t.numel() <= MAX_SHADOW_NUMEL for t in tensors)


@contextlib.contextmanager
def meta_values(device: torch.device | str | None) -> Iterator[None]:
    """``MetaValues`` for the block when ``device`` is the meta device; nothing otherwise."""
    if device is None or torch.device(device).type != "meta":
        yield
        return
    with MetaValues():
        yield
