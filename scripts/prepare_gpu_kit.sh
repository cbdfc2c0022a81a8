#!/usr/bin/env bash
# Prepares the offline kit that scripts/gpu_check.sh needs on a GPU machine whose Python has
# CUDA torch but no network and no megatron-core: the megatron-core 0.16.1 wheel for that
# Python (2.6 MB) and, when available here, the parallel build script of the C++ core.
#
#   bash scripts/prepare_gpu_kit.sh [KIT=.gpu_kit] [PYVER=3.12]
#
# .gpu_kit/ is git-ignored: copy or carry it with the checkout (well under 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=${1:-.gpu_kit}
PYVER=${2:-3.12}
mkdir -p "$KIT/whl"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$KIT/whl" \
  "megatron-core==0.16.1"
# The parallel compile of csrc/ (setup.py's serial build is the fallback there).
SHARED=${SKRULL_GPU_SHARED:-/work/shared/gpu}
if [ -f "$SHARED/build_ext.sh" ]; then cp "$SHARED/build_ext.sh" "$KIT/"; fi
# The commit being copied (a copied checkout's .git may be stale): gpu_check.sh exports it as
# SKRULL_COMMIT for the reports. Rewrite it when you copy a newer checkout.
git rev-parse HEAD > "$KIT/commit" 2>/dev/null || true
echo "kit in $KIT ($(du -sh "$KIT" | cut -f1)): $(cd "$KIT" && ls whl/* ./*.sh 2>/dev/null | tr '\n' ' ')"
