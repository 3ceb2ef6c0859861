#!/usr/bin/env bash
# Run the README's test command (`make test`) and fail on anything but a clean pass.
# pytest exits 5 when it collected no tests; that is a failure here, like any non-zero code.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
make test
rc=$?
echo "ci: make test exited $rc after $(( $(date +%s) - start )) s"
if [ "$rc" -eq 5 ]; then echo "ci: pytest ran no tests: failing"; exit 1; fi
exit "$rc"
