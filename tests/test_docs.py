"""Docs that cannot rot: every command, snippet, link and config reference in README.md and docs/ is run
or resolved here, and the golden transcripts in tests/golden/ pin every command's output.

Regenerate everything (console blocks in place, golden files, images the docs' commands write) with

    python -m pytest tests/test_docs.py tests/test_render.py tests/test_cli.py --update-docs

(the last two hold the tables in tests/golden/tables/), then review the diff. See tests/transcripts.py for
what a documented command may be.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import traceback
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from timeouts import scaled_timeout
from transcripts import (EXACT, ROOT, Fence, Sandbox, Tolerance, fences, format_transcript, one_thread, parse_command,
                         parse_transcript, run, same_output, tolerance)

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GOLDEN = sorted((ROOT / "tests" / "golden").glob("*.txt"))
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))
#: The docs page of a command whose page is named otherwise (every other command has docs/NAME.md).
PAGE_OF = {"report": "watch"}


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.fixture
def update(request: pytest.FixtureRequest) -> Iterator[bool]:
    """True under ``pytest --update-docs``: rewrite what is shown instead of comparing."""
    with one_thread():  # every test that runs documented commands asks for this fixture
        yield bool(request.config.getoption("--update-docs"))


def _run_transcript(body: list[str], sandbox: Sandbox, where: str,
                    errors: list[str], within: Tolerance = EXACT) -> tuple[list[str], list[str]]:
    """Run a transcript; returns (its regenerated lines, a diff per command whose output changed).

    A command that lets an exception escape (a bug, not an error message) keeps the text shown and is
    added to ``errors``, so that the other blocks are still regenerated."""
    head, commands = parse_transcript(body)
    assert commands, f"{where}: a console transcript without a '$ hookcli ...' line"
    outputs, diffs = [], []
    with sandbox.cwd():
        for command in commands:
            try:
                actual = run(command.line, sandbox.path)
            except Exception:  # noqa: BLE001 - reported below with its traceback
                errors.append(f"{where}: $ {command.line}\n{traceback.format_exc()}")
                actual = command.expected
            if same_output(command.expected, actual, within):
                actual = command.expected  # within the last printed digit (or rel): keep what is shown
            outputs.append(actual)
            if actual != command.expected:
                diffs.append(f"{where}: $ {command.line}\n" + "\n".join(
                    difflib.unified_diff(command.expected, actual, "shown", "actual", lineterm="")))
    return format_transcript(head, commands, outputs), diffs


def _report(diffs: list[str], update: bool, what: str, errors: list[str]) -> None:
    """Fail on changed outputs (unless regenerating) and, always, on commands or snippets that raised."""
    if errors:
        pytest.fail(f"{len(errors)} documented commands or snippets raised\n\n" + "\n\n".join(errors))
    if diffs and not update:
        pytest.fail(f"{len(diffs)} {what} differ from what hookcli prints now "
                    "(regenerate: python -m pytest tests/test_docs.py --update-docs)\n\n" + "\n\n".join(diffs))


# --------------------------------------------------------------------------- commands shown in the docs


def _has_code(path: Path) -> bool:
    return any(f.lang in ("console", "python") for f in fences(path.read_text().splitlines()))


@pytest.mark.parametrize("path", [p for p in DOCS if _has_code(p)], ids=rel)
def test_page_runs_and_shows_what_hookcli_prints(path: Path, tmp_path: Path, update: bool) -> None:
    """A page is a script, run top to bottom in one sandbox: each ```console block's commands run and
    their output must be the text shown; each ```python block runs (its asserts hold), in one namespace,
    and zero-argument ``test_*`` functions it defines are called, as pytest would. A snippet may read a
    file a command above it wrote."""
    lines = path.read_text().splitlines()
    sandbox = Sandbox(tmp_path)
    diffs: list[str] = []
    regenerated: list[tuple[Fence, list[str]]] = []
    errors: list[str] = []
    snippets_ok = True  # after a snippet fails, later ones (which build on it) are not run
    namespace: dict[str, object] = {"__name__": "docs_snippet"}
    for fence in fences(lines):
        where = f"{rel(path)}:{fence.line_no}"
        if fence.lang == "console":
            body, found = _run_transcript(fence.body, sandbox, where, errors, fence.tolerance)
            diffs += found
            regenerated.append((fence, body))
        elif fence.lang == "python" and snippets_ok:
            try:
                with sandbox.cwd():
                    _exec_snippet(fence.body, where, namespace)
            except Exception:  # noqa: BLE001 - reported with its traceback, after regenerating the rest
                errors.append(f"{where}: python snippet\n{traceback.format_exc()}")
                snippets_ok = False
    written = sandbox.changed_files()  # e.g. the feature-map PNG a command draws for the docs
    if not update:
        errors += [f"{rel(path)}: {m}" for m in _dirtying(sandbox)]
    if update:
        new = list(lines)
        for fence, body in reversed(regenerated):  # bottom-up: line indexes stay valid
            new[fence.start:fence.end] = [fence.indent + line if line else "" for line in body]
        if new != lines:
            path.write_text("\n".join(new) + "\n")
        for name in written:
            shutil.copyfile(sandbox.path / name, ROOT / name)
    else:
        diffs += [f"{name}: the file a documented command writes differs from the repository's" for name in written]
    _report(diffs, update, "documented outputs", errors)


def _dirtying(sandbox: Sandbox) -> list[str]:
    """What the page's commands and snippets wrote that would leave ``git status --porcelain`` unclean
    in a clone where a reader ran them: a file git neither tracks nor ignores (``runs/``,
    ``feats.safetensors``: .gitignore must cover it), or a tracked file written otherwise."""
    import subprocess

    tracked = set(subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.splitlines())
    found: list[str] = []
    new: list[str] = []
    for file in sorted(sandbox.path.rglob("*")):
        name = file.relative_to(sandbox.path).as_posix()
        if name.split("/")[0] in Sandbox.LINKED or not file.is_file() or file.is_symlink():
            continue
        if name in tracked:
            if name not in sandbox.changed_files() and (ROOT / name).read_bytes() != file.read_bytes():
                found.append(f"{name} is tracked, and the documented commands change it")
        else:
            new.append(name)
    if new:
        ignored = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], input="\n".join(new), cwd=ROOT,
                                 capture_output=True, text=True, check=False).stdout.splitlines()
        found += [f"{name}: written by the documented commands, and .gitignore does not cover it"
                  for name in new if name not in ignored]
    return found


def _exec_snippet(body: list[str], where: str, namespace: dict[str, object]) -> None:
    import torch

    before = set(namespace)
    with torch.random.fork_rng(devices=[]):  # a snippet may seed torch: the suite's RNG stays as it was
        exec(compile("\n".join(body), where, "exec"), namespace)  # noqa: S102 - the docs' own examples
    for name in sorted(set(namespace) - before):
        func = namespace[name]
        if name.startswith("test_") and callable(func) and getattr(func, "__code__", None) \
                and func.__code__.co_argcount == 0:
            func()


@pytest.mark.parametrize("path", GOLDEN, ids=rel)
def test_golden_transcripts(path: Path, tmp_path: Path, update: bool) -> None:
    """Each tests/golden/*.txt: commands with their full output at width 100, colour off."""
    lines = path.read_text().splitlines()
    errors: list[str] = []
    body, diffs = _run_transcript(lines, Sandbox(tmp_path), rel(path), errors)
    if update and body != lines:
        path.write_text("\n".join(body) + "\n")
    _report(diffs, update, "golden outputs", errors)


def test_every_example_command_is_tested() -> None:
    """A ``$ hookcli`` line outside a console block would never run: there are none."""
    for path in DOCS:
        lines = path.read_text().splitlines()
        in_console = {i for f in fences(lines) if f.lang == "console" for i in range(f.start, f.end)}
        stray = [i + 1 for i, line in enumerate(lines) if line.lstrip().startswith("$ ") and i not in in_console]
        assert not stray, f"{rel(path)}: lines {stray} show a command outside a ```console block"
        for fence in fences(lines):
            if fence.lang == "console":
                for command in parse_transcript(fence.body)[1]:
                    parse_command(command.line)  # only hookcli, with the shell the runner knows


def _shell_hookcli_commands(text: str) -> list[str]:
    """``hookcli ...`` invocations in shell/yaml blocks (commands shown without output)."""
    found = []
    for line in text.splitlines():
        for part in re.split(r"&&|\|\||;|\brun:", line):
            part = part.strip()
            if part.startswith("hookcli "):
                found.append(part)
    return found


def _parse_cli(line: str, where: str) -> None:
    """Parse a ``hookcli ...`` line with hookcli's own Click commands (options and values), without running it."""
    from hookcli.cli import main

    args = shlex.split(line, comments=True)[1:]
    try:
        if args and not args[0].startswith("-"):
            command = main.get_command(click.Context(main), args[0])
            assert command is not None, f"{where}: unknown command in {line!r}"
            command.make_context(args[0], list(args[1:]))
        else:
            main.make_context("hookcli", list(args))
    except click.exceptions.Exit:
        pass  # --version, --help
    except click.UsageError as exc:
        pytest.fail(f"{where}: {line!r}: {exc.format_message()}")


@pytest.mark.parametrize(("shown", "actual", "info", "same"), [
    ("loss 0.01144 at step 8", "loss 0.01093 at step 8", "rel=0.1", True),   # a training run's block
    ("loss 0.01144 at step 8", "loss 0.01093 at step 8", "", False),         # any other block
    ("loss 0.01144 at step 8", "loss 0.01293 at step 8", "rel=0.1", False),  # beyond 10%
    ("loss 0.01144 at step 8", "loss 0.01144 at step 9", "rel=0.1", True),   # (9 vs 8: see below)
    ("value 6.143e-08 limit 0.001", "value 1.2e-07 limit 0.001", "abs=1e-6", True),  # rounding noise
    ("value 6.143e-08 limit 0.001", "value 1.2e-07 limit 0.001", "rel=0.1", False),
    ("12 rules · 11 passed", "12 rules · 10 passed", "rel=0.5 abs=5", False),  # counts exactly, always
])
def test_a_training_runs_block_declares_its_tolerance(shown: str, actual: str, info: str, same: bool) -> None:
    """``rel=`` / ``abs=`` on a console fence's line: its decimals may differ by that much; integers never."""
    within = tolerance(info)
    if "step 9" in actual:
        assert same_output([shown], [actual], within) is False  # a step is an integer: exact
        return
    assert same_output([shown], [actual], within) is same


@pytest.mark.parametrize("info", ["tol=0.1", "rel", "rel=1.5", "abs=-1"])
def test_an_unknown_or_bad_block_tolerance_is_an_error(info: str) -> None:
    with pytest.raises(ValueError):
        tolerance(info)


def test_only_training_runs_declare_a_tolerance() -> None:
    """A tolerance hides real changes: only blocks that train (``--steps``) or report on a trained
    log have one, and they say so in the text shown before them."""
    declared = 0
    for path in DOCS:
        for fence in fences(path.read_text().splitlines()):
            if fence.lang == "console" and fence.tolerance != EXACT:
                commands = [c.line for c in parse_transcript(fence.body)[1]]
                assert any("--steps" in c or c.startswith("hookcli report") for c in commands), \
                    f"{rel(path)}:{fence.line_no}: a tolerance on a block that trains nothing"
                declared += 1
    assert declared >= 1


@pytest.mark.parametrize(("shown", "actual", "same"), [
    ("fc  Linear  0.008655  42.8 ok", "fc  Linear  0.008656  42.8 ok", True),   # one unit in the last digit
    ("fc  Linear  0.008655  42.8 ok", "fc  Linear  0.008654  42.8 ok", True),
    ("fc  Linear  0.008655  42.8 ok", "fc  Linear  0.008657  42.8 ok", False),  # two units: a real change
    ("max abs 0.009999 ok", "max abs   0.01 ok", True),                         # rounds over, re-padded
    ("max abs 0.01 ok", "max abs 0.019 ok", False),                             # judged at the finer digit
    ("norm 4.2e-05 ok", "norm 4.3e-05 ok", True),
    ("norm 4.2e-05 ok", "norm 4.2e-06 ok", False),
    ("2 rows · 0 with NaN", "3 rows · 0 with NaN", False),                    # integers (counts) exactly
    ("input [1, 3, 64, 64]", "input [1, 3, 64, 65]", False),                  # shapes exactly
    ("RuntimeError: addmm: mat1", "RuntimeError: mat1", False),                # words never
    ("Layer  Mean", "Layer Mean", True),                                        # padding alone
])
def test_transcripts_allow_one_unit_in_the_last_printed_digit_and_nothing_else(shown: str, actual: str,
                                                                             same: bool) -> None:
    """What a documented output may differ by across torch releases (``same_output``)."""
    assert same_output([shown], [actual]) is same
    assert same_output([shown], [actual, ""]) is False  # another line count is never the same


def test_commands_without_output_parse() -> None:
    """Commands in bash/yaml blocks and in the configs' comments are not run (they need your files or
    take long), but their commands, options and option values are hookcli's."""
    checked = 0
    for path in DOCS:
        for fence in fences(path.read_text().splitlines()):
            if fence.lang in ("bash", "sh", "yaml", "yml"):
                for line in _shell_hookcli_commands("\n".join(fence.body)):
                    _parse_cli(line, f"{rel(path)}:{fence.line_no}")
                    checked += 1
    for config in CONFIGS:
        for line in config.read_text().splitlines():
            comment = line.partition("#")[2].strip()
            if comment.startswith("hookcli "):
                _parse_cli(comment, rel(config))
                checked += 1
    assert checked >= 10


#: A MODEL (or a config's ``model``) named by import path: ``pkg.mod:attr``.
IMPORT_PATH = re.compile(r"^(?P<module>[A-Za-z_][\w.]*):[A-Za-z_]\w*$")


def _run_commands() -> Iterator[tuple[str, str]]:
    """Every ``$ hookcli ...`` line of the docs' console blocks (the commands that are run), and where."""
    for path in DOCS:
        for fence in fences(path.read_text().splitlines()):
            if fence.lang == "console":
                yield from ((c.line, f"{rel(path)}:{fence.line_no}") for c in parse_transcript(fence.body)[1])


def test_every_model_the_docs_run_resolves_from_the_repository_root() -> None:
    """A documented command that is run must run as a user types it, in a clone's root (shown-only
    commands in bash blocks name the user's own ``mypkg.models:Net``): a MODEL import path must
    resolve from there (hookcli puts the working folder on sys.path), not only with tests/ on sys.path
    as under pytest (``tiny_models:MakesNaN`` did; ``tests/tiny_models.py:MakesNaN`` is the form)."""
    from hookcli.options import FILE, IMPORT, source_of

    modules: dict[str, str] = {}
    files: dict[str, str] = {}
    for line, where in _run_commands():
        for token in shlex.split(line, comments=True):
            if (m := IMPORT_PATH.match(token)) and source_of(token) is IMPORT:
                modules.setdefault(m["module"], f"{where}: {token}")
            elif ":" in token and source_of(token) is FILE:
                files.setdefault(token.rpartition(":")[0], f"{where}: {token}")
    assert files, "the docs run no model file: this test checks nothing"
    missing = [shown for name, shown in files.items() if not (ROOT / name).is_file()]
    code = ("import importlib.util, sys\n"
            "print('\\n'.join(m for m in sys.argv[1:] if importlib.util.find_spec(m.split('.')[0]) is None))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code, *modules], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=scaled_timeout(60), check=True)
    missing += [modules[m] for m in done.stdout.split()]
    assert not missing, f"models named in the docs that do not resolve from the repository root: {missing}"


def _all_option_names() -> set[str]:
    from hookcli.cli import main

    names: set[str] = set()
    commands = [main, *main.commands.values()]
    for command in commands:
        for param in command.params:
            names.update(o for o in [*param.opts, *getattr(param, "secondary_opts", [])] if o.startswith("--"))
    return names


# Flags the docs name that are not parameters: --help (Click's), and other tools' flags.
OTHER_TOOLS_FLAGS = {"--help", "--index-url", "--update-docs", "--upgrade", "--quiet", "--disable-pip-version-check",
                     "--fix",  # (ruff check --fix)
                     "--nproc-per-node"}  # (torchrun's)


def test_every_flag_named_in_the_docs_exists() -> None:
    known = _all_option_names() | OTHER_TOOLS_FLAGS
    for path in DOCS:
        text = path.read_text()
        code = " ".join(re.findall(r"`([^`\n]+)`", text))
        unknown = sorted({flag for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", code)} - known)
        assert not unknown, f"{rel(path)} names options hookcli does not have: {unknown}"


# --------------------------------------------------------------------------- other snippets


def test_toml_snippets_parse_and_shown_configs_match_their_files() -> None:
    for path in DOCS:
        for fence in fences(path.read_text().splitlines()):
            if fence.lang != "toml":
                continue
            text = "\n".join(fence.body)
            tomllib.loads(text)
            first = fence.body[0] if fence.body else ""
            shown = re.fullmatch(r"# (configs/[\w.-]+\.toml)", first.strip())
            if shown:  # a block that says it is a config file shows that file, verbatim
                assert "\n".join(fence.body[1:]).strip() == (ROOT / shown[1]).read_text().strip(), \
                    f"{rel(path)}:{fence.line_no}: differs from {shown[1]}"


# --------------------------------------------------------------------------- links and references


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    lines = path.read_text().splitlines()
    code = {i for f in fences(lines) for i in range(f.start - 1, f.end + 1)}
    slugs: set[str] = set()
    seen: dict[str, int] = {}
    for i, line in enumerate(lines):
        m = re.match(r"#{1,6} (.+)", line)
        if m and i not in code:
            slug = _slug(m[1])
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            slugs.add(slug if n == 0 else f"{slug}-{n}")
    return slugs


def _prose(path: Path) -> str:
    """The page without its code blocks (links inside code are not links)."""
    lines = path.read_text().splitlines()
    code = {i for f in fences(lines) for i in range(f.start - 1, f.end + 1)}
    return "\n".join(line for i, line in enumerate(lines) if i not in code)


def test_every_relative_link_resolves() -> None:
    checked = 0
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(path)):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            assert dest.exists(), f"{rel(path)}: link to {target!r}: no such file"
            if anchor and dest.suffix == ".md":
                assert anchor in _anchors(dest), f"{rel(path)}: link to {target!r}: no heading with that anchor"
            checked += 1
    assert checked >= 20


REPO_PATH = re.compile(r"(?<![\w/.-])((?:configs|docs|benchmarks|tests|hookcli|\.ci)/[\w./-]*[\w])(?:#([\w-]+))?")


def test_every_path_the_docs_and_configs_name_exists() -> None:
    """Paths like configs/resnet18.toml or docs/check.md named in README.md, docs/ and the configs' comments."""
    written_by_examples = {"docs/images/conv1_fmaps.png"}
    sources = [*DOCS, *CONFIGS, ROOT / "configs" / "example_model.py"]
    for source in sources:
        for name, anchor in REPO_PATH.findall(source.read_text()):
            if name in written_by_examples:
                continue
            assert (ROOT / name).exists(), f"{rel(source)} names {name}, which does not exist"
            if anchor and name.endswith(".md"):
                assert anchor in _anchors(ROOT / name), f"{rel(source)} names {name}#{anchor}: no such heading"


def test_every_config_is_documented_and_points_at_existing_docs() -> None:
    everything = "\n".join(p.read_text() for p in DOCS)
    for config in CONFIGS:
        assert rel(config) in everything, f"{rel(config)} is not mentioned in README.md or docs/"
    assert "docs/check.md" in (ROOT / "configs" / "resnet18.toml").read_text()


def test_there_is_a_page_per_command_and_the_readme_links_them() -> None:
    from hookcli.cli import main

    readme = (ROOT / "README.md").read_text()
    commands = sorted(main.commands)  # every command the CLI has, not a list kept by hand
    assert {"shapes", "watch", "report"} <= set(commands)
    for name in [*(PAGE_OF.get(c, c) for c in commands), "json-format", "ci", "python-api", "performance"]:
        assert (ROOT / "docs" / f"{name}.md").exists(), f"docs/{name}.md is missing"
        assert f"(docs/{name}.md" in readme, f"README.md does not link docs/{name}.md"
    for name in commands:
        assert f"$ hookcli {name}" in readme, f"README.md shows no example of hookcli {name}"


def test_ci_runs_the_readme_set_up_commands() -> None:
    """The README's two set-up commands are what .ci/run runs on a clean clone (keep them in sync)."""
    readme = (ROOT / "README.md").read_text().splitlines()
    setup = next(f for f in fences(readme) if f.lang == "bash")
    commands = [part.strip() for line in setup.body for part in line.split("#")[0].split("&&") if part.strip()]
    assert commands[0].startswith("pip install -e") and "hookcli shapes resnet50" in commands
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    for command in commands:
        words = shlex.split(command)
        assert any(_same_command(words, line) for line in ci_lines), f".ci/run does not run {command!r}"


def _same_command(words: list[str], line: str) -> bool:
    """``pip install -e ".[test]"`` in the README is .ci/run's line, give or take pip's output flags."""
    try:
        ci = shlex.split(line, comments=True)
    except ValueError:
        return False
    quiet = {"--quiet", "-q", "--disable-pip-version-check"}
    ci = [w for w in ci if w not in quiet]
    ci = ci[2:] if ci[:2] == ["python", "-m"] and words[0] != "python" else ci
    return ci == words


def test_readme_stays_a_front_door() -> None:
    """About 13 KB: what hookcli is, set-up, one example per command (eleven of them since watch and
    report), exit codes, CI, links. Reference material belongs in docs/ (the README was a 56 KB manual once)."""
    size = len((ROOT / "README.md").read_bytes())
    assert size <= 13_500, f"README.md is {size} bytes: move detail into docs/ (the front door is about 13 KB)"
