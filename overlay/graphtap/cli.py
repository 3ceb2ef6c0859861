"""The `graphtap` command.

    graphtap serve MODEL [--sites S ...] [--hook-config JSON] [vllm serve arguments...]
    graphtap sites MODEL [--json]
    graphtap demo [--model llama|qwen2] [--eager]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from graphtap.runner_info import WORKER_EXTENSION


def serve_argv(model: str, sites: list[str] | None, hook_config: str | None,
               rest: list[str]) -> list[str]:
    """`vllm serve` with graphtap's hook manager and sites in its hook_config."""
    config = json.loads(hook_config) if hook_config else {}
    if sites:
        config["sites"] = sites
    # The runner probe (GET /v1/graphtap/stats reads the workers through it), unless the
    # caller brings a worker extension of their own.
    probe = [] if any(a.startswith("--worker-extension-cls") for a in rest) else \
        ["--worker-extension-cls", WORKER_EXTENSION]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model,
            "--hook-manager", "graphtap", "--hook-config", json.dumps(config), *probe, *rest]


def _serve(args, rest: list[str]) -> int:
    argv = serve_argv(args.model, args.sites, args.hook_config, rest)
    env = dict(os.environ)
    if "TRITON_INTERPRET" not in env and not _has_gpu():
        env["TRITON_INTERPRET"] = "1"  # Model Runner V2's kernels on a CPU (patch 0001)
    os.execvpe(argv[0], argv, env)
    return 1


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="graphtap", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="generate with the patched engine on an embedded tiny model")
    demo.add_argument("--model", choices=["llama", "qwen2"], default="llama")
    demo.add_argument("--eager", action="store_true", help="skip torch.compile (faster start)")
    serve = sub.add_parser("serve", help="vllm serve MODEL with graphtap's hook manager; "
                                         "other arguments go to vllm serve")
    serve.add_argument("model")
    serve.add_argument("--sites", nargs="+", help="hook sites that get ops (default: every "
                                                  "residual site), e.g. 'blocks.*.hook_resid_post'")
    serve.add_argument("--hook-config", help="JSON hook_config (--sites replaces its sites)")
    sites = sub.add_parser("sites", help="every hook site of a model with its row shape")
    sites.add_argument("model", help="a model directory (or a name already in the HF cache)")
    sites.add_argument("--json", action="store_true")
    args, rest = ap.parse_known_args(argv)
    if args.cmd != "serve" and rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "demo":
        from graphtap.demo import run_demo

        return run_demo(args.model, eager=args.eager)
    if args.cmd == "serve":
        return _serve(args, rest)
    return _sites(args)


if __name__ == "__main__":
    raise SystemExit(main())
