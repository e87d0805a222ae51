#!/usr/bin/env bash
# Devmem TCP hardware check: run on a host with a devmem-capable NIC (gve, bnxt, mlx5,
# fbnic, idpf), as root, with /dev/udmabuf (modprobe udmabuf) and a peer reachable over that
# NIC by ssh. Not run in CI (no such NIC there); see docs/OPERATIONS.md "Hardware checks".
#
#   scripts/hw/devmem-check.sh IFNAME PEER_SSH PEER_ADDR_AS_SEEN_FROM_PEER [PORT]
#
#   IFNAME     the devmem NIC here, e.g. eth1
#   PEER_SSH   ssh destination of the peer, e.g. root@10.0.0.2 (needs python3 and shardwire
#              in PATH there)
#   HERE       this host's address on IFNAME, as the peer dials it
#   PORT       data port steered to the devmem queue (default 5201)
#
# Steps (each prints PASS/FAIL; the script stops at the first failure; shardwire undoes its NIC
# changes itself, and at its next start after a crash):
#   1. shardwire nics: IFNAME reports devmem_capable (trial bind outcome).
#   2. steering: shardwire sets RSS over queues 0..Q-1 and an ntuple rule PORT -> queue Q
#      itself (journaled, undone at the end); the script shows the NIC's tables.
#   3. the kernel selftest sequence (cargo test --test hw, ignored tests):
#      empty queue list fails; header split off fails; bind succeeds and shows on the queue;
#      shrinking channels under the bound queue fails; closing the socket unbinds; then a
#      validated pattern from the peer lands in the dma-buf with no byte in host memory.
#   4. ingest: shardwire source on the peer, shardwire serve --receive devmem here as a node of
#      one lane (SHARDWIRE_LANES='[{}]', so IFNAME and queue Q are what it binds, on a host of
#      several GPUs too), one epoch consumed: CRC failures 0, devmem frags > 0, host bytes 0.
#   5. devmem TX: shardwire source --devmem-tx IFNAME here (admin 127.0.0.1:7591), a node on
#      the peer consumes; passes only when the source's /metrics count devmem TX bytes on
#      IFNAME (shardwire_source_devmem_tx_bytes_total > 0) and its log has no connection that
#      fell back to sendfile.
#
#   scripts/hw/devmem-check.sh --lanes PEER_SSH
#
#   Every lane at once (issue 24), on a host whose GPUs and devmem NICs pair into lanes
#   (`shardwire topology`): PEER_SSH as above, reaching every lane NIC's address. Starts
#   `serve --receive devmem` (lanes auto, memory auto), one trainer per lane (--device = the
#   lane's GPU), then checks per lane in /v1/bindings: a kernel binding on that lane's NIC only,
#   frags > 0, steering errors 0, no payload in host memory, one flow rule per open data
#   connection while trainers read; after shutdown: no journal left, and every lane NIC's
#   ntuple rules as they were before the node started (rules already there are kept).
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/hw/lib.sh
if [ "${1:-}" = "--lanes" ]; then
  exec scripts/hw/devmem-lanes-check.sh "${@:2}"
fi
IF=${1:?IFNAME}; PEER=${2:?PEER_SSH}; HERE=${3:?address of this host on IFNAME}; PORT=${4:-5201}
[ "$(id -u)" = 0 ] || { echo "run as root"; exit 2; }
command -v ethtool >/dev/null || { echo "needs ethtool"; exit 2; }
[ -e /dev/udmabuf ] || { echo "needs /dev/udmabuf (modprobe udmabuf)"; exit 2; }

RXQ=$(ls -d /sys/class/net/"$IF"/queues/rx-* | wc -l)
# Queue 0 stays with RSS (shardwire refuses to bind it): a NIC needs two RX queues here.
[ "$RXQ" -ge 2 ] || { echo "$IF has $RXQ RX queue(s); raise them: ethtool -L $IF combined 2 (rx 2 where the NIC has separate RX and TX channels)"; exit 2; }
Q=$((RXQ - 1))
hw_start "$PEER"

# 1. capability probe
$SW nics --json | python3 -c "
import json,sys
n=[x for x in json.load(sys.stdin) if x['name']=='$IF']
assert n, 'no $IF'; n=n[0]
print(n['reason'])
sys.exit(0 if n['devmem_capable'] else 1)" && pass "probe: $IF is devmem-capable" || fail "probe: $IF"

# 2. steering is done (and undone) by shardwire itself (RSS over 0..Q-1, ntuple PORT -> Q);
#    show the NIC before, to compare with after.
ethtool -x "$IF" | head -5 || true
ethtool -n "$IF" || true

# 3. kernel selftest sequence, then the pattern
export SHARDWIRE_HW_IFNAME="$IF" SHARDWIRE_HW_QUEUE="$Q" SHARDWIRE_HW_PORT="$PORT"
cargo test --release -p shardwire-devmem --test hw -- --ignored --test-threads 1 \
  hw_bind_sequence_follows_the_kernel_selftest && pass "bind sequence" || fail "bind sequence"
