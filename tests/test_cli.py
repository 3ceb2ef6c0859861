"""The `graphtap` command's engine-free parts (`graphtap serve` itself starts the server of
test_serve_api.py)."""
import json
import subprocess
import sys

from graphtap.cli import serve_argv


def test_serve_passes_graphtap_and_vllm_arguments_through():
    argv = serve_argv("m", ["blocks.*.hook_resid_post"], '{"max_vectors": 8}',
                      ["--port", "8001", "--api-key", "k"])
    assert argv[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", "m"]
    i = argv.index("--hook-config")
    assert json.loads(argv[i + 1]) == {"max_vectors": 8, "sites": ["blocks.*.hook_resid_post"]}
    assert argv[argv.index("--hook-manager") + 1] == "graphtap"
    assert argv[-4:] == ["--port", "8001", "--api-key", "k"]
    assert argv[argv.index("--worker-extension-cls") + 1] == "graphtap.runner_info.RunnerInfoExtension"
    own = serve_argv("m", None, None, ["--worker-extension-cls", "mine.Ext"])
    assert own.count("--worker-extension-cls") == 1  # the caller's own wins


def test_serve_prefill_graphs_become_vllm_serve_settings(monkeypatch):
    """`graphtap serve --prefill-graphs 2048`: vllm serve reads a 2048-token step budget and
    graph_sizes' capture sizes from the arguments it is given (on the H200 a capturing
    server's TTFT at 64 at once: benchmarks/results, group llama3-8b-ttft-graphs). A flag
    of the caller's that sets the same is refused, naming it; so are budgets below one
    token and, without a GPU, the option itself."""
    import pytest
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from graphtap.cli import main
    from graphtap.graph_sizes import prefill_graph_sizes

    argv = serve_argv("m", None, None, ["--port", "8001"], prefill_graphs=2048)
    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[4:])
    engine = AsyncEngineArgs.from_cli_args(parsed)
    assert engine.max_num_batched_tokens == 2048 and parsed.port == 8001
    compilation = engine.compilation_config
    assert compilation.cudagraph_capture_sizes == prefill_graph_sizes(2048)
    assert str(compilation.cudagraph_mode).endswith("FULL_AND_PIECEWISE")
    for flag in ["--max-num-batched-tokens=4096", "--compilation-config", "-cc",
                 "--compilation-config.cudagraph_mode", "--enforce-eager"]:
        with pytest.raises(ValueError, match=f"drop {flag.split('=')[0]} or --prefill"):
            serve_argv("m", None, None, [flag, "x"], prefill_graphs=2048)
    with pytest.raises(ValueError, match="at least 1 token"):
        serve_argv("m", None, None, [], prefill_graphs=0)
    # as on a machine without one (with one, main would exec vllm serve)
    monkeypatch.setattr("graphtap.cli.has_gpu", lambda: False)
    with pytest.raises(SystemExit, match="--prefill-graphs needs a GPU"):
        main(["serve", "m", "--prefill-graphs", "2048"])


