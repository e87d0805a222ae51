# Shared by the hardware checks in scripts/hw (sourced, not run).

# peer_source PEER TMP SHARDS MIB: a dataset of SHARDS random shards of MIB MiB on the peer
# (/tmp/swds), indexed, served by `shardwire source` on 0.0.0.0:7500 with a new secret (also
# written to TMP/secret here).
peer_source() {
  local peer=$1 tmp=$2 shards=$3 mib=$4
  ssh "$peer" "mkdir -p /tmp/swds && python3 -c \"
import os
for i in range($shards): open(f'/tmp/swds/s{i:03d}.bin','wb').write(os.urandom($mib<<20))
\" && shardwire index /tmp/swds"
  head -c 32 /dev/urandom | base64 > "$tmp/secret"
  scp -q "$tmp/secret" "$peer:/tmp/swds/secret"
  ssh "$peer" "(nohup shardwire source --listen 0.0.0.0:7500 --dataset hw=/tmp/swds --secret-file /tmp/swds/secret >/tmp/swds/source.log 2>&1 &)"
}

# wait_ready ADMIN: waits up to 90 s for the node's /readyz.
wait_ready() {
  for _ in $(seq 90); do curl -fs "$1/readyz" >/dev/null && return 0; sleep 1; done
  return 1
}

pass() { echo "PASS $*"; }
fail() { echo "FAIL $*"; exit 1; }

# hw_start PEER: the release binary built ($SW), and on exit (a `fail` included) the peer's
# source, the node ($SERVE_PID) and every process whose PID a script added to HW_PIDS (a local
# source, say) stopped.
hw_start() {
  HW_PEER=$1
  HW_PIDS=${HW_PIDS:-}
  hw_cleanup() {
    ssh "$HW_PEER" "pkill -f 'shardwire source --listen 0.0.0.0:7500'" 2>/dev/null || true
    [ -n "${SERVE_PID:-}" ] && kill "$SERVE_PID" 2>/dev/null || true
    local pid
    for pid in ${HW_PIDS:-}; do
      kill "$pid" 2>/dev/null || true
    done
  }
  trap hw_cleanup EXIT
  cargo build --release -p shardwire
  SW=target/release/shardwire
}
