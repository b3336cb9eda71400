"""Nothing of the user's is lost by writing an output (issue 11, section 2, the file bullets).

- FIFOs and devices are written in place (never replaced by a regular file), symlinks are followed
  (the link stays a link), read-only files are refused with exit 2 and a hint;
- a failed run leaves ``-o FILE`` as it was and prints its partial report, marked partial, on stdout;
- SIGTERM/SIGINT in the middle of a run or of a write leave no temporary file and the old file intact;
- a full disk is one line, exit 2, a hint, and no temporary file.

Devices: as root the tests make their own null/full device nodes (``mknod``) so that a bug cannot
replace the machine's ``/dev/null``; otherwise they use ``/dev/null`` and ``/dev/full``, which a user
cannot replace anyway.
"""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from reference import dummy
import tiny_models as tm
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hookcli
from hookcli.errors import OutputError
from hookcli.output import atomic_path, ensure_writable, open_output, resolve_target, write_atomic
from timeouts import scaled_timeout

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
POSIX = os.name == "posix"

pytestmark = pytest.mark.skipif(not POSIX, reason="FIFOs, devices and signals are POSIX")


def leftovers(directory: Path) -> list[str]:
    """Temporary files hookcli could have left (``.<name>.XXXX.tmp``, safetensors' ``.tmpXXXX``)."""
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp") or p.name.startswith(".tmp"))


# --------------------------------------------------------------------------- devices and FIFOs


def _device(tmp_path: Path, name: str, minor: int, real: str) -> Path:
    """A character device like ``real`` (1, minor): our own node as root, else the real one."""
    if IS_ROOT and hasattr(os, "mknod"):
        node = tmp_path / name
        try:
            os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, minor))
            node.chmod(0o666)
            os.close(os.open(node, os.O_WRONLY))  # a nodev mount would refuse to open it
        except OSError:
            node.unlink(missing_ok=True)
        else:
            return node
    if not IS_ROOT and os.path.exists(real):
        return Path(real)  # a user cannot replace /dev entries, whatever hookcli does
    pytest.skip(f"no device like {real} to write to")


def assert_device(path: Path, minor: int) -> None:
    st_ = os.stat(path)
    assert stat.S_ISCHR(st_.st_mode), f"{path} is no longer a character device"
    assert st_.st_rdev == os.makedev(1, minor)


@pytest.fixture
def null_device(tmp_path: Path) -> Path:
    return _device(tmp_path, "null", 3, "/dev/null")


@pytest.fixture
def full_device(tmp_path: Path) -> Path:
    return _device(tmp_path, "full", 7, "/dev/full")


class PipeReader:
    """A FIFO at ``path`` and a thread reading everything written into it."""

    def __init__(self, path: Path) -> None:
        os.mkfifo(path)
        self.path = path
        self.data: bytes | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with open(self.path, "rb") as fh:
            self.data = fh.read()

    def result(self, timeout: float = 120) -> bytes:
        self._thread.join(scaled_timeout(timeout))
        assert not self._thread.is_alive(), "nothing was written into the FIFO"
        assert self.data is not None
        return self.data

    def close(self) -> None:
        """Unblock the reader if nothing ever opened the FIFO for writing."""
        if self._thread.is_alive():
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                return
            os.close(fd)
            self._thread.join(scaled_timeout(5))


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[PipeReader]:
    reader = PipeReader(tmp_path / "pipe")
    yield reader
    reader.close()


def assert_fifo(path: Path) -> None:
    assert stat.S_ISFIFO(os.lstat(path).st_mode), f"{path} is no longer a FIFO"


# --------------------------------------------------------------------------- the library


def test_null_device_is_written_in_place(tmp_path: Path, null_device: Path) -> None:
    assert resolve_target(null_device).in_place
    assert write_atomic(null_device, "report\n") == null_device.absolute()
    write_atomic(null_device, b"\x00" * 100_000)
    assert_device(null_device, 3)
    assert leftovers(null_device.parent) == []


def test_fifo_gets_the_bytes_and_stays_a_fifo(fifo: PipeReader) -> None:
    payload = os.urandom(300_000)  # more than a pipe buffer: the reader must drain while we write
    write_atomic(fifo.path, payload)
    assert fifo.result() == payload
    assert_fifo(fifo.path)
    assert leftovers(fifo.path.parent) == []


