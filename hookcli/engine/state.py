"""Hand the user's model and process back exactly as they came.

- ``preserved``: mode, device, dtype, parameter and buffer objects and values, ``requires_grad``,
  ``.grad``; the torch (CPU and accelerator), Python ``random`` and numpy RNG states, seeded from
  ``--seed`` for the run so that Dropout & co. give the same numbers every time.
- ``meta_copy``: the meta device cannot be undone in place (a tensor moved there has no values),
  so a caller's model runs there as a copy whose parameters and buffers are meta tensors: no
  weight is copied, and the caller's model is only read.
- ``exclusive``: one run at a time in the process (the RNG and the model being run are shared
  state), and a clear refusal when a run re-enters a model it is running (a hookcli call from
  inside a hooked forward); the run is ``offline``.
- ``offline``: the model libraries' offline switches, on for the run and put back afterwards.
"""

from __future__ import annotations

import copy
import os
import random
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hookcli.errors import UsageError, safe_str
from hookcli.engine import weight_guard
from hookcli.engine.model_index import ModelIndex

#: Held for every run: the RNG states are process-wide, and so is a model two threads share.
#: Re-entrant, so a run may call hookcli on *another* model from inside its forward.
_RUN_LOCK = threading.RLock()
_local = threading.local()


def _running_here() -> list[nn.Module]:
    """The models this thread is running now (inside ``preserved``), outermost first."""
    models: list[nn.Module] | None = getattr(_local, "models", None)
    if models is None:
        models = _local.models = []
    return models


def _refuse_reentry(model: nn.Module, running: list[nn.Module]) -> None:
    """UsageError when ``model`` shares a module with a model this thread is running now."""
    busy = {id(m) for outer in running for m in outer.modules()}
    for name, module in model.named_modules():
        if id(module) in busy:
            where = f" (its module {name!r})" if name else ""
            raise UsageError(
                f"hookcli is already running this model{where} in this thread: a hookcli call from inside the "
                "model's forward or one of its hooks cannot run the same model again",
                hint="call hookcli after the forward returns, or on a copy of the model (copy.deepcopy(model))",
            )


#: The switches that keep the model libraries off the network (huggingface_hub, and transformers and
#: timm through it): hookcli never downloads a model, and a lookup that only *may* download (a name
#: not in the local cache, the hub client's own metadata fetches) must open no socket either.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


@contextmanager
def offline() -> Iterator[None]:
    """The block runs with ``OFFLINE_ENV`` set, and with huggingface_hub's offline constant on
    (read once when it is imported, so an import before the run, or during it, would keep its own
    value); both are put back afterwards, so a Python caller's process is left as it was."""
    saved_env = {key: os.environ.get(key) for key in OFFLINE_ENV}
    hub = sys.modules.get("huggingface_hub.constants")
    had_hub, saved_hub = hub is not None, getattr(hub, "HF_HUB_OFFLINE", None)
    os.environ.update(OFFLINE_ENV)
    if hub is not None:
        hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        hub = sys.modules.get("huggingface_hub.constants")
        if hub is not None:  # imported during the run: its constant follows the restored environment
            hub.HF_HUB_OFFLINE = saved_hub if had_hub else os.environ.get("HF_HUB_OFFLINE", os.environ.get(
                "TRANSFORMERS_OFFLINE", "")).upper() in {"1", "ON", "YES", "TRUE"}


@contextmanager
def exclusive(model: Any = None) -> Iterator[None]:
    """Hold the process-wide run lock for the block: runs from other threads wait their turn.

    Taken by every API call that reads or runs a model, so that no run sees another's half-changed
    model (train mode, another dtype) and hooks never collect another run's calls. A call from
    inside a run of the same thread (a user's hook calling hookcli) is refused with UsageError when
    it would run a model that run is using, instead of deadlocking or mixing rows. The run is
    ``offline``: no model library opens a socket.
    """
    running = _running_here()
    if running and isinstance(model, nn.Module):
        _refuse_reentry(model, running)
    with _RUN_LOCK, offline():
        yield


