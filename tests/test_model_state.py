"""The caller's model and process state come back as they were (issue 11, section 2).

Every API function, with every device, dtype and mode, on a model with BatchNorm, Dropout, user
hooks, a frozen parameter, an existing ``.grad`` and a tied parameter: the full state is snapshot
before and compared after. The RNGs (torch, Python, numpy) are left as found and ``seed`` gives the
run's numbers; concurrent runs from threads are serialised (rows never mix) and a hookcli call
from inside a hooked forward of the same model is refused. Numbers are checked against plain torch.
"""

from __future__ import annotations

import copy
import random
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import hookcli
from hookcli.errors import HookcliError, UnsupportedError, UsageError

HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
              "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs")
GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                "_global_backward_pre_hooks", "_global_forward_hooks_always_called")


class StateNet(nn.Module):
    """BatchNorm, Dropout, a frozen parameter, a tied weight (``mid`` and ``out`` share one)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)
        self.out.weight = self.mid.weight
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(torch.relu(self.bn(self.inp(x))))
        return self.head(self.out(torch.tanh(self.mid(x))))


def user_model() -> tuple[StateNet, dict[str, int]]:
    """A StateNet in the state a user leaves it in: trained statistics, grads, own hooks, mixed modes."""
    torch.manual_seed(0)
    model = StateNet()
    with torch.no_grad():
        model.bn.running_mean.copy_(torch.randn(8))
        model.bn.running_var.copy_(torch.rand(8) + 0.5)
        model.bn.num_batches_tracked.fill_(7)
    model.inp.bias.requires_grad_(False)  # frozen
    model.mid.weight.grad = torch.randn(8, 8)  # an existing .grad (of the tied weight)
    model.head.bias.grad = torch.randn(3)
    fired = {"forward": 0, "pre": 0, "backward": 0, "tensor": 0}

    def forward_hook(module: nn.Module, args: Any, output: Any) -> None:
        fired["forward"] += 1

    def pre_hook(module: nn.Module, args: Any) -> None:
        fired["pre"] += 1

    def backward_hook(module: nn.Module, grad_in: Any, grad_out: Any) -> None:
        fired["backward"] += 1

    def tensor_hook(grad: torch.Tensor) -> None:
        fired["tensor"] += 1

    model.bn.register_forward_hook(forward_hook)
    model.inp.register_forward_pre_hook(pre_hook)
    model.head.register_full_backward_hook(backward_hook)
    model.head.weight.register_hook(tensor_hook)
    model.eval()
    model.mid.train()  # one submodule in train mode inside an eval model
    return model, fired


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Everything of the model a run could change: objects, values, devices, dtypes, flags, hooks."""
    state: dict[str, Any] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        params = {
            n: (p, p.device, p.dtype, p.requires_grad, p.detach().clone(), p.grad,
                None if p.grad is None else p.grad.detach().clone(), dict(p._backward_hooks or {}))
            for n, p in m._parameters.items() if p is not None
        }
        buffers = {n: (b, b.device, b.dtype, b.detach().clone()) for n, b in m._buffers.items() if b is not None}
        slots = ({n for n, p in m._parameters.items() if p is None}, {n for n, b in m._buffers.items() if b is None})
        hooks = {h: dict(getattr(m, h)) for h in HOOK_DICTS}
        state[name] = (m, m.training, params, buffers, hooks, (set(vars(m)), slots))
    return state


