"""``meshlearn.net`` is the bottom layer: it imports the standard library, torch, cryptography,
itself and meshlearn's core basics, never config, train, distributed or elastic."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import meshlearn.net

ALLOWED = {"torch", "cryptography", "meshlearn.net", "meshlearn.atomic"}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def _allowed(name: str) -> bool:
    return (name.split(".")[0] in sys.stdlib_module_names or name == "__future__"
            or any(name == a or name.startswith(a + ".") for a in ALLOWED))


def test_net_imports_only_the_bottom_layer() -> None:
    package = Path(meshlearn.net.__file__).parent
    modules = sorted(package.glob("*.py"))
    assert len(modules) >= 7
    found = {f"{path.name}: {name}" for path in modules for name in _imports(path) if not _allowed(name)}
    assert found == set()
    assert "meshlearn.net.keys" in _imports(package / "tls.py")  # the parser sees the package's own imports
