"""The layering rules of docs/architecture.md, checked from the source: which layer may import which, no import
cycles, and entrypoints / benchmarks that reach the engine through its public surface only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pagedllm"
ARGPARSE_PRIVATE = {"_SubParsersAction", "_actions", "_format_action"}  # argparse has no public names for these
MAX_LINES = 480  # "about 450": one concept per module
# close_objects and check_schema, pure functions of a JSON schema that tool calls share with the grammar compiler
ENGINE_IMPORTS_BESIDE_THE_PROTOCOL = {"pagedllm.entrypoints.openai.tool_calls": {"pagedllm.engine.structured_output",
                                                                               "pagedllm.engine.grammar_limits"}}
ENGINE_PARTS = {"scheduler", "block_manager", "runner", "kv_usage", "groups", "detokenizers", "observers", "matchers",
                "structured"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def imports(tree: ast.Module) -> set[str]:
    """Every module imported anywhere in the file (function-level imports included, type-checking-only ones not);
    `from a import b` counts as a.b when that is a module, else as a."""
    names = set(MODULES)
    found = set()
    type_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and "TYPE_CHECKING" in
                 ast.unparse(block.test) for n in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            subs = {f"{node.module}.{alias.name}" for alias in node.names} & names
            found.update(subs or {node.module})
    return found


MODULES = modules()
GRAPH = {name: {i for i in imports(tree) if i.startswith("pagedllm")} for name, tree in MODULES.items()}


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or module in {"pagedllm.core", "pagedllm.engine", "pagedllm.model",
                                                    "pagedllm.entrypoints", "pagedllm.bench"} else "top"


def test_the_layers_are_the_packages_we_think():
    assert {layer(m) for m in MODULES} == {"top", "core", "engine", "model", "entrypoints", "bench"}
    assert "pagedllm.core.scheduler" in MODULES and "pagedllm.entrypoints.openai.app" in MODULES


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer(m) == "core"))
def test_core_imports_no_torch_and_nothing_above_it(module):
    """The memory policy is plain Python: testable and readable without a model."""
    everything = imports(MODULES[module])
    assert not {i for i in everything if i.split(".")[0] in {"torch", "numpy"}}
    assert {layer(i) for i in GRAPH[module]} <= {"top", "core"}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer(m) == "top"))
def test_top_level_data_modules_stay_light(module):
    """config, sampling_params, outputs, errors: plain data every layer may use, importing no layer."""
    assert {layer(i) for i in GRAPH[module]} <= {"top"} or module == "pagedllm"


@pytest.mark.parametrize("kind,allowed", [("model", {"top", "core", "model"}),
                                          ("engine", {"top", "core", "model", "engine"}),
                                          ("entrypoints", {"top", "engine", "entrypoints", "bench"})])
def test_dependencies_point_one_way(kind, allowed):
    for module in (m for m in MODULES if layer(m) == kind):
        assert {layer(i) for i in GRAPH[module]} <= allowed, module


def test_only_the_cli_command_table_imports_bench():
    importers = {m for m, deps in GRAPH.items() if layer(m) != "bench" and any(layer(d) == "bench" for d in deps)}
    assert importers == {"pagedllm.entrypoints.cli"}


def test_no_import_cycles():
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(GRAPH.get(module, ())):
            if dep not in GRAPH or dep == module or module.startswith(dep + "."):
                continue  # a package's own __init__ is not a dependency edge
            assert state.get(dep) != 1, "import cycle: " + " -> ".join([*path, module, dep])
            if dep not in state:
                visit(dep, [*path, module])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [])


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer(m) in {"entrypoints", "bench"}))
def test_entrypoints_and_benchmarks_use_the_engines_public_surface(module):
    """No `x._name` on another object, no `engine.scheduler` / `.block_manager` / `.runner`, no patched methods."""
    for node in ast.walk(MODULES[module]):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value.id if isinstance(node.value, ast.Name) else None
        private = node.attr.startswith("_") and not node.attr.startswith("__") and owner not in {"self", "cls"}
        assert not private or node.attr in ARGPARSE_PRIVATE, f"{module}:{node.lineno} reads .{node.attr}"
        assert node.attr not in ENGINE_PARTS, f"{module}:{node.lineno} reaches into the engine's .{node.attr}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("pagedllm.entrypoints.openai")))
def test_the_openai_server_reaches_the_engine_through_its_protocol_only(module):
    """The server knows an engine client (engine/protocol.py), not which engine it is: a new backend is one class."""
    engine_imports = {i for i in GRAPH[module] if layer(i) == "engine"}
    assert engine_imports <= {"pagedllm.engine.protocol", *ENGINE_IMPORTS_BESIDE_THE_PROTOCOL.get(module, ())}, module
    assert {layer(i) for i in GRAPH[module]} <= {"top", "engine", "entrypoints"}, module


def module_aliases(tree: ast.Module) -> set[str]:
    """The names a file binds to imported modules (`import a.b as c`, `from a import module`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.asname or alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update(alias.asname or alias.name for alias in node.names
                         if f"{node.module}.{alias.name}" in MODULES)
    return names


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer(m) == "entrypoints"))
def test_entrypoints_import_no_private_name_and_patch_no_module(module):
    """`from x import _name`, `x.name = ...` or `setattr(x, ...)` on a module would tie an entrypoint to another
    module's insides, or change them for everyone."""
    tree = MODULES[module]
    aliases = module_aliases(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            assert not private, f"{module}:{node.lineno} imports {private} from {node.module}"
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            attribute = isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
            owner = target.value.id if attribute else None
            assert owner not in aliases, f"{module}:{node.lineno} patches {owner}.{target.attr}"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in {"setattr", "delattr"}:
            first = node.args[0] if node.args else None
            assert not (isinstance(first, ast.Name) and first.id in aliases), f"{module}:{node.lineno} patches a module"


@pytest.mark.parametrize("path", sorted(p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != "bench"))
def test_no_module_is_too_long(path):
    """One concept per module; the benchmarks (one module per command) may run longer."""
    name = str(path.relative_to(PACKAGE.parent))
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines: split it by concept"
