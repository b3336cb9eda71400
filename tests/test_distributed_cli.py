"""The command line under torchrun, and ``--shard ddp|fsdp2|tp`` (docs/distributed.md "The CLI under
torchrun"): each sharded run's JSON report against a one-process CliRunner run of the same command,
the layers' numbers against plain torch, the materialised weights against a one-process build, and
the errors (one exit code on every rank, no report, one message).

Eight torchrun launches of 2 ranks (gloo, CPU): one of tests/distributed_cli_worker.py (the weights of
all three kinds) and seven of ``python -m hookcli``.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import sharded_models  # noqa: E402
from torchrun_launch import NEEDS_GLOO, launch, torchrun_env  # noqa: E402
from timeouts import scaled_timeout

pytestmark = NEEDS_GLOO
WORLD = 2
REL = 1e-5
MODELS = Path(sharded_models.__file__)
MODEL = f"{MODELS}:build"
#: 5 samples on 2 ranks: slices of 3 and 2 (uneven)
BATCH = 5


def hookcli_torchrun(*args: str) -> Any:
    return launch(["-m", "hookcli", *args], WORLD)


def close(one: Any, sharded: Any, path: str = "$") -> None:
    """``sharded`` equals ``one``: the same keys, lists, strings and counts, floats within ``REL``."""
    if isinstance(one, float) or isinstance(sharded, float):
        assert one is not None and sharded is not None, path
        if math.isnan(one):
            assert math.isnan(sharded), path
        else:
            assert math.isclose(one, sharded, rel_tol=REL, abs_tol=1e-7), (path, one, sharded)
    elif isinstance(one, dict):
        assert one.keys() == sharded.keys(), (path, one.keys() ^ sharded.keys())
        for key in one:
            close(one[key], sharded[key], f"{path}.{key}")
    elif isinstance(one, list):
        assert len(one) == len(sharded), path
        for i, (a, b) in enumerate(zip(one, sharded)):
            close(a, b, f"{path}[{i}]")
    else:
        assert one == sharded, (path, one, sharded)


def one_process(cli: Any, tmp_path: Path, *args: str, command: str = "stats") -> dict[str, Any]:
    out = tmp_path / "one.json"
    result = cli(command, MODEL, *args, "-o", out)
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def same_report(one: dict[str, Any], sharded: dict[str, Any], kind: str) -> None:
    """The sharded report is the one-process report, plus a note saying it was sharded (and under tp
    each layer's placement: every output whole on every rank, as the plan gathers each split Linear's)."""
    assert any(f"sharded over {WORLD} ranks (--shard {kind}" in note for note in sharded["notes"])
    if kind == "tp":
        assert [row.pop("placement") for row in sharded["layers"]] == ["replicated"] * len(sharded["layers"])
    close({k: v for k, v in one.items() if k != "notes"}, {k: v for k, v in sharded.items() if k != "notes"})


@pytest.mark.parametrize("kind", ["fsdp2", "tp"])
def test_sharded_stats_equal_one_process_and_plain_torch(cli: Any, tmp_path: Path, kind: str) -> None:
    """fsdp2 (uneven shards, uneven batch slices: 5 samples as 3 + 2) and tp (every Linear whose width
    divides by 2 split, the whole batch on every rank), from an input file: the report of one process,
    and each layer's statistics those of plain torch's forward of the model hookcli builds."""
    x = torch.randn(BATCH, 6, generator=torch.Generator().manual_seed(7))
    torch.save(x, tmp_path / "x.pt")
    out = tmp_path / f"{kind}.json"
    done = hookcli_torchrun("stats", MODEL, "--input", str(tmp_path / "x.pt"), "--shard", kind, "-o", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == ""  # the report went to the file, written once (by rank 0)
    assert done.stderr.count(f"wrote {out}") == 1
    sharded = json.loads(out.read_text())
    same_report(one_process(cli, tmp_path, "--input", tmp_path / "x.pt"), sharded, kind)

    torch.manual_seed(0)  # hookcli builds the model seeded with --seed (0), in eval mode
    net = sharded_models.build().eval()
    outputs: dict[str, torch.Tensor] = {}
    for name, module in net.named_children():
        module.register_forward_hook(lambda m, i, o, name=name: outputs.__setitem__(name, o.detach().double()))
    with torch.no_grad():
        net(x)
    rows = {row["name"]: row for row in sharded["layers"]}
    assert set(rows) == set(outputs)
    for name, t in outputs.items():
        stats = rows[name]["stats"]
        assert rows[name]["shape"] == list(t.shape)
        for key, value in (("mean", t.mean()), ("std", t.std(correction=0)), ("min", t.min()), ("max", t.max()),
                           ("norm", t.norm())):
            assert math.isclose(stats[key], value.item(), rel_tol=REL, abs_tol=1e-7), (name, key)


def test_sharded_ddp_data_equals_one_process(cli: Any, tmp_path: Path) -> None:
    """ddp over ``--data`` (7 samples in batches of 3, 3 and 1: each batch sliced over the ranks, rank 1's
    slice of the last one empty), JSON on stdout printed once (rank 0's), nothing on stderr: the
    report of one process over the same batches, its sample count included."""
    torch.save(torch.randn(7, 6, generator=torch.Generator().manual_seed(3)), tmp_path / "data.pt")
    args = ("--data", str(tmp_path / "data.pt"), "--batch-size", "3")
    done = hookcli_torchrun("stats", MODEL, *args, "--shard", "ddp", "-f", "json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr == ""
    sharded = json.loads(done.stdout)
    assert sharded["inputs"][0]["source"].endswith("3 batches, 7 samples")
    same_report(one_process(cli, tmp_path, *args), sharded, "ddp")


def test_sharded_tp_grads_equal_one_process(cli: Any, tmp_path: Path) -> None:
    """grads under tp (every rank the whole batch, the same loss): each layer's output gradient and each
    parameter's gradient (its shards merged, never gathered) and norm, and the loss, are one process's;
    the parameters' gradients also against torch.autograd.grad."""
    done = hookcli_torchrun("grads", MODEL, "--input-shape", f"{BATCH}x6", "--params", "all", "--shard", "tp",
                            "-f", "json")
    assert done.returncode == 0, done.stderr[-3000:]
    sharded = json.loads(done.stdout)
    one = one_process(cli, tmp_path, "--input-shape", f"{BATCH}x6", "--params", "all", command="grads")
    rows = {row["name"]: row for row in sharded["params"]}
    same_report(one, sharded, "tp")

    torch.manual_seed(0)
    net = sharded_models.build().eval()
    x = torch.randn(BATCH, 6, generator=torch.Generator().manual_seed(0))  # hookcli's dummy: randn(seed=0)
    assert one["inputs"][0]["source"] == "randn(seed=0)"
    loss = torch.nn.functional.cross_entropy(net(x), torch.zeros(BATCH, dtype=torch.long))
    assert math.isclose(sharded["loss"]["value"], loss.item(), rel_tol=REL)
    names, params = zip(*net.named_parameters())
    for name, g in zip(names, torch.autograd.grad(loss, params)):
        assert math.isclose(rows[name]["grad"]["norm"], g.double().norm().item(), rel_tol=REL), name


def test_materialised_weights_equal_a_one_process_build(tmp_path: Path) -> None:
    """Every parameter and buffer (BatchNorm's running statistics, a non-persistent buffer) of the model
    ``--shard ddp|fsdp2|tp`` materialises, gathered from every rank, equals the one-process build with
    the same seed, exactly; tied weights stay tied (ddp) or are refused (fsdp2, tp)."""
    # a hang (a rank left waiting in rank 0's broadcast for the group's 30 minutes) ends in TimeoutExpired
    done = launch([str(Path(__file__).with_name("distributed_cli_worker.py")), str(tmp_path)], WORLD, timeout=scaled_timeout(150))
    assert done.returncode == 0, done.stderr[-3000:]
    torch.manual_seed(0)
    net = sharded_models.build()
    expected = {**dict(net.named_parameters()), **dict(net.named_buffers())}
    torch.manual_seed(0)
    reads = sharded_models.reads_values()  # cannot be built on meta: built on each host, then sharded (fsdp2)
    for kind, want_from in (("ddp", expected), ("fsdp2", expected), ("tp", expected),
                            ("reads_values", {**dict(reads.named_parameters()), **dict(reads.named_buffers())})):
        got = torch.load(tmp_path / f"{kind}.pt")
        assert got.keys() == want_from.keys(), kind
        for name, want in want_from.items():
            for rank in range(WORLD):
                assert torch.equal(got[name][rank], want.detach()), (kind, name, rank)
    # tied weights (an embedding and its output head): ddp keeps them one parameter, whose gradient is
    # that of both uses (plain torch's); fsdp2 and tp, whose plans would untie them, refuse (exit 2)
    tied = json.loads((tmp_path / "tied.json").read_text())
    torch.manual_seed(0)
    net = sharded_models.tied()
    (grad,) = torch.autograd.grad(net(torch.tensor([[1, 2, 3, 4], [5, 6, 0, 1]])).square().mean(), [net.emb.weight])
    assert tied["ddp"]["same"] and tied["ddp"]["params"] == 1
    assert torch.allclose(torch.tensor(tied["ddp"]["grad"]), grad, rtol=REL, atol=0)
    assert tied["fsdp2"] == tied["tp"] == ["UnsupportedError", 2]
    # a build that fails on one rank alone (rank 0's full build on the host; rank 1's on meta): that rank
    # raises its own error, the other RanksFailed (exit 2), before any rank waits in the broadcast
    failures = [json.loads((tmp_path / f"failures{rank}.json").read_text()) for rank in range(WORLD)]
    for name, failing, words in (("host_fails", 0, "host-fails: out of host memory"),
                                 ("rank1_fails", 1, "rank1-fails: no model here")):
        for kind in ("fsdp2", "ddp"):
            own, other = failures[failing][f"{name} {kind}"], failures[1 - failing][f"{name} {kind}"]
            assert own[1] == 2 and own[0] != "RanksFailed" and words in own[2], own
            assert other[:2] == ["RanksFailed", 2] and other[2].startswith(
                f"--shard {kind}: building or sharding the model failed on 1 of {WORLD} ranks (rank {failing}: ") \
                and words in other[2], other  # the failed rank's reason, said on every rank
    # --shard tp of a transformer layer: the output of one process (before: its attention raised, a
    # DTensor out_proj weight meeting plain inputs, exit 1, for a model that runs in one process)
    torch.manual_seed(0)
    with torch.no_grad():
        want = sharded_models.attention()(torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0)))
    assert torch.allclose(torch.load(tmp_path / "attention.pt"), want, rtol=REL, atol=1e-6)
    # grads over --data whose last batch (1 sample) leaves rank 1 an empty slice: refused on every rank
    # before that batch runs (before: rank 1's loss raised while rank 0 waited in DDP's all-reduce: a hang)
    for rank in range(WORLD):
        name, code, message = failures[rank]["empty slice"]
        assert (name, code) == ("UsageError", 2) and message.startswith("grads --shard ddp: batch 1: a batch of 1 "), \
            message


