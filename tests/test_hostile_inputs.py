"""Hostile paths, files and processes around a run: a NUL byte in any path, inputs that are FIFOs or
devices, SIGTERM while a file is written, and a reader of stdout that went away. Each is one line and
exit 2 (or the exit code a Unix tool gives: 143, 141), never an internal error (exit 3) or a hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import hookcli
from hookcli.errors import UsageError
from timeouts import scaled_timeout

ROOT = Path(__file__).parents[1]
NET = "import torch\n\n\ndef build(width=4):\n    return torch.nn.Linear(width, 2)\n"


def one_error(out, *words: str) -> None:
    """Exit 2, stdout empty, stderr one Error line and one hint, naming ``words``."""
    lines = out.stderr.splitlines()
    assert out.exit_code == 2, out.output
    assert len(lines) == 2 and lines[0].startswith("Error: ") and lines[1].startswith("  hint: "), out.stderr
    assert "internal error" not in out.stderr and "Traceback" not in out.stderr
    for word in words:
        assert word in lines[0], out.stderr


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "net.py").write_text(NET)
    torch.save(torch.zeros(2, 4), tmp_path / "x.pt")
    monkeypatch.chdir(tmp_path)
    sys.modules.pop("net", None)
    yield tmp_path
    sys.modules.pop("net", None)


# --------------------------------------------------------------------------- NUL bytes


#: A NUL in each path key of a config (and in a key's name), as TOML writes it (\u0000).
NUL_KEYS = [
    ("output", 'output = "r\\u0000.json"'),
    ("watch.out", '[watch]\nout = "log\\u0000.jsonl"'),
    ("input", 'input = "x\\u0000.pt"'),
    ("weights", 'weights = "w\\u0000.pt"'),
    ("data", 'data = "d\\u0000"'),
    ("baseline", '[checks]\nbaseline = "b\\u0000.json"'),
    ("layers", 'layers = "a\\u0000"'),
    ("checks", '[checks]\n"grad\\u0000norm" = 1'),
]


@pytest.mark.parametrize("key, line", NUL_KEYS, ids=[k for k, _ in NUL_KEYS])
def test_a_nul_byte_in_a_config_is_one_line(cli, repo: Path, key: str, line: str) -> None:
    model = 'model = "net:build"\n' + ('input_shape = "1x4"\n' if key not in ("input", "data") else "")
    (repo / "ci.toml").write_text(model + line + "\n")
    command = ["watch", "--steps", "1"] if key == "watch.out" else ["check"]
    out = cli(*command, "--config", repo / "ci.toml")
    one_error(out, "NUL")
    assert key.split(".")[0] in out.stderr.splitlines()[0]


def test_a_nul_byte_in_the_model_of_a_config(cli, repo: Path) -> None:
    (repo / "ci.toml").write_text('model = "net\\u0000.py:build"\ninput_shape = "1x4"\n')
    one_error(cli("shapes", "--config", repo / "ci.toml"), "NUL", "'model'")


@pytest.mark.parametrize("args", [
    ["stats", "net:build", "--input-shape", "1x4", "-o", "r\0.json"],
    ["stats", "net:build", "--input", "x\0.pt"],
    ["stats", "net:build", "--data", "x\0.pt"],
    ["stats", "net:build", "--input-shape", "1x4", "--weights", "w\0.pt"],
    ["stats", "net\0.py:build", "--input-shape", "1x4"],
    ["stats", "--config", "c\0.toml"],
    ["check", "net:build", "--input-shape", "1x4", "--baseline", "b\0.json"],
    ["check", "net:build", "--input-shape", "1x4", "--junit", "j\0.xml"],
    ["features", "net:build", "--input-shape", "1x4", "-o", "f\0.pt"],
    ["watch", "net:build", "--input-shape", "1x4", "--steps", "1", "--out", "l\0.jsonl"],
    ["diff", "net:build", "--input-shape", "1x4", "--vs-weights", "w\0.pt"],
    ["report", "log\0.jsonl"],
], ids=lambda args: args[0] + " " + next(a for a in args if "\0" in a).replace("\0", "NUL"))
def test_a_nul_byte_in_a_command_line_path_is_one_line(cli, repo: Path, args: list[str]) -> None:
    """No OS passes a NUL in argv, but ``main(args)`` and CliRunner do: never 'embedded null byte'."""
    one_error(cli(*args), "NUL")


@pytest.mark.parametrize("options", [
    {"model": "net\0.py:build"}, {"weights": "w\0.pt"}, {"inputs": ["x\0.pt"]}, {"data": "d\0"},
    {"inputs": [Path("x\0.pt")]},
], ids=["model", "weights", "inputs", "data", "inputs-path"])
def test_a_nul_byte_in_an_api_path_is_a_usage_error(repo: Path, options: dict) -> None:
    options = {"model": "net:build", **options}
    if "inputs" not in options and "data" not in options:
        options["input_shapes"] = ["1x4"]
    with pytest.raises(UsageError, match="NUL"):
        hookcli.stats(**options)


def test_a_nul_byte_in_an_output_or_baseline_of_the_api(repo: Path) -> None:
    from hookcli.errors import OutputError
    from hookcli.output import ensure_writable, write_atomic

    for call in (lambda: ensure_writable("r\0.json"), lambda: write_atomic("r\0.json", "x")):
        with pytest.raises(OutputError, match="NUL"):
            call()
    with pytest.raises(UsageError, match="NUL"):
        hookcli.check("net:build", input_shapes=["1x4"], baseline="b\0.json")


# --------------------------------------------------------------------------- FIFOs and devices


@pytest.fixture
def fifo(repo: Path):
    """A FIFO named like a tensor file; should a read block on it, a writer comes after 20 s and closes
    it, so that a regression fails the test rather than hanging it."""
    path = repo / "pipe.pt"
    os.mkfifo(path)

    def unblock() -> None:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # no reader: nothing blocks
            pass

    timer = threading.Timer(20, unblock)
    timer.daemon = True
    timer.start()
    yield path
    timer.cancel()


@pytest.mark.parametrize("args, what", [
    (["stats", "net:build", "--input", "{f}"], "input file"),
    (["stats", "net:build", "--data", "{f}"], "data file"),
    (["stats", "net:build", "--input-shape", "1x4", "--weights", "{f}"], "weights file"),
    (["stats", "net:build", "--input-shape", "1x4", "--config", "{f}"], "config file"),
    (["check", "net:build", "--input-shape", "1x4", "--baseline", "{f}"], "baseline file"),
    (["stats", "--config", "ci.toml"], "input file"),  # the config names the FIFO
], ids=["input", "data", "weights", "config", "baseline", "config-input"])
def test_a_fifo_is_refused_up_front(cli, repo: Path, fifo: Path, args: list[str], what: str) -> None:
    (repo / "ci.toml").write_text(f'model = "net:build"\ninput = "{fifo.name}"\n')
    out = cli(*[a.format(f=fifo) for a in args])
    one_error(out, what, "FIFO")


@pytest.mark.parametrize("flag, what", [("--input", "input file"), ("--data", "data file"),
                                        ("--weights", "weights file"), ("--config", "config file")])
def test_a_device_is_refused_before_it_is_read(cli, repo: Path, monkeypatch: pytest.MonkeyPatch, flag: str,
                                               what: str) -> None:
    """A tensor file that is a link to /dev/zero was read up to the 4 GiB limit before being refused."""
    monkeypatch.setenv("HOOKCLI_MAX_TENSOR_BYTES", str(1 << 20))  # (the old behaviour: 'too large' at 1 MiB)
    monkeypatch.setenv("HOOKCLI_MAX_TEXT_BYTES", str(1 << 20))
    (repo / "zero.pt").symlink_to("/dev/zero")
    extra = [] if flag in ("--input", "--data") else ["--input-shape", "1x4"]
    one_error(cli("stats", "net:build", *extra, flag, repo / "zero.pt"), what, "a device")


def test_read_capped_reads_regular_files_only(tmp_path: Path) -> None:
    from hookcli.errors import InputError
    from hookcli.limits import TEXT_BYTES, read_capped

    (tmp_path / "a.toml").write_bytes(b"x = 1\n")
    assert read_capped(tmp_path / "a.toml", TEXT_BYTES, "config file") == b"x = 1\n"
    os.mkfifo(tmp_path / "p")
    for path, kind in ((tmp_path / "p", "FIFO"), (Path("/dev/zero"), "device")):
        with pytest.raises(InputError, match=kind):
            read_capped(path, TEXT_BYTES, "config file")


# --------------------------------------------------------------------------- SIGTERM while writing

#: Runs the CLI with SIGTERM sent to itself from inside the AT-th write to a file (not stdout/stderr):
#: the signal lands in the middle of writing the output, wherever the writer is (torch.save's C++ writer).
SIGTERM_RUNNER = """
import os, signal, sys
real_write, count = os.write, [0]
def write(fd, data):
    if fd > 2:
        count[0] += 1
        if count[0] == int(os.environ["AT"]):
            os.kill(os.getpid(), signal.SIGTERM)
    return real_write(fd, data)
