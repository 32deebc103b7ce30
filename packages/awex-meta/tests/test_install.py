"""What ``pip install awex-meta`` gives: complete metadata from one version source, ``py.typed``, the license,
``awex-meta --version``; and the clear message when PyPI's upstream ``awex`` distribution takes the ``awex``
namespace (a stand-in laid out as it is, and the real wheel when PyPI can be reached)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import awex.meta
import awex_doctor

DOCTOR_DIR = str(Path(awex_doctor.__file__).resolve().parent)


def test_installed_metadata_is_complete_and_has_one_version():
    try:
        dist = importlib.metadata.distribution("awex-meta")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("awex-meta is not installed here (run from a source tree): nothing to check")
    meta = dist.metadata
    assert meta["Version"] == awex.meta.__version__  # the version is written once, in awex.meta.__version__
    assert meta["License-Expression"] == "Apache-2.0"
    classifiers = meta.get_all("Classifier")
    assert "Typing :: Typed" in classifiers and any(c.startswith("Development Status") for c in classifiers)
    assert meta["Summary"] and meta["Requires-Python"]
    files = {str(f) for f in dist.files or ()}
    assert any(f.endswith("licenses/LICENSE") for f in files), sorted(files)[:20]
    assert (Path(awex.meta.__file__).parent / "py.typed").is_file()
    scripts = [e for e in dist.entry_points if e.group == "console_scripts" and e.name == "awex-meta"]
    assert scripts and scripts[0].value == "awex_doctor:awex_meta"


def _awex_meta(*args: str, path: list[str] | None = None) -> subprocess.CompletedProcess:
    code = "import sys, awex_doctor; sys.argv = ['awex-meta', *sys.argv[1:]]; sys.exit(awex_doctor.awex_meta())"
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(path)
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=120)


def test_version_names_the_installed_packages():
    out = _awex_meta("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"awex-meta {awex.meta.__version__}"), out.stdout
    for name, version in awex_doctor.installed().items():
        if name != "awex-meta":
            assert f"{name} {version}" in out.stdout


def test_nothing_in_the_awex_namespace_imports_the_doctor():
    """The doctor sits above the namespace (it must run when ``awex`` is broken): ``awex-meta`` passes the packages it
    found to ``awex.meta.cli.main``, which never imports it back (no circle)."""
    import ast

    root = Path(awex.meta.__file__).resolve().parents[1]
    importers = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n.split(".")[0] == "awex_doctor" for n in names):
                importers.append(str(path.relative_to(root)))
    assert importers == []


def test_a_clean_environment_has_no_clash():
    assert awex_doctor.clash() is None
    text, status = awex_doctor.report()
    assert status == 0 and "no clash" in text


def test_a_package_found_twice_is_named_with_what_to_do(tmp_path):
    """A second copy of awex.meta (and its metadata) in a folder that comes first on the path: the doctor names
    both places, says which is imported, and exits 1; without the copy it says nothing of copies."""
    site = tmp_path / "site"
    (site / "awex" / "meta").mkdir(parents=True)  # a namespace portion: no awex/__init__.py, so no clash
    (site / "awex" / "meta" / "__init__.py").write_text("")
    info = site / "awex_meta-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: awex-meta\nVersion: 0.0.1\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), DOCTOR_DIR, *sys.path[1:]])}
    doctor = subprocess.run([sys.executable, "-m", "awex_doctor"], capture_output=True, text=True, env=env, timeout=120)
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    assert "TWO COPIES" in doctor.stdout and "awex.meta in 2 places" in doctor.stdout, doctor.stdout
    assert f"{site / 'awex' / 'meta'} (imported)" in doctor.stdout, doctor.stdout
    assert "awex-meta installed 2 times" in doctor.stdout, doctor.stdout
    assert awex_doctor.copies() is None  # this environment: each package once


def _upstream_stand_in(site: Path) -> None:
    """Laid out as PyPI's awex 0.9.0 is: awex/__init__.py that imports its engines, its own awex/meta/."""
    (site / "awex" / "meta").mkdir(parents=True)
    (site / "awex" / "__init__.py").write_text("raise RuntimeError('upstream awex/__init__.py ran')\n")
    (site / "awex" / "meta" / "__init__.py").write_text("")
    info = site / "awex-0.9.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: awex\nVersion: 0.9.0\n")
    (info / "RECORD").write_text("awex/__init__.py,,\nawex/meta/__init__.py,,\n")


def _assert_clash_is_reported(site: Path) -> None:
    path = [str(site), DOCTOR_DIR, *sys.path[1:]]
    out = _awex_meta("plan", "--help", path=path)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "distribution 'awex' 0.9.0" in out.stderr and "pip uninstall awex" in out.stderr, out.stderr
    assert "upstream awex/__init__.py ran" not in out.stderr  # said before anything of it runs
    doctor = subprocess.run(
        [sys.executable, "-m", "awex_doctor"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(path)},
        timeout=120,
    )
    assert doctor.returncode == 1 and "CLASH" in doctor.stdout, doctor.stdout + doctor.stderr


def test_the_upstream_distribution_is_named_with_what_to_do(tmp_path):
    _upstream_stand_in(tmp_path)
    _assert_clash_is_reported(tmp_path)


def test_the_real_upstream_wheel_is_named_with_what_to_do(tmp_path):
    """PyPI's own awex 0.9.0, installed into a directory that comes first on the path."""
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    got = subprocess.run([*pip, "download", "--no-deps", "awex==0.9.0", "-d", str(wheels)], capture_output=True)
    if got.returncode != 0:
        pytest.skip(f"PyPI's awex 0.9.0 could not be downloaded here: {got.stderr.decode()[-300:]}")
    wheel = next(wheels.glob("awex-0.9.0-*.whl"))
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, capture_output=True)
    assert (site / "awex" / "__init__.py").is_file() and (site / "awex" / "meta").is_dir()
    # What a user meets without the check: awex.meta is upstream's, not ours.
    probe = textwrap.dedent(
        """
        try:
            import awex.meta
            print('plan_transfers' in dir(awex.meta))
        except Exception as e:
            print(type(e).__name__)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path[1:]])}
    seen = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert "True" not in seen.stdout, seen.stdout
    _assert_clash_is_reported(site)
