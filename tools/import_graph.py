"""The import graph of gyre/'s packages, checked against the intended layering, and its long functions.

    python -m tools.import_graph                # the graph; exit 1 if a package imports one above it
    python -m tools.import_graph --long 60      # also every function over 60 lines (gyre/ and launch/)
    python -m tools.import_graph --params 5     # also every function taking more than 5 parameters

Imports are read from the source (ast), lazy ones inside functions included: a deferred import is still a
dependency. A package is gyre's first-level name (gyre/sched/cell/worker.py -> sched, gyre/health.py -> health).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. A package may import its own layer and those below; an import of a higher layer is an arrow up.
LAYERS: list[tuple[str, ...]] = [
    ("errors", "fsutil", "lifetime"),
    ("config",),
    ("model",),
    ("store", "traj", "comm"),
    ("train",),
    ("engine", "sandbox", "health", "metrics", "tracking"),
    ("proxy", "tasks"),
    ("harness",),
    ("warm_start", "pipeline", "resume"),
    ("eval",),  # held-out metrics and task sets; the runs that use them are the controller's
    ("sched",),  # the one orchestrator (gyre.sched.controller) for every scheduler
    ("sim",),  # the simulator drives the production scheduling code (gyre.sched.policy)
]
LAYER_OF = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def package_of(path: Path) -> str:
    parts = path.relative_to(ROOT / "gyre").with_suffix("").parts
    return parts[0]


def gyre_imports(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """(imported gyre package, line) for every import of gyre in a module's tree."""
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = (
                [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                if node.module == "gyre"
                else [node.module]
            )
        for name in names:
            parts = name.split(".")
            if parts[0] == "gyre" and len(parts) > 1:
                yield parts[1], node.lineno


def sources(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py"))


def import_graph() -> tuple[Counter[tuple[str, str]], list[str]]:
    """Edge counts between packages, and every import that points up (file:line src -> dst)."""
    edges: Counter[tuple[str, str]] = Counter()
    upward = []
    for path in sources("gyre"):
        src = package_of(path)
        for dst, line in gyre_imports(ast.parse(path.read_text(), str(path))):
            if dst == src:
                continue
            edges[src, dst] += 1
            if LAYER_OF.get(dst, -1) > LAYER_OF.get(src, len(LAYERS)):
                upward.append(f"{path.relative_to(ROOT)}:{line}: {src} -> {dst}")
    return edges, upward


def long_functions(limit: int, dirs: tuple[str, ...] = ("gyre", "launch")) -> list[tuple[int, str]]:
    """(lines, file:line name) of every function or method longer than `limit` lines, longest first."""
    found = []
    for path in sources(*dirs):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > limit:
                    found.append((n, f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"))
    return sorted(found, reverse=True)


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Parameters a caller passes: positional and keyword-only, *args and **kwargs, not self or cls."""
    a = node.args
    named = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    if named and named[0] in ("self", "cls"):
        named = named[1:]
    return len(named) + (a.vararg is not None) + (a.kwarg is not None)


def many_parameters(limit: int, dirs: tuple[str, ...] = ("gyre", "launch")) -> list[tuple[int, str]]:
    """(parameters, file:line name) of every function or method taking more than `limit`, most first."""
    found = []
    for path in sources(*dirs):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and (n := parameter_count(node)) > limit:
                found.append((n, f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"))
    return sorted(found, reverse=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--long", type=int, default=0, help="also list functions over this many lines")
    parser.add_argument("--params", type=int, default=0, help="also list functions taking more parameters")
    parser.add_argument("--under", default="", help="list long functions and parameters only under this path")
    args = parser.parse_args()
    edges, upward = import_graph()
    unlayered = sorted({p for e in edges for p in e} - set(LAYER_OF))
    print("layers (lowest first): " + " < ".join("/".join(layer) for layer in LAYERS))
    for src in sorted({s for s, _ in edges}, key=lambda p: (LAYER_OF.get(p, -1), p)):
        targets = sorted((d for s, d in edges if s == src), key=lambda p: (LAYER_OF.get(p, -1), p))
        print(f"  {src} -> " + ", ".join(f"{d}({edges[src, d]})" for d in targets))
    if unlayered:
        print("packages without a layer (add them to LAYERS): " + ", ".join(unlayered))
    print(f"arrows up: {len(upward)}")
    for line in upward:
        print(f"  {line}")
    if args.long:
        found = [f for f in long_functions(args.long) if f[1].startswith(args.under)]
        print(f"functions over {args.long} lines: {len(found)}")
        for n, where in found:
            print(f"  {n:4d} {where}")
    if args.params:
        found = [f for f in many_parameters(args.params) if f[1].startswith(args.under)]
        print(f"functions over {args.params} parameters: {len(found)}")
        for n, where in found:
            print(f"  {n:4d} {where}")
    return 1 if upward or unlayered else 0


if __name__ == "__main__":
    sys.exit(main())