def global_state() -> dict[str, Any]:
    """Process state a run could change: the RNGs and the global module hooks."""
    from torch.nn.modules import module as module_mod

    return {
        "torch": torch.get_rng_state(),
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "hooks": {h: dict(getattr(module_mod, h)) for h in GLOBAL_HOOKS},
        "grad_enabled": torch.is_grad_enabled(),
        "default_dtype": torch.get_default_dtype(),
    }


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values (meta tensors have none: equal shapes)."""
    if a.device.type == "meta" or b.device.type == "meta":
        return a.device == b.device and a.shape == b.shape
    return torch.equal(a, b)


def assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before.keys() == after.keys()
    for name, (m, training, params, buffers, hooks, attrs) in before.items():
        m2, training2, params2, buffers2, hooks2, attrs2 = after[name]
        assert m2 is m and training2 == training, name
        assert params2.keys() == params.keys() and buffers2.keys() == buffers.keys(), name
        for n, (p, device, dtype, rg, value, grad, grad_value, thooks) in params.items():
            p2, device2, dtype2, rg2, value2, grad2, grad_value2, thooks2 = params2[n]
            assert p2 is p, f"{name}.{n} was replaced"
            assert (device2, dtype2, rg2) == (device, dtype, rg), f"{name}.{n}"
            assert same_values(value2, value), f"{name}.{n} values changed"
            assert grad2 is grad, f"{name}.{n}.grad object changed"
            assert (grad_value is None) == (grad_value2 is None)
            if grad_value is not None:
                assert grad_value2.dtype == grad_value.dtype and same_values(grad_value2, grad_value)
            assert thooks2 == thooks, f"{name}.{n} tensor hooks changed"
        for n, (b, device, dtype, value) in buffers.items():
            b2, device2, dtype2, value2 = buffers2[n]
            assert b2 is b and (device2, dtype2) == (device, dtype), f"{name}.{n}"
            assert same_values(value2, value), f"{name}.{n} buffer values changed"
        assert hooks2 == hooks, f"{name}: module hooks changed"
        assert attrs2 == attrs, f"{name}: attributes added or removed"


def assert_globals_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert torch.equal(after["torch"], before["torch"]), "torch CPU RNG state changed"
    assert after["random"] == before["random"], "Python random state changed"
    np_before, np_after = before["numpy"], after["numpy"]
    assert np_after[0] == np_before[0] and np.array_equal(np_after[1], np_before[1]) and \
        np_after[2:] == np_before[2:], "numpy RNG state changed"
    assert after["hooks"] == before["hooks"] and after["grad_enabled"] == before["grad_enabled"]
    assert after["default_dtype"] == before["default_dtype"]


# --------------------------------------------------------------------------- every API function

SHAPE = ["4x6"]
CALLS: dict[str, Callable[..., Any]] = {
    "shapes": lambda m, **o: hookcli.shapes(m, input_shapes=SHAPE, **o),
    "shapes_meta_option": lambda m, **o: hookcli.shapes(m, input_shapes=SHAPE, meta=True, **o),
    "stats": lambda m, **o: hookcli.stats(m, input_shapes=SHAPE, all_modules=True, **o),
    "grads": lambda m, **o: hookcli.grads(m, input_shapes=SHAPE, params="all", input_grads=True, clip=0.1, **o),
    "check": lambda m, **o: hookcli.check(m, input_shapes=SHAPE, **o),
    "features": lambda m, **o: hookcli.features(m, input_shapes=SHAPE, layers="bn,drop,head", **o),
    "fmaps": lambda m, **o: hookcli.fmaps(m, layer="bn", input_shapes=SHAPE, **o),
    "modules": lambda m, **o: hookcli.modules(m),
    "inspect": lambda m, **o: hookcli.inspect(m, input_shapes=SHAPE, **o),
}
#: These need values, which the meta device has none of: they refuse it (UsageError).
NEEDS_VALUES = {"stats", "inspect", "features", "fmaps", "grads", "check"}


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("call", list(CALLS))
def test_every_call_hands_the_model_and_process_back(call: str, device: str, dtype: str, train: bool) -> None:
    model, fired = user_model()
    before, globals_before = snapshot(model), global_state()
    try:
        result = CALLS[call](model, device=device, dtype=dtype, train=train)
    except UsageError as exc:
        # only what needs values may be refused, and only on meta, with a clear message
        assert device == "meta" and call in NEEDS_VALUES, f"{type(exc).__name__}: {exc}"
        assert "needs values" in str(exc) and exc.hint
    else:
        assert result is not None
        if device == "cpu" and call not in ("modules", "shapes_meta_option"):
            assert fired["forward"] >= 1  # the model really ran (and the user's hooks with it)
    assert_same(before, snapshot(model))
    assert_globals_same(globals_before, global_state())
    # and the model still computes what it computed before, with the user's own hooks firing
    counts = dict(fired)
    reference, _ = user_model()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert fired["forward"] == counts["forward"] + 1 and fired["pre"] == counts["pre"] + 1


def test_meta_runs_never_touch_the_callers_weights_and_give_real_shapes() -> None:
    model, _ = user_model()
    before = snapshot(model)
    report = hookcli.shapes(model, input_shapes=SHAPE, device="meta", all_modules=True)
    assert_same(before, snapshot(model))
    assert report.device == "meta"
    expected: dict[str, list[int]] = {}

    def record(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            expected[name] = list(output.shape)

        return hook

    hooks = [m.register_forward_hook(record(name)) for name, m in model.named_children()]
    with torch.no_grad():
        model(torch.zeros(4, 6))
    for h in hooks:
        h.remove()
    got = {r.name: r.shape for r in report.layers if r.name}
    assert {k: v for k, v in got.items() if k in expected} == expected


def test_meta_refuses_a_model_it_cannot_copy_and_leaves_it_alone() -> None:
    model, _ = user_model()
    model.lock = threading.Lock()  # deepcopy cannot copy a lock
    before = snapshot(model)
    with pytest.raises(UsageError, match="meta device") as info:
        hookcli.shapes(model, input_shapes=SHAPE, device="meta")
    assert info.value.hint and "cpu" in info.value.hint
    assert_same(before, snapshot(model))


def test_a_model_already_on_meta_runs_in_place() -> None:
    with torch.device("meta"):
        model = StateNet()
    before = snapshot(model)
    report = hookcli.shapes(model, input_shapes=SHAPE)
    assert report.device == "meta" and [r.shape for r in report.layers if r.name == "head"] == [[4, 3]]
    assert_same(before, snapshot(model))


def test_swapped_parameters_on_conversion_come_back() -> None:
    """With torch's swap_tensors conversion, ``.to(dtype)`` swaps the caller's parameter objects' data."""
    model, _ = user_model()
    before = snapshot(model)
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        hookcli.grads(model, input_shapes=SHAPE, dtype="float64", train=True, params="all")
        hookcli.shapes(model, input_shapes=SHAPE, device="meta")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    assert_same(before, snapshot(model))


