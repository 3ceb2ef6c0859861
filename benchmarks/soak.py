"""Soak: many requests with mixed specs against one graphtap server, each checked
against its solo run; then nothing may be held.

Mixed specs: plain (greedy and sampled), steering with every op and position rule,
captures of every site kind and rule, attention patterns, both together, n = 2 with
steering, safetensors encoding. Random (Poisson) arrival, ~5 % of clients leave
mid-stream, a small KV cache so that requests are preempted and recomputed, chunked
prefill with a small token budget. Every response is compared with the same request run
alone first: tokens (greedy and seeded sampling) bit for bit, captured rows by position
and value; then the server's /v1/graphtap/stats must show nothing held, and the
servers' host memory (and on a GPU, device memory) must not grow.

  CPU:  python -m benchmarks.soak --requests 10000 --out soak.json   (tiny Llama)
  CI:   tests/test_soak.py runs --requests 1000
  GPU:  python -m benchmarks.soak --model qwen2-1.5b --requests 10000 --out soak-gpu.json
        (dummy weights of the real config; values compared to --tolerance)

Exit status 1 when a row was lost or misattributed, a response was a 5xx, a greedy
response differed from its solo run, or anything was held at the end.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.soak_cases import Case, catalogue, compare

KEY = "soak"


def server_cmd(args, model: str, port: int) -> list[str]:
    hook = {"sites": ["blocks.*.hook_resid_pre", "blocks.1.hook_resid_mid",
                      "blocks.*.hook_resid_post", "blocks.1.attn.hook_q", "blocks.1.attn.hook_k",
                      "blocks.1.attn.hook_v", "blocks.1.attn.hook_z",
                      "blocks.1.attn.hook_pattern"],
            "max_vectors": 64, "capture_rows": 8192, "pattern_rows": 2048}
    cmd = [sys.executable, "-m", "graphtap.cli", "serve", model, "--hook-config",
           json.dumps(hook), "--host", "127.0.0.1", "--port", str(port), "--api-key", KEY,
           "--served-model-name", "m", "--seed", "0",
           "--max-model-len", "512", "--max-num-seqs", str(args.max_num_seqs),
           "--enable-chunked-prefill", "--max-num-batched-tokens", str(args.batched_tokens),
           "--kv-cache-memory-bytes", str(args.kv_cache_bytes)]
    if args.gpu:
        return cmd + ["--load-format", "dummy", "--dtype", "bfloat16"]
    return cmd + ["--dtype", "float32", "--enforce-eager"]


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry))
            rss[int(entry)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo += children.get(p, [])
    return total


def device_used() -> int | None:
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,"
                              "nounits"], capture_output=True, text=True, timeout=30).stdout
        return int(out.split()[0]) * 2**20
    except (OSError, ValueError, IndexError):
        return None


async def send(client, case: Case, leave: bool):
    body = case.body()
    if leave:  # stream, read one chunk, go away
        body = {**body, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break
        return None
    r = await client.post("/v1/completions", json=body)
    return r.status_code, r.json()


async def load(base: str, cases: list[Case], args, rng) -> list:
    import httpx

    picks = rng.integers(0, len(cases), args.requests)
    leaves = rng.random(args.requests) < args.disconnect
    gaps = rng.exponential(1.0 / args.rate, args.requests)
    limits = httpx.Limits(max_connections=args.concurrency)
    results: list = [None] * args.requests
    gate = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits,
                                 headers={"Authorization": f"Bearer {KEY}"}) as client:
        async def one(i):
            async with gate:
                try:
                    results[i] = await send(client, cases[picks[i]], bool(leaves[i]))
                except Exception as e:  # a transport error: counted, never hidden
                    results[i] = (-1, {"error": repr(e)})
        tasks = []
        for i in range(args.requests):
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(gaps[i])
            if args.progress and i % 500 == 0:
                print(f"soak: {i}/{args.requests} sent", file=sys.stderr, flush=True)
        await asyncio.gather(*tasks)
    return list(zip(picks.tolist(), leaves.tolist(), results))


def wait_free(base: str, timeout: float = 120) -> dict:
    """The stats once nothing is held (or at the timeout). vLLM tells the runner which
    requests ended (aborted by a disconnect) with its next step: a one-token plain
    request between polls lets it run."""
    import httpx

    deadline, snapshot = time.monotonic() + timeout, None
    with httpx.Client(base_url=base, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as client:
        while time.monotonic() < deadline:
            snapshot = client.get("/v1/graphtap/stats").json()
            if not held(snapshot):
                break
            time.sleep(1)
            client.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3],
                                                 "max_tokens": 1})
    return snapshot


def held(snapshot: dict) -> dict:
    out = {f"frontend.{k}": v for k, v in snapshot["frontend"].items()
           if v and k != "saved_bytes"}
    for i, worker in enumerate(snapshot.get("workers") or []):
        for family, counts in worker.items():
            out.update({f"worker{i}.{family}.{k}": v for k, v in counts.items()
                        if v and k != "vectors_resident" and not k.endswith("_total")})
    if not snapshot.get("workers"):
        out["workers"] = "no stats from the workers"
    return out


def run(args) -> dict:
    import httpx

    from graphtap.testing.servers import free_port, running_server

    model = args.model_path or _model(args)
    cases = catalogue(model, args)
    port = free_port()
    env = dict(os.environ)
    if args.graphtap_path:
        env["PYTHONPATH"] = args.graphtap_path
    log = Path(args.log)
    with running_server(server_cmd(args, str(model), port), port, env, log,
                        args.start_timeout) as base:
        pid = _server_pid(port)
        client = httpx.Client(base_url=base, timeout=600,
                              headers={"Authorization": f"Bearer {KEY}"})
        solo = []
        for case in cases:  # alone, one at a time: the references
            r = client.post("/v1/completions", json=case.body())
            solo.append((r.status_code, r.json()))
        bad_solo = [c.name for c, (s, _) in zip(cases, solo) if s != 200]
        rng = np.random.default_rng(args.seed)
        warm = args.requests // 10
        warm_args = argparse.Namespace(**{**vars(args), "requests": warm})
        asyncio.run(load(base, cases, warm_args, rng))  # warm-up: allocator pools fill
        wait_free(base)
        rss0, dev0 = tree_rss(pid), device_used()
        started = time.monotonic()
        results = asyncio.run(load(base, cases, args, rng))
        elapsed = time.monotonic() - started
        snapshot = wait_free(base)
        rss1, dev1 = tree_rss(pid), device_used()
        engine = metrics(client)
    counts = {"requests": args.requests, "checked": 0, "left_mid_stream": 0, "status_5xx": 0,
              "status_4xx": 0, "transport_errors": 0, "tokens_differ": 0,
              "sampled_tokens_differ": 0, "rows_lost": 0, "rows_misattributed": 0,
              "rows_checked": 0, "withheld_with_error": 0}
    for pick, left, result in results:
        if left:
            counts["left_mid_stream"] += 1
            continue
        status, body = result
        if status == -1:
            counts["transport_errors"] += 1
        elif status >= 500:
            counts["status_5xx"] += 1
        elif status >= 400:
            counts["status_4xx"] += 1
        else:
            counts["checked"] += 1
            for k, v in compare(cases[pick], solo[pick][1], body, args.tolerance).items():
                counts[k] += v
    report = {**counts, "solo_refused": bad_solo, **engine, "seconds": round(elapsed, 1),
              "held_at_end": held(snapshot), "host_rss_growth_mib":
              round((rss1 - rss0) / 2**20, 1), "host_rss_mib": round(rss1 / 2**20, 1),
              "device_growth_mib": None if dev0 is None or dev1 is None
              else round((dev1 - dev0) / 2**20, 1),
              "config": {k: v for k, v in vars(args).items() if k not in ("out", "log")}}
    report["ok"] = not (counts["status_5xx"] or counts["transport_errors"] or
                        counts["tokens_differ"] or counts["rows_lost"] or
                        counts["rows_misattributed"] or report["held_at_end"] or bad_solo or
                        counts["status_4xx"])
    return report


def metrics(client) -> dict:
    """vLLM's own counters (Prometheus /metrics): that preemption and chunked prefill did
    happen."""
    want = {"vllm:num_preemptions_total": "preemptions",
            "vllm:prompt_tokens_total": "prompt_tokens",
            "vllm:prefix_cache_hits_total": "prefix_cache_hit_tokens"}
    out = dict.fromkeys(want.values(), None)
    try:
        text = client.get("/metrics").text
    except Exception:
        return out
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in want:
            try:
                out[want[name]] = (out[want[name]] or 0) + int(float(line.rsplit(" ", 1)[1]))
            except ValueError:
                pass
    return out


def _server_pid(port: int) -> int:
    """The serving process: the one listening on `port` (its children are the engine)."""
    import subprocess

    out = subprocess.run(["ss", "-Htlnp", f"sport = :{port}"], capture_output=True,
                         text=True).stdout
    return int(out.split("pid=")[1].split(",")[0]) if "pid=" in out else os.getpid()


def _model(args) -> Path:
    if args.gpu:
        from benchmarks.gpu.workloads import model_dir

        return Path(model_dir(args.model))
    from graphtap.testing.tiny_models import tiny_model

    return tiny_model("llama")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--rate", type=float, default=40.0, help="mean arrivals per second")
    ap.add_argument("--concurrency", type=int, default=48)
    ap.add_argument("--disconnect", type=float, default=0.05)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--long-tokens", type=int, default=40,
                    help="max_tokens of the longest prompt's cases (decode growth preempts)")
    ap.add_argument("--max-num-seqs", type=int, default=24)
    ap.add_argument("--batched-tokens", type=int, default=96)
    ap.add_argument("--kv-cache-bytes", type=int, default=6 * 2**20)
    ap.add_argument("--tolerance", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--model", default="llama")
    ap.add_argument("--model-path", type=Path)
    ap.add_argument("--graphtap-path")
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--log", default="soak-server.log")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--progress", action="store_true")
    args = ap.parse_args(argv)
    report = run(args)
    text = json.dumps(report, indent=1, default=str)  # paths in the config
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
