#!/usr/bin/env bash
# Creates .venv (if missing) and installs replaykv into it.
# Usage: scripts/install.sh [extras]   e.g. scripts/install.sh serve,test
# torch is installed first at the pinned build so pip does not pull a multi-GB CUDA build;
# the package itself only asks for a range. REPLAYKV_TORCH_INDEX_URL names the wheel index torch
# comes from (e.g. https://download.pytorch.org/whl/cpu); unset, pip's configured index is used.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-serve}"
python3 -m venv .venv 2>/dev/null || true
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
torch_index=()
if [ -n "${REPLAYKV_TORCH_INDEX_URL:-}" ]; then
    torch_index=(--index-url "$REPLAYKV_TORCH_INDEX_URL")
fi
python -c "import torch" 2>/dev/null || python -m pip install -q "${torch_index[@]}" "torch==2.13.0"
python -m pip install -q -e ".[${extras}]"