@pytest.mark.skipif(not os.path.isdir("/dev/fd"), reason="no /dev/fd")
def test_descriptor_paths_are_written_in_place(tmp_path: Path) -> None:
    """``-o /dev/stdout`` (here ``/dev/fd/N``): into the open pipe or file, never renamed over."""
    r, w = os.pipe()
    try:
        write_atomic(f"/dev/fd/{w}", "into the pipe")
        os.close(w)
        w = -1
        assert os.read(r, 100) == b"into the pipe"
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    log = tmp_path / "log.txt"
    log.write_text("old and longer")
    with open(log, "ab") as fh:  # a shell's `> log.txt`: the file stays the same file
        inode = os.fstat(fh.fileno()).st_ino
        write_atomic(f"/dev/fd/{fh.fileno()}", "new")
    assert log.read_text() == "new" and log.stat().st_ino == inode and leftovers(tmp_path) == []


def test_reader_closing_the_fifo_early_is_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "pipe"
    os.mkfifo(path)

    def read_one_byte() -> None:
        with open(path, "rb") as fh:
            fh.read(1)

    thread = threading.Thread(target=read_one_byte, daemon=True)
    thread.start()
    with pytest.raises(OutputError, match="the reader closed the pipe") as info:
        write_atomic(path, b"x" * 10_000_000)
    thread.join(scaled_timeout(10))
    assert info.value.exit_code == 2 and info.value.hint
    assert_fifo(path) and leftovers(tmp_path) == []


def test_full_device_is_no_space_exit_2_with_hint(full_device: Path) -> None:
    with pytest.raises(OutputError, match="no space left on device") as info:
        write_atomic(full_device, "x" * 10_000)
    assert info.value.exit_code == 2 and info.value.hint
    assert_device(full_device, 7)
    assert leftovers(full_device.parent) == []


def test_symlink_chain_and_relative_links_are_followed(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    real = tmp_path / "sub" / "real.json"
    real.write_text("old")
    real.chmod(0o640)
    (tmp_path / "b").symlink_to("sub/real.json")  # relative
    (tmp_path / "a").symlink_to("b")  # a chain: a -> b -> sub/real.json
    assert write_atomic(tmp_path / "a", "new") == real
    assert real.read_text() == "new" and stat.S_IMODE(real.stat().st_mode) == 0o640
    assert os.readlink(tmp_path / "a") == "b" and os.readlink(tmp_path / "b") == "sub/real.json"
    assert leftovers(tmp_path) == [] and leftovers(tmp_path / "sub") == []


def test_dangling_symlink_creates_its_target(tmp_path: Path) -> None:
    link = tmp_path / "latest.json"
    link.symlink_to("runs/1.json")
    (tmp_path / "runs").mkdir()
    write_atomic(link, "new")
    assert link.is_symlink() and (tmp_path / "runs" / "1.json").read_text() == "new"
    (tmp_path / "gone").symlink_to("missing/x.json")  # missing directories are created, as for -o
    write_atomic(tmp_path / "gone", "x")
    assert (tmp_path / "gone").is_symlink() and (tmp_path / "missing" / "x.json").read_text() == "x"


def test_symlink_to_a_fifo_or_device_writes_in_place(tmp_path: Path, fifo: PipeReader,
                                                     null_device: Path) -> None:
    (tmp_path / "to_pipe").symlink_to(fifo.path)
    write_atomic(tmp_path / "to_pipe", "through the link")
    assert fifo.result() == b"through the link"
    assert_fifo(fifo.path) and (tmp_path / "to_pipe").is_symlink()
    (tmp_path / "to_null").symlink_to(null_device)
    write_atomic(tmp_path / "to_null", "x")
    assert_device(null_device, 3)
    assert (tmp_path / "to_null").is_symlink()


def test_symlink_loop_is_exit_2(tmp_path: Path) -> None:
    (tmp_path / "x").symlink_to("y")
    (tmp_path / "y").symlink_to("x")
    with pytest.raises(OutputError, match="symlink") as info:
        ensure_writable(tmp_path / "x")
    assert info.value.exit_code == 2 and info.value.hint


def test_read_only_file_is_refused_even_as_root(tmp_path: Path) -> None:
    target = tmp_path / "keep.json"
    target.write_text("precious")
    target.chmod(0o444)
    with pytest.raises(OutputError, match="read-only") as info:
        write_atomic(target, "new")
    assert info.value.exit_code == 2 and "chmod" in info.value.hint
    assert target.read_text() == "precious" and leftovers(tmp_path) == []
    link = tmp_path / "link.json"
    link.symlink_to(target)
    with pytest.raises(OutputError, match="read-only"):
        write_atomic(link, "new")
    assert target.read_text() == "precious"


@settings(max_examples=40, deadline=None)
@given(mode=st.integers(min_value=0, max_value=0o777))
def test_file_modes_decide_what_is_refused(mode: int) -> None:
    """As root: any write bit allows replacing (root may), none refuses. As a user: the owner's bit."""
    with tempfile.TemporaryDirectory() as d:
        target = Path(d) / "r.txt"
        target.write_text("old")
        target.chmod(mode)
        writable = bool(mode & 0o222) if IS_ROOT else bool(mode & 0o200)
        try:
            write_atomic(target, "new")
        except OutputError:
            assert not writable
            target.chmod(0o600)
            assert target.read_text() == "old"
        else:
            assert writable
            assert stat.S_IMODE(target.stat().st_mode) == mode  # the mode is kept
            target.chmod(0o600)
            assert target.read_text() == "new"
        assert leftovers(Path(d)) == []


def test_directory_and_socket_are_refused(tmp_path: Path) -> None:
    import socket

    with pytest.raises(OutputError, match="is a directory"):
        ensure_writable(tmp_path)
    path = tmp_path / "s"
    with socket.socket(socket.AF_UNIX) as sock:
        try:
            sock.bind(str(path))
        except OSError:
            pytest.skip("cannot bind a unix socket here")
        with pytest.raises(OutputError, match="socket"):
            ensure_writable(path)


def test_native_writer_error_naming_an_os_error_is_output_error(tmp_path: Path) -> None:
    """safetensors (Rust) reports a full disk as ``SafetensorError(... (os error 28))``."""
    target = tmp_path / "f.safetensors"
    target.write_bytes(b"old")

    class SafetensorError(Exception):
        pass

    with pytest.raises(OutputError, match="no space left on device") as info:
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"half")
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert info.value.hint and target.read_bytes() == b"old" and leftovers(tmp_path) == []
    with pytest.raises(ValueError, match="unrelated"):  # other errors pass through unchanged
        with open_output(target) as out:
            out.write(b"half")
            raise ValueError("unrelated")
    assert target.read_bytes() == b"old" and leftovers(tmp_path) == []


