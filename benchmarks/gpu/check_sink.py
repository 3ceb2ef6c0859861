#!/usr/bin/env python3
"""GPU check of the bulk sink under CUDA graphs (issue 18): a sink step's rows come home
on the sink's own stream and are written after that copy's event, so the GPU is where
a missed wait would show (rows written before they arrived: zeros or another step's
bytes). On a tiny bf16 Llama with FULL_AND_PIECEWISE graphs, the same prompts in three
batches: captured per request (the reference); sunk in the model's dtype beside plain
requests only (views of the step copy handed over before it arrived, written after the
event); sunk as float32 (a cast made on the engine's thread after waiting) and in the
model's dtype beside per-request captures in the same steps. The step copies go
through the sink's pinned staging memory (courier/staging.py). Every sunk (request,
position) appears once and equals the per-request capture of the same prompt. Writes
a JSON verdict; exits 1 if a check fails. Session 17's first run compared a site's
shards of both dtypes concatenated (float32): its dtype failure was the check's."""
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

    def generate(ways):
        batch = [(p, w) for p in prompts for w in ways]
        params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                 **({"hooks": spec(*w)} if w else {})) for _, w in batch]
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in batch], params,
                            use_tqdm=False)
        return list(zip(batch, outs))

    # 1: per-request references; 2: model-dtype sink requests beside plain ones only,
    # so every sink step hands its rows over as views still being copied (the event
    # path: nothing on the engine's thread waits); 3: the float32 sink (a cast made on
    # the engine's thread after the event) beside per-request captures in the same steps
    refs = generate([("model", False), None])
    sunk = generate([("model", True), None]) + generate(
        [("float32", False), ("float32", True), ("model", True)])
    ref_of = {(tuple(p), w): o for (p, w), o in refs + sunk if w and not w[1]}
    index = llm.collective_rpc("graphtap_sink_sync")[0]
    requests = index["requests"]
    checks, worst = [], 0.0
    for (prompt, way), out in sunk:
        if not way or not way[1]:
            continue
        kept = ref_of[(tuple(prompt), (way[0], False))].hooks
        ran = len(prompt) + len(out.outputs[0].token_ids) - 1
        # the engine core's ids: vLLM appends "-" and 8 hex digits to each request's id
        me = [r.rsplit("-", 1)[0] for r in requests].index(out.request_id)
        for site in SITES:
            want = kept[site]
            # the site's shards in this request's format (one format a shard: the model
            # and float32 ways of a site are shards of their own)
            shards = [load_file(str(sink_dir / s["file"])) for s in index["shards"]
                      if s["site"] == site and s["dtype"] == str(want.dtype)[6:]]
            mine = [(f["position"][f["request"] == me], f["values"][f["request"] == me])
                    for f in shards]
            pos = torch.cat([m[0] for m in mine])
            vals = torch.cat([m[1] for m in mine])
            same = vals.dtype == want.dtype and vals.shape == want.shape
            diff = (vals.float() - want.float()).abs() if same else None
            err = float(diff.max() / want.float().abs().max().clamp_min(1e-6)) if same \
                else float("inf")
            worst = max(worst, err)
            checks.append({"way": way[0], "site": site, "rows": len(pos), "ran": ran,
                           "complete_once_in_order": pos.tolist() == list(range(ran)),
                           "dtype": [str(vals.dtype), str(want.dtype)],
                           "shape": [list(vals.shape), list(want.shape)],
                           "nonfinite": int((~torch.isfinite(vals.float())).sum()),
                           "rows_equal": int((diff.flatten(1).amax(1) == 0).sum()) if same
                           else None,
                           "max_rel_vs_per_request": err})
    errors = [o.hooks.error for _, o in refs + sunk if o.hooks is not None and o.hooks.error]
    verdict = {"errors": errors, "sink_checks": len(checks), "worst_max_rel": worst,
               "shards": len(index["shards"]), "repeated": index["repeated"],
               "stats": llm.collective_rpc("graphtap_hook_stats")[0].get("sink"),
               "checks": checks}
    # the same prompts: equal up to bf16 noise between batches of other sizes (a row
    # written before its copy arrived would be zeros or another step's bytes)
    stats = verdict["stats"]
    verdict["ok"] = bool(not errors and checks and worst <= 1e-2
                         and all(c["complete_once_in_order"] for c in checks)
                         # on a GPU the step copies went through the pinned staging
                         and (cpu or (stats["staged_total"] > 0 and not stats["error"])))
    shutdown(llm)
    shutil.rmtree(sink_dir, ignore_errors=True)
    out = Path(os.environ.get("OUT", ROOT / "benchmarks" / "results")) / "gpu-sink-check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(verdict, indent=1))
    print(json.dumps({k: v for k, v in verdict.items() if k != "checks"}, indent=1))
    return 0 if verdict["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
