"""Atomic output files: content, failures leave no partial or temporary files."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

import hookcli.output as output
from hookcli.errors import OutputError
from hookcli.output import ensure_writable, write_atomic

ROOT_USER = hasattr(os, "geteuid") and os.geteuid() == 0


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_write_atomic_writes_text_and_bytes(tmp_path: Path) -> None:
    target = tmp_path / "report.json"
    assert write_atomic(target, "héllo\n") == target
    assert target.read_text(encoding="utf-8") == "héllo\n"
    write_atomic(str(target), b"\x00\x01")
    assert target.read_bytes() == b"\x00\x01"
    assert leftovers(tmp_path) == []


def test_new_file_gets_umask_permissions(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    try:
        target = write_atomic(tmp_path / "a.txt", "x")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o644


def test_existing_file_replaced_and_mode_kept(tmp_path: Path) -> None:
    target = tmp_path / "out.csv"
    target.write_text("old")
    target.chmod(0o600)
    write_atomic(target, "new")
    assert target.read_text() == "new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600


def test_missing_directories_are_created(tmp_path: Path) -> None:
    write_atomic(tmp_path / "nope" / "deeper" / "r.json", "x")  # as --junit and -o both do
    assert (tmp_path / "nope" / "deeper" / "r.json").read_text() == "x"
    assert leftovers(tmp_path / "nope" / "deeper") == []
    (tmp_path / "afile").write_text("")
    with pytest.raises(OutputError, match="not a directory"):
        write_atomic(tmp_path / "afile" / "sub" / "r.json", "x")


def test_directory_target(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    with pytest.raises(OutputError, match="is a directory"):
        write_atomic(tmp_path / "d", "x")
    assert leftovers(tmp_path) == []


def test_failed_encoding_keeps_old_content(tmp_path: Path) -> None:
    target = tmp_path / "r.md"
    target.write_text("old")
    with pytest.raises(OutputError, match="UTF-8"):
        write_atomic(target, "bad \udc80 surrogate")
    assert target.read_text() == "old" and leftovers(tmp_path) == []


@pytest.mark.parametrize("step", ["fsync", "replace"])
def test_failure_mid_write_keeps_old_content_and_no_temp(tmp_path: Path, monkeypatch,
                                                         step: str) -> None:
    target = tmp_path / "r.json"
    target.write_text("old")

    def boom(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(output.os, step, boom)
    with pytest.raises(OutputError, match="no space left"):
        write_atomic(target, "new content")
    monkeypatch.undo()
    assert target.read_text() == "old" and leftovers(tmp_path) == []


def test_rejects_non_text(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        write_atomic(tmp_path / "x", 3)  # type: ignore[arg-type]


def test_symlink_target_is_followed(tmp_path: Path) -> None:
    real = tmp_path / "real.txt"
    real.write_text("old")
    link = tmp_path / "link.txt"
    link.symlink_to(real)
    write_atomic(link, "new")
    assert link.is_symlink() and real.read_text() == "new"


def test_ensure_writable(tmp_path: Path) -> None:
    assert ensure_writable(tmp_path / "r.json") == tmp_path / "r.json"
    assert ensure_writable(tmp_path / "missing" / "r.json") == tmp_path / "missing" / "r.json"
    assert not (tmp_path / "missing").exists()  # created only when something is written
    with pytest.raises(OutputError, match="is a directory"):
        ensure_writable(tmp_path)
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputError, match="not a directory"):
        ensure_writable(tmp_path / "file" / "r.json")
    with pytest.raises(OutputError, match="empty"):
        ensure_writable("")


@pytest.mark.skipif(ROOT_USER or os.name != "posix", reason="root ignores directory permissions")
def test_permission_denied(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(OutputError, match="permission denied"):
            ensure_writable(locked / "r.json")
        with pytest.raises(OutputError, match="permission denied"):
            write_atomic(locked / "r.json", "x")
    finally:
        locked.chmod(0o700)


def test_permission_denied_messages_simulated(tmp_path: Path, monkeypatch) -> None:
    """The same paths as above, simulated so they run as root too."""
    monkeypatch.setattr(output.os, "access", lambda *args, **kwargs: False)
    with pytest.raises(OutputError, match="permission denied for directory"):
        ensure_writable(tmp_path / "r.json")
    monkeypatch.undo()

    def denied(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(output.tempfile, "mkstemp", denied)
    with pytest.raises(OutputError, match="permission denied"):
        write_atomic(tmp_path / "r.json", "x")
    assert list(tmp_path.iterdir()) == []
