"""Make a small HF model directory locally (no hub): a byte-level BPE tokenizer trained on a synthetic corpus
and random weights for any supported ``config.json``."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

WORDS = (
    "the quick brown fox jumps over the lazy dog hello world weight sync training inference engine tensor "
    "parallel pipeline model layer attention reinforcement learning policy reward rollout gradient update"
).split()

PROMPTS = ["the quick brown fox", "reinforcement learning policy", "tensor parallel pipeline"]


def dtype_kwarg(dtype: Any) -> dict[str, Any]:
    """``dtype`` under transformers' keyword for it in the installed version (``awex.engines.vllm_learned``'s rule:
    ``dtype`` since 4.56, ``torch_dtype`` before; the ``floors`` session runs 4.51)."""
    import transformers

    from awex.engines.vllm_learned import dtype_keyword

    return {dtype_keyword(transformers.__version__): dtype}


def make_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rnd = random.Random(0)
    corpus = [" ".join(rnd.choice(WORDS) for _ in range(20)) for _ in range(2000)]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    n = tok.get_vocab_size()
    if n < vocab_size:
        tok.add_tokens([f"<|extra_{i}|>" for i in range(vocab_size - n)])
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"vocabulary of {vocab_size} is too small for a byte-level tokenizer")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(out)


def make_tiny_model(out: str | Path, config: dict[str, Any], seed: int = 0, dtype: str = "float32") -> Path:
    """Write ``config`` with random weights (seeded) and a matching tokenizer to ``out``; returns the path."""
    import torch
    from transformers import AutoConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer(out, int(config["vocab_size"]))
    cfg = dict(config)
    cfg.update(torch_dtype=dtype, eos_token_id=0, bos_token_id=0, pad_token_id=0)
    given = cfg.pop("model_type", None)  # the architecture decides where Awex knows it (tests derive configs)
    model_type = {
        "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3",
        "LlamaForCausalLM": "llama",
        "MistralForCausalLM": "mistral",
        "Qwen3MoeForCausalLM": "qwen3_moe",
        "Qwen2MoeForCausalLM": "qwen2_moe",
        "DeepseekV3ForCausalLM": "deepseek_v3",
        "Glm4MoeForCausalLM": "glm4_moe",
    }.get(cfg["architectures"][0], given)
    cfg.pop("architectures", None)
    hf_config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = hf_auto_class(cfg | {"model_type": model_type}).from_config(hf_config, **dtype_kwarg(getattr(torch, dtype)))
    with torch.no_grad():  # HF initialises norms to 1: randomise them too, so a wrong norm shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
        for module in model.modules():  # DeepSeek-V3 / GLM-4.5 checkpoints hold the router's score bias in FP32
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                module.e_score_correction_bias = bias.float()
    model.save_pretrained(out, safe_serialization=True)
    return out


def perturb_(model, step: int, scale: float = 0.02) -> None:
    """An 'RL step': change every weight by seeded noise (so each step's weights differ)."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype))


def hf_greedy(model, tokenizer, prompts=PROMPTS, max_new_tokens: int = 16) -> list[list[int]]:
    import torch

    out = []
    with torch.no_grad():
        for p in prompts:
            ids = tokenizer(p, return_tensors="pt").input_ids
            gen = model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
            out.append(gen[0, ids.shape[1] :].tolist())
    return out


def vllm_greedy(llm, prompts=PROMPTS, max_tokens: int = 16) -> list[list[int]]:
    """Greedy output of a vLLM ``LLM``, each prompt generated alone. vLLM's result depends on the batch a token is
    computed in (bf16 on the CPU build: a tiny DeepSeek-V3 parts after 5 tokens between a batch of three prompts
    and each alone), and which requests share a batch depends on when each reaches the engine core process, so a
    batched comparison can flip under load; one request at a time it cannot."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids) for p in prompts]


def hf_auto_class(config: dict[str, Any]):
    """transformers' auto class for a model: a causal LM, else an image-text-to-text model (a VLM)."""
    import transformers

    causal = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if config.get("model_type") in causal or "vision_config" not in config:
        return transformers.AutoModelForCausalLM
    return transformers.AutoModelForImageTextToText


def is_vlm(config: dict[str, Any]) -> bool:
    return "vision_config" in config


def decoder_layers(model) -> list:
    """The decoder layers of an HF model (the ``ModuleList`` named ``layers``, wherever it sits: ``model.layers``,
    ``model.decoder.layers``, ``model.language_model.layers``)."""
    import torch

    for name, module in model.named_modules():
        if name.rpartition(".")[2] == "layers" and isinstance(module, torch.nn.ModuleList):
            return list(module)
    raise ValueError(f"{type(model).__name__} has no decoder layers named 'layers'")


def canonical_weights(model_dir: str | Path, config: dict[str, Any]) -> dict[str, Any]:
    """A model's weights by canonical name, as a trainer of it names them. For an architecture Awex has a table
    for, the checkpoint itself; otherwise what transformers loads (transformers 5 renames some tensors on load,
    e.g. GPT-NeoX's ``embed_out`` to ``lm_head``, a VLM's ``language_model.model`` to ``model.language_model``),
    named by ``awex.convert.hf.hf_checkpoint_tensors``."""
    from safetensors.torch import load_file

    from awex.meta.models import table_architecture

    if table_architecture(config) is not None:
        return {k: v.clone() for k, v in load_file(str(Path(model_dir) / "model.safetensors")).items()}
    from awex.convert.hf import hf_checkpoint_tensors, hf_views
    from awex.meta import Box

    model = hf_auto_class(config).from_pretrained(model_dir, **dtype_kwarg("auto"))  # the checkpoint's dtypes
    view_of = hf_views(model)
    return {
        name: view_of(name, Box((0,) * len(shape), shape)).detach().clone()
        for name, shape, _ in hf_checkpoint_tensors(model)
    }


def load_json(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


LOGPROB_TOLERANCE = 1e-3  # float32 tiny models: vLLM-CPU and HF agree to ~1e-5; stale KV moves a logprob by more


def version_boundary(
    old_model, new_model, prompt_ids: list[int], tokens: list[int], logprobs: list[float] | None = None
) -> int | None:
    """Where a greedy completion ``tokens`` of ``prompt_ids`` switched from ``old_model`` to ``new_model`` (a request
    paused in ``keep`` mode mid-generation and resumed on the new version): a split point ``k`` such that every token
    before ``k`` is the old model's greedy choice and every token from ``k`` on the new model's, each given all the
    tokens before it, and, with the engine's ``logprobs`` of each token, those equal the model's within
    :data:`LOGPROB_TOLERANCE` (a token computed from a stale cache or mixed weights moves its logprob even where the
    argmax holds). ``None`` when no split explains the completion. One teacher-forced pass per model."""
    import torch

    seq = torch.tensor([list(prompt_ids) + list(tokens)])
    start, n = len(prompt_ids), len(tokens)
    target = torch.tensor(tokens)
    ok = []
    with torch.no_grad():
        for model in (old_model, new_model):
            logits = model(seq).logits[0, start - 1 : start - 1 + n].float()
            good = logits.argmax(-1) == target
            if logprobs is not None:
                mine = logits.log_softmax(-1).gather(1, target[:, None])[:, 0]
                good &= (mine - torch.tensor(logprobs)).abs() <= LOGPROB_TOLERANCE
            ok.append(good.tolist())
    for k in range(n, -1, -1):  # the latest switch that explains it (the old version ran up to the pause)
        if all(ok[0][:k]) and all(ok[1][k:]):
            return k
    return None
