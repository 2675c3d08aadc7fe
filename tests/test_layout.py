"""The house rules that a tool can check: module sizes, rooms, private attributes, errors.

Each module owns one concept in at most 400 lines; a package (a room) holds at most
15 modules before it gets subpackages; no module reads the private attributes or
imports the private names of another module; every exception class is an
``rlferry.errors.RlferryError``.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pathlib
import pkgutil

import pytest

import rlferry
from rlferry.errors import RlferryError

SRC = pathlib.Path(rlferry.__file__).resolve().parent
MODULES = sorted(p for p in SRC.rglob("*.py"))
MAX_LINES = 400
MAX_ROOM = 15


def _rel(p: pathlib.Path) -> str:
    return str(p.relative_to(SRC.parent))


def _room(p: pathlib.Path) -> str:
    return _rel(p.parent)


ROOMS = sorted({_room(p) for p in MODULES})


@pytest.mark.parametrize("room", ROOMS)
def test_every_module_of_the_room_is_at_most_400_lines(room):
    long = {
        _rel(p): n
        for p in MODULES
        if _room(p) == room and (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by concept): {long}"


@pytest.mark.parametrize("room", ROOMS)
def test_a_room_holds_at_most_15_modules(room):
    here = [p.name for p in MODULES if _room(p) == room and p.name != "__init__.py"]
    assert len(here) <= MAX_ROOM, f"{room}: {len(here)} modules (give it subpackages)"


def _defined_private(tree: ast.AST) -> set[str]:
    """The private names a module defines: its attributes (``self._x = ...``, a class's
    ``_x``), methods, and module-level names."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


TREES = {p: ast.parse(p.read_text()) for p in MODULES}
OWNERS: dict[str, set[str]] = {}
for _p, _tree in TREES.items():
    for _name in _defined_private(_tree):
        OWNERS.setdefault(_name, set()).add(_rel(_p))


def _foreign_reads(p: pathlib.Path) -> list[str]:
    tree = TREES[p]
    mine = _defined_private(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            inside = node.level > 0 or node.module.startswith("rlferry")
            for a in node.names:
                private = a.name.startswith("_") and not a.name.startswith("__")
                if inside and private and not _is_module(p, node, a.name):
                    found.append(f"line {node.lineno}: imports {a.name} from {node.module}")
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or name.startswith("__"):
            continue
        base = node.value
        if isinstance(base, ast.Name) and base.id in ("self", "cls"):
            continue
        if isinstance(base, ast.Call) and getattr(base.func, "id", None) == "super":
            continue
        if name in mine or name not in OWNERS:
            continue  # its own, or not rlferry's (torch._C, a library's)
        found.append(f"line {node.lineno}: reads .{name} (defined in {sorted(OWNERS[name])})")
    return found


def _is_module(p: pathlib.Path, node: ast.ImportFrom, name: str) -> bool:
    """``from . import _plan`` imports a private module of the package, not a private name."""
    if node.level:
        base = p.parent
        for _ in range(node.level - 1):
            base = base.parent
        where = base.joinpath(*(node.module or "").split(".")) if node.module else base
    else:
        where = SRC.parent.joinpath(*node.module.split("."))
    return (where / f"{name}.py").exists() or (where / name).is_dir()


@pytest.mark.parametrize("room", ROOMS)
def test_no_module_reads_another_modules_private_names(room):
    reads = {_rel(p): r for p in MODULES if _room(p) == room and (r := _foreign_reads(p))}
    text = "\n".join(f"{m}: {r}" for m, rs in reads.items() for r in rs)
    assert not reads, f"private names read across modules (make them public, or move them):\n{text}"


LOWER = ("rlferry.wire", "rlferry.queue", "rlferry.weights", "rlferry.control")


def _private_reach(p: pathlib.Path) -> list[str]:
    """Imports of a lower floor's private modules (``rlferry.queue._client``) from another
    package: the floors above use what the floor below exports."""
    own = _rel(p).split("/")[1]
    found = []
    for node in ast.walk(TREES[p]):
        names = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if (
                name.startswith(LOWER)
                and parts[1] != own
                and any(x.startswith("_") and not x.startswith("__") for x in parts[2:])
            ):
                found.append(f"line {node.lineno}: {name}")
    return found


@pytest.mark.parametrize("room", ROOMS)
def test_upper_floors_import_the_lower_floors_public_names_only(room):
    reach = {_rel(p): r for p in MODULES if _room(p) == room and (r := _private_reach(p))}
    text = "\n".join(f"{m}: {r}" for m, rs in reach.items() for r in rs)
    assert not reach, f"private modules of another floor imported:\n{text}"


BUILTIN_ERRORS = {
    n for n, v in vars(builtins).items() if inspect.isclass(v) and issubclass(v, BaseException)
}


def test_every_exception_class_has_rlferry_error_as_an_ancestor():
    strays = []
    for info in pkgutil.walk_packages(rlferry.__path__, "rlferry."):
        try:
            mod = importlib.import_module(info.name)
        except ImportError as e:  # an optional extra (vllm, triton) that is not installed
            assert "No module named" in str(e) or "extra" in str(e), e
            continue
        for obj in vars(mod).values():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == info.name
                and not issubclass(obj, RlferryError)
            ):
                strays.append(f"{obj.__module__}.{obj.__qualname__}")
    # classes of modules that could not be imported here, read from their source
    for p, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
                builtin = {n for n in bases if n in BUILTIN_ERRORS}
                if builtin and bases == builtin and node.name != "RlferryError":
                    strays.append(f"{_rel(p)}: {node.name}({', '.join(sorted(bases))})")
    assert not strays, "exception classes outside rlferry.errors' tree:\n" + "\n".join(strays)
