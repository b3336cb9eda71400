"""hookcli.watch under torchrun (docs/distributed.md): 2 ranks on CPU with gloo, DDP, FSDP2 and tensor
parallel, and FSDP2 x TP on 4, against plain torch over the global batch, and against a one-process
watch of the same model and batches; hookcli.stats under torchrun.

Eight torchrun runs (tests/distributed_worker.py), each paying two (or four) interpreter and torch
start-ups: 108 s wall (97 s CPU) on the shared 2-core development machine (docs/distributed.md).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

import hookcli
from hookcli.engine import distributed, stats
from hookcli.engine import rank_stats

sys.path.insert(0, str(Path(__file__).parent))
import distributed_worker as worker  # noqa: E402
from torchrun_launch import NEEDS_GLOO, close, launch  # noqa: E402

pytestmark = NEEDS_GLOO
WORLD = 2


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``launched(mode, world)``: the folder of one torchrun of the worker in ``mode``, made once per
    module (several tests read one launch: each costs every rank a torch start-up)."""
    done: dict[tuple[str, int], Path] = {}

    def run(mode: str, world: int = WORLD) -> Path:
        if (mode, world) not in done:
            out = tmp_path_factory.mktemp(mode)
            torchrun(mode, out, world)
            done[(mode, world)] = out
        return done[(mode, world)]

    return run


def torchrun(mode: str, out: Path, world: int = WORLD) -> list[dict[str, Any]] | None:
    """Run the worker on ``world`` ranks; each rank's ``rank<r>.json`` (the log is ``out/log.jsonl``), None
    for ``count`` (its files are in ``out/4`` and ``out/40``) and ``cause`` (``out/cause<r>.json``,
    ``out/rank_one<r>.json``)."""
    done = launch([str(Path(worker.__file__)), mode, str(out)], world)
    assert done.returncode == 0, done.stderr[-4000:]
    if mode in ("count", "cause"):
        return None
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def outputs_of(net: nn.Sequential, x: torch.Tensor) -> list[torch.Tensor]:
    """Each module's output of ``net`` (a Sequential) on ``x``, in plain torch."""
    outputs = []
    for module in net:
        x = module(x)
        outputs.append(x)
    return outputs


def torch_stats(t: torch.Tensor) -> dict[str, float]:
    """What the log says of a tensor, computed by torch over the whole tensor (float64)."""
    t = t.detach().double()
    return {"mean": t.mean().item(), "std": t.std(correction=0).item(), "min": t.min().item(),
            "max": t.max().item(), "count": t.numel(), "zero_fraction": (t == 0).double().mean().item()}


def reference(hidden: int = 5) -> list[dict[str, Any]]:
    """The worker's training in one process over the global batch, in plain torch: per step, each
    module's output and its gradient w.r.t. the sum of the ranks' losses (each rank's backward
    starts from its own mean loss), each parameter's norm before the step, its gradient (the ranks'
    mean: what DDP and FSDP2 leave in .grad), its update, and the ranks' mean loss."""
    net = worker.model(hidden=hidden)
    params = dict(net.named_parameters())
    per_rank = worker.GLOBAL_BATCH // WORLD
    steps = []
    for step in range(worker.STEPS):
        x, y = worker.batch(step)
        outputs = outputs_of(net, x)
        h = outputs[-1]
        losses = [nn.functional.mse_loss(h[r * per_rank:(r + 1) * per_rank], y[r * per_rank:(r + 1) * per_rank])
                  for r in range(WORLD)]
        out_grads = torch.autograd.grad(sum(losses), outputs, retain_graph=True)
        grads = torch.autograd.grad(sum(losses) / WORLD, list(params.values()))
        record = {"loss": (sum(losses) / WORLD).item(),
                  "layers": {str(i): (torch_stats(o), torch_stats(g)) for i, (o, g) in enumerate(zip(outputs, out_grads))},
                  "channels": {str(i): torch_channels(o) for i, o in enumerate(outputs)},
                  "params": {}, "tensors": {}}
        sgd_step(params, grads, record)
        steps.append(record)
    return steps


def sgd_step(params: dict[str, nn.Parameter], grads: Any, record: dict[str, Any]) -> None:
    """The worker's SGD step in plain torch, in place; each parameter's norm before it, its gradient's
    statistics and its update's norm into ``record["params"]`` (and the tensors into ``record["tensors"]``
    where the record has that key)."""
    with torch.no_grad():
        for (name, p), g in zip(params.items(), grads):
            before = p.detach().clone()
            p -= worker.LR * g
            record["params"][name] = (torch.linalg.vector_norm(before.double()).item(), torch_stats(g),
                                      torch.linalg.vector_norm((before - p).double()).item())
            if "tensors" in record:
                record["tensors"][name] = (before, g)


