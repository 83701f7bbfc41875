"""The whole package keeps the layers of docs/ARCHITECTURE.md: each module imports only its own layer and
the layers below it, and no package imports another package's private names (a module or an attribute
whose name starts with an underscore). The checks read the source of every module under src/roving, at
any depth of the file (an import inside a function counts), so they fail on any new import.
"""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

import roving

SRC = Path(roving.__file__).resolve().parent

#: The layers, lowest first, as docs/ARCHITECTURE.md draws them. A module belongs to the layer of the
#: longest prefix that names it; every module must have one (a new top-level module is placed here).
LAYERS: List[Tuple[str, Tuple[str, ...]]] = [
    ("errors", ("roving.errors",)),  # the one error family's base, under every package's errors
    # owner-only files and the selector thread: used by the backends and everything above
    ("system helpers", ("roving.system",)),
    ("config", ("roving.config",)),
    ("backends", ("roving.backends",)),
    ("transport", ("roving.transport",)),
    # a child's start-up checks (boot, environment, code shipping) and its crash log are the process's
    ("processes, pipes and queues", ("roving.process", "roving._child", "roving.connection", "roving.queues",
                                     "roving.shared", "roving._sentinels", "roving.observe", "roving.boot",
                                     "roving.environment", "roving.codeship", "roving.crashlog",
                                     "roving.process_payload", "roving.stdlib_process")),
    ("pool, managers and synchronisation", ("roving.pool", "roving.managers", "roving.synchronize",
                                            "roving.sharedctypes", "roving._homed", "roving._manager_proxy",
                                            "roving._manager_server")),
    # the facade (roving/__init__.py) and the context object expose the API below; the standard
    # interfaces built on it sit beside them
    ("API", ("roving", "roving.context", "roving.futures", "roving.joblib", "roving.rl")),
    # SkipPipe, room by room (docs/ARCHITECTURE.md): the model and the run's vocabulary at its root; the
    # planning, which needs neither PyTorch nor the runtime; the stages and the messages between them;
    # the verification of nodes; the runtime that runs stages on nodes; the run that drives it all
    ("pipeline: the model, its sizes, the faults' vocabulary", (
        "roving.pipeline.errors", "roving.pipeline.presets", "roving.pipeline.model", "roving.pipeline.optim",
        "roving.pipeline.faults")),
    ("pipeline: planning", ("roving.pipeline.planning",)),
    ("pipeline: stages and their messages", ("roving.pipeline.stages", "roving.pipeline.protocol",
                                            "roving.pipeline.dispatch")),
    ("pipeline: verification", ("roving.pipeline.verify",)),
    ("pipeline: runtime", ("roving.pipeline.runtime",)),
    ("pipeline: the run", ("roving.pipeline.run", "roving.pipeline")),
    ("commands and dashboard", ("roving.cli", "roving.__main__", "roving.pipeline.run.cli",
                                "roving.pipeline.run.inference", "roving.dashboard")),
]

#: The packages whose private names are theirs alone (the rest of roving's modules form ``roving``).
PACKAGES = ("roving.system", "roving.backends", "roving.transport", "roving.pool", "roving.pipeline",
            "roving.dashboard", "roving.rl")

#: Upward imports that are allowed, each with its reason; each must be made inside a function, so that
#: importing the lower module never imports the upper one.
UPWARD_ALLOWED: Dict[Tuple[str, str], str] = {
    ("roving", "roving.dashboard"): "roving.init(dashboard=True) (or ROVING_DASHBOARD=1) starts the dashboard",
}

#: Reach-ins into another package's private names not yet removed, each with what removes it. The test
#: fails when one is gone (so that the entry goes too) as when a new one appears.
PRIVATE_KNOWN: Dict[Tuple[str, str], str] = {
    ("roving.pool._upkeep", "roving._sentinels"): "the sentinel watcher, public once the selector threads "
                                                  "are one helper (issue 33)",
}


@dataclass(frozen=True)
class Import:
    """One roving name a module imports: ``target`` is absolute (``roving.pool._results.deliver``)."""

    module: str
    target: str
    line: int
    in_function: bool