( sleep 3; ssh "$PEER" "python3 -c \"
import socket
s=socket.create_connection(('$HERE',$PORT)); pat=bytes(i%251 for i in range(251*4096)); n=64<<20; sent=0
while sent<n:
    k=min(len(pat)-(sent%251), n-sent); off=sent%251; s.sendall(pat[off:off+k]); sent+=k
s.close()\"" ) &
cargo test --release -p shardwire-devmem --test hw -- --ignored --test-threads 1 --nocapture \
  hw_validated_pattern_lands_in_the_dmabuf && pass "pattern" || fail "pattern"
wait

# 4. ingest through serve --receive devmem
TMP=$(mktemp -d)
peer_source "$PEER" "$TMP" 32 4
PEER_HOST=${PEER#*@}
# One lane: with `lanes = "auto"` a host of several GPUs makes a lane per GPU, each binding its
# own NIC, and devmem_interface/devmem_queues are ignored; a table of one lane takes them.
SHARDWIRE_LANES='[{}]' $SW serve --source "$PEER_HOST:7500" --secret-file "$TMP/secret" \
  --socket "$TMP/t.sock" --data-listen "0.0.0.0:$PORT" --admin 127.0.0.1:7410 --receive devmem \
  --devmem-interface "$IF" --devmem-queue "$Q" --nic-state-file "$TMP/nic.json" 2>"$TMP/serve.log" &
SERVE_PID=$!
wait_ready 127.0.0.1:7410 || fail "serve did not start (see $TMP/serve.log)"
$SW consume --socket "$TMP/t.sock" --dataset hw --jsonl > "$TMP/batches.jsonl" || fail "consume"
curl -fs 127.0.0.1:7410/v1/status | python3 -c "
import json,sys
s=json.load(sys.stdin); d=s['devmem']; c=s['counters']
print(d, c)
assert c['crc_failures']==0 and d['frags']>0 and d['linear_bytes']==0 and d['plain_bytes']==0
" && pass "ingest: $(wc -l < "$TMP/batches.jsonl") batches via devmem" || fail "ingest (see $TMP/serve.log)"
kill "$SERVE_PID"; wait "$SERVE_PID" || true; SERVE_PID=""
[ ! -e "$TMP/nic.json" ] && pass "NIC restored on shutdown" || fail "NIC state file left behind"
ethtool -n "$IF" | grep -q "dst-port $PORT" && fail "ntuple rule left behind" || pass "no ntuple rule left"

# 5. devmem TX: a source here sends from a TX-bound dma-buf to a node on the peer (host mode,
#    one lane). The bind alone proves nothing about the data path (a lane routed through
#    another NIC, or a connection with no free ring, sends with sendfile), so the step reads
#    the bytes the source sent with devmem TX on IF from its /metrics.
mkdir -p "$TMP/txds" && head -c $((64 << 20)) /dev/urandom > "$TMP/txds/a.bin" && $SW index "$TMP/txds"
$SW source --listen 0.0.0.0:7501 --dataset tx="$TMP/txds" --secret-file "$TMP/secret" \
  --admin 127.0.0.1:7591 --devmem-tx "$IF" 2>"$TMP/txsource.log" &
TXSRC=$!
HW_PIDS="$HW_PIDS $TXSRC"
sleep 2
grep -q "sending with devmem TX" "$TMP/txsource.log" || fail "devmem TX: no TX binding on $IF (see $TMP/txsource.log)"
ssh "$PEER" "SHARDWIRE_LANES='[{}]' shardwire serve --source $HERE:7501 --secret-file /tmp/swds/secret \
  --socket /tmp/swds/t.sock --admin 127.0.0.1:7410 --receive host --memory host & sleep 3; \
  shardwire consume --socket /tmp/swds/t.sock --dataset tx --jsonl \
  | python3 -c 'import sys,json; b=[json.loads(l) for l in sys.stdin if l.startswith(\"{\")]; assert b; print(len(b))'; \
  rc=\$?; kill %1; exit \$rc" || fail "devmem TX: the node on the peer got no batch (see $TMP/txsource.log)"
curl -fs 127.0.0.1:7591/metrics > "$TMP/txsource.metrics" || fail "devmem TX: no /metrics from the source"
TXBYTES=$(python3 - "$TMP/txsource.metrics" "$IF" <<'PY'
import re, sys
text, nic = open(sys.argv[1]).read(), sys.argv[2]
pat = r'^shardwire_source_devmem_tx_bytes_total\{interface="([^"]+)"\} (\S+)$'
print(int(sum(float(v) for n, v in re.findall(pat, text, re.M) if n == nic)))
PY
) || fail "devmem TX: unreadable /metrics (see $TMP/txsource.metrics)"
[ "$TXBYTES" -gt 0 ] || fail "devmem TX: 0 bytes sent with devmem TX on $IF (see $TMP/txsource.log, $TMP/txsource.metrics)"
if grep -qE "sends? with sendfile" "$TMP/txsource.log"; then
  fail "devmem TX: a data connection fell back to sendfile (see $TMP/txsource.log)"
fi
pass "devmem TX source: $TXBYTES bytes sent with devmem TX on $IF"
kill "$TXSRC" || true
wait "$TXSRC" 2>/dev/null || true
HW_PIDS=${HW_PIDS/ $TXSRC/}
