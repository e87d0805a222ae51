#!/usr/bin/env bash
# GPU check: every test that needs a CUDA GPU, plus the GPU benchmark, in one command.
# Run on a host with an NVIDIA GPU (driver 12.8+, dma-buf and VMM support), Rust, and the
# test venv (`scripts/test` makes it; torch there is a CUDA build). Not run in CI (no GPU).
#
#   scripts/gpu-check.sh [BENCH_MIB]        # ~3-4 minutes on an H200 from a warm cargo cache
#
# A GPU host without Rust or the venv (a lent machine that reaches no registry): build here with
# `scripts/gpu-check-pack.sh` (it puts the binaries and a crc32c wheel in .gpucheck/), copy the
# checkout with .gpucheck/ there, and run `GPU_CHECK_BIN=.gpucheck GPU_CHECK_PYTHON=python3
# scripts/gpu-check.sh`: the python named needs numpy, pytest, torch (CUDA) and cuda-bindings.
#
# Steps (each prints PASS/FAIL; every step runs, the exit status is 1 if any failed, so one run
# on a scarce machine says all it can):
#   1. shardwire gpus: the probe lists a usable device and `auto` chooses CUDA memory.
#   2. cargo test -p shardwire-gpu -- --ignored: VMM region + fd/dma-buf export, the CRC
#      kernel against crc-fast, the gather kernel against the CPU reference (between regions,
#      and a batch assembled inside one region), H2D staging, the service's GPU self-test.
#   3. gpu_bench (release): gather GB/s against cuMemcpyDtoD, CRC GB/s, H2D staging GB/s;
#      the JSON lands in target/gpu-check/bench.json (copy the figures to docs/BENCHMARKS.md).
#   4. pytest tests/e2e/test_cuda_sdk.py and test_cuda_e2e.py: the Python SDK imports a VMM
#      region (cuda-python) and torch.from_dlpack gives a GPU tensor without a copy; the node
#      with memory = "cuda" end to end into torch (receive host and devmem-sim, and batch
#      mode: shuffled batches assembled by the gather kernel, byte-exact in torch).
#   5. Lanes, on a host with several GPUs: `shardwire topology` (the GPUs, NICs and pairing the
#      node plans from this host's sysfs tree, saved to target/gpu-check/topology.{txt,json}),
#      and test_cuda_e2e.py's per-GPU lane test: one lane per GPU, a trainer on each GPU gets
#      its region there, tensors on cuda:i in torch, byte-exact (it must not skip here). A
#      failed topology fails the step and the lane test is not run (one verdict per step).
set -euo pipefail
cd "$(dirname "$0")/.."
MIB=${1:-256}
LOGS=${CARGO_TARGET_DIR:-target}/gpu-check
mkdir -p "$LOGS"
FAILED=0
pass() { echo "PASS $*"; }
fail() { echo "FAIL $*"; FAILED=1; }
START=$SECONDS
PY=${GPU_CHECK_PYTHON:-.venv/bin/python}

