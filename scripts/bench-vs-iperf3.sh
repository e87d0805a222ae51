#!/usr/bin/env bash
# Ingest goodput of `shardwire bench` as a ratio to iperf3 on loopback, measured in the same
# run: the two alternate ROUNDS times with the same number of parallel flows, and every
# ratio plus the median (of an even ROUNDS, the mean of the two middle ratios, as `shardwire
# bench` reports its own) is printed. Usage: scripts/bench-vs-iperf3.sh [FLOWS] [SECONDS] [ROUNDS] [SHARD_SIZE]
# IPERF3_ARGS adds client flags, e.g. IPERF3_ARGS=-Z for iperf3's sendfile (zero-copy) sender,
# which is what shardwire's source uses. SKIP_BUILD=1 skips `cargo build --release -p
# shardwire` (the binary is then ${CARGO_TARGET_DIR:-target}/release/shardwire as it is).
# A weak baseline: by default iperf3's sender copies (shardwire's uses sendfile), and iperf3
# before 3.16 runs all its -P streams in one thread, so iperf3 is not the kernel's ceiling
# here and a ratio above 1 does not say shardwire reaches it (docs/BENCHMARKS.md, "Against
# iperf3"; the in-process comparison against plain TCP is the stricter one).
set -euo pipefail
cd "$(dirname "$0")/.."
flows=${1:-4}; secs=${2:-8}; rounds=${3:-3}; shard=${4:-4MiB}
[ "$rounds" -ge 1 ] 2>/dev/null || { echo "bench-vs-iperf3: ROUNDS must be a whole number >= 1, not '$rounds'" >&2; exit 2; }
command -v iperf3 >/dev/null || { echo "iperf3 is not installed (apt-get install iperf3)" >&2; exit 2; }
[ "${SKIP_BUILD:-0}" = 1 ] || cargo build --release -q -p shardwire
bin=${CARGO_TARGET_DIR:-target}/release/shardwire
port=$((20000 + RANDOM % 20000))
# The round's iperf3 server, stopped however the script ends (a failed client, a parse error
# under set -e, Ctrl-C): it would otherwise keep listening.
srv=
trap '[ -z "$srv" ] || kill "$srv" 2>/dev/null || true' EXIT
trap 'exit 143' TERM
trap 'exit 130' INT
ratios=()
for r in $(seq 1 "$rounds"); do
  iperf3 -s -p "$port" -1 >/dev/null 2>&1 &
  srv=$!
  sleep 0.5
  ip=$(iperf3 -c 127.0.0.1 -p "$port" -P "$flows" -t "$secs" ${IPERF3_ARGS:-} -J | python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/1e9)')
  wait "$srv"
  srv=
  sw=$("$bin" bench --flows "$flows" --seconds "$secs" --shard-size "$shard" | sed -n 's/^shardwire: \([0-9.]*\) Gbps.*/\1/p')
  ratio=$(python3 -c "print(f'{$sw/$ip:.3f}')")
  echo "round $r: iperf3 -P $flows ${IPERF3_ARGS:-}: $ip Gbps; shardwire bench --flows $flows (CRC on, to a trainer): $sw Gbps; ratio $ratio"
  ratios+=("$ratio")
done
printf '%s\n' "${ratios[@]}" | sort -n | awk '{a[NR]=$1} END {
  m = (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2
  printf "median ratio shardwire/iperf3 over %d rounds: %.3f\n", NR, m
}'
