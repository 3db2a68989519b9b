#!/usr/bin/env bash
# Prepared GPU check of pdplug's GPU pack path: random bit-exact Triton cases, `pdplug bench plan
# --device cuda` on row sizes {128,256,576,656,1152,4096} x DCP {1,2,4,8} (+ HND head sub-rows),
# the stream-ordering test (a KV write queued behind torch.cuda._sleep) and `pdplug demo --device
# cuda`. Under 5 minutes on a GPU machine without a registry, from wheels brought along.
#
#   scripts/gpu_check/gpu_check.sh download [WHEEL_DIR]   # on a machine with PyPI (default
#                                                         # scripts/gpu_check/wheels)
#   scripts/gpu_check/gpu_check.sh run [--cpu] [--wheels DIR] [--out DIR]
#
# run: a venv (--system-site-packages: the machine's torch and triton) with the wheels and
# pdplug (editable, no deps) installed offline, then each step under a time limit; logs and
# JSON results in --out (default scripts/gpu_check/results/<time>), summary.txt last. Exit
# status 1 when a step fails. --cpu: the smoke mode (no venv, no install: the current
# interpreter, TRITON_INTERPRET=1, small shapes) that a test runs.
# Environment: PYTHON (interpreter, default python3), GPU_CHECK_VENV (venv path, default
# scripts/gpu_check/.venv), GPU_CHECK_BUDGET (seconds for all steps, default 280).
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
py=${PYTHON:-python3}

download() {
    local dir=${1:-$here/wheels}
    mkdir -p "$dir"
    # CPython 3.12 manylinux x86_64 wheels only; torch and triton are on the GPU machine
    # already (nixl-cu13 names torch as a dependency: fetched without its dependencies)
    local common=(--only-binary=:all: --python-version 3.12 --implementation cp
                  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d "$dir")
    "$py" -m pip download "${common[@]}" "msgspec>=0.18" "pyzmq>=25.1" "pluggy>=1.5" \
        "click>=8.2" "rich>=13.7" "numpy>=1.26" "setuptools>=69" wheel "pytest>=8" \
        "pytest-timeout>=2.3" || return 1
    "$py" -m pip download "${common[@]}" --no-deps "nixl-cu13==1.5.1" || return 1
    ls -l "$dir"
    du -sh "$dir"
}

run() {
    local cpu=0 wheels=$here/wheels out=""
    while [ $# -gt 0 ]; do
        case $1 in
            --cpu) cpu=1 ;;
            --wheels) wheels=$2; shift ;;
            --out) out=$2; shift ;;
            *) echo "unknown option $1" >&2; return 2 ;;
        esac
        shift
    done
    out=${out:-$here/results/$(date +%Y%m%d-%H%M%S)}
    mkdir -p "$out"
    local budget=${GPU_CHECK_BUDGET:-280} start=$SECONDS
    local failed=() PY PDPLUG
    log() { echo "[$((SECONDS - start))s] $*" | tee -a "$out/summary.txt"; }
    step() {  # step NAME LIMIT_S CMD...: run under the limit (and the budget left), log it
        local name=$1 limit=$2 left rc
        shift 2
        left=$((budget - (SECONDS - start)))
        [ "$limit" -gt "$left" ] && limit=$left
        if [ "$limit" -le 5 ]; then
            log "FAIL $name: no time left of the ${budget}s budget"
            failed+=("$name")
            return
        fi
        log "== $name (limit ${limit}s): $*"
        timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
        rc=$?
        tail -n 30 "$out/$name.log"
        if [ $rc -eq 0 ]; then
            log "PASS $name"
        else
            [ $rc -eq 124 ] && rc="$rc (timed out)"
            log "FAIL $name: exit $rc (log $out/$name.log)"
            failed+=("$name")
        fi
    }
    if [ $cpu -eq 1 ]; then
        export TRITON_INTERPRET=1
        PY=$py
    else
        local venv=${GPU_CHECK_VENV:-$here/.venv}
        log "== install into $venv from $wheels (offline)"
        [ -d "$wheels" ] || { log "FAIL install: no wheel folder $wheels (run download)"; return 1; }
        "$py" -m venv --system-site-packages "$venv" || { log "FAIL install: venv"; return 1; }
        PY=$venv/bin/python
        local pip=("$PY" -m pip install --quiet --no-index --find-links "$wheels")
        local pkgs=(msgspec pyzmq pluggy click rich pytest pytest-timeout)
        "$PY" -c "import numpy" 2>/dev/null || pkgs+=(numpy)
        "${pip[@]}" "${pkgs[@]}" >"$out/install.log" 2>&1 &&
            "${pip[@]}" --no-deps nixl-cu13 >>"$out/install.log" 2>&1 &&
            "${pip[@]}" --no-deps -e "$repo" >>"$out/install.log" 2>&1 ||
            { tail -n 20 "$out/install.log"; log "FAIL install (log $out/install.log)"; return 1; }
        log "PASS install"
    fi
    PDPLUG=$(dirname "$PY")/pdplug
    [ -x "$PDPLUG" ] || PDPLUG=$(command -v pdplug)
    "$PY" - >"$out/env.txt" 2>&1 <<'PYEOF'