if [ -n "${GPU_CHECK_BIN:-}" ]; then
    # Prebuilt (scripts/gpu-check-pack.sh): the binaries, and the wheels the python lacks.
    BIN="$GPU_CHECK_BIN/shardwire"
    if [ -d "$GPU_CHECK_BIN/whl" ] && ! "$PY" -c 'import crc32c' 2>/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --target "$GPU_CHECK_BIN/site" "$GPU_CHECK_BIN"/whl/*.whl \
            || echo "warning: the wheels in $GPU_CHECK_BIN/whl did not install into $PY (step 4 needs crc32c)"
        export PYTHONPATH="$PWD/$GPU_CHECK_BIN/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    run_gpu_tests() {
        local rc=0 t
        for t in "$GPU_CHECK_BIN"/test-*; do "$t" --ignored --test-threads=1 || rc=1; done
        return $rc
    }
    run_gpu_bench() { "$GPU_CHECK_BIN/gpu_bench" "$MIB"; }
else
    cargo build -q --release -p shardwire -p shardwire-gpu --examples --bin shardwire
    BIN=${CARGO_TARGET_DIR:-target}/release/shardwire
    # --lib and cuda_gpu only: fake_driver.rs compiles the same suite in for its fake-libcuda child.
    run_gpu_tests() { cargo test -q --release -p shardwire-gpu --lib --test cuda_gpu -- --ignored --test-threads=1; }
    run_gpu_bench() { cargo run -q --release -p shardwire-gpu --example gpu_bench -- "$MIB"; }
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv 2>&1 | tee "$LOGS/nvidia-smi.txt" || true
BIN=$(realpath "$BIN")
"$BIN" gpus --json | tee "$LOGS/gpus.json" || true
grep -q '"memory": "cuda"' "$LOGS/gpus.json" && pass "1 probe: auto chooses CUDA memory" \
    || fail "1 probe: auto did not choose CUDA memory (see $LOGS/gpus.json)"

if run_gpu_tests >"$LOGS/tests.log" 2>&1; then
    grep 'test result' "$LOGS/tests.log"
    grep -q 'test result: ok. 6 passed' "$LOGS/tests.log" && pass "2 GPU tests" || fail "2 GPU tests (expected 6 passed)"
else
    cat "$LOGS/tests.log"
    fail "2 GPU tests (see $LOGS/tests.log)"
fi

if run_gpu_bench >"$LOGS/bench.json" 2>"$LOGS/bench.err"; then
    cat "$LOGS/bench.json"
    pass "3 GPU benchmark: $LOGS/bench.json"
else
    cat "$LOGS/bench.json" "$LOGS/bench.err"
    fail "3 GPU benchmark"
fi

if [ -x "$PY" ] || command -v "$PY" >/dev/null; then
    if SHARDWIRE_BIN="$BIN" "$PY" -m pytest -q -rs -p no:cacheprovider \
        tests/e2e/test_cuda_sdk.py tests/e2e/test_cuda_e2e.py >"$LOGS/pytest.log" 2>&1; then
        tail -3 "$LOGS/pytest.log"
        # Tests for hosts without a driver skip here by design; the GPU ones must not.
        if grep -q 'needs CUDA GPU' "$LOGS/pytest.log"; then
            fail "4 SDK and node GPU tests skipped (see $LOGS/pytest.log)"
        else
            pass "4 SDK and node GPU tests"
        fi
    else
        cat "$LOGS/pytest.log"
        fail "4 SDK and node GPU tests (see $LOGS/pytest.log)"
    fi
else
    fail "4 no $PY: run scripts/test once (it makes the venv) or set GPU_CHECK_PYTHON"
fi
GPUS=$(python3 -c 'import json, sys; print(len(json.load(open(sys.argv[1]))["probe"]["devices"]))' "$LOGS/gpus.json" 2>/dev/null || echo 0)
# One verdict per step: a failed topology is step 5's FAIL, and the lane test does not run
# then (the node would plan its lanes from the same sysfs reading that failed).
TOPOLOGY_OK=1
"$BIN" topology >"$LOGS/topology.txt" 2>"$LOGS/topology.err" \
    && "$BIN" topology --json >"$LOGS/topology.json" 2>>"$LOGS/topology.err" || TOPOLOGY_OK=0
cat "$LOGS/topology.txt" "$LOGS/topology.err"
if [ "$TOPOLOGY_OK" = 0 ]; then
    fail "5 lanes: shardwire topology failed (see $LOGS/topology.err); the per-GPU lane test not run"
elif [ "$GPUS" -ge 2 ]; then
    # PASS only when pytest exited 0 and the test did not skip.
    LANES_RC=0
    SHARDWIRE_BIN="$BIN" "$PY" -m pytest -q -rs -p no:cacheprovider \
        "tests/e2e/test_cuda_e2e.py::test_every_gpu_has_its_lane_and_a_stream_lands_on_its_trainers_gpu" \
        >"$LOGS/lanes.log" 2>&1 || LANES_RC=$?
    if [ "$LANES_RC" != 0 ]; then
        cat "$LOGS/lanes.log"
        fail "5 lanes: per-GPU lane test, pytest exit $LANES_RC (see $LOGS/lanes.log)"
    elif grep -q 'needs 2 or more CUDA GPUs' "$LOGS/lanes.log"; then
        fail "5 lanes: the per-GPU lane test skipped with $GPUS GPUs"
    else
        pass "5 lanes: $GPUS GPUs, one lane each, every stream on its trainer's GPU"
    fi
else
    echo "SKIP 5 lanes: $GPUS GPU(s) here (the per-GPU lane test needs 2 or more); topology in $LOGS/topology.txt"
fi
if [ "$FAILED" = 0 ]; then
    echo "gpu-check: all passed in $((SECONDS - START)) s"
else
    echo "gpu-check: FAILED (see the FAIL lines above) in $((SECONDS - START)) s"
    exit 1
fi
