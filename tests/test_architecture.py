"""The package's shape, enforced: dependencies point one way and nothing else registers hooks.

cli -> api -> commands -> engine -> records; render -> records; the shared leaves (errors, options,
config, output, progress, _version) import only each other and records. Imports are read from the source
with ``ast`` (lazy imports inside functions count: they are dependencies too; ``if TYPE_CHECKING:``
blocks do not).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "hookcli"

LEAVES = {"hookcli._version", "hookcli.errors", "hookcli.options", "hookcli.config", "hookcli.output",
          "hookcli.progress", "hookcli.targets", "hookcli.escape", "hookcli.limits"}

#: layer -> the layers it may import (besides itself, the leaves and records).
ALLOWED = {
    "cli": {"api", "render"},
    "integrations": {"api", "render"},  # the training libraries' callbacks, over the public API
    "api": {"commands"},
    "commands": {"engine"},
    "engine": set(),
    "render": set(),
    "records": set(),
    "leaf": set(),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> str:
    if module in LEAVES:
        return "leaf"
    if module in ("hookcli", "hookcli.api", "hookcli.__main__"):
        return "api" if module != "hookcli.__main__" else "cli"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "api"


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node except the bodies of ``if TYPE_CHECKING:`` blocks."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                yield child
                yield from _walk(child)
            continue
        yield node
        yield from _walk(node)


def imports(path: Path, known: set[str]) -> set[str]:
    """The hookcli modules ``path`` imports (``from pkg import sub`` counts as ``pkg.sub``), plus
    every third-party top-level package it imports, as ``ext:NAME``."""
    found: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in _walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.name
                found.add(name if name.startswith("hookcli") else "ext:" + name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if not node.module.startswith("hookcli"):
                found.add("ext:" + node.module.split(".")[0])
                continue
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports(path, known) for name, path in mods.items()}


def test_dependencies_point_one_way() -> None:
    wrong = []
    for module, deps in graph().items():
        mine = layer(module)
        for dep in deps:
            if dep.startswith("ext:") or dep == module:
                continue
            theirs = layer(dep)
            if theirs in (mine, "leaf", "records") or theirs in ALLOWED[mine]:
                continue
            if dep == "hookcli" and mine == "api":
                continue
            wrong.append(f"{module} ({mine}) imports {dep} ({theirs})")
    assert not wrong, "imports against the direction cli -> api -> commands -> engine -> records:\n" + "\n".join(
        sorted(wrong))


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    edges = {m: {d for d in deps if not d.startswith("ext:") and d != m} for m, deps in graph().items()}
    # a package's __init__ re-exporting its own submodules is not a cycle of the design
    for module in edges:
        edges[module] = {d for d in edges[module] if not module.startswith(d + ".")}
    assert _cycles(edges) == []


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_render_and_records_never_import_torch() -> None:
    for module, deps in graph().items():
        if layer(module) in ("render", "records"):
            heavy = {d for d in deps if d in ("ext:torch", "ext:numpy", "ext:torchvision")}
            assert not heavy, f"{module} imports {heavy}: renderers read plain records only"


HOOK_CALLS = ("register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
              "register_backward_hook", "register_full_backward_pre_hook", "register_hook",
              "register_module_forward_hook", "register_module_forward_pre_hook",
              "register_post_accumulate_grad_hook", "register_step_pre_hook", "register_step_post_hook",
              "register_optimizer_step_pre_hook", "register_optimizer_step_post_hook")


#: The modules that register hooks: ``engine.session`` (the recording's gradient hooks on output and input
#: tensors, ``--clip``'s on parameters) and ``engine.hooks`` (everything put on a model, an optimizer or the
#: process, and taken off again).
HOOK_MODULES = {"hookcli.engine.session", "hookcli.engine.hooks"}


@pytest.mark.parametrize("name", HOOK_CALLS)
def test_only_the_engine_hook_modules_register_hooks(name: str) -> None:
    """No module but ``HOOK_MODULES`` names a hook-registration function: as a method or attribute
    (``module.register_forward_hook``), a bare name or an imported one (``register_module_forward_hook``)."""
    callers = set()
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if ((isinstance(node, ast.Attribute) and node.attr == name)
                    or (isinstance(node, ast.Name) and node.id == name)
                    or (isinstance(node, ast.alias) and node.name.rsplit(".", 1)[-1] == name)):
                callers.add(module)
    assert callers <= HOOK_MODULES, f"{name} called outside the engine's hook modules: {callers - HOOK_MODULES}"


@pytest.mark.parametrize(("name", "builder"), [("WatchLayer", "hookcli.engine.step_rows"),
                                               ("WatchParam", "hookcli.engine.step_rows"),
                                               ("ParamRecord", "hookcli.engine.session")])
def test_a_step_s_rows_are_built_in_one_place(name: str, builder: str) -> None:
    """A logged step, the flight recorder's steps and a step merged over the ranks all make their rows
    with ``engine.step_rows`` (``watch_layers``, ``watch_param``); a run's parameters, a hook set's step
    and ``grads`` over batches with ``session.param_record``: no other module constructs them."""
    callers = set()
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == name:
                callers.add(module)
    assert callers == {builder}, f"{name} built outside {builder}: {callers}"


def test_every_public_api_function_is_on_the_package_without_importing_torch() -> None:
    """``hookcli.X`` is ``hookcli.api.X`` for every name the API exports, and importing the package
    (what ``hookcli --help`` does) leaves torch unimported."""
    import subprocess
    import sys

    code = ("import sys, hookcli, hookcli.api as api; "
            "assert all(getattr(hookcli, n) is getattr(api, n) for n in api.__all__), 'missing'; "
            "assert set(api.__all__) <= set(hookcli.__all__); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


#: The engine's run loop owns these: the hook session's reducer, which module's gradient came last
#: (backward failure blame), the ``extra`` vectors riding on the records' host transfer, and ``attach``
#: itself (a command runs the model through ``engine.run.run_step``/``run_model``/``forward_report``).
ENGINE_PRIVATE = {"reducer", "last_grad_call", "attach", "HookSession"}


def test_commands_use_the_engines_public_face_only() -> None:
    """Commands import no private (``_name``) engine name and never touch the hook session's inner
    parts: the one run loop (``engine.run.run_step``) does that for every command."""
    wrong = []
    for module, path in modules().items():
        if layer(module) != "commands":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hookcli.engine"):
                wrong += [f"{module} imports {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") or a.name in ENGINE_PRIVATE]
            elif isinstance(node, ast.Attribute) and node.attr in ENGINE_PRIVATE:
                wrong.append(f"{module} uses .{node.attr}")
            elif isinstance(node, ast.Name) and node.id in ENGINE_PRIVATE:
                wrong.append(f"{module} uses {node.id}")
            elif isinstance(node, ast.keyword) and node.arg == "extra":
                wrong.append(f"{module} passes extra=")
    assert not wrong, "commands reaching into the engine:\n" + "\n".join(sorted(set(wrong)))


def _top_level_names(tree: ast.Module) -> Iterator[str]:
    """The functions, classes and constants a module defines at its top level."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name
        elif isinstance(node, ast.Assign):
            yield from (t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            yield node.target.id


def test_no_dead_code_every_top_level_name_is_used_somewhere() -> None:
    """ruff finds unused imports and locals, not a public function or constant nothing calls: a name
    defined at a module's top level must be named again somewhere (hookcli, tests, benchmarks, docs)."""
    import re

    root = PACKAGE.parent
    sources = [*root.glob("hookcli/**/*.py"), *root.glob("tests/**/*.py"), *root.glob("benchmarks/**/*.py"),
               *root.glob("docs/*.md"), root / "README.md", root / "setup.py"]
    words: dict[str, int] = {}
    for path in sources:
        for word in re.findall(r"\w+", path.read_text(encoding="utf-8")):
            words[word] = words.get(word, 0) + 1
    unused = sorted(f"{name}.{defined}" for name, path in modules().items()
                    for defined in _top_level_names(ast.parse(path.read_text(encoding="utf-8")))
                    if not defined.startswith("__") and words.get(defined, 0) <= 1)
    assert not unused, f"defined but never used (delete, or use it): {unused}"


#: The most lines a function may take, from its ``def`` to its last line.
MAX_FUNCTION_LINES = 80
#: ``path:function`` allowed over it (none).
LONG_FUNCTIONS: set[str] = set()


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """The functions (methods and nested ones too) of ``path`` longer than ``limit`` lines, with their
    lengths (``def`` line to end line: decorators are not counted)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno is not None and node.end_lineno - node.lineno + 1 > limit]


def test_no_function_is_over_80_lines() -> None:
    found = {f"{path.relative_to(PACKAGE).as_posix()}:{name}": lines
             for path in sorted(PACKAGE.rglob("*.py")) for name, lines in long_functions(path)}
    over = sorted(f"{where} ({lines} lines)" for where, lines in found.items() if where not in LONG_FUNCTIONS)
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (split them into named helpers):\n" + "\n".join(over)


def test_the_function_length_check_counts_def_to_end(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    source.write_text(f"def long():\n{body}\n\nclass C:\n    def short(self):\n        return 1\n")
    assert long_functions(source) == [("long", 81)]
    assert long_functions(source, limit=81) == []


def test_the_run_loop_takes_a_plan_not_per_feature_flags() -> None:
    """``engine.run.run_step`` keeps its phases and hands what a run records to collectors
    (``engine.collectors``): at most 8 parameters and under 60 lines."""
    tree = ast.parse((PACKAGE / "engine" / "run.py").read_text())
    (run_step,) = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "run_step"]
    arguments = run_step.args
    count = len(arguments.posonlyargs) + len(arguments.args) + len(arguments.kwonlyargs)
    assert count <= 8 and arguments.vararg is None and arguments.kwarg is None, ast.dump(arguments)
    assert run_step.end_lineno - run_step.lineno + 1 < 60


def test_the_hook_session_knows_no_particular_tap() -> None:
    """What the hooks record of each call's tensors is a tap (``engine.taps``), handed to the session: the
    session imports no particular tap and has no per-feature switch, so a new measurement is a new tap,
    not an edit of the session's hot path."""
    tree = ast.parse((PACKAGE / "engine" / "session.py").read_text())
    from_taps = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                 and node.module == "hookcli.engine.taps" for alias in node.names}
    assert from_taps == {"Tap", "overrides"}
    switches = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Attribute) and node.value.attr == "options"}
    assert not switches, f"the session reads per-feature options: {sorted(switches)}"