def test_atomic_path_into_a_device_copies_in_place(null_device: Path, fifo: PipeReader) -> None:
    with atomic_path(fifo.path) as tmp:
        tmp.write_bytes(b"abc" * 1000)
    assert fifo.result() == b"abc" * 1000
    assert_fifo(fifo.path)
    with atomic_path(null_device) as tmp:
        tmp.write_bytes(b"x")
    assert_device(null_device, 3)


# --------------------------------------------------------------------------- features into a pipe


def _load_bytes(fmt: str, data: bytes) -> dict[str, torch.Tensor]:
    """Read a features file from bytes with the format's own library (not hookcli)."""
    if fmt == "safetensors":
        from safetensors.torch import load

        return load(data)
    if fmt == "pt":
        return torch.load(io.BytesIO(data), weights_only=True)["tensors"]
    with np.load(io.BytesIO(data)) as arrays:
        return {k: torch.from_numpy(arrays[k]) for k in arrays.files if k != "__metadata__"}


@pytest.mark.parametrize("fmt", ["safetensors", "pt", "npz"])
def test_features_stream_into_a_fifo_equal_plain_torch(tmp_path: Path, fmt: str) -> None:
    reader = PipeReader(tmp_path / f"feats.{fmt}")
    try:
        model = tm.Reused().eval()
        result = hookcli.features(model, input_shapes=["3x4"], layers="act,head", output=reader.path)
        data = reader.result()
    finally:
        reader.close()
    assert_fifo(reader.path)
    assert result.file_bytes == len(data)
    calls = tm.reused_calls(model, dummy(3, 4))
    expected = {label: calls[label] for label in ("act#0", "act#1", "act#2", "head")}
    saved = _load_bytes(fmt, data)
    assert set(saved) == set(expected)
    for label, value in expected.items():
        assert torch.equal(saved[label], value), label
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".npz"])
def test_features_into_a_full_device_is_exit_2(cli, tmp_path: Path, full_device: Path, suffix: str) -> None:
    link = tmp_path / f"out{suffix}"  # the extension picks the format; the link leads to the device
    link.symlink_to(full_device)
    result = cli("features", "tiny_models:Reused", "--input-shape", "2x4", "-o", link)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines[0].startswith("Error: cannot write") and "no space left on device" in lines[0]
    assert lines[1].startswith("  hint: ") and len(lines) == 2
    assert_device(full_device, 7)
    assert leftovers(tmp_path) == []


