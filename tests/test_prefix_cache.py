"""The local engine's prefix cache: fixed-size token blocks under a byte bound, LRU eviction tail blocks first,
hits on what is left after a partial eviction, stale entries dropped on weight updates, the default bound."""
from __future__ import annotations

import collections
import random

import torch

from core.config import InferenceConfig
from inference_server.engine import LocalEngine, SamplingParams
from inference_server.kvcache import PrefixCache, auto_cache_bytes
from tests.test_inference_engine import DC, GREEDY, assert_close, engines, make_model, rand_prompt, ref_greedy  # noqa: F401

LAYERS, HKV, HD = 2, 2, 3


def _kv(n: int, tag: float) -> list:
    """Per-layer (k, v) [HKV, n, HD] whose values name (layer, k/v, head, position): checks the blocks' contents."""
    pos = torch.arange(n, dtype=torch.float32)[None, :, None].expand(HKV, n, HD)
    head = torch.arange(HKV, dtype=torch.float32)[:, None, None]
    return [(tag + 1000 * layer + 100 * head + pos, -(tag + 1000 * layer + 100 * head + pos)) for layer in range(LAYERS)]


class RefCache:
    """The slow reference: {key: tokens held}, least recently used first; over the byte bound the LRU entry loses
    its last block (a whole one, or the shorter tail), entry by entry; over capacity the LRU entry goes whole."""

    def __init__(self, capacity: int, max_bytes: int, bt: int, tok_bytes: int):
        self.cap, self.max, self.bt, self.tb = capacity, max_bytes, bt, tok_bytes
        self.d: collections.OrderedDict[str, int] = collections.OrderedDict()

    def bytes(self) -> int:
        return sum(self.d.values()) * self.tb

    def get(self, k):
        if k in self.d:
            self.d.move_to_end(k)

    def put(self, k, n):
        self.d.pop(k, None)
        self.d[k] = n
        while len(self.d) > self.cap:
            self.d.popitem(last=False)
        while self.bytes() > self.max:
            lru = next(iter(self.d))
            n = self.d[lru]
            n -= (n % self.bt) or self.bt
            if n:
                self.d[lru] = n
            else:
                del self.d[lru]


def test_eviction_order_and_byte_bound_match_the_reference():
    bt, tok_bytes = 8, LAYERS * 2 * HKV * HD * 4
    for seed in range(6):
        rng = random.Random(seed)
        cap, max_bytes = rng.choice([3, 6, 100]), rng.randrange(20, 200) * tok_bytes
        c, ref = PrefixCache(cap, max_bytes, bt), RefCache(cap, max_bytes, bt, tok_bytes)
        for step in range(300):
            k = f"t{rng.randrange(10)}"
            if rng.random() < 0.4:
                e = c.get(k)
                ref.get(k)
                assert (e is not None) == (k in ref.d)
            else:
                n = rng.randrange(1, 90)
                c.put(k, list(range(n)), _kv(n, step), 0)
                ref.put(k, n)
            assert list(c._d) == list(ref.d), (seed, step)  # same entries, same recency order
            assert {key: len(e.ids) for key, e in c._d.items()} == ref.d
            assert c.nbytes == ref.bytes() <= max_bytes
            assert c.nbytes == sum(b.numel() * b.element_size() for e in c._d.values() for b in e.blocks)
        assert c.evicted_blocks > 0


def test_blocks_hold_the_kv_and_a_prefix_comes_back_exactly():
    c = PrefixCache(10, 1 << 20, 4)
    kv = _kv(11, 7.0)
    c.put("a", list(range(11)), kv, 3)
    e = c.get("a")
    assert [b.shape[3] for b in e.blocks] == [4, 4, 3] and e.version == 3
    for n in (1, 4, 5, 11):
        got = e.kv(n)
        for (k, v), (k0, v0) in zip(got, kv):
            assert torch.equal(k, k0[:, :n]) and torch.equal(v, v0[:, :n])
    # The copy outlives the entry: evicting it does not change what a request already took.
    got = e.kv(11)
    c.pop("a")
    assert torch.equal(got[1][0], kv[1][0]) and c.nbytes == 0 and len(c) == 0