#: Private attributes of other objects hookcli must write, each with its reason: (module, object
#: expression, attribute) -> why. Everything else writes only its own (``self._x``, ``cls._x``).
FOREIGN_PRIVATE_WRITES: dict[tuple[str, str, str], str] = {
    ("hookcli.commands.diff", "fits", "_metadata"):
        "torch's state dicts carry their modules' versions in this attribute, which load_state_dict reads "
        "(torch sets it the same way); a filtered copy must keep it",
    ("hookcli.commands.watch_tensorboard", "queue", "_writer"):
        "TensorBoard's event-file writer has no public way to replace its record writer: the guard that "
        "keeps a full disk from killing its thread goes in here",
    ("hookcli.commands.watch_tensorboard", "worker", "_record_writer"):
        "the same record writer as held by TensorBoard's writer thread (both must be the guard)",
}


def _private_writes(tree: ast.AST) -> Iterator[tuple[int, str, str]]:
    """(line, object expression, attribute) of each assignment to a private attribute (``_name``, not a
    dunder) of an object other than ``self``/``cls``: an assigned, augmented or annotated target (inside
    tuples and lists too) and ``setattr(obj, "_name", ...)`` with a literal name."""
    def foreign(value: ast.expr) -> bool:
        return not (isinstance(value, ast.Name) and value.id in ("self", "cls"))

    def private(attr: str) -> bool:
        return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))

    def targets(node: ast.expr) -> Iterator[ast.expr]:
        if isinstance(node, (ast.Tuple, ast.List)):
            for item in node.elts:
                yield from targets(item)
        elif isinstance(node, ast.Starred):
            yield from targets(node.value)
        else:
            yield node

    for node in ast.walk(tree):
        found: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            found = [t for target in node.targets for t in targets(target)]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            found = list(targets(node.target))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and private(node.args[1].value) and foreign(node.args[0])):
            yield node.lineno, ast.unparse(node.args[0]), node.args[1].value
        for target in found:
            if isinstance(target, ast.Attribute) and private(target.attr) and foreign(target.value):
                yield target.lineno, ast.unparse(target.value), target.attr