def test_a_rank_that_fails_stops_every_rank_with_one_exit_code() -> None:
    """The model raising on rank 1 only (its slice of 2 samples is too small for it): every rank exits
    1 (rank 0 with RanksFailed, agreed to rank 1's code), no report, rank 1's error said once, with
    its hint, no traceback of hookcli's; nobody hangs. torchrun polls its ranks every 5 s here, so
    that both have ended (neither is stopped by torchrun's SIGTERM) when it reads their exit codes."""
    done = launch(["--monitor-interval", "5", "-m", "hookcli", "stats", f"{MODELS}:picky", "--input-shape",
                   f"{BATCH}x6", "--shard", "ddp", "-f", "json"], WORLD)
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stdout == ""
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert sum("rank 1:" in line and "picky: needs 3 samples, got 2" in line for line in errors) == 1, errors
    assert all("rank 1:" in line or "rank 0:" in line and "failed on 1 of 2 ranks" in line for line in errors), errors
    assert str(Path(__file__).parents[1] / "hookcli") not in done.stderr  # no traceback through hookcli
    codes = dict(re.findall(r"rank\s*: (\d+) \(local_rank.*?exitcode\s*: (-?\d+)", done.stderr, re.DOTALL))
    assert codes == {"0": "1", "1": "1"}, (codes, done.stderr[-3000:])  # torchrun's table of the ranks' exit codes