def test_hit_after_partial_eviction_reuses_the_remaining_blocks(engines):
    m = make_model(0)
    tok_bytes = DC.num_hidden_layers * 2 * DC.num_key_value_heads * (DC.hidden_size // DC.num_attention_heads) * 4
    # Room for 40 tokens of KV in blocks of 8.
    cached = engines(m, cache_block_tokens=8, cache_max_bytes=40 * tok_bytes)
    plain = engines(m, cache_capacity=0)
    rng = random.Random(11)
    sp = SamplingParams(max_new_tokens=10, **GREEDY)
    pa, pb = rand_prompt(rng, 20), rand_prompt(rng, 12)
    a1 = cached.generate(pa, sp, trajectory_id="a")           # 29 tokens cached: blocks 8 8 8 5
    assert cached.metrics()["cache_bytes"] == 29 * tok_bytes
    cached.generate(pb, SamplingParams(max_new_tokens=8, **GREEDY), trajectory_id="b")  # +19 tokens: over 40
    mt = cached.metrics()
    # "a" (least recently used) lost its tail: the 5-token block, then one 8-token block; "b" is whole.
    assert mt["cache_entries"] == 2 and mt["cache_evicted_blocks"] == 2
    assert mt["cache_bytes"] == (16 + 19) * tok_bytes <= mt["cache_max_bytes"]
    p2 = pa + a1.output_ids + rand_prompt(rng, 6)
    a2, ref = cached.generate(p2, sp, trajectory_id="a"), plain.generate(p2, sp, trajectory_id="a")
    assert a2.cached_tokens == 16 and ref.cached_tokens == 0  # the two whole blocks left, not nothing
    assert a2.output_ids == ref.output_ids == ref_greedy(m, p2, 10)[0]
    assert_close(a2.logprobs, ref.logprobs)


def test_byte_bound_holds_under_many_trajectories(engines):
    tok_bytes = DC.num_hidden_layers * 2 * DC.num_key_value_heads * (DC.hidden_size // DC.num_attention_heads) * 4
    e = engines(cache_block_tokens=16, cache_max_bytes=300 * tok_bytes)
    rng = random.Random(5)
    futs = [e.submit(rand_prompt(rng, rng.randrange(5, 60)), SamplingParams(max_new_tokens=rng.randrange(1, 20)),
                     trajectory_id=f"t{i}") for i in range(40)]
    for f in futs:
        f.result(60)
    mt = e.metrics()
    assert 0 < mt["cache_bytes"] <= 300 * tok_bytes and mt["cache_evicted_blocks"] > 0


def test_weight_updates_drop_entries_no_request_can_use(engines):
    new, newer = make_model(1), make_model(2)
    e = engines(make_model(0))
    rng = random.Random(9)
    sp = SamplingParams(max_new_tokens=4, **GREEDY)
    for t in "abc":
        e.generate(rand_prompt(rng, 10), sp, trajectory_id=t)
    assert e.metrics()["cache_entries"] == 3
    e.update_weights(1, state_dict=new.hf_state_dict())
    assert e.metrics()["cache_entries"] == 3  # one version of grace: a caller may still raise its budget
    e.update_weights(2, state_dict=newer.hf_state_dict())
    mt = e.metrics()
    assert mt["cache_entries"] == 0 and mt["cache_bytes"] == 0 and mt["cache_dropped_stale"] == 3


def test_a_larger_staleness_budget_keeps_entries(engines):
    e = engines(make_model(0))
    rng = random.Random(10)
    p = rand_prompt(rng, 10)
    a1 = e.generate(p, SamplingParams(max_new_tokens=4, **GREEDY), trajectory_id="a", max_stale_versions=3)
    for v in (1, 2, 3):
        e.update_weights(v, state_dict=make_model(v).hf_state_dict())
    assert e.metrics()["cache_entries"] == 1  # 3 versions old, within the budget seen (3) plus grace
    a2 = e.generate(p + a1.output_ids, SamplingParams(max_new_tokens=2, **GREEDY), trajectory_id="a", max_stale_versions=3)
    assert a2.cached_tokens == len(p) + 3


def test_default_bound_is_derived_from_available_memory():
    avail = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemAvailable:"))
    got = auto_cache_bytes()
    assert 64 << 20 <= got <= 4 << 30
    if avail * 0.1 < 4 << 30:
        assert abs(got - avail * 0.1) < 0.2 * avail * 0.1
    e = LocalEngine(InferenceConfig(max_context=64), make_model(0))
    try:
        assert InferenceConfig().cache_max_bytes == 0 and 64 << 20 <= e.metrics()["cache_max_bytes"] <= 4 << 30
    finally:
        e.close()
    # A bound given in config is taken as is.
    e = LocalEngine(InferenceConfig(max_context=64, cache_max_bytes=12345), make_model(0))
    try:
        assert e.metrics()["cache_max_bytes"] == 12345
    finally:
        e.close()


def test_bad_cache_settings_are_refused_with_their_names():
    import pytest

    for kw, name in (({"cache_max_bytes": -1}, "cache_max_bytes"), ({"cache_block_tokens": 0}, "cache_block_tokens")):
        with pytest.raises(ValueError, match=name):
            LocalEngine(InferenceConfig(max_context=64, **kw), make_model(0))
