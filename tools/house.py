"""Checks that keep the house in order, run by ``./noxw -s house`` (and so by CI):

- ``sizes``: no module over 450 lines under ``packages/*/src``, ``integration/`` (tests excepted), ``examples/``
  and ``tools/``; README.md under 15,000 characters.
- ``docs``: every file path, ``awex.*`` name, nox session, ``python -m`` module and command-line flag that README.md,
  ``docs/`` and the package and example READMEs mention in backticks exists in the code.
- ``defaults``: every default or constant the docs state in a row of ``tools/house_defaults.py`` is the code's.
- ``imports``: each package declares exactly what it imports (``tools/house_imports.py``).

Import circles and layers are import-linter's (``.importlinter``), run beside this by the same nox session.

    python tools/house.py            # both checks; exit status 1 and one line per finding if any fails
    python tools/house.py docs       # one of them
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from house_defaults import PACKAGE_OF, check_defaults  # tools/ is this script's folder
from house_errors import check_errors
from house_imports import check_imports

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 450
MAX_README = 15_000
CODE_DIRS = ["packages/awex-meta/src", "packages/awex-convert/src", "packages/awex-transport/src"]
CODE_DIRS += ["packages/awex-engines/src", "integration", "examples", "tools"]
DOCS = ["README.md", "CONTRIBUTING.md", "docs/*.md", "packages/*/README.md", "integration/*.md", "examples/*.md"]
SKIP_PARTS = {".nox", ".tox", "__pycache__", "build", ".venv-nox"}
PATH_ROOTS = ("packages/", "integration/", "docs/", "examples/", "tools/", ".ci/", "noxfile.py", "noxw")
OTHERS_FLAGS = {"--transformer-impl", "--moe-tp-extend-ep"}  # Megatron-LM's and MindSpeed's, named in docs/usage.md
OTHERS_NAMES = {"general_plugins", "GateLinear", "cuMemcpy2DAsync", "_extra_state"}  # vLLM's, CUDA's, Megatron's
OTHERS_FILES = {"awex/__init__.py", "config.json"}  # upstream Awex's package file (README); an HF model's config


def _python_files(*dirs: str) -> list[Path]:
    out = []
    for d in dirs:
        for p in sorted((ROOT / d).rglob("*.py")):
            if not SKIP_PARTS & set(p.relative_to(ROOT).parts):
                out.append(p)
    return out


def check_sizes() -> list[str]:
    found = []
    for path in _python_files(*CODE_DIRS):
        rel = path.relative_to(ROOT)
        if "tests" in rel.parts:
            continue
        lines = path.read_text().count("\n")
        if lines > MAX_LINES:
            found.append(f"{rel}: {lines} lines (at most {MAX_LINES}: split it by idea)")
    readme = len((ROOT / "README.md").read_text())
    if readme > MAX_README:
        found.append(f"README.md: {readme:,} characters (at most {MAX_README:,}: the user's page; details go to docs/)")
    return found


class _Code:
    """What the code defines: every identifier it binds or names, flags it declares, nox sessions."""

    def __init__(self) -> None:
        self.words: set[str] = set()
        self.strings: set[str] = set()
        for path in [*_python_files(*CODE_DIRS, "packages"), ROOT / "noxfile.py"]:
            try:
                tree = ast.parse(path.read_text())
            except SyntaxError:
                continue
            self.words.add(path.stem)
            docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Name):
                    self.words.add(node.id)
                elif isinstance(node, ast.Attribute):
                    self.words.add(node.attr)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    self.words.add(node.name)
                elif isinstance(node, ast.arg):
                    self.words.add(node.arg)
                elif isinstance(node, ast.keyword) and node.arg:
                    self.words.add(node.arg)
                elif isinstance(node, ast.alias):
                    self.words.update((node.asname or node.name).split("."))
                    self.words.update(node.name.split("."))
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                    self.strings.update(re.findall(r"\w+", node.value))  # tensor names, routes, vLLM's names
        self.sessions = set(re.findall(r"^def (\w+)\(session", (ROOT / "noxfile.py").read_text(), re.M))
        text = "\n".join(p.read_text() for p in _python_files(*CODE_DIRS, "packages"))
        self.flags = set(re.findall(r"--[a-z][a-z0-9-]+", text + (ROOT / "noxfile.py").read_text()))


def _module_file(dotted: str) -> Path | None:
    """The file or package folder of ``awex.<pkg>...`` / ``awex_integration...`` / ``awex_doctor``, or None."""
    parts = dotted.split(".")
    if parts[0] == "awex" and len(parts) > 1 and parts[1] in PACKAGE_OF:
        base = ROOT / "packages" / PACKAGE_OF[parts[1]] / "src"
    elif parts[0] == "awex_integration":
        base = ROOT / "integration"
    elif parts[0] == "awex_doctor":
        base = ROOT / "packages/awex-meta/src"
    else:
        return None
    path = base.joinpath(*parts)
    if path.with_suffix(".py").exists():
        return path.with_suffix(".py")
    if (path / "__init__.py").exists():
        return path
    return None


def _dotted_ok(dotted: str, code: _Code) -> bool:
    """``awex.pkg.module`` exists, or ``awex.pkg.module.Name[.attr]``: the module exists and the code names ``Name``."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        if _module_file(".".join(parts[:cut])) is not None:
            return all(p in code.words for p in parts[cut:])
    return False


