"""The Rust client (client/src/stream.rs) through `shardwire consume`, where the Python tests
cannot reach it: a batch the node sends as JSON (it does not fit the binary form) still
carries the resume state that `Stream::state` reports."""

from __future__ import annotations

import pyarrow as pa

from conftest import index_dataset, serve_dataset, write_arrow

# A column name longer than the binary batch form's u16 name field.
LONG_NAME = "x" * 70_000


def test_the_state_of_a_batch_sent_as_json_is_kept(sw, tmp_path):
    """`consume --limit 2 --print-state` over a dataset whose tensor name is too long for the
    binary form: the node answers with JSON batches, and the state printed is the position
    after the two batches taken (not the one the stream opened at)."""
    d = tmp_path / "ds"
    table = pa.table({LONG_NAME: pa.array(range(64), pa.int64())})
    write_arrow(d / "part-0.arrow", table.to_batches(max_chunksize=16), stream=False)
    index_dataset(d)
    node = serve_dataset(sw, "j", d)
    lines = sw.consume(node, "j", limit=2, print_state=True)
    batches = [line for line in lines if "tensors" in line]
    assert len(batches) == 2, lines
    assert batches[0]["tensors"][0]["name"] == LONG_NAME
    states = [line["state"] for line in lines if "state" in line]
    assert len(states) == 1, lines
    assert (states[0]["epoch"], states[0]["index"]) == (0, 2), states[0]