def run_lock() -> threading.RLock:
    """The process-wide run lock (re-entrant): held by ``exclusive``, ``preserved`` and ``hooks.attach``."""
    return _RUN_LOCK


# --------------------------------------------------------------------------- RNG


def _accelerators(devices: Iterable[torch.device]) -> tuple[list[int], bool]:
    """The CUDA device indices and whether MPS is among ``devices`` (CPU and meta have no state to fork)."""
    cuda: set[int] = set()
    mps = False
    for device in devices:
        if device.type == "cuda":
            cuda.add(device.index if device.index is not None else torch.cuda.current_device())
        elif device.type == "mps":
            mps = True
    return sorted(cuda), mps


@contextmanager
def seeded_rng(seed: int, devices: Iterable[torch.device] = ()) -> Iterator[None]:
    """Seed torch's CPU generator, the generators of the accelerator ``devices``, Python's ``random``
    and (when imported) numpy's global RNG with ``seed`` for the block; restore every state after.

    Only the CUDA devices named are touched (``torch.manual_seed`` would also seed, or queue a seed
    for, every other GPU: state the caller would find changed). The run's torch RNG starts as after
    ``torch.manual_seed(seed)``, so its Dropout masks can be reproduced with plain torch. Holds the
    run lock: the states are process-wide, and two threads forking them at once would restore each
    other's.
    """
    with _RUN_LOCK:
        with _seeded(seed, devices):
            yield


@contextmanager
def _seeded(seed: int, devices: Iterable[torch.device]) -> Iterator[None]:
    """``seeded_rng`` without the lock."""
    cuda, mps = _accelerators(devices)
    np = sys.modules.get("numpy")
    cpu_state = torch.random.default_generator.get_state()
    cuda_states = [torch.cuda.get_rng_state(i) for i in cuda]
    mps_state = torch.mps.get_rng_state() if mps else None
    py_state = random.getstate()
    np_state = np.random.get_state() if np is not None else None
    try:
        torch.random.default_generator.manual_seed(seed)
        for i in cuda:
            torch.cuda.default_generators[i].manual_seed(seed)
        if mps:
            torch.mps.manual_seed(seed)
        random.seed(seed)
        if np is not None:
            np.random.seed(seed % 2**32)
        yield
    finally:
        torch.random.default_generator.set_state(cpu_state)
        for i, state in zip(cuda, cuda_states):
            torch.cuda.set_rng_state(state, i)
        if mps_state is not None:
            torch.mps.set_rng_state(mps_state)
        random.setstate(py_state)
        if np is not None and np_state is not None:
            np.random.set_state(np_state)


# --------------------------------------------------------------------------- model state