def test_a_rank_that_fails_in_a_sharded_model_leaves_no_rank_hanging() -> None:
    """``--shard fsdp2``: the model raising on rank 1 only (before its sharded Linear) leaves rank 0
    waiting in FSDP2's all-gather of that Linear, a collective hookcli's would never match. Rank 1
    enters none (no merge, no exit-code agreement, no barrier): it says its own error and exits 1, which
    ends the run (torchrun stops rank 0, or rank 0's all-gather fails as rank 1's connection closes).
    Before, every rank hung until the process group's timeout."""
    done = launch(["-m", "hookcli", "grads", f"{MODELS}:picky", "--input-shape", f"{BATCH}x6", "--shard", "fsdp2",
                   "-f", "json"], WORLD, timeout=scaled_timeout(150))
    assert done.returncode == 1, done.stderr[-3000:]
    # rank 0, when its all-gather failed first (the model raised there), shows its rows so far, as partial,
    # saying they are its own part's (not "over all 1 ranks")
    if done.stdout:
        partial = json.loads(done.stdout)
        assert partial["partial"] is True and any("this rank's own part only" in n for n in partial["notes"]), \
            partial["notes"]
        assert not any("one process over the whole batch" in n for n in partial["notes"]), partial["notes"]
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    own = ("Error: rank 1: the model raised in forward at (model) (FSDPPicky) with input shape(s) 2x6: ValueError: "
           "picky: needs 3 samples, got 2")
    assert errors.count(own) == 1, errors
    # rank 0: stopped by torchrun, or (when the machine is busy) first its all-gather fails as rank 1 goes
    assert all(line.startswith("Error: rank 0: the model raised in forward at fc ") for line in errors if line != own)
    assert str(Path(__file__).parents[1] / "hookcli") not in done.stderr  # no traceback through hookcli
    codes = dict(re.findall(r"rank\s*: (\d+) \(local_rank.*?exitcode\s*: (-?\d+)", done.stderr, re.DOTALL))
    assert codes.get("1") == "1" and codes.get("0") in ("1", "143", "-15"), (codes, done.stderr[-3000:])


