"""A mixture's weights changed at an epoch boundary through ``shardwire.torch.IterableDataset``
(a real source and node, the datasets and node of test_mix.py), with the dataset's own calls
and with torchdata's ``StatefulDataLoader`` with 0 workers (which loads a state after
``set_epoch``):

- the usual loop's checkpoint after epoch 0, resumed with new weights, ``load_state_dict``
  and ``set_epoch(1)``, continues every dataset from its cursor, and so does epoch 2 of that
  run, from where epoch 1 ended;
- ``ds.dataset = {...}`` between two epochs of a running process does the same, with no
  checkpoint;
- ``ds.batch_size = 16`` between two epochs (a batch-size ramp-up) opens the next from a
  probe: the node refuses the position where the epoch before ended for another global batch
  (before, the first item of the next epoch raised ``state_mismatch``).

No sample skipped or repeated. Before, the SDK dropped the finished state and opened the next
epoch from a probe's state, and the node replayed the earlier epochs under the new weights:
the cursors it reached were other than those delivered, so one dataset skipped samples and
the other repeated them (after a resume, from epoch 2 on: only epoch 1 started at the saved
state).
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
#: Half and half, then 7 web rows and 1 code row a batch.
HALF = {"web": 0.5, "code": 0.5}
SEVEN_ONE = {"web": 0.875, "code": 0.125}


def _loader(ds: Any, how: str, stateful: Any) -> Any:
    return ds if how == "dataset" else stateful.StatefulDataLoader(ds, batch_size=None, num_workers=0)


def _ids(items: Any) -> list[list[int]]:
    return [[int(i) for i in item["id"]] for item in items]


def _cursors(ds: Any) -> list[int]:
    return ds.state_dict()["stream"]["mix"]["cursors"]


def _rows(batches: list[list[int]], of: set[int]) -> list[int]:
    """The ids of `batches` that are in `of`, in delivery order (each dataset's cursor order)."""
    return [i for b in batches for i in b if i in of]


def _epoch_0(ds: Any, loader: Any) -> list[list[int]]:
    """Epoch 0 under HALF: 4 rows of each dataset a batch."""
    ds.set_epoch(0)
    epoch0 = _ids(loader)
    saved = ds.state_dict()["stream"]
    assert len(epoch0) == STEPS and (saved["epoch"], saved["index"]) == (1, 0), saved
    assert saved["mix"]["cursors"] == [4 * STEPS, 4 * STEPS], saved["mix"]
    return epoch0


def _check_epoch_1(data: Any, epoch0: list[list[int]], epoch1: list[list[int]], after: list[int]) -> None:
    """Epoch 1 under SEVEN_ONE went on from epoch 0's cursors (228, 228); `data`: the
    `datasets` fixture."""
    _, web, code, _ = data
    assert len(epoch1) == STEPS
    assert all(sum(i in code for i in b) == 1 for b in epoch1), epoch1
    assert after == [4 * STEPS + 7 * STEPS, 4 * STEPS + STEPS], after  # from the saved cursors
    web0, web1 = _rows(epoch0, web), _rows(epoch1, web)
    # web's first pass (400 rows) is finished by epoch 1's first 400 - 228 web rows: each once.
    first_pass = web0 + web1[: 400 - len(web0)]
    assert len(first_pass) == 400 and set(first_pass) == web, "a web row skipped or repeated"
    code0, code1 = _rows(epoch0, code), _rows(epoch1, code)
    # code's cursor 228 is 3 passes of 60 and 48 rows; epoch 1's first 12 end that pass.
    open_pass = code0[180:] + code1[:12]
    assert len(open_pass) == 60 and set(open_pass) == code, "a code row skipped or repeated"


@pytest.mark.parametrize("how", ["dataset", "stateful"])
def test_new_weights_at_an_epoch_boundary_continue_every_cursor(node, datasets, how):  # noqa: F811
    pytest.importorskip("torch", reason="torch is installed by scripts/test")
    stateful = pytest.importorskip("torchdata.stateful_dataloader") if how == "stateful" else None
    from shardwire.torch import IterableDataset

    _, web, code, _ = datasets
    ds = IterableDataset(HALF, socket=node.socket, **OPTS)
    loader = _loader(ds, how, stateful)
    epoch0 = _epoch_0(ds, loader)
    ckpt = loader.state_dict()

    # After a restart, with 7 web rows and 1 code row a batch.
    ds2 = IterableDataset(SEVEN_ONE, socket=node.socket, **OPTS)
    loader2 = _loader(ds2, how, stateful)
    # The dataset loads the state here, before set_epoch; the StatefulDataLoader keeps it and
    # loads it into the dataset at iter(loader2), after set_epoch.
    loader2.load_state_dict(ckpt)
    ds2.set_epoch(1)
    epoch1 = _ids(loader2)
    after = _cursors(ds2)
    _check_epoch_1(datasets, epoch0, epoch1, after)

    # Epoch 2 goes on from where epoch 1 ended (627, 285). Before, it opened from a probe's
    # state and the node replayed epochs 0 and 1 under 7/8 and 1/8: web from 798, code from
    # 114, so web's [627, 798) never came and code's [114, 285) came again.
    ds2.set_epoch(2)
    at_start = ds2.state_dict()["stream"]  # a checkpoint taken here names them too
    assert at_start is not None and at_start["mix"]["cursors"] == after, at_start
    epoch2 = _ids(loader2)
    assert len(epoch2) == STEPS
    assert all(sum(i in code for i in b) == 1 for b in epoch2), epoch2
    end2 = _cursors(ds2)
    assert end2 == [after[0] + 7 * STEPS, after[1] + STEPS], end2
    web1, web2 = _rows(epoch1, web), _rows(epoch2, web)
    # web's second pass, [400, 800): epoch 1's web rows after its first 172 ([400, 627)),
    # then epoch 2's first 173.
    second_pass = web1[400 - 4 * STEPS :] + web2[: 800 - after[0]]
    assert len(second_pass) == 400 and set(second_pass) == web, "a web row skipped or repeated"
    code1, code2 = _rows(epoch1, code), _rows(epoch2, code)
    # code's fifth pass, [240, 300): epoch 1's code rows after its first 12 ([240, 285)),
    # then epoch 2's first 15.
    fifth_pass = code1[12:] + code2[: 300 - after[1]]
    assert len(fifth_pass) == 60 and set(fifth_pass) == code, "a code row skipped or repeated"


@pytest.mark.parametrize("how", ["dataset", "stateful"])
def test_new_weights_between_epochs_of_a_running_process_continue_every_cursor(node, datasets, how):  # noqa: F811
    pytest.importorskip("torch", reason="torch is installed by scripts/test")
    stateful = pytest.importorskip("torchdata.stateful_dataloader") if how == "stateful" else None
    from shardwire.torch import IterableDataset

    ds = IterableDataset(HALF, socket=node.socket, **OPTS)
    loader = _loader(ds, how, stateful)
    epoch0 = _epoch_0(ds, loader)
    ds.dataset = SEVEN_ONE  # no restart, no checkpoint
    ds.set_epoch(1)
    epoch1 = _ids(loader)
    _check_epoch_1(datasets, epoch0, epoch1, _cursors(ds))


@pytest.mark.parametrize("how", ["dataset", "stateful"])
def test_a_batch_size_ramp_up_between_epochs_opens_the_next_from_a_probe(node, datasets, how):  # noqa: F811
    """Weights unchanged: the epoch opens from a probe (the kept state pins the global batch),
    with a warning that a replay reaches the run's cursors only if nothing changed earlier."""
    pytest.importorskip("torch", reason="torch is installed by scripts/test")
    stateful = pytest.importorskip("torchdata.stateful_dataloader") if how == "stateful" else None
    from shardwire.torch import IterableDataset

    _, _, code, _ = datasets
    ds = IterableDataset(HALF, socket=node.socket, **OPTS)
    loader = _loader(ds, how, stateful)
    _epoch_0(ds, loader)
    ds.batch_size = 16
    ds.set_epoch(1)
    with pytest.warns(RuntimeWarning, match=r"differs in `global_batch`.*changed earlier in the run"):
        epoch1 = _ids(loader)
    assert len(epoch1) == (400 + 60) // 16, epoch1
    assert all(len(b) == 16 and sum(i in code for i in b) == 8 for b in epoch1), epoch1
