"""The package's import layers, read from the source with ``ast`` (nothing is imported).

Every ``import``/``from ... import`` counts, at module level and inside functions (a lazy import is
still a dependency, only a hidden one), type-only ones under ``TYPE_CHECKING`` too, and so does
``importlib.import_module("meshlearn....")`` with a literal name. The rules:

- no import circle among meshlearn's modules (a strongly connected component of more than one);
- a method package (anchor, compress, curvature, dp, protocol, verify, warmup, and the subspace
  update plugin) imports no trainer, planner, runtime, entry point, config tree or compatibility table;
- the dist runtime never imports the elastic layer (elastic is composed on top of it);
- the runtimes and the engine (distributed, elastic, cluster, mesh) never import the trainer
  (``train``): what they share with it (the run folder's checkpoint layout, the worker's assembly,
  the config diff) sits below both;
- the transport at the bottom (``net``: credentials, TLS, the one port, authenticated links)
  imports nothing of meshlearn's but itself and the leaf helpers ``atomic`` and ``errors``, and of
  the rest only the standard library, torch and cryptography (it stays light to audit);
- nothing imports ``meshlearn.entry`` but the entry points themselves and ``meshlearn.__main__``;
- nobody probes a driver with ``getattr``/``hasattr`` (a call whose first argument is a name or
  attribute ending in ``driver``): what a driver offers is declared (``mesh/driver.py``), and an
  optional capability is tested with ``isinstance`` on its Protocol.

Each broken rule is one line: the edge (importer -> imported, at FILE:LINE) or the probe, and the rule.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "meshlearn"

METHODS = ("anchor", "compress", "curvature", "dp", "protocol", "verify", "warmup", "mesh.basis_updates")
ABOVE_METHODS = ("train", "plan", "distributed", "elastic", "entry", "config", "compat")
RUNTIMES = ("distributed", "elastic", "cluster", "mesh")  # never import the trainer
BELOW_NET = ("net", "atomic", "errors")  # what the transport may import
NET_THIRD_PARTY = ("torch", "cryptography")  # besides the standard library


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    where: str  # FILE:LINE of the import


def _within(module: str, package: str) -> bool:
    """Whether ``module`` is ``package`` or inside it (``package`` without the root prefix)."""
    name = f"{ROOT}.{package}"
    return module == name or module.startswith(name + ".")


def module_names(src: Path) -> dict[str, Path]:
    """Every module under ``src/meshlearn`` by its dotted name (a package by its ``__init__``)."""
    names = {}
    for path in sorted((src / ROOT).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The module a ``from`` import names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(module: str, source: str, is_package: bool, known: Iterable[str]) -> list[tuple[str, int]]:
    """(imported meshlearn module, line) for every import in ``source``; a ``from A import b`` of a
    submodule ``A.b`` counts as an import of ``A.b``."""
    known = set(known)
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, is_package, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in known else base, node.lineno))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == "import_module" and isinstance(node.args[0].value, str):
                found.append((node.args[0].value, node.lineno))
    return [(name, line) for name, line in dict.fromkeys(found)  # one per (module, line), in order
            if (name == ROOT or name.startswith(ROOT + ".")) and name != module]


def import_graph(src: Path = SRC) -> list[Edge]:
    names = module_names(src)
    edges = []
    for module, path in names.items():
        for imported, line in imports_of(module, path.read_text(), path.name == "__init__.py", names):
            edges.append(Edge(module, imported, f"{path.relative_to(src)}:{line}"))
    return edges


def circles(edges: Iterable[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    succ: dict[str, set[str]] = {}
    for e in edges:
        succ.setdefault(e.importer, set()).add(e.imported)
        succ.setdefault(e.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(succ):
        if root in index:
            continue
        work = [(root, iter(sorted(succ[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(succ[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def layer_violations(edges: list[Edge]) -> list[str]:
    """One line per broken rule: the circles' edges, then the upward edges."""
    lines = []
    for component in circles(edges):
        members = set(component)
        for e in edges:
            if e.importer in members and e.imported in members:
                lines.append(f"{e.importer} -> {e.imported} ({e.where}): in an import circle of "
                             f"{len(component)} modules")
    for e in edges:
        method = any(_within(e.importer, m) for m in METHODS)
        if method and any(_within(e.imported, p) for p in ABOVE_METHODS):
            lines.append(f"{e.importer} -> {e.imported} ({e.where}): a method imports the trainer, planner, "
                         "a runtime, an entry point or the config tree")
        if _within(e.importer, "distributed") and _within(e.imported, "elastic"):
            lines.append(f"{e.importer} -> {e.imported} ({e.where}): the dist runtime imports the elastic "
                         "layer (the entry point composes it)")
        if any(_within(e.importer, r) for r in RUNTIMES) and _within(e.imported, "train"):
            lines.append(f"{e.importer} -> {e.imported} ({e.where}): a runtime imports the trainer "
                         "(what both need sits below both)")
        if _within(e.importer, "net") and not any(_within(e.imported, p) for p in BELOW_NET):
            lines.append(f"{e.importer} -> {e.imported} ({e.where}): the transport (net) imports a layer "
                         "above it")
        if (_within(e.imported, "entry") and not _within(e.importer, "entry")
                and e.importer != f"{ROOT}.__main__"):
            lines.append(f"{e.importer} -> {e.imported} ({e.where}): only the entry points import "
                         f"{ROOT}.entry")
    return lines


