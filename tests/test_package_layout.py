"""The package's layout rules, read from the source with `ast` (no import of torch or of the package itself, < 1 s):

- no import cycles among herald_torchrec's modules, nor among benchmarks/' scripts: module-level AND function-level
  imports count (a function-level import only hides a cycle until the function runs), imports under
  `if TYPE_CHECKING:` do not (they never run); `from pkg import name` is an import of `pkg.name` when that is a
  module, else of `pkg` itself. Importing `a.b.c` is counted as an edge to `a.b.c` only, not to its parents'
  `__init__`, which every package import runs anyway;
- herald_torchrec/schedule/ (the control plane) never imports torch, torchrec or fbgemm_gpu, itself or through the
  herald_torchrec modules it imports;
- every package's `__init__.py` has a docstring (it names the package's one concern);
- no file under herald_torchrec/ or benchmarks/ carries a work-log label ("session 17", "issue 9").
"""

from __future__ import annotations

import ast
import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "herald_torchrec"
SCRIPTS = "benchmarks"  # a folder of scripts, not a package: they import each other by bare name (`import e2e`)
NO_TORCH_PREFIX = f"{PACKAGE}.schedule"
TORCH_STACK = ("torch", "torchrec", "fbgemm_gpu")
WORK_LOG_LABEL = re.compile(r"\b(?:sessions?|issues?) #?\d+\b", re.IGNORECASE)


@dataclass(frozen=True)
class Import:
    """One import statement's target as written (absolute, dotted) and the line it is on."""

    name: str
    line: int


@dataclass(frozen=True)
class Edge:
    """An import between two modules of the scanned trees."""

    source: str
    target: str
    line: int


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for the package under root/PACKAGE and the scripts under root/SCRIPTS (named
    `benchmarks.e2e`, although they import each other as `e2e`)."""
    found: dict[str, Path] = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in sorted((root / SCRIPTS).glob("*.py")):
        found[f"{SCRIPTS}.{path.stem}"] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(nodes: list[ast.stmt]):
    """Every node under `nodes`, function bodies included, except the bodies of `if TYPE_CHECKING:`."""
    stack: list[ast.AST] = list(reversed(nodes))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(reversed(node.orelse))
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def runtime_imports(path: Path, module: str) -> list[Import]:
    """The imports a module can run (module- and function-level), as absolute dotted names; `from a import b`
    gives `a.b` (resolved against the known modules later)."""
    is_package = path.name == "__init__.py"
    out: list[Import] = []
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path)).body):
        if isinstance(node, ast.Import):
            out.extend(Import(alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                here = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names = [base if alias.name == "*" else f"{base}.{alias.name}" for alias in node.names]
            out.extend(Import(name, node.lineno) for name in names)
    return out


def resolve(name: str, importer: str, modules: dict[str, Path]) -> str | None:
    """The scanned module an import name lands on: the longest known prefix of it (`a.b.C` -> `a.b`); a script's
    bare `import e2e` is its sibling `benchmarks.e2e`."""
    if importer.startswith(f"{SCRIPTS}.") and name.split(".")[0] != PACKAGE:
        name = f"{SCRIPTS}.{name}"
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


@dataclass
class ImportGraph:
    edges: dict[str, dict[str, Edge]]  # source -> target -> the first import of target in source
    external: dict[str, list[Import]]  # source -> its imports outside the scanned trees

    def chain(self, path: list[str]) -> str:
        """`a (line 12) -> b (line 40) -> c`: each module with the line that imports the next one."""
        steps = [f"{a} (line {self.edges[a][b].line})" for a, b in zip(path, path[1:])]
        return " -> ".join([*steps, path[-1]])


def import_graph(root: Path = REPO_ROOT) -> ImportGraph:
    modules = module_files(root)
    edges: dict[str, dict[str, Edge]] = {m: {} for m in modules}
    external: dict[str, list[Import]] = {m: [] for m in modules}
    for module, path in modules.items():
        for imp in runtime_imports(path, module):
            target = resolve(imp.name, module, modules)
            if target is None:
                external[module].append(imp)
            elif target != module and target not in edges[module]:
                edges[module][target] = Edge(module, target, imp.line)
    return ImportGraph(edges, external)


def strongly_connected(edges: dict[str, dict[str, Edge]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted; only those of two or more modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def shortest_cycle(graph: ImportGraph, component: list[str]) -> list[str]:
    """The shortest cycle through the component's first module, staying inside the component."""
    start, members = component[0], set(component)
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph.edges[node]):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if nxt in members and nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"no cycle through {start}")  # a component of two or more modules always has one