def torch_channels(t: torch.Tensor) -> tuple[list[float], int]:
    """Each channel's (the last dimension's) zero fraction over all the other dimensions, and how many
    channels are zero in every value: what the ``dead_units`` rule and the log's ``dead_channels`` say."""
    zero = (t.detach() == 0).reshape(-1, t.shape[-1]).double()
    return zero.mean(0).tolist(), int((zero.min(0).values == 1).sum())


def assert_channels(lines: list[dict[str, Any]], fractions: list[dict[str, list[float]]],
                    expected: list[dict[str, Any]], uncounted: set[str] = frozenset()) -> None:
    """Every logged step's per-channel zero fractions (``fractions``: the rank's ``channel_fractions``)
    and ``dead_channels`` / ``channels`` equal plain torch's over the global batch; the layers in
    ``uncounted`` (tensor-parallel shards) have none."""
    for line, found, ref in zip(lines, fractions, expected, strict=True):
        for layer in line["layers"]:
            name = layer["name"]
            if name in uncounted:
                assert "channels" not in layer and name not in found, name
                continue
            want, dead = ref["channels"][name]
            assert (layer["channels"], layer["dead_channels"]) == (len(want), dead), (line["step"], name)
            assert found[name] == pytest.approx(want, abs=1e-12), (line["step"], name)


def assert_histograms(folder: Path, expected: list[dict[str, Any]]) -> None:
    """TensorBoard's histograms of every parameter and gradient (rank 0's event file) equal
    ``torch.histc`` of the whole tensor in one process: 30 buckets from its min to its max, the
    count, sum and sum of squares."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"histograms": 0})
    events.Reload()
    for name in expected[0]["tensors"]:
        for kind, index in (("values", 0), ("grad", 1)):
            written = events.Histograms(f"params/{name}/{kind}")
            assert [h.step for h in written] == list(range(worker.STEPS)), (name, kind)
            for h, ref in zip(written, expected):
                t = ref["tensors"][name][index].detach().reshape(-1)
                lo, hi = t.min().item(), t.max().item()
                h = h.histogram_value
                assert (close(h.min, lo), close(h.max, hi), h.num) == (True, True, t.numel()), (name, kind)
                assert close(h.sum, t.double().sum().item(), t.double().abs().sum().item())  # a sum near 0: its spread
                assert close(h.sum_squares, t.double().square().sum().item())
                # no value of the reference within 1e-5 of an inner bucket edge: the ranks' float
                # rounding cannot move one across it
                position = (t.double() - lo) / (hi - lo) * 30
                inner = position[(position > 0) & (position < 30)]
                assert ((inner - inner.round()).abs() > 1e-5).all()
                # one value (4.bias): histc widens the range by 1 each side, all in the middle bucket
                assert list(h.bucket) == torch.histc(t, bins=30, min=lo, max=hi).tolist(), (name, kind)


def assert_matches(lines: list[dict[str, Any]], expected: list[dict[str, Any]], *, out_grad_scale: float = 1.0) -> None:
    """Every logged step's layers and parameters equal the reference (counts exact, floats ``REL``)."""
    assert [line["step"] for line in lines] == list(range(worker.STEPS))
    for line, ref in zip(lines, expected):
        assert close(line["loss"], ref["loss"])
        assert {layer["name"] for layer in line["layers"]} == set(ref["layers"])
        for layer in line["layers"]:
            want_stats, want_grad = ref["layers"][layer["name"]]
            for key, value in want_stats.items():
                spread = want_stats["std"] if key == "mean" else 0.0
                assert close(layer["stats"][key], value, spread), (line["step"], layer["name"], key)
            for key, value in want_grad.items():
                scale = out_grad_scale if key in ("mean", "std", "min", "max") else 1.0
                spread = want_grad["std"] * scale if key == "mean" else 0.0
                assert close(layer["grad"][key], value * scale, spread), (line["step"], layer["name"], "grad", key)
            assert layer["stats"]["count"] == want_stats["count"]  # exact
        assert [p["name"] for p in line["params"]] == list(ref["params"])
        for p in line["params"]:
            norm, grad, update = ref["params"][p["name"]]
            assert close(p["norm"], norm) and close(p["update_norm"], update), p["name"]
            for key, value in grad.items():
                spread = grad["std"] if key == "mean" else 0.0
                assert close(p["grad"][key], value, spread), (line["step"], p["name"], "grad", key)
            assert p["grad"]["count"] == grad["count"]


@pytest.fixture(scope="module")
def expected() -> list[dict[str, Any]]:
    return reference()


def ranks_of(folder: Path, world: int = WORLD) -> list[dict[str, Any]]:
    """Each rank's ``rank<r>.json`` of a launch."""
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]