def driver_probes(src: Path = SRC) -> list[str]:
    """One line per ``getattr``/``hasattr`` call on a driver (``driver``, ``self.driver``,
    ``ctx.driver``, ``sim_driver``, ...) in the package: FILE:LINE and the call."""
    lines = []
    for path in module_names(src).values():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and node.args):
                continue
            target = node.args[0]
            name = (target.id if isinstance(target, ast.Name) else
                    target.attr if isinstance(target, ast.Attribute) else "")
            if name.endswith("driver"):
                lines.append(f"{path.relative_to(src)}:{node.lineno}: {ast.unparse(node)}: probes a driver "
                             "(declare the member in mesh/driver.py, or test a capability with isinstance)")
    return lines


def transport_third_party(src: Path = SRC) -> list[str]:
    """One line per import in ``net`` of a module that is neither the standard library, meshlearn,
    nor one of ``NET_THIRD_PARTY``."""
    lines = []
    for module, path in module_names(src).items():
        if not _within(module, "net"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module
                     else [])
            for name in names:
                top = name.split(".")[0]
                if top not in (*sys.stdlib_module_names, ROOT, "__future__", *NET_THIRD_PARTY):
                    lines.append(f"{path.relative_to(src)}:{node.lineno}: imports {name}: the transport "
                                 f"uses only the standard library and {', '.join(NET_THIRD_PARTY)}")
    return lines


def test_the_transport_needs_only_the_standard_library_torch_and_cryptography(tmp_path):
    assert not transport_third_party(), "\n".join(transport_third_party())
    src = _fake_package(tmp_path, {"__init__.py": "", "net/__init__.py": "",
                                   "net/tls.py": "import ssl\nimport numpy\nfrom cryptography import x509\n"})
    assert [line.split(": ")[0] for line in transport_third_party(src)] == ["meshlearn/net/tls.py:2"]


def test_nobody_probes_a_driver():
    assert not driver_probes(), "\n".join(driver_probes())


def test_the_probe_check_finds_each_form_of_probe(tmp_path):
    src = _fake_package(tmp_path, {
        "__init__.py": "",
        "train/__init__.py": "",
        "train/loop.py": ("def f(driver, ctx):\n"
                          "    a = getattr(driver, 'lookahead', 0)\n"
                          "    b = hasattr(ctx.driver, 'timeline')\n"
                          "    c = getattr(self.sim_driver, 'clock')\n"),
        "verify/__init__.py": "",
        "verify/plugin.py": ("from meshlearn.mesh.driver import DataPlan\n\n"
                             "def g(driver, ctx, config):\n"
                             "    x = isinstance(driver, DataPlan)\n"
                             "    y = getattr(config, 'driver', None)\n"  # the driver is not the target
                             "    z = getattr(ctx.driver_settings, 'x', 0)\n"
                             "    return driver.lookahead\n"),
    })
    assert [line.split(": ")[0:2] for line in driver_probes(src)] == [
        ["meshlearn/train/loop.py:2", "getattr(driver, 'lookahead', 0)"],
        ["meshlearn/train/loop.py:3", "hasattr(ctx.driver, 'timeline')"],
        ["meshlearn/train/loop.py:4", "getattr(self.sim_driver, 'clock')"],
    ]


def test_the_package_keeps_its_layers():
    edges = import_graph()
    assert len({e.importer for e in edges}) > 100  # the walk saw the package, not an empty folder
    problems = layer_violations(edges)
    assert not problems, "\n".join(problems)