def test_features_and_fmaps_into_null_device(cli, tmp_path: Path, null_device: Path) -> None:
    for suffix in (".pt", ".png"):
        link = tmp_path / f"out{suffix}"
        link.symlink_to(null_device)
    feats = cli("features", "tiny_models:Reused", "--input-shape", "2x4", "-o", tmp_path / "out.pt", "-f", "json")
    assert feats.exit_code == 0, feats.output
    assert json.loads(feats.stdout)["file"]["bytes"] > 0
    maps = cli("fmaps", "broken_models:Healthy", "--input-shape", "1x3x8x8", "--layer", "conv",
               "-o", tmp_path / "out.png")
    assert maps.exit_code == 0, maps.output
    assert_device(null_device, 3)
    assert leftovers(tmp_path) == [] and leftovers(null_device.parent) == []


def test_fmaps_png_streams_into_a_fifo(cli, tmp_path: Path) -> None:
    from PIL import Image

    reader = PipeReader(tmp_path / "maps.png")
    try:
        result = cli("fmaps", "broken_models:Healthy", "--input-shape", "1x3x8x8", "--layer", "conv",
                     "-o", reader.path, "-f", "json")
        data = reader.result()
    finally:
        reader.close()
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    image = Image.open(io.BytesIO(data))
    assert list(image.size) == report["image_size"] and report["shown"] == list(range(8))
    assert_fifo(reader.path)


# --------------------------------------------------------------------------- -o and --junit


def test_stats_into_a_fifo_equal_plain_torch(cli, tmp_path: Path) -> None:
    reader = PipeReader(tmp_path / "stats")
    try:
        result = cli("stats", "tiny_models:Reused", "--input-shape", "2x4", "--layers", "fc1",
                     "-f", "json", "-o", reader.path)
        data = reader.result()
    finally:
        reader.close()
    assert result.exit_code == 0, result.output
    assert result.stdout == "" and "wrote" in result.stderr
    assert_fifo(reader.path)
    report = json.loads(data)
    torch.manual_seed(0)  # hookcli seeds the model's random initialisation with --seed
    model = tm.Reused().eval()
    with torch.no_grad():
        y = model.fc1(dummy(2, 4)).double()
    (row,) = report["layers"]
    assert row["name"] == "fc1" and report["partial"] is False
    for key, value in {"mean": y.mean(), "std": y.std(correction=0), "min": y.min(), "max": y.max()}.items():
        assert row["stats"][key] == pytest.approx(float(value), rel=1e-5, abs=1e-6), key


def test_dash_o_null_device_and_symlink(cli, tmp_path: Path, null_device: Path) -> None:
    result = cli("shapes", "tiny_models:Reused", "--input-shape", "2x4", "-o", null_device)
    assert result.exit_code == 0, result.output
    assert_device(null_device, 3)
    real = tmp_path / "real.json"
    real.write_text("old")
    (tmp_path / "link.json").symlink_to("real.json")
    result = cli("shapes", "tiny_models:Reused", "--input-shape", "2x4", "-o", tmp_path / "link.json")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "link.json").is_symlink() and json.loads(real.read_text())["command"] == "shapes"
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("case", ["stats", "features", "fmaps", "junit"])
def test_read_only_targets_exit_2_before_running(cli, tmp_path: Path, case: str) -> None:
    name = {"features": "f.pt", "fmaps": "m.png", "junit": "check.xml"}.get(case, "r.json")
    target = tmp_path / name
    target.write_text("precious")
    target.chmod(0o444)
    args = {
        "stats": ["stats", "tiny_models:Raises", "--input-shape", "2x4", "-o", target],
        "features": ["features", "tiny_models:Raises", "--input-shape", "2x4", "-o", target],
        "fmaps": ["fmaps", "tiny_models:Raises", "--input-shape", "2x4", "--layer", "good", "-o", target],
        "junit": ["check", "tiny_models:Raises", "--input-shape", "2x4", "--junit", target],
    }[case]
    result = cli(*args)  # the model raises if it runs (exit 1): exit 2 says it never ran
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines[0] == f"Error: cannot write {target}: the file is read-only"
    assert lines[1].startswith("  hint: make it writable first (chmod u+w") and len(lines) == 2
    assert target.read_text() == "precious" and leftovers(tmp_path) == []


