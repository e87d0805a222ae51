"""``shardwire.torch.IterableDataset`` without a node: no binary, no socket (torch only where
a test says so; the dataset's torch-free body, ``_DatasetMixin``, is what is tested).

- A mixture's state saved at the end of epoch ``e`` (the start of ``e + 1``) is resumed from,
  not replaced by a probe, when the loop names ``e + 1`` (``set_epoch`` before or after
  ``load_state_dict``): it holds every dataset's cursor, which a probe's ``{epoch, index: 0}``
  does not (the node replays the schedule from its start under the weights given now, which
  repeats and skips samples where they changed). So is the position where an iteration of
  the process ended, for every later epoch: after a resume with new weights (at an epoch
  boundary or inside an epoch) and after ``ds.dataset = {...}`` between epochs. Only a
  mixture of the same datasets in the same order keeps such a state, and only where the node
  takes it for the request as it is now: the probe (opened first, as every epoch after the
  first was before such states were kept) has the state's fingerprint, and a DataLoader
  worker's state was saved under the weights asked for now; else the epoch opens from the
  probe, with a warning where the weights changed (``ds.batch_size = 16`` between epochs, an
  elastic resume on another global batch). A second full pass over an epoch starts at its
  start again and ends where the first did. Other states are replaced as before.
- An epoch past what a stream counts (``epoch + epochs > 2**32 - 1``) is a ValueError naming
  it and the bound, also where ``ds.epochs`` was raised after the epoch was set (at the open),
  and one naming ``epochs`` where it alone is too large.
- ``rank=`` without ``world_size=`` (or the other way round) is a ValueError naming both,
  when the dataset is made and when it is sent to a spawned worker.
- ``set_epoch`` and ``load_state_dict``'s ``state["epoch"]`` take integers >= 0 only.
- ``_connect`` closes its socket when an interrupt lands in it.

The attach requests are captured where they would go out (``Stream._open``), as in
test_sdk_options.py.
"""

from __future__ import annotations

import json
import multiprocessing.context
import pathlib
import socket
import sys
from typing import Any

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "client" / "python" / "src"))

import shardwire  # noqa: E402
import shardwire.torch as swt  # noqa: E402
from shardwire import _client  # noqa: E402

import test_sdk_options  # noqa: E402

#: A kept state taken where the node refuses it, or dropped without a word where the weights
#: changed, fails a test (those that expect the warning catch it).
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

MIX = {"web": 0.75, "code": 0.25}
#: The weights the states below were saved under.
HALF = {"web": 0.5, "code": 0.5}


def fingerprint(global_batch: int = 8, seed: int = 0) -> str:
    """A mixture's fingerprint, as the node writes it (its first fields)."""
    return f"v2;mix=web+code;global_batch={global_batch};seed={seed}"


#: A probe's state (FakeStream.state_dict): a stream of global batch 8, seed 0 that delivered
#: nothing.
PROBE = {"epoch": 0, "index": 0, "cursor": 0, "partitions": 1, "shuffle_block": 100, "seed": 0, "fingerprint": fingerprint()}


def mix_state(epoch: int, index: int, step: int, cursors: list[int]) -> dict[str, Any]:
    """A mixture's stream state as the node sends it: saved under weights .5 / .5."""
    mix = {"step": step, "datasets": ["web", "code"], "weights": [1 << 39, 1 << 39], "cursors": cursors, "carry": [0, 0]}
    return {**PROBE, "epoch": epoch, "index": index, "mix": mix}


#: Epoch 0 (250 steps of 8, 1000 samples of each dataset) delivered in full under .5 / .5:
#: the position after its last batch, the start of epoch 1.
END_OF_0 = mix_state(1, 0, 250, [1000, 1000])
#: Epoch 1 under .75 / .25 from END_OF_0's cursors: half of it, and all of it (the start of
#: epoch 2); then epoch 2 likewise. A probe's ``{epoch: 2, index: 0}`` instead made the node
#: replay 500 steps under .75 / .25, to cursors (3000, 1000): web's [2500, 3000) never came,
#: code's [1000, 1500) twice.
MID_1 = mix_state(1, 125, 375, [1750, 1250])
END_OF_1 = mix_state(2, 0, 500, [2500, 1500])
END_OF_2 = mix_state(3, 0, 750, [4000, 2000])