def test_sites_lists_every_site_with_its_row_shape(qwen2_path):
    res = subprocess.run([sys.executable, "-m", "graphtap.cli", "sites", str(qwen2_path),
                          "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["architecture"] == "Qwen2ForCausalLM" and report["slots"]
    sites = {r["site"]: r["shape"] for r in report["sites"]}
    assert len(sites) == 3 * 8  # 3 layers x 8 kinds
    assert sites["blocks.0.hook_resid_pre"] == [256]
    assert sites["blocks.2.attn.hook_q"] == [4, 64] and sites["blocks.2.attn.hook_k"] == [2, 64]
    assert "FLASH_ATTN" in report["patterns"]
    human = subprocess.run([sys.executable, "-m", "graphtap.cli", "sites", str(qwen2_path)],
                           capture_output=True, text=True, timeout=120)
    assert human.returncode == 0 and "blocks.2.attn.hook_pattern" in human.stdout


def test_demo_guard_arguments_are_checked_before_any_engine_starts(capsys):
    import pytest

    from graphtap.cli import main
    from graphtap.guard_demo import parse_heads

    assert parse_heads(["7:12,3", "5:18", "7:3"]) == [(5, 18), (7, 3), (7, 12)]
    for argv, words in [(["demo", "guard"], "needs --heads"),
                        (["demo", "guard", "--heads", "5"], "is not LAYER:HEAD"),
                        (["demo", "guard", "--heads", "5:x"], "is not LAYER:HEAD"),
                        (["demo", "--model", "gpt2"], "any model: demo guard"),
                        (["demo", "--heads", "5:1"], "belong to demo guard")]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and words in capsys.readouterr().err, argv


def test_gpu_is_detected_without_poisoning_fork(monkeypatch):
    """On the H200, `graphtap demo guard` died at engine start ("Cannot re-initialize
    CUDA in forked subprocess"): the CLI had asked torch.cuda.is_available() through the
    CUDA runtime, and vLLM then forked its engine core. Asked through NVML instead, and
    nowhere else in the package."""
    import re
    from pathlib import Path

    import torch

    import graphtap
    from graphtap.devices import NVML_CHECK, has_gpu

    seen = []
    monkeypatch.delenv(NVML_CHECK, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: seen.append(
        __import__("os").environ.get(NVML_CHECK)) or True)
    assert has_gpu() and seen == ["1"] and NVML_CHECK not in __import__("os").environ
    root = Path(graphtap.__file__).parent
    callers = [p.relative_to(root).as_posix() for p in root.rglob("*.py")
               if re.search(r"cuda\.is_available\(", p.read_text())]
    assert callers == ["devices.py"], callers


def _harvest_args(*extra):
    from types import SimpleNamespace

    args = dict(sites=["blocks.1.hook_resid_post"], sink_memory_gb=4.0, compile=False,
                prefill_graphs=None, step_tokens=2048)
    for key, value in extra:
        args[key] = value
    return SimpleNamespace(**args)


def test_harvest_engine_on_a_gpu_and_without_one():
    """`graphtap harvest` ran the tests' CPU settings on a GPU too (float32 weights, 16
    sequences, eager), and prefill steps larger than vLLM's 512-token graphs ran without
    graphs there (benchmarks/results, llama3-8b-sink-overlap and
    llama3-8b-prefill-graphs: the host paced them). On a GPU: the model's dtype, 256
    sequences, steps of --step-tokens, compiled with graphs up to that budget unless
    --no-prefill-graphs; without a GPU eager, and --prefill-graphs is refused, naming
    the flag."""
    import pytest

    from graphtap.cli import harvest_engine
    from graphtap.graph_sizes import prefill_graph_sizes

    cpu = harvest_engine(_harvest_args(), "/s", gpu=False)
    assert cpu == {"eager": True, "hook_manager": "graphtap", "hook_config": {
        "sites": ["blocks.1.hook_resid_post"], "sink_dir": "/s",
        "sink_max_queued_bytes": 4 << 30}}
    gpu = harvest_engine(_harvest_args(("step_tokens", 4096)), "/s", gpu=True)
    assert not gpu["eager"] and gpu["dtype"] == "auto"
    assert gpu["max_num_batched_tokens"] == 4096
    assert gpu["compilation_config"]["cudagraph_capture_sizes"] == prefill_graph_sizes(4096)
    eager = harvest_engine(_harvest_args(("prefill_graphs", False)), "/s", gpu=True)
    assert eager["eager"] and "compilation_config" not in eager
    with pytest.raises(SystemExit, match="--prefill-graphs needs a GPU"):
        harvest_engine(_harvest_args(("prefill_graphs", True)), "/s", gpu=False)
    with pytest.raises(SystemExit, match="--step-tokens"):
        harvest_engine(_harvest_args(("step_tokens", 0)), "/s", gpu=True)