def test_the_accelerator_path_packs_the_same_slots_on_every_rank(launched: Any, expected: list[dict[str, Any]]) -> None:
    """DDP again with the statistics as an accelerator takes them (tensors carrying their scale, here
    on CPU): the same numbers as plain torch, and no rank packs a slot longer than another's."""
    folder = launched("ddp") / "accelerator"
    assert_matches([json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines()], expected)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_equal_plain_torch_over_the_global_batch(mode: str, launched: Any,
                                                           expected: list[dict[str, Any]]) -> None:
    """DDP and FSDP2 (uneven and empty shards): every number of the log, and each output's per-channel
    zero counts; under FSDP2 (``tensorboard_dir=`` given to rank 0 alone) also each parameter's and
    gradient's histogram over its shards, with one more collective a logged step (inside
    ``optimizer.step()``: the shards' min and max)."""
    folder = launched(mode)
    ranks = ranks_of(folder)
    lines = [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines()]
    assert_matches(lines, expected)
    assert_channels(lines, ranks[0]["channels"], expected)
    # every rank got the same records; only rank 0 wrote (one log, one line per step)
    assert ranks[0]["records"] == ranks[1]["records"] == lines
    assert ranks[0]["channels"] == ranks[1]["channels"]
    assert ranks[0]["findings"] == [] and ranks[1]["findings"] == []
    collectives = [(c["optimizer_step"], c["process_group"]) for c in ranks[0]["collectives"][1:]]
    if mode == "fsdp":
        assert_histograms(folder / "tb", expected)
        assert collectives == [(1, 3), (1, 3)]
    else:
        assert not (folder / "tb").exists()
        assert collectives == [(0, 3), (0, 3)]


@pytest.mark.parametrize(("mode", "world", "out_grad_scale"), [("tp", 2, 1 / WORLD), ("tp_dtensor", 2, 1 / WORLD),
                                                                 ("fsdp_tp", 4, 1.0)])
def test_tensor_parallel_equals_plain_torch_over_the_global_batch(mode: str, world: int, out_grad_scale: float,
                                                                  launched: Any) -> None:
    """Tensor parallel on 2 ranks (``0`` colwise, ``2`` rowwise; every rank the whole batch) and FSDP2 x
    TP on 2 x 2 (each TP group half the batch, FSDP2 shards uneven and empty), and TP whose colwise
    layer outputs a DTensor (``use_local_output=False``; its local part is reduced): the numbers of one
    process over the global batch. The colwise layer's output and the ReLU after it are parts of the
    features on each TP rank (summed), the rowwise output and what follows are copies (counted once).
    Output gradients are of the loss each rank's backward starts from: under TP alone the global mean
    loss (1/2 of the reference's sum of two half-batch losses), under FSDP2 x TP its TP group's half.
    Per-channel zeros are counted on the copies only; under ``tp`` (``tensorboard_dir=`` on rank 0)
    the parameters' and gradients' histograms are over their TP shards."""
    folder = launched(mode, world)
    ranks = ranks_of(folder, world)
    lines = [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines()]
    expected = reference(worker.TP_HIDDEN)
    assert_matches(lines, expected, out_grad_scale=out_grad_scale)
    for line in lines:
        assert {layer["name"]: layer["placement"] for layer in line["layers"]} == {
            "0": "sharded", "1": "sharded", "2": "replicated", "3": "replicated", "4": "replicated"}
    # per-channel zeros: of the copies, once per TP group, summed over the groups; of the shards, none
    assert_channels(lines, ranks[0]["channels"], expected, uncounted={"0", "1"})
    assert all(rank["records"] == lines for rank in ranks)
    assert all(rank["findings"] == [] for rank in ranks)
    if mode == "tp":  # histograms of colwise (Shard(0)), rowwise (Shard(1)) and replicated parameters
        assert_histograms(folder / "tb", expected)


def test_dead_channels_are_those_of_the_global_batch(launched: Any) -> None:
    """DDP on 2 ranks (the ``ddp`` launch's second watch): ``dead_model``'s init kills channels 0 and 1;
    channel 2 is zero on rank 0's half of the batch only, channel 3 on rank 1's. Each logged step's
    per-channel zero fractions and ``dead_channels`` are plain torch's over the global batch (2 dead,
    where each rank alone has 3), and ``dead_units`` judges the ReLU per channel (128 values a channel
    over the ranks; a rank's 64 are too few for the rule): it names the 2 killed channels at step 2."""
    folder = launched("ddp")
    ranks = [json.loads((folder / f"dead{r}.json").read_text()) for r in range(WORLD)]
    assert ranks[0] == ranks[1]
    net = worker.dead_model()
    for step, (layers, fractions) in enumerate(zip(ranks[0]["layers"], ranks[0]["channels"], strict=True)):
        with torch.no_grad():
            linear = net[0](worker.dead_batch(step))
            outputs = {"0": linear, "1": net[1](linear)}
        assert [torch_channels(half)[1] for half in outputs["1"].chunk(WORLD)] == [3, 3]  # each rank alone
        for layer in layers:
            want, dead = torch_channels(outputs[layer["name"]])
            assert (layer["channels"], layer["dead_channels"]) == (6, dead), (step, layer["name"])
            assert fractions[layer["name"]] == pytest.approx(want, abs=1e-12), (step, layer["name"])
        assert [layer["dead_channels"] for layer in layers] == [0, len(worker.DEAD)]
    found = [(f["rule"], f["step"], f["layer"], f["value"]) for f in ranks[0]["findings"]]
    assert found == [("dead_units", 2, "1", float(len(worker.DEAD)))]


