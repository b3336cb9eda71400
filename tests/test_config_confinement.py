"""A config from a stranger's repository names only that repository's files: every path key of a config
(``hookcli.config``: ``OPTION_KEYS``, ``[watch]``, ``[checks]``) against every way out of it (a symlink
inside the tree leading out, ``..``, ``~``, an absolute path), through the real command line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from hookcli.config import OPTION_KEYS, WATCH_KEYS

NET = "import torch\n\n\ndef build(width=4):\n    return torch.nn.Linear(width, 2)\n"
DATA = "import torch\n\nbatches = [torch.zeros(2, 4)]\n"

#: Every key whose value is (or may be) a path, with each form it names one in: (key as written in the
#: config, the text it is given with PATH the file or folder outside, the config lines it needs besides).
PATH_KEYS: list[tuple[str, str, str]] = [
    ("output", 'output = "PATH/r.json"', 'model = "net:build"\ninput_shape = "1x4"\n'),
    ("watch.out", '[watch]\nout = "PATH/log.jsonl"', 'model = "net:build"\ninput_shape = "1x4"\n'),
    ("input", 'input = "PATH/x.pt"', 'model = "net:build"\n'),
    ("input", 'input = "x=PATH/x.pt"', 'model = "net:build"\n'),
    ("input", 'input = "PATH/imgs"', 'model = "net:build"\n'),
    ("weights", 'weights = "PATH/w.pt"', 'model = "net:build"\ninput_shape = "1x4"\n'),
    ("model", 'model = "PATH/evil.py:build"', 'input_shape = "1x4"\n'),
    ("model", 'model = "PATH/evil.py"', 'input_shape = "1x4"\n'),
    ("model", 'model = "hf:PATH/hfmodel"', 'input_shape = "1x4"\n'),
    ("data", 'data = "PATH/x.pt"', 'model = "net:build"\n'),
    ("data", 'data = "PATH/imgs"', 'model = "net:build"\n'),
    ("data", 'data = "PATH/evildata.py:batches"', 'model = "net:build"\n'),
    ("baseline", '[checks]\nbaseline = "PATH/b.json"', 'model = "net:build"\ninput_shape = "1x4"\n'),
]
#: How each escape spells the folder outside the repository (``home``, beside it).
ESCAPES = {
    "symlink": "link",  # repo/link -> home
    "dotdot": "../home",
    "tilde": "~",
    "absolute": "{home}",
}


def test_the_table_covers_every_path_key() -> None:
    """A path key added to config.py without a row here fails this test."""
    path_like = {"output", "input", "weights", "model", "data"}
    assert path_like <= set(OPTION_KEYS)
    assert {key for key, _, _ in PATH_KEYS} == path_like | {"watch.out", "baseline"}
    assert "out" in WATCH_KEYS
    not_paths = set(OPTION_KEYS) - path_like - {"model_args"}  # model_args: refused keys checked in test_config
    for key in not_paths:  # every other key's value is a number, a choice or a name, never opened as a file
        assert OPTION_KEYS[key].expected != "string" or key in {"device", "dtype", "format"}, key


@pytest.fixture
def outside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A repository (the working directory, its model in net.py) and, beside it, the user's HOME
    holding every kind of file a config could name: a tensor, weights, code, images, a baseline."""
    repo, home = tmp_path / "repo", tmp_path / "home"
    repo.mkdir()
    home.mkdir()
    (repo / "net.py").write_text(NET)
    (repo / "link").symlink_to(home)
    torch.save(torch.zeros(2, 4), home / "x.pt")
    torch.save({"weight": torch.zeros(2, 4), "bias": torch.zeros(2)}, home / "w.pt")
    sentinel = home / "ran"
    (home / "evil.py").write_text(f"open({str(sentinel)!r}, 'w').close()\n" + NET)
    (home / "evildata.py").write_text(f"open({str(sentinel)!r}, 'w').close()\n" + DATA)
    (home / "imgs").mkdir()
    from PIL import Image

    Image.new("RGB", (8, 8)).save(home / "imgs" / "a.png")
    (home / "hfmodel").mkdir()
    (home / "hfmodel" / "config.json").write_text('{"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2}')
    (home / "b.json").write_text("{}")
    (home / ".bashrc").write_text("mine\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(repo)
    for name in ("net", "evil", "evildata"):
        sys.modules.pop(name, None)
    yield home
    for name in ("net", "evil", "evildata"):
        sys.modules.pop(name, None)


def _refused(out, key: str) -> None:
    lines = out.stderr.splitlines()
    assert out.exit_code == 2 and out.stdout == "", out.output
    assert len(lines) == 2 and lines[0].startswith("Error: ") and lines[1].startswith("  hint: "), out.stderr
    assert f"'{key}'" in lines[0], out.stderr


@pytest.mark.parametrize("escape", list(ESCAPES))
@pytest.mark.parametrize("key, line, rest", PATH_KEYS, ids=[line.split("=")[0].strip().replace("\n", " ") +
                                                             "=" + line.split('"')[1] for _, line, _ in PATH_KEYS])
def test_no_path_key_leaves_the_repository(cli, outside: Path, key: str, line: str, rest: str, escape: str) -> None:
    home = outside
    before = sorted(p.name for p in home.iterdir())
    text = rest + line.replace("PATH", ESCAPES[escape].format(home=home)) + "\n"
    cfg = outside.parent / "repo" / "ci.toml"
    cfg.write_text(text)
    command = "watch" if key == "watch.out" else "check"
    out = cli(command, "--config", cfg, *(["--steps", "1"] if command == "watch" else []))
    _refused(out, key)
    assert not (home / "ran").exists(), "code outside the repository was imported"
    assert sorted(p.name for p in home.iterdir()) == before, "a file was written outside the repository"
    assert (home / ".bashrc").read_text() == "mine\n"


@pytest.mark.parametrize("key, line", [("input", 'input = "imgs"'), ("data", 'data = "imgs"')])
def test_a_folder_in_the_repository_holding_links_out_is_refused(cli, outside: Path, key: str, line: str) -> None:
    """The folder is the repository's, the image in it a link to the user's file: what is read is outside."""
    repo = outside.parent / "repo"
    (repo / "imgs").mkdir()
    (repo / "imgs" / "b.png").symlink_to(outside / "imgs" / "a.png")
    cfg = repo / "ci.toml"
    cfg.write_text('model = "resnet18"\n' + line + "\n")
    _refused(cli("stats", "--config", cfg), key)


def test_the_same_files_inside_the_repository_are_fine(cli, outside: Path) -> None:
    """The confinement refuses the way out, not the key: each kind of file, kept in the repository."""
    repo = outside.parent / "repo"
    torch.save(torch.zeros(2, 4), repo / "x.pt")
    (repo / "sub").mkdir()
    (repo / "sub" / "link_in.pt").symlink_to(repo / "x.pt")  # a link that stays inside
    cfg = repo / "ci" / "ci.toml"
    cfg.parent.mkdir()
    cfg.write_text('model = "../net.py:build"\ninput = "../sub/link_in.pt"\noutput = "out/r.json"\n')
    out = cli("stats", "--config", cfg)
    assert out.exit_code == 0, out.output
    assert (repo / "ci" / "out" / "r.json").is_file()
