"""The import graph of ``pp_core`` and the built-in plugins, read from the source with ``ast``.

DESIGN.md's Layout rules, checked on every import statement, including those inside functions
(a function-local import is still an edge: it only moves the cycle from import time to call
time): the graph has no cycle; ``pp_core.schedule`` imports neither torch nor
``pp_core.runtime``; the library (``pp_core`` outside ``pp_core.app``) never imports the
application; the schedule command's module never imports torch at its top level.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = ROOT / "plugins"
# Old import paths users were told to import, each only re-exporting the module that replaced
# it; an alias imports downwards like any module, so it needs no exemption from the layers.
# None is kept today (pp_core.app.checkpoint went in step 4: import pp_core.checkpoint).
COMPATIBILITY_PATHS: dict[str, str] = {}
# `python -m pp_core` is the application's command line, like the console script
APP_ENTRY_POINTS = {"pp_core.__main__"}


def module_files() -> dict[str, Path]:
    """``{dotted module name: path}`` for every module of pp_core and of the built-in plugins."""
    found = {}
    for base, top in ((ROOT, "pp_core"), (PLUGINS, "pp_core_builtins")):
        for path in sorted((base / top).rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            found[".".join(parts).removesuffix(".__init__")] = path
    return found


def _is_package(module: str, files: dict[str, Path]) -> bool:
    return files[module].name == "__init__.py"


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Nodes under ``if TYPE_CHECKING:``: read by type checkers, never run, so not edges."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def imports_of(module: str, files: dict[str, Path],
               type_checking: bool = False) -> list[tuple[str, int, bool]]:
    """``(imported module, line, at top level)`` for every import that runs in ``module`` (and
    those under ``if TYPE_CHECKING:`` too, with ``type_checking``).

    ``from a import b`` counts as an import of ``a.b`` when that is a module of ours, else of
    ``a``; relative imports are resolved against the module's package.
    """
    tree = ast.parse(files[module].read_text(), str(files[module]))
    package = module if _is_package(module, files) else module.rpartition(".")[0]
    skip = set() if type_checking else _type_checking_only(tree)
    top_level = {id(node) for node in tree.body}
    top_level |= {id(n) for node in tree.body if isinstance(node, (ast.If, ast.Try))
                  for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        at_top = id(node) in top_level
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, at_top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.append((sub if sub in files else source, node.lineno, at_top))
    return found


def graph(files: dict[str, Path], type_checking: bool = False) -> dict[str, dict[str, int]]:
    """``{module: {imported module of ours: line}}``. Importing ``a.b.c`` runs ``a`` and
    ``a.b`` too (their ``__init__``), so those are edges as well - except a package that holds
    the importer: Python has started it before the importer, so only an explicit import of it
    (``from pp_core import X`` inside ``pp_core``) is an edge."""
    edges: dict[str, dict[str, int]] = {name: {} for name in files}
    for module in files:
        for target, line, _ in imports_of(module, files, type_checking):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                name = ".".join(parts[:i])
                implicit_parent = module.startswith(name + ".") and name != target
                if name in files and name != module and not implicit_parent:
                    edges[module].setdefault(name, line)
    return edges


def find_cycle(edges: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle as ``[a, b, ..., a]``, or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def describe(cycle: list[str], edges) -> str:
    return " -> ".join(f"{a} (line {edges[a][b]})" for a, b in zip(cycle, cycle[1:])) + \
        f" -> {cycle[-1]}"


def test_import_graph_has_no_cycle():
    files = module_files()
    assert "pp_core.schedule.ir" in files and "pp_core_builtins.schedules.gpipe" in files
    edges = graph(files)
    cycle = find_cycle(edges)
    assert cycle is None, f"import cycle: {describe(cycle, edges)}"


def test_import_graph_has_no_cycle_counting_type_checking_imports():
    """A type named under ``TYPE_CHECKING`` from a room above is still a design tie: the hook
    specs once named the initializer Protocol from ``runtime/``, three floors up."""
    files = module_files()
    edges = graph(files, type_checking=True)
    cycle = find_cycle(edges)
    assert cycle is None, f"import cycle (TYPE_CHECKING imports counted): {describe(cycle, edges)}"


def _violations(prefix: str, forbidden, top_level_only: bool = False,
                exact: bool = False) -> list[str]:
    """Imports of ``forbidden`` modules in ``prefix`` (and below it, unless ``exact``)."""
    files = module_files()
    found = []
    for module in files:
        if module != prefix and (exact or not module.startswith(prefix + ".")):
            continue
        for target, line, at_top in imports_of(module, files):
            if top_level_only and not at_top:
                continue
            if any(target == f or target.startswith(f + ".") for f in forbidden):
                found.append(f"{files[module].relative_to(ROOT)}:{line} imports {target}")
    return found


def test_schedule_half_imports_neither_torch_nor_the_runtime():
    bad = _violations("pp_core.schedule", ("torch", "pp_core.runtime", "pp_core.app"))
    assert not bad, bad


def test_library_never_imports_the_application():
    files = module_files()
    library = [m for m in files if not m.startswith("pp_core.app") and m not in APP_ENTRY_POINTS]
    bad = [v for module in library for v in _violations(module, ("pp_core.app",), exact=True)]
    assert not bad, bad


def test_compatibility_paths_only_re_export_the_new_module():
    files = module_files()
    for old, new in COMPATIBILITY_PATHS.items():
        tree = ast.parse(files[old].read_text())
        body = tree.body[1:] if isinstance(tree.body[0], ast.Expr) else tree.body
        assert all(isinstance(node, ast.ImportFrom) and node.module == new for node in body), old
        assert "Compatibility path" in ast.get_docstring(tree), old


def test_validation_reaches_neither_the_launcher_nor_the_trainer():
    """``pp-core validate`` checks a file; what launches or trains must not be part of it."""
    files = module_files()
    edges = graph(files)
    seen, todo = set(), ["pp_core.app.check"]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(edges[module])
    assert not seen & {"pp_core.app.launch", "pp_core.app.rank"}, sorted(seen)


def test_schedule_command_imports_torch_only_lazily():
    """tests/schedule/test_schedule_torch_free.py runs the commands; this names the line at once."""
    bad = _violations("pp_core.app.commands.schedule", ("torch",), top_level_only=True)
    bad += _violations("pp_core.app.cli", ("torch",), top_level_only=True)
    assert not bad, bad


# What each room may import (docs/architecture.md): a room uses the rooms below it, never above.
# "core" is pp_core's top-level modules (config, errors, hookspecs, plugin_manager, ...);
# "facade" is pp_core/__init__.py, the public names.
BELOW_APP = {"core", "schedule", "planning", "parallel", "runtime"}
ALLOWED = {
    "core": {"core"},
    "schedule": {"core"},
    "planning": {"core", "schedule"},
    "parallel": {"core"},
    "runtime": {"core", "schedule", "planning", "parallel"},
    "measure": {"core", "schedule", "planning", "parallel", "runtime"},
    "checkpoint": {"core", "parallel"},
    "testing": BELOW_APP,
    "facade": {"core", "schedule", "runtime", "measure"},
    "builtins": BELOW_APP | {"facade", "measure"},
    "app": BELOW_APP | {"facade", "measure", "checkpoint"},
}


def room(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "pp_core_builtins":
        return "builtins"
    if len(parts) == 1:
        return "facade"
    return parts[1] if parts[1] in ALLOWED else "core"


def test_each_room_imports_only_the_rooms_below_it():
    """Type-only imports included: a type named from a room above is an arrow up all the same."""
    files = module_files()
    edges = graph(files, type_checking=True)
    bad = [f"{files[a].relative_to(ROOT)}:{line} ({room(a)}) imports {b} ({room(b)})"
           for a in sorted(edges) if a not in APP_ENTRY_POINTS for b, line in sorted(edges[a].items())
           if room(b) != room(a) and room(b) not in ALLOWED[room(a)]]
    assert not bad, "imports against docs/architecture.md's layers:\n" + "\n".join(bad)


def test_the_checker_sees_relative_and_function_local_imports(tmp_path):
    pkg = tmp_path / "pp_core"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import a\n")
    (pkg / "sub" / "a.py").write_text("def f():\n    from ..b import g\n")
    (pkg / "b.py").write_text("from pp_core.sub import a\n"
                             "if TYPE_CHECKING:\n    from pp_core import c\n")
    files = {"pp_core": pkg / "__init__.py", "pp_core.sub": pkg / "sub" / "__init__.py",
             "pp_core.sub.a": pkg / "sub" / "a.py", "pp_core.b": pkg / "b.py"}
    assert ("pp_core.b", 2, False) in imports_of("pp_core.sub.a", files)
    assert ("pp_core.sub.a", 1, True) in imports_of("pp_core.sub", files)
    assert [target for target, _, _ in imports_of("pp_core.b", files)] == ["pp_core.sub.a"]
    cycle = find_cycle(graph(files))
    assert cycle is not None and set(cycle) == {"pp_core.b", "pp_core.sub", "pp_core.sub.a"}


LAZY_TAG = re.compile(r"#\s*lazy:\s*\S")


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def untagged_local_imports(files: dict[str, Path]) -> list[str]:
    """``file:line`` of every function-local import (``TYPE_CHECKING`` ones aside) whose line,
    or the first line of the run of consecutive imports it belongs to, has no ``# lazy:``
    reason. A local import is there only to keep something heavy off a light path, and says
    which (DESIGN.md, Layout); one with no such reason belongs at the top of the module."""
    found = []
    for module, path in sorted(files.items()):
        source = path.read_text()
        lines, tree = source.splitlines(), ast.parse(source, str(path))
        skip = _type_checking_only(tree)
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                for field_name in ("body", "orelse", "finalbody", "handlers"):
                    block = getattr(node, field_name, None)
                    if not isinstance(block, list):
                        continue
                    head = None  # the first import of the current run of consecutive imports
                    for stmt in block:
                        if not isinstance(stmt, (ast.Import, ast.ImportFrom)):
                            head = None
                            continue
                        head = head or stmt
                        if id(stmt) in skip:
                            continue
                        if not any(LAZY_TAG.search(lines[n.lineno - 1]) for n in (stmt, head)):
                            found.append(f"{_shown(path)}:{stmt.lineno}: "
                                         f"{lines[stmt.lineno - 1].strip()}")
    return sorted(set(found))


def test_every_function_local_import_says_why_it_is_local():
    """Hoist it, or tag its line (or the first of a run of imports) ``# lazy: <reason>``."""
    bad = untagged_local_imports(module_files())
    assert not bad, (f"{len(bad)} function-local imports without a '# lazy: <reason>' "
                     f"comment (hoist them, or say why they are local):\n" + "\n".join(bad))


def test_the_lazy_tag_checker_sees_untagged_imports(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import os\n"
                    "def f():\n"
                    "    import torch  # lazy: torch\n"
                    "    import math\n"
                    "    x = 1\n"
                    "    import json\n"
                    "    if x:\n"
                    "        from a import (b,  # lazy: optional\n"
                    "                       c)\n"
                    "    if TYPE_CHECKING:\n"
                    "        import typing\n"
                    "class C:\n"
                    "    def g(self):\n"
                    "        import re  # a comment that is not a reason\n")
    found = [line.split(": ")[0] for line in untagged_local_imports({"m": path})]
    assert found == ["m.py:14", "m.py:6"]