class FakeStream(test_sdk_options.FakeStream):
    """A stream with no batches, a fingerprint (a probe's) and a mixture's probe state, of
    the request `req` (its global batch and seed)."""

    def __init__(self, req: dict[str, Any] | None = None) -> None:
        req = req or {}
        gb, seed = req.get("batch_size", 8) * req.get("world_size", 1), req.get("seed", 0)
        self.probe = {**PROBE, "seed": seed, "fingerprint": fingerprint(gb, seed)}

    def state_dict(self) -> dict[str, Any]:
        return dict(self.probe)


class Batches(FakeStream):
    """A stream that delivers a batch for each of `states`, its position after that batch
    (as JSON bytes, as a socket stream keeps it until a checkpoint asks)."""

    def __init__(self, *states: dict[str, Any]) -> None:
        self.left = list(states)
        self.at: dict[str, Any] | None = None

    def next(self, timeout: float | None = None) -> dict[str, np.ndarray] | None:  # type: ignore[override]
        if not self.left:
            return None
        self.at = self.left.pop(0)
        return {"id": np.arange(8)}

    def _snapshot(self) -> bytes:
        return json.dumps(self.at).encode()


@pytest.fixture
def answers() -> list[FakeStream]:
    """The streams the dataset's next opens (not its probes) are answered with, in turn (a
    callable: each of them, by the request, from there on); then FakeStreams, with no
    batches."""
    return []


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch, answers: list[FakeStream]) -> list[dict[str, Any]]:
    """The attach requests of the dataset's streams, captured instead of sent (each answered
    with the next of `answers`, else a FakeStream; a probe, without ``worker``, with a
    FakeStream); the main process, DDP rank 0 of 1 unless a test says otherwise."""
    reqs: list[dict[str, Any]] = []

    def sock_open(cls: Any, path: str, req: dict[str, Any], auto_device: bool = False) -> FakeStream:
        reqs.append(req)
        if not answers or "worker" not in req:
            return FakeStream(req)
        return answers[0](req) if callable(answers[0]) else answers.pop(0)

    monkeypatch.setattr(_client.Stream, "_open", classmethod(sock_open))
    monkeypatch.setattr(swt, "connect", lambda socket: shardwire.Client("/nonexistent/trainer.sock"))
    monkeypatch.setattr(swt, "_worker", lambda: (0, 1))
    return reqs


def mixture(weights: dict[str, float] = MIX, **kw: Any) -> Any:
    kw = {"batch_size": 8, "rank": 0, "world_size": 1, **kw}
    return swt._DatasetMixin(dict(weights), socket="/nonexistent", **kw)


def opened(sent: list[dict[str, Any]]) -> list[Any]:
    """(epochs, state) of each attach request; "probe" for a probe's (no ``worker``)."""
    return [(r["epochs"], r["state"]) if "worker" in r else "probe" for r in sent]


# --- a mixture's state at the next epoch's start -------------------------------------------


