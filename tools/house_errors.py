"""The ``errors`` check of ``tools/house.py``: every error a package raises on purpose is one of Awex's
(``awex.meta.errors``: ``AwexError``, and ``AwexValueError`` for values it cannot use), read statically. A package's
source may not raise a bare ``ValueError`` (raise ``AwexValueError``, or a class of its own on it), and every exception
class it defines derives from an Awex error (by name: its bases include ``AwexError``, ``AwexValueError`` or another
class it defines that does) unless it is one of :data:`INTERNAL`, which never leave the module that raises them, or
of :data:`APART`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILTIN = {"Exception", "ValueError", "RuntimeError", "TimeoutError", "AssertionError", "TypeError", "KeyError"}
INTERNAL = {  # caught where they are raised, never seen by a user
    "UnsupportedLoad": "awex.convert.recorded: a probe's load that no box expresses, turned into AmbiguousLoadError",
    "Busy": "awex.meta.http_exchange: a 503 answer, retried by the client until its deadline",
    "BadRequest": "awex.meta.server.errors: the server's 400 answer, sent as HTTP",
    "TooLarge": "awex.meta.server.errors: the server's 413 answer, sent as HTTP",
}
APART = {  # user-facing, but cannot derive from AwexError
    "AwexInstallClash": "awex_doctor: the awex namespace itself is broken (awex.meta cannot be imported)",
}


def _sources() -> list[Path]:
    return sorted(p for p in ROOT.glob("packages/*/src/**/*.py") if "build" not in p.parts)


def check_errors() -> list[str]:
    found: list[str] = []
    classes: dict[str, tuple[list[str], str]] = {}
    for path in _sources():
        rel = path.relative_to(ROOT)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                if getattr(node.exc.func, "id", None) == "ValueError":
                    found.append(f"{rel}:{node.lineno}: raises a bare ValueError; raise AwexValueError")
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                classes[node.name] = (bases, f"{rel}:{node.lineno}")

    def awex(name: str, seen: frozenset = frozenset()) -> bool:
        if name in ("AwexError", "AwexValueError"):
            return True
        if name not in classes or name in seen:
            return False
        return any(awex(b, seen | {name}) for b in classes[name][0])

    def exception(name: str, seen: frozenset = frozenset()) -> bool:
        if name in BUILTIN or name.endswith("Error"):
            return True
        return name in classes and name not in seen and any(exception(b, seen | {name}) for b in classes[name][0])

    for name, (bases, where) in sorted(classes.items()):
        if any(exception(b) for b in bases) and not awex(name) and name not in INTERNAL and name not in APART:
            found.append(f"{where}: {name}({', '.join(bases)}) is not an Awex error (derive it from AwexError)")
    return found
