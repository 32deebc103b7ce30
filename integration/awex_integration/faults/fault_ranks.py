"""Ranks of the fault suite (each runs in its own spawned process): a Megatron-layout trainer and a vLLM-layout
engine of plain CPU tensors, syncing over gloo through ``WeightsWriter`` / ``WeightsReader`` and a MetaServer,
with faults injected by the harness (never by the library): a rank that dies, raises, or is interrupted at a
chosen point of a chosen version.

Each rank follows a script: a list of steps ``{"version": ..., "fault": ...}``; it records per step whether the
library said the step succeeded, and (receivers) whether the bytes it holds are that version's, so the suite can
count false successes: a party that said a version was applied where it was not.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from awex_integration.faults.injected import (
    EXIT_CODE,
    MODEL,
    _alter_segment_once,
    _corrupt_after,
    _die_after_prepare,
    _die_relaying,
    _lose_reports,
    _raise,
    _wrong_checkpoint,
)

WAIT_TOO_SHORT = 1.0  # seconds an engine rank with fault "time_out_waiting" waits for a version


def _tensors():
    from awex.meta import canonical_tensors

    return canonical_tensors(json.loads(MODEL.read_text()), dtype="float32")


def layouts(train_tp: int, infer_tp: int, instance: str = "eng", trainer: str = "trainer"):
    from awex.meta.layouts import MegatronParallel, VllmParallel, megatron_layout, vllm_layout

    tensors = _tensors()
    return (
        megatron_layout(tensors, MegatronParallel(tp=train_tp), instance=trainer),
        vllm_layout(tensors, VllmParallel(tp=infer_tp), instance=instance),
    )


def value(name: str, step: int) -> float:
    """What every element of canonical tensor ``name`` holds in weight version number ``step``."""
    return step + (zlib.crc32(name.encode()) % 1000) / 1000.0


def rank_device(device: str, role: str, rank: int, train_tp: int) -> str:
    """Where a rank's tensors live: ``"cpu"``; ``"cuda"``: GPU 0 for every rank (colocated: CUDA IPC);
    ``"cuda-per-rank"``: a GPU of its own (trainer rank r on GPU r, engine rank r on GPU ``train_tp + r``; NCCL)."""
    if device != "cuda-per-rank":
        return device
    import torch

    index = rank if role == "trainer" else train_tp + rank
    torch.cuda.set_device(index)
    return f"cuda:{index}"


def plain_views(layout, local_rank: int, device: str = "cpu"):
    """Plain tensors standing in for the engine's parameters, one per box of this rank; and a view_of over them
    (on ``device``, see :func:`rank_device`)."""
    import torch

    held: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def view_of(name, box):
        t = held.setdefault((name, box.offsets), torch.full(box.sizes, -1.0, device=device))
        return t

    from awex.transport import LocalShards

    LocalShards.from_layout(layout, local_rank, view_of)  # creates every box's tensor
    return held, view_of


def holds(held, step: int) -> bool:
    return all(bool((t == value(name, step)).all()) for (name, _), t in held.items())


def step_number(version: str) -> int:
    return int(version.rsplit("-", 1)[1])


@dataclass(frozen=True)
class RankJob:
    """What one rank of a fault case runs (a trainer rank: :func:`trainer_rank`; an engine rank:
    :func:`receiver_rank`); picklable, spawned processes take it as it is."""

    address: str  # the MetaServer
    job: str
    rank: int
    train_tp: int
    infer_tp: int
    script: list[dict]  # per version: its name and the fault to play, if any
    timeout: float
    workdir: str  # where the ranks leave records and meet ("at-..." and "go" files)
    device: str = "cpu"  # "cpu", "cuda" (every rank on GPU 0) or "cuda-per-rank"
    transport: str = "auto"  # a trainer's writer's
    instance: str = "eng"  # the engine's Awex instance (a trainer's one destination)
    verify: bool = False  # a trainer's writer's verify mode
    trainer_instance: str = "trainer"  # a trainer's Awex instance


def trainer_rank(job: RankJob) -> list[dict]:
    address, rank, tp, infer_tp, script, timeout = (
        job.address,
        job.rank,
        job.train_tp,
        job.infer_tp,
        job.script,
        job.timeout,
    )
    workdir, device, transport, destinations = job.workdir, job.device, job.transport, [job.instance]
    import torch

    from awex.engines.writer import WeightsWriter
    from awex.meta.client import MetaClient

    layout, _ = layouts(tp, infer_tp, trainer=job.trainer_instance)
    held, view_of = plain_views(layout, rank, rank_device(device, "trainer", rank, tp))
    if script and script[0].get("fault") == "wrong_address":  # nothing listens there: said within seconds, then gone
        _wrong_address(
            workdir, script[0]["version"], lambda a: WeightsWriter(MetaClient(a, job=job.job), layout, rank, view_of)
        )
    writer = WeightsWriter(
        MetaClient(address, job=job.job, timeout=timeout),
        layout,
        rank,
        view_of,
        timeout=timeout,
        wave_bytes=64 << 10,
        transport=transport,
        verify=job.verify,
    )
    Path(workdir, f"writer-{os.getpid()}").touch()  # this writer took its epoch (a step may wait for a newer one)
    out = Records(workdir)
    for step in script:
        version, fault = step["version"], step.get("fault")
        writer.timeout = step.get("timeout", timeout)
        if step.get("pause"):
            pause(workdir, "trainer", rank)
        if step.get("until_writers"):  # until that many writers of this rank were made (a replacement took over)
            _until(lambda: len(list(Path(workdir).glob("writer-*"))) >= step["until_writers"], 120.0)
        if step.get("delay"):  # a long training step: the engines ask for the version before it is written
            time.sleep(step["delay"])
        with torch.no_grad():
            for (name, _), t in held.items():
                t.fill_(value(name, step_number(version)))
        if fault == "die_before":
            os._exit(EXIT_CODE)
        if fault == "die_during":  # dies once its first wave is on the way
            writer.refresh = lambda: _exit_soon(0.05)
        if fault == "die_after_agreement":  # every rank agreed on the plan and joined the group; no byte sent
            writer.refresh = lambda: os._exit(EXIT_CODE)
        if fault == "raise_before_ready":  # its refresh raises once the version is announced (the process runs on)

            def refresh_fails():
                writer.refresh = None  # once: the retry goes through
                raise RuntimeError("injected: the trainer's refresh failed after the announcement")

            writer.refresh = refresh_fails
        if fault == "die_before_ready":  # its weights are out (an IPC export); not yet signalled
            from awex.engines.sync.peer_link import SyncPeerLink

            SyncPeerLink.ready = lambda *args: os._exit(EXIT_CODE)
        if fault == "die_while_filling":  # shm: said ready, its segment part-filled (the receivers copy what is there)
            from awex.transport.pull import shm

            def fill_half(sender, count=1, deadline=None, version=""):
                sender.segment.set_version(count, version)
                sender.segment.set_progress(count, sender.segment.nbytes // 2)  # (the bytes are not written)
                time.sleep(0.2)  # the receivers copy the first half
                os._exit(EXIT_CODE)

            shm.ShmSender.fill = fill_half
        if fault == "lose_report":  # the version's report (served versions, the claim applied) never arrives
            _lose_reports()
        if fault == "alter_segment":  # shm: one byte of the filled segment altered before the receivers copy it
            _alter_segment_once(writer)
        freed = None
        if fault == "free_param":  # offloaded (the usual resize_(0)) and not loaded back before the write
            freed = next(iter(held.values()))
            nbytes = freed.untyped_storage().nbytes()
            freed.untyped_storage().resize_(0)
        started = time.monotonic()
        try:
            writer.write(version, destinations)
            out.append(
                {
                    "version": version,
                    "ok": True,
                    "seconds": time.monotonic() - started,
                    "deadline": writer.timeout,
                    "transport": writer.transport_in_use,
                    **({"resources": resources()} if step.get("measure") else {}),
                }
            )
        except Exception as e:
            out.append(
                {
                    "version": version,
                    "ok": False,
                    "error": f"{type(e).__name__}: {e}"[:1500],
                    "seconds": time.monotonic() - started,
                    "deadline": writer.timeout,
                }
            )
        writer.refresh = None
        if freed is not None:  # loaded back (new memory) before the next step fills it
            freed.untyped_storage().resize_(nbytes)
    writer.flush()
    return list(out)


class Records(list):
    """A rank's step records, each also appended to ``records-<pid>.jsonl`` in the case's folder as it is made:
    the harness reads the steps a rank finished before it died (:func:`died_records`)."""

    def __init__(self, workdir: str):
        super().__init__()
        self.path = Path(workdir, f"records-{os.getpid()}.jsonl")

    def append(self, record: dict) -> None:
        super().append(record)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def died_records(workdir: str, pid: int) -> list[dict]:
    path = Path(workdir, f"records-{pid}.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def pause(workdir: str, role: str, rank: int, timeout: float = 120.0) -> None:
    """Say this rank reached a pause, and wait for the harness's "go" (it restarts or freezes things meanwhile)."""
    Path(workdir, f"at-{role}-{rank}").write_text("")
    _until(Path(workdir, "go").exists, timeout, "the harness never said go")


