"""The `graphtap` command.

    graphtap serve MODEL [--sites S ...] [--hook-config JSON] [--prefill-graphs TOKENS]
                   [vllm serve arguments...]
    graphtap sites MODEL [--json]
    graphtap demo [--model smollm2|llama|qwen2] [--compile] [--png FILE]
    graphtap demo guard --heads 5:18 7:12 [--model M] [--threshold T] [--dtype D]
    graphtap vector build MODEL --site S --positive FILE --negative FILE --out F.safetensors
    graphtap rerank MODEL --query Q --documents FILE --layers L [L ...]
    graphtap harvest MODEL --dataset FILE.jsonl|HF-DATASET --sites S [S ...] --out DIR
                     [--positions all] [--dtype float32|model] [--shard-prompts N]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from graphtap.devices import has_gpu
from graphtap.runner_info import WORKER_EXTENSION


def serve_argv(model: str, sites: list[str] | None, hook_config: str | None,
               rest: list[str], prefill_graphs: int | None = None) -> list[str]:
    """`vllm serve` with graphtap's hook manager and sites in its hook_config; with
    `prefill_graphs` steps of that many tokens and CUDA graphs up to them."""
    config = json.loads(hook_config) if hook_config else {}
    if sites:
        config["sites"] = sites
    # The runner probe (GET /v1/graphtap/stats reads the workers through it), unless the
    # caller brings a worker extension of their own.
    probe = [] if any(a.startswith("--worker-extension-cls") for a in rest) else \
        ["--worker-extension-cls", WORKER_EXTENSION]
    graphs = [] if prefill_graphs is None else prefill_graph_args(prefill_graphs, rest)
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model,
            "--hook-manager", "graphtap", "--hook-config", json.dumps(config), *probe,
            *graphs, *rest]


# vllm serve's flags that --prefill-graphs sets (vLLM reads either spelling, and
# --compilation-config.KEY / -cc.KEY set one key of it)
_GRAPH_FLAGS = ("--max-num-batched-tokens", "--max_num_batched_tokens",
                "--compilation-config", "--compilation_config", "-cc", "--enforce-eager",
                "--enforce_eager")


def prefill_graph_args(tokens: int, rest: list[str]) -> list[str]:
    """vllm serve's arguments for steps of `tokens` tokens replayed from CUDA graphs
    (graph_sizes.py): a capturing server's prefill steps then leave the host out, as a
    harvest's do (benchmarks/results, group llama3-8b-ttft-graphs). A flag of the
    caller's that sets the same thing is refused, naming both, never silently
    overridden either way."""
    from graphtap.graph_sizes import prefill_compilation_config

    if tokens < 1:
        raise ValueError(f"graphtap serve: --prefill-graphs must be at least 1 token, "
                         f"not {tokens}")
    for arg in rest:
        flag = arg.split("=", 1)[0]
        if any(flag == f or flag.startswith(f + ".") for f in _GRAPH_FLAGS):
            raise ValueError(f"graphtap serve: --prefill-graphs sets the step budget and "
                             f"the compilation config itself; drop {flag} or "
                             f"--prefill-graphs")
    return ["--max-num-batched-tokens", str(tokens),
            "--compilation-config", json.dumps(prefill_compilation_config(tokens))]


def _serve(args, rest: list[str]) -> int:
    if args.prefill_graphs is not None and not has_gpu():
        raise SystemExit("graphtap serve: --prefill-graphs needs a GPU (CUDA graphs)")
    try:
        argv = serve_argv(args.model, args.sites, args.hook_config, rest,
                          args.prefill_graphs)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    env = dict(os.environ)
    if "TRITON_INTERPRET" not in env and not has_gpu():
        env["TRITON_INTERPRET"] = "1"  # Model Runner V2's kernels on a CPU (patch 0001)
    os.execvpe(argv[0], argv, env)
    return 1


def _sites(args) -> int:
    from graphtap.sites_report import report

    rows = report(args.model)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"graphtap sites of {args.model}")
    for column in ("site", "row shape", "note"):
        table.add_column(column)
    for r in rows["sites"]:
        table.add_row(r["site"], str(r["shape"]), r["note"])
    console = Console()
    console.print(table)
    console.print(rows["patterns"])
    return 0


def _read_prompts(path: str) -> list[str]:
    """One prompt per line, or a JSON list of strings."""
    from pathlib import Path

    text = Path(path).read_text()
    if text.lstrip().startswith("["):
        prompts = json.loads(text)
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise SystemExit(f"{path}: expected prompts, one per line or a JSON list of strings")
    return prompts


def _vector(args) -> int:
    from rich.console import Console

    from graphtap.testing.engines import make_llm, shutdown
    from graphtap.vectors import contrast

    positive, negative = _read_prompts(args.positive), _read_prompts(args.negative)
    llm = make_llm(args.model, eager=True, hook_manager="graphtap",
                   hook_config={"sites": [args.site]})
    try:
        vec = contrast(llm, positive, negative, args.site, args.positions, chat=args.chat)
    finally:
        shutdown(llm)
    vec.save(args.out, args.name)
    Console().print(f"{args.out}: {args.site}, |v| = {float((vec.values ** 2).sum() ** 0.5):.4g}, "
                    f"projections positive {vec.positive_projection:.4g}, negative "
                    f"{vec.negative_projection:.4g} ({len(positive)} + {len(negative)} prompts)")
    return 0


def _rerank(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from graphtap.rerank import rerank
    from graphtap.testing.engines import make_llm, shutdown

    docs = _read_prompts(args.documents)
    llm = make_llm(args.model, eager=True, hook_manager="graphtap", hook_config={
        "sites": [f"blocks.{layer}.attn.hook_pattern" for layer in args.layers],
        "max_spans": max(len(docs), 1), "mass_rows": 16384})
    try:
        ranked = rerank(llm, args.query, docs, args.layers)
    finally:
        shutdown(llm)
    table = Table(title=f"documents for {args.query!r}, best first")
    for column in ("rank", "document", "score"):
        table.add_column(column)
    for rank, (i, score) in enumerate(ranked, 1):
        table.add_row(str(rank), docs[i][:80], f"{score:+.4f}")
    Console().print(table)
    return 0


def _harvest(args) -> int:
    from rich.console import Console

    from graphtap.harvest import harvest, read_dataset
    from graphtap.testing.engines import make_llm, shutdown

    try:
        prompts = read_dataset(args.dataset, args.column)
        positions = json.loads(args.positions) if args.positions[:1] in "[{" else args.positions
    except ValueError as e:
        raise SystemExit(f"graphtap harvest: {e}") from None
    import shutil
    from pathlib import Path

    # the engine's bulk sink, where the rows land before harvest arranges them by prompt:
    # anything left there by an interrupted run is not this run's
    sink = Path(args.out) / ".sink"
    shutil.rmtree(sink, ignore_errors=True)
    llm = make_llm(args.model, **harvest_engine(args, str(sink), has_gpu()))
    try:
        manifest = harvest(llm, prompts, args.sites, args.out, positions, args.dtype,
                           args.shard_prompts, args.max_tokens)
    finally:
        shutdown(llm)
    shutil.rmtree(sink, ignore_errors=True)
    Console().print(f"{args.out}: {manifest['rows']} rows at {len(args.sites)} site(s) from "
                    f"{len(prompts)} prompts in {len(manifest['shards'])} shard(s)"
                    f"{'' if manifest['complete'] else ' (incomplete)'}")
    return 0


def harvest_engine(args, sink_dir: str, gpu: bool) -> dict:
    """make_llm's arguments for a harvest: its hook config (the bulk sink); on a GPU the
    model's dtype, vLLM's memory share, 256 sequences and steps of --step-tokens tokens
    (make_llm's defaults are the tests' CPU ones) and, unless --no-prefill-graphs, CUDA
    graphs up to a step's budget (graph_sizes.py): without them the host paced a harvest's
    prefill steps (benchmarks/results, llama3-8b-sink-overlap). --prefill-graphs without a
    GPU is refused, naming the flag."""
    hooks = {"sites": args.sites, "sink_dir": sink_dir,
             "sink_max_queued_bytes": int(args.sink_memory_gb * 2**30)}
    if args.step_tokens < 1:
        raise SystemExit(f"graphtap harvest: --step-tokens must be at least 1, not "
                         f"{args.step_tokens}")
    if args.prefill_graphs and not gpu:
        raise SystemExit("graphtap harvest: --prefill-graphs needs a GPU (CUDA graphs)")
    graphs = gpu if args.prefill_graphs is None else args.prefill_graphs
    kw = dict(eager=not (args.compile or graphs), hook_manager="graphtap",
              hook_config=hooks)
    if gpu:
        kw.update(dtype="auto", gpu_memory_utilization=0.9, max_model_len=None,
                  max_num_seqs=256, max_num_batched_tokens=args.step_tokens)
    if graphs:
        from graphtap.graph_sizes import prefill_compilation_config

        kw["compilation_config"] = prefill_compilation_config(args.step_tokens)
    return kw


def _demo(ap, args) -> int:
    from graphtap.demo import run_demo, run_guard_demo
    from graphtap.guard_demo import parse_heads

    if args.part == "guard":
        if not args.heads:
            ap.error("demo guard needs --heads LAYER:HEAD[,HEAD] ...")
        try:
            heads = parse_heads(args.heads)
        except ValueError as e:
            ap.error(str(e))
        engine = {"dtype": args.dtype} if args.dtype else {}
        return run_guard_demo(args.model, heads, args.threshold,
                              png=args.png or "graphtap-guard.png", eager=not args.compile,
                              **engine)
    if args.model not in ("smollm2", "llama", "qwen2"):
        ap.error("demo: --model is smollm2, llama or qwen2 (any model: demo guard)")
    if args.heads or args.threshold is not None or args.dtype:
        ap.error("demo: --heads, --threshold and --dtype belong to demo guard")
    return run_demo(args.model, eager=not args.compile, png=args.png or "graphtap-demo.png")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="graphtap", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="steering and a prompt-injection guard on SmolLM2 "
                                       "(or a smoke run on a tiny random model)")
    demo.add_argument("part", nargs="?", choices=["all", "guard"], default="all",
                      help="guard: only the Attention Tracker guard, with --heads, on any "
                           "model")
    demo.add_argument("--model", default="smollm2",
                      help="smollm2 (default), llama or qwen2 (tiny random smoke runs); "
                           "with guard: any model directory or name")
    demo.add_argument("--heads", nargs="+", metavar="LAYER:HEAD[,HEAD]",
                      help="guard: the (layer, head) pairs whose focus is averaged")
    demo.add_argument("--threshold", type=float,
                      help="guard: flag below this focus (default: from calibration prompts)")
    demo.add_argument("--dtype", help="guard: the model's dtype (default float32)")
    demo.add_argument("--compile", action="store_true", help="torch.compile (slower start)")
    demo.add_argument("--png", help="where the score plot goes (default graphtap-demo.png, "
                                    "graphtap-guard.png for guard)")
    serve = sub.add_parser("serve", help="vllm serve MODEL with graphtap's hook manager; "
                                         "other arguments go to vllm serve")
    serve.add_argument("model")
    serve.add_argument("--sites", nargs="+", help="hook sites that get ops (default: every "
                                                  "residual site), e.g. 'blocks.*.hook_resid_post'")
    serve.add_argument("--hook-config", help="JSON hook_config (--sites replaces its sites)")
    serve.add_argument("--prefill-graphs", type=int, metavar="TOKENS",
                       help="steps of TOKENS tokens, CUDA graphs captured up to them (GPU): "
                            "prefill steps replay graphs instead of launching every kernel "
                            "and hook op from the host; costs capture time and graph memory "
                            "at start")
    sites = sub.add_parser("sites", help="every hook site of a model with its row shape")
    sites.add_argument("model", help="a model directory (or a name already in the HF cache)")
    sites.add_argument("--json", action="store_true")
    vector = sub.add_parser("vector", help="steering vectors built from the engine")
    build = vector.add_subparsers(dest="action", required=True).add_parser(
        "build", help="difference of means of a site over positive and negative prompts")
    build.add_argument("model")
    build.add_argument("--site", required=True, help="e.g. blocks.6.hook_resid_post")
    build.add_argument("--positive", required=True, help="prompts, one per line (or JSON)")
    build.add_argument("--negative", required=True)
    build.add_argument("--positions", default="last_prompt")
    build.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    build.add_argument("--out", required=True, help="a .safetensors file (a vectors_dir entry)")
    build.add_argument("--name", help="the tensor's name (default: the file's stem)")
    rr = sub.add_parser("rerank", help="order documents by the attention a query pays them")
    rr.add_argument("model")
    rr.add_argument("--query", required=True)
    rr.add_argument("--documents", required=True, help="one per line (or a JSON list)")
    rr.add_argument("--layers", type=int, nargs="+", required=True)
    hv = sub.add_parser("harvest", help="activations of a prompt set, as sharded safetensors")
    hv.add_argument("model")
    hv.add_argument("--dataset", required=True,
                    help="JSONL ({\"prompt\": ...}, {\"text\": ...} or {\"prompt_token_ids\": "
                         "[...]} per line), or a Hugging Face dataset: a save_to_disk folder "
                         "or NAME[:SPLIT] (needs the datasets package)")
    hv.add_argument("--column", help="the dataset's prompt column (default: the first of "
                                     "prompt, text, prompt_token_ids it has)")
    hv.add_argument("--sites", nargs="+", required=True, help="e.g. blocks.6.hook_resid_post")
    hv.add_argument("--positions", default="all",
                    help="all, prompt, last_prompt, generated, or a JSON list or span")
    hv.add_argument("--dtype", choices=["float32", "model"], default="float32")
    hv.add_argument("--shard-prompts", type=int, default=64, help="prompts per shard")
    hv.add_argument("--max-tokens", type=int, default=1, help="tokens generated per prompt")
    hv.add_argument("--out", required=True, help="a directory (an existing harvest resumes)")
    hv.add_argument("--compile", action="store_true",
                    help="torch.compile (default: eager, or graphs on a GPU)")
    hv.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="GPU (default there): torch.compile and CUDA graphs up to "
                         "--step-tokens, so prefill steps replay graphs instead of launching "
                         "every kernel from the host (start time and graph memory: "
                         "--no-prefill-graphs runs eager)")
    hv.add_argument("--step-tokens", type=int, default=2048,
                    help="GPU: the tokens a step may hold (max_num_batched_tokens)")
    hv.add_argument("--sink-memory-gb", type=float, default=4.0,
                    help="host memory the sink's rows may hold before the engine waits for "
                         "the disk (the engine's 256 MiB default throttles a harvest of many "
                         "layers to a fraction of the disk's speed)")
    args, rest = ap.parse_known_args(argv)
    if args.cmd != "serve" and rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd in ("demo", "vector", "rerank", "harvest") and \
            "TRITON_INTERPRET" not in os.environ and \
            not has_gpu():
        os.environ["TRITON_INTERPRET"] = "1"  # Model Runner V2 on a CPU (patch 0001)
    if args.cmd == "demo":
        return _demo(ap, args)
    if args.cmd == "serve":
        return _serve(args, rest)
    if args.cmd == "vector":
        return _vector(args)
    if args.cmd == "rerank":
        return _rerank(args)
    if args.cmd == "harvest":
        return _harvest(args)
    return _sites(args)


if __name__ == "__main__":
    raise SystemExit(main())
