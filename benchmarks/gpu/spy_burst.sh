#!/usr/bin/env bash
# Where the engine core's and the frontend's host time goes while bench_tpot runs bursts:
# py-spy samples both processes for SECONDS once the first measured run is out, without
# stopping them (--nonblocking); the bench then runs to its end. After the bundle's
# install (run_gpu.sh's notes):
#   BENCH_ARGS="--modes idle,hs --rates= --bursts 64 --input-len 256 --output-len 8 --reps 25" \
#     bash benchmarks/gpu/spy_burst.sh llama3-8b SECONDS PYSPY_WHEEL_DIR
# $OUT gets engine.txt and frontend.txt (py-spy's raw collapsed stacks, thread ids on),
# the bench's log and result; benchmarks/gpu/spy_report.py sums them per function.
# SPY_TIMELINE=1: the engine core as a timeline instead (engine.json.gz: py-spy's Chrome
# trace, waiting threads included), which benchmarks/gpu/spy_timeline.py reads per burst.
# SPY_GIL=1: the same trace holding only the thread that has the GIL at each sample (which
# thread a waiting busy loop waits for). Session 39's (H100, nonblocking, 20 s) got 5444
# samples of 20000 and 1066 errors: too few to place a step's waits; trace_summary.py of
# a --trace-modes burst said more.
set -euo pipefail
cd "$(dirname "$0")/../.."
model=$1 seconds=$2 wheels=$3
OUT=${OUT:?the folder that comes back}
python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy "$wheels"/*.whl
spy=/tmp/pyspy/bin/py-spy
bash benchmarks/gpu/run_gpu.sh "$model" graphtap > "$OUT/bench.log" 2>&1 &
bench=$!
until grep -q '"rate"' "$OUT/bench.log" 2>/dev/null; do  # the first measured run's line
  kill -0 $bench 2>/dev/null || { tail -20 "$OUT/bench.log"; exit 1; }
  sleep 2
done
frontend=$(pgrep -f 'benchmarks.gpu.bench_tpot' | head -1)
engine=$(pgrep -f 'EngineCore' | head -1 || true)
engine=${engine:-$(pgrep -P "$frontend" | head -1)}  # AsyncLLM's engine core process
record() {  # record NAME PID
  "$spy" record --nonblocking --threads --full-filenames -r 1000 -d "$seconds" -f raw \
    -o "$OUT/$1.txt" -p "$2" > "$OUT/spy-$1.log" 2>&1 || tail -5 "$OUT/spy-$1.log"
}
if [ "${SPY_TIMELINE:-0}" = 1 ] || [ "${SPY_GIL:-0}" = 1 ]; then
  which=$([ "${SPY_GIL:-0}" = 1 ] && echo --gil || echo --idle)
  "$spy" record --nonblocking --threads --full-filenames $which -r 1000 -d "$seconds" \
    -f chrometrace -o "$OUT/engine.json" -p "$engine" > "$OUT/spy-engine.log" 2>&1 &&
    gzip "$OUT/engine.json" || tail -5 "$OUT/spy-engine.log" &
else
  record engine "$engine" &
fi
spy_engine=$!
record frontend "$frontend"
wait $spy_engine
wait $bench || tail -20 "$OUT/bench.log"  # the bench runs its repetitions to the end
echo "runs logged: $(grep -c '"rate"' "$OUT/bench.log")"
