"""LocalEngine against a slow reference (full-sequence forward, no cache): batching, prefix cache, weight updates."""
from __future__ import annotations

import concurrent.futures
import math
import random
import threading
import time

import pytest
import torch

from inference_server.engine import LocalEngine, QueueFull, SamplingParams, WeightLoadError
from core.config import InferenceConfig
from core.model import CausalLM, DecoderConfig

DC = DecoderConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=512)
GREEDY = dict(temperature=0.0)


def make_model(seed: int = 0) -> CausalLM:
    return CausalLM(DC).init_weights(seed, std=0.1).eval()


@pytest.fixture
def engines():
    made = []

    def make(model=None, version=0, start=True, **kw):
        e = LocalEngine(InferenceConfig(**{"max_context": 256, **kw}), model or make_model(0), version=version, start=start)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


@torch.inference_mode()
def ref_greedy(model: CausalLM, ids: list[int], n: int, stop=()) -> tuple[list[int], list[float]]:
    """Greedy decoding by re-running the whole sequence every token; logprobs under T=1."""
    ids, out, lps = list(ids), [], []
    for _ in range(n):
        logits, _ = model(torch.tensor([ids]))
        lp = torch.log_softmax(logits[0, -1].float(), -1)
        t = int(lp.argmax())
        out.append(t)
        lps.append(float(lp[t]))
        ids.append(t)
        if t in stop:
            break
    return out, lps


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, DC.vocab_size) for _ in range(n)]


def assert_close(a: list[float], b: list[float], tol: float = 1e-4):
    assert len(a) == len(b)
    assert max((abs(x - y) for x, y in zip(a, b)), default=0.0) < tol


def test_greedy_matches_reference(engines):
    m = make_model(0)
    e = engines(m)
    rng = random.Random(0)
    for n in (1, 7, 30):
        p = rand_prompt(rng, n)
        out = e.generate(p, SamplingParams(max_new_tokens=12, **GREEDY))
        want, lps = ref_greedy(m, p, 12)
        assert out.output_ids == want
        assert_close(out.logprobs, lps)
        assert out.versions == [0] * 12 and out.finish_reason == "length" and out.prompt_tokens == n


def test_stop_token_ends_and_is_included(engines):
    m = make_model(0)
    e = engines(m)
    p = rand_prompt(random.Random(1), 10)
    want, _ = ref_greedy(m, p, 10)
    stop = want[3]
    k = want.index(stop)
    out = e.generate(p, SamplingParams(max_new_tokens=10, stop_token_ids=(stop,), **GREEDY))
    assert out.output_ids == want[: k + 1] and out.finish_reason == "stop"


def test_sampling_seeded_and_logprobs_are_behaviour_logprobs(engines):
    m = make_model(0)
    e = engines(m)
    p = rand_prompt(random.Random(2), 9)
    sp = SamplingParams(max_new_tokens=16, temperature=0.7, top_k=40, top_p=0.95, seed=1234)
    a, b = e.generate(p, sp), e.generate(p, sp)
    assert a.output_ids == b.output_ids  # same seed, same tokens
    with torch.inference_mode():
        full = torch.tensor([p + a.output_ids])
        want = m.token_logprobs(full, temperature=0.7)[0, len(p):].tolist()
    assert_close(a.logprobs, want)
    # top_k=1 collapses sampling onto greedy.
    one = e.generate(p, SamplingParams(max_new_tokens=8, temperature=1.3, top_k=1))
    assert one.output_ids == ref_greedy(m, p, 8)[0]


