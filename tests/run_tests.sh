#!/usr/bin/env bash
# The test command: creates .venv (if missing) with the CPU torch wheel on this machine's disk,
# installs gsm-train with its dev extra, checks lint and format with ruff (pyproject.toml's
# [tool.ruff]; `.venv/bin/ruff format . && .venv/bin/ruff check --fix .` repairs most), and runs the
# whole suite, then the Triton kernels' tests
# under Triton's interpreter where no GPU runs them; given arguments, it runs pytest with those
# instead. Fails on any failure and when no test is collected (pytest exit status 5).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0" -e ".[dev]"
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest -q -n auto  # one worker per core (pytest-xdist); tests/conftest.py splits torch's threads
if .venv/bin/python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  exit 0  # the suite ran the Triton kernels' tests on the GPU
fi
# Without a GPU the suite skips the Triton kernels' tests: run them under Triton's interpreter on the CPU
# (the same kernels and checks; a few minutes, one worker per core: they are independent), without the
# interpreter's own numpy warnings (thousands).
TRITON_INTERPRET=1 exec .venv/bin/python -m pytest -q -n auto -m triton_kernels -W "ignore:::triton.runtime.interpreter"
