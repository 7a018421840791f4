"""Import direction is a checked rule: each layer imports only the layers below it (branch_settlement's
docstring has the map, each package's __init__ its own rule). Every import of every module of the installed
namespace is read from its source (also imports inside functions), so a fold that imports the runtime, or a
replay and a runtime that import each other, fail here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent
NS = "branch_settlement"
# The namespace's packages and the folders they come from (pyproject.toml's package-dir).
FOLDERS = {f"{NS}": REPO / "branch_settlement", f"{NS}.schemas": REPO / "schemas",
           f"{NS}.projections": REPO / "projections", f"{NS}.processors": REPO / "processors"}

P = f"{NS}.processors"
# layer -> the layers it may import (besides itself). Listed bottom-up; the most specific prefix names a module's layer.
ALLOWED = {
    f"{NS}.errors": set(),
    f"{NS}.schemas": {f"{NS}.errors"},
    f"{NS}.projections": {f"{NS}.errors", f"{NS}.schemas"},
    f"{P}.gc_tuning": set(),
    f"{P}.workload": set(),
    f"{P}.ledger": {f"{NS}.errors", f"{NS}.schemas", f"{NS}.projections"},
    f"{P}.replay": {f"{NS}.errors", f"{NS}.schemas", f"{NS}.projections", f"{P}.ledger", f"{P}.gc_tuning"},
    f"{P}.kafka": {f"{NS}.errors", f"{NS}.schemas", f"{NS}.projections", f"{P}.ledger", f"{P}.gc_tuning",
                   f"{P}.workload"},
    f"{P}.audit": {f"{NS}.errors", f"{NS}.schemas", f"{NS}.projections", f"{P}.ledger", f"{P}.replay"},
    f"{P}.crosscheck": {f"{NS}.errors", f"{NS}.schemas", f"{NS}.projections", f"{P}.ledger", f"{P}.replay",
                        f"{P}.kafka", f"{P}.gc_tuning"},
    f"{P}.cli": {f"{NS}.errors", f"{NS}.schemas", f"{NS}.projections", f"{P}.ledger", f"{P}.replay", f"{P}.kafka",
                 f"{P}.crosscheck", f"{P}.audit", f"{P}.gc_tuning", f"{P}.workload"},
}


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if package == NS and parts and parts[0] in ("schemas", "projections", "processors"):
                continue
            found[".".join([package, *parts])] = path
    return found


def layer(module: str) -> str:
    candidates = [name for name in ALLOWED if module == name or module.startswith(name + ".")]
    if not candidates and module in (NS, P):
        return module
    assert candidates, f"{module} belongs to no layer of ALLOWED: add it"
    return max(candidates, key=len)


def imports(path: Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_every_module_imports_only_the_layers_below_it() -> None:
    found = modules()
    assert f"{P}.ledger.fold" in found and f"{P}.kafka.processor" in found
    problems = []
    for module, path in sorted(found.items()):
        own = layer(module)
        allowed = ALLOWED.get(own, set()) | {own}
        for name in sorted(imports(path, module)):
            if not (name == NS or name.startswith(NS + ".")):
                if name.split(".")[0] in ("processors", "projections", "schemas"):
                    problems.append(f"{module} imports {name}: import it as {NS}.{name}")
                continue
            if name in found or name in (NS, P):
                target = name
            else:  # `from package import name`: the name is an attribute of an imported module
                target = name.rsplit(".", 1)[0]
            if target in (NS, P):
                continue
            if layer(target) not in allowed:
                problems.append(f"{module} ({own}) imports {name} ({layer(target)})")
    assert not problems, "\n".join(problems)


def test_the_rule_catches_a_fold_importing_the_runtime(tmp_path) -> None:
    """The check itself can fail: a ledger module importing the Kafka runtime is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text(f"from {P}.kafka import processor\n")
    names = imports(bad, f"{P}.ledger.bad")
    assert f"{P}.kafka.processor" in names
    assert layer(f"{P}.kafka.processor") not in ALLOWED[f"{P}.ledger"]


def test_the_event_types_are_defined_once() -> None:
    """The codec's EVENT_TYPES (one schema each) is the list; the fold's per-type tables must cover exactly it."""
    from branch_settlement.processors.ledger.validation import ID_FIELDS
    from branch_settlement.processors.ledger.handlers import HANDLERS
    from branch_settlement.schemas.codec import EVENT_TYPES

    assert set(ID_FIELDS) == set(EVENT_TYPES)
    assert set(HANDLERS) == set(EVENT_TYPES) - {"Tick"}  # a tick is the fold's own step, not a handler's
