"""What a trainer whose memory moves costs per version: a Qwen3-8B-shaped model (Megatron layout, bf16) colocated with
one engine on one GPU over CUDA IPC, four versions (`--versions`), once with the trainer's memory staying put and
once offloaded to the host and loaded back before every version after the first (the writer re-binds: new views, a
new export; the engine opens it and re-points its copies at it, or rebuilds its copy plan). Every received tensor is
checked each version. Prints and writes one JSON object: per version the writer's time and phases, the engine's
phases; the ratio of a moved version's write to a steady one's; the medians of the moved versions' phases. With
``--let-go`` a third run offloads the same way with ``hold_trainer_memory=False``: the device memory each offload gave
back, and what a version costs when the writer and the engine take the trainer's memory anew every time.

    python -m awex_integration.benchmarks.rebind_cost --out integration/results/rebind-results-1xh100.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics

from awex_integration.benchmarks.gpu_sync_workers import run_sync_case


def measure(layers: int, move: bool, versions: int = 4, let_go: bool = False) -> dict:
    moving = "trainer" if move else False  # the trainer alone: both sides at once hold 4 copies at the peak
    case = ("ipc", 1, [0], [(1, [0])], False, "qwen3-8b", False, False, moving, layers, versions, let_go)
    out = run_sync_case(case, timeout=900)
    failures = {str(k): v for k, (s, v) in out.items() if s != "ok" or (k[0] != "trainer" and v["bad"])}
    if failures:
        raise RuntimeError(f"a rank failed or received wrong bytes: {failures}")
    trainer, engine = out[("trainer", 0)][1], out[("vllm-0", 0)][1]
    return {
        "checked_tensors": engine["checked"],
        "freed_bytes_by_offload": trainer.get("freed", []),
        "model_bytes": trainer["model_bytes"],
        "versions": [
            {"writer_seconds": round(w["seconds"], 4), "writer_phases": w["phases"], "engine_phases": r["phases"]}
            for w, r in zip(trainer["stats"], engine["stats"])
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=36, help="Qwen3-8B has 36")
    parser.add_argument("--versions", type=int, default=4, help="versions a run (the first plans)")
    parser.add_argument(
        "--let-go", action="store_true", help="also the moved run with hold_trainer_memory=False (offload frees)"
    )
    parser.add_argument("--out")
    args = parser.parse_args()
    import torch

    steady, moved = measure(args.layers, False, args.versions), measure(args.layers, True, args.versions)
    steady_write = statistics.median(v["writer_seconds"] for v in steady["versions"][1:])
    moved_write = statistics.median(v["writer_seconds"] for v in moved["versions"][1:])
    later = moved["versions"][1:]
    result = {
        "device": torch.cuda.get_device_name(0),
        "date": datetime.date.today().isoformat(),
        "model": f"qwen3-8b, {args.layers} layers, bf16",
        "steady": steady,
        "moved": moved,
        "steady_write_seconds": steady_write,
        "moved_write_seconds": moved_write,
        "moved_over_steady": round(moved_write / steady_write, 2),
        # medians over the moved versions (seconds; an engine phase a version did not have counts as 0)
        "moved_engine_phases": _medians([v["engine_phases"] for v in later], ("open", "executor", "rebase", "capture")),
        "moved_writer_phases": _medians([v["writer_phases"] for v in later], ("fingerprint", "export")),
    }
    if args.let_go:  # the writer and engine let go of the trainer's memory after each version
        let_go = measure(args.layers, True, args.versions, let_go=True)
        result["let_go"] = let_go
        result["let_go_write_seconds"] = statistics.median(v["writer_seconds"] for v in let_go["versions"][1:])
        result["let_go_engine_phases"] = _medians(
            [v["engine_phases"] for v in let_go["versions"][1:]], ("open", "executor", "rebase", "capture", "transfer")
        )
        result["let_go_writer_phases"] = _medians(
            [v["writer_phases"] for v in let_go["versions"][1:]], ("fingerprint", "export", "total")
        )
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


def _medians(phases: list[dict], names: tuple[str, ...]) -> dict[str, float]:
    return {n: round(statistics.median(p.get(n, 0.0) for p in phases), 5) for n in names}


if __name__ == "__main__":
    main()
