"""Checks an environment's Awex installation without importing ``awex``: ``python -m awex_doctor``.

Awex's packages (awex-meta, awex-convert, awex-transport, awex-engines) share the ``awex`` namespace: none of them
ships ``awex/__init__.py``. PyPI's upstream ``awex`` distribution (inclusionAI's Awex) ships ``awex/__init__.py``
(which imports its own engines at once) and its own ``awex/meta/``. Installed in the same environment, its files
take the place of ours: ``import awex.meta`` then runs upstream's code and fails with an error that says nothing
about the clash. This module lives outside ``awex`` so that it can say so; the ``awex-meta`` command runs it first.

    python -m awex_doctor          # prints the Awex packages installed, exits 1 on a clash or a package found twice
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path

OURS = ("awex-meta", "awex-convert", "awex-transport", "awex-engines")
UPSTREAM = "awex"  # PyPI's distribution of inclusionAI's Awex


class AwexInstallClash(ImportError):
    """The ``awex`` namespace of this environment is taken by another distribution."""


def installed() -> dict[str, str]:
    """Version of each Awex package installed here (by distribution name)."""
    found = {}
    for name in OURS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def clash() -> str | None:
    """What takes the ``awex`` namespace away from Awex's packages here, and what to do; ``None`` if nothing."""
    try:
        upstream = importlib.metadata.distribution(UPSTREAM)
    except importlib.metadata.PackageNotFoundError:
        upstream = None
    spec = importlib.util.find_spec("awex")  # finds, never runs, awex/__init__.py
    regular = spec is not None and spec.origin not in (None, "namespace")
    if upstream is None and not regular:
        return None
    if upstream is not None:
        where = upstream.locate_file("")
        what = f"the distribution 'awex' {upstream.version} (PyPI's upstream Awex, inclusionAI) is installed in {where}"
    else:
        what = "a package 'awex' with its own __init__.py is importable"
    if regular:
        what += f"; 'import awex' loads {spec.origin}"
    return (
        f"{what}. It ships awex/__init__.py and awex/meta/, which take the place of the awex.* namespace that "
        f"{', '.join(OURS)} share: 'import awex.meta' would run its code, not this project's. "
        "Use a separate environment for each, or: pip uninstall awex, then pip install --force-reinstall "
        "awex-meta (and the other awex-* packages you use), whose files it may have overwritten."
    )


SUBPACKAGES = ("meta", "convert", "transport", "engines")


def copies() -> str | None:
    """Where one of Awex's packages is found twice (an editable checkout and an install, two site folders, a
    distribution's metadata twice): the first on the path is the one imported, the others are shadowed, and the two
    may differ. What to do; ``None`` if each is found once."""
    spec = importlib.util.find_spec("awex")
    places = [Path(p) for p in (spec.submodule_search_locations or [])] if spec is not None else []
    found = []
    for sub in SUBPACKAGES:
        where = [p / sub for p in places if (p / sub / "__init__.py").is_file()]
        if len(where) > 1:
            found.append(f"awex.{sub} in {len(where)} places: {where[0]} (imported), " + ", ".join(map(str, where[1:])))
    seen: dict[str, list[str]] = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name in OURS:
            seen.setdefault(name, []).append(str(dist.locate_file("")))
    found += [f"{name} installed {len(at)} times: {', '.join(at)}" for name, at in sorted(seen.items()) if len(at) > 1]
    if not found:
        return None
    return (
        "; ".join(found) + ". The one first on the path is used and may not be the one you changed or upgraded: "
        "pip uninstall each twice-installed package until none is left, then install it once "
        "(an editable checkout or a wheel, not both)"
    )


def check() -> None:
    """Raise :class:`AwexInstallClash` saying what clashes and what to do, if anything does."""
    problem = clash()
    if problem is not None:
        raise AwexInstallClash(problem)


def report() -> tuple[str, int]:
    """The doctor's text and exit status."""
    lines = [f"Python {sys.version.split()[0]} at {sys.executable}"]
    versions = installed()
    for name in OURS:
        lines.append(f"{name}: {versions.get(name, 'not installed')}")
    spec = importlib.util.find_spec("awex")
    if spec is not None:
        places = list(spec.submodule_search_locations or [])
        lines.append(f"awex namespace: {', '.join(str(Path(p)) for p in places) or spec.origin}")
    problem, twice = clash(), copies()
    if twice is not None:
        lines.append(f"TWO COPIES: {twice}")
    if problem is None:
        lines.append("no clash: the awex namespace holds only Awex's packages")
        return "\n".join(lines), 1 if twice else 0
    lines.append(f"CLASH: {problem}")
    return "\n".join(lines), 1


def awex_meta() -> int:
    """The ``awex-meta`` command: the installation check, then :func:`awex.meta.cli.main`."""
    try:
        check()
    except AwexInstallClash as e:
        print(f"awex-meta: {e}", file=sys.stderr)
        return 2
    from awex.meta.cli import main

    return main(installed=installed())


def main() -> int:
    text, status = report()
    print(text)
    return status


if __name__ == "__main__":
    sys.exit(main())
