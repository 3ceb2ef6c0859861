#!/usr/bin/env bash
# On the GPU host (no package index): make the graphtap overlay importable *with its
# entry point* (vllm.hook_managers -> graphtap), which a plain PYTHONPATH entry lacks.
#   source benchmarks/gpu/overlay_site.sh [SITE_DIR]     (default /tmp/gt-site)
# then run with PYTHONPATH=/tmp/vllm-site/patched:/tmp/vllm-site/deps:$GT_SITE
GT_SITE=${1:-/tmp/gt-site}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
rm -rf "$GT_SITE" && mkdir -p "$GT_SITE/graphtap-0.1.0.dist-info"
cp -r "$repo/overlay/graphtap" "$GT_SITE/"
printf 'Metadata-Version: 2.1\nName: graphtap\nVersion: 0.1.0\n' > "$GT_SITE/graphtap-0.1.0.dist-info/METADATA"
printf '[vllm.hook_managers]\ngraphtap = graphtap.seam:GraphtapHookManager\n' \
  > "$GT_SITE/graphtap-0.1.0.dist-info/entry_points.txt"
export GT_SITE
