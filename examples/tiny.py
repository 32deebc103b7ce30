"""The small model the examples run on CPU, made here (no download): a 2-layer Qwen2 with random weights and a
word-level tokenizer. On GPUs, pass ``--model`` a real checkpoint instead (Qwen3, Qwen2, Llama, Mistral...)."""

from __future__ import annotations

from pathlib import Path

WORDS = (
    "the a of to and in is was for on that with as by at from it his her an be are this which or had not but "
    "president united states capital france largest ocean earth speed light vacuum chemical formula water "
    "tallest mountain world first person walk moon great wall china built photosynthesis process plants theory "
    "general relativity proposed boiling point sea level planet solar system dna stands deoxyribonucleic acid "
    "hello my name future ai quick brown fox jumps over lazy dog policy reward rollout gradient update model"
).split()
VOCAB = 512


def tiny_model(path: str | Path, seed: int = 0, layers: int = 2) -> str:
    """Write the model to ``path`` (once; weights from ``seed``) and return the path as a string."""
    import random

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return str(path)
    tokenizer = Tokenizer(models.BPE())  # byte-level BPE, as Qwen's, learnt from sentences of WORDS
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    rnd = random.Random(0)
    corpus = [" ".join(rnd.choice(WORDS) for _ in range(20)) for _ in range(2000)]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    learn = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet, show_progress=False
    )
    tokenizer.train_from_iterator(corpus, learn)
    tokenizer.add_tokens([f"<|extra_{i}|>" for i in range(VOCAB - tokenizer.get_vocab_size())])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=0,
        bos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # larger than HF's init, so that greedy text differs visibly from one model to another
        for p in model.parameters():
            p.normal_(0.0, 0.5 if p.dim() > 1 else 0.1).add_(1.0 if p.dim() == 1 else 0.0)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return str(path)
