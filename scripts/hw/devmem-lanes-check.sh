#!/usr/bin/env bash
# Devmem TCP on every lane (scripts/hw/devmem-check.sh --lanes PEER_SSH): see that script's
# header. Not run in CI (no devmem NIC there). Prints PASS/FAIL per step, stops at the first
# failure.
set -euo pipefail
PEER=${1:?PEER_SSH}
cd "$(dirname "$0")/../.."
. scripts/hw/lib.sh
[ "$(id -u)" = 0 ] || { echo "run as root"; exit 2; }
command -v ethtool >/dev/null || { echo "needs ethtool"; exit 2; }
TMP=$(mktemp -d)
hw_start "$PEER"

# 1. the lanes: every lane has a GPU and a devmem-capable NIC.
$SW topology --json > "$TMP/topology.json"
python3 - "$TMP/topology.json" <<'PY' || fail "topology"
import json, sys
t = json.load(open(sys.argv[1]))
lanes = t["lanes"]
assert len(lanes) >= 2, f"{len(lanes)} lane(s): this check is for a host of several GPU/NIC pairs"
for l in lanes:
    print(l)
    assert l.get("nic") and l.get("gpu"), f"lane without a NIC or a GPU: {l}"
PY
pass "topology: $(python3 -c "import json; print(len(json.load(open('$TMP/topology.json'))['lanes']))" ) lanes"
NICS=$(python3 -c "import json; print(' '.join(l['nic'] for l in json.load(open('$TMP/topology.json'))['lanes']))")
GPUS=$(python3 -c "import json; print(' '.join(l['gpu'] for l in json.load(open('$TMP/topology.json'))['lanes']))")

# The ntuple rules each lane NIC carries before the node starts (an operator's, a cloud
# agent's): shardwire restores only its own, so step 4 compares against these.
# (A NIC whose driver lists no rules has none: empty, not a failure under pipefail.)
ntuple_rules() { { ethtool -n "$1" 2>/dev/null || true; } | sed -n '/Filter:/,$p'; }
for nic in $NICS; do ntuple_rules "$nic" > "$TMP/rules.before.$nic"; done

# 2. a source on the peer, the node here with devmem on every lane.
peer_source "$PEER" "$TMP" 64 8
PEER_HOST=${PEER#*@}
$SW serve --source "$PEER_HOST:7500" --secret-file "$TMP/secret" --socket "$TMP/t.sock" \
  --data-listen "0.0.0.0:0" --admin 127.0.0.1:7410 --receive devmem \
  --nic-state-file "$TMP/nic.json" 2>"$TMP/serve.log" &
SERVE_PID=$!
wait_ready 127.0.0.1:7410 || fail "serve did not start (see $TMP/serve.log)"
for nic in $NICS; do
  [ -e "$TMP/nic.$nic.json" ] && pass "journal of $nic" || fail "no journal for $nic"
done

# 3. one trainer per lane (its GPU), all at once; flow rules sampled while they read.
pids=()
for gpu in $GPUS; do
  $SW consume --socket "$TMP/t.sock" --dataset hw --device "$gpu" --jsonl > "$TMP/batches.$gpu.jsonl" &
  pids+=($!)
done
sleep 3
curl -fs 127.0.0.1:7410/v1/bindings > "$TMP/bindings.during.json"
for p in "${pids[@]}"; do wait "$p" || fail "a trainer failed"; done
curl -fs 127.0.0.1:7410/v1/bindings > "$TMP/bindings.json"
curl -fs 127.0.0.1:7410/v1/status > "$TMP/status.json"
python3 - "$TMP" "$NICS" <<'PY' || fail "per-lane bindings (see $TMP/serve.log)"
import json, sys
tmp, nics = sys.argv[1], sys.argv[2].split()
during = {b["lane"]: b for b in json.load(open(f"{tmp}/bindings.during.json"))["bindings"]}
after = {b["lane"]: b for b in json.load(open(f"{tmp}/bindings.json"))["bindings"]}
st = json.load(open(f"{tmp}/status.json"))
assert st["counters"]["crc_failures"] == 0, st["counters"]
assert sorted(after) == list(range(len(nics))), after
ids = set()
for lane, nic in enumerate(nics):
    b = after[lane]
    print(f"lane {lane}: {b}")
    assert b["kind"] == "kernel" and b["interface"] == nic, b
    assert b["frags"] > 0 and b["steering_errors"] == 0, b
    assert b["linear_bytes"] == 0 and b["plain_bytes"] == 0, b
    assert b["flow_rule_failures"] == 0, b
    assert during[lane]["flow_rules"] >= 1, during[lane]
    ids.add(b["binding"])
assert len(ids) == len(nics), "one binding (one dma-buf) per lane"
PY
pass "every lane received into its own binding on its own NIC"
for nic in $NICS; do ethtool -n "$nic" | grep -c "Filter:" | xargs echo "$nic rules while serving:"; done

# 4. shutdown restores every NIC.
kill "$SERVE_PID"; wait "$SERVE_PID" || true; SERVE_PID=""
for nic in $NICS; do
  [ ! -e "$TMP/nic.$nic.json" ] || fail "journal of $nic left behind"
  ntuple_rules "$nic" > "$TMP/rules.after.$nic"
  diff -u "$TMP/rules.before.$nic" "$TMP/rules.after.$nic" \
    || fail "ntuple rules on $nic differ from those before the node started (diff above)"
done
pass "every NIC restored on shutdown (ntuple rules as before the node started)"
