"""benchmarks/results/README.md, generated from the result files that
benchmarks/results/manifest.json lists (the latest per model and workload), never by hand:

    python -m benchmarks.results_readme           # rewrite it
    python -m benchmarks.results_readme --check   # exit 1 if it is out of date (a test)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.gpu.capture_report import merged, overheads, render, verdict
from benchmarks.gpu.tpot_stats import PHASES, ttft_by_position

RESULTS = Path(__file__).resolve().parent / "results"


def _check(group: dict) -> str:
    d = json.loads((RESULTS / group["files"][0]).read_text())
    c = d["captures"]
    counters = d["compilation_counters_after"]
    rows = [("verdict", "ok" if d["ok"] else "FAILED"),
            ("runner", f"{d['runner']['runner_class']} ({d['runner']['cudagraph_mode']})"),
            ("greedy tokens, graphs vs eager graphtap", d["parity_graph_vs_eager"]),
            ("every steered request differs from its plain run", all(d["steered_requests_differ"])),
            ("no recompile or re-capture across request mixes", d["no_recompile_or_recapture"]),
            ("graphs captured / Inductor compiles",
             f"{counters['num_cudagraph_captured']} / {counters['num_inductor_compiles']}"),
            ("steer op's Python body during runs",
             d.get("steer_op_python_calls_during_runs", "–")),
            ("captures complete, no error", c["complete"] and c["error"] is None),
            ("pattern vs softmax(qk^T), max abs", f"{c['pattern_vs_softmax_qk_max_abs']:.1e}"),
            ("residual rows graph vs eager, max rel", f"{c['resid_graph_vs_eager_max_rel']:.2%}")]
    sc = d.get("scores")
    if sc is not None:  # issue 17's families, from session 11 on
        rows += [("probe scores graph vs eager, max rel",
                  f"{sc['probe_graph_vs_eager_max_rel']:.2%}"),
                 ("attention mass graph vs eager, max abs",
                  f"{sc['mass_graph_vs_eager_max_abs']:.1e}"),
                 ("attention mass over spans covering every key, |sum - 1|",
                  f"{sc['mass_rows_sum_to_one']:.1e}"),
                 ("focus guard verdict delivered", sc["guard"] is not None),
                 ("open conditional gate steers, as in eager",
                  sc["open_gate_steers"] and sc["open_gate_equals_eager"]),
                 ("shut conditional gate: tokens of the plain run", sc["shut_gate_equals_plain"])]
    return "| check | result |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)


def _tpot(group: dict) -> str:
    runs = {}
    for name in group["files"]:
        d = json.loads((RESULTS / name).read_text())
        for mode, by_rate in d["summary_tpot_ms"].items():
            variant = "stock" if d["variant"] == "stock" else f"graphtap {mode}"
            runs[(d["model"], variant)] = by_rate
    loads = sorted({k for by_rate in runs.values() for k in by_rate},
                   key=lambda k: (k.startswith("burst"), float(k.removeprefix("burst"))))
    heads = [f"{k[5:]} at once" if k.startswith("burst") else f"{k} req/s" for k in loads]
    lines = ["| model | variant | " + " | ".join(heads) + " |", "|---|---|" + "---|" * len(loads)]
    for (model, variant), by_rate in sorted(runs.items()):
        base = runs.get((model, "stock"), {})
        cells = [f"{by_rate[k]:.2f} ms" + (f" ({(by_rate[k] / base[k] - 1) * 100:+.1f} %)"
                                           if variant != "stock" and k in base else "")
                 if k in by_rate else "–" for k in loads]
        lines.append(f"| {model} | {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _capture(group: dict) -> str:
    result, models = merged([RESULTS / f for f in group["files"]], ci=True)
    keep, drop = group.get("modes"), {tuple(cell) for cell in group.get("drop", [])}
    for key in ("summary_overhead_vs_idle_pct", "summary_overhead_vs_idle_pct_engine"):
        if key in result:  # modes shown, and (mode, load) cells a later group supersedes
            result[key] = {m: {k: c for k, c in cells.items() if (m, k) not in drop}
                           for m, cells in result[key].items() if not keep or m in keep}
    out = render(result, models) + "\n" + verdict(overheads(result))
    if "summary_overhead_vs_idle_pct_engine" in result:
        out += ("\nOn the engine core's clock (output timestamps, the client's delays left "
                "out):\n\n" + render(result, models, engine=True))
    return out


def _profile(group: dict) -> str:
    lines = ["| file | mode | rows | rows/s | MB/s | TTFT median | graphtap host ms/step |",
             "|---|---|---|---|---|---|---|"]
    for name in group["files"]:
        d = json.loads((RESULTS / name).read_text())
        for m in d["modes"]:
            host = sum(m.get("graphtap_host_ms_per_step", {}).values())
            ttft = m.get("ttft_ms_median")
            lines.append(f"| {name} | {m['mode']} | {m['rows']} | {m['rows_per_s']:,.0f} | "
                         f"{m['MB_per_s']:.1f} | {'–' if ttft is None else f'{ttft:.0f} ms'} | "
                         f"{host:.3f} |")
    return "\n".join(lines) + "\n"


def _soak(group: dict) -> str:
    lines = ["| file | requests | checked | left mid-stream | 5xx | 4xx | tokens differ | "
             "rows checked | lost | misattributed | held at end | preemptions | "
             "host RSS growth | seconds |", "|---" * 14 + "|"]
    for name in group["files"]:
        d = json.loads((RESULTS / name).read_text())
        growth = f"{d['host_rss_growth_mib']:+.0f} MiB of {d['host_rss_mib']:.0f}"
        if d.get("device_growth_mib") is not None:
            growth += f"; device {d['device_growth_mib']:+.0f} MiB"
        lines.append(f"| {name} | {d['requests']:,} | {d['checked']:,} | "
                     f"{d['left_mid_stream']} | {d['status_5xx']} | {d['status_4xx']} | "
                     f"{d['tokens_differ']} | {d['rows_checked']:,} | {d['rows_lost']} | "
                     f"{d['rows_misattributed']} | {len(d['held_at_end'])} | "
                     f"{'–' if d.get('preemptions') is None else d['preemptions']} | "
                     f"{growth} | {d['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def _kernels(group: dict) -> str:
    d = json.loads((RESULTS / group["files"][0]).read_text())
    rows = [(k, f"{v:.1e}") for k, v in d.items() if isinstance(v, float)]
    return ("| kernel vs torch reference | max difference |\n|---|---|\n" +
            "".join(f"| {k} | {v} |\n" for k, v in rows) +
            f"| verdict | {'ok' if d['ok'] else 'FAILED'} on {d['device']} |\n")


def _demo(group: dict) -> str:
    d = json.loads((RESULTS / group["files"][0]).read_text())
    rows = [("command", f"`{d['command']}`"), ("model", d["model"]),
            ("runner", f"{d['runner']} on {d['gpu']}"),
            ("engine start", f"{d['engine_start_s']:.0f} s"),
            ("heads (layer, head)", ", ".join(f"L{l}H{h}" for l, h in d["heads"])),
            ("threshold (calibration midpoint)", f"{d['threshold']:.3f}")]
    for kind in ("benign", "injected"):
        scores = [r["focus"] for r in d["held_out"] if r["kind"] == kind]
        rows.append((f"held-out {kind} focus", ", ".join(f"{s:.3f}" for s in scores)))
    n = {k: sum(r["kind"] == k for r in d["held_out"]) for k in ("benign", "injected")}
    rows += [("injected stopped (finish_reason guard)", f"{d['caught']}/{n['injected']}"),
             ("benign let through", f"{d['passed']}/{n['benign']}")]
    return "| | |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)


def _sink(group: dict) -> str:
    """Per file and load: the sink's rows and bytes, its rates over the run (the engine's
    side), including the wait for the writer afterwards (in the page cache) and then for
    the disk (os.sync, where the run measured it), the machine's probes (median run of the
    repetitions), and TPOT vs idle paired per request (pooled over every repetition; the
    A/A control idle2 where the launch ran it).
    Before the staging memory (runs without its counter) the first repetition is left
    out: the host's pinned pool grew during it."""
    lines = ["| file | sites / token | in / out | load | rows / run | GB / run | rows/s (run) | "
             "GB/s (run) | % of D2H | GB/s incl. writer | GB/s to disk | D2H probe | "
             "disk probe | TPOT vs idle | A/A: idle2 vs idle | dump vs idle |",
             "|---" * 16 + "|"]
    for name in group["files"]:
        d = json.loads((RESULTS / name).read_text())
        over = d.get("summary_overhead_vs_idle_pct", {})
        link = d.get("link", {})
        sites = group["layers"][name]  # the launch's --sink-layers, as sites per token
        staged = any("sink.staged_total" in r.get("hook_counters", {}) for r in d["runs"])
        by_load: dict[str, list] = {}
        for r in d["runs"]:
            if r["mode"] == "sink" and (staged or r["rep"] > 0):
                by_load.setdefault(str(r["rate"]), []).append(r)
        for load, runs in by_load.items():
            med = sorted(runs, key=lambda r: r["sink_rows_per_s"])[len(runs) // 2]
            total = med["wall_s"] + med["sink_settle_s"]
            dump = over.get("dump", {}).get(load, {}).get("pooled")
            aa = over.get("idle2", {}).get(load, {}).get("pooled")
            d2h = link.get("d2h_gb_s", 0)
            # after the writer, os.sync (runs since session 17's last change)
            disk = f"{med['sink_gb_per_s_disk']:.2f}" if "sink_gb_per_s_disk" in med else "–"
            lines.append(
                f"| {name} | {sites} | {d['input_len']} / {d['output_len']} | "
                f"{load.replace('burst', '')} at once | "
                f"{med['sink_rows']:,} | {med['sink_bytes'] / 1e9:.2f} | "
                f"{med['sink_rows_per_s']:,.0f} | {med['sink_gb_per_s']:.2f} | "
                f"{med['sink_gb_per_s'] / d2h:.0%} | "
                f"{med['sink_bytes'] / total / 1e9:.2f} | {disk} | {d2h:.1f} | "
                f"{link.get('disk_write_gb_s', 0):.2f} | "
                f"{over['sink'][load]['pooled']:+.1f} % | "
                f"{'–' if aa is None else f'{aa:+.1f} %'} | "
                f"{'–' if dump is None else f'{dump:+.1f} %'} |")
    return "\n".join(lines) + "\n"


def _sink_check(group: dict) -> str:
    d = json.loads((RESULTS / group["files"][0]).read_text())
    checks, stats = d["checks"], d["stats"]
    rows = [("verdict", "ok" if d["ok"] else "FAILED"), ("errors", len(d["errors"])),
            ("(request, site) checks, float32 and model dtype", len(checks)),
            ("every sunk position there once, in order",
             all(c["complete_once_in_order"] for c in checks)),
            ("rows equal to per-request captures",
             f"{sum(c['rows_equal'] for c in checks)} / {sum(c['rows'] for c in checks)}"),
            ("worst max rel vs per-request", d["worst_max_rel"]),
            ("non-finite values", sum(c["nonfinite"] for c in checks)),
            ("shards", d["shards"]), ("repeated positions", len(d["repeated"])),
            ("step copies into the staging memory / outside it",
             f"{stats['staged_total']} / {stats['unstaged_total']}")]
    return "| | |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)


def _first_step(group: dict) -> str:
    """first_step_host.py's pieces, cold and warm, one column pair per overlay."""
    d = json.loads((RESULTS / group["files"][0]).read_text())
    names = list(d["overlays"])
    lines = ["| workload | piece | " + " | ".join(f"{n} cold / warm (us)" for n in names) + " |",
             "|---" * (2 + len(names)) + "|"]
    runs = [{r["workload"]: r for r in d["overlays"][n]} for n in names]
    for workload, first in runs[0].items():
        for piece in first["cold_us"]:
            cells = [f"{r[workload]['cold_us'].get(piece, '–')} / "
                     f"{r[workload]['warm_us'].get(piece, '–')}" for r in runs]
            lines.append(f"| {workload} | {piece} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _trace_steps(group: dict) -> str:
    """trace_summary.py --json: per traced burst and step, the device's idle time and
    graphtap's share of it, with what else the busy loop ran meanwhile."""
    lines = ["| file | trace | step | span (ms) | device idle (ms) | of it graphtap's (ms) | "
             "the rest, most first (ms) |", "|---" * 7 + "|"]
    for name in group["files"]:
        d = json.loads((RESULTS / name).read_text())
        for t, s in ((t, s) for t in d["traces"] for s in t["steps"]):
            rest = sorted(((n, us) for n, us in s["idle_us_by_host"].items()
                           if not n.startswith("graphtap.")), key=lambda x: -x[1])[:3]
            lines.append(f"| {name} | {t['trace']} | {s['step'].split('_generation')[0]} | "
                         f"{s['span_ms']:.1f} | {s['device_idle_ms']:.2f} | "
                         f"{s['graphtap_ms']:.2f} | " +
                         ", ".join(f"{n} {us / 1e3:.2f}" for n, us in rest) + " |")
    return "\n".join(lines) + "\n"


def _ttft(group: dict) -> str:
    """Per file, load and mode: TTFT of bursts (tpot_stats.ttft_by_position)."""
    lines = ["| file | load | mode | reps | TTFT median (ms) | vs idle, paired by position "
             "(ms) [95 % interval over repetitions] | ms per admitted request | admit / queue / prefill / deliver (ms) | "
             "the same, paired vs idle (ms) |",
             "|---" * 9 + "|"]
    for name in group["files"]:
        d = json.loads((RESULTS / name).read_text())
        for load, modes in ttft_by_position(d["runs"]).items():
            for mode, f in modes.items():
                ci = f.get("paired_ci95_ms")
                paired = "–" if mode == "idle" else f"{f['paired_ms']:+.1f}" + (
                    f" [{ci[0]:+.1f}, {ci[1]:+.1f}]" if ci else "")
                ph = f["phases_ms"]  # recorded since the end of session 18
                phases = "–" if ph is None else " / ".join(f"{ph[k]:.1f}" for k in PHASES)
                pp = f["phases_paired_ms"]
                paired_phases = "–" if pp is None or mode == "idle" else \
                    " / ".join(f"{pp[k]:+.1f}" for k in PHASES)
                lines.append(f"| {name} | {load.replace('burst', '')} at once | {mode} | "
                             f"{f['reps']} | {f['median_ms']:.1f} | {paired} | "
                             f"{f['slope_ms']:.2f} | {phases} | {paired_phases} |")
    return "\n".join(lines) + "\n"


RENDER = {"sink": _sink, "sink-check": _sink_check, "ttft": _ttft, "demo": _demo, "check": _check, "tpot": _tpot,
          "capture": _capture, "profile": _profile, "soak": _soak, "kernels": _kernels,
          "first-step": _first_step, "trace-steps": _trace_steps}


def readme() -> str:
    manifest = json.loads((RESULTS / "manifest.json").read_text())
    parts = ["# Results: where things stand\n",
             "Generated by `python -m benchmarks.results_readme` from the files "
             "`manifest.json` lists: the latest result per model and workload (H200, bf16, "
             "vLLM 0.29.0 with graphtap's series; dummy weights of real architectures, 256 "
             "prompt / 128 output tokens unless a section says otherwise). Targets, from "
             "the capture issue: hidden states ≤ 2.5 % and Q/K ≤ 3.5 % TPOT over idle at "
             "every load. Sections marked CPU ran on the development machine (2 cores).\n"]
    for group in manifest["groups"]:
        files = ", ".join(f"`{f}`" for f in group["files"])
        where = "CPU run in session" if group.get("machine") == "cpu" else "Device session"
        parts.append(f"## {group['title']}\n\n{where} {group['session']}; {files}.\n\n"
                     f"{group['what']}\n\n{RENDER[group['kind']](group)}")
    return "\n".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    text, path = readme(), RESULTS / "README.md"
    if args.check:
        if path.read_text() != text:
            print(f"{path} is out of date: run python -m benchmarks.results_readme")
            return 1
        return 0
    path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
