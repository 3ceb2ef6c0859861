"""An engine core in the frontend's process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the
worker in it too): its prefill steps' splits wait for their tokens (courier/later.py)
and, with no output thread to settle them, vLLM's output processor does as they
arrive. Every captured row of a burst equals HF's.

The engine runs in a subprocess (this file, run as a script): an engine core started
in pytest's process would turn on vLLM's environment cache and freeze the garbage
collector's heap for every module after this one."""
import json
import os
import subprocess
import sys
from pathlib import Path

SITES = ["blocks.1.attn.hook_k", "blocks.2.hook_resid_post"]
TEXTS = ["Interpretability engineers read the residual stream of a transformer. " * 5,
         "Numbers like 12, 40, 256 and 4096 appear in configuration files. " * 5,
         "Once upon a time there was a small model that generated random words. " * 5,
         "Steering vectors shift the hidden state of every token they touch. " * 5]
MAX_TOKENS = 4


def main(model: str, out: Path) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from safetensors.torch import save_file
    from vllm import SamplingParams

    from graphtap.testing.engines import make_llm, tokenize

    # 256 tokens a step: a step's rows (k of 4 heads and the residual, 1 KiB each a
    # position) are well past DEFER_BYTES
    llm = make_llm(model, hook_manager="graphtap", max_num_batched_tokens=256,
                   hook_config={"capture_rows": 1024, "sites": SITES})
    ids = [i[:110] for i in tokenize(model, TEXTS)]
    hooks = {"capture": [{"site": s, "positions": "all", "dtype": "float32"} for s in SITES]}
    outs = llm.generate([{"prompt_token_ids": i} for i in ids],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                       hooks=hooks), use_tqdm=False)
    tensors, errors = {}, []
    for n, o in enumerate(outs):
        errors.append(o.hooks.error)
        for s in SITES:
            tensors[f"{n}/{s}"] = o.hooks[s].contiguous()
            tensors[f"{n}/{s}/positions"] = o.hooks.positions[s].contiguous()
    save_file(tensors, str(out / "rows.safetensors"))
    phases = sorted({p for p, _, _ in llm.collective_rpc("graphtap_host_timeline")[0]})
    (out / "run.json").write_text(json.dumps({
        "client": type(llm.llm_engine.engine_core).__name__, "ids": ids, "errors": errors,
        "tokens": [list(o.outputs[0].token_ids) for o in outs], "phases": phases}))


def test_an_in_process_engine_settles_deferred_rows_equal_to_hf(llama_path, tmp_path):
    import torch
    from safetensors.torch import load_file

    from graphtap.testing.engines import _hf_model
    from graphtap.testing.hf_reference import hf_capture, hf_capture_attention

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parents[1] / "overlay"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, __file__, str(llama_path), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["client"] == "InprocClient"  # the engine core ran in that process
    assert "split_later" in run["phases"]  # its prefill steps' splits waited
    assert run["errors"] == [None] * len(TEXTS)
    rows = load_file(str(tmp_path / "rows.safetensors"))
    hf = _hf_model(str(llama_path))
    for n, ids in enumerate(run["ids"]):
        k, k_pos = hf_capture_attention(hf, ids, MAX_TOKENS, 1)
        resid, resid_pos, tokens = hf_capture(hf, ids, MAX_TOKENS, SITES[1:])
        assert run["tokens"][n] == tokens
        for site, want, pos in ((SITES[0], k["k"], k_pos),
                                (SITES[1], resid[SITES[1]], resid_pos[SITES[1]])):
            assert rows[f"{n}/{site}/positions"].tolist() == pos.tolist(), (n, site)
            err = (rows[f"{n}/{site}"] - want).abs().max().item()
            assert err <= 1e-4, (n, site, err)
        assert len(k_pos) == len(ids) + MAX_TOKENS - 1  # every position that ran
        assert torch.isfinite(rows[f"{n}/{SITES[0]}"]).all()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