@pytest.mark.parametrize("set_epoch_first", [True, False], ids=["set_epoch-then-load", "load-then-set_epoch"])
def test_a_mixture_state_at_the_next_epoch_s_start_is_resumed_from_not_probed(sent, answers, set_epoch_first):
    """The usual loop resumed with new weights (.75 / .25): the stream opens at the saved
    state, whose cursors (1000, 1000) the node continues from. Before, the state was dropped
    and a probe's ``{epoch: 1, index: 0}`` without them opened the stream: the node replayed
    epoch 0 under .75 / .25 (cursors 1500 / 500), so web's [1000, 1500) never came and code's
    [500, 1000) came twice. Every later epoch starts where the one before ended (before,
    epoch 2 on opened from a probe again: the same replay, one epoch later). A probe opens
    first each time: its fingerprint is the state's, so the state is taken."""
    ds = mixture()
    saved = {"epoch": 0, "stream": END_OF_0}
    if set_epoch_first:  # StatefulDataLoader's order: it loads the state at iter(loader)
        ds.set_epoch(1)
        ds.load_state_dict(saved)
    else:  # the dataset's own load_state_dict, then the loop's set_epoch
        ds.load_state_dict(saved)
        ds.set_epoch(1)
    assert ds.state_dict() == {"epoch": 1, "stream": END_OF_0}  # a checkpoint now keeps it too
    assert list(ds) == []
    assert opened(sent) == ["probe", (2, END_OF_0)]  # not the probe's {epoch: 1, index: 0}
    assert sent[1]["mix"] == [{"dataset": "web", "weight": 0.75}, {"dataset": "code", "weight": 0.25}]
    sent.clear()
    answers.append(Batches(MID_1, END_OF_1))
    ds.set_epoch(1)  # epoch 1 again (the first iteration delivered nothing here)
    assert len(list(ds)) == 2
    ds.set_epoch(2)
    assert ds.state_dict() == {"epoch": 2, "stream": END_OF_1}  # a checkpoint here resumes there
    answers.append(Batches(END_OF_2))
    assert len(list(ds)) == 1
    ds.set_epoch(3)
    assert list(ds) == []
    assert opened(sent) == ["probe", (2, END_OF_0), "probe", (3, END_OF_1), "probe", (4, END_OF_2)]


def test_weights_changed_between_epochs_of_a_running_process_continue_every_cursor(sent, answers):
    """``ds.dataset = {...}`` between epochs, no checkpoint: epoch 1 opens at the position
    where epoch 0 ended, under the new weights. Before, a probe opened it and the node
    replayed epoch 0 under the new weights."""
    ds = mixture(HALF)
    answers.append(Batches(mix_state(0, 125, 125, [500, 500]), END_OF_0))
    ds.set_epoch(0)
    assert len(list(ds)) == 2
    ds.dataset = dict(MIX)
    ds.set_epoch(1)
    assert list(ds) == []
    assert opened(sent) == [(1, None), "probe", (2, END_OF_0)]
    assert sent[2]["mix"] == [{"dataset": "web", "weight": 0.75}, {"dataset": "code", "weight": 0.25}]


def test_a_resume_inside_an_epoch_with_new_weights_continues_every_cursor_in_later_epochs(sent, answers):
    """``num_workers=0``: a checkpoint inside epoch 0 resumed under .75 / .25; the node goes
    on from its cursors, and epoch 1 opens where epoch 0 ended (before: from a probe, the
    node replaying epoch 0 under .75 / .25 from its start)."""
    inside = mix_state(0, 100, 100, [400, 400])
    end = mix_state(1, 0, 250, [1300, 700])  # 150 steps of 6 web and 2 code samples more
    ds = mixture()
    ds.load_state_dict({"epoch": 0, "stream": inside})
    answers.append(Batches(end))
    assert len(list(ds)) == 1
    ds.set_epoch(1)
    assert list(ds) == []
    assert opened(sent) == [(1, inside), "probe", (2, end)]


def test_an_epoch_left_early_or_run_to_its_end_starts_over_from_its_start(sent, answers):
    """A ``break`` in epoch 1 (resumed at END_OF_0): iterating epoch 1 again starts it over
    at END_OF_0's cursors (before, from a probe). So does iterating it again once it ran to
    its end (not at its end position, which would resume it to nothing; before, from a
    probe: see the next test)."""
    ds = mixture()
    ds.set_epoch(1)
    ds.load_state_dict({"epoch": 0, "stream": END_OF_0})
    answers += [Batches(MID_1, END_OF_1), Batches(MID_1, END_OF_1)]
    it = iter(ds)
    next(it)
    it.close()  # a `break` after one batch
    assert len(list(ds)) == 2
    assert opened(sent) == ["probe", (2, END_OF_0), "probe", (2, END_OF_0)]
    sent.clear()
    assert list(ds) == []
    assert opened(sent) == ["probe", (2, END_OF_0)]