def test_a_head_only_one_rank_takes_logs_ddps_mean_gradient(launched: Any) -> None:
    """DDP with ``find_unused_parameters=True`` (the ``ddp`` launch's ``unused_branch``): at step 1 rank 1
    alone takes the right head; DDP gives every rank the ranks' mean gradient of it, rank 0's without a
    backward of its own through it. The log has the right head's gradient (before: none, as rank 0's
    copy is the one logged, though the update moved it) and every parameter's numbers are plain
    torch's: each step's gradient that of the ranks' mean loss; the right head has none at steps 0
    and 2, where no rank takes it."""
    lines = [json.loads(line) for line in (launched("ddp") / "branch" / "log.jsonl").read_text().splitlines()]
    net = worker.Branchy()
    params = dict(net.named_parameters())
    for line in lines:
        step = line["step"]
        losses = [net(worker.branch_batch(step, r), not worker.right_taken(step, r)).square().mean()
                  for r in range(WORLD)]
        used = {name for name in params if not name.startswith("right")} | (
            {"right.weight", "right.bias"} if any(worker.right_taken(step, r) for r in range(WORLD)) else set())
        grads = torch.autograd.grad(sum(losses) / WORLD, [params[name] for name in used])
        record: dict[str, Any] = {"params": {}}
        sgd_step({name: params[name] for name in used}, grads, record)
        logged = {p["name"]: p for p in line["params"]}
        assert close(line["loss"], (sum(losses) / WORLD).item())
        for name in params:
            if name not in used:
                assert logged[name].get("grad") is None and logged[name]["update_norm"] == 0.0, (step, name)
                continue
            norm, grad, update = record["params"][name]
            assert close(logged[name]["norm"], norm) and close(logged[name]["update_norm"], update), (step, name)
            assert logged[name]["grad"] is not None, (step, name)
            for key, value in grad.items():
                assert close(logged[name]["grad"][key], value, grad["std"] if key == "mean" else 0.0), (step, name, key)
    assert [line["step"] for line in lines] == list(range(worker.STEPS))


def sp_reference() -> list[dict[str, Any]]:
    """``sp_model``'s training in one process in plain torch, every token at once: per step each
    module's output and its gradient w.r.t. the loss (every rank's loss: the replicated head's), each
    parameter's norm, gradient and update (SGD), as ``reference`` gives them."""
    net = worker.sp_model()
    params = dict(net.named_parameters())
    steps = []
    for step in range(worker.STEPS):
        x, y = worker.sp_batch(step)
        outputs = outputs_of(net, x)
        h = outputs[-1]
        loss = nn.functional.mse_loss(h, y)
        out_grads = torch.autograd.grad(loss, outputs, retain_graph=True)
        grads = torch.autograd.grad(loss, list(params.values()))
        record = {"loss": loss.item(), "params": {},
                  "layers": {str(i): (torch_stats(o), torch_stats(g)) for i, (o, g) in enumerate(zip(outputs, out_grads))},
                  "channels": {str(i): torch_channels(o) for i, o in enumerate(outputs)}}
        sgd_step(params, grads, record)
        steps.append(record)
    return steps


def test_sequence_parallel_equals_plain_torch_over_every_token(launched: Any) -> None:
    """Sequence parallelism (the ``tp`` launch's second watch: torch's TP tutorial in small): each rank
    feeds its half of the tokens to a ``SequenceParallel`` LayerNorm, a colwise Linear gathers them, the
    rowwise one scatters them back, a colwise head replicates its output. Every output's and its
    gradient's statistics, and every parameter's, are those of one process over all the tokens. The
    LayerNorm's output (a DTensor), the Linear pair's and the ReLU's are classified ``sharded`` (other
    tokens or other features on each rank), the head's ``replicated``. The LayerNorm's gradients are
    ``Partial`` (each rank its tokens' share): summed, not compared as replicas (no ``replica_desync``)."""
    folder = launched("tp") / "sp"
    ranks = ranks_of(folder)
    lines = [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines()]
    expected = sp_reference()
    assert_matches(lines, expected)
    for line in lines:
        assert {layer["name"]: layer["placement"] for layer in line["layers"]} == {
            "0": "sharded", "1": "sharded", "2": "sharded", "3": "sharded", "4": "replicated"}
    assert_channels(lines, ranks[0]["channels"], expected, uncounted={"0", "1", "2", "3"})
    assert ranks[0]["records"] == ranks[1]["records"] == lines
    assert ranks[0]["findings"] == ranks[1]["findings"] == []