def test_prefix_cache_multiturn_same_results(engines):
    m = make_model(0)
    cached, plain = engines(m), engines(m, cache_capacity=0)
    rng = random.Random(3)
    p1 = rand_prompt(rng, 20)
    sp = SamplingParams(max_new_tokens=10, **GREEDY)
    a1, b1 = cached.generate(p1, sp, trajectory_id="t"), plain.generate(p1, sp, trajectory_id="t")
    assert a1.output_ids == b1.output_ids and a1.cached_tokens == 0
    p2 = p1 + a1.output_ids + rand_prompt(rng, 6)  # the next turn extends the conversation
    a2, b2 = cached.generate(p2, sp, trajectory_id="t"), plain.generate(p2, sp, trajectory_id="t")
    assert a2.cached_tokens == len(p1) + len(a1.output_ids) - 1 and b2.cached_tokens == 0
    assert a2.output_ids == b2.output_ids == ref_greedy(m, p2, 10)[0]
    assert_close(a2.logprobs, b2.logprobs)
    # A rewritten history still reuses the common prefix.
    p3 = p2[:15] + rand_prompt(rng, 12)
    a3 = cached.generate(p3, sp, trajectory_id="t")
    assert a3.cached_tokens == 15 + (p3[15] == p2[15])
    assert a3.output_ids == ref_greedy(m, p3, 10)[0]
    mt = cached.metrics()
    assert mt["cache_hit_tokens"] == a2.cached_tokens + a3.cached_tokens and mt["cache_entries"] == 1


def test_concurrent_batching_matches_one_at_a_time(engines):
    m = make_model(0)
    e = engines(m)
    rng = random.Random(4)
    prompts = [rand_prompt(rng, rng.randrange(1, 60)) for _ in range(8)]
    lens = [3 + 4 * i for i in range(8)]
    futs = [e.submit(p, SamplingParams(max_new_tokens=n, **GREEDY)) for p, n in zip(prompts[:4], lens[:4])]
    futs[0].result(10)  # the rest join a batch that is already decoding
    futs += [e.submit(p, SamplingParams(max_new_tokens=n, **GREEDY)) for p, n in zip(prompts[4:], lens[4:])]
    for p, n, f in zip(prompts, lens, futs):
        out = f.result(30)
        want, lps = ref_greedy(m, p, n)
        assert out.output_ids == want
        assert_close(out.logprobs, lps)
    assert e.metrics()["batch_mean"] > 1.5


def _update_at(e: LocalEngine, k: int, version: int, sd: dict):
    """An on_token callback that queues a weight update right after the k-th token (applied before token k+1)."""
    fired = []

    def cb(tok, lp, v):
        fired.append(tok)
        if len(fired) == k:
            fired.append(e.update_weights(version, state_dict=sd, wait=False))

    return cb, fired


def test_weight_update_mid_generation_recomputes(engines):
    old, new = make_model(0), make_model(1)
    e = engines(make_model(0))  # the engine's own copy: updates overwrite its parameters in place
    p = rand_prompt(random.Random(5), 12)
    cb, fired = _update_at(e, 5, 1, new.hf_state_dict())
    out = e.submit(p, SamplingParams(max_new_tokens=30, **GREEDY), on_token=cb).result(30)
    assert out.versions == [0] * 5 + [1] * 25
    assert out.output_ids[:5] == ref_greedy(old, p, 5)[0]
    want, lps = ref_greedy(new, p + out.output_ids[:5], 25)
    assert out.output_ids[5:] == want
    assert_close(out.logprobs[5:], lps)
    assert out.interruptions == 1 and out.recomputed_tokens == len(p) + 5
    info = fired[5].result(5)
    assert info["version"] == 1 and info["interrupted_requests"] == 1 and info["recomputed_requests"] == 1
    assert e.version == 1 and e.metrics()["recomputed_tokens"] == len(p) + 5


@torch.inference_mode()
def test_weight_update_keeps_stale_kv_within_budget(engines):
    old, new = make_model(0), make_model(1)
    e = engines(make_model(0))  # the engine's own copy: updates overwrite its parameters in place
    p = rand_prompt(random.Random(6), 12)
    cb, _ = _update_at(e, 5, 1, new.hf_state_dict())
    out = e.submit(p, SamplingParams(max_new_tokens=20, **GREEDY), max_stale_versions=1, on_token=cb).result(30)
    assert out.versions == [0] * 5 + [1] * 15 and out.recomputed_tokens == 0 and out.interruptions == 1
    # Reference: the old weights' KV of everything fed before the update, new weights from there on.
    seq = p + out.output_ids[:4]
    _, past = old(torch.tensor([seq]))
    tok, pos, want = out.output_ids[4], len(seq), []
    for _ in range(15):
        logits, past = new(torch.tensor([[tok]]), positions=torch.tensor([[pos]]), past=past)
        tok, pos = int(logits[0, -1].argmax()), pos + 1
        want.append(tok)
    assert out.output_ids[5:] == want
    assert e.metrics()["stale_kv_kept"] == 1


