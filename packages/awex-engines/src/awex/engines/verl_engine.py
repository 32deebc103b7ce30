"""verl's checkpoint-engine slot: a checkpoint engine registered as ``awex`` in verl's ``CheckpointEngineRegistry``.
verl picks it from its configuration alone::

    actor_rollout_ref.rollout.checkpoint_engine.backend=awex
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=awex.engines.verl_engine
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.awex.meta_address=http://HOST:PORT

(``engine_kwargs.awex`` also takes ``job``, ``token``, ``timeout`` and ``transport``; start ``awex-meta serve`` where
every worker reaches it.) verl's interface streams whole named tensors: every actor rank yields the full tensors
(gathered), every rollout worker takes full tensors and loads them through its engine's loader. So here the first
actor rank copies what it is given into one buffer per tensor (kept between steps) and writes them as one Awex
version to every rollout worker, each receiving the whole model into buffers of its own (kept too) and yielding
them; the planner lets rollout workers forward what others need (a tree, not one sender's link times N). What
this interface cannot express, and Awex does outside it: receiving into the engine's live weights in place (here
every worker holds a second copy and its loader copies again), and resharding without a gather (each actor rank
sending only the shards it holds, each engine rank receiving only its own). verl users who run vLLM get both with
vLLM's own weight-transfer API and backend ``awex`` (``awex.engines.vllm_trainer``) instead of this slot.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Generator
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from awex.engines.reader import WeightsReader
from awex.engines.writer import WeightsWriter
from awex.meta import CanonicalTensor, TensorSpec
from awex.meta.client import MetaClient
from awex.meta.errors import AwexValueError
from awex.meta.layouts import hf_layout
from awex.transport.shards import torch_dtype

log = logging.getLogger("awex.engines.verl")

TRAINER = "verl-actor"  # the Awex instance of the first actor rank


def rollout_instance(rank: int) -> str:
    return f"verl-rollout-{rank}"


@CheckpointEngineRegistry.register("awex")
class AwexCheckpointEngine(CheckpointEngine):
    """One worker's side (an actor rank or a rollout worker, told by :meth:`init_process_group`); see the module."""

    def __init__(
        self,
        bucket_size: int = 0,
        meta_address: str | None = None,
        job: str = "verl",
        token: str | None = None,
        timeout: float = 300.0,
        transport: str = "auto",
    ) -> None:
        if not meta_address:
            raise AwexValueError(
                "awex checkpoint engine: give the MetaServer's address (checkpoint_engine.engine_kwargs.awex."
                "meta_address=http://HOST:PORT, where `awex-meta serve` runs)"
            )
        self.client = MetaClient(meta_address, job=job, token=token, timeout=timeout)
        self.timeout, self.transport = timeout, transport
        self.role: str | None = None
        self.rank = 0
        self.rollouts = 0
        self.updates = 0  # versions sent or received (their names where verl gives no step)
        self._held: dict[str, torch.Tensor] = {}  # one buffer per tensor, kept between steps
        self._writer: WeightsWriter | None = None
        self._reader: WeightsReader | None = None

    def prepare(self) -> dict[str, Any]:
        """Nothing to allocate or announce: the ranks meet at the MetaServer."""
        return {}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Each worker's role and rank; the actor ranks learn how many rollout workers receive."""
        actor = {
            "role": ["actor"] * actor_wg_world_size,
            "rank": list(range(actor_wg_world_size)),
            "rollouts": [rollout_world_size] * actor_wg_world_size,
        }
        rollout = {"role": ["rollout"] * rollout_world_size, "rank": list(range(rollout_world_size))}
        return actor, rollout

    def init_process_group(self, role: str, rank: int, rollouts: int = 0) -> None:
        if role not in ("actor", "rollout") or (role == "actor" and rollouts < 1):
            raise AwexValueError(f"awex checkpoint engine: role {role!r} with {rollouts} rollout worker(s)")
        self.role, self.rank, self.rollouts = role, rank, rollouts

    def finalize(self) -> None:
        """Nothing to free: the buffers, the writer and the reader are kept for the next step."""

    def _version(self, global_steps: int | None) -> str:
        self.updates += 1
        return f"step-{global_steps}" if global_steps is not None else f"update-{self.updates}"

    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None], global_steps=None):
        """An actor rank: the first copies the tensors into its buffers and writes them to every rollout worker;
        the others only drain ``weights`` (their gathers are collective with the first rank's)."""
        if self.role != "actor":
            raise AwexValueError("awex checkpoint engine: send_weights on a worker that is not an actor rank")
        version = self._version(global_steps)
        pairs = weights if hasattr(weights, "__aiter__") else _aiter(weights)  # verl's actors yield either way
        if self.rank != 0:
            async for _ in pairs:
                pass
            return {}
        seen = []
        async for name, tensor in pairs:
            held = self._held.get(name)
            if held is None and self._writer is not None:
                raise AwexValueError(
                    f"awex checkpoint engine: {name} is new since the first step (a model's tensors are fixed)"
                )
            if held is None:
                held = self._held[name] = torch.empty_like(tensor, memory_format=torch.contiguous_format)
            elif held.shape != tensor.shape or held.dtype != tensor.dtype:
                raise AwexValueError(
                    f"awex checkpoint engine: {name} is {tuple(tensor.shape)} {tensor.dtype}, it was "
                    f"{tuple(held.shape)} {held.dtype}"
                )
            held.copy_(tensor)
            seen.append(name)
        if self._writer is not None and set(seen) != set(self._held):
            raise AwexValueError(f"awex checkpoint engine: {sorted(set(self._held) - set(seen))[:5]} were not sent")
        if self._writer is None:
            layout = hf_layout(_tensors(self._held), "trainer", TRAINER)
            self._writer = WeightsWriter(
                self.client, layout, 0, _views(self._held), timeout=self.timeout, transport=self.transport
            )
        destinations = [rollout_instance(r) for r in range(self.rollouts)]
        stats = await asyncio.to_thread(self._writer.write, version, destinations)
        log.info("awex checkpoint engine: %s to %d rollout worker(s)", version, self.rollouts)
        return {"awex/bytes_sent": stats.bytes_sent, "awex/seconds": stats.seconds}

    async def receive_weights(self, global_steps=None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """A rollout worker: receive the version whole into its buffers, then yield them by name."""
        if self.role != "rollout":
            raise AwexValueError("awex checkpoint engine: receive_weights on a worker that is not a rollout worker")
        version = self._version(global_steps)
        if self._reader is None:
            source = await asyncio.to_thread(self.client.fetch_layout, TRAINER, "current", self.timeout)
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
            for t in source.tensors:
                self._held[t.spec.name] = torch.empty(t.spec.shape, dtype=torch_dtype(t.spec.dtype), device=device)
            layout = hf_layout(_tensors(self._held), "inference", rollout_instance(self.rank))
            self._reader = WeightsReader(self.client, layout, 0, _views(self._held), timeout=self.timeout)
        await asyncio.to_thread(self._reader.receive, version)
        for name, held in self._held.items():
            yield name, held

    def close(self) -> None:
        for side in (self._writer, self._reader):
            if side is not None:
                side.close()


async def _aiter(pairs):
    for pair in pairs:
        yield pair


def _tensors(held: dict[str, torch.Tensor]) -> list[CanonicalTensor]:
    """Whole tensors as verl streams them (each held whole by one rank: how a tensor could split does not matter)."""
    return [
        CanonicalTensor(TensorSpec(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")), "replicated")
        for name, t in held.items()
    ]


def _views(held: dict[str, torch.Tensor]):
    """Views of the engine's own buffers, with their fingerprint: they never move, so a steady version checks their
    addresses and derives no view again (``awex.convert.live.fingerprinted``)."""
    from awex.convert.live import fingerprinted

    return fingerprinted(lambda name, box: held[name][box.slices()], held)