@pytest.mark.parametrize("again", ["iter", "set_epoch"])
def test_a_second_full_pass_over_an_epoch_leaves_where_later_epochs_start(sent, answers, again):
    """r_final20's numbers: epoch 1, resumed at END_OF_0 under .75 / .25, ends at (2500,
    1500); iterated again (after ``set_epoch(1)`` or not), it starts at END_OF_0 again and so
    ends there again, and epoch 2 starts at (2500, 1500). Before, the second pass opened from
    a probe, the node replaying 500 steps under .75 / .25 to (3000, 1000), and that end
    replaced the first pass's: epoch 2 then delivered code's [1000, 1500) again and never
    web's [2500, 3000)."""
    replay_end = mix_state(2, 0, 500, [3000, 1000])

    def stream(req: dict[str, Any]) -> FakeStream:
        """Epoch 1 at END_OF_0 ends at END_OF_1; from a probe's start, at the replay's end."""
        if req["state"] == END_OF_0:
            return Batches(MID_1, END_OF_1)
        if req["state"]["epoch"] == 1:
            return Batches(mix_state(1, 125, 375, [1875, 1125]), replay_end)
        return Batches()

    ds = mixture()
    ds.set_epoch(1)
    ds.load_state_dict({"epoch": 0, "stream": END_OF_0})
    answers.append(stream)
    assert len(list(ds)) == 2
    if again == "set_epoch":
        ds.set_epoch(1)
        assert ds.state_dict() == {"epoch": 1, "stream": END_OF_0}
    assert len(list(ds)) == 2
    ds.set_epoch(2)
    assert ds.state_dict() == {"epoch": 2, "stream": END_OF_1}
    assert list(ds) == []
    assert opened(sent) == ["probe", (2, END_OF_0), "probe", (2, END_OF_0), "probe", (3, END_OF_1)]


def test_a_persistent_worker_starts_the_next_epoch_where_its_iteration_ended(sent, answers, monkeypatch: pytest.MonkeyPatch):
    """Worker 1 of 2 ends epoch 0 at its first index of epoch 1; the main process's
    ``set_epoch(1)`` (the shared epoch) makes its next iteration start there, and the state
    StatefulDataLoader asks for right after ``iter(dataset)`` names it. A position reached in
    another process (the main one's, copied into a worker) is not used."""
    monkeypatch.setattr(swt, "_worker", lambda: (1, 2))
    mine = mix_state(1, 1, 251, [1003, 1005])
    ds = mixture(HALF)  # a worker's state takes no new weights
    answers.append(Batches(mix_state(0, 249, 249, [999, 997]), mine))
    assert len(list(ds)) == 2
    ds._epoch.value = 1  # the main process's set_epoch, seen through the shared epoch
    it = iter(ds)
    assert ds.state_dict() == {"epoch": 1, "stream": mine}
    assert list(it) == []
    assert opened(sent) == [(1, None), "probe", (2, mine)]

    main = mixture(HALF)
    monkeypatch.setattr(swt, "_worker", lambda: (0, 1))
    answers.append(Batches(END_OF_0))
    assert len(list(main)) == 1
    monkeypatch.setattr(swt, "_worker", lambda: (1, 2))  # its copy, in worker 1 of 2
    main._epoch.value = 1
    sent.clear()
    assert list(main) == []
    assert opened(sent)[-1] == (2, {**PROBE, "epoch": 1})


@pytest.mark.parametrize(
    "now",
    ["code", {"code": 0.25, "web": 0.75}, {"web": 0.5, "code": 0.3, "books": 0.2}],
    ids=["one-dataset", "other-order", "other-datasets"],
)
def test_a_mixture_state_is_kept_only_for_the_same_datasets_in_the_same_order(sent, answers, now):
    """Another dataset at an epoch boundary opens from a probe, as before, both from a loaded
    checkpoint and from where the process got to: the node refuses a mixture's state for a
    request of other datasets (``state_mismatch``; before, such a state was kept)."""
    ds = swt._DatasetMixin(now, socket="/nonexistent", batch_size=8, rank=0, world_size=1)
    ds.set_epoch(1)
    ds.load_state_dict({"epoch": 0, "stream": END_OF_0})
    assert ds.state_dict() == {"epoch": 1, "stream": None}
    assert list(ds) == []
    assert opened(sent) == ["probe", (2, {**PROBE, "epoch": 1})]

    sent.clear()
    ds = mixture()
    answers.append(Batches(END_OF_0))
    assert len(list(ds)) == 1
    ds.dataset = now
    ds.set_epoch(1)
    assert list(ds) == []
    assert opened(sent) == [(1, None), "probe", (2, {**PROBE, "epoch": 1})]


