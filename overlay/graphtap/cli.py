"""The `graphtap` command."""
from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="graphtap", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="generate with the patched engine on an embedded tiny model")
    demo.add_argument("--model", choices=["llama", "qwen2"], default="llama")
    demo.add_argument("--eager", action="store_true", help="skip torch.compile (faster start)")
    args = ap.parse_args(argv)
    if args.cmd == "demo":
        from graphtap.demo import run_demo

        return run_demo(args.model, eager=args.eager)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
