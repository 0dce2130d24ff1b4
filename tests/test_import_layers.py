"""Imports point one way (docs/architecture.md, "Layers"): a package imports only packages in lower
layers, never a sibling in its own layer and never one above it. Every import counts, the lazy ones
inside functions too, and ``importlib.import_module("pkg...")`` with a literal name. There is no
exceptions list: a wrong-way import is fixed where it is written.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Low to high. remediation sits above analytics because the planner scores candidate plans with
# analytics' schedule model (remediation/costs.py); trainer and ui are siblings and never import
# each other.
LAYERS: list[set[str]] = [
    {"collector"},
    {"analytics"},
    {"remediation"},
    {"trainer", "ui"},
    {"infra"},
    {"resihp"},
    {"bench"},
]
# infra starts and stops a Kafka broker for the command line and the benchmarks: a leaf tool that
# imports none of our packages, so only the composition root and bench/ import it.
LEAVES = {"collector", "infra"}

# trainer sits on analytics, beside remediation rather than above it (trainer → analytics →
# collector): an executor obeys commands from the bus, never the planner's code, and what both need
# (the slowest-link rule, collector/topology.py) is contract. The console never imports analytics:
# what analytics derives reaches it as events, and the folds it shares with analytics (goodput,
# incidents, the plan lifecycle) are contract in collector/.
APART = {frozenset({"trainer", "remediation"}), frozenset({"ui", "analytics"})}

RANK = {pkg: rank for rank, layer in enumerate(LAYERS) for pkg in layer}
PACKAGES = sorted(RANK)

# Inside a package, its subpackages are layered the same way, low to high. analytics: detection
# judges (the cost model, the frame, the judges, the incident book) and knows nothing of where it
# runs; projections (DuckDB) and sharding (shards and the merge) each run it, never each other;
# the service runs them all on a bus. Every module of such a package lives in one of them.
SUBLAYERS: dict[str, list[set[str]]] = {
    "analytics": [{"detection"}, {"projections", "sharding"}, {"service"}],
}


def imported_modules(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in a module's tree; relative imports stay in ``package``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, package if node.level else node.module or ""))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) == "import_module"):
            found.append((node.lineno, node.args[0].value))
    return found


def subpackage_of(package: str, path: Path) -> str | None:
    """The subpackage of ``package`` that ``path`` lies in (None: outside it, or at its root)."""
    parts = path.relative_to(ROOT / package).parts if path.is_relative_to(ROOT / package) else ()
    return parts[0] if len(parts) > 1 else None


def sublayer_problem(package: str, here: str | None, name: str) -> str | None:
    """Why an import of ``name`` from subpackage ``here`` of ``package`` breaks its sublayers (None: it does not)."""
    layers = SUBLAYERS.get(package)
    parts = name.split(".")
    if layers is None or here is None or len(parts) < 2 or parts[0] != package:
        return None
    rank = {sub: r for r, layer in enumerate(layers) for sub in layer}
    target = parts[1]
    if target == here or target not in rank or here not in rank:
        return None
    if rank[target] == rank[here]:
        return f"{package}.{target} is a sibling of {package}.{here} in the same layer"
    if rank[target] > rank[here]:
        return f"{package}.{target} sits above {package}.{here}"
    return None


def wrong_way_imports(package: str, files: list[Path], subpackage: str | None = None) -> list[str]:
    """Every import in ``files`` (which belong to ``package``, in ``subpackage`` when given, else
    wherever each lies) that the layers or the package's sublayers forbid."""
    problems = []
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        here = subpackage or subpackage_of(package, path)
        for line, name in imported_modules(tree, package):
            target = name.split(".")[0]
            where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line} imports {name}"
            if target == package and (why := sublayer_problem(package, here, name)) is not None:
                problems.append(f"{where}: {why}")
            if target not in RANK or target == package:
                continue
            if package in LEAVES:
                problems.append(f"{where}: {package} is a leaf and imports none of our packages")
            elif frozenset({package, target}) in APART:
                problems.append(f"{where}: {package} and {target} never import each other")
            elif RANK[target] == RANK[package]:
                problems.append(f"{where}: {target} is a sibling of {package} in the same layer")
            elif RANK[target] > RANK[package]:
                problems.append(f"{where}: {target} sits above {package}")
    return problems


def test_every_package_has_a_layer():
    on_disk = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert on_disk - {"tests"} <= set(RANK), f"place {sorted(on_disk - set(RANK))} in LAYERS"
    assert set(RANK) <= on_disk, f"LAYERS names packages that do not exist: {sorted(set(RANK) - on_disk)}"


@pytest.mark.parametrize("package", sorted(SUBLAYERS))
def test_every_module_lies_in_a_sublayer(package):
    named = {sub for layer in SUBLAYERS[package] for sub in layer}
    on_disk = {p.parent.name for p in (ROOT / package).glob("*/__init__.py")}
    loose = sorted(p.name for p in (ROOT / package).glob("*.py") if p.name != "__init__.py")
    assert on_disk == named, f"{package}: subpackages {sorted(on_disk)} on disk, {sorted(named)} in SUBLAYERS"
    assert not loose, f"{package}: place {loose} in one of its subpackages"


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_down_the_layers(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no modules under {package}/"
    problems = wrong_way_imports(package, files)
    assert not problems, "imports that point the wrong way:\n" + "\n".join(problems)


@pytest.mark.parametrize("source, package, expected", [
    ("from resihp.cli import main\n", "collector", "collector is a leaf"),
    ("def f():\n    import bench.recover\n", "resihp", "bench sits above resihp"),
    ("import importlib\nimportlib.import_module('ui.feed')\n", "trainer", "ui is a sibling of trainer"),
    ("from trainer.sim import engine\n", "analytics", "trainer sits above analytics"),
    ("from remediation.cluster import ClusterState\n", "trainer", "trainer and remediation never import each other"),
    ("def f():\n    from analytics.projections.goodput_projection import GoodputProjection\n", "ui",
     "ui and analytics never import each other"),
    ("from remediation import planner\n", "infra", "infra is a leaf"),
])
def test_the_check_catches_a_wrong_way_import(tmp_path, source, package, expected):
    module = tmp_path / "m.py"
    module.write_text(source)
    problems = wrong_way_imports(package, [module])
    assert len(problems) == 1 and expected in problems[0], problems


@pytest.mark.parametrize("source, subpackage, expected", [
    ("from analytics.sharding.merge import JobMerge\n", "detection", "analytics.sharding sits above analytics.detection"),
    ("def f():\n    from analytics.service import consumer\n", "projections",
     "analytics.service sits above analytics.projections"),
    ("from analytics.projections.tables import insert_arrow\n", "sharding",
     "analytics.projections is a sibling of analytics.sharding"),
])
def test_the_check_catches_a_wrong_way_import_between_subpackages(tmp_path, source, subpackage, expected):
    module = tmp_path / "m.py"
    module.write_text(source)
    problems = wrong_way_imports("analytics", [module], subpackage)
    assert len(problems) == 1 and expected in problems[0], problems


def test_the_check_allows_a_downward_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from collector.events import Envelope\nfrom . import sibling\n"
                      "def f():\n    from analytics.detection.schedule import op_table\n")
    assert wrong_way_imports("remediation", [module]) == []
    module.write_text("from analytics.detection.frame import IterationFrame\nfrom analytics.sharding import merge\n")
    assert wrong_way_imports("analytics", [module], "service") == []