@pytest.mark.parametrize("change, value, field", [("batch_size", 16, "global_batch=16"), ("seed", 7, "seed=7")])
def test_a_change_between_epochs_that_the_state_pins_opens_the_next_from_a_probe(sent, answers, change, value, field):
    """The report's trigger, weights unchanged: ``ds.batch_size = 16`` (a batch-size ramp-up)
    or ``ds.seed = 7`` between two epochs of a running process. The probe's fingerprint is not
    the state's, so the epoch opens from the probe, as before the state was kept (with it, the
    first item raised ``state_mismatch`` on ``global_batch`` / ``seed``), with a warning: the
    state carries the weights it was saved under, which a weight change earlier in the run
    would not show, so the SDK cannot tell that the replay reaches the run's cursors."""
    ds = mixture(HALF)
    answers.append(Batches(END_OF_0))
    assert len(list(ds)) == 1
    setattr(ds, change, value)
    ds.set_epoch(1)
    assert ds.state_dict() == {"epoch": 1, "stream": END_OF_0}  # kept until the open checks it
    said = rf"opens from a probe, .*: its fingerprint differs in `{field.split('=')[0]}`.*reaches the run's cursors only if nothing .*changed earlier in the run: samples may repeat or be skipped$"
    with pytest.warns(RuntimeWarning, match=said):
        assert list(ds) == []
    assert opened(sent)[1:] == ["probe", (2, {**FakeStream(sent[1]).probe, "epoch": 1})]
    assert field in sent[2]["state"]["fingerprint"]


def test_a_resume_with_the_same_fingerprint_keeps_the_state_on_another_world_size(sent):
    """What the node compares is the fingerprint, which holds the global batch, not the world
    size: 2 ranks of 4 take the state of 1 rank of 8, under new weights (no warning)."""
    ds = mixture(batch_size=4, rank=1, world_size=2)
    ds.set_epoch(1)
    ds.load_state_dict({"epoch": 0, "stream": END_OF_0})
    assert list(ds) == []
    assert opened(sent) == ["probe", (2, END_OF_0)]
    assert (sent[1]["rank"], sent[1]["world_size"], sent[1]["batch_size"]) == (1, 2, 4)


def test_an_elastic_resume_on_another_global_batch_opens_from_a_probe_with_a_warning(sent):
    """Saved after epoch 0 by 1 rank of 8 (global batch 8), resumed on 2 ranks of 8 with new
    weights: the node refuses the state (``global_batch``: saved 8, the request has 16; before,
    the first item raised that), so epoch 1 opens from the probe, and a warning says the
    probe's start holds no cursors under the changed weights."""
    ds = mixture(rank=0, world_size=2)
    ds.set_epoch(1)
    ds.load_state_dict({"epoch": 0, "stream": END_OF_0})
    said = r"epoch 1 of the mixture \['web', 'code'\] opens from a probe, .*: its fingerprint differs in `global_batch`: saved 8, the request has 16\. .*samples may repeat or be skipped$"
    with pytest.warns(RuntimeWarning, match=said):
        assert list(ds) == []
    assert opened(sent) == ["probe", (2, {**PROBE, "epoch": 1, "fingerprint": fingerprint(16)})]


