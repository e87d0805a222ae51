#!/usr/bin/env bash
# Ingest goodput of `shardwire bench` as a ratio to iperf3 on loopback, measured in the same
# run: the two alternate ROUNDS times with the same number of parallel flows, and every
# ratio plus the median is printed. Usage: scripts/bench-vs-iperf3.sh [FLOWS] [SECONDS] [ROUNDS] [SHARD_SIZE]
# IPERF3_ARGS adds client flags, e.g. IPERF3_ARGS=-Z for iperf3's sendfile (zero-copy) sender,
# which is what shardwire's source uses.
set -euo pipefail
cd "$(dirname "$0")/.."
flows=${1:-4}; secs=${2:-8}; rounds=${3:-3}; shard=${4:-4MiB}
command -v iperf3 >/dev/null || { echo "iperf3 is not installed (apt-get install iperf3)" >&2; exit 2; }
cargo build --release -q -p shardwire
bin=${CARGO_TARGET_DIR:-target}/release/shardwire
port=$((20000 + RANDOM % 20000))
ratios=()
for r in $(seq 1 "$rounds"); do
  iperf3 -s -p "$port" -1 >/dev/null 2>&1 &
  sleep 0.5
  ip=$(iperf3 -c 127.0.0.1 -p "$port" -P "$flows" -t "$secs" ${IPERF3_ARGS:-} -J | python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/1e9)')
  wait
  sw=$("$bin" bench --flows "$flows" --seconds "$secs" --shard-size "$shard" | sed -n 's/^shardwire: \([0-9.]*\) Gbps.*/\1/p')
  ratio=$(python3 -c "print(f'{$sw/$ip:.3f}')")
  echo "round $r: iperf3 -P $flows ${IPERF3_ARGS:-}: $ip Gbps; shardwire bench --flows $flows (CRC on, to a trainer): $sw Gbps; ratio $ratio"
  ratios+=("$ratio")
done
printf '%s\n' "${ratios[@]}" | sort -n | awk '{a[NR]=$1} END {print "median ratio shardwire/iperf3 over " NR " rounds: " a[int((NR+1)/2)]}'
