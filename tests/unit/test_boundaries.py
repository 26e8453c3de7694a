"""Architecture boundaries from DESIGN.md, enforced on the import graph of the source tree."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("flows", "training", "data_pipeline", "evaluation", "infra")
# Lower layers never import higher ones: infra < data_pipeline < training < evaluation < flows.
LAYERS = {"infra": 0, "data_pipeline": 1, "training": 2, "evaluation": 3, "flows": 4}
LIBRARIES = ("infra", "data_pipeline", "training", "evaluation")
# the model package (configuration, transformer, MoE, sampling, accounting, LoRA, the Hugging Face mapping)
MODEL_CODE = tuple(sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "training" / "model").glob("*.py")))
# Only these modules may import the library on the left (paths relative to the repository root).
OWNERS = {
    "deepspeed": {"training/parallel/"},
    "ray.train": {"training/launch.py"},
    "ray.tune": {"training/stages/sweep.py"},
    "mlflow": {"infra/"},
    "prefect": {"flows/", "infra/"},
}


def imports_of(path: Path, runtime_only: bool = False) -> set[str]:
    """Every module or name `path` imports, at the top or inside functions (`runtime_only`: less the imports
    under `if TYPE_CHECKING:`, which only the type checker runs)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    checking_only = {
        id(inner)
        for node in ast.walk(tree)
        if runtime_only and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for statement in node.body
        for inner in ast.walk(statement)
    }
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in checking_only:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def source_files() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_there_is_source_to_check() -> None:
    assert len(source_files()) >= 8


@pytest.mark.parametrize("library", OWNERS)
def test_library_is_imported_only_by_its_owner(library: str) -> None:
    offenders = []
    for path in source_files():
        rel = path.relative_to(ROOT).as_posix()
        uses = any(name == library or name.startswith(library + ".") for name in imports_of(path))
        if uses and not any(rel == owner or rel.startswith(owner) for owner in OWNERS[library]):
            offenders.append(rel)
    assert not offenders, f"{library} imported outside {sorted(OWNERS[library])}: {offenders}"


@pytest.mark.parametrize("module", MODEL_CODE)
def test_model_code_is_device_and_distribution_free(module: str) -> None:
    path = ROOT / module
    forbidden = ("deepspeed", "ray", "mlflow", "prefect", "torch.distributed", "torch.cuda")
    bad = [n for n in imports_of(path) if any(n == f or n.startswith(f + ".") for f in forbidden)]
    assert not bad, f"{module} imports {bad}"
    names = {
        node.attr if isinstance(node, ast.Attribute) else node.id
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Attribute | ast.Name)
    }
    owned_elsewhere = names & {"autocast", "get_rank", "cuda", "to_device", "set_device"}
    assert not owned_elsewhere, (
        f"{module} uses {owned_elsewhere}: model code must not own device or precision"
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_imports_a_higher_layer(package: str) -> None:
    """Every import, at the top of a module or inside a function body, stays at its own layer or below."""
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in imports_of(path):
            top = name.split(".")[0]
            if top in LAYERS and LAYERS[top] > LAYERS[package]:
                offenders.append(f"{path.relative_to(ROOT).as_posix()} imports {name}")
    assert not offenders, "\n".join(sorted(set(offenders)))


@pytest.mark.parametrize("package", LIBRARIES)
def test_libraries_take_stage_specs_not_the_recipe(package: str) -> None:
    """The Recipe lives at the edge (flows/): library functions receive their own spec or slices."""
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                if any(a.arg == "recipe" for a in args):
                    offenders.append(f"{path.relative_to(ROOT).as_posix()}:{node.lineno} {node.name}")
    assert not offenders, offenders


def test_the_layer_rule_catches_an_upward_import(tmp_path: Path) -> None:
    """The checker itself: an import inside a function body is seen."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from flows.recipe import Recipe\n    return Recipe\n")
    assert "flows.recipe" in imports_of(module)


def module_graph() -> dict[str, set[str]]:
    """module -> the lmforge modules it imports when it runs (function-level imports included)."""
    modules = {}
    for path in source_files():
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def owner(name: str) -> str | None:
        parts = name.split(".")
        return next((m for i in range(len(parts), 0, -1) if (m := ".".join(parts[:i])) in modules), None)

    return {
        module: {o for name in imports_of(path, runtime_only=True) if (o := owner(name)) and o != module}
        for module, path in modules.items()
    }


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each a circle of imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while (top := stack.pop()) != module:
                component.append(top)
            if component:
                circles.append(sorted([module, *component]))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def test_no_import_circles() -> None:
    """No two modules import each other, directly or around a circle, not even from inside a function."""
    assert import_circles(module_graph()) == []


def test_the_circle_check_sees_a_function_level_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_circles(graph) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


def test_the_cli_and_every_stage_declaration_load_without_torch() -> None:
    """`lmforge --help` builds every command from the registry without importing torch (or Ray, or Prefect)."""
    import subprocess
    import sys

    script = (
        "import sys; from flows.cli import build_parser; build_parser().format_help(); "
        "heavy = [m for m in ('torch', 'ray', 'prefect', 'deepspeed', 'mlflow') if m in sys.modules]; "
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
