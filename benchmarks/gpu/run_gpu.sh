#!/usr/bin/env bash
# One step of the GPU measurement, after the offline bundle is installed in /tmp/vllm-site
# (see ../shared/gpu-bundle/README.md). Steps, each within the device's 10-minute limit:
#   check            graph parity + in-graph proof on a tiny model (patched)
#   sinkcheck        the bulk sink's rows under graphs equal per-request captures
#   stagecheck       the host rings (slot rows through UVA, the router's one-copy layout)
#                    with the device lagging the host (check_staging.py)
#   firststep        a burst's first hooked step, piece by piece (first_step_host.py;
#                    FIRST_ARGS="--samples 40 --label L")
#   routelaunch      a capturing step's routing launches and replays (route_launch.py;
#                    ROUTE_ARGS="--max-reqs 64,1024")
#   <model> stock    TPOT, stock vLLM wheel
#   <model> graphtap TPOT, patched wheel + graphtap (idle and steering alternate;
#                    BENCH_ARGS="--modes idle,hs,qk,mixed,dump ..." for the capture loads)
#   twin <model>     capture overhead on two engines side by side, mode vs idle at the same
#                    moment (bench_twin.py; TWIN_ARGS="--rates 4,16 --bursts 16,64 ...")
#   profile <model>  capture rows/s and host time per mode (profile_capture.py;
#                    PROFILE_ARGS="--modes idle,dump,idle" to narrow it)
#   serve <model>    vllm bench serve against a stock and a graphtap server
#                    (benchmarks/serve_bench.py; SERVE_ARGS="--num-prompts 24 ...")
#   report           merge results into benchmarks/results/tpot.md
# Results are written to $OUT (the device tool brings them back) and benchmarks/results.
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/gpu/overlay_site.sh /tmp/gt-site
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"; export OUT
DEPS=/tmp/vllm-site/deps
while [ $# -gt 0 ]; do
  case "$1" in
    check)  PYTHONPATH=/tmp/vllm-site/patched:$DEPS:$GT_SITE python3 -m benchmarks.gpu.check_graphs; shift ;;
    sinkcheck) PYTHONPATH=/tmp/vllm-site/patched:$DEPS:$GT_SITE python3 -m benchmarks.gpu.check_sink; shift ;;
    stagecheck) PYTHONPATH=/tmp/vllm-site/patched:$DEPS:$GT_SITE python3 -m benchmarks.gpu.check_staging; shift ;;
    firststep) PYTHONPATH=/tmp/vllm-site/patched:$DEPS:$GT_SITE python3 \
               -m benchmarks.gpu.first_step_host ${FIRST_ARGS:-}; shift ;;
    routelaunch) PYTHONPATH=/tmp/vllm-site/patched:$DEPS:$GT_SITE python3 \
               -m benchmarks.gpu.route_launch ${ROUTE_ARGS:-}; shift ;;
    report) python3 -m benchmarks.gpu.bench_tpot --report --out "$OUT"; shift ;;
    twin)   PYTHONPATH=/tmp/vllm-site/patched:$DEPS:$GT_SITE python3 \
               -m benchmarks.gpu.bench_twin --model "$2" --out "$OUT" ${TWIN_ARGS:-}; shift 2 ;;
    profile) PYTHONPATH=/tmp/vllm-site/patched:$DEPS:$GT_SITE python3 \
               -m benchmarks.gpu.profile_capture --model "$2" ${PROFILE_ARGS:-}; shift 2 ;;
    serve)  PYTHONPATH=$DEPS:$GT_SITE python3 -m benchmarks.serve_bench --model "$2" \
               --stock-path /tmp/vllm-site/stock:$DEPS \
               --graphtap-path /tmp/vllm-site/patched:$DEPS:$GT_SITE --out "$OUT" \
               ${SERVE_ARGS:---num-prompts 24}; shift 2 ;;
    *)      model=$1 variant=$2; shift 2
            site=/tmp/vllm-site/$([ "$variant" = stock ] && echo stock || echo patched)
            PYTHONPATH=$site:$DEPS:$GT_SITE python3 -m benchmarks.gpu.bench_tpot \
              --model "$model" --variant "$variant" --out "$OUT" ${BENCH_ARGS:-} ;;
  esac
done
