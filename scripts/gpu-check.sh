#!/usr/bin/env bash
# GPU check: every test that needs a CUDA GPU, plus the GPU benchmark, in one command.
# Run on a host with an NVIDIA GPU (driver 12.8+, dma-buf and VMM support), Rust, and the
# test venv (`scripts/test` makes it; torch there is a CUDA build). Not run in CI (no GPU).
#
#   scripts/gpu-check.sh [BENCH_MIB]        # ~3-4 minutes on an H200 from a warm cargo cache
#
# Steps (each prints PASS/FAIL; stops at the first failure):
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
#      its region there, tensors on cuda:i in torch, byte-exact (it must not skip here).
set -euo pipefail
cd "$(dirname "$0")/.."
MIB=${1:-256}
OUT=${CARGO_TARGET_DIR:-target}/gpu-check
mkdir -p "$OUT"
pass() { echo "PASS $*"; }
fail() { echo "FAIL $*"; exit 1; }
START=$SECONDS

cargo build -q --release -p shardwire -p shardwire-gpu --examples --bin shardwire
BIN=${CARGO_TARGET_DIR:-target}/release/shardwire
"$BIN" gpus --json | tee "$OUT/gpus.json"
grep -q '"memory": "cuda"' "$OUT/gpus.json" && pass "1 probe: auto chooses CUDA memory" \
    || fail "1 probe: auto did not choose CUDA memory (see $OUT/gpus.json)"

# --lib and cuda_gpu only: fake_driver.rs compiles the same suite in for its fake-libcuda child.
cargo test -q --release -p shardwire-gpu --lib --test cuda_gpu -- --ignored --test-threads=1 \
    >"$OUT/tests.log" 2>&1 || { cat "$OUT/tests.log"; fail "2 GPU tests (see $OUT/tests.log)"; }
grep 'test result' "$OUT/tests.log"
grep -q 'test result: ok. 6 passed' "$OUT/tests.log" && pass "2 GPU tests" || fail "2 GPU tests (expected 6 passed)"

cargo run -q --release -p shardwire-gpu --example gpu_bench -- "$MIB" >"$OUT/bench.json" \
    || fail "3 GPU benchmark"
cat "$OUT/bench.json"
pass "3 GPU benchmark: $OUT/bench.json"

if [ -x .venv/bin/python ]; then
    SHARDWIRE_BIN="$PWD/target/release/shardwire" .venv/bin/python -m pytest -q -rs \
        tests/e2e/test_cuda_sdk.py tests/e2e/test_cuda_e2e.py >"$OUT/pytest.log" 2>&1 \
        || { cat "$OUT/pytest.log"; fail "4 SDK and node GPU tests (see $OUT/pytest.log)"; }
    tail -3 "$OUT/pytest.log"
    # Tests for hosts without a driver skip here by design; the GPU ones must not.
    grep -q 'needs CUDA GPU' "$OUT/pytest.log" && fail "4 SDK and node GPU tests skipped (see $OUT/pytest.log)"
    pass "4 SDK and node GPU tests"
else
    fail "4 no .venv: run scripts/test once (it makes the venv)"
fi
GPUS=$(grep -c '"pci_bus_id"' "$OUT/gpus.json" || true)
"$BIN" topology >"$OUT/topology.txt" && "$BIN" topology --json >"$OUT/topology.json" \
    || fail "5 lanes: shardwire topology (see $OUT)"
cat "$OUT/topology.txt"
if [ "$GPUS" -ge 2 ]; then
    SHARDWIRE_BIN="$PWD/target/release/shardwire" .venv/bin/python -m pytest -q -rs \
        "tests/e2e/test_cuda_e2e.py::test_every_gpu_has_its_lane_and_a_stream_lands_on_its_trainers_gpu" \
        >"$OUT/lanes.log" 2>&1 || { cat "$OUT/lanes.log"; fail "5 lanes: per-GPU lane test (see $OUT/lanes.log)"; }
    grep -q 'needs 2 or more CUDA GPUs' "$OUT/lanes.log" && fail "5 lanes: the per-GPU lane test skipped with $GPUS GPUs"
    pass "5 lanes: $GPUS GPUs, one lane each, every stream on its trainer's GPU"
else
    echo "SKIP 5 lanes: one GPU here (the per-GPU lane test needs 2 or more); topology in $OUT/topology.txt"
fi
echo "gpu-check: all passed in $((SECONDS - START)) s"
