# The two commands of the README. Both set up .venv first (idempotent).
VENV := .venv/bin
# CPU only: Triton's interpreter runs Model Runner V2's kernels where there is no GPU.
ifeq ($(shell command -v nvidia-smi),)
export TRITON_INTERPRET ?= 1
endif

.PHONY: setup demo test wheel verify bench
setup:
	bash scripts/setup_env.sh

demo: setup
	$(VENV)/graphtap demo

test: setup
	$(VENV)/python -m pytest tests -q

wheel: setup
	$(VENV)/python scripts/build_patched_wheel.py --out dist

verify: setup
	for w in dist/vllm*+graphtap.*.whl; do $(VENV)/python scripts/verify_wheel.py $$w || exit 1; done

bench: setup
	$(VENV)/python -m pytest benchmarks/cpu -q --benchmark-only -p no:cacheprovider
