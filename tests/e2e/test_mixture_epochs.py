"""A mixture's weights changed at an epoch boundary through ``shardwire.torch.IterableDataset``
(a real source and node, the datasets and node of test_mix.py): the usual loop's checkpoint
after epoch 0, resumed with new weights, ``load_state_dict`` and ``set_epoch(1)`` (the
dataset's own calls, and torchdata's ``StatefulDataLoader`` with 0 workers, which loads the
state after ``set_epoch``), continues every dataset from its cursor: no sample skipped or
repeated. Before, the SDK dropped the finished state and opened epoch 1 from a probe's state,
and the node replayed epoch 0 under the new weights: the cursors it reached were other than
those delivered, so one dataset skipped samples and the other repeated them.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from conftest import REPO
from test_mix import datasets, node  # noqa: F401 (fixtures)

sys.path.insert(0, str(REPO / "client" / "python" / "src"))

#: web 400 rows, code 60, global batch 8: a mixture epoch is (400 + 60) // 8 steps.
STEPS = (400 + 60) // 8
OPTS = {"seed": 3, "batch_size": 8}


def _loader(ds: Any, how: str, stateful: Any) -> Any:
    return ds if how == "dataset" else stateful.StatefulDataLoader(ds, batch_size=None, num_workers=0)


def _ids(items: Any) -> list[list[int]]:
    return [[int(i) for i in item["id"]] for item in items]


@pytest.mark.parametrize("how", ["dataset", "stateful"])
def test_new_weights_at_an_epoch_boundary_continue_every_cursor(node, datasets, how):  # noqa: F811
    pytest.importorskip("torch", reason="torch is installed by scripts/test")
    stateful = pytest.importorskip("torchdata.stateful_dataloader") if how == "stateful" else None
    from shardwire.torch import IterableDataset

    _, web, code, _ = datasets
    ds = IterableDataset({"web": 0.5, "code": 0.5}, socket=node.socket, **OPTS)
    loader = _loader(ds, how, stateful)
    ds.set_epoch(0)
    epoch0 = _ids(loader)
    ckpt = loader.state_dict()
    saved = ds.state_dict()["stream"]
    assert len(epoch0) == STEPS and (saved["epoch"], saved["index"]) == (1, 0), saved
    assert saved["mix"]["cursors"] == [4 * STEPS, 4 * STEPS], saved["mix"]

    # After a restart, with 7 web rows and 1 code row a batch.
    ds2 = IterableDataset({"web": 0.875, "code": 0.125}, socket=node.socket, **OPTS)
    loader2 = _loader(ds2, how, stateful)
    # The dataset loads the state here, before set_epoch; the StatefulDataLoader keeps it and
    # loads it into the dataset at iter(loader2), after set_epoch.
    loader2.load_state_dict(ckpt)
    ds2.set_epoch(1)
    epoch1 = _ids(loader2)
    assert len(epoch1) == STEPS
    assert all(sum(i in code for i in b) == 1 for b in epoch1), epoch1
    after = ds2.state_dict()["stream"]["mix"]["cursors"]
    assert after == [4 * STEPS + 7 * STEPS, 4 * STEPS + STEPS], after  # from the saved cursors

    web0 = [i for b in epoch0 for i in b if i in web]
    web1 = [i for b in epoch1 for i in b if i in web]
    # web's first pass (400 rows) is finished by epoch 1's first 400 - 228 web rows: each once.
    first_pass = web0 + web1[: 400 - len(web0)]
    assert len(first_pass) == 400 and set(first_pass) == web, "a web row skipped or repeated"
    code0 = [i for b in epoch0 for i in b if i in code]
    code1 = [i for b in epoch1 for i in b if i in code]
    # code's cursor 228 is 3 passes of 60 and 48 rows; epoch 1's first 12 end that pass.
    open_pass = code0[180:] + code1[:12]
    assert len(open_pass) == 60 and set(open_pass) == code, "a code row skipped or repeated"