def _module_name(path: Path) -> str:
    parts = ("roving", *path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> Dict[str, Path]:
    found = {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}
    assert len(found) > 80, f"only {len(found)} modules found under {SRC}"
    return found


def _imports(module: str, path: Path) -> List[Import]:
    """The roving names ``module`` imports, with whether each import is made inside a function."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: List[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[:len(package.split(".")) - child.level + 1]
                    name = ".".join(base + ([child.module] if child.module else []))
                else:
                    name = child.module or ""
                targets = [f"{name}.{a.name}" for a in child.names]
            elif isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            else:
                visit(child, inner)
                continue
            out.extend(Import(module, t, child.lineno, in_function) for t in targets
                       if t == "roving" or t.startswith("roving."))

    visit(ast.parse(path.read_text()), False)
    return out


def _all_imports() -> List[Import]:
    return [imp for module, path in _modules().items() for imp in _imports(module, path)]


def _layer(name: str) -> Optional[int]:
    best: Optional[Tuple[int, int]] = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    return None if best is None else best[0]


def _package(name: str) -> str:
    return next((p for p in PACKAGES if name == p or name.startswith(p + ".")), "roving")


def _private_part(name: str) -> Optional[str]:
    """The first private component of ``name`` after its package (``_results`` of roving.pool._results)."""
    rest = name[len(_package(name)):].lstrip(".")
    return next((part for part in rest.split(".") if part.startswith("_") and not part.startswith("__")), None)


def _private_reach_ins() -> Set[Tuple[str, str, int]]:
    """(module, the private name up to its private part, line) for each import of another package's
    private name, and each use of a private attribute of a module or class imported from one."""
    found = set()
    for imp in _all_imports():
        part = _private_part(imp.target)
        if part is not None and _package(imp.target) != _package(imp.module):
            found.add((imp.module, imp.target[:imp.target.index(part) + len(part)], imp.line))
    for module, path in _modules().items():
        bound = {}  # local name -> the roving name it was imported as
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                name = ".".join(base + ([node.module] if node.module else []))
                bound.update({a.asname or a.name: f"{name}.{a.name}" for a in node.names})
            elif isinstance(node, ast.Import):
                bound.update({a.asname or a.name.partition(".")[0]: a.name if a.asname else a.name.partition(".")[0]
                              for a in node.names})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                target = bound.get(node.value.id, "")
                if target.startswith("roving") and _package(target) != _package(module):
                    found.add((module, f"{target}.{node.attr}", node.lineno))
    return found


def test_every_module_of_the_package_has_a_layer():
    unplaced = sorted(m for m in _modules() if _layer(m) is None)
    assert unplaced == [], f"place these modules in a layer of LAYERS: {unplaced}"


def test_each_module_imports_only_its_own_layer_and_the_layers_below():
    upward = []
    for imp in _all_imports():
        low, high = _layer(imp.module), _layer(imp.target)
        assert low is not None and high is not None, imp
        if high <= low:
            continue
        allowed = next((why for (src, dst), why in UPWARD_ALLOWED.items()
                        if imp.module == src and (imp.target == dst or imp.target.startswith(dst + "."))), None)
        if allowed is None or not imp.in_function:
            upward.append(f"{imp.module}:{imp.line} ({LAYERS[low][0]}) imports {imp.target} ({LAYERS[high][0]})")
    assert upward == [], "imports that go up a layer:\n" + "\n".join(upward)


def test_the_allowed_upward_imports_are_still_made():
    made = {(imp.module, imp.target) for imp in _all_imports()}
    for src, dst in UPWARD_ALLOWED:
        assert any(m == src and (t == dst or t.startswith(dst + ".")) for m, t in made), \
            f"{src} no longer imports {dst}: remove the entry from UPWARD_ALLOWED"


def test_no_package_imports_or_reads_a_private_name_of_another_package():
    found = _private_reach_ins()
    unknown = sorted(f"{m}:{line} uses {name}" for m, name, line in found if (m, name) not in PRIVATE_KNOWN)
    assert unknown == [], "private names of another package:\n" + "\n".join(unknown)
    gone = sorted(k for k in PRIVATE_KNOWN if k not in {(m, name) for m, name, _ in found})
    assert gone == [], f"these reach-ins are gone: remove them from PRIVATE_KNOWN: {gone}"


def test_the_private_name_check_sees_an_import_and_an_attribute_of_another_package(tmp_path, monkeypatch):
    """The check itself: a module that imports another package's private module, and one that reads a
    private attribute of a module imported from another package, are both reported."""
    fake = tmp_path / "roving"
    (fake / "pipeline").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "pipeline" / "__init__.py").write_text("")
    (fake / "pipeline" / "a.py").write_text("from ..pool import _dispatch\n")
    (fake / "pipeline" / "b.py").write_text("from ..transport import endpoint as ep\nep._peers\n")
    (fake / "pipeline" / "c.py").write_text("from . import _own\nfrom ..transport import endpoint\n")
    for i in range(81):  # _modules() insists on a package of some size
        (fake / f"m{i}.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "SRC", fake)
    assert _private_reach_ins() == {("roving.pipeline.a", "roving.pool._dispatch", 1),
                                    ("roving.pipeline.b", "roving.transport.endpoint._peers", 2)}


def _within(target: str, *prefixes: str) -> bool:
    return any(target == p or target.startswith(p + ".") for p in prefixes)


def test_no_backend_module_imports_the_transport_or_anything_above_the_configuration():
    files = [m for m in _modules() if _package(m) == "roving.backends"]
    assert len(files) >= 7
    outside = sorted({f"{imp.module} imports {imp.target}" for imp in _all_imports()
                      if imp.module in files and not _within(imp.target, "roving.backends", "roving.config",
                                                             "roving.errors", "roving.system")})
    assert outside == []


def test_the_configuration_imports_no_other_roving_module_but_the_error_family():
    assert [imp.target for imp in _all_imports()
            if imp.module == "roving.config" and not _within(imp.target, "roving.errors")] == []
    assert [imp.target for imp in _all_imports() if imp.module == "roving.errors"] == []


#: Each backend is a plug-in: a module or folder that nothing outside it imports but roving.backends,
#: which picks one by name (``backends.get``).
BACKEND_PLUGINS = ("roving.backends.local", "roving.backends.slurm", "roving.backends.docker",
                   "roving.backends.kubernetes")
#: Direct imports of a backend from outside it, each with its reason.
PLUGIN_IMPORTS_KNOWN: Dict[Tuple[str, str], str] = {
    ("roving.cli", "roving.backends.docker"): "`roving run --build` builds and pushes an image, which only "
                                              "Docker's backend does",
}


def test_nothing_outside_a_backend_imports_it_but_the_backends_package_that_picks_it_by_name():
    found = set()
    for imp in _all_imports():
        plugin = next((p for p in BACKEND_PLUGINS if _within(imp.target, p)), None)
        if plugin is not None and not _within(imp.module, plugin) and imp.module != "roving.backends":
            found.add((imp.module, plugin))
    assert found == set(PLUGIN_IMPORTS_KNOWN), found
