"""The package's architecture, checked by reading its imports (so a change that breaks it fails CI).

Layers, each importing only those below it (and itself)::

    cli                                      the ``elastic-moe`` command
    tools                                    demo, bench, eval, diagnose, gate lab, recipes
    swift                                    the ms-swift integration
    mcore | hf | titan                       one adapter per framework, never each other
    compat                                   version and framework shims on the training path
    cpu_runtime                              the opt-in CPU runtime: tools, tests and entry points
                                             may switch it on, no adapter and no shim imports it
    core                                     framework-free: nothing else of the package

The package ``__init__`` re-exports core names lazily; the top-level entry point (``megatron_lm``)
may import anything but the CLI. Every import
counts, at module level or inside a function, and the graph between modules has no cycle.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = "elastic_moe_plugin"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

#: layer -> the layers it may import (besides itself)
#: (``root`` is the package's ``__init__``: ``__version__`` and lazy re-exports of the core)
ALLOWED: dict[str, set[str]] = {
    "root": {"core"},
    "core": set(),
    "compat": {"core", "root"},
    "cpu_runtime": {"core", "root"},
    "mcore": {"core", "compat", "root"},
    "hf": {"core", "compat", "root"},
    "titan": {"core", "compat", "root"},
    "swift": {"core", "compat", "mcore", "hf", "root"},
    "tools": {"core", "compat", "cpu_runtime", "mcore", "hf", "titan", "swift", "root"},
    "cli": {"core", "compat", "cpu_runtime", "mcore", "hf", "titan", "swift", "tools", "root"},
    "entry": {"core", "compat", "cpu_runtime", "mcore", "hf", "titan", "swift", "tools", "root"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(ROOT.rglob("*.py")) if path.parent.name != "plugin"}


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The package module an import of ``name`` loads (a submodule if it is one), else None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    """Every package module ``module`` imports, anywhere in the file.

    ``from pkg import name`` counts as an import of ``pkg.name`` when that is a module (a submodule
    import), else of ``pkg`` (its ``__init__``).
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names += [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
    targets = {_resolve(name) for name in names if name == PACKAGE or name.startswith(PACKAGE + ".")}
    return {target for target in targets if target is not None and target != module}


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "root"
    if parts[1] == "megatron_lm":
        return "entry"
    return parts[1]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return components


# ---------------------------------------------------------------------------------- static checks
def test_every_layer_is_known():
    assert {_layer(module) for module in MODULES} <= set(ALLOWED)
    assert {"core", "compat", "cpu_runtime", "mcore", "hf", "titan", "swift", "tools", "cli"} <= {
        _layer(module) for module in MODULES
    }


def test_no_shim_and_no_adapter_imports_the_cpu_runtime():
    """The CPU runtime is opt-in: nothing on a training path (compat, the adapters) may load it."""
    importers = sorted(f"{module} imports {target}" for module, targets in GRAPH.items() for target in targets
                       if _layer(target) == "cpu_runtime" and _layer(module) in ("compat", "mcore", "hf", "titan", "swift"))
    assert importers == []
    assert any(_layer(module) == "compat" for module in MODULES)


def test_the_import_graph_has_no_cycle():
    assert _cycles(GRAPH) == []


def test_the_cycle_check_finds_a_cycle():
    """The checker itself: a planted two-module cycle and a three-module cycle are reported."""
    planted = {**GRAPH, "a": {"b"}, "b": {"a"}, "x": {"y"}, "y": {"z"}, "z": {"x"}}
    assert sorted(_cycles(planted)) == [["a", "b"], ["x", "y", "z"]]


def test_arrows_point_down_only():
    wrong = sorted(
        f"{module} ({_layer(module)}) imports {target} ({_layer(target)})"
        for module, targets in GRAPH.items()
        for target in targets
        if _layer(target) != _layer(module) and _layer(target) not in ALLOWED[_layer(module)]
    )
    assert wrong == []


def test_the_core_imports_nothing_else_of_the_package():
    core = {module: targets for module, targets in GRAPH.items() if _layer(module) == "core"}
    assert core and all(_layer(target) == "core" for targets in core.values() for target in targets)


def test_the_import_reader_sees_function_level_imports():
    """``mcore.routing`` imports Megatron lazily inside functions; the reader must see package
    imports there too (cli imports its tools only inside run())."""
    assert "elastic_moe_plugin.tools.schedule_report" in GRAPH["elastic_moe_plugin.cli.schedule"]
    assert "elastic_moe_plugin.mcore.aux_loss" in GRAPH["elastic_moe_plugin.mcore.routing"]


def _top_level_definitions(path: Path) -> dict[str, set[str]]:
    """{name defined at the top of the file: the names its body refers to}."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            targets = [node.name]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = [t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                       if isinstance(t, ast.Name)]
        else:
            continue
        used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        used |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
        for target in targets:
            found[target] = used - {target}
    return found


def test_the_routing_core_holds_only_what_the_doors_run():
    """Every definition in ``core/routing.py`` is reachable from what the doors' routing and load
    balancing import from it; the gate lab's own instruments live in ``tools/gates_lab``."""
    definitions = _top_level_definitions(ROOT / "core" / "routing.py")
    definitions.pop("__all__", None)
    roots: set[str] = set()
    for module in ("elastic_moe_plugin.mcore.routing", "elastic_moe_plugin.mcore.aux_loss", "elastic_moe_plugin.hf.routing"):
        tree = ast.parse(MODULES[module].read_text())
        roots |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                  and node.module == "elastic_moe_plugin.core.routing" for alias in node.names}
    assert roots, "the doors import nothing from core.routing"
    reached, frontier = set(), list(roots)
    while frontier:
        name = frontier.pop()
        if name in reached or name not in definitions:
            continue
        reached.add(name)
        frontier += sorted(definitions[name])
    assert sorted(set(definitions) - reached) == []


