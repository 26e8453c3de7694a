"""Architecture boundaries from DESIGN.md, enforced on the import graph of the source tree."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("flows", "training", "data_pipeline", "evaluation", "infra")
MODEL_CODE = ("training/model.py", "training/moe.py", "training/sampling.py", "training/accounting.py")
# Only these modules may import the library on the left (paths relative to the repository root).
OWNERS = {
    "deepspeed": {"training/parallel.py"},
    "ray.train": {"training/launch.py"},
    "ray.tune": {"training/sweep.py"},
    "mlflow": {"infra/"},
    "prefect": {"flows/", "infra/"},
}


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
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
