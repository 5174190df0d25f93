#!/usr/bin/env bash
# Install the benchmark-only dependencies (DeepSpeed + its pure-Python deps)
# into the CURRENT Python environment without touching torch.
# Idempotent: re-running is a no-op when everything is already installed.
#
#   bash bench/setup_env.sh            # uses `python` on PATH
#   PYTHON=/path/to/python bash bench/setup_env.sh
#   DS_VERSION=0.19.8 bash bench/setup_env.sh
set -euo pipefail

PYTHON="${PYTHON:-python}"
DS_VERSION="${DS_VERSION:-0.19.8}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

TORCH_VERSION="$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)"
if [[ -z "$TORCH_VERSION" ]]; then
    echo "setup_env.sh: torch is not importable with $PYTHON; install torch==2.13.0 first" >&2
    exit 1
fi

# Constraint file: pip may never replace the installed torch.
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==${TORCH_VERSION}" > "$CONSTRAINTS"

installed_ds="$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("deepspeed"))' 2>/dev/null || true)"

# 1) pure-Python requirements (cheap no-op when already satisfied)
"$PYTHON" -m pip install -q -c "$CONSTRAINTS" -r "$HERE/requirements.txt"

# 2) deepspeed itself, no deps, no prebuilt ops (JIT at first use)
if [[ "$installed_ds" != "$DS_VERSION" ]]; then
    echo "setup_env.sh: installing deepspeed==${DS_VERSION} (--no-deps, DS_BUILD_OPS=0)"
    DS_BUILD_OPS=0 "$PYTHON" -m pip install -q --no-deps -c "$CONSTRAINTS" "deepspeed==${DS_VERSION}"
else
    echo "setup_env.sh: deepspeed ${installed_ds} already installed"
fi

# 3) sanity checks: torch unchanged, deepspeed importable on the CPU accelerator
after="$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])')"
if [[ "$after" != "$TORCH_VERSION" ]]; then
    echo "setup_env.sh: torch changed from $TORCH_VERSION to $after!" >&2
    exit 1
fi
DS_ACCELERATOR=cpu "$PYTHON" - <<'PY'
import torch, deepspeed
from deepspeed.accelerator import get_accelerator
print(f"setup_env.sh: OK torch {torch.__version__}, deepspeed {deepspeed.__version__}, "
      f"accelerator {get_accelerator()._name}")
PY
