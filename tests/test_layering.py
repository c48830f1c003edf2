"""The package imports only downward: no cycles, no imports hidden inside functions.

The layers (docs/architecture.md), bottom to top. A module may import its own layer and the
layers below it; within a layer the imports must not form a cycle. Imports guarded by
``if TYPE_CHECKING:`` are annotations only and are exempt.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "torch_popxl"

# (layer name, module prefixes); the first matching prefix wins, longest prefixes first.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("torch_popxl.errors", "torch_popxl.dtypes", "torch_popxl._C")),
    ("ir", ("torch_popxl.ir",)),
    ("capture", ("torch_popxl.capture_packed", "torch_popxl.capture")),
    ("opdefs", ("torch_popxl.opdefs",)),
    (
        "api",
        (
            "torch_popxl.ops",
            "torch_popxl.tensor_methods",
            "torch_popxl.remote",
            # upstream's module paths (popxl.tensor, popxl.graph, ...): re-exports of ir/
            "torch_popxl.tensor",
            "torch_popxl.graph",
            "torch_popxl.context",
            "torch_popxl.streams",
            "torch_popxl.remote_buffer",
            "torch_popxl.replica_grouping",
            "torch_popxl.module",
            "torch_popxl.tensorlocation",
            "torch_popxl.random_seed",
            "torch_popxl.utils",
            "torch_popxl.fp8_utils",
            "torch_popxl.popart",
            "torch_popxl.testing",
        ),
    ),
    ("transforms", ("torch_popxl.transforms",)),
    ("runtime", ("torch_popxl.runtime", "torch_popxl.session")),
    (
        "top",
        (
            "torch_popxl.compile",
            "torch_popxl.compile_common",
            "torch_popxl.compile_guards",
            "torch_popxl.compile_infer",
            "torch_popxl.compile_loss",
            "torch_popxl.compile_masked",
            "torch_popxl.compile_optim",
            "torch_popxl.compile_renorm",
            "torch_popxl.compile_rows",
            "torch_popxl.compile_updates",
            "torch_popxl.addons",
            "torch_popxl.plan",
            "torch_popxl.__main__",
        ),
    ),
]


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _layer(module: str) -> int:
    if module == "torch_popxl":
        return len(LAYERS)  # the package itself: above everything
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}.")
    return best[0]


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom | ast.Import) -> set[str]:
    """The package modules ``node`` imports (an imported attribute maps to its module)."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        if node.level:
            base = importer.split(".") if is_package else importer.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        targets = [f"{module}.{alias.name}" for alias in node.names]
    found = set()
    for target in targets:
        if target.split(".")[0] != "torch_popxl":
            continue
        if target == "torch_popxl._C" or target.startswith("torch_popxl._C."):
            continue  # the compiled extension: a leaf
        while target not in MODULES and "." in target:
            target = target.rsplit(".", 1)[0]
        if target in MODULES and target != importer:
            found.add(target)
    return found


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            guarded.update(id(child) for child in ast.walk(node))
    return guarded


def _imports() -> tuple[dict[str, set[str]], list[str]]:
    """(module -> imported package modules, descriptions of function-local imports)."""
    edges: dict[str, set[str]] = {}
    local: list[str] = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        guarded = _type_checking_nodes(tree)
        top = {id(node) for node in tree.body}
        # A top-level try/except around an import (the extension) still runs at import time.
        for node in tree.body:
            if isinstance(node, ast.Try):
                top.update(id(child) for child in node.body)
        edges[module] = set()
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom) or id(node) in guarded:
                continue
            targets = _resolve(module, path.name == "__init__.py", node)
            if targets and id(node) not in top:
                local.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} imports {targets}")
            edges[module] |= targets
    return edges, local


EDGES, LOCAL_IMPORTS = _imports()


def test_no_function_local_imports_of_the_package():
    assert not LOCAL_IMPORTS, (
        "Imports of torch_popxl modules inside functions hide the dependency structure; move "
        "them to the top of the module (restructure if that makes a cycle):\n"
        + "\n".join(LOCAL_IMPORTS)
    )


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
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


def test_no_import_cycles():
    assert not _cycles(EDGES)


def _layer_name(module: str) -> str:
    index = _layer(module)
    return "package" if index == len(LAYERS) else LAYERS[index][0]


def _upward(edges: dict[str, set[str]]) -> list[str]:
    # The package itself (its __init__) sits above everything: only __main__ may import it.
    return [
        f"{a} ({_layer_name(a)}) imports {b} ({_layer_name(b)})"
        for a, targets in sorted(edges.items())
        for b in sorted(targets)
        if a not in ("torch_popxl", "torch_popxl.__main__") and _layer(b) > _layer(a)
    ]


def test_an_upward_import_is_caught():
    edges = {"torch_popxl.ir.graph": {"torch_popxl.runtime.session", "torch_popxl.dtypes"}}
    assert _upward(edges) == [
        "torch_popxl.ir.graph (ir) imports torch_popxl.runtime.session (runtime)"
    ]


def test_imports_only_go_down_the_layers():
    upward = _upward(EDGES)
    assert not upward, "Upward imports:\n" + "\n".join(upward)


@pytest.mark.parametrize(
    "source, expected_cycles",
    [
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ],
)
def test_the_cycle_finder_finds_cycles(source, expected_cycles):
    assert _cycles(source) == expected_cycles


def test_the_checks_see_every_module():
    # The checks above are only as good as their module list and resolution.
    assert "torch_popxl.ir.graph" in MODULES and "torch_popxl.runtime.session" in MODULES
    assert "torch_popxl.ir.tensor" in EDGES["torch_popxl.ir.graph"]
    assert all(_layer(m) >= 0 for m in MODULES)
