#!/usr/bin/env bash
# Install the benchmark-only dependencies (DeepSpeed + its pure-Python deps,
# Megatron-Core for bench/tp_megatron.py) into the CURRENT Python environment
# without touching torch.
# Idempotent: re-running is a no-op when everything is already installed.
#
#   bash bench/setup_env.sh            # uses `python` on PATH
#   PYTHON=/path/to/python bash bench/setup_env.sh
#   DS_VERSION=0.19.8 bash bench/setup_env.sh
#   MCORE_VERSION=0.16.1 bash bench/setup_env.sh   # megatron-core (0.17+ needs Python >= 3.12)
#   BENCH_PREBUILD=all bash bench/setup_env.sh   # also JIT-build cpu_adam + CPU fused_adam (+ async_io)
#   BENCH_AIO=0 bash bench/setup_env.sh          # do not apt-get install libaio-dev
#
# BENCH_PREBUILD (default "shm"): which DeepSpeed C++ ops to JIT-compile now
# into the torch extensions cache (~/.cache/torch_extensions/py311_cpu), so the
# first benchmark run does not pay for it (~1-2 min each on 2 cores):
#   none | shm (deepspeed_shm_comm: built by every deepspeed init on CPU)
#   | all (shm + cpu_adam for ZeRO-Offload + fused_adam for a DS-config optimizer
#          + async_io and pin_memory for NVMe offload, bench/zero3_nvme.py; async_io is
#          skipped with a warning when libaio's headers are missing)
#
# BENCH_AIO (default 1): DeepSpeed's NVMe offload (offload_param/offload_optimizer
# device "nvme") needs its async_io op, which links libaio: install the Debian/Ubuntu
# package libaio-dev with apt-get (as root, or through sudo -n) when its header
# /usr/include/libaio.h is missing. Nothing happens when it is already there.
set -euo pipefail

PYTHON="${PYTHON:-python}"
DS_VERSION="${DS_VERSION:-0.19.8}"
MCORE_VERSION="${MCORE_VERSION:-0.16.1}"
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
installed_mcore="$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("megatron-core"))' 2>/dev/null || true)"

# 1) pure-Python requirements (cheap no-op when already satisfied)
"$PYTHON" -m pip install -q -c "$CONSTRAINTS" -r "$HERE/requirements.txt"

# 2) deepspeed itself, no deps, no prebuilt ops (JIT at first use)
if [[ "$installed_ds" != "$DS_VERSION" ]]; then
    echo "setup_env.sh: installing deepspeed==${DS_VERSION} (--no-deps, DS_BUILD_OPS=0)"
    DS_BUILD_OPS=0 "$PYTHON" -m pip install -q --no-deps -c "$CONSTRAINTS" "deepspeed==${DS_VERSION}"
else
    echo "setup_env.sh: deepspeed ${installed_ds} already installed"
fi

# 2b) megatron-core (bench/tp_megatron.py only), no deps: its runtime requirements are
#     just numpy and packaging>=24.2 (the rest of requires_dist are extras: TE, apex, ...).
if [[ "$installed_mcore" != "$MCORE_VERSION" ]]; then
    echo "setup_env.sh: installing megatron-core==${MCORE_VERSION} (--no-deps)"
    "$PYTHON" -m pip install -q -c "$CONSTRAINTS" numpy "packaging>=24.2"
    "$PYTHON" -m pip install -q --no-deps -c "$CONSTRAINTS" "megatron-core==${MCORE_VERSION}"
else
    echo "setup_env.sh: megatron-core ${installed_mcore} already installed"
fi

# 2c) libaio-dev for DeepSpeed's async_io op (NVMe offload; bench/zero3_nvme.py only)
if [[ "${BENCH_AIO:-1}" == "1" ]]; then
    if [[ -f /usr/include/libaio.h ]]; then
        echo "setup_env.sh: libaio-dev already installed"
    elif command -v apt-get >/dev/null 2>&1; then
        SUDO=""
        if [[ "$(id -u)" != "0" ]]; then
            if sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO="none"; fi
        fi
        if [[ "$SUDO" == "none" ]]; then
            echo "setup_env.sh: WARNING libaio-dev missing and no root/sudo: DeepSpeed NVMe offload will not build" >&2
        else
            echo "setup_env.sh: installing libaio-dev (apt-get)"
            $SUDO env DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -q libaio-dev >/dev/null \
                || { $SUDO timeout 300 apt-get update -qq && \
                     $SUDO env DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -q libaio-dev >/dev/null; } \
                || echo "setup_env.sh: WARNING apt-get install libaio-dev failed: DeepSpeed NVMe offload will not build" >&2
        fi
    else
        echo "setup_env.sh: WARNING no apt-get: install libaio's headers (libaio-devel / libaio) for DeepSpeed NVMe offload" >&2
    fi
fi

# 3) sanity checks: torch unchanged, deepspeed importable on the CPU accelerator,
#    megatron-core's tensor_parallel importable
after="$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])')"
if [[ "$after" != "$TORCH_VERSION" ]]; then
    echo "setup_env.sh: torch changed from $TORCH_VERSION to $after!" >&2
    exit 1
fi
"$PYTHON" -W ignore -c 'import megatron.core, megatron.core.tensor_parallel; print(f"setup_env.sh: OK megatron-core {megatron.core.__version__}")'
BENCH_PREBUILD="${BENCH_PREBUILD:-shm}" DS_ACCELERATOR=cpu "$PYTHON" - <<'PY'
import os, time
import torch, deepspeed
from deepspeed.accelerator import get_accelerator
acc = get_accelerator()
print(f"setup_env.sh: OK torch {torch.__version__}, deepspeed {deepspeed.__version__}, "
      f"accelerator {acc.device_name()}, comm backend {acc.communication_backend_name()}")
which = os.environ["BENCH_PREBUILD"]
ops = {"none": [], "shm": ["ShareMemCommBuilder"],
       "all": ["ShareMemCommBuilder", "CPUAdamBuilder", "FusedAdamBuilder", "AsyncIOBuilder"]}[which]
for name in ops:
    t0 = time.perf_counter()
    try:
        builder = acc.create_op_builder(name)
        if name == "AsyncIOBuilder" and not builder.is_compatible(verbose=False):
            print("setup_env.sh: WARNING AsyncIOBuilder skipped: libaio (io_submit) not found; "
                  "DeepSpeed NVMe offload unavailable")
            continue
        builder.load(verbose=False)  # AsyncIOBuilder also builds + loads pin_memory first
        print(f"setup_env.sh: {name} ready ({time.perf_counter() - t0:.0f}s)")
    except Exception as e:  # not fatal: only the runs that need the op fail
        print(f"setup_env.sh: WARNING {name} failed to build: {type(e).__name__}: {e}")
PY
