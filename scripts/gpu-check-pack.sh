#!/usr/bin/env bash
# Packs what scripts/gpu-check.sh runs into .gpucheck/, for a GPU host that has no Rust
# toolchain and reaches no package registry (a lent machine): the release shardwire binary, the
# gpu_bench example, the two GPU test binaries (shardwire-gpu's lib and tests/cuda_gpu.rs), all
# stripped, and a cp312 wheel of crc32c (the e2e tests' checksum; the host's python has the
# rest: numpy, pytest, torch with CUDA, cuda-bindings). Then, on that host, from a copy of this
# checkout with .gpucheck/ in it:
#
#   GPU_CHECK_BIN=.gpucheck GPU_CHECK_PYTHON=python3 scripts/gpu-check.sh
#
# The binaries need glibc no newer than this host's and an x86-64 GPU host.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.gpucheck
TARGET=${CARGO_TARGET_DIR:-target}
mkdir -p "$DEST/whl"
rm -f "$DEST"/shardwire "$DEST"/gpu_bench "$DEST"/test-*

cargo build -q --release -p shardwire -p shardwire-gpu --examples --bin shardwire
cp "$TARGET/release/shardwire" "$TARGET/release/examples/gpu_bench" "$DEST/"
# The test executables, by name from cargo's own report (their file names carry a hash).
cargo test -q --release --no-run -p shardwire-gpu --lib --test cuda_gpu --message-format=json \
    | python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        name = "lib" if "lib" in m["target"]["kind"] else m["target"]["name"]
        shutil.copy(m["executable"], sys.argv[1] + "/test-" + name)
        print("packed test-" + name)
' "$DEST"
strip "$DEST"/shardwire "$DEST"/gpu_bench "$DEST"/test-*
if ! ls "$DEST"/whl/crc32c-*cp312*.whl >/dev/null 2>&1; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$DEST/whl" crc32c
fi
du -sh "$DEST"/* | sort -h
