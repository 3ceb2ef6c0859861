"""`make demo`: the main job on an embedded tiny model, reporting what actually ran."""
from __future__ import annotations

import time

from rich.console import Console
from rich.table import Table

from graphtap.testing.engines import make_llm, runner_info, shutdown
from graphtap.testing.tiny_models import tiny_model

PROMPTS = ["The quick brown fox", "Attention patterns show which tokens"]
SITE = "blocks.2.hook_resid_post"


def demo_hooks(hidden: int) -> dict:
    """Steer the stream at SITE and capture it at the last prompt token and after."""
    import numpy as np

    vec = np.random.default_rng(0).normal(size=hidden).astype(np.float32).tolist()
    return {"steer": [{"site": SITE, "op": "add", "scale": 6.0, "vector": vec}],
            "capture": [{"site": SITE, "positions": {"start": 3, "end": 8}}]}


def run_demo(model: str = "llama", eager: bool = False) -> int:
    from vllm import SamplingParams

    console = Console()
    t0 = time.monotonic()
    path = tiny_model(model)
    console.print(f"tiny {model} model at {path}")
    llm = make_llm(path, eager=eager, hook_manager="graphtap")
    started = time.monotonic() - t0
    try:
        info = runner_info(llm)
        plain = SamplingParams(max_tokens=16, temperature=0.0)
        outs = llm.generate(PROMPTS, plain)
        steered = llm.generate(PROMPTS[:1], SamplingParams(
            max_tokens=16, temperature=0.0, hooks=demo_hooks(256)))[0]
    finally:
        shutdown(llm)
    table = Table(title="what ran in the vLLM worker")
    table.add_column("item")
    table.add_column("value")
    table.add_row("model runner", info["runner_class"])
    table.add_row("Model Runner V2", str(info["model_runner_v2"]))
    table.add_row("compilation mode", info["compilation_mode"])
    table.add_row("CUDA graph mode", info["cudagraph_mode"])
    table.add_row("engine start", f"{started:.1f} s")
    console.print(table)
    for prompt, out in zip(PROMPTS, outs):
        console.print(f"[bold]{prompt!r}[/] -> {out.outputs[0].text!r}")
    console.print(f"[bold]{PROMPTS[0]!r}[/] steered at {SITE} -> {steered.outputs[0].text!r}")
    rows = steered.hooks[SITE]
    console.print(f"captured {SITE}: {tuple(rows.shape)} at positions "
                  f"{steered.hooks.positions[SITE].tolist()}, row norms "
                  f"{[round(float(r.norm()), 2) for r in rows]}")
    if not info["model_runner_v2"]:
        console.print("[red]vLLM fell back to its V1 runner: graphtap's hook slots are absent")
        return 1
    return 0
