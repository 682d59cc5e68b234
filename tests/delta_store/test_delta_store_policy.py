"""The cache policy's decisions on scripted request sequences (no I/O, explicit clock)."""

import math

import pytest

from bitdelta.cache_policy import WeightedLRUPolicy

MB = 1 << 20


def fill(policy: WeightedLRUPolicy, requests: list[tuple[float, str]], size: int = 10 * MB) -> None:
    """Play requests; each miss is admitted (evicting what the policy says), as the cache does."""
    for now, key in requests:
        policy.record(key, now)
        if key in policy.resident:
            continue
        victims = policy.plan(key, size, now)
        assert victims is not None
        for v in victims:
            policy.remove(v)
        policy.add(key, size)


def test_rate_weighting_beats_recency():
    # Budget for 3. A is requested 5 times, then B and C once each, later than A.
    p = WeightedLRUPolicy(30 * MB, half_life_s=60)
    fill(p, [(0, "A"), (1, "A"), (2, "A"), (3, "A"), (4, "A"), (5, "B"), (6, "C")])
    p.record("D", 7)
    # Plain LRU would evict A (touched least recently); weighted by rate, B goes.
    assert p.plan("D", 10 * MB, 7) == ["B"]
    assert p.score("A", 7) > p.score("C", 7) > p.score("B", 7)


def test_tiny_half_life_is_plain_lru():
    p = WeightedLRUPolicy(30 * MB, half_life_s=1e-3)
    fill(p, [(0, "A"), (1, "A"), (2, "A"), (3, "A"), (4, "A"), (5, "B"), (6, "C")])
    p.record("D", 7)
    assert p.plan("D", 10 * MB, 7) == ["A"]


def test_a_key_that_stops_being_requested_sinks():
    p = WeightedLRUPolicy(30 * MB, half_life_s=10)
    fill(p, [(0, "A"), (0.5, "A"), (1, "A"), (1.5, "A"), (2, "A")])  # A was hot...
    fill(p, [(t, k) for t in range(60, 120, 2) for k in ("B", "C")])  # ...then only B and C are used
    p.record("D", 121)
    assert p.plan("D", 10 * MB, 121) == ["A"]


def test_rate_is_requests_per_second():
    p = WeightedLRUPolicy(MB, half_life_s=30)
    for i in range(600):  # 2 requests per second for 5 minutes
        p.record("A", i / 2)
    assert p.rate("A", 299.5) == pytest.approx(2.0, rel=0.05)
    # One half-life later with no requests, the rate has halved.
    assert p.rate("A", 329.5) == pytest.approx(1.0, rel=0.05)


def test_order_only_changes_with_requests():
    p = WeightedLRUPolicy(MB, half_life_s=5)
    p.record("A", 0)
    p.record("A", 1)
    p.record("B", 2)
    for now in (2, 10, 100, 1000):
        assert p.score("A", now) > p.score("B", now)  # both decay alike
    assert p.score("A", 1e5) == p.score("B", 1e5) == 0.0  # underflowed...
    p.record("C", 1e5)
    p.add("A", MB // 2)
    p.add("B", MB // 2)
    assert p.plan("C", MB // 2, 1e5) == ["B"]  # ...yet A still ranks above B
    p.record("B", 1e5 + 1)
    assert p.plan("C", MB // 2, 1e5 + 1) == ["A"]  # until B is requested again


def test_pinning_protects_the_hottest_from_a_big_newcomer():
    # Budget for 4 small; A and B are hot, C and D lukewarm; a big delta E needs the room of 3.
    script = [(t, "A") for t in range(0, 10)] + [(t + 0.5, "B") for t in range(0, 8)] + [(11, "C"), (12, "D")]
    unpinned = WeightedLRUPolicy(40 * MB, half_life_s=60)
    fill(unpinned, script)
    unpinned.record("E", 13)
    assert unpinned.plan("E", 30 * MB, 13) == ["C", "D", "B"]  # B, though hot, goes too

    pinned = WeightedLRUPolicy(40 * MB, half_life_s=60, pin_top_n=2)
    fill(pinned, script)
    pinned.record("E", 13)
    assert pinned.pinned(13) == {"A", "B"}
    assert pinned.plan("E", 30 * MB, 13) is None  # only C and D may go: not enough; E is served uncached
    assert pinned.plan("E", 20 * MB, 13) == ["C", "D"]


def test_pinned_set_follows_traffic():
    p = WeightedLRUPolicy(40 * MB, half_life_s=10, pin_top_n=1)
    fill(p, [(0, "A"), (1, "A"), (2, "B")])
    assert p.pinned(2) == {"A"}
    fill(p, [(t, "B") for t in range(3, 30)])  # B becomes the hot one
    assert p.pinned(30) == {"B"}


def test_busy_keys_are_never_victims_and_too_big_is_refused():
    p = WeightedLRUPolicy(20 * MB, half_life_s=60)
    fill(p, [(0, "A"), (1, "B")])
    p.record("C", 2)
    assert p.plan("C", 10 * MB, 2) == ["A"]
    assert p.plan("C", 10 * MB, 2, busy={"A"}) == ["B"]
    assert p.plan("C", 10 * MB, 2, busy={"A", "B"}) is None
    assert p.plan("C", 21 * MB, 2) is None  # larger than the whole budget
    assert p.plan("C", 0, 2) == []


def test_replacing_a_resident_key_does_not_evict_itself():
    p = WeightedLRUPolicy(20 * MB, half_life_s=60)
    fill(p, [(0, "A"), (1, "B")])
    p.record("A", 2)
    assert p.plan("A", 10 * MB, 2) == []  # its old copy's room counts as free
    assert p.plan("A", 15 * MB, 2) == ["B"]


def test_request_history_is_bounded():
    p = WeightedLRUPolicy(MB, half_life_s=60, max_tracked=100)
    for i in range(1000):
        p.record(f"k{i}", i)
    assert len(p._stats) <= 100
    assert p.score("k999", 999) == 1.0


def test_bad_arguments():
    with pytest.raises(ValueError):
        WeightedLRUPolicy(-1)
    with pytest.raises(ValueError):
        WeightedLRUPolicy(1, half_life_s=0)
    with pytest.raises(ValueError):
        WeightedLRUPolicy(1, pin_top_n=-1)
    assert math.isclose(WeightedLRUPolicy(1).rate("never", 0), 0.0)