def test_prefix_cache_respects_versions(engines):
    old, new = make_model(0), make_model(1)
    e = engines(make_model(0))  # the engine's own copy: updates overwrite its parameters in place
    rng = random.Random(7)
    sp = SamplingParams(max_new_tokens=6, **GREEDY)
    pa, pb = rand_prompt(rng, 10), rand_prompt(rng, 10)
    a1, b1 = e.generate(pa, sp, trajectory_id="a"), e.generate(pb, sp, trajectory_id="b")
    e.update_weights(1, state_dict=new.hf_state_dict())
    a2 = e.generate(pa + a1.output_ids + [5], sp, trajectory_id="a")  # default budget 0: recompute
    b2 = e.generate(pb + b1.output_ids + [5], sp, trajectory_id="b", max_stale_versions=1)
    assert a2.cached_tokens == 0 and b2.cached_tokens == len(pb) + 5
    assert a2.output_ids == ref_greedy(new, pa + a1.output_ids + [5], 6)[0]


def test_installed_weights_are_not_kept_by_an_idle_engine(engines):
    """The scheduler loop held the last update (its whole state dict, or the mapping of a shm segment) until its next
    take, which an idle engine does only when a request comes: one extra copy of the weights for as long as it idles."""
    import gc
    import weakref

    from core.proc import wait_for

    e = engines(make_model(0))
    sd = make_model(1).hf_state_dict()
    ref = weakref.ref(next(iter(sd.values())))
    assert e.update_weights(1, state_dict=sd)["version"] == 1
    del sd
    wait_for(lambda: gc.collect() >= 0 and ref() is None, 10, "the update's tensors freed", every=0.05)


def test_an_update_waiting_for_another_gives_up_at_its_deadline_and_is_never_installed(engines):
    """A second update waited for the first (reading its weights) with no deadline: its RPC timed out, and it was
    installed later all the same. It now waits at most its timeout and is then refused for good (UpdateBusy)."""
    from inference_server.engine_types import UpdateBusy

    e = engines(make_model(0), version=1)
    sd = make_model(1).hf_state_dict()
    assert e._update_lock.acquire(timeout=5)   # an update in progress (reading a large checkpoint)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            second = pool.submit(e.update_weights, 2, state_dict=sd, timeout=0.2)
            with pytest.raises(UpdateBusy, match="version 2 not installed"):
                second.result(timeout=30)
        finally:
            e._update_lock.release()
    assert e.version == 1
    assert e.update_weights(2, state_dict=sd)["version"] == 2 and e.version == 2   # the same version goes in now


def test_update_weights_errors(engines, tmp_path):
    e = engines(make_model(0), version=3)
    with pytest.raises(ValueError, match="not newer"):
        e.update_weights(3, state_dict=make_model(1).hf_state_dict())
    other = CausalLM(DecoderConfig(vocab_size=300, hidden_size=32, num_attention_heads=4)).init_weights(0)
    with pytest.raises(WeightLoadError, match="shapes"):
        e.update_weights(4, state_dict=other.hf_state_dict())
    with pytest.raises(WeightLoadError, match="missing"):
        e.update_weights(4, state_dict={"x": torch.zeros(1)})
    with pytest.raises(WeightLoadError, match="cannot load"):
        e.update_weights(4, path=str(tmp_path / "nope"))
    make_model(1).save_hf(tmp_path / "v4")
    assert e.update_weights(4, path=str(tmp_path / "v4"))["version"] == 4 and e.version == 4