os.write = write
from hookcli.cli.main import main
main()
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1", "COLUMNS": "100"}


@pytest.mark.parametrize("args, name, at", [
    (["features", "net:build", "--input-shape", "2x4", "--all", "-o"], "out.pt", 3),
    (["features", "net:build", "--input-shape", "2x4", "--all", "-o"], "out.npz", 2),
    (["stats", "net:build", "--input-shape", "2x4", "-o"], "out.json", 1),
], ids=["features-pt", "features-npz", "stats-o"])
def test_sigterm_while_writing_an_output_exits_143_and_keeps_the_old_file(repo: Path, args: list[str], name: str,
                                                                          at: int) -> None:
    (repo / "runner.py").write_text(SIGTERM_RUNNER)
    (repo / name).write_text("the old file\n")
    done = subprocess.run([sys.executable, "runner.py", *args, name], cwd=repo, env={**_env(), "AT": str(at)},
                          capture_output=True, text=True, timeout=scaled_timeout(300))
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert done.stderr.splitlines()[-1] == "terminated (SIGTERM)" and "internal error" not in done.stderr, done.stderr
    assert (repo / name).read_text() == "the old file\n"
    assert sorted(p.name for p in repo.iterdir() if p.name.endswith(".tmp")) == []


# --------------------------------------------------------------------------- a reader that went away