@dataclass
class _Saved:
    """What ``preserved`` puts back after a run: each module's mode, the parameter and buffer slots (in
    ``index``), each parameter's storage, ``requires_grad`` and ``.grad``, and the values of the buffers
    and parameters a run may change in place."""

    index: ModelIndex
    modules: list[nn.Module]
    training: list[bool]
    #: whether the run converts the model (``.to``: its tensors are not all on ``device``/``dtype``)
    convert: bool
    #: (parameter, its data when converted, requires_grad, .grad, the gradient's data when converted)
    param_state: list[tuple[Any, ...]]
    buffer_values: list[tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def take(cls, index: ModelIndex, device: torch.device | str | None, dtype: torch.dtype | None) -> _Saved:
        modules = index.modules
        params = index.params
        # ``.to`` changes the storage of each tensor; skipped when every one is there already (walking
        # the modules to change nothing costs more than a small model's forward pass)
        convert = (device is not None or dtype is not None) and not _placed(
            [*params, *(p.grad for p in params if p.grad is not None), *index.buffers],
            None if device is None else torch.device(device), dtype)
        param_state = [(p, p.data if convert else None, p.requires_grad, p.grad,
                        p.grad.data if convert and p.grad is not None else None) for p in params]
        # a forward may update buffers in place in either mode (BatchNorm's running statistics in
        # train mode, a user's step counter or moving average in any); the native batch_norm does so
        # without bumping the version counter, so every buffer's values are kept and copied back
        with torch.no_grad():  # (a clone outside autograd: no detach per buffer)
            buffer_values = [(b, b.clone()) for b in index.buffers]
        return cls(index, modules, [m.training for m in modules], convert, param_state, buffer_values)

    def restore(self, weights: weight_guard.Guard | None) -> None:
        """Put everything back; with ``weights``, the weights a run changed in place too (the
        parameters are the indexed ones again by then)."""
        for m, name, p in self.index.param_slots:
            m._parameters[name] = p
        for m, name, b in self.index.buffer_slots:
            m._buffers[name] = b
        # after the slots are back: then a module with more entries than indexed holds added ones
        self.index.restore_structure()  # submodules, None entries, what the forward added
        for p, data, requires_grad, grad, grad_data in self.param_state:
            if data is not None:
                p.data = data
            if grad is not None and grad_data is not None:
                grad.data = grad_data
            if p.grad is not grad:
                p.grad = grad
            if p.requires_grad != requires_grad:  # (an inference tensor refuses even a no-op set)
                p.requires_grad_(requires_grad)
        _copy_back(self.buffer_values)
        if weights is not None:
            _copy_back(weights.to_put_back())  # (an inference tensor's parameter: inside inference_mode)
        for m, was_training in zip(self.modules, self.training):
            if m.training != was_training:
                m.training = was_training


@contextmanager
def preserved(
    model: nn.Module,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    train: bool = False,
    seed: int | None = None,
    index: ModelIndex | None = None,
    keep_params: bool = True,
) -> Iterator[nn.Module]:
    """Put ``model`` on ``device``/``dtype`` in train or eval mode for the block, then restore it.

    Restored in ``finally`` (also when the block raises): each module's ``training`` flag, the tree
    as indexed (``ModelIndex.restore_structure``: a submodule, parameter or buffer the forward added is
    removed, one it replaced or removed is put back), the parameter and buffer objects in each module
    (``.to`` may replace them), each parameter's storage
    (device and dtype), ``requires_grad`` and ``.grad`` (object and data), and the values of the
    buffers and parameters the run changed in place (BatchNorm statistics in train mode, a counter or
    moving average a forward updates in any mode; a weight a forward changes under ``no_grad`` or through
    ``.data``: ``weight_guard``, which copies a model's weights on its first run only). ``keep_params=False``
    leaves the weights' values out: a model hookcli built itself, which no caller sees again, or optimiser
    steps, whose update is the run's purpose. With ``seed`` the RNGs are seeded for the block and restored after
    (``seeded_rng``). Reads the model through ``index`` (one traversal, made here when not given);
    the run lock is held and the model is marked as running in this thread (see ``exclusive``).

    The meta device cannot be undone in place: run a caller's model there through ``meta_copy``.
    """
    with _RUN_LOCK:
        index = index if index is not None and index.model is model else ModelIndex.of(model)
        saved = _Saved.take(index, device, dtype)
        guard = weight_guard.guarded(model, index.params) if keep_params and not saved.convert else nullcontext()
        devices = {p.device for p, *_ in saved.param_state}
        if device is not None:
            devices.add(torch.device(device))
        running = _running_here()
        running.append(model)
        try:
            with seeded_rng(seed, devices) if seed is not None else nullcontext(), guard as weights:
                completed = False
                try:
                    if saved.convert:
                        _convert(model, device, dtype)
                    if not _in_mode(saved.modules, saved.training, train):
                        model.train(train)
                    yield model
                    completed = True
                finally:
                    saved.restore(weights)
                    if weights is not None:
                        weights.settle(completed)
        finally:
            running.pop()


def _copy_back(values: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``target.copy_(snapshot)`` for every pair: in one ``torch._foreach_copy_`` (hundreds of small
    BatchNorm buffers cost a copy call each otherwise); an inference tensor (made under
    ``inference_mode``) only inside that mode, where it may be written."""
    inference = [(b, v) for b, v in values if b.is_inference()]
    plain = [(b, v) for b, v in values if not b.is_inference()]
    with torch.no_grad():
        if plain:
            torch._foreach_copy_([b for b, _ in plain], [v for _, v in plain])
        if inference:
            with torch.inference_mode():
                for b, v in inference:
                    b.copy_(v)


#: The complex dtype of each real precision: a run in float64 computes a complex weight in complex128.
_COMPLEX_OF = {torch.float16: torch.complex32, torch.float32: torch.complex64, torch.float64: torch.complex128}


def _run_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``t`` has in a run in ``dtype``: a floating tensor ``dtype``, a complex one the complex
    dtype of that precision (its own where there is none, bfloat16), any other its own. ``Module.to(dtype)``
    would cast a complex one to ``dtype`` itself, dropping its imaginary part."""
    if dtype is None or not (t.is_floating_point() or t.is_complex()):
        return t.dtype
    return dtype if t.is_floating_point() else _COMPLEX_OF.get(dtype, t.dtype)


def _convert(model: nn.Module, device: torch.device | str | None, dtype: torch.dtype | None) -> None:
    """``model.to(device=device, dtype=dtype)``, complex tensors to ``_run_dtype`` (``to``'s own walk)."""
    model._apply(lambda t: t.to(device=device, dtype=_run_dtype(t, dtype)))


def _placed(tensors: list[torch.Tensor], device: torch.device | None, dtype: torch.dtype | None) -> bool:
    """True when ``_convert(model, device, dtype)`` would change none of ``tensors``: each is on
    ``device`` already and has its ``_run_dtype`` (only floating and complex ones are cast)."""
    return all((device is None or t.device == device) and t.dtype == _run_dtype(t, dtype) for t in tensors)


def _in_mode(modules: list[nn.Module], training: list[bool], train: bool) -> bool:
    """True when ``model.train(train)`` would change nothing: every module is in that mode already and
    none overrides ``train`` (an override may do more than set the flags, e.g. freeze BatchNorm)."""
    return all(flag == train for flag in training) and all(
        cls.train is nn.Module.train for cls in {type(m) for m in modules})


def copy_model(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)``, also of a model that holds a tensor computed with autograd as a plain
    attribute: ``spectral_norm`` and the old ``weight_norm`` keep their ``weight`` so after a forward (or
    from the start), and deepcopy refuses a tensor that is not a graph leaf. The copy holds it detached
    (those hooks recompute it at each forward; a stale graph could not be backpropagated again anyway).
    The caller's model is only read. Raises what deepcopy raises for anything else it cannot copy."""
    memo: dict[int, Any] = {}
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, torch.Tensor) and not value.is_leaf and id(value) not in memo:
                memo[id(value)] = value.detach().clone()
    return copy.deepcopy(model, memo)


def needs_meta_copy(model: nn.Module) -> bool:
    """True when some parameter or buffer of ``model`` holds values (is not on the meta device)."""
    return any(t.device.type != "meta" for t in model.parameters()) or any(
        t.device.type != "meta" for t in model.buffers())


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors (same shapes and dtypes).

    ``copy.deepcopy`` with a memo that maps each parameter and buffer to its meta twin, so no weight
    is copied and shared (tied) tensors stay shared; ``requires_grad`` is kept, ``.grad`` is not
    copied. The caller's model is only read. UsageError when the model cannot be copied.
    """
    memo: dict[int, Any] = {}
    try:
        for module in model.modules():
            for p in module._parameters.values():
                if p is not None and id(p) not in memo:
                    memo[id(p)] = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
            for b in module._buffers.values():
                if b is not None and id(b) not in memo:
                    memo[id(b)] = b.detach().to("meta")
        return copy.deepcopy(model, memo)
    except Exception as exc:  # noqa: BLE001 - any failure to copy means: cannot run it on meta safely
        raise UsageError(
            f"cannot run this model on the meta device without changing it: copying its structure failed "
            f"({type(exc).__name__}: {safe_str(exc)})",
            hint="use device='cpu', or give the model by spec (e.g. 'pkg.mod:build') so hookcli builds it on meta",
        ) from None


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (CPU for a model with neither)."""
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")
