"""Delta syncs on real optimisation steps: an HF decoder trained with Adam on fp32 master weights, its bf16 copy
synced after every step through the public path (``WeightsWriter(delta=True)`` -> ``WeightsReader``, p2p) into an
HF model of the same config; per step, the fraction of bf16 elements that changed (by tensor kind), the bytes that
crossed against a dense sync's, and whether every received tensor equals the trainer's bit for bit.

    python -m awex_integration.benchmarks.delta_steps --model qwen2-tiny --steps 4 --lr 1e-6 [--out FILE]

The batches are generated tokens (an RL step's shape, not its data): what matters here is the size of Adam's
updates against a bf16 unit in the last place, which the learning rate sets.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch

MODELS = Path(__file__).resolve().parents[2] / "models"


def train_and_sync(
    config: dict,
    steps: int,
    lr: float,
    batch: int = 4,
    seq: int = 32,
    seed: int = 0,
    device: str = "cpu",
    sync: bool = True,
) -> dict:
    """Run ``steps`` Adam steps, syncing the bf16 weights after the initial state and after each step.

    ``sync=False`` (one GPU: the p2p transport needs a second one for NCCL): no engine; each step records the
    bytes the delta encoding would take with every tensor as its own bucket (``awex.transport.delta.encoding``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from awex.meta import canonical_tensors
    from awex.meta.server import start_embedded
    from awex.transport.delta import encoding
    from awex_integration.engines.tiny_model import dtype_kwarg

    torch.manual_seed(seed)
    hf_config = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    hf_config.architectures = config.get("architectures")

    master = AutoModelForCausalLM.from_config(hf_config, **dtype_kwarg(torch.float32)).to(device)
    engine = AutoModelForCausalLM.from_config(hf_config, **dtype_kwarg(torch.bfloat16)).to(device) if sync else None
    tensors = canonical_tensors(config, dtype="bfloat16")
    kinds = {t.name: t.kind for t in tensors}
    masters = dict(master.named_parameters())
    trainer = {name: masters[name].detach().to(torch.bfloat16) for name in kinds}  # what the trainer syncs
    received = dict(engine.named_parameters()) if sync else {}
    server = start_embedded() if sync else None
    writer = reader = None
    try:
        if sync:
            writer, reader = _writer_and_reader(server, tensors, trainer, received)
        optimiser = torch.optim.Adam(master.parameters(), lr=lr)
        generator = torch.Generator(device="cpu").manual_seed(seed + 1)
        records = []
        for step in range(steps + 1):
            before = {n: t.clone() for n, t in trainer.items()}
            if step:
                tokens = torch.randint(0, config["vocab_size"], (batch, seq), generator=generator).to(device)
                loss = master(input_ids=tokens, labels=tokens).loss
                optimiser.zero_grad()
                loss.backward()
                optimiser.step()
                with torch.no_grad():
                    for name, t in trainer.items():
                        t.copy_(masters[name])  # round to bf16 in place: the writer's views stay valid
            changed: dict[str, list[int]] = {}
            encoded = 0
            for name, t in trainer.items():
                c = changed.setdefault(kinds[name], [0, 0])
                n = int((t.view(torch.int16) != before[name].view(torch.int16)).sum())
                c[0] += n
                c[1] += t.numel()
                encoded += 48 + encoding(-(-t.numel() // 8) * 8, n)[1]
            record = {
                "step": step,
                "changed_fraction": round(sum(c for c, _ in changed.values()) / sum(n for _, n in changed.values()), 6),
                "changed_fraction_by_kind": {k: round(c / n, 6) for k, (c, n) in sorted(changed.items())},
            }
            if not sync:
                dense = sum(t.numel() * 2 for t in trainer.values())
                records.append(
                    {
                        **record,
                        "encoded_bytes_per_tensor": encoded if step else dense,
                        "dense_bytes": dense,
                        "dense_over_encoded": round(dense / (encoded if step else dense), 2),
                    }
                )
                continue
            out: dict = {}
            t = threading.Thread(target=lambda v=f"step-{step}": out.update(read=reader.receive(v)))
            t.start()
            started = time.perf_counter()
            written = writer.write(f"step-{step}", ["engine"])
            t.join(120)
            seconds = time.perf_counter() - started
            exact = all(torch.equal(trainer[n], received[n].data) for n in trainer)
            records.append(
                {
                    **record,
                    "bytes_sent": written.bytes_sent,
                    "bytes_dense": written.bytes_dense,
                    "dense_over_sent": round(written.bytes_dense / max(1, written.bytes_sent), 2),
                    "buckets_resent": written.buckets_resent,
                    "seconds": round(seconds, 4),
                    "bit_exact": exact,
                    "received": "read" in out,
                }
            )
        greedy_equal = _greedy_equal(engine, trainer, hf_config, device) if sync else None
    finally:
        for end in (writer, reader, server):
            if end is not None:
                (end.stop if end is server else end.close)()
    return {"lr": lr, "steps": records, "greedy_equal_to_reference": greedy_equal}


def _writer_and_reader(server, tensors, trainer: dict, received: dict):
    from awex.engines.reader import WeightsReader
    from awex.engines.writer import WeightsWriter
    from awex.meta.client import MetaClient
    from awex.meta.layouts import hf_layout

    writer = WeightsWriter(
        MetaClient(server.address, job="delta-steps", timeout=120),
        hf_layout(tensors, "trainer", "trainer"),
        0,
        lambda name, box: trainer[name][box.slices()],
        transport="p2p",
        delta=True,
        timeout=120,
    )
    reader = WeightsReader(
        MetaClient(server.address, job="delta-steps", timeout=120),
        hf_layout(tensors, "inference", "engine"),
        0,
        lambda name, box: received[name].data[box.slices()],
    )
    return writer, reader


def _greedy_equal(engine, trainer: dict, hf_config, device: str) -> bool:
    """The synced engine's greedy tokens against a reference model loaded with the trainer's bf16 weights."""
    from transformers import AutoModelForCausalLM

    from awex_integration.engines.tiny_model import dtype_kwarg

    reference = AutoModelForCausalLM.from_config(hf_config, **dtype_kwarg(torch.bfloat16)).to(device)
    reference.load_state_dict(trainer, strict=False)
    prompt = torch.arange(1, 9, device=device).view(1, -1)
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        return torch.equal(engine.generate(prompt, **kwargs), reference.generate(prompt, **kwargs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2-tiny", help="integration/models/NAME.json")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-7, 1e-6, 1e-5])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument(
        "--no-sync",
        action="store_true",
        help="measure change fractions and encoded sizes only (one GPU: NCCL point to point needs two)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    config = json.loads((MODELS / f"{args.model}.json").read_text())
    runs = [
        train_and_sync(config, args.steps, lr, args.batch, args.seq, device=args.device, sync=not args.no_sync)
        for lr in args.lr
    ]
    for run in runs:
        for r in run["steps"]:
            print(json.dumps({"lr": run["lr"], **r}), flush=True)
    if args.out:
        import platform
        from datetime import datetime, timezone

        device = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU ({platform.machine()})"
        doc = {
            "what": __doc__.split("\n\n")[0],
            "device": device,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
            "transport": "none (change fractions only)"
            if args.no_sync
            else "p2p (gloo)"
            if args.device == "cpu"
            else "p2p",
            "model": args.model,
            "command": [
                "python",
                "-m",
                "awex_integration.benchmarks.delta_steps",
                *(argv if argv is not None else sys.argv[1:]),
            ],
            "runs": runs,
        }
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if all(r.get("bit_exact", True) for run in runs for r in run["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
