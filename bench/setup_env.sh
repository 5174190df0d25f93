#!/usr/bin/env bash
# Install the benchmark-only dependencies (DeepSpeed + its pure-Python deps)
# into the CURRENT Python environment without touching torch.
# Idempotent: re-running is a no-op when everything is already installed.
#
#   bash bench/setup_env.sh            # uses `python` on PATH
#   PYTHON=/path/to/python bash bench/setup_env.sh
#   DS_VERSION=0.19.8 bash bench/setup_env.sh
#   BENCH_PREBUILD=all bash bench/setup_env.sh   # also JIT-build cpu_adam + CPU fused_adam
#
# BENCH_PREBUILD (default "shm"): which DeepSpeed C++ ops to JIT-compile now
# into the torch extensions cache (~/.cache/torch_extensions/py311_cpu), so the
# first benchmark run does not pay for it (~1-2 min each on 2 cores):
#   none | shm (deepspeed_shm_comm: built by every deepspeed init on CPU)
#   | all (shm + cpu_adam for ZeRO-Offload + fused_adam for a DS-config optimizer)
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
BENCH_PREBUILD="${BENCH_PREBUILD:-shm}" DS_ACCELERATOR=cpu "$PYTHON" - <<'PY'
import os, time
import torch, deepspeed
from deepspeed.accelerator import get_accelerator
acc = get_accelerator()
print(f"setup_env.sh: OK torch {torch.__version__}, deepspeed {deepspeed.__version__}, "
      f"accelerator {acc.device_name()}, comm backend {acc.communication_backend_name()}")
which = os.environ["BENCH_PREBUILD"]
ops = {"none": [], "shm": ["ShareMemCommBuilder"],
       "all": ["ShareMemCommBuilder", "CPUAdamBuilder", "FusedAdamBuilder"]}[which]
for name in ops:
    t0 = time.perf_counter()
    try:
        acc.create_op_builder(name).load(verbose=False)
        print(f"setup_env.sh: {name} ready ({time.perf_counter() - t0:.0f}s)")
    except Exception as e:  # not fatal: only the runs that need the op fail
        print(f"setup_env.sh: WARNING {name} failed to build: {type(e).__name__}: {e}")
PY