def cycle_report(graph: ImportGraph) -> list[str]:
    report = []
    for component in strongly_connected(graph.edges):
        cycle = shortest_cycle(graph, component)
        rest = sorted(set(component) - set(cycle))
        report.append(graph.chain(cycle) + (f"   (the same circle also takes in: {', '.join(rest)})" if rest else ""))
    return report


def test_no_import_cycles() -> None:
    report = cycle_report(import_graph())
    assert not report, "import cycles (each module with the line that imports the next):\n" + "\n".join(report)


def test_schedule_never_imports_the_torch_stack() -> None:
    """One search from every schedule module at once: each module it reaches that imports the torch stack is
    reported once, with the shortest chain from the control plane to it."""
    graph = import_graph()
    starts = sorted(m for m in graph.edges if m == NO_TORCH_PREFIX or m.startswith(NO_TORCH_PREFIX + "."))
    parent: dict[str, str] = {}
    queue = deque(starts)
    reached = set(starts)
    bad = []
    while queue:
        node = queue.popleft()
        torch_imports = [imp for imp in graph.external[node] if imp.name.split(".")[0] in TORCH_STACK]
        if torch_imports:
            path = [node]
            while path[-1] in parent:
                path.append(parent[path[-1]])
            first = torch_imports[0]
            bad.append(f"{graph.chain(path[::-1])} imports {first.name} (line {first.line})")
        for nxt in sorted(graph.edges[node]):
            if nxt not in reached:
                reached.add(nxt)
                parent[nxt] = node
                queue.append(nxt)
    assert not bad, "the control plane must run without torch:\n" + "\n".join(bad)


def test_every_package_has_an_init_with_a_docstring() -> None:
    missing = []
    for folder in sorted(p for p in (REPO_ROOT / PACKAGE).rglob("*") if p.is_dir() and p.name != "__pycache__"):
        if not any(folder.glob("*.py")):
            continue
        init = folder / "__init__.py"
        if not init.exists():
            missing.append(f"{init.relative_to(REPO_ROOT)}: missing")
        elif not ast.get_docstring(ast.parse(init.read_text())):
            missing.append(f"{init.relative_to(REPO_ROOT)}: no docstring naming the package's concern")
    assert not missing, "\n".join(missing)


def test_no_work_log_labels() -> None:
    hits = []
    for top in (PACKAGE, SCRIPTS):
        for path in sorted((REPO_ROOT / top).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            data = path.read_bytes()
            if b"\0" in data:
                continue  # binary (plots, built kernels)
            for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
                for match in WORK_LOG_LABEL.finditer(line):
                    hits.append(f"{path.relative_to(REPO_ROOT)}:{number}: {match.group(0)!r}")
    assert not hits, f"{len(hits)} work-log labels (history belongs in the changelog):\n" + "\n".join(hits)


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_check_sees_function_level_and_from_imports_and_skips_type_checking(tmp_path: Path) -> None:
    """The checker itself on a made-up tree: a cycle closed by a function-level `from pkg import module` is found
    and reported as a chain; one closed only under `if TYPE_CHECKING:` is not; a script cycle is found."""
    _write(
        tmp_path,
        {
            f"{PACKAGE}/__init__.py": '"""root"""\n',
            f"{PACKAGE}/a.py": f"from {PACKAGE}.sub import b\n",
            f"{PACKAGE}/sub/__init__.py": '"""sub"""\nVALUE = 1\n',
            f"{PACKAGE}/sub/b.py": f"def f():\n    from {PACKAGE} import a\n",
            f"{PACKAGE}/c.py": f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from {PACKAGE} import d\n",
            f"{PACKAGE}/d.py": f"from {PACKAGE}.c import VALUE\nfrom {PACKAGE}.sub import VALUE as V\n",
            f"{SCRIPTS}/x.py": "import y\n",
            f"{SCRIPTS}/y.py": "def g():\n    import x\n",
        },
    )
    graph = import_graph(tmp_path)
    assert f"{PACKAGE}.sub" in graph.edges[f"{PACKAGE}.d"]  # `from pkg import NAME`: the package itself
    assert cycle_report(graph) == [
        f"{SCRIPTS}.x (line 1) -> {SCRIPTS}.y (line 2) -> {SCRIPTS}.x",
        f"{PACKAGE}.a (line 1) -> {PACKAGE}.sub.b (line 2) -> {PACKAGE}.a",
    ]
