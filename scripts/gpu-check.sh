#!/usr/bin/env bash
# GPU checks: run on a host with an NVIDIA GPU and driver (not in CI). Builds the workspace,
# prints what the probe sees, and runs the tests marked #[ignore = "needs CUDA GPU"].
# In this version that is the probe test (a VMM-capable device must be found); the CUDA region,
# gather/CRC kernel and H2D benchmarks join this script when they are built.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,pci.bus_id,memory.total --format=csv || echo "nvidia-smi not found"
cargo build --release -p shardwire
target/release/shardwire gpus
cargo test --release -p shardwire-gpu -- --ignored --nocapture