import importlib, platform
import torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
for m in ("triton", "numpy", "msgspec", "zmq", "pluggy", "nixl_cu13", "nixl_cu12", "nixl"):
    try:
        print(m, getattr(importlib.import_module(m), "__version__", "importable"))
    except ImportError as e:
        print(m, "missing:", e)
from pdplug_nixl.engine import import_nixl
try:
    print("import_nixl ->", import_nixl().__name__)
except ImportError as e:
    print("import_nixl -> missing:", e)
PYEOF
    cat "$out/env.txt"
    if [ $cpu -eq 1 ]; then
        step check_pack 240 "$PY" "$here/check_pack.py" --device cpu --quick \
            --out "$out/check_pack.json"
        local small=(--cached 1024 --unique 1000 --chunk-bound 512 --layers 2 --pack-layers 2
                     --repeats 2 --pack-repeats 2 --prep-repeats 5 --page 16)
        step bench_plan 120 "$PDPLUG" bench plan "${small[@]}" --row-bytes 128,656 --dcp 1,2 \
            --json "$out/bench_plan.json"
        step bench_plan_hnd 60 "$PDPLUG" bench plan "${small[@]}" --layout hnd --tp 1:2 \
            --kv-heads 4 --head-bytes 64 --dcp 2 --json "$out/bench_plan_hnd.json"
    else
        step check_pack 90 "$PY" "$here/check_pack.py" --device cuda --out "$out/check_pack.json"
        step bench_plan 120 "$PDPLUG" bench plan --device cuda --row-bytes \
            128,256,576,656,1152,4096 --dcp 1,2,4,8 --repeats 20 --pack-repeats 15 \
            --json "$out/bench_plan.json"
        step bench_plan_hnd 30 "$PDPLUG" bench plan --device cuda --layout hnd --tp 1:2 \
            --head-bytes 256 --dcp 2,4 --repeats 20 --pack-repeats 15 \
            --json "$out/bench_plan_hnd.json"
        step ordering 60 "$PY" -m pytest -x -q -rs -p no:cacheprovider \
            "$repo/tests/transfer/test_transfer_ordering.py" -k gpu
        step demo 60 "$PDPLUG" demo --device cuda --requests 4
    fi
    if [ ${#failed[@]} -gt 0 ]; then
        log "RESULT: FAILED (${failed[*]}) in $((SECONDS - start))s; results in $out"
        return 1
    fi
    log "RESULT: all steps passed in $((SECONDS - start))s; results in $out"
}

case ${1:-} in
    download) shift; download "$@" ;;
    run) shift; run "$@" ;;
    *) sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
