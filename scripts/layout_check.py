"""The package layout's numbers (issue 35's targets): modules at the root of ``src/deltarefit``, import cycles
between modules, and modules over 450 lines.

    python scripts/layout_check.py [SRC]      (SRC defaults to src/deltarefit beside this script)

Cycles count every import, module-level or inside a function, resolved to the module it names
(``from .x import y`` names ``x``, or ``x.y`` when that is a module). The one exception is a package's own
factory: an import inside a function listed in ``FACTORIES`` of a module of the same package (a factory
must name its implementations, and they import the interface it returns). Exit status 0 always: this is a
report, not a gate.
"""

from __future__ import annotations

import ast
import os
import sys

MAX_ROOT = 12
MAX_LINES = 450
# (module, function): a package's factory, whose imports of its own package's modules are not counted.
FACTORIES = {("deltarefit.storage.base", "open_store")}


def modules(src: str) -> dict[str, str]:
    """dotted name -> path, for every .py under ``src`` (the package directory)."""
    top = os.path.basename(os.path.normpath(src))
    out = {}
    for dp, dn, fn in os.walk(src):
        dn[:] = sorted(d for d in dn if not d.startswith((".", "__pycache__")))
        for f in sorted(fn):
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dp, f), src)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join([top, *rel])] = os.path.join(dp, f)
    return out


def _functions(tree: ast.AST):
    """(import node, name of the enclosing top-level function or method, or None) for every import."""
    def walk(node, fn):
        for child in ast.iter_child_nodes(node):
            f = fn
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                f = fn or child.name
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, f
            yield from walk(child, f)
    yield from walk(tree, None)


def edges(mods: dict[str, str]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        is_pkg = path.endswith("__init__.py")
        pkg = m.split(".") if is_pkg else m.split(".")[:-1]
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node, fn in _functions(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    # a submodule, or the module named; nothing for a namespace package or an extension
                    targets.append(sub if sub in mods else base if base in mods else "")
            for name in targets:
                t = name
                while t and t not in mods and isinstance(node, ast.Import):  # ``import a.b`` loads ``a`` too
                    t = t.rpartition(".")[0]
                if t not in mods:
                    continue
                if t == m:
                    continue
                if fn is not None and (m, fn) in FACTORIES and t.rpartition(".")[0] == m.rpartition(".")[0]:
                    continue
                graph[m].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    sys.setrecursionlimit(10000)

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(out)


def main(argv: list[str]) -> int:
    src = argv[0] if argv else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "deltarefit")
    src = os.path.normpath(src)
    mods = modules(src)
    root = sorted(f for f in os.listdir(src) if f.endswith(".py"))
    print(f"root modules: {len(root)} (target <= {MAX_ROOT}): {' '.join(root)}")
    found = cycles(edges(mods))
    print(f"import cycles (function-level imports counted, factories {sorted(f'{m}.{f}' for m, f in FACTORIES)} "
          f"excepted): {len(found)}")
    for comp in found:
        print("  " + " <-> ".join(c.removeprefix("deltarefit.") for c in comp))
    long = []
    for path in mods.values():
        with open(path) as f:
            n = sum(1 for _ in f)
        if n > MAX_LINES:
            long.append((n, os.path.relpath(path, os.path.dirname(src))))
    print(f"modules over {MAX_LINES} lines: {len(long)}")
    for n, p in sorted(long, reverse=True):
        print(f"  {n:5d}  {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