def test_fixed_weights_are_the_node_s():
    """protocol/src/samples/mix.rs `fixed_weights`: normalised to 2**40, the rounding error to
    the first largest weight."""
    one = 1 << 40
    assert swt._fixed_weights([0.5, 0.5]) == [1 << 39, 1 << 39]  # mix_state's
    assert swt._fixed_weights([0.75, 0.25]) == [3 << 38, 1 << 38]
    assert swt._fixed_weights([3, 1]) == [3 << 38, 1 << 38]
    assert swt._fixed_weights([1.0, 1.0, 1.0]) == [one // 3 + 1, one // 3, one // 3]
    assert swt._fixed_weights([1.0, 1e-30]) == [one - 1, 1]


def test_a_legacy_state_without_block_keys_is_compared_as_the_node_resumes_it():
    """A state saved before the fingerprint named ``NAME.block_keys=global`` resumes with the
    legacy keys, whose fingerprint does not name them (the node's ``BlockKeys::of_state``): the
    probe's field is left out for that dataset only."""
    probe = "v2;mix=a+b;global_batch=8;seed=0;a.shuffle=block;a.block_keys=global;b.shuffle=block;b.block_keys=global"
    legacy_a = "v2;mix=a+b;global_batch=8;seed=0;a.shuffle=block;b.shuffle=block;b.block_keys=global"
    assert swt._resumed_fingerprint(probe, legacy_a, ["a", "b"]) == legacy_a
    assert swt._resumed_fingerprint(probe, probe, ["a", "b"]) == probe


def test_a_worker_s_mixture_state_at_the_epoch_s_start_is_kept(sent, monkeypatch: pytest.MonkeyPatch):
    """A DataLoader worker's position at an epoch's start is its first index there (below the
    worker count): worker 1 of 2 keeps its state at ``{epoch: 1, index: 1}``."""
    monkeypatch.setattr(swt, "_worker", lambda: (1, 2))
    mine = mix_state(1, 1, 251, [1003, 1005])
    ds = mixture(HALF)
    ds.set_epoch(1)
    ds.load_state_dict({"epoch": 0, "stream": mine})
    assert list(ds) == []
    assert opened(sent) == ["probe", (2, mine)]
    assert (sent[1]["worker"], sent[1]["num_workers"]) == (1, 2)


def test_a_worker_s_mixture_state_under_other_weights_opens_from_a_probe_with_a_warning(sent, monkeypatch: pytest.MonkeyPatch):
    """The node refuses new weights for a DataLoader worker's state (each worker is at
    another step): the epoch opens from the probe, and a warning says samples may repeat or
    be skipped (before, the first item raised ``state_mismatch``)."""
    monkeypatch.setattr(swt, "_worker", lambda: (1, 2))
    ds = mixture()
    ds.set_epoch(1)
    ds.load_state_dict({"epoch": 0, "stream": mix_state(1, 1, 251, [1003, 1005])})
    with pytest.warns(RuntimeWarning, match=r"a DataLoader worker's state takes no new weights .*samples may repeat or be skipped$"):
        assert list(ds) == []
    assert opened(sent) == ["probe", (2, {**PROBE, "epoch": 1})]


def test_a_resume_point_moved_to_the_epoch_it_starts_is_kept_by_the_next_iteration(sent):
    """A position kept from an iteration of epoch 0 (one that ended in an error right after
    its last batch, or a worker's load before the main process named epoch 1) when the epoch
    becomes 1 without this copy's ``set_epoch`` (a worker sees the shared epoch change)."""
    ds = mixture()
    ds._resume, ds._resume_epoch = END_OF_0, 0
    ds._epoch.value = 1  # the main process's set_epoch, seen through the shared epoch
    assert ds._start() == (END_OF_0, 1)


@pytest.mark.parametrize(
    "dataset, stream, epoch",
    [
        ("one", {**PROBE, "epoch": 1}, 1),  # one dataset: a probe gives the same start
        (MIX, END_OF_0, 2),  # an epoch later than the state's: that epoch starts whole
        (MIX, mix_state(0, 100, 100, [400, 400]), 1),  # inside epoch 0: epoch 1 wins
    ],
    ids=["one-dataset", "later-epoch", "inside-the-epoch"],
)
def test_other_states_still_give_way_to_the_epoch_set_epoch_names(sent, dataset, stream, epoch):
    ds = swt._DatasetMixin(dataset, socket="/nonexistent", batch_size=8, rank=0, world_size=1)
    ds.load_state_dict({"epoch": 0, "stream": stream})
    ds.set_epoch(epoch)
    assert ds.state_dict() == {"epoch": epoch, "stream": None}
    assert list(ds) == []
    assert opened(sent) == ["probe", (epoch + 1, {**PROBE, "epoch": epoch})]  # the probe, then the epoch


# --- rank and world size come in pairs -----------------------------------------------------


@pytest.mark.parametrize("kw, said", [({"rank": 1}, "rank=1 and world_size=None"), ({"world_size": 4}, "rank=None and world_size=4")])
def test_rank_or_world_size_alone_is_refused_naming_both(kw, said):
    """Before, ``rank=`` alone was paired with the DDP job's global world size (with tensor
    parallelism: every epoch read half the data, silently)."""
    with pytest.raises(ValueError, match=f"^{said}: pass both"):
        swt._DatasetMixin("d", socket="/s", **kw)
    with pytest.raises(ValueError, match=f"^{said}: pass both"):
        swt._ddp_ranks(kw.get("rank"), kw.get("world_size"))  # a forked worker's open
    assert swt._ddp_ranks(1, 4) == (1, 4)


def test_a_spawned_worker_s_dataset_is_refused_with_rank_alone(monkeypatch: pytest.MonkeyPatch):
    """The dataset pickled for a spawned worker fills in the DDP job's rank and world size
    only when both were left out; one set since the dataset was made is refused (before, the
    job's global world size was filled in beside it)."""
    monkeypatch.setattr(multiprocessing.context, "get_spawning_popen", lambda: object())
    monkeypatch.setattr(swt, "_cuda_in_use", lambda: False)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    ds = swt._DatasetMixin("d", socket="/s")
    state = ds.__getstate__()
    assert (state["rank"], state["world_size"]) == (3, 8)
    ds.rank = 1
    with pytest.raises(ValueError, match="^rank=1 and world_size=None: pass both"):
        ds.__getstate__()


# --- epochs are integers >= 0 ----------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True, None, np.float64(2.0)])
def test_an_epoch_that_is_no_integer_at_least_0_is_refused_naming_it(bad):
    """Before, ``set_epoch(-1)`` was taken (batch mode then delivered epochs 0 and 1, or said
    ``epochs`` was 0), and ``1.5`` or ``"2"`` were truncated or parsed."""
    ds = swt._DatasetMixin("d", socket="/s", batch_size=8)
    with pytest.raises(ValueError, match=f"^set_epoch's epoch must be an integer >= 0, not {bad!r}$".replace("(", r"\(").replace(")", r"\)")):
        ds.set_epoch(bad)
    with pytest.raises(ValueError, match=r"^load_state_dict's state\['epoch'\] must be an integer >= 0, not "):
        ds.load_state_dict({"epoch": bad, "stream": None})
    assert ds.epoch == 0 and ds.state_dict() == {"epoch": 0, "stream": None}  # nothing changed


@pytest.mark.parametrize("epochs", [1, 3])
def test_an_epoch_past_what_a_stream_counts_is_refused_naming_it_and_the_bound(epochs):
    """The attach request's ``epochs`` (``epoch + epochs``) is 32 bits. Before,
    ``set_epoch(2**32)`` was taken and the first item raised an error naming ``epochs`` (left
    at 1), and 2**63 and more were truncated by the shared epoch's 64 bits."""
    ds = swt._DatasetMixin("d", socket="/s", batch_size=8, epochs=epochs)
    last = 2**32 - 1 - epochs
    ds.set_epoch(last)
    for bad in (last + 1, 2**32, 2**63, 2**64 + 1):
        said = rf"{bad} with epochs={epochs} ends past the last epoch a stream counts: .*at most 2\*\*32 - 1 \(4294967295, .*so the epoch at most {last}$"
        with pytest.raises(ValueError, match=f"^set_epoch's epoch {said}"):
            ds.set_epoch(bad)
        with pytest.raises(ValueError, match=rf"^load_state_dict's state\['epoch'\] {said}"):
            ds.load_state_dict({"epoch": bad, "stream": None})
        with pytest.raises(ValueError, match=f"^IterableDataset.epoch {said}"):
            ds.epoch = bad
    assert ds.epoch == last
    with pytest.raises(ValueError, match=f"^start_epoch {last + 1} with epochs={epochs} ends past"):
        swt.open_at_epoch(shardwire.Client("/nonexistent/trainer.sock"), "d", start_epoch=last + 1, epochs=epochs)


@pytest.mark.parametrize("mode", ["batch", "shard", "shard-state"])
def test_epochs_raised_after_the_epoch_was_set_is_refused_at_the_open_naming_the_epoch(sent, mode):
    """``ds.epochs = 4`` after ``set_epoch(2**32 - 2)``: the open checks the bound again and
    names the dataset's epoch (before, batch mode's open raised about the sum, "epochs must be
    below 2**32 ..., not 4294967298", as did a shard-mode state, which nothing checked)."""
    kw = {"batch_size": 8} if mode == "batch" else {}
    ds = swt._DatasetMixin("d", socket="/nonexistent", rank=0, world_size=1, **kw)
    epoch = 2**32 - 2
    ds.set_epoch(epoch)
    if mode == "shard-state":
        ds.load_state_dict({"epoch": epoch, "stream": {"epoch": epoch, "index": 3, "seed": 0, "fingerprint": "v1;fp"}})
    ds.epochs = 4
    said = rf"^the dataset's epoch {epoch} with epochs=4 ends past the last epoch a stream counts: .*so the epoch at most {2**32 - 5}$"
    with pytest.raises(ValueError, match=said):
        next(iter(ds))
    assert sent == []  # nothing opened, not even a probe


def test_epochs_alone_past_what_a_stream_counts_is_refused_naming_epochs():
    """Before, "... so the epoch at most -4294967297"."""
    ds = swt._DatasetMixin("d", socket="/s", batch_size=8)
    ds.epochs = 2**33
    said = r"^epochs=8589934592 is more epochs than a stream counts \(set_epoch's epoch is 3\): epoch \+ epochs must be at most 2\*\*32 - 1 \(4294967295, .*so epochs at most 4294967292$"
    with pytest.raises(ValueError, match=said):
        ds.set_epoch(3)
    with pytest.raises(ValueError, match=said.replace("set_epoch's epoch is 3", "start_epoch is 3")):
        swt.open_at_epoch(shardwire.Client("/nonexistent/trainer.sock"), "d", start_epoch=3, epochs=2**33)


def test_numpy_integer_epochs_are_taken():
    ds = swt._DatasetMixin("d", socket="/s", batch_size=8)
    ds.set_epoch(np.int64(3))
    assert ds.epoch == 3 and type(ds.state_dict()["epoch"]) is int
    ds.load_state_dict({"epoch": np.uint32(5), "stream": None})
    assert ds.epoch == 5


# --- _connect closes its socket on an interrupt ---------------------------------------------


@pytest.mark.parametrize("connected", [False, True], ids=["in-connect", "as-connect-returns"])
def test_connect_closes_its_socket_when_interrupted(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path, connected):
    """A KeyboardInterrupt in the blocking connect, or as it returns: the socket is closed
    before the interrupt goes on (before, only OSErrors closed it)."""
    path = str(tmp_path / "trainer.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    made: list[socket.socket] = []
    real = _client._send_timeout

    def send_timeout(sock: socket.socket, seconds: float) -> None:
        made.append(sock)
        if (seconds == 0) == connected:  # the first call is before connect, the second after
            raise KeyboardInterrupt
        real(sock, seconds)

    monkeypatch.setattr(_client, "_send_timeout", send_timeout)
    try:
        with pytest.raises(KeyboardInterrupt):
            _client._connect(path)
        assert made and made[0].fileno() == -1
        if connected:  # the node's side sees the connection closed
            peer, _ = listener.accept()
            with peer:
                peer.settimeout(5)
                assert peer.recv(1) == b""
    finally:
        listener.close()
