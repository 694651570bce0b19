#!/usr/bin/env bash
# The test command: creates .venv (if missing) with the CPU torch wheel on this machine's disk,
# installs gsm-train with its dev extra, and runs the whole suite. Fails on any failure and when
# no test is collected (pytest exit status 5).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0" -e ".[dev]"
exec .venv/bin/python -m pytest -q "$@"