def test_junit_into_null_device(cli, null_device: Path) -> None:
    result = cli("check", "broken_models:Healthy", "--input-shape", "2x3x8x8", "--junit", null_device)
    assert result.exit_code == 0, result.output
    assert_device(null_device, 3)


# --------------------------------------------------------------------------- failed runs


GOOD = '{"an earlier": "good report"}\n'


@pytest.mark.parametrize("command", ["stats", "shapes", "grads"])
def test_failed_run_leaves_the_file_and_prints_the_partial_report(cli, tmp_path: Path, command: str) -> None:
    out = tmp_path / "report.json"
    out.write_text(GOOD)
    result = cli(command, "tiny_models:Raises", "--input-shape", "2x4", "-o", out)
    assert result.exit_code == 1, result.output
    assert out.read_text() == GOOD and sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
    report = json.loads(result.stdout)  # .json implied JSON for the file: the partial report is JSON too
    assert report["schema"] == 1 and report["partial"] is True
    assert report["failure"]["module"] == "bad"
    assert [(r["name"], r["called"], r.get("raised", False)) for r in report["layers"]] == [
        ("good", True, False), ("act", True, False), ("bad", True, True), ("never", False, False)]
    lines = result.stderr.splitlines()
    assert f"{out} left unchanged: the run failed, so its partial report went to stdout" in lines
    assert sum(line.startswith("Error: ") for line in lines) == 1 and "Traceback" not in result.stderr


def test_failed_run_into_a_fifo_sends_the_partial_report_there(cli, tmp_path: Path) -> None:
    """A reader waiting on a FIFO gets the partial report (marked) instead of waiting forever."""
    reader = PipeReader(tmp_path / "pipe")
    try:
        result = cli("stats", "tiny_models:Raises", "--input-shape", "2x4", "-f", "json", "-o", reader.path)
        data = reader.result()
    finally:
        reader.close()
    assert result.exit_code == 1 and result.stdout == ""
    report = json.loads(data)
    assert report["partial"] is True and report["failure"]["module"] == "bad"
    assert_fifo(reader.path)


