"""The harness's vLLM worker extension: probes that show, from inside each worker, which path a sync took.

    LLM(..., worker_extension_cls=WORKER_EXTENSION)
    llm.collective_rpc("awex_probe_start")      # before the syncs
    llm.collective_rpc("awex_probe_report")     # after: one dict per worker

``awex_probe_start`` records every live parameter's storage pointer and counts the tensors the worker hands to
``model.load_weights`` from then on (an instance attribute wrapping the model's own method: harness only).
``awex_probe_report`` says which parameters moved to other storage, which tensors went through
``load_weights``, and how the awex backend routed them. ``awex_probe_state`` digests every tensor the model holds
(parameters, buffers, and tensors a layer derived and keeps as a plain attribute, such as latent attention's decode
matrices): a synced engine's and a fresh engine's must be equal. Importing this module in a worker also applies the
harness patch ``awex_integration.engines.vllm_cpu_plain_weights`` when its environment variable is set.
"""

from __future__ import annotations

import hashlib
import os

import torch

from awex_integration.engines import vllm_cpu_plain_weights

WORKER_EXTENSION = f"{__name__}.WorkerProbe"

if os.environ.get(vllm_cpu_plain_weights.ENV) == "1":
    vllm_cpu_plain_weights.apply()


class WorkerProbe:
    """Mixed into vLLM's worker class (``self`` is the worker)."""

    def awex_probe_start(self) -> int:
        model = self.model_runner.model
        self._awex_pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
        self._awex_loaded: list[str] = []
        original = model.load_weights

        def counting_load_weights(weights, *args, **kwargs):
            weights = list(weights)
            self._awex_loaded.extend(name for name, _ in weights)
            return original(weights, *args, **kwargs)

        model.load_weights = counting_load_weights
        return len(self._awex_pointers)

    def awex_probe_report(self) -> dict:
        model = self.model_runner.model
        now = {n: p.data_ptr() for n, p in model.named_parameters()}
        engine = self.weight_transfer_engine
        dest = engine.destinations
        return {
            "params": len(now),
            "moved": sorted(n for n, ptr in self._awex_pointers.items() if now.get(n) != ptr),
            "empty": sorted(n for n, p in model.named_parameters() if p.numel() == 0),
            "loaded": sorted(set(self._awex_loaded)),
            "in_place": list(dest.in_place),
            "loader": engine.loaded_through_vllm,  # staged: what its commit cannot copy in place
        }

    def awex_probe_state(self) -> dict[str, str]:
        """A digest of every tensor the model holds, by ``module.attribute`` (a tensor held twice: once)."""
        model = self.model_runner.model
        out: dict[str, str] = {}
        seen: set[tuple[int, int, tuple]] = set()
        for prefix, module in model.named_modules():
            for attr, value in vars(module).items():
                if attr == "kv_cache":  # what the engine computed, not what it loaded
                    continue
                tensors = value.items() if attr in ("_parameters", "_buffers") else [(attr, value)]
                for name, t in tensors:
                    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                        continue
                    key = (t.data_ptr(), t.numel(), tuple(t.shape))
                    if key in seen:
                        continue
                    seen.add(key)
                    out[f"{prefix}.{name}" if prefix else name] = tensor_digest(t)
        return out

    def awex_learned_vs_table(self) -> list[str]:
        """With the awex backend set up on a layout learned from vLLM's loaders: how it differs from Awex's table of
        the architecture (every rank's boxes, each tensor's shape and dtype, and for this rank the memory each box
        lands in: the same storage, offset, shape and strides). Empty: equal."""
        from awex.convert.live import LiveTensors
        from awex.convert.vllm import vllm_views
        from awex.engines.vllm_backend import _vllm_parallel, engine_layout
        from awex.meta.models import model_dims

        engine = self.weight_transfer_engine
        learned = engine.learned.layout
        table = engine_layout(self.vllm_config, learned.instance)
        diffs = []
        if sorted(learned.names) != sorted(table.names):
            diffs.append(
                f"names: only learned {sorted(set(learned.names) - set(table.names))[:5]}, only table "
                f"{sorted(set(table.names) - set(learned.names))[:5]}"
            )
        for name in sorted(set(learned.names) & set(table.names)):
            a, b = learned.tensor(name).spec, table.tensor(name).spec
            if (tuple(a.shape), a.dtype) != (tuple(b.shape), b.dtype):
                diffs.append(f"{name}: learned {a.shape} {a.dtype}, table {b.shape} {b.dtype}")
            elif learned.holdings(name) != table.holdings(name):
                diffs.append(f"{name}: learned holdings {learned.holdings(name)}, table {table.holdings(name)}")
        hf_config = self.model_runner.model_config.hf_config.to_dict()
        dims = model_dims(hf_config, str(self.model_runner.model_config.dtype).removeprefix("torch."))
        pc = self.vllm_config.parallel_config
        parallel = _vllm_parallel(self.vllm_config)
        model = self.model_runner.model
        want = vllm_views(
            LiveTensors(model, buffers=False),
            dims,
            parallel,
            tp_rank=pc.rank % parallel.tp,
            dp_rank=pc.data_parallel_index,
        )
        got = engine.reader.shards
        rank = pc.data_parallel_index * pc.world_size + pc.rank
        for name, boxes in table.rank_boxes(rank).items():
            if name in engine.destinations.loader:
                continue
            for box in boxes:
                t = want(name, box)
                views = [v for b, v in got.pairs(name) if b == box]
                if len(views) != 1:
                    diffs.append(f"{name} {box}: learned holds {[str(b) for b, _ in got.pairs(name)]}")
                    continue
                v = views[0]
                if (v.data_ptr(), tuple(v.shape), _strides(v)) != (t.data_ptr(), tuple(t.shape), _strides(t)):
                    diffs.append(
                        f"{name} {box}: learned lands at {v.data_ptr() - t.data_ptr():+d} {v.stride()}, "
                        f"table at {t.stride()}"
                    )
        return diffs

    def awex_learned_cost(self) -> dict:
        """What learning the layout took on this worker: seconds, and the resident memory it added (bytes)."""
        learned = self.weight_transfer_engine.learned
        return {"seconds": learned.seconds, "tensors": len(learned.landings) + len(learned.loader)}

    def awex_learned_tensors(self) -> int:
        """How many canonical tensors this worker's learned layout holds."""
        return len(self.weight_transfer_engine.learned.layout.names)

    def awex_probe_lora(self, adapters: dict[str, int]) -> dict:
        """A digest of each adapter tensor the engine holds (``awex.engines.vllm_lora``'s names), and which adapter
        id each GPU slot serves (``slots``); what the slots compute is checked by the engine's output."""
        from awex.engines.vllm_lora import AdapterTensors

        manager = self.model_runner.model.lora_manager
        out = {name: tensor_digest(t) for name, t in AdapterTensors(manager, adapters).items()}
        out["slots"] = list(manager.lora_index_to_id)
        return out


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    """Strides that matter (a dim of size 1 is never stepped)."""
    return tuple(s for s, n in zip(t.stride(), t.shape) if n != 1)


def tensor_digest(t: torch.Tensor) -> str:
    """``dtype:shape:digest`` of a tensor's bytes (what the probes compare across processes)."""
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return f"{t.dtype}:{tuple(t.shape)}:{hashlib.sha256(raw.numpy().tobytes()).hexdigest()[:16]}"