def test_model_that_raises_is_handed_back() -> None:
    model, _ = user_model()
    model.head = nn.Linear(5, 3)  # wrong input size: the forward raises at head
    before = snapshot(model)
    globals_before = global_state()
    for call in ("stats", "grads", "features"):
        with pytest.raises(HookcliError):
            CALLS[call](model, dtype="float64", train=True)
    assert_same(before, snapshot(model))
    assert_globals_same(globals_before, global_state())


# --------------------------------------------------------------------------- RNG and --seed


def dropout_net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 64), nn.Dropout(0.5), nn.Linear(64, 2))


def plain_dropout_output(model: nn.Module, seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The Dropout output of a train-mode forward on ones, with the torch RNG seeded as ``seed``."""
    net = copy.deepcopy(model).train()
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        return net[1](net[0](torch.ones(shape)))


@pytest.mark.parametrize("seed", [0, 7, 12345])
def test_train_dropout_is_seeded_from_seed_and_the_rng_is_left_alone(seed: int) -> None:
    model = dropout_net()
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    globals_before = global_state()
    first = hookcli.stats(model, input_shapes=["8x6"], fill="ones", train=True, seed=seed, layers="1")
    assert_globals_same(globals_before, global_state())
    torch.rand(3)  # move the caller's RNG: the run must not depend on it
    again = hookcli.stats(model, input_shapes=["8x6"], fill="ones", train=True, seed=seed, layers="1")
    assert first.to_dict()["layers"] == again.to_dict()["layers"]
    # the numbers are the Dropout output plain torch gives after torch.manual_seed(seed)
    expected = plain_dropout_output(model, seed, (8, 6)).double()
    stats = first.to_dict()["layers"][0]["stats"]
    assert stats["zero_fraction"] == pytest.approx(float((expected == 0).double().mean()))
    assert stats["mean"] == pytest.approx(float(expected.mean()), rel=1e-5, abs=1e-6)
    assert stats["std"] == pytest.approx(float(expected.std(correction=0)), rel=1e-5, abs=1e-6)
    other = hookcli.stats(model, input_shapes=["8x6"], fill="ones", train=True, seed=seed + 1, layers="1")
    assert other.to_dict()["layers"] != first.to_dict()["layers"]


def test_train_grads_are_seeded_and_match_autograd() -> None:
    model = dropout_net()
    seed = 5
    globals_before = global_state()
    report = hookcli.grads(model, input_shapes=["8x6"], fill="ones", train=True, seed=seed, loss="sum",
                           params="all")
    assert_globals_same(globals_before, global_state())
    net = copy.deepcopy(model).train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        loss = net(torch.ones(8, 6)).sum()
        (g,) = torch.autograd.grad(loss, [net[0].weight])
    row = next(p for p in report.to_dict()["params"] if p["name"] == "0.weight")
    assert row["grad"]["norm"] == pytest.approx(float(g.double().norm()), rel=1e-5)


def test_the_python_and_numpy_rngs_a_model_draws_from_are_seeded_and_restored() -> None:
    class Noisy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * random.random() + float(np.random.rand())

    random.seed(1)
    np.random.seed(1)
    globals_before = global_state()
    runs = [hookcli.stats(Noisy(), input_shapes=["2x3"], fill="ones", seed=s).to_dict()["layers"][0]["stats"]
            for s in (4, 4, 5)]
    assert_globals_same(globals_before, global_state())
    random.seed(4)
    np.random.seed(4)
    assert runs[0]["mean"] == pytest.approx(random.random() + float(np.random.rand()), rel=1e-6)
    random.setstate(globals_before["random"])
    np.random.set_state(globals_before["numpy"])
    assert runs[0] == runs[1] and runs[0]["mean"] != runs[2]["mean"]


@pytest.mark.parametrize("seed", [0, 11])
def test_a_model_built_by_spec_is_seeded_and_the_rng_is_left_alone(seed: int) -> None:
    import tiny_models

    globals_before = global_state()
    report = hookcli.grads("tiny_models:Reused", input_shapes=["2x4"], seed=seed, params="all")
    tree = hookcli.modules("tiny_models:Reused")
    assert_globals_same(globals_before, global_state())
    assert tree.modules and report.params
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        reference = tiny_models.Reused()
    norms = {n: float(p.detach().double().norm()) for n, p in reference.named_parameters()}
    assert {p.name: pytest.approx(p.norm, rel=1e-6) for p in report.params} == norms


def test_cli_same_seed_same_numbers(cli) -> None:
    """Through the CLI: on ones, only the Dropout masks depend on --seed."""
    import json

    args = ["stats", "test_model_state:dropout_net", "--input-shape", "8x6", "--fill", "ones", "--train",
            "--format", "json"]
    a, b, c = (cli(*args, "--seed", s) for s in ("3", "3", "4"))
    assert a.exit_code == b.exit_code == c.exit_code == 0, a.stderr
    assert json.loads(a.stdout)["layers"] == json.loads(b.stdout)["layers"]
    assert json.loads(a.stdout)["layers"] != json.loads(c.stdout)["layers"]


# --------------------------------------------------------------------------- threads and re-entry


def run_options(thread: int, run: int) -> dict[str, Any]:
    """Different seed and batch per (thread, run): results of different runs are distinguishable."""
    return {"input_shapes": [f"{2 + thread}x6"], "seed": 100 * thread + run, "train": True, "all_modules": True}


def layers(report: Any) -> list[dict[str, Any]]:
    return report.to_dict()["layers"]


def test_threads_on_one_model_are_serialised_and_rows_never_mix() -> None:
    """4 threads x 3 runs of stats and grads on one model, and stats on a second Dropout model that
    draws from the same process-wide RNG: each result is what the same run gives on its own."""
    model, _ = user_model()
    second = dropout_net()
    threads, runs = 4, 3
    fns: dict[str, Callable[..., Any]] = {
        "stats": hookcli.stats,
        "grads": lambda m, **o: hookcli.grads(m, params="all", **o),
        "second": lambda m, **o: hookcli.stats(second, **o),
    }
    expected = {(fn, t, r): layers(fns[fn](model, **run_options(t, r)))
                for fn in fns for t in range(threads) for r in range(runs)}
    before, second_before, globals_before = snapshot(model), snapshot(second), global_state()
    got: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads)

    def worker(t: int) -> None:
        try:
            barrier.wait()
            for r in range(runs):
                for fn in fns:
                    got[(fn, t, r)] = layers(fns[fn](model, **run_options(t, r)))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors
    assert got.keys() == expected.keys()
    for key in expected:
        assert got[key] == expected[key], key
    assert_same(before, snapshot(model))
    assert_same(second_before, snapshot(second))
    assert_globals_same(globals_before, global_state())
    # the single-threaded numbers themselves: the first BatchNorm row against plain torch (batch stats)
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(0))
    ref = copy.deepcopy(model).train()
    with torch.no_grad():
        bn_out = ref.bn(ref.inp(x))
    bn_row = next(row for row in expected[("stats", 0, 0)] if row["name"] == "bn")
    assert bn_row["stats"]["mean"] == pytest.approx(float(bn_out.double().mean()), abs=1e-6)
    assert bn_row["stats"]["std"] == pytest.approx(float(bn_out.double().std(correction=0)), rel=1e-5)


def test_a_call_from_inside_a_hooked_forward_on_the_same_model_is_refused() -> None:
    model, _ = user_model()
    other = dropout_net()
    seen: dict[str, Any] = {}

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        for key, target in (("same", model), ("sibling", model.bn), ("hooked", model.mid)):
            try:
                hookcli.stats(target, input_shapes=SHAPE)
            except UsageError as exc:
                seen[key] = exc
        seen["other"] = layers(hookcli.stats(other, input_shapes=["2x6"], seed=4))

    handle = model.mid.register_forward_hook(hook)
    try:
        before = snapshot(model)
        outer = hookcli.stats(model, input_shapes=SHAPE, train=True, all_modules=True)
        assert_same(before, snapshot(model))
    finally:
        handle.remove()
    for key in ("same", "sibling", "hooked"):
        assert "already running this model" in str(seen[key]) and seen[key].hint
    # the nested run on another model gave what it gives on its own, and the outer run is intact
    assert seen["other"] == layers(hookcli.stats(other, input_shapes=["2x6"], seed=4))
    assert layers(outer) == layers(hookcli.stats(model, input_shapes=SHAPE, train=True, all_modules=True))


def test_uninitialised_lazy_modules_are_refused_and_left_lazy() -> None:
    from torch.nn.parameter import UninitializedParameter

    model = nn.Sequential(nn.Linear(3, 4), nn.LazyLinear(2))
    with pytest.raises(UnsupportedError, match=r"1\.weight is an uninitialised lazy parameter") as info:
        hookcli.stats(model, input_shapes=["2x3"])
    assert info.value.hint and "forward" in info.value.hint
    assert type(model[1]) is nn.LazyLinear and isinstance(model[1].weight, UninitializedParameter)
    model(torch.zeros(2, 3))  # initialised by the user: now it runs, and comes back as it came
    before = snapshot(model)
    report = hookcli.stats(model, input_shapes=["2x3"], dtype="float64", train=True)
    assert [r.shape for r in report.layers] == [[2, 4], [2, 2]]
    assert_same(before, snapshot(model))


class ReshapesItself(nn.Module):
    """A forward that changes the module tree every way a model can (lazy heads, caches, swapped
    activations): the run must hand back the tree it was given."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail = fail
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU()
        self.gone = nn.Identity()
        self.register_buffer("cache", None)
        self.register_buffer("kept", torch.arange(3.0))
        self.register_module("slot", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        del self.kept  # a buffer removed and another added: the same number of entries
        self.register_buffer("made", torch.ones(3, dtype=x.dtype))  # a buffer made on first call
        self.cache = x.detach().sum(0)  # a None buffer filled
        self.head = nn.Linear(4, 2).to(x.dtype)  # a lazily made head
        self.act = nn.Tanh()  # a submodule swapped
        del self.gone  # a submodule removed
        self.slot = nn.Identity()  # a None submodule filled
        self.fc.register_parameter("scale", nn.Parameter(torch.ones(4, dtype=x.dtype)))  # on a child
        if self.fail:
            raise RuntimeError("boom")
        return self.head(self.act(self.fc(x)) * self.fc.scale)


@pytest.mark.parametrize("call", ["stats", "grads", "shapes"])
@pytest.mark.parametrize("fail", [False, True])
def test_what_a_forward_adds_swaps_or_removes_in_the_tree_is_put_back(call: str, fail: bool) -> None:
    """The model comes back as it was given, not initialised by hookcli's seeded run in its --dtype:
    added submodules, parameters and buffers are removed, swapped and removed ones put back, filled
    None entries emptied again (also when the forward raises)."""
    model = ReshapesItself(fail)
    reference = copy.deepcopy(model)
    before = snapshot(model)
    if fail:
        with pytest.raises(HookcliError):
            getattr(hookcli, call)(model, input_shapes=["2x4"], dtype="float64", device="cpu", all_modules=True)
    else:
        getattr(hookcli, call)(model, input_shapes=["2x4"], dtype="float64", device="cpu", all_modules=True)
    assert_same(before, snapshot(model))
    assert [n for n, _ in model.named_modules()] == ["", "fc", "act", "gone"]
    assert model.cache is None and model._modules["slot"] is None and "made" not in model._buffers
    if not fail:  # and its own first call does what it would have done without hookcli
        x = torch.randn(3, 4)
        torch.manual_seed(1)
        expected = reference(x)
        torch.manual_seed(1)
        assert torch.equal(model(x), expected)


class TradesABuffer(nn.Module):
    """Removes one buffer and adds another in forward: the module holds as many entries as before."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("kept", torch.arange(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        del self.kept
        self.register_buffer("made", torch.ones(3))
        return self.fc(x)


def test_a_buffer_traded_for_another_is_put_back() -> None:
    model = TradesABuffer()
    before = snapshot(model)
    hookcli.stats(model, input_shapes=["2x4"])
    assert_same(before, snapshot(model))
    assert list(model._buffers) == ["kept"]


def test_optimiser_steps_on_a_callers_model_keep_their_update_and_a_forwards_drift_is_undone() -> None:
    """``preserved`` puts back what a forward changes in a caller's weights, but a run whose purpose is
    optimiser steps (check's SGD step on its copy, check --steps) keeps the steps' update: checked
    against one plain float64 SGD step of the same loss."""
    from hookcli.engine import run as engine
    from hookcli.options import RunOptions

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    prep = engine.prepare(RunOptions(model=model, inputs=x, seed=0))

    def loss(output: Any, args: Any, kwargs: Any, model: nn.Module) -> tuple[torch.Tensor, None]:
        return output.pow(2).mean(), None

    plan = engine.OptimiserSteps(lambda: torch.optim.SGD(model.parameters(), lr=0.5), 1)
    result = engine.run_model(prep, [], engine.RunPlan(loss=loss, steps=plan, show_phase=False))
    assert result.cause is None
    w, b = (before[n].double().requires_grad_(True) for n in ("weight", "bias"))
    gw, gb = torch.autograd.grad((x.double() @ w.T + b).pow(2).mean(), (w, b))
    assert torch.allclose(model.weight.detach().double(), before["weight"].double() - 0.5 * gw, atol=1e-6)
    assert torch.allclose(model.bias.detach().double(), before["bias"].double() - 0.5 * gb, atol=1e-6)
    assert not torch.equal(model.weight, before["weight"])

    stepped = {n: p.detach().clone() for n, p in model.named_parameters()}
    drift = model.register_forward_pre_hook(lambda m, a: m.weight.data.add_(1.0))
    try:
        engine.run_model(engine.prepare(RunOptions(model=model, inputs=x, seed=0)), [],
                         engine.RunPlan(show_phase=False))
    finally:
        drift.remove()
    assert torch.equal(model.weight, stepped["weight"]) and torch.equal(model.bias, stepped["bias"])
