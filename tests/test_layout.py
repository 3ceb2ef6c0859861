"""The package's shape, checked from its imports: arrows go one way (spec -> engine ->
ops; engine -> courier -> outputs), the frontend stays on the spec side and uses only the
courier's public name, no family imports another, and no file grows past ~400 lines."""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "overlay" / "graphtap"

# What each part may import of graphtap (itself always): nothing imports up the flow.
ALLOWED = {
    "spec": set(),
    "config": {"spec"},
    "outputs": set(),
    "wire": {"outputs"},
    "ops": set(),
    "courier": {"outputs", "ops.tables", "profiling"},
    "support": set(),
    "profiling": set(),
    "log": set(),
    "engine": {"spec", "config", "ops", "courier", "support", "profiling", "log"},
    "frontend": {"spec", "config", "courier", "outputs", "wire", "support", "log",
                 "profiling"},
    "server": {"config"},
    "client": {"outputs", "wire"},
    "vectors": {"spec"},
    "analyzers": set(),
    "spans": set(),
    "devices": set(),
    "rerank": {"spans"},
}


def part_of(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def graphtap_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return {n for n in names if n == "graphtap" or n.startswith("graphtap.")}


def modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        yield ".".join(rel.parts).removesuffix(".__init__"), path


@pytest.mark.parametrize("module,path", list(modules()), ids=lambda v: str(v))
def test_imports_go_down_the_data_flow(module, path):
    part = part_of(module)
    if part not in ALLOWED:
        return  # cli, demo, testing, runner_info: the house around the package
    for name in graphtap_imports(path):
        target = name.removeprefix("graphtap.")
        if part_of(name) == part or name == "graphtap":
            continue
        assert part_of(name) in ALLOWED[part] or target in ALLOWED[part], \
            f"{module} imports {name}: {part} may import {sorted(ALLOWED[part])}"
        if part == "frontend" and part_of(name) == "courier":
            assert name == "graphtap.courier", f"{module} reaches into {name}"


def test_no_family_imports_another():
    families = {p.stem for p in (PKG / "engine" / "families").glob("*.py")} - {"__init__"}
    for stem in families:
        imported = graphtap_imports(PKG / "engine" / "families" / f"{stem}.py")
        others = {f"graphtap.engine.families.{o}" for o in families - {stem, "vectors"}}
        assert not imported & others, (stem, imported & others)


@pytest.mark.parametrize("module,path", list(modules()), ids=lambda v: str(v))
def test_files_stay_small(module, path):
    assert len(path.read_text().splitlines()) <= 400, module


@pytest.mark.parametrize("module,path", list(modules()), ids=lambda v: str(v))
def test_public_classes_say_what_they_are(module, path):
    undocumented = [node.name for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.ClassDef) and not node.name.startswith("_")
                    and not ast.get_docstring(node)]
    assert not undocumented, (module, undocumented)
