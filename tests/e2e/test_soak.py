"""A short stream-churn soak without any /metrics scraper (see soak.py): the node's RSS slope
stays flat. Before the fix the Prometheus recorder kept every histogram sample until a scrape
and RSS grew linearly with the hand-offs. `scripts/soak SECONDS` runs the long version."""

from soak import churn, soak_dataset, warmup_end

from conftest import wait_ready

#: The node's RssAnon climbs to a plateau in its first ~10 s of churn (allocator arenas, thread
#: stacks of trainer connections); on a busy 2-core host that can take longer, up to 30 s. The
#: warm-up ends once RssAnon has set no new maximum for WARMUP_QUIET seconds, at WARMUP_LEAST
#: seconds at the earliest and WARMUP_MOST at the latest (a leak sets a new maximum every
#: second, so it runs the warm-up to WARMUP_MOST and is then fitted over the same window). A
#: rise left over from a warm-up that ended early lands at the start of the window, where it
#: does not tilt the Theil-Sen slope (a 1 MiB step in the window's first or last quarter gives
#: a median pairwise slope of 0). 6 s rather than 5: in a simulation of a climb that lasts 25 s
#: under 1 MiB swings, 5 s of quiet ended some warm-ups mid-climb (slopes up to 5.5 MiB/min);
#: 6 s did not (at most 2.5).
WARMUP_QUIET = 6
WARMUP_LEAST = 10
WARMUP_MOST = 30
#: Seconds of churn fitted after the warm-up: with a plateau at ~10 s the test takes ~60 s (it
#: took 75 s with a fixed 30 s warm-up; 80 s at most now).
WINDOW = 45
#: MiB/min over WINDOW seconds. The long soak's target is 0.5 (scripts/soak 600); 45 s on a
#: shared 2-core machine is noisier: RssAnon swings by about 1 MiB around its plateau over tens
#: of seconds (one run: 8.4 MiB at 30 s, 9.5 at 63 s, 8.7 at 74 s, slope +1.04), and one
#: full-suite run measured +1.80 while ending at the same 9.4 MiB as passing runs. The leak
#: this test exists for (the recorder keeping every sample until a scrape) measured +27.4
#: MiB/min, nine times this bound. (A shorter window would need a looser bound: a bounded swing
#: tilts the slope in proportion to 1/window, and a leak of a few MiB/min would pass.)
MAX_SLOPE = 3.0
#: Hand-offs per second the churn must reach for growth to show: the 20 000 batches in 75 s
#: this test asked for before, per second of the (now adaptive) run.
MIN_BATCHES_PER_SECOND = 20_000 / 75


def fitted_enough(samples) -> bool:
    """True once the warm-up has ended and WINDOW seconds were sampled after it."""
    end = warmup_end(samples, WARMUP_QUIET, WARMUP_LEAST, WARMUP_MOST)
    return end is not None and samples[-1][0] >= end + WINDOW


def test_churn_without_a_scraper_keeps_memory_flat(sw, tmp_path):
    d = soak_dataset(tmp_path / "soak")
    src = sw.source({"soak": d})
    node = sw.serve([src], "--stream-memory", "4MiB", "--pool-size", "64MiB")
    wait_ready(node)
    # WARMUP_MOST + WINDOW caps the run (a warm-up that never settles); +5 s for sampling lag.
    res = churn(node.pid, node.socket, "soak", WARMUP_MOST + WINDOW + 5, clients=4, done=fitted_enough)
    warmup = warmup_end(res.samples, WARMUP_QUIET, WARMUP_LEAST, WARMUP_MOST)
    assert warmup is not None, f"the warm-up did not end within {res.seconds:.0f} s: {res.samples}"
    summary = res.summary(warmup)
    print(summary)
    assert not res.errors, f"{len(res.errors)} client errors, first: {res.errors[:3]}"
    assert res.batches > MIN_BATCHES_PER_SECOND * res.seconds, f"the churn was too light to show growth: {summary}"
    assert res.samples[-1][0] - warmup >= WINDOW - 1, f"fewer than {WINDOW} s were fitted: {summary}"
    assert res.slope_mib_per_min(warmup) < MAX_SLOPE, summary
    assert node.alive()