def test_a_rank_that_left_the_group_says_its_rows_are_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank whose run failed in a model with collectives of its own leaves the group (``desert``): the
    partial report it shows holds its own rows, unmerged, and its note says so (before: "statistics
    over all 1 ranks of the process group", as the group it left counts as none)."""
    from hookcli.engine import distributed

    monkeypatch.setattr(distributed, "_deserted", True)
    for tp in (None, [[0, 1]]):
        note = distributed.ranks_note(tp)
        assert note.startswith("statistics of this rank's own part only") and "all 1 ranks" not in note, note


def test_a_rank_that_left_the_group_keeps_only_the_note_that_is_true(monkeypatch: pytest.MonkeyPatch) -> None:
    """A --shard run's report says "the report is that of one process over the whole batch"; on a rank that
    left the group its rows are its own part's, and it said both. Now only the own-part note stays there,
    and a rank still in the group keeps both its notes."""
    from hookcli.engine import distributed
    from hookcli.engine.run import SHARD_NOTE, note_ranks
    from hookcli.records import ModelInfo, Report

    def report() -> Report:
        made = Report(command="stats", model=ModelInfo(spec="m", source="python", class_name="M", params=0,
                                                       trainable_params=0, param_bytes=0, buffer_bytes=0))
        made.notes += ["an earlier note", SHARD_NOTE.format(ranks=2, shard="ddp")]
        return made

    kept = report()
    note_ranks(kept, None)
    assert kept.notes[:2] == report().notes and len(kept.notes) == 3 and "own part only" not in kept.notes[2]
    monkeypatch.setattr(distributed, "_deserted", True)
    for tp in (None, [[0, 1]]):
        left = report()
        note_ranks(left, tp)
        assert left.notes[0] == "an earlier note" and len(left.notes) == 2, left.notes
        assert left.notes[1].startswith("statistics of this rank's own part only"), left.notes
        assert not any("one process over the whole batch" in note for note in left.notes)


def test_a_batch_that_leaves_a_rank_no_sample_is_refused_by_grads() -> None:
    """``grads --shard ddp`` with a batch of 1 on 2 ranks: rank 1's slice is empty, its loss would raise
    while rank 0 waits in a collective (before: every rank hung). Every rank refuses it before running:
    exit 2, one message from rank 0 with its hint."""
    done = launch(["-m", "hookcli", "grads", MODEL, "--input-shape", "1x6", "--shard", "ddp"], WORLD, timeout=scaled_timeout(150))
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stdout == ""
    lines = [line for line in done.stderr.splitlines() if line.startswith(("Error:", "  hint:"))]
    assert len(lines) == 2 and lines[0].startswith("Error: rank 0: grads --shard ddp: a batch of 1 sample(s)"), lines
    assert "empty slice" in lines[0] and lines[1].startswith("  hint:"), lines
    codes = dict(re.findall(r"rank\s*: (\d+) \(local_rank.*?exitcode\s*: (-?\d+)", done.stderr, re.DOTALL))
    assert codes == {"0": "2", "1": "2"}, (codes, done.stderr[-3000:])


def test_shard_outside_torchrun_and_bad_values_are_usage_errors(cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--shard`` without torchrun's environment, or an unknown kind: exit 2, one Error line and a hint,
    nothing on stdout."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for args, words in ((["--shard", "fsdp2"], "runs under torchrun only"), (["--shard", "zero3"], "'zero3'")):
        result = cli("stats", MODEL, "--input-shape", "2x6", *args)
        assert result.exit_code == 2
        assert result.stdout == ""
        lines = result.stderr.splitlines()
        assert len(lines) == 2 and lines[0].startswith("Error:") and words in lines[0], lines
        assert lines[1].startswith("  hint:")


def test_shard_from_a_config_is_checked_like_the_flag(cli: Any, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``shard = "fsdp2"`` in a config sets ``--shard`` (refused outside torchrun, as the flag is); a bad
    value names the config key."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text('shard = "fsdp2"\n')
    bad.write_text('shard = "zero3"\n')
    result = cli("stats", MODEL, "--input-shape", "2x6", "--config", good)
    assert result.exit_code == 2 and "--shard fsdp2 runs under torchrun only" in result.stderr
    result = cli("stats", MODEL, "--input-shape", "2x6", "--config", bad)
    assert result.exit_code == 2 and "shard" in result.stderr.splitlines()[0]


@pytest.mark.parametrize("rank", [0, 1])
def test_under_torchrun_only_rank_0_prints_and_one_process_commands_refuse(
        cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    """Under torchrun's environment, ``shapes`` (no process group) runs on every rank and rank 0 alone
    prints it or writes ``-o``; ``diff``, ``features`` and ``fmaps`` refuse (exit 2 on every rank), said
    by rank 0 only; so is a bad option (every rank parsed the same line)."""
    torchrun_env(monkeypatch, rank)
    out = tmp_path / "shapes.json"
    result = cli("shapes", MODEL, "--input-shape", "2x6", "-o", out)
    assert result.exit_code == 0
    assert out.exists() == (rank == 0)
    assert result.stderr == (f"wrote {out}\n" if rank == 0 else "")
    result = cli("shapes", MODEL, "--input-shape", "2x6", "-f", "json")
    assert result.exit_code == 0
    if rank == 0:
        assert [row["name"] for row in json.loads(result.stdout)["layers"]][0] == "fc1"
    else:
        assert result.stdout == ""
    for args in (["diff", MODEL, "--vs-dtype", "float64"], ["features", MODEL, "-o", tmp_path / "f.safetensors"],
                 ["fmaps", MODEL, "--layer", "fc1", "-o", tmp_path / "f.png"], ["stats", MODEL, "--shard", "zero3"]):
        result = cli(*args)
        assert result.exit_code == 2, (args, result.output)
        assert result.stdout == ""
        if rank == 0:
            lines = result.stderr.splitlines()
            assert len(lines) == 2 and lines[0].startswith("Error:") and lines[1].startswith("  hint:"), lines
        else:
            assert result.stderr == ""
    assert not (tmp_path / "f.safetensors").exists() and not (tmp_path / "f.png").exists()


def test_the_cli_opens_and_closes_its_process_group_and_bad_devices_are_usage_errors(
        cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's environment for one rank (WORLD_SIZE 1, in this process): ``stats`` opens the default
    process group (gloo) and destroys it after, also when it fails; a device that is no device, or a
    GPU this rank does not have, is exit 2 with one message (never an internal error)."""
    from torchrun_launch import free_port

    torchrun_env(monkeypatch, 0)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    out = tmp_path / "one.json"
    assert cli("stats", MODEL, "--input-shape", "2x6", "-o", out).exit_code == 0
    assert out.exists() and not torch.distributed.is_initialized()
    devices = ["potato"] + (["cuda"] if torch.cuda.device_count() == 0 else [])
    for device in devices:
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        result = cli("stats", MODEL, "--input-shape", "2x6", "--device", device)
        assert result.exit_code == 2, result.output
        assert result.stdout == ""
        assert result.stderr.startswith("Error: rank 0: ") and len(result.stderr.splitlines()) == 2, result.stderr
        assert not torch.distributed.is_initialized()