def test_queue_full(engines):
    e = engines(make_model(0), start=False, max_queue=2)
    p = SamplingParams(max_new_tokens=3, **GREEDY)
    futs = [e.submit([5, 6], p), e.submit([7], p)]
    with pytest.raises(QueueFull):
        e.submit([8], p)
    e.start()
    assert all(len(f.result(10).output_ids) == 3 for f in futs)
    assert e.metrics()["requests_rejected_queue_full"] == 1


def test_requests_cancelled_while_waiting_do_not_fill_the_queue(engines):
    """A waiting request whose caller gave up (deadline, client gone) used to keep its place until the scheduler had
    room to take it: with the batch busy, max_queue cancelled requests refused every live one (QueueFull)."""
    e = engines(make_model(0), start=False, max_queue=2)  # not started: nothing leaves the queue meanwhile
    p = SamplingParams(max_new_tokens=3, **GREEDY)
    for f in [e.submit([5, 6], p), e.submit([7], p)]:
        f.cancel()
    live = e.submit([8], p)
    with pytest.raises(QueueFull):  # the queue still holds max_queue live requests at most
        e.submit([9], p), e.submit([10], p)
    e.start()
    assert len(live.result(10).output_ids) == 3
    assert e.metrics()["requests_cancelled"] == 2


def test_a_failed_step_fails_the_requests_it_took_instead_of_losing_them(engines):
    """A failure while the scheduler admitted what it took (an OOM copying a cached prefix) failed only the requests
    already running or admitted: the one being admitted and those after it were never resolved, so their callers
    waited forever (a Generate without a deadline hung)."""
    e = engines(make_model(0), start=False)
    real = e._sched.cache.get
    e._sched.cache.get = lambda key: (_ for _ in ()).throw(RuntimeError("out of memory")) if key == "bad" else real(key)
    p = SamplingParams(max_new_tokens=3, **GREEDY)
    futs = [e.submit([5, 6, 7], p, t) for t in ("bad", "next")]
    e.start()
    for f in futs:
        with pytest.raises(RuntimeError, match="engine step failed: RuntimeError: out of memory"):
            f.result(10)
    assert len(e.generate([5, 6, 7], p, "fine").output_ids) == 3  # the engine goes on
    assert e.metrics()["step_errors"] == 1


@pytest.mark.parametrize("ids,kw,match", [
    ([], {}, "empty"),
    ([1, 300], {}, "outside the vocabulary"),
    ([1, -1], {}, "outside the vocabulary"),
    ([1] * 250, {"max_new_tokens": 10}, "exceeds max_context"),
    ([1], {"max_new_tokens": 0}, "max_new_tokens"),
    ([1], {"temperature": -0.5}, "temperature"),
    ([1], {"top_p": 1.5}, "top_p"),
    ([1], {"top_k": -1}, "top_k"),
    ([1], {"stop_token_ids": (999,)}, "stop_token_ids"),
])
def test_bad_requests(engines, ids, kw, match):
    e = engines(make_model(0), start=False)
    with pytest.raises(ValueError, match=match):
        e.submit(ids, SamplingParams(**{"max_new_tokens": 4, **kw}))


def test_a_tiny_temperature_samples_greedily_as_sglang_does(engines):
    """0 < temperature < 1e-6 is greedy (SGLang's _SAMPLING_EPS); dividing the logits by 1e-44 once made them inf
    and every logprob NaN, answered OK."""
    e = engines(make_model(0))
    want = e.generate([3, 4, 5], SamplingParams(max_new_tokens=6, temperature=0.0))
    for t in (1e-44, 1e-30, 9e-7):
        got = e.generate([3, 4, 5], SamplingParams(max_new_tokens=6, temperature=t))
        assert got.output_ids == want.output_ids and got.logprobs == want.logprobs, t
        assert all(math.isfinite(x) for x in got.logprobs)


def test_cancel_stops_the_request(engines):
    e = engines(make_model(0))
    started = threading.Event()
    fut = e.submit([3, 4, 5], SamplingParams(max_new_tokens=250, **GREEDY), on_token=lambda *a: started.set())
    assert started.wait(10)
    assert fut.cancel()
    deadline = time.monotonic() + 10
    while not e.metrics()["requests_cancelled"] and time.monotonic() < deadline:
        time.sleep(0.005)
    m = e.metrics()
    assert m["running"] == 0 and m["requests_cancelled"] == 1 and m["tokens_generated"] < 250