def _doc_files() -> list[Path]:
    out = []
    for pattern in DOCS:
        out += sorted(ROOT.glob(pattern))
    return out


def _path_exists(token: str, doc: Path, names: set[str]) -> bool:
    token = token.split("::")[0]
    if any(c in token for c in "<*|{") or "..." in token or token in OTHERS_FILES:
        return True  # a pattern, not a path; or another project's file
    if "/" not in token:  # a file named by itself (`rlhf.py`, `usage.md`): one of the project's files has that name
        return token in names
    bases = (
        ROOT,
        doc.parent,
        *ROOT.glob("packages/*"),
        *ROOT.glob("packages/*/src"),
        *ROOT.glob("packages/*/src/awex"),
    )
    return any((base / token).exists() for base in bases)


def _file_names() -> set[str]:
    return {p.name for p in ROOT.rglob("*") if p.is_file() and not SKIP_PARTS & set(p.relative_to(ROOT).parts)}


def check_docs() -> list[str]:
    code, names, found = _Code(), _file_names(), []
    for doc in _doc_files():
        rel = doc.relative_to(ROOT)
        text = re.sub(r"```.*?```", lambda m: m.group(0).replace("`", ""), doc.read_text(), flags=re.S)
        for lineno, line in enumerate(text.splitlines(), 1):
            for token in re.findall(r"`([^`\n]+)`", line):
                problem = _check_token(token.strip(), doc, code, names)
                if problem:
                    found.append(f"{rel}:{lineno}: `{token}`: {problem}")
    return found


def _check_token(token: str, doc: Path, code: _Code, names: set[str]) -> str | None:
    for m in re.finditer(r"(?:nox|noxw)\s+-s\s+([\w-]+)", token):
        if m.group(1) not in code.sessions:
            return f"no nox session {m.group(1)!r} in noxfile.py"
    for m in re.finditer(r"python -m ([\w.]+)", token):
        if _module_file(m.group(1)) is None and not m.group(1).startswith(("pytest", "pip", "nox", "vllm")):
            return f"no module {m.group(1)}"
    if token.startswith("-") or " " in token:
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]+", token):
            if flag not in code.flags and flag not in OTHERS_FLAGS:
                return f"no command-line flag {flag} in the code"
    if " " in token or "(" in token or "=" in token:
        return None  # a call or a command line: its flags and sessions were checked above
    if re.fullmatch(r"(awex|awex_integration|awex_doctor)(\.\w+)+", token):
        return None if _dotted_ok(token, code) else "no such module or name in the code"
    if token.startswith(PATH_ROOTS) or re.fullmatch(r"[\w./-]+\.(py|md|json|toml|ini|txt)", token):
        return None if _path_exists(token, doc, names) else "no such file"
    looks_like_code = "_" in token or "." in token or token[1:] != token[1:].lower()  # snake_case, dotted, CamelCase
    if looks_like_code and re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", token):
        missing = [p for p in token.split(".") if not {p} & (code.words | code.strings | OTHERS_NAMES)]
        return f"the code names no {missing[0]!r}" if missing else None
    return None


CHECKS = {
    "sizes": check_sizes,
    "docs": check_docs,
    "defaults": check_defaults,
    "imports": check_imports,
    "errors": check_errors,
}


def main(argv: list[str]) -> int:
    names = argv or list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        print(f"unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    failed = 0
    for name in names:
        found = CHECKS[name]()
        for line in found:
            print(f"{name}: {line}")
        print(f"house {name}: {'ok' if not found else f'{len(found)} finding(s)'}")
        failed += bool(found)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
