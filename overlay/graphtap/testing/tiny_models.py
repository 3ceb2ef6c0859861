"""Tiny random-weight models and a BPE tokenizer, written locally: no hub, no downloads.

Used by the tests (reference parity against HF transformers) and by `make demo`. The
shapes are chosen for vLLM's CPU attention, which rejects head_dim 16: hidden 256 with
head_dim 64. Qwen2 uses grouped-query attention (4 query heads over 2 KV heads).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

# A small corpus is enough for a byte-level BPE to have a few hundred merges; the text
# also gives the tests natural-looking prompts.
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Interpretability engineers read the residual stream of a transformer.",
    "Steering vectors shift the hidden state of a language model at run time.",
    "Attention patterns show which tokens a head looks at when it writes its output.",
    "Prompt injection asks a model to ignore its previous instructions.",
    "Hallucination probes are linear classifiers trained on hidden states.",
    "vLLM serves large language models with paged attention and CUDA graphs.",
    "A guardrail should cost a few percent of the time per output token.",
    "Once upon a time there was a small model that generated random words.",
    "Numbers like 12, 40, 256 and 4096 appear in configuration files.",
]

SPECS = {
    "llama": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256,
        intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, head_dim=64, max_position_embeddings=1024, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False,
    ),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=256,
        intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=False, use_sliding_window=False,
    ),
}
VOCAB_SIZE = 512
SEED = 1234
FORMAT_VERSION = 1  # bump when anything above changes: it is part of the cache key


def default_cache_dir() -> Path:
    return Path(os.environ.get("GRAPHTAP_TINY_CACHE", Path.home() / ".cache" / "graphtap" / "tiny"))


def _cache_key(name: str) -> str:
    blob = json.dumps([FORMAT_VERSION, SPECS[name], CORPUS, VOCAB_SIZE, SEED], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def build_tokenizer(out_dir: Path) -> None:
    """Train a byte-level BPE tokenizer and save it in the HF `tokenizer.json` format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.save_pretrained(out_dir)


def build_model(name: str, out_dir: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(SPECS[name])
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB_SIZE, bos_token_id=0,
                                  eos_token_id=1, pad_token_id=2, torch_dtype="float32", **spec)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    # Larger-than-default init spreads the logits so greedy decoding has clear winners,
    # which keeps HF-vs-vLLM token parity from hinging on float ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out_dir, safe_serialization=True)


def tiny_model(name: str, cache_dir: Path | None = None) -> Path:
    """Directory of tiny model `name` ("llama" or "qwen2"), built once and cached."""
    if name not in SPECS:
        raise ValueError(f"unknown tiny model {name!r}; choose one of {sorted(SPECS)}")
    root = (cache_dir or default_cache_dir()) / f"{name}-{_cache_key(name)}"
    if (root / ".complete").exists():
        return root
    tmp = root.with_name(root.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    build_model(name, tmp)
    build_tokenizer(tmp)
    (tmp / ".complete").write_text("ok\n")
    try:
        os.replace(tmp, root)
    except OSError:  # another process won the race: its copy is identical
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return root