def test_sampler_distribution_and_truncation():
    from inference_server.sampling import RowParams, sample

    B, V = 20000, 6
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0]).expand(B, V)
    gen = torch.Generator().manual_seed(0)

    def freq(t=1.0, p=1.0, k=0):
        tok, lp = sample(logits, RowParams.build([t] * B, [p] * B, [k] * B, [None] * B), gen)
        assert torch.allclose(lp, torch.log_softmax(logits / t, -1).gather(-1, tok[:, None]).squeeze(-1))
        return torch.bincount(tok, minlength=V).float() / B

    assert (freq(0.7) - torch.softmax(logits[0] / 0.7, -1)).abs().max() < 0.015
    top2 = freq(k=2)
    assert top2[2:].sum() == 0 and abs(top2[0] - 1 / (1 + torch.e ** -1)) < 0.015
    pr = torch.softmax(logits[0], -1)
    nucleus = freq(p=float(pr[0] + pr[1]) - 0.01)  # needs the top 2 tokens to reach p
    assert nucleus[2:].sum() == 0 and nucleus[1] > 0.2


def test_mixed_prefill_group_with_and_without_cached_prefixes(engines):
    m = make_model(0)
    e = engines(m)
    rng = random.Random(8)
    sp = SamplingParams(max_new_tokens=6, **GREEDY)
    firsts = {f"t{i}": rand_prompt(rng, 5 + 7 * i) for i in range(3)}
    outs = {t: e.generate(p, sp, trajectory_id=t) for t, p in firsts.items()}
    batch = [(t, firsts[t] + outs[t].output_ids + rand_prompt(rng, 1 + 4 * i)) for i, t in enumerate(firsts)]
    batch += [(f"new{i}", rand_prompt(rng, 3 + 9 * i)) for i in range(3)]
    e2 = engines(make_model(0), start=False)  # queue everything first so one prefill group mixes both kinds
    e2._sched.cache = e._sched.cache
    futs = [e2.submit(p, sp, trajectory_id=t) for t, p in batch]
    e2.start()
    for (t, p), f in zip(batch, futs):
        out = f.result(10)
        assert out.output_ids == ref_greedy(m, p, 6)[0]
        assert (out.cached_tokens > 0) == (not t.startswith("new"))


def test_a_checkpoint_that_overflows_the_serving_dtype_is_refused_at_start(tmp_path):
    """A weight beyond fp16's range (65504) became inf when an fp16 engine (inference.precision fp16, or auto on a GPU
    without bf16) loaded it: the engine served NaN logits, and every later weight update of the same weights was
    refused as non-finite, so training went on while the servers kept the start's weights. Refused at start, naming
    the weight; the same checkpoint serves in fp32 and bf16."""
    from core.config import UserError

    m = make_model(0)
    with torch.no_grad():
        m.model.layers[1].mlp.down_proj.weight[3, 5] = 1e5
    m.save_hf(tmp_path / "big")
    with pytest.raises(UserError, match=r"model\.layers\.1\.mlp\.down_proj\.weight holds NaN or inf as inference"
                                        r"\.precision torch\.float16 \(values beyond .*serve in bfloat16 or float32"):
        LocalEngine(InferenceConfig(max_context=64, precision="fp16"), str(tmp_path / "big"), start=False)
    for prec in ("fp32", "bf16"):
        LocalEngine(InferenceConfig(max_context=64, precision=prec), str(tmp_path / "big"), start=False).close()
    with torch.no_grad():
        m.model.layers[0].self_attn.q_proj.weight[0, 0] = float("nan")
    m.save_hf(tmp_path / "nan")
    with pytest.raises(UserError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight holds NaN or inf as inference"
                                        r"\.precision torch\.float32$"):
        LocalEngine(InferenceConfig(max_context=64, precision="fp32"), str(tmp_path / "nan"), start=False)