def _fake_package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / ROOT / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_checker_reports_each_kind_of_broken_layer(tmp_path):
    """A small fake package breaking every rule once, with the import styles the check must see:
    a lazy import, a relative one, a type-only one, and importlib."""
    src = _fake_package(tmp_path, {
        "__init__.py": "",
        "hooks.py": "import importlib\n\ndef build():\n    importlib.import_module('meshlearn.plugins')\n",
        "plugins.py": "from meshlearn.anchor import plugin\n",
        "anchor/__init__.py": "",
        "anchor/plugin.py": "from meshlearn import hooks\n\ndef f():\n    from ..train import loop\n",
        "train/__init__.py": "",
        "train/loop.py": "",
        "distributed/__init__.py": "",
        "distributed/worker.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                 "    from meshlearn.elastic.driver import Driver\n",
        "elastic/__init__.py": "",
        "elastic/driver.py": "",
        "elastic/membership.py": "from meshlearn.train.loop import run\n",
        "cluster/__init__.py": "",
        "cluster/shared.py": "def changed():\n    from meshlearn.train import loop\n",
        "mesh/__init__.py": "",
        "mesh/sim.py": "import importlib\n\nimportlib.import_module('meshlearn.train')\n",
        "distributed/verifier.py": "from ..train import loop\n",
        "entry/__init__.py": "",
        "entry/cli.py": "from meshlearn.distributed import worker\n",
        "report.py": "from meshlearn.entry.cli import main\n",
        "__main__.py": "from meshlearn.entry.cli import main\n",
        "errors.py": "",
        "net/__init__.py": "",
        "net/tls.py": "from meshlearn import errors\n\ndef dial():\n    from meshlearn.train import loop\n",
    })
    problems = layer_violations(import_graph(src))
    assert sorted(p.split(" (")[0] for p in problems) == [
        "meshlearn.anchor.plugin -> meshlearn.hooks",  # hooks -> plugins -> anchor.plugin -> hooks
        "meshlearn.anchor.plugin -> meshlearn.train.loop",  # a method imports the trainer (lazily)
        "meshlearn.cluster.shared -> meshlearn.train.loop",  # a runtime imports the trainer (lazily)
        "meshlearn.distributed.verifier -> meshlearn.train.loop",  # ... (relative)
        "meshlearn.distributed.worker -> meshlearn.elastic.driver",  # dist -> elastic (type-only)
        "meshlearn.elastic.membership -> meshlearn.train.loop",  # a runtime imports the trainer
        "meshlearn.hooks -> meshlearn.plugins",  # importlib's edge closes the circle
        "meshlearn.mesh.sim -> meshlearn.train",  # the engine imports the trainer (importlib)
        "meshlearn.net.tls -> meshlearn.train.loop",  # the transport reaches up (errors is allowed)
        "meshlearn.plugins -> meshlearn.anchor.plugin",
        "meshlearn.report -> meshlearn.entry.cli",  # only entry and __main__ may import entry
    ]
    assert all("in an import circle of 3 modules" in p for p in problems if "hooks" in p or "plugins ->" in p)
    assert sum("a runtime imports the trainer" in p for p in problems) == 4
    assert any(p.startswith("meshlearn.anchor.plugin -> meshlearn.train.loop (meshlearn/anchor/plugin.py:4)")
               for p in problems)


def test_the_checker_passes_a_package_that_keeps_its_layers(tmp_path):
    src = _fake_package(tmp_path, {
        "__init__.py": "",
        "hooks.py": "",
        "anchor/__init__.py": "",
        "anchor/plugin.py": "from meshlearn import hooks\n",
        "elastic/__init__.py": "",
        "elastic/driver.py": "from meshlearn.distributed import worker\n",
        "distributed/__init__.py": "",
        "distributed/worker.py": "from meshlearn.checkpoint_layout import latest_complete\n",
        "checkpoint_layout.py": "",
        "train/__init__.py": "",
        "train/trainer.py": ("from meshlearn import checkpoint_layout\n"
                             "from meshlearn.distributed import worker\n"),
        "entry/__init__.py": "",
        "entry/plugins.py": "from meshlearn.anchor.plugin import *\n",
        "entry/cli.py": "from . import plugins\nfrom meshlearn.elastic.driver import *\n",
        "__main__.py": "from meshlearn.entry.cli import main\n",
    })
    edges = import_graph(src)
    assert Edge("meshlearn.entry.cli", "meshlearn.entry.plugins", "meshlearn/entry/cli.py:1") in edges
    assert layer_violations(edges) == []
