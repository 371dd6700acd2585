#!/usr/bin/env bash
# Creates .venv (if missing) and installs replaykv into it.
# Usage: scripts/install.sh [extras]   e.g. scripts/install.sh serve,test
# torch is installed first at the pinned CPU build so pip does not pull a multi-GB CUDA build;
# the package itself only asks for a range.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-serve}"
python3 -m venv .venv 2>/dev/null || true
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[${extras}]"