def _until(done, timeout: float, what: str = "the harness's condition did not hold") -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout:g} s")
        time.sleep(0.05)


def resources() -> dict:
    """This process's resident memory, threads and open file descriptors."""
    import gc

    gc.collect()
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    out = {
        "rss_bytes": rss_pages * os.sysconf("SC_PAGE_SIZE"),
        "threads": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
    }
    import torch

    if torch.cuda.is_initialized():
        out["cuda_bytes"] = torch.cuda.memory_allocated()
    return out


def _exit_soon(delay: float) -> None:
    import threading

    threading.Timer(delay, lambda: os._exit(EXIT_CODE)).start()


def receiver_rank(job: RankJob) -> list[dict]:
    address, instance, rank, train_tp, tp, script = (
        job.address,
        job.instance,
        job.rank,
        job.train_tp,
        job.infer_tp,
        job.script,
    )
    timeout, workdir, device = job.timeout, job.workdir, job.device
    from awex.engines.reader import WeightsReader
    from awex.meta.client import MetaClient

    _, layout = layouts(train_tp, tp, instance)
    held, view_of = plain_views(layout, rank, rank_device(device, "engine", rank, train_tp))
    reader = WeightsReader(MetaClient(address, job=job.job, timeout=timeout), layout, rank, view_of, timeout=timeout)
    out = Records(workdir)
    for step in script:
        version, fault = step["version"], step.get("fault")
        if step.get("pause"):
            pause(workdir, "engine", rank)
        apply = validate = None
        strict = False
        if fault == "die_after_transfer":
            apply = lambda shards: os._exit(EXIT_CODE)  # noqa: E731
        elif fault == "raise_in_apply":
            apply = _raise(RuntimeError("the engine's load step failed"))
        elif fault == "interrupt_in_apply":
            apply = _raise(KeyboardInterrupt())
        elif fault == "strict_mismatch":
            validate, strict = _wrong_checkpoint(held, workdir, f"{instance}-{rank}-{version}"), True
        elif fault == "fail_before_transfer":
            reader._session.transfer = _raise(RuntimeError("engine refused to start receiving"))
        elif fault == "die_after_agreement":  # agreed on the plan and joined the group, then gone
            reader._session.transfer = _die_after_prepare(reader._session)
        elif fault == "corrupt_after_transfer":  # one bit of what arrived flipped (a transport or memory fault)
            reader._session.transfer = _corrupt_after(reader)
        elif fault == "die_relaying":  # gloo: dies as it starts forwarding to another engine rank (a relay)
            _die_relaying()
        reader.timeout = WAIT_TOO_SHORT if fault == "time_out_waiting" else timeout  # gives up before it is written
        if step.get("delay"):  # a slow engine: reaches its update call late
            time.sleep(step["delay"])
        started = time.monotonic()
        try:
            reader.receive(version, apply=apply, validate=validate, strict=strict, in_place=True)
            out.append(
                {
                    "version": version,
                    "ok": True,
                    "holds": holds(held, step_number(version)),
                    "seconds": time.monotonic() - started,
                    **({"resources": resources()} if step.get("measure") else {}),
                }
            )
        except BaseException as e:  # KeyboardInterrupt included: the library must report it as a failure too
            out.append(
                {
                    "version": version,
                    "ok": False,
                    "error": f"{type(e).__name__}: {e}"[:1500],
                    "seconds": time.monotonic() - started,
                }
            )
        finally:
            reader._session.__dict__.pop("transfer", None)
    reader.flush()
    reader.close()
    return list(out)


def _wrong_address(workdir: str, version: str, make_writer) -> None:
    """``make_writer(address)`` with an address where nothing listens: record how it failed as the attempt at
    ``version``, and exit as a killed rank would (the harness restarts it)."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        wrong = f"http://127.0.0.1:{s.getsockname()[1]}"
    started = time.monotonic()
    try:
        make_writer(wrong)
        record = {"version": version, "ok": True, "error": f"a writer was made against {wrong}"}
    except Exception as e:
        record = {"version": version, "ok": False, "error": f"{type(e).__name__}: {e}"[:1500]}
    Records(workdir).append(dict(record, seconds=time.monotonic() - started))
    os._exit(EXIT_CODE)
