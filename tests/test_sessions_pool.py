"""The RAM pool for local (SWA) state: TTL by an injected clock, LRU by bytes, and
the resume plan (hit: continue exactly; miss: replay the last window)."""

import pytest

from sessions import LocalStatePool, plan_resume


class FakeClock:
    """A test double for time.monotonic that moves only when told."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_ttl_expires_and_hits_refresh():
    clock = FakeClock()
    pool = LocalStatePool(ttl_s=60, max_bytes=100, clock=clock)
    pool.put("a", "state-a", 10)
    clock.t = 50
    assert pool.get("a") == "state-a"  # refreshes to 110
    clock.t = 109
    assert pool.get("a") == "state-a"
    clock.t = 200
    assert pool.get("a") is None
    assert pool.stats()["expirations"] == 1 and pool.stats()["bytes"] == 0


def test_lru_eviction_by_bytes():
    pool = LocalStatePool(ttl_s=60, max_bytes=100, clock=FakeClock())
    pool.put("a", 1, 40)
    pool.put("b", 2, 40)
    pool.get("a")  # b is now least recently used
    pool.put("c", 3, 40)
    assert pool.get("b") is None and pool.get("a") == 1 and pool.get("c") == 3
    s = pool.stats()
    assert s["evictions"] == 1 and s["bytes"] == 80 and s["entries"] == 2


def test_oversized_entry_is_rejected_and_put_replaces():
    pool = LocalStatePool(ttl_s=60, max_bytes=100, clock=FakeClock())
    assert pool.put("a", 1, 30)
    assert pool.put("a", 2, 50) and pool.stats()["bytes"] == 50
    assert not pool.put("big", 0, 101) and pool.get("big") is None
    with pytest.raises(ValueError):
        LocalStatePool(ttl_s=0, max_bytes=1)


def test_position_mismatch_is_a_miss():
    pool = LocalStatePool(ttl_s=60, max_bytes=100, clock=FakeClock())
    pool.put("s", "rings@300", 10, position=300)
    assert pool.get("s", position=301) is None
    assert pool.get("s", position=300) == "rings@300"


def test_plan_resume_hit_and_miss():
    pool = LocalStatePool(ttl_s=60, max_bytes=100, clock=FakeClock())
    pool.put("s", "rings", 10, position=300)
    hit = plan_resume(pool, "s", kv_tokens=300, window=128)
    assert (hit.local_state, hit.replay_from, hit.prefill_from) == ("rings", None, 300)
    miss = plan_resume(pool, "s", kv_tokens=256, window=128)
    assert (miss.local_state, miss.replay_from, miss.prefill_from) == (None, 128, 256)
    assert plan_resume(pool, "new", kv_tokens=50, window=128).replay_from == 0
