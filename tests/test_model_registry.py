"""One registry of model sources (issue #21): ``hookcli.options.MODEL_SOURCES``.

Loading, a config's confinement, ``hookcli models`` and the help texts all read it; these tests fail when
a place keeps a list of its own (a prefix written out again, a source without a loader, a listed name
that loading would take for another source).
"""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import pytest

import hookcli
from hookcli.engine.loading import LOADERS
from hookcli.options import LISTED_SOURCES, MODEL_SOURCES, source_of

PACKAGE = Path(hookcli.__file__).parent
PREFIXES = {source.prefix for source in MODEL_SOURCES if source.prefix}


def test_no_module_but_the_registry_writes_a_source_prefix_out() -> None:
    """``"timm:"``, ``"hf:"`` and ``"torchvision:"`` as string constants live in hookcli/options.py only:
    a second copy (a ``startswith(("timm:", ...))`` in the config reader, say) is a list of its own."""
    copies = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "options.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.lower() in PREFIXES:
                copies.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.value!r}")
    assert not copies


def test_every_source_has_a_loader_and_its_example_is_told_apart_as_it() -> None:
    assert set(LOADERS) == {source.kind for source in MODEL_SOURCES}
    assert len({source.kind for source in MODEL_SOURCES}) == len(MODEL_SOURCES)
    for source in MODEL_SOURCES:
        assert source_of(source.example) is source, source.kind
        assert source.config in ("any", "own folder", "own module", "own file"), source.kind
        if source.prefix:  # any case, as users type it
            assert source_of(" " + source.prefix.upper() + "x ") is source


def test_help_names_every_source_and_models_offers_every_listed_one(cli) -> None:
    result = cli("--help")
    assert result.exit_code == 0 and not result.stderr
    text = " ".join(result.stdout.split())  # Click wraps the help text
    for source in MODEL_SOURCES:
        assert " ".join(source.help.split()) in text and source.example in text, source.kind
    result = cli("models", "--help")
    assert result.exit_code == 0
    assert "[" + "|".join(LISTED_SOURCES) + "]" in " ".join(result.stdout.split())
    assert LISTED_SOURCES == tuple(source.kind for source in MODEL_SOURCES if source.listed)


@pytest.mark.parametrize("kind", LISTED_SOURCES)
def test_every_name_models_lists_is_loaded_as_the_source_it_was_listed_for(cli, kind: str) -> None:
    needs = {"timm": "timm", "hf": "transformers"}.get(kind)
    if needs and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{needs} is not installed")
    result = cli("models", "--source", kind, "-f", "json")
    assert result.exit_code == 0, result.stderr
    names = [row["name"] for row in json.loads(result.stdout)["models"]]
    assert names
    assert {source_of(name).kind for name in names} == {kind}
