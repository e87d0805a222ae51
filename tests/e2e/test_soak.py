"""A short stream-churn soak without any /metrics scraper (see soak.py): the node's RSS slope
stays flat. Before the fix the Prometheus recorder kept every histogram sample until a scrape
and RSS grew linearly with the hand-offs. `scripts/soak SECONDS` runs the long version."""

from soak import churn, soak_dataset

from conftest import wait_ready

SECONDS = 75
#: The node's RssAnon climbs to a plateau in its first ~10 s of churn (allocator arenas, thread
#: stacks of trainer connections); on a busy 2-core host that can take longer: 30 s.
WARMUP = 30
#: MiB/min. The long soak's target is 0.5 (scripts/soak 600); 45 s on a shared 2-core machine
#: is noisier: RssAnon swings by about 1 MiB around its plateau over tens of seconds (one run:
#: 8.4 MiB at 30 s, 9.5 at 63 s, 8.7 at 74 s, slope +1.04), and one full-suite run measured
#: +1.80 while ending at the same 9.4 MiB as passing runs. The leak this test exists for (the
#: recorder keeping every sample until a scrape) measured +27.4 MiB/min, nine times this bound.
MAX_SLOPE = 3.0


def test_churn_without_a_scraper_keeps_memory_flat(sw, tmp_path):
    d = soak_dataset(tmp_path / "soak")
    src = sw.source({"soak": d})
    node = sw.serve([src], "--stream-memory", "4MiB", "--pool-size", "64MiB")
    wait_ready(node)
    res = churn(node.pid, node.socket, "soak", SECONDS, clients=4)
    summary = res.summary(WARMUP)
    print(summary)
    assert not res.errors, f"{len(res.errors)} client errors, first: {res.errors[:3]}"
    assert res.batches > 20_000, f"the churn was too light to show growth: {summary}"
    assert res.slope_mib_per_min(WARMUP) < MAX_SLOPE, summary
    assert node.alive()
