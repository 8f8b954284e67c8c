"""The pool's loop keeps a big fleet busy: 100 fake workers (bench/pool_sim.py: virtual workers on a
few async actors, real Ray streams) at 1 s per batch."""

from bench.pool_sim import simulate


def test_a_hundred_fake_workers_wait_for_work_under_3_percent_of_the_time(ray_cluster):
    result = simulate(workers=100, batch_seconds=1.0, batches=3, shards_per_worker=2, hosts=2)
    assert result["workers_that_ran"] == 100
    assert result["shards_reported"] == 200 and result["batch_events"] >= 200 * 3  # every event came through
    assert result["wall_seconds"] < result["ideal_seconds"] + 3  # stragglers' copies stop at the first commit
    assert result["busy_fraction"] >= 0.97, result
    assert result["dispatch_ms"]["p99"] < 500, result
    assert result["driver_dispatch_ms"]["median"] < 50, result  # the loop itself: a result to the next shard