def test_sequence_parallel_under_fsdp2_x_tp_equals_plain_torch_and_refuses_a_sharded_partial_gradient(
        launched: Any) -> None:
    """Sequence parallelism under FSDP2 x TP on 2 x 2 ranks (the ``fsdp_tp`` launch's second watch): each
    TP group one row of the batch, each rank its half of the row's tokens. FSDP2 (torch 2.14) leaves the
    LayerNorm's gradient summed over the TP ranks (``Replicate`` on ``tp``, sharded on ``dp``): every
    number is one process's over every row and token; output gradients are those of the TP group's
    row loss (2x the global mean loss's). A fourth step whose LayerNorm gradient is both sharded and
    ``Partial`` is refused on every rank at that step, with one clear error (UnsupportedError, exit 2,
    a hint), and the log keeps the three steps before it."""
    folder = launched("fsdp_tp", 4) / "sp_fsdp"
    ranks = ranks_of(folder, 4)
    lines = [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines()]
    expected = sp_reference()
    assert_matches(lines, expected, out_grad_scale=2.0)
    for line in lines:
        assert {layer["name"]: layer["placement"] for layer in line["layers"]} == {
            "0": "sharded", "1": "sharded", "2": "sharded", "3": "sharded", "4": "replicated"}
    assert_channels(lines, ranks[0]["channels"], expected, uncounted={"0", "1", "2", "3"})
    assert all(rank["records"] == lines and rank["findings"] == [] for rank in ranks)
    errors = [rank["errors"] for rank in ranks]  # a refusal: raised at w.step() on every rank, as a finding under
    assert all(found == errors[0] for found in errors) and len(errors[0]) == 1, errors  # on_finding="raise"
    name, code, message, hint = errors[0][0]
    assert (name, code) == ("UnsupportedError", 2)
    assert message == "the gradient of parameter 0.weight is both sharded and Partial" and hint, errors


@settings(max_examples=40, deadline=None)
@given(parts=st.lists(st.lists(st.integers(0, 29), max_size=20), min_size=2, max_size=4),
       lo=st.floats(-10, 10), span=st.floats(0.5, 100))
def test_bucket_counts_of_parts_with_the_global_edges_add_up_to_those_of_the_whole(parts: list[list[int]], lo: float,
                                                                                   span: float) -> None:
    """What ``global_histograms`` sums, without processes: each part's ``histogram`` with the edges of
    the whole (its min and max, the ranks' MAX) adds up to ``torch.histc`` of the concatenation; empty
    parts (an empty FSDP2 shard) add nothing. Values at bucket centres (no rounding across an edge)."""
    hi = lo + span
    tensors = [lo + span * (torch.tensor(p, dtype=torch.float64) + 0.5) / 30 for p in parts]
    tensors[0] = torch.cat([torch.tensor([lo, hi], dtype=torch.float64), tensors[0]])
    whole = torch.cat(tensors)
    found = [h for t in tensors if (h := stats.histogram(t, bounds=(lo, hi))) is not None]
    assert all(h[:2].tolist() == [lo, hi] for h in found)  # the edges given, not the part's own
    summed = sum(found)
    assert summed[2] == whole.numel()
    assert summed[5:].tolist() == torch.histc(whole, bins=30, min=lo, max=hi).tolist()


