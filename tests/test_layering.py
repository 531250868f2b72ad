"""Imports inside the package flow one way, down the layers of docs/DESIGN.md, with no cycle.

Read from the source (no import runs): every ``megatron.context_parallel`` import of every
module, lazy ones inside functions included. A module may import its own layer or lower ones.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron" / "context_parallel"
PREFIX = "megatron.context_parallel"

# Lowest first. Within a layer modules may import each other (no cycle, checked below).
LAYERS = [
    {"_env", "_linkage", "_extension"},
    {"comm", "comm.errors", "comm.groups", "comm.plan", "comm.row_ops", "comm.mappings"},
    {"tree"},
    {
        "attention",
        "attention.settings",
        "attention.kernel",
        "attention.sums",
        "attention.cudnn",
        "attention.staging",
        "attention.runs",
        "attention.blocks",
        "attention.tree_tables",
        "attention.fused",
        "attention.rotary",
        "head",
        "head.vocab_triton",
        "head.vocab_gluon",
        "head.vocab_ops",
        "head.output",
    },
    {"params"},
    {"attention.layers", "mixers", "mixers.gdn_conv", "mixers.gdn"},
    {"models", "models.hybrid", "models.forward"},
    {""},  # the package's __init__: the public surface
]


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: pathlib.Path, modules: set) -> set:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PREFIX):
            base = node.module[len(PREFIX) :].lstrip(".")
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                names.append(sub if sub in modules else base)
        elif isinstance(node, ast.Import):
            names += [
                a.name[len(PREFIX) :].lstrip(".") for a in node.names if a.name.startswith(PREFIX)
            ]
        found.update(n for n in names if n in modules)
    return found


def _graph() -> dict:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: _imports(path, set(paths)) - {name} for name, path in paths.items()}


def test_every_module_has_a_layer():
    layered = set().union(*LAYERS)
    assert set(_graph()) == layered


def test_imports_go_down_the_layers():
    level = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    upward = [
        f"{module or '__init__'} (layer {level[module]}) imports {dep} (layer {level[dep]})"
        for module, deps in _graph().items()
        for dep in deps
        if level[dep] > level[module]
    ]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    graph = _graph()
    state: dict = {}
    cycles = []

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(stack[stack.index(dep) :] + [dep]))
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "\n".join(cycles)


# A function's body past its docstring; Triton kernels included. ~60 lines is the house rule, a
# little over it is left where a kernel's loop would only split into helpers with dummy state.
LONGEST_BODY = 70


def test_no_long_functions():
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = node.body
            first = body[0]
            docstring = isinstance(first, ast.Expr) and isinstance(
                getattr(first, "value", None), ast.Constant
            )
            start = body[1].lineno if docstring and len(body) > 1 else first.lineno
            lines = node.end_lineno - start + 1
            if lines > LONGEST_BODY:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, "\n".join(long)
