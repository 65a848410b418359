"""The package's layering, written as data and checked against every import in ``src/rlasync``.

Imports run downward only, so each layer can be read, tested and replaced on its own. A package
may import the packages of lower layers; an import within a layer, or upward, is an arrow the
layering lacks and fails here, unless ``SIDEWAYS`` lists it with the reason it stays.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import rlasync

SRC = Path(rlasync.__file__).parent

LAYERS: list[set[str]] = [
    {"config", "interrupts", "registry"},
    {"transport", "models", "algorithms", "tools", "rewards", "data", "metrics", "plugins"},
    {"envs"},
    {"runtime"},
    {"weights"},
    {"engines", "agents", "trainer", "launcher"},
    {"serving"},
    {"compose"},
    {"modes"},
    {"cli", "__main__"},
]
"""Bottom to top. ``rlasync/__init__.py`` (the package's public face) may import any layer but
``cli``; ``weights`` is the library both ends of a weight transfer use (the trainer's sender,
an engine's sink), so it sits under them rather than beside them; ``serving`` (the OpenAI
endpoint and its loop) speaks to the engines for the agents, so it sits on both; ``compose``
(a run's parts, made from the config: where they run, the rows, checkpoints, records) sits on
all the roles, and ``modes`` (the schedules, each only the order it drives those parts in) on
it. ``envs`` (a task's rows and its scorer) is made of rows and rewards, and the agent loops run
it."""

SIDEWAYS: dict[tuple[str, str], str] = {
    ("data", "rlasync.tools.calculator"): "the calc task's prompts offer the calculator's schema",
    ("rewards", "rlasync.plugins"): "a verl reward function's file is imported as a plugin file is",
    (
        "agents",
        "rlasync.engines.types",
    ): "an agent loop sends the engines' request type and reads their output",
    ("agents", "rlasync.engines.protocol"): "an agent loop handles the errors of the engine protocol",
    (
        "agents",
        "rlasync.engines.router",
    ): "the agent-loop worker drives its node's engines through a Router it builds",
    (
        "agents",
        "rlasync.engines.telemetry",
    ): "the agent-loop worker shows that Router's load on its node's /metrics",
}
"""Imports within a layer that stay, and why: (importing package, imported module). An agent
loop never imports an engine: only the engines' types and protocol (the worker, the router)."""


def _layer(package: str) -> int:
    for i, layer in enumerate(LAYERS):
        if package in layer:
            return i
    raise AssertionError(f"rlasync.{package} is in no layer: add it to LAYERS in {__file__}")


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> Iterator[tuple[str, int]]:
    """Every module ``path`` imports (at any depth: lazy imports count), with its line; for
    ``from X import y``, both ``X`` and ``X.y`` (``y`` may be a module; ``_arrows`` keeps the real ones)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            yield target, node.lineno
            for alias in node.names:
                yield f"{target}.{alias.name}", node.lineno


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _is_module(name: str) -> bool:
    path = SRC.joinpath(*name.split(".")[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _arrows() -> Iterator[tuple[str, str, str]]:
    """(importing module, imported module, file:line) for every import between two packages."""
    for path in sorted(SRC.rglob("*.py")):
        module = _module_name(path)
        for target, line in _imports(path):
            if target.startswith("rlasync.") and _top(target) != _top(module) and _is_module(target):
                yield module, target, f"{path.relative_to(SRC.parent)}:{line}"


def test_every_import_runs_down_the_layers() -> None:
    wrong = []
    for module, target, where in _arrows():
        src, dst = _top(module), _top(target)
        if dst == "cli":
            if module != "rlasync.__main__":
                wrong.append(f"{where}: {module} imports {target}: nothing imports the command line")
            continue
        if src == "":  # rlasync/__init__.py: the public face re-exports from any layer but cli
            continue
        if _layer(dst) < _layer(src):
            continue
        if (src, target) in SIDEWAYS:
            continue
        wrong.append(
            f"{where}: {module} ({src}, layer {_layer(src)}) imports {target} ({dst}, layer {_layer(dst)})"
        )
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(set(wrong)))


def test_every_sideways_arrow_is_still_needed() -> None:
    used = {(_top(m), t) for m, t, _ in _arrows()}
    assert set(SIDEWAYS) <= used, f"listed in SIDEWAYS but no longer imported: {set(SIDEWAYS) - used}"


def test_the_layering_knows_every_package() -> None:
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    packages |= {p.stem for p in SRC.glob("*.py") if p.stem != "__init__"}
    known = set().union(*LAYERS)
    assert packages <= known, f"packages in no layer: {packages - known}"


def test_config_loads_without_torch() -> None:
    """``rlasync --help`` and config checks stay instant: the config layer imports no torch."""
    code = (
        "import sys, rlasync.config, rlasync.config.loader; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (
        f"importing rlasync.config loaded {done.stdout.strip()} {done.stderr[-2000:]}"
    )


def _module_edges() -> dict[str, set[str]]:
    """Module -> the ``rlasync`` modules it imports, at any depth (in functions, under
    ``TYPE_CHECKING``): ``from p import m`` is an edge to the module ``p.m`` where ``m`` is one,
    else to ``p`` (the package's ``__init__``, which that import runs)."""
    edges: dict[str, set[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        module = _module_name(path)
        named = edges.setdefault(module, set())
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join([*parts[: len(parts) - node.level + 1], *([base] if base else [])])
                targets = [f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base for a in node.names]
            else:
                continue
            for target in targets:
                while target.startswith("rlasync") and not _is_module(target):
                    target = target.rpartition(".")[0]  # `import rlasync.x.name`: the module x
                if target.startswith("rlasync") and target != module:
                    named.add(target)
    return edges


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_no_module_imports_itself_through_others() -> None:
    """No circle of imports between modules, lazy and type-only imports included: a circle
    makes import order matter and the modules in it one concept in several files."""
    edges = _module_edges()
    circles = _circles(edges)
    shown = ["\n".join(f"  {m} -> {sorted(edges[m] & set(c))}" for m in c) for c in circles]
    assert not circles, "import circles:\n" + "\n\n".join(shown)


def test_the_circle_finder_finds_circles() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
