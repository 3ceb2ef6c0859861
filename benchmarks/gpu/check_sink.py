#!/usr/bin/env python3
"""GPU check of the bulk sink under CUDA graphs (issue 18): a sink step's rows come home
on the sink's own stream and are written after that copy's event, so the GPU is where
a missed wait would show (rows written before they arrived: zeros or another step's
bytes). On a tiny bf16 Llama with FULL_AND_PIECEWISE graphs, one batch of the same
prompts three ways: captured per request (model dtype and float32), sunk in the model's
dtype (views of the step copy, written after the event) and sunk as float32 (a cast
made on the engine's thread after waiting), beside plain requests. Every sunk
(request, position) appears once and equals the per-request capture of the same
prompt. Writes a JSON verdict; exits 1 if a check fails."""
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
ROOT = Path(__file__).resolve().parents[2]

import numpy as np  # noqa: E402  after the environment above, as vLLM reads it

SITES = ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_mid", "blocks.3.hook_resid_post",
         "blocks.2.attn.hook_q"]


def spec(dtype: str, sink: bool) -> dict:
    return {"capture": [{"site": s, "dtype": dtype, "sink": sink} for s in SITES]}


def main() -> int:
    import torch
    from safetensors.torch import load_file
    from vllm import SamplingParams

    from graphtap.testing.engines import make_llm, shutdown
    from graphtap.testing.tiny_models import tiny_model

    cpu = "--cpu" in sys.argv  # a smoke run of this script's logic on CPU
    sink_dir = Path(tempfile.mkdtemp(prefix="graphtap-sink-check-"))
    graphs = {} if cpu else {"compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE",
                                                    "max_cudagraph_capture_size": 256}}
    llm = make_llm(tiny_model("llama"), eager=cpu, dtype="float32" if cpu else "bfloat16",
                   gpu_memory_utilization=0.3, hook_manager="graphtap", max_num_seqs=32,
                   hook_config={"sites": SITES, "sink_dir": str(sink_dir),
                                "sink_shard_rows": 100}, **graphs)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, size=n).tolist() for n in (7, 90, 33, 150, 12)]
    ways = [("model", False), ("float32", False), ("model", True), ("float32", True), None]
    batch = [(p, w) for p in prompts for w in ways]
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                             **({"hooks": spec(*w)} if w else {})) for _, w in batch]
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in batch], params, use_tqdm=False)
    index = llm.collective_rpc("graphtap_sink_sync")[0]
    requests = index["requests"]
    checks, worst = [], 0.0
    for (prompt, way), out in zip(batch, outs):
        if not way or not way[1]:
            continue
        kept = outs[batch.index((prompt, (way[0], False)))].hooks
        ran = len(prompt) + len(out.outputs[0].token_ids) - 1
        me = requests.index(next(r for r in requests if r.startswith(out.request_id)))
        for site in SITES:
            shards = [load_file(str(sink_dir / s["file"])) for s in index["shards"]
                      if s["site"] == site]
            mine = [(f["position"][f["request"] == me], f["values"][f["request"] == me])
                    for f in shards]
            pos = torch.cat([m[0] for m in mine])
            vals = torch.cat([m[1] for m in mine])
            want = kept[site]
            ok = pos.tolist() == list(range(ran)) and vals.dtype == want.dtype \
                and vals.shape == want.shape
            err = float((vals.float() - want.float()).abs().max()
                        / want.float().abs().max().clamp_min(1e-6)) if ok else float("inf")
            worst = max(worst, err)
            checks.append({"way": way[0], "site": site, "rows": len(pos), "ran": ran,
                           "complete_once_in_order": pos.tolist() == list(range(ran)),
                           "max_rel_vs_per_request": err})
    errors = [o.hooks.error for o in outs if o.hooks is not None and o.hooks.error]
    verdict = {"errors": errors, "sink_checks": len(checks), "worst_max_rel": worst,
               "shards": len(index["shards"]), "repeated": index["repeated"],
               "stats": llm.collective_rpc("graphtap_hook_stats")[0].get("sink"),
               "checks": checks}
    # same prompt, same batch, same kernels: equal up to the batch's own bf16 noise
    verdict["ok"] = bool(not errors and checks and worst <= 1e-2
                         and all(c["complete_once_in_order"] for c in checks))
    shutdown(llm)
    shutil.rmtree(sink_dir, ignore_errors=True)
    out = Path(os.environ.get("OUT", ROOT / "benchmarks" / "results")) / "gpu-sink-check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(verdict, indent=1))
    print(json.dumps({k: v for k, v in verdict.items() if k != "checks"}, indent=1))
    return 0 if verdict["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