def test_partial_rows_hold_the_right_numbers(cli) -> None:
    result = cli("stats", "tiny_models:Raises", "--input-shape", "2x4", "-f", "json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["partial"] is True
    torch.manual_seed(0)
    model = tm.Raises().eval()
    with torch.no_grad():
        good = model.good(dummy(2, 4)).double()
    row = report["layers"][0]
    assert row["name"] == "good"
    assert row["stats"]["mean"] == pytest.approx(float(good.mean()), rel=1e-5, abs=1e-6)
    assert row["stats"]["max"] == pytest.approx(float(good.max()), rel=1e-5, abs=1e-6)


def test_failed_run_with_a_new_path_writes_nothing(cli, tmp_path: Path) -> None:
    out = tmp_path / "new.csv"
    result = cli("stats", "tiny_models:Raises", "--input-shape", "2x4", "-o", out)
    assert result.exit_code == 1
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert f"{out} not written: the run failed, so its partial report went to stdout" in result.stderr
    rows = list(csv.DictReader(io.StringIO(result.stdout)))  # .csv implied CSV
    assert [r["name"] for r in rows] == ["good", "act", "bad", "never"]
    assert {r["partial"] for r in rows} == {"true"}


def test_partial_is_marked_in_every_format(cli) -> None:
    args = ("stats", "tiny_models:Raises", "--input-shape", "2x4", "-f")
    table = cli(*args, "table")
    assert table.exit_code == 1
    assert any(line.startswith("stats (PARTIAL: the model raised in forward") for line in table.stdout.splitlines())
    markdown = cli(*args, "markdown").stdout
    assert markdown.startswith("### stats: tiny_models:Raises (PARTIAL: the model raised in forward")
    header = cli(*args, "csv").stdout.splitlines()[0]
    assert header.split(",")[-1] == "partial"


def test_complete_run_is_not_partial(cli) -> None:
    args = ("stats", "tiny_models:Reused", "--input-shape", "2x4", "-f")
    assert json.loads(cli(*args, "json").stdout)["partial"] is False
    assert "PARTIAL" not in cli(*args, "table").stdout
    assert "PARTIAL" not in cli(*args, "markdown").stdout
    assert "partial" not in cli(*args, "csv").stdout.splitlines()[0].split(",")
    assert json.loads(cli("models", "resnet1*", "-f", "json").stdout)["partial"] is False


# --------------------------------------------------------------------------- signals (real processes)


DRIVER = r"""
import os, sys, time

marker, pause = os.environ["HOOKCLI_TEST_MARKER"], os.environ.get("HOOKCLI_TEST_PAUSE", "")


def wait_for_the_signal():
    open(marker, "w").close()
    time.sleep(600)


if pause == "write":  # after the first bytes hookcli writes, in the middle of the file
    import hookcli.output as output

    real_write, paused = output.OutputStream.write, []

    def write(self, data):
        n = real_write(self, data)
        if not paused:
            paused.append(True)
            wait_for_the_signal()
        return n

    output.OutputStream.write = write
elif pause == "fsync":  # the whole file written (by safetensors' own code), not yet renamed
    real_fsync, paused = os.fsync, []

    def fsync(fd):
        real_fsync(fd)
        if not paused:
            paused.append(True)
            wait_for_the_signal()

    os.fsync = fsync

from hookcli.cli import main

main(args=sys.argv[1:], prog_name="hookcli")
"""

SLOW_MODEL = """
import os, time

from torch import nn


class Slow(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        open(os.environ["HOOKCLI_TEST_MARKER"], "w").close()
        time.sleep(600)
        return y


def build():
    return Slow()
"""


def run_and_signal(tmp_path: Path, args: list[str], sig: int, pause: str = "",
                   at_pause: Callable[[], None] = lambda: None) -> tuple[int, str, str]:
    """Run hookcli in a real process; once it is at ``pause`` (or in the model's forward) call
    ``at_pause`` and send ``sig``. Returns (exit code, stdout, stderr)."""
    marker = tmp_path / "marks" / "ready"
    marker.parent.mkdir(exist_ok=True)
    env = {**os.environ, "HOOKCLI_TEST_MARKER": str(marker), "HOOKCLI_TEST_PAUSE": pause,
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")])}
    env.pop("HOOKCLI_DEBUG", None)
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, *args], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + scaled_timeout(300)
        while not marker.exists():
            if proc.poll() is not None:
                out, err = proc.communicate()
                pytest.fail(f"hookcli ended (exit {proc.returncode}) before the pause point:\n{err}")
            if time.monotonic() > deadline:
                pytest.fail("hookcli never reached the pause point")
            time.sleep(0.05)
        at_pause()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=scaled_timeout(300))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err


@pytest.mark.parametrize(("suffix", "pause", "sig", "code", "line"), [
    (".pt", "write", signal.SIGTERM, 143, "terminated (SIGTERM)"),
    (".pt", "write", signal.SIGINT, 130, "interrupted"),
    # after safetensors wrote its whole file, before the rename
    (".safetensors", "fsync", signal.SIGTERM, 143, "terminated (SIGTERM)"),
])
def test_signal_in_the_middle_of_writing_features_leaves_no_temp_file(tmp_path: Path, suffix: str, pause: str,
                                                                       sig: int, code: int, line: str) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    target = out_dir / f"feats{suffix}"
    target.write_bytes(b"old features")
    seen: list[list[str]] = []
    rc, out, err = run_and_signal(tmp_path, ["features", "tiny_models:Reused", "--input-shape", "64x4",
                                             "-o", str(target)], sig, pause=pause,
                                  at_pause=lambda: seen.append(leftovers(out_dir)))
    assert seen and len(seen[0]) == 1, f"the temporary file was not there at the pause ({pause})"
    assert rc == code, err
    assert err.strip().splitlines() == [line] and out == ""
    assert leftovers(out_dir) == [] and target.read_bytes() == b"old features"


def test_sigterm_during_the_model_leaves_the_old_file(tmp_path: Path) -> None:
    (tmp_path / "slow.py").write_text(SLOW_MODEL)
    target = tmp_path / "r.json"
    target.write_bytes(b"old")
    rc, out, err = run_and_signal(tmp_path, ["stats", "slow.py:build", "--input-shape", "2x4", "-o", str(target)],
                                  signal.SIGTERM)
    assert rc == 143, err
    assert err.strip().splitlines() == ["terminated (SIGTERM)"]
    assert target.read_bytes() == b"old" and leftovers(tmp_path) == []
