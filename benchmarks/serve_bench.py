"""vLLM's own `vllm bench serve` against a stock server and a graphtap server on the same
weights: TPOT, TTFT and output throughput per mode, and each mode's ratio to stock.

The stock server runs without a hook manager (on the GPU host: the stock wheel); the
graphtap server runs the modes one after another with the same prompts (`--seed`): idle
(no hooks), steer (a registered vector added at one layer, every request), hs
(residuals at 3 layers, last prompt token), qk (post-RoPE q and k, 4 layers x 4 heads),
and idle2, idle again: the A/A control, the measurement's own noise. Hooks travel in
`--extra-body` as a top-level `hooks` object, as any client sends them.

  GPU:  python -m benchmarks.serve_bench --model llama3-8b \\
            --stock-path /tmp/vllm-site/stock:/tmp/vllm-site/deps \\
            --graphtap-path /tmp/vllm-site/patched:/tmp/vllm-site/deps:$GT_SITE
  CPU:  python -m benchmarks.serve_bench --quick   (tiny model, CI smoke; no speed claims)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from benchmarks.gpu.workloads import hook_config, mode_hooks, model_dir, steer_vector

MODES = ["stock", "idle", "steer", "hs", "qk", "idle2"]
METRICS = ("median_tpot_ms", "median_ttft_ms", "output_throughput")


@contextmanager
def server(args, model: str, tokenizer: str, graphtap: bool, cfg: dict, log: Path):
    from graphtap.testing.servers import ServerFailed, free_port, running_server

    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model,
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "m",
           "--tokenizer", tokenizer, "--max-model-len", str(args.input_len + args.output_len + 16),
           "--seed", "0", "--no-enable-prefix-caching", "--disable-log-stats"]
    cmd += (["--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.3"]
            if args.quick else ["--load-format", "dummy", "--dtype", "bfloat16"])
    if graphtap:
        cmd += ["--hook-manager", "graphtap", "--hook-config",
                json.dumps(hook_config(cfg, [m for m in MODES if m != "stock"]))]
    env = dict(os.environ)
    path = args.graphtap_path if graphtap else args.stock_path
    if path:
        env["PYTHONPATH"] = path
    if args.quick:
        env.setdefault("TRITON_INTERPRET", "1")
    try:
        with running_server(cmd, port, env, log, args.start_timeout) as base:
            yield base, env
    except ServerFailed as e:
        raise SystemExit(str(e)) from None


def bench(args, base: str, env: dict, tokenizer: str, rate: float, hooks: dict | None,
          out: Path) -> dict:
    """One `vllm bench serve` run; its saved result."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
           "--backend", "vllm", "--base-url", base, "--endpoint", "/v1/completions",
           "--model", "m", "--tokenizer", tokenizer, "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(args.num_prompts), "--request-rate", str(rate), "--seed", "0",
           "--ignore-eos", "--temperature", "0", "--save-result", "--result-dir", str(out.parent),
           "--result-filename", out.name]
    if hooks is not None:
        cmd += ["--extra-body", json.dumps({"hooks": hooks})]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.run_timeout)
    if res.returncode != 0 or not out.exists():
        raise SystemExit(f"vllm bench serve failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    return json.loads(out.read_text())


def served_hooks(mode: str, cfg: dict) -> dict | None:
    """A mode's spec as a client sends it: the steering vector by its registered name."""
    hooks = mode_hooks(mode, cfg, [])
    for s in (hooks or {}).get("steer", []):
        s["vector"] = "bench"
    return hooks


def register(base: str, cfg: dict) -> None:
    body = json.dumps({"name": "bench", "vector": steer_vector(cfg).tolist()}).encode()
    req = urllib.request.Request(base + "/v1/graphtap/vectors", body,
                                 {"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=60).read()


def table(result: dict) -> str:
    rates = sorted({r["rate"] for r in result["runs"]})
    lines = []
    for rate in rates:
        runs = {r["mode"]: r for r in result["runs"] if r["rate"] == rate}
        stock = runs.get("stock")
        lines += [f"\n{rate:g} req/s, {result['num_prompts']} prompts, {result['input_len']} in / "
                  f"{result['output_len']} out tokens:\n",
                  "| mode | completed | median TPOT | median TTFT | output tok/s | TPOT vs stock |",
                  "|---|---|---|---|---|---|"]
        for mode in [m for m in MODES if m in runs]:
            r = runs[mode]
            ratio = (f"{(r['median_tpot_ms'] / stock['median_tpot_ms'] - 1) * 100:+.1f} %"
                     if stock and mode != "stock" else "–")
            lines.append(f"| {mode} | {r['completed']}/{r['num_prompts']} | "
                         f"{r['median_tpot_ms']:.2f} ms | {r['median_ttft_ms']:.1f} ms | "
                         f"{r['output_throughput']:.1f} | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rates", default="1,4,8,16")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--stock-path", help="PYTHONPATH of the stock server (GPU host)")
    ap.add_argument("--graphtap-path", help="PYTHONPATH of the graphtap server (GPU host)")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--quick", action="store_true", help="CPU smoke run on the tiny model")
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--run-timeout", type=float, default=900)
    args = ap.parse_args()
    if args.quick:
        args.model, args.rates, args.num_prompts = "tiny", "8", 4
        args.input_len, args.output_len = 16, 8
    modes = args.modes.split(",")
    path, cfg = model_dir(args.model)
    from graphtap.testing.tiny_models import tiny_model

    # Dummy weights come without a tokenizer: the tiny model's serves (its ids are valid
    # in every real vocabulary, and speed does not depend on which tokens run).
    tokenizer = str(tiny_model("llama")) if not args.quick else path
    out = Path(args.out)
    runs_dir = out / f"serve-bench-{args.model}-runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    result = {"model": args.model, "num_prompts": args.num_prompts, "input_len": args.input_len,
              "output_len": args.output_len, "runs": []}
    rates = [float(r) for r in args.rates.split(",")]
    for graphtap in (False, True):
        variant = [m for m in modes if (m != "stock") == graphtap]
        if not variant:
            continue
        log = runs_dir / f"server-{'graphtap' if graphtap else 'stock'}.log"
        with server(args, path, tokenizer, graphtap, cfg, log) as (base, env):
            if graphtap and "steer" in variant:
                register(base, cfg)
            for rate in rates:
                for mode in variant:
                    hooks = served_hooks(mode, cfg) if graphtap else None
                    saved = bench(args, base, env, tokenizer, rate, hooks,
                                  runs_dir / f"{mode}-{rate:g}.json")
                    run = {"mode": mode, "rate": rate, "num_prompts": args.num_prompts,
                           "completed": saved["completed"], "failed": saved.get("failed", 0),
                           **{m: saved[m] for m in METRICS}}
                    result["runs"].append(run)
                    print(json.dumps(run), flush=True)
    name = f"serve-bench-{args.model}{'-quick' if args.quick else ''}"
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{name}.md").write_text(f"# vllm bench serve: {args.model}\n" + table(result))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