#: the longest module of the package, and the longest function where the routing runs
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
SMALL_FUNCTION_LAYERS = ("core", "mcore", "hf", "titan", "swift")


def _oversized(path: Path, root: Path = ROOT) -> list[str]:
    """``path`` if it is over :data:`MAX_MODULE_LINES`, and its functions over
    :data:`MAX_FUNCTION_LINES` (``def`` to last line, docstring included) in the small-function layers."""
    text = path.read_text()
    found = [f"{path.name}: {text.count(chr(10))} lines"] if text.count("\n") > MAX_MODULE_LINES else []
    if path.relative_to(root).parts[0] in SMALL_FUNCTION_LAYERS:
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{path.name}:{node.lineno} {node.name}: {length} lines")
    return found


def test_modules_and_routing_functions_stay_readable():
    """No module over 500 lines; no function over 60 lines in core/, mcore/, hf/ and swift/."""
    assert [problem for path in MODULES.values() for problem in _oversized(path)] == []


def test_the_size_check_finds_a_long_function(tmp_path):
    package = tmp_path / "core"
    package.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (package / "long.py").write_text(f"def long():\n{body}\n")
    assert _oversized(package / "long.py", tmp_path) == [f"long.py:1 long: {MAX_FUNCTION_LINES + 1} lines"]


# ---------------------------------------------------------------------------------- what a training process loads
_PROBE = r"""
import json, sys
which = sys.argv[1]
if which == "mcore":
    from elastic_moe_plugin import cpu_runtime
    cpu_runtime.enable(force=True)  # only to import megatron.core 0.19 without triton
    from elastic_moe_plugin import ElasticConfig, mcore
    mcore.apply(ElasticConfig(schedule="6-10"))
else:
    from elastic_moe_plugin import ElasticConfig, hf
    hf.apply(ElasticConfig(schedule="6-10"))
print(json.dumps(sorted(sys.modules)))
"""
TOOL_MODULES = ("elastic_moe_plugin.tools", "elastic_moe_plugin.cli", "elastic_moe_plugin.swift", "matplotlib",
                "lm_eval", "swift")


@pytest.mark.parametrize("adapter", [
    pytest.param("mcore", marks=pytest.mark.megatron),
    pytest.param("hf", marks=pytest.mark.hf),
])
def test_a_training_process_loads_no_tool(adapter):
    env = {**os.environ, "TORCH_COMPILE_DISABLE": "1"}
    result = subprocess.run([sys.executable, "-c", _PROBE, adapter], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert f"elastic_moe_plugin.{adapter}" in loaded
    other = "hf" if adapter == "mcore" else "mcore"
    assert f"elastic_moe_plugin.{other}" not in loaded
    leaked = [name for name in loaded if any(name == tool or name.startswith(tool + ".") for tool in TOOL_MODULES)]
    assert leaked == []