def test_no_module_writes_another_objects_private_attributes() -> None:
    """A private attribute (``_name``) is written by its own object only (``self._x = ...``): hookcli never
    sets the inner state of another of its objects, of torch's or of a library's from outside, except the
    few in ``FOREIGN_PRIVATE_WRITES``, each with its reason."""
    wrong = []
    for module, path in modules().items():
        for line, obj, attr in _private_writes(ast.parse(path.read_text())):
            if (module, obj, attr) not in FOREIGN_PRIVATE_WRITES:
                wrong.append(f"{module}:{line}: {obj}.{attr}")
    assert not wrong, "writes to another object's private attribute:\n" + "\n".join(wrong)


def test_the_private_write_finder_finds_each_form() -> None:
    source = ("a._x = 1\nself._ok = 2\nb.c._y += 1\nd._z: int = 3\ne, f._w = 1, 2\nsetattr(g, '_v', 1)\n"
              "setattr(self, '_fine', 1)\ncls._fine = 1\nh.public = 1\nsetattr(i, 'public', 1)\nj.__dict__ = {}\n")
    assert [(obj, attr) for _, obj, attr in _private_writes(ast.parse(source))] == [
        ("a", "_x"), ("b.c", "_y"), ("d", "_z"), ("f", "_w"), ("g", "_v")]
    assert set(FOREIGN_PRIVATE_WRITES) <= {(m, o, a) for m, p in modules().items()
                                           for _, o, a in _private_writes(ast.parse(p.read_text()))}
