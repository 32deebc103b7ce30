"""Every shell command README.md gives runs as written on the CPU stack CI installs, or is held to what CI runs: each
line of its shell blocks is matched by one rule below, and a line no rule knows fails here (a new command needs its
check). ``./noxw -s NAME`` names a session of noxfile.py (the plan session's arguments are run through
``awex-meta plan``); ``pip install`` names packages of this repository and extras they declare; ``awex-meta
--version`` and ``python -m awex_doctor`` run; the server command is the one the integration tests start
(``awex_integration.engines.vllm_http.VllmServer``), the same module and flags."""

from __future__ import annotations

import ast
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _shell_lines() -> list[str]:
    """The commands of README's shell blocks (fences without a language), continuations joined, comments dropped."""
    lines: list[str] = []
    fence: str | None = None  # inside a block: its language ("" for a shell block)
    for line in README.replace("\\\n", " ").splitlines():
        if line.startswith("```"):
            fence = line[3:].strip() if fence is None else None
        elif fence == "":
            command = line.split(" #", 1)[0].strip()
            if command and not command.startswith("#"):
                lines.append(re.sub(r"\s+", " ", command))
    return lines


def _sessions() -> set[str]:
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    return {
        f.name
        for f in tree.body
        if isinstance(f, ast.FunctionDef) and any("session" in ast.unparse(d) for d in f.decorator_list)
    }


def _run(*args: str) -> subprocess.CompletedProcess:
    bindir = Path(sys.executable).parent
    return subprocess.run(
        [str(bindir / args[0]) if (bindir / args[0]).exists() else args[0], *args[1:]],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def _noxw(words: list[str]) -> None:
    assert words[1] == "-s" and words[2] in _sessions(), f"README runs nox session {words[2]!r}: not in noxfile.py"
    if "--" in words:  # the plan session runs `awex-meta plan` with what follows `--`
        assert words[2] == "plan", words
        out = _run("awex-meta", "plan", *words[words.index("--") + 1 :])
        assert out.returncode == 0, out.stderr[-2000:]
        json.loads(out.stdout.strip().splitlines()[-1])  # --json: the last line is one JSON object


def _pip(words: list[str]) -> None:
    assert words[1] == "install", words
    for target in words[2:]:
        path, _, extras = target.partition("[")
        pyproject = ROOT / path / "pyproject.toml"
        assert pyproject.is_file(), f"README installs {path}: not a package of this repository"
        declared = tomllib.loads(pyproject.read_text())["project"].get("optional-dependencies", {})
        for extra in filter(None, extras.rstrip("]").split(",")):
            assert extra in declared, f"README installs {path}[{extra}]: no such extra ({sorted(declared)})"


def _server(words: list[str]) -> None:
    env, rest = words[0], words[1:]
    assert env == "VLLM_SERVER_DEV_MODE=1", words  # vLLM's weight-transfer routes are served in dev mode only
    held = (ROOT / "integration" / "awex_integration" / "engines" / "vllm_http.py").read_text()
    assert rest[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"], rest
    assert f'"-m", "{rest[2]}"' in held, "the server the tests start is not the one README gives"
    flags = dict(zip(rest[3::2], rest[4::2]))
    assert set(flags) == {"--model", "--weight-transfer-config"}, flags
    assert json.loads(flags["--weight-transfer-config"]) == {"backend": "awex"}
    assert f"\"--weight-transfer-config\", '{flags['--weight-transfer-config']}'" in held


def test_every_readme_shell_command_is_checked():
    lines = _shell_lines()
    assert len(lines) >= 6, lines  # the README's blocks were found
    for line in lines:
        words = shlex.split(line)
        if words[0] == "./noxw":
            _noxw(words)
        elif words[0] == "pip":
            _pip(words)
        elif words[:2] == ["awex-meta", "--version"]:
            out = _run("awex-meta", "--version")
            assert out.returncode == 0 and out.stdout.startswith("awex-meta 0."), out.stdout + out.stderr
        elif words == ["python", "-m", "awex_doctor"]:
            out = _run(sys.executable, "-m", "awex_doctor")
            assert out.returncode == 0, out.stdout + out.stderr
        elif words[0].startswith("VLLM_SERVER_DEV_MODE="):
            _server(words)
        else:
            raise AssertionError(f"README.md gives `{line}`: no rule here checks it (add one)")
