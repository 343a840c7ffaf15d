"""The project's modules import each other in layers: no cycles, no imports hidden in functions.

Reads the source (ast) of every module of the project's packages; nothing is imported.
An edge a -> b means module a imports module b at module level (`if TYPE_CHECKING:`
blocks aside). A package's `__init__` that a submodule import runs implicitly is not an
edge; `from package import name` is one (to the submodule `name` when it is one).
"""

from __future__ import annotations

import ast
import pathlib
import tomllib

from tests.support import REPO_ROOT

ROOT = REPO_ROOT


def _installed_names() -> dict[str, str]:
    """Folder -> the import name it installs as (pyproject.toml's package-dir)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        package_dir = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {"bam_jax": "bam_jax"} | {folder: name for name, folder in package_dir.items()}


PACKAGES = _installed_names()


def _module_name(path: pathlib.Path) -> str:
    folder, *parts = path.relative_to(ROOT).with_suffix("").parts
    parts = [PACKAGES[folder], *parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _project_modules() -> dict[str, pathlib.Path]:
    modules = {}
    for folder in PACKAGES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            modules[_module_name(path)] = path
    return modules


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """Absolute names a statement imports: modules, or module.attribute for `from` imports."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = module.split(".")
        anchor = anchor if is_package else anchor[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def _resolve(name: str, modules: dict[str, pathlib.Path]) -> str | None:
    """The project module a name denotes: itself, or the module it is an attribute of."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _walk_imports(tree: ast.Module):
    """(import statement, inside a function) for every import outside TYPE_CHECKING blocks."""

    def visit(node: ast.AST, in_function: bool):
        for child in ast.iter_child_nodes(node):
            if _is_type_checking_block(child):
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child, in_function
            inside = in_function or isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
            )
            yield from visit(child, inside)

    yield from visit(tree, False)


def _import_graph() -> tuple[dict[str, set[str]], list[str]]:
    """Module-level edges between project modules, and the function-level imports of
    project (or non-allowed third-party) modules as 'module:line name' strings."""
    modules = _project_modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    hidden: list[str] = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node, in_function in _walk_imports(tree):
            names = _imported_names(node, module, is_package)
            targets = {_resolve(name, modules) for name in names} - {None, module}
            if in_function:
                top_levels = {name.split(".")[0] for name in names}
                if targets or (top_levels & set(PACKAGES.values())):
                    hidden.append(f"{module}:{node.lineno} {ast.unparse(node)}")
                continue
            if isinstance(node, ast.ImportFrom):
                # `from a.b import c` runs a.b (unless only its submodule c is named).
                base = _resolve(names[0], modules)
                submodules = {_resolve(n, modules) for n in names[1:]} - {base}
                runs_base = base is not None and not _only_submodules(names, modules)
                targets = (submodules | ({base} if runs_base else set())) - {None, module}
            graph[module] |= targets
    return graph, hidden


def _only_submodules(names: list[str], modules: dict[str, pathlib.Path]) -> bool:
    """`from package import a, b` naming only submodules needs the package's init alone."""
    return all(name in modules for name in names[1:])


def _cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[tuple[str, ...]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                connect(target)
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
                components.append(tuple(sorted(component)))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(components)


def test_no_import_inside_a_function_hides_a_project_module() -> None:
    hidden = _import_graph()[1]
    assert not hidden, "imports inside functions:\n" + "\n".join(hidden)


def test_no_import_cycles() -> None:
    cycles = _cycles(_import_graph()[0])
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_graph_sees_the_attention_layers() -> None:
    graph, _ = _import_graph()
    assert {"bam_jax.blockwise", "bam_jax.fused_attention"} <= graph["bam_jax.attention"]
    assert "bam_jax.masking" in graph["bam_jax.kernels.tile_math"]


def test_the_architecture_doc_names_every_module() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    unnamed = sorted(
        name
        for name, path in _project_modules().items()
        if path.stem not in ("__init__", "__main__") and path.name not in text
    )
    assert not unnamed, f"docs/architecture.md does not name: {unnamed}"
