"""The four packages alike: one version source each, the same license text, py.typed, complete metadata, floors
that were run (CHANGELOG.md's "What is tested")."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["meta", "convert", "transport", "engines"]


@pytest.mark.parametrize("name", PACKAGES)
def test_package_metadata(name):
    root = ROOT / "packages" / f"awex-{name}"
    project = tomllib.loads((root / "pyproject.toml").read_text())
    meta = project["project"]
    assert "version" not in meta and meta["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": f"awex.{name}.__version__"}
    assert isinstance(importlib.import_module(f"awex.{name}").__version__, str)
    assert meta["license"] == "Apache-2.0" and meta["license-files"] == ["LICENSE"]
    assert (root / "LICENSE").read_bytes() == (ROOT / "LICENSE").read_bytes()
    assert "Typing :: Typed" in meta["classifiers"]
    assert (root / "src" / "awex" / name / "py.typed").is_file()
    assert project["tool"]["setuptools"]["package-data"] == {f"awex.{name}": ["py.typed"]}


def test_engine_floors_are_versions_that_were_run():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    tested = changelog.split("## What is tested", 1)[1].split("\n## ", 1)[0]
    floors = {}
    for name in PACKAGES:
        meta = tomllib.loads((ROOT / "packages" / f"awex-{name}" / "pyproject.toml").read_text())["project"]
        for req in [*meta["dependencies"], *(r for rs in meta.get("optional-dependencies", {}).values() for r in rs)]:
            if ">=" in req and not req.startswith("awex-"):
                dist, floor = req.split(">=")
                floors[dist.strip()] = floor.split(",")[0].strip()
    names = {"torch": "torch", "vllm": "vLLM", "megatron-core": "Megatron-core", "transformers": "transformers"}
    names["ray"] = "Ray"
    for dist, label in names.items():
        floor = floors[dist]
        assert f"{label} {floor}" in tested, f"{dist}>={floor} is declared but CHANGELOG.md says no run of it"
