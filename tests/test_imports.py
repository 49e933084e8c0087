"""No import cycles: the import graphs of the package uacompile (its folders as setup.cfg's package_dir
maps them) and of the bench scripts, read from the sources with ast.

Every import counts wherever it is written (module level or inside a function), and so does
importlib.import_module with a constant name: a cycle hidden in a function is still a cycle. Only
imports under `if TYPE_CHECKING:` are left out (they never run). `from P import x` is an edge to the
submodule P.x where there is one, else to P itself; the implicit import of a parent package's
__init__ is no edge (every submodule has it)."""
from __future__ import annotations

import ast
import configparser
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent


def package_modules(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (source file, is a package __init__), through setup.cfg's package_dir."""
    cfg = configparser.ConfigParser()
    cfg.read(root / "setup.cfg")
    mapping = {}
    for line in cfg.get("options", "package_dir").strip().splitlines():
        pkg, _, folder = (x.strip() for x in line.partition("="))
        mapping[pkg] = folder
    mods: dict[str, tuple[Path, bool]] = {}
    for pkg, folder in mapping.items():
        for f in sorted((root / folder).rglob("*.py")):
            parts = [p for p in f.relative_to(root / folder).with_suffix("").parts if p != "__init__"]
            mods.setdefault(".".join([pkg, *parts]), (f, f.name == "__init__.py"))
    return mods


def bench_modules(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """The bench scripts import each other by their bare names (bench/ is on their sys.path)."""
    return {f.stem: (f, False) for f in sorted((root / "bench").glob("*.py"))}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (or typing.TYPE_CHECKING)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                skip.update(id(n) for n in ast.walk(stmt))
    return skip


def imported_names(module: str, is_pkg: bool, tree: ast.AST):
    """(absolute dotted name, line, from_names) of every import in a module's source; from_names are
    the names a `from` import takes (None for `import x` and import_module)."""
    package = module if is_pkg else module.rpartition(".")[0]

    def absolute(name: str, level: int) -> str:
        if not level:
            return name
        base = package.split(".")
        base = base[:len(base) - (level - 1)]
        return ".".join(base + ([name] if name else []))

    skip = _type_checking_nodes(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno, None
        elif isinstance(node, ast.ImportFrom):
            yield absolute(node.module or "", node.level), node.lineno, [a.name for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            name = node.args[0].value
            level = len(name) - len(name.lstrip("."))
            yield absolute(name.lstrip("."), level), node.lineno, None


def import_graph(mods: dict[str, tuple[Path, bool]]) -> nx.DiGraph:
    """module -> module edges (attribute `at`: file:line of the import) among mods."""
    g = nx.DiGraph()
    g.add_nodes_from(mods)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    for m, (path, is_pkg) in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        for name, line, from_names in imported_names(m, is_pkg, tree):
            targets = []
            for n in from_names or [None]:
                sub = f"{name}.{n}" if n else None
                targets.append(sub if sub in mods else resolve(name))
            for t in targets:
                if t and t != m and not g.has_edge(m, t):
                    g.add_edge(m, t, at=f"{path.relative_to(ROOT)}:{line}")
    return g


def cycles(g: nx.DiGraph) -> list[str]:
    """One line a strongly connected group of modules: the group, and one loop through it with where
    each import is written."""
    out = []
    for group in sorted((sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1)):
        loop = nx.find_cycle(g.subgraph(group), group[0])
        path = " -> ".join(f"{a} ({g.edges[a, b]['at']})" for a, b in loop) + f" -> {loop[0][0]}"
        out.append(f"{{{', '.join(group)}}}: {path}")
    return out


def test_the_graph_sees_hidden_imports(tmp_path):
    """Imports inside functions and import_module with a constant name are edges; TYPE_CHECKING ones are not."""
    (tmp_path / "setup.cfg").write_text("[options]\npackage_dir =\n    pkg = src\n    pkg.sub = other\n")
    (tmp_path / "src").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "src" / "__init__.py").write_text("")
    (tmp_path / "src" / "a.py").write_text("def f():\n    from .sub import b\n")
    (tmp_path / "src" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    (tmp_path / "other" / "__init__.py").write_text("")
    (tmp_path / "other" / "b.py").write_text("import importlib\nX = importlib.import_module('pkg.a')\nfrom .. import c\n")
    mods = package_modules(tmp_path)
    assert set(mods) == {"pkg", "pkg.a", "pkg.c", "pkg.sub", "pkg.sub.b"}
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        g = import_graph(mods)
    finally:
        ROOT = old
    assert set(g.edges) == {("pkg.a", "pkg.sub.b"), ("pkg.sub.b", "pkg.a"), ("pkg.sub.b", "pkg.c")}
    assert cycles(g) == ["{pkg.a, pkg.sub.b}: pkg.a (src/a.py:2) -> pkg.sub.b (other/b.py:2) -> pkg.a"]


@pytest.mark.parametrize("where", ["package", "bench"])
def test_no_import_cycles(where):
    mods = package_modules() if where == "package" else bench_modules()
    assert len(mods) > 10
    found = cycles(import_graph(mods))
    assert not found, f"import cycles in the {where}:\n" + "\n".join(found)
