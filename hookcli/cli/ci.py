"""``hookcli check``'s CI outputs written at the command line's edge: the JUnit file, GitHub
annotations on stderr, the job summary. Their text comes from ``hookcli.render.ci``."""

from __future__ import annotations

import os
from pathlib import Path

import click

from hookcli.output import write_atomic
from hookcli.records import CheckResult
from hookcli.render.ci import annotations, junit_xml, step_summary


def write_junit(result: CheckResult, path: str | os.PathLike[str]) -> Path:
    """Write :func:`~hookcli.render.ci.junit_xml` to ``path`` atomically (temp file + rename)."""
    return write_atomic(path, junit_xml(result))


def append_step_summary(result: CheckResult, path: str | os.PathLike[str]) -> None:
    """Append the Markdown rendering of ``result`` to ``$GITHUB_STEP_SUMMARY`` (appending is the
    contract of that file: every step adds to it)."""
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(step_summary(result))


def github_enabled(flag: bool | None) -> bool:
    """``--github``/``--no-github``, else on when ``GITHUB_ACTIONS=true``."""
    return flag if flag is not None else os.environ.get("GITHUB_ACTIONS", "") == "true"


def publish(result: CheckResult, *, junit: str | os.PathLike[str] | None = None, github: bool | None = None) -> None:
    """Every CI output the options and environment ask for (annotations on stderr)."""
    if junit:
        click.echo(f"wrote {write_junit(result, junit)}", err=True)
    if github_enabled(github):
        for line in annotations(result):
            click.echo(line, err=True)
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        try:
            append_step_summary(result, summary)
        except OSError as exc:  # never hide the check's verdict behind a summary problem
            click.echo(f"warning: cannot append to GITHUB_STEP_SUMMARY ({summary}): {exc}", err=True)


__all__ = ["append_step_summary", "github_enabled", "publish", "write_junit"]