def _closed_pipe_run(args: list[str], cwd: Path, *, stderr_too: bool) -> tuple[int, str]:
    """``python -m hookcli ARGS`` whose stdout (and stderr, with ``stderr_too``) is a pipe whose reader
    closed before anything was written: every write raises EPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "hookcli", *args], cwd=cwd, env=_env(), stdout=write_end,
                              stderr=write_end if stderr_too else subprocess.PIPE, timeout=scaled_timeout(300))
    finally:
        os.close(write_end)
    return done.returncode, (done.stderr or b"").decode()


@pytest.mark.parametrize("args", [
    ["--help"], ["--version"], ["shapes", "--help"], ["models"], ["stats", "net:build", "--input-shape", "2x4", "-f", "json"],
    ["features", "net:build", "--input-shape", "2x4", "-o", "f.pt"],
], ids=lambda args: " ".join(args))
def test_a_closed_stdout_ends_quietly_with_141(repo: Path, args: list[str]) -> None:
    """As ``hookcli ... | head -1`` when head has gone: 141 (docs/options.md), never 1 (which says the model
    failed) or 3, and nothing on stderr."""
    code, err = _closed_pipe_run(args, repo, stderr_too=False)
    assert code == 141 and err == "", (code, err)


@pytest.mark.parametrize("args", [["nosuchcommand"], ["shapes", "--fill", "bad"], ["stats", "no_such_model_x"]],
                         ids=lambda args: " ".join(args))
def test_closed_stdout_and_stderr_end_quietly_with_141(repo: Path, args: list[str]) -> None:
    """``hookcli ... 2>&1 | head -1`` when head has gone, also for an error's own lines."""
    code, _ = _closed_pipe_run(args, repo, stderr_too=True)
    assert code == 141


UNHASHABLE = '''import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def __eq__(self, other):  # (and so no __hash__: Python drops it)
        return isinstance(other, Block)

    def forward(self, x):
        return self.fc(x)


def whole():
    return Block()


def inner():
    return nn.Sequential(nn.Identity(), Block())
'''


@pytest.mark.parametrize(("attr", "where"), [("whole", "(model) (Block)"), ("inner", "1 (Block)")])
def test_a_module_class_with_eq_and_no_hash_is_one_line_exit_2(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              attr: str, where: str) -> None:
    """torch's own ``named_modules`` (and ``parameters``) fail on such a module: one line naming it, exit 2,
    the fix as the hint; through the API an UnsupportedError, not a raw TypeError."""
    (tmp_path / "unhashable.py").write_text(UNHASHABLE)
    monkeypatch.chdir(tmp_path)
    sys.modules.pop("unhashable", None)
    out = cli("stats", f"unhashable.py:{attr}", "--input-shape", "2x4")
    one_error(out, where, "__eq__ without __hash__")
    assert "__hash__ = nn.Module.__hash__" in out.stderr
    namespace: dict[str, object] = {}
    exec(compile(UNHASHABLE, "unhashable", "exec"), namespace)
    with pytest.raises(hookcli.HookcliError, match="__eq__ without __hash__"):
        hookcli.stats(namespace[attr](), input_shapes=["2x4"])  # type: ignore[operator]