@pytest.fixture(scope="module")
def api_reports(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    """Each rank's ``stats`` and ``grads`` reports (the worker's ``stats`` mode: one torchrun)."""
    ranks = torchrun("stats", tmp_path_factory.mktemp("api"))
    assert ranks is not None
    return ranks


def test_stats_api_under_torchrun_is_over_every_ranks_batch(api_reports: list[list[dict[str, Any]]]) -> None:
    """``hookcli.stats`` on each rank's half of a batch, as one input and as ``data`` in batches of 2:
    every rank's report holds the statistics of plain torch over the whole batch (the norm checks
    the count), and says so in a note."""
    ranks = api_reports
    net = worker.model()
    x, _ = worker.batch(0)
    outputs, h = {}, x
    with torch.no_grad():
        for name, module in net.named_children():
            h = module(h)
            outputs[name] = h.double()
    assert ranks[0] == ranks[1]
    for report in ranks[0][:2]:
        assert [layer["name"] for layer in report["layers"]] == list(outputs)
        assert any("2 ranks" in note for note in report["notes"])
        for layer in report["layers"]:
            out = outputs[layer["name"]]
            want = {"mean": out.mean().item(), "std": out.std(correction=0).item(), "min": out.min().item(),
                    "max": out.max().item(), "norm": torch.linalg.vector_norm(out).item(),
                    "zero_fraction": (out == 0).double().mean().item()}
            for key, value in want.items():
                assert close(layer["stats"][key], value), (layer["name"], key)


def test_grads_api_under_torchrun_is_over_every_ranks_batch(api_reports: list[list[dict[str, Any]]]) -> None:
    """``hookcli.grads`` (loss: the output's mean) on each rank's half of a batch, as one input and as
    ``data`` in batches of 2: every rank's report holds plain torch's gradients over the whole batch:
    each layer's output gradient that of the sum of the batch losses (each batch's backward starts
    from its own loss), each parameter's that of their mean (DDP's), the loss their mean."""
    ranks = api_reports
    assert ranks[0] == ranks[1]
    net = worker.model()
    x, _ = worker.batch(0)
    outputs, h = [], x
    for module in net:
        h = module(h)
        outputs.append(h)
    for report, rows in zip(ranks[0][2:], (4, 2)):  # rows per batch: one input per rank, then batches of 2
        losses = [h[start:start + rows].mean() for start in range(0, worker.GLOBAL_BATCH, rows)]
        out_grads = torch.autograd.grad(sum(losses), outputs, retain_graph=True)
        param_grads = torch.autograd.grad(sum(losses) / len(losses), list(net.parameters()), retain_graph=True)
        assert close(report["loss"]["value"], (sum(losses) / len(losses)).item())
        assert any("2 ranks" in note for note in report["notes"])
        assert [layer["name"] for layer in report["layers"]] == [str(i) for i in range(len(net))]
        for layer, g in zip(report["layers"], out_grads):
            for key, value in grad_stats(g).items():
                assert close(layer["grad"][key], value), (rows, layer["name"], key)
        assert [p["name"] for p in report["params"]] == [name for name, _ in net.named_parameters()]
        for p, g in zip(report["params"], param_grads):
            for key, value in grad_stats(g).items():
                assert close(p["grad"][key], value), (rows, p["name"], key)


def grad_stats(g: torch.Tensor) -> dict[str, float]:
    """What a grads report says of a gradient, computed by torch (float64)."""
    g = g.detach().double()
    return {"mean": g.mean().item(), "std": g.std(correction=0).item(), "min": g.min().item(),
            "max": g.max().item(), "norm": torch.linalg.vector_norm(g).item()}


def test_one_process_watch_equals_plain_torch(tmp_path: Path, expected: list[dict[str, Any]]) -> None:
    """The same model, weights and global batch in one process without a process group: the same
    numbers, but for output gradients, which are of the global mean loss (1/world of the ranks' sum)."""
    assert distributed.process_group() is None
    net = worker.model()
    optimizer = torch.optim.SGD(net.parameters(), lr=worker.LR)
    with hookcli.watch(net, optimizer, every=1, out=tmp_path / "log.jsonl") as w:
        for step in range(worker.STEPS):
            x, y = worker.batch(step)
            loss = nn.functional.mse_loss(net(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            w.step(loss=loss)
    lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert_matches(lines, expected, out_grad_scale=1 / WORLD)


def test_collectives_per_logged_step_do_not_grow_with_layers(tmp_path: Path) -> None:
    """A logged step's reduction is 3 all_reduce calls with 4 layers as with 40 (their per-channel
    zero counts included), counted by the
    process group's own sequence number (every collective on it, hookcli's or not) around
    ``w.step()``; the first step adds only the ranks' mean of its late loss (the layout exchange ran
    inside optimizer.step(), where the step was closed)."""
    torchrun("count", tmp_path)
    counts = {}
    for layers in (4, 40):
        ranks = [json.loads((tmp_path / str(layers) / f"rank{r}.json").read_text()) for r in range(WORLD)]
        for rank in ranks:
            assert [c["process_group"] for c in rank["collectives"]] == [c["hookcli"] for c in rank["collectives"]]
        counts[layers] = [c["process_group"] for c in ranks[0]["collectives"]]
        assert len(ranks[0]["records"][1]["layers"]) == 2 * layers + 1
        # the per-channel zero counts ride in the first SUM
        assert [layer["channels"] for layer in ranks[0]["records"][1]["layers"]] == [4] * (2 * layers) + [1]
    assert counts[4] == counts[40] == [1, 3, 3]


def test_nan_on_rank_1_and_a_nudged_replica_are_named_by_rank(tmp_path: Path) -> None:
    """Rank 1's copy of 2.weight is nudged by 1e-3 after DDP's broadcast: a replica desync from step 0;
    rank 1's input has a NaN at step 1: rank 1 saw it first, in layer 0's output; at step 2 hookcli's
    hook fails on rank 1 alone: both ranks stop there (rank 1 with its own error), neither hangs."""
    ranks = torchrun("faults", tmp_path)
    lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    desync = [(f["rule"], f["layer"], f["value"]) for f in lines[0]["findings"]]
    assert desync == [("replica_desync", "2.weight", 1.0)]
    assert "rank 1" in lines[0]["findings"][0]["message"]
    found = [f for f in lines[1]["findings"] if f["rule"] == "nonfinite_rank"]
    assert len(found) == 1 and found[0]["value"] == 1 and found[0]["layer"] == "0"
    assert "rank 1" in found[0]["message"]
    assert lines[1]["layers"][0]["stats"]["nan_count"] == 5  # one NaN input value x 5 outputs
    assert ranks[0]["records"] == ranks[1]["records"] == lines and len(lines) == 2
    assert ranks[0]["findings"] == ranks[1]["findings"]
    # at step 2 every rank's watch stops, said once (never raised into the loop): rank 1 with its own error
    [message0], [message1] = ranks[0]["errors"], ranks[1]["errors"]
    assert message0.startswith("hookcli.watch stopped at step 2: the run failed on 1 of 2 ranks"), message0
    assert message1.startswith("hookcli.watch stopped at step 2: internal error: ") and "cannot be detached" in message1
    # what this step does not reduce is refused when the watch is made, with exit code 2
    refused = [json.loads((tmp_path / f"refused{r}.json").read_text()) for r in range(WORLD)]
    assert refused[0] == refused[1]
    [(error, code, message)] = refused[0]
    assert (error, code) == ("UnsupportedError", 2)
    assert "parameter weight" in message and "2-D mesh" in message


@settings(max_examples=60, deadline=None)
@given(parts=st.lists(st.integers(0, 50), min_size=2, max_size=4), offset=st.sampled_from([0.0, 1e3, 1e6, -1e8]),
       seed=st.integers(0, 2**16))
def test_the_two_sums_give_the_moments_of_all_ranks_values(parts: list[int], offset: float, seed: int) -> None:
    """What the first two SUMs compute, without processes: each part's ``Moments`` (as a rank reduces
    its values), the global mean from the summed ``count`` and ``count * mean``, then the summed
    ``centred_about`` it; against torch in float64 over the concatenation, offsets included (data
    far from 0 loses no digits: no power sums about 0), and empty parts (a rank that ran nothing)."""
    g = torch.Generator().manual_seed(seed)
    values = [offset + torch.randn(n, generator=g, dtype=torch.float64) for n in parts]
    assume(sum(parts) > 1)
    moments = [stats.as_moments(stats.reduce_tensor(v)) if v.numel() else stats.EMPTY for v in values]
    count = sum(m.count for m in moments)
    mean = sum(m.count * m.mean for m in moments if m.count) / count
    m2, m3, m4 = (sum(column) for column in zip(*(rank_stats.centred_about(m, mean) for m in moments)))
    everything = torch.cat(values)
    centred = everything - everything.mean()
    assert count == everything.numel()
    assert mean == pytest.approx(everything.mean().item(), rel=1e-12, abs=1e-12)
    # float64 data at 1e8 resolves its spread to ~2e-8 (eps * offset / std); power sums about 0 would
    # keep no digit of m2 there (x^2 ~ 1e16 against a spread of ~1)
    assert m2 == pytest.approx((centred ** 2).sum().item(), rel=1e-6)
    assert m4 == pytest.approx((centred ** 4).sum().item(), rel=1e-6)
    assert m3 == pytest.approx((centred ** 3).sum().item(), rel=1e-6, abs=1e-6 * m2 ** 1.5)


def _rank_one(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank_one{rank}.json").read_text()) for rank in range(WORLD)]


def test_a_nan_made_on_rank_one_only_is_named_on_every_rank(launched: Any) -> None:
    """DDP on 2 ranks, the NaN made in ``1``'s own forward at step 2 on rank 1 only, every step logged.
    Plain torch (the worker's own forward hooks on an unwatched run): on rank 1 the first non-finite
    output is ``1``'s at step 2, its children's finite; on rank 0 nothing is until step 3 (the averaged
    gradient's NaN in the weights), first in ``0``'s output. Every rank's watch names rank 1's maker at
    step 2, and ``nonfinite_rank`` says rank 1."""
    ranks = _rank_one(launched("cause"))
    assert ranks[1]["plain"][0] == [2, "1"]
    assert ranks[0]["plain"][0] == [3, "0"]
    for said in ranks:
        findings = [(f["rule"], f["step"], f["layer"], f["direction"]) for f in said["logged"]]
        assert sorted(findings) == [("nonfinite", 2, "1", "forward"), ("nonfinite_rank", 2, "0", "backward")]
        nonfinite = next(f for f in said["logged"] if f["rule"] == "nonfinite")
        assert nonfinite["message"].startswith("first NaN/Inf of the run at step 2: made in 1's own forward "
                                               "(after 1.act); first seen in 2's output")
        assert next(f for f in said["logged"] if f["rule"] == "nonfinite_rank")["message"].startswith(
            "NaN/Inf first seen on rank 1")


def test_a_nan_made_on_rank_one_only_is_named_by_rank_one_with_the_flight_recorder(launched: Any) -> None:
    """The same run unlogged (``every=50, flight=4``): rank 1, where the NaN is made, names it at step 2."""
    rank1 = _rank_one(launched("cause"))[1]
    assert [(f["rule"], f["step"], f["layer"], f["direction"]) for f in rank1["flight"]] == [
        ("nonfinite", 2, "1", "forward")]
    assert rank1["flight"][0]["message"].startswith("first NaN/Inf of the run at step 2: made in 1's own forward")


def test_under_torchrun_every_rank_s_flight_recorder_names_the_run_s_first_nan(launched: Any) -> None:
    """The same run unlogged (``every=50, flight=4``): rank 0's own forward stays finite until the averaged
    gradient's NaN reaches its weights, yet every rank's flight recorder names the run's first NaN/Inf,
    the earliest (step, rank) of plain torch's first non-finite output over the ranks, by the same maker,
    step and rank (the ranks agree where they meet: here at the block's end)."""
    ranks = _rank_one(launched("cause"))
    step, rank, layer = min((said["plain"][0][0], r, said["plain"][0][1]) for r, said in enumerate(ranks))
    assert (step, rank) == (2, 1)  # (not rank 0's first: its NaN comes a step later, from rank 1)
    messages = set()
    for said in ranks:
        assert [(f["rule"], f["step"], f["layer"], f["direction"]) for f in said["flight"]] == [
            ("nonfinite", step, layer, "forward")]
        messages.add(said["flight"][0]["message"])
    assert len(messages) == 1
    assert messages.pop().startswith(f"first NaN/Inf of the run at step {step}: made in {layer}'s own forward "
                                     f"(after {layer}.act) on rank {rank}; first seen in 2's output")


def test_the_flight_recorders_agree_at_the_next_logged_step(launched: Any) -> None:
    """The same run with ``every=3, flight=2``: the ranks agree at logged step 3 (rank 1's flag rides in the
    step's first SUM), and every rank's flight line names the earliest (step, rank) of plain torch's
    first non-finite outputs, by its maker and rank; step 3's record (NaN on every rank by then, first in
    rank 0's ``0`` output) says no ``nonfinite_rank``: the flight line named the rank of the run's first."""
    ranks = _rank_one(launched("cause"))
    step, rank, layer = min((said["plain"][0][0], r, said["plain"][0][1]) for r, said in enumerate(ranks))
    assert all(said["plain"][0][0] <= 3 for said in ranks)  # (every rank's output is NaN by logged step 3)
    for said in ranks:
        nonfinite = said["flight_logged"]
        assert [(f["rule"], f["step"], f["layer"], f["direction"]) for f in nonfinite] == [
            ("nonfinite", step, layer, "forward")]
        assert nonfinite[0]["message"].startswith(f"first NaN/Inf of the run at step {step}: made in {layer}'s own "
                                                  f"forward (after {layer}.act) on rank {rank}; first seen in 2's")


def test_the_flight_recorders_agreement_costs_collectives_only_where_the_ranks_meet(launched: Any) -> None:
    """Counted by the process group's own sequence number (DDP's included) against the unwatched run's:
    an unlogged step adds none; a logged step adds what it adds without the flight recorder, except the
    one where the ranks agree (one MIN, one ``all_gather_object``: 3); the watch's end adds the vote (1),
    then the gather when the NaN was not agreed on before (2), nothing once it was."""
    for said in _rank_one(launched("cause")):
        counts = said["collectives"]
        plain, logged = counts["plain"], counts["logged"]
        assert plain[-1] == logged[-1] == 0
        assert [a - p for a, p in zip(counts["flight"], plain)] == [logged[0] - plain[0], 0, 0, 0, 0, 1 + 2]
        extra = [a - p for a, p in zip(counts["flight_logged"], plain)]
        assert extra == [logged[0] - plain[0], 0, 0, logged[3] - plain[3] + 3, 0, 0]


def test_replicas_are_compared_by_value() -> None:
    """``_same`` compares copies by value, NaN equal to NaN, at ``DESYNC_RTOL``."""
    assert rank_stats._same([1.0, math.nan], [1.0, math.nan])
    assert not rank_stats._same([1.0], [1.0 + 1e-6])


def test_the_maker_of_a_nan_is_named_under_torchrun(launched: Any) -> None:
    """DDP on 2 ranks, every step logged: the NaN that ``1``'s own forward makes at step 2 (its Linear and
    Tanh finite, plain torch: the block's children's outputs stay finite) is named by its maker on every
    rank, as in one process (the engine's ``nonfinite_rank``, which rank saw it, aside)."""
    tmp_path = launched("cause")
    torch.manual_seed(0)
    block = worker.MaskedBlock()
    x = torch.randn(4, 5)
    for _ in range(3):
        out = block(x)
    assert torch.isfinite(block.act(block.lin(x))).all() and not torch.isfinite(out).all()
    for rank in range(WORLD):
        findings = [f for f in json.loads((tmp_path / f"cause{rank}.json").read_text()) if f["rule"] == "nonfinite"]
        assert [(f["rule"], f["step"], f["layer"], f["direction"]) for f in findings] == [
            ("nonfinite", 2, "1", "forward")]
        assert findings[0]["message"].startswith(
            "first NaN/Inf of the run at step 2: made in 1's own forward (after 1.act); first seen in 2's output")
