#!/usr/bin/env bash
# Installs everything the test suite needs (redis-server included) and runs it.
# Extra arguments go to pytest, e.g. scripts/test.sh -m slow
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
  echo "installing redis-server and redis-cli (needed by the SWA pool and Redis Cluster tests)"
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools >/dev/null
  else
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools >/dev/null
  fi
fi
scripts/install.sh serve,test
. .venv/bin/activate
ruff check replaykv tests bench
mypy replaykv bench
python -m pytest -q --durations=30 "$@"
