"""What the SGLang path answers gRPC callers when SGLang refuses a request, fails it, or answers what tars cannot use."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from core.config import InferenceConfig
from core.inference_client import InferenceClient
from inference_server.engine_types import SamplingParams
from inference_server.server import InferenceServer, make_engine
from inference_server.sglang_engine import SGLangEngine
from test_sglang import PROMPT, gen_body, greedy, in_thread, models, servers, wait_for  # noqa: F401 - fixtures


def front(cfg: InferenceConfig, model: str, body, joined_later: bool = False):
    """Run `body(client, engine)` against a gRPC front over the sglang engine of cfg (joined_later: over servers the
    start did not see, so did not learn the context length of, as a replica that answers only once serving)."""
    async def main():
        eng = SGLangEngine(cfg, cfg.sglang_urls, 0) if joined_later else make_engine(cfg, model)
        srv = InferenceServer(cfg, eng, model_name="sglang")
        await srv.start()
        client = InferenceClient([srv.address], retries=0)
        try:
            return await body(client, eng)
        finally:
            await client.close()
            await srv.stop()
            eng.close()

    return asyncio.run(asyncio.wait_for(main(), 60))


def test_a_request_sglang_refuses_is_invalid_argument_with_its_message(servers, models):
    """SGLang answers 400 for a request it refuses (here: past its own context, smaller than the front's); the front
    answered INTERNAL ("RuntimeError: SGLang /generate ... HTTP 400"), which callers treat as a server fault. The
    replica is not taken out: the next request that fits is served there."""
    s = servers(weight_version="0")  # context 256
    cfg = InferenceConfig(max_context=1024, engine="sglang", sglang_urls=[s.url], sglang_health_interval_s=30)

    async def body(client, eng):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await client.generate("t", PROMPT, 300, temperature=0.0)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value
        assert ei.value.details().startswith("SGLang refused the request: ") and "256" in ei.value.details()
        assert eng.metrics()["replicas_healthy"] == 1
        r = await client.generate("t", PROMPT, 4, temperature=0.0)
        assert r.output_ids == greedy(models["a"], PROMPT, 4)[0]

    front(cfg, models["a"], body, joined_later=True)


def test_a_generation_sglang_fails_keeps_its_code(servers, models):
    """A 5xx is the replica's fault, not the request's: the replica is taken out (UNAVAILABLE once none is left),
    never INVALID_ARGUMENT."""
    s = servers(weight_version="0")
    cfg = InferenceConfig(max_context=256, engine="sglang", sglang_urls=[s.url], sglang_health_interval_s=30,
                          sglang_max_resumes=0)

    def broken(key):
        raise RuntimeError("device lost")

    s.engine._sched.cache.get = broken

    async def body(client, eng):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await client.generate("t", PROMPT, 4, temperature=0.0)
        assert ei.value.code() != grpc.StatusCode.INVALID_ARGUMENT, ei.value
        assert eng.metrics()["replicas_healthy"] == 0

    front(cfg, models["a"], body)


def _fill(s, n: int) -> list:
    """Hold n long requests on the stand-in s (rids fill-0...), returned running; end them with _unfill."""
    from inference_server.sglang_http import http_json

    threads = [in_thread(http_json, s.url, "/generate", gen_body(f"fill-{i}", 200), 60.0)[0] for i in range(n)]
    wait_for(lambda: len(s.reqs) == n, 30)
    return threads


def _unfill(s, threads) -> None:
    from inference_server.sglang_http import http_json

    for i in range(len(threads)):
        http_json(s.url, "/abort_request", {"rid": f"fill-{i}"})
    for t in threads:
        t.join(30)


def test_a_full_sglang_queue_is_resource_exhausted_and_the_replica_stays(servers, models):
    """SGLang started with --max-queued-requests answers 503 "The request queue is full." for a request past its
    queue (Scheduler._abort_on_queued_limit): the engine took that for a dead server, took the replica out (0 healthy,
    NOT_SERVING) and answered UNAVAILABLE, so load became an outage. It is now RESOURCE_EXHAUSTED (actors back off and
    retry), the replica stays in and serves the next request."""
    from inference_server.sglang_http import http_json

    s = servers(weight_version="0", token_delay_s=0.05, max_running_requests=1, max_queued_requests=1)
    fill = _fill(s, 2)  # one running, one waiting: the queue is full
    try:
        st, r = http_json(s.url, "/generate", gen_body("probe", 2))
        assert (st, r) == (503, {"object": "error", "message": "The request queue is full.", "type": "503",
                                 "param": None, "code": 503}), (st, r)
        assert http_json(s.url, "/health_generate")[0] == 200  # full, not dead
        cfg = InferenceConfig(max_context=256, engine="sglang", sglang_urls=[s.url], sglang_health_interval_s=30)

        async def body(client, eng):
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await client.generate("t", PROMPT, 4, temperature=0.0)
            assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, ei.value
            assert "The request queue is full." in ei.value.details()
            m = eng.metrics()
            assert (m["replicas_healthy"], m["replica_down_events"], m["requests_rejected_queue_full"]) == (1, 0, 1)
            _unfill(s, fill)
            r = await client.generate("t", PROMPT, 4, temperature=0.0)
            assert r.output_ids == greedy(models["a"], PROMPT, 4)[0]

        front(cfg, models["a"], body)
    finally:
        _unfill(s, fill)


def test_a_full_replica_sends_the_request_to_one_with_room(servers, models):
    """Of two replicas, the one a trajectory sticks to has a full queue: the request is served by the other, and both
    stay in rotation."""
    a = servers(weight_version="0", token_delay_s=0.05, max_running_requests=1, max_queued_requests=1)
    b = servers(weight_version="0")
    fill = _fill(a, 2)
    try:
        cfg = InferenceConfig(max_context=256, engine="sglang", sglang_urls=[a.url, b.url], sglang_health_interval_s=30)

        async def body(client, eng):
            tid = next(f"t{i}" for i in range(64) if eng.route(f"t{i}").url == a.url)  # sticks to a from now on
            r = await client.generate(tid, PROMPT, 4, temperature=0.0)
            assert r.output_ids == greedy(models["a"], PROMPT, 4)[0]
            m = eng.metrics()
            assert (m["replicas_healthy"], m["requests_rejected_queue_full"]) == (2, 1)
            assert [x["requests"] for x in m["replicas"]] == [1, 1]  # refused by a, served by b

        front(cfg, models["a"], body)
    finally:
        _unfill(a, fill)


def test_the_stand_in_applies_sglangs_context_rules(servers):
    """SGLang (context length C) refuses prompt + max_new_tokens >= C with 400 {"error": {"message"}} and caps
    max_new_tokens at C - prompt - 2; the stand-in accepted up to C (the local engine's rule) and generated to it."""
    from inference_server.sglang_http import http_json

    s = servers(weight_version="0")  # C = 256
    body = {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": -1,
            "sampling_params": {"max_new_tokens": 256 - len(PROMPT), "temperature": 0.0, "ignore_eos": True}}
    st, r = http_json(s.url, "/generate", body)
    assert st == 400 and r["error"]["message"].startswith(
        "Requested token count exceeds the model's maximum context length of 256 tokens. You requested a total of 256 "
        "tokens: 20 tokens from the input messages and 236 tokens for the completion."), (st, r)
    body["sampling_params"]["max_new_tokens"] = 256 - len(PROMPT) - 1
    st, r = http_json(s.url, "/generate", body)
    assert st == 200 and r["meta_info"]["completion_tokens"] == 256 - len(PROMPT) - 2
    assert r["meta_info"]["finish_reason"] == {"type": "length", "length": 256 - len(PROMPT) - 2}
    st, r = http_json(s.url, "/generate", {**body, "input_ids": list(range(2, 258))})
    assert st == 400 and r["error"]["message"] == "The input (256 tokens) is longer than the model's context length (256 tokens)."
    st, r = http_json(s.url, "/generate", {**body, "input_ids": [5] * 250, "sampling_params": {"max_new_tokens": 2}})
    assert st == 400 and r["error"]["message"].startswith(
        "Input length (250 tokens) exceeds the maximum allowed length (250 tokens)."), (st, r)


def test_the_front_admits_what_sglang_serves_in_full(servers, models):
    """With tars's max_context equal to SGLang's context length (256), prompt + max_new_tokens of 256 passed the front
    and failed on SGLang, 255 came back one token short of max_new_tokens (SGLang's cap), and a prompt of 251 (250 =
    C - 6 or more: SGLang's scheduler refuses it; a generation resumed after an abort is such a prompt) with 3 new
    tokens failed on SGLang; the front now refuses these at once, saying the limit (250) as actors read it, and serves
    250 in full, with a long prompt too."""
    from actor.judge import context_limit

    s = servers(weight_version="0")
    cfg = InferenceConfig(max_context=256, engine="sglang", sglang_urls=[s.url], sglang_health_interval_s=30)
    n = 256 - len(PROMPT) - 6
    ref = greedy(models["a"], PROMPT, n)[0]
    ref = ref[:ref.index(1) + 1] if 1 in ref else ref  # the model's EOS (id 1) ends a generation on SGLang

    async def body(client, eng):
        for prompt, extra in ((PROMPT, 6), (PROMPT, 5), (PROMPT, 1), ([5] * 251, 3 - n)):
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await client.generate("t", prompt, n + extra, temperature=0.0)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and context_limit(ei.value) == 250, ei.value
        r = await client.generate("t", PROMPT, n, temperature=0.0)
        assert r.output_ids == ref and r.finish_reason == ("length" if len(ref) == n else "stop")
        r = await client.generate("t2", [5] * 244, 6, temperature=0.0)
        assert r.output_ids == greedy(models["a"], [5] * 244, 6)[0][:len(r.output_ids)] and r.prompt_tokens == 244

    front(cfg, models["a"], body)


def test_an_attached_servers_shorter_context_bounds_the_front_at_start(servers, models):
    """tars took SGLang's context length to be inference.max_context (1024) while the attached server's was 256:
    prompt 20 + max_new_tokens 235 passed the front, SGLang (255 < 256) took it and capped it at 256 - 20 - 2, so it
    came back 234 tokens long, one short of what was asked, as a full "length" answer. The start now reads the
    server's context length (GET /v1/models, max_model_len) and lowers max_context to it: the request is refused at
    once with the limit (250) the actors fit their prompts to; one within it is served in full."""
    from actor.judge import context_limit
    from inference_server.sglang_http import http_json

    s = servers(weight_version="0")  # context 256
    assert http_json(s.url, "/v1/models")[1]["data"][0]["max_model_len"] == 256
    cfg = InferenceConfig(max_context=1024, engine="sglang", sglang_urls=[s.url], sglang_health_interval_s=30)

    async def body(client, eng):
        assert (eng.cfg.max_context, eng.cfg.request_limit()) == (256, 250)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await client.generate("t", PROMPT, 235, temperature=0.0, stop_token_ids=[299])
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and context_limit(ei.value) == 250, ei.value
        r = await client.generate("t", [5] * 20, 230, temperature=0.0)
        assert r.output_ids == ref

    ref = greedy(models["a"], [5] * 20, 230)[0]
    ref = ref[:ref.index(1) + 1] if 1 in ref else ref  # the model's EOS (id 1) ends a generation on SGLang

    front(cfg, models["a"], body)


def test_sglangs_own_context_refusal_tells_actors_its_limit(servers, models):
    """A server whose context (256) is below the front's, joined after the start: its refusal carries the limit in the
    front's words."""
    from actor.judge import context_limit

    s = servers(weight_version="0")
    cfg = InferenceConfig(max_context=1024, engine="sglang", sglang_urls=[s.url], sglang_health_interval_s=30)

    async def body(client, eng):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await client.generate("t", PROMPT, 300, temperature=0.0)
        assert context_limit(ei.value) == 250, ei.value

    front(cfg, models["a"], body, joined_later=True)


def test_seeds_past_int64_reach_sglang_as_seeds_it_takes(servers, models):
    """A uint64 seed of 2**63 or more went to SGLang as is, where its int64 seed tensor overflows (the stand-in fails
    it with 500, as SGLang's scheduler does): the replica was taken out and the request answered UNAVAILABLE. It now
    goes in two's complement: the same seed still gives the same sample, different ones different samples."""
    from inference_server.sglang_http import http_json

    s = servers(weight_version="0")
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "sampling_seed": 1 << 63}}
    st, r = http_json(s.url, "/generate", body)
    assert st == 500 and "Overflow" in r["message"], (st, r)
    for ok in ((1 << 63) - 1, -(1 << 63)):
        assert http_json(s.url, "/generate", {**body, "sampling_params": {"max_new_tokens": 2, "sampling_seed": ok}})[0] == 200

    cfg = InferenceConfig(max_context=256, engine="sglang", sglang_urls=[s.url], sglang_health_interval_s=30)
    big = (1 << 64) - 7

    async def body_(client, eng):
        a = await client.generate("t1", PROMPT, 12, temperature=1.0, seed=big)
        b = await client.generate("t2", PROMPT, 12, temperature=1.0, seed=big)
        c = await client.generate("t3", PROMPT, 12, temperature=1.0, seed=big - 1)
        assert len(a.output_ids) == 12 and a.output_ids == b.output_ids and a.logprobs == b.logprobs
        assert c.output_ids != a.output_ids
        assert eng.metrics()["replicas_healthy"] == 1
        with pytest.raises(ValueError, match="seed must be in"):
            eng.submit(PROMPT, SamplingParams(max_new_tokens=2, seed=-1))

    front(cfg, models["a"], body_)


@pytest.mark.parametrize("bad", [float("nan"), float("-inf"), None])  # None: what SGLang's orjson writes for NaN / inf
def test_a_non_finite_logprob_fails_the_request_at_once(models, bad):
    """A NaN or inf logprob in SGLang's answer went through the engine to the actor, whose trajectory the learner's
    stream then refused: the episode was lost late. The request now fails at once, naming the token."""
    from inference_server.sglang_conformance import ConformanceServer

    class Broken(ConformanceServer):  # a server whose model produces a non-finite logprob at the third token
        def response(self, r, final=True):
            out = super().response(r, final)
            lps = out["meta_info"].get("output_token_logprobs") or []
            if len(lps) > 2:
                lps[2][0] = bad
            return out

    s = Broken(models["a"], cfg=InferenceConfig(max_context=256, max_stale_versions=1 << 30), weight_version="0")
    s.start()
    try:
        cfg = InferenceConfig(max_context=256, engine="sglang", sglang_urls=[s.url], sglang_health_interval_s=30)

        async def body(client, eng):
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await client.generate("t", PROMPT, 6, temperature=0.0)
            assert ei.value.code() == grpc.StatusCode.INTERNAL, ei.value
            assert f"logprob {bad!r} for output token 2: not a finite number" in ei.value.details()
            assert (await client.generate("t", PROMPT, 2, temperature=0.0)).output_ids == greedy(models["a"], PROMPT, 2)[0]

        front(cfg, models["a"], body)
    finally:
        s.stop()


def test_counters_lose_no_update_under_concurrent_requests(servers, monkeypatch):
    """The engine's counters were a Counter updated from its worker threads without a lock: `stats[k] += n` reads,
    then writes, and two threads that both read before either writes lose one update. Under the GIL the read can
    yield inside Counter.__missing__ (the first update of a key; 4 keys of 3000 lost one with 8 threads and a 1 us
    switch interval); here every thread is held there until all have read, which makes that interleaving certain:
    8 finished requests counted as 1. Updates are now made under one lock."""
    import collections
    import threading

    from test_sglang import wait_for

    from inference_server.engine_types import SamplingParams
    from inference_server.sglang_engine import SGLangEngine

    n = 8
    barriers: dict = {}
    guard = threading.Lock()

    def missing(self, key):  # every engine worker reading a missing key waits for the others (1 s at most)
        if not threading.current_thread().name.startswith("tars-sglang"):
            return 0
        with guard:
            b = barriers.setdefault(key, threading.Barrier(n, timeout=1.0))
        try:
            b.wait()
        except threading.BrokenBarrierError:
            pass
        return 0

    s = servers(weight_version="0")
    cfg = InferenceConfig(max_context=256, engine="sglang", sglang_urls=[s.url], sglang_max_concurrency=n)
    e = SGLangEngine(cfg, [s.url], health_thread=False)
    try:
        monkeypatch.setattr(collections.Counter, "__missing__", missing)
        futs = [e.submit(PROMPT, SamplingParams(max_new_tokens=3 + i, temperature=0.0), f"t{i}") for i in range(n)]
        outs = [f.result(60) for f in futs]
        wait_for(lambda: e.metrics()["requests_finished"] >= n)  # counted just after each result is set
        m = e.metrics()
        assert m["requests"] == n and m["requests_finished"] == n, m
        assert m["tokens_generated"] == sum(len(o.output_ids) for o in outs), m
    finally:
        monkeypatch.undo()
        e.close()


def test_a_generation_past_the_request_timeout_leaves_its_replica_in(servers, models):
    """The socket timeout of a /generate is the time left before sglang_request_timeout_s; when it fired the engine
    took it for a dead replica: the only replica went out of rotation (the next request UNAVAILABLE), and the slow
    request answered INTERNAL. It now answers DEADLINE_EXCEEDED, its request is aborted on the server, and the
    replica stays in."""
    from test_sglang import wait_for

    s = servers(weight_version="0", token_delay_s=0.1)  # 100 tokens: 10 s
    cfg = InferenceConfig(max_context=256, engine="sglang", sglang_urls=[s.url], sglang_health_interval_s=30,
                          sglang_request_timeout_s=1.5)

    async def body(client, eng):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await client.generate("slow", PROMPT, 100, temperature=0.0)
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, ei.value
        assert "sglang_request_timeout_s=1.5" in ei.value.details()
        m = eng.metrics()
        assert m["replicas_healthy"] == 1 and m["replica_down_events"] == 0, m
        wait_for(lambda: not s.reqs)  # aborted on the server, not left to run to 100 tokens
        assert (await client.generate("next", PROMPT, 2, temperature=0.0)).output_ids == greedy(models["a"], PROMPT, 2)[0]

    front(cfg, models["a"], body)


def test_metrics_tell_waiting_from_running(servers):
    """Requests beyond the runners (sglang_max_concurrency, at least 2) wait in the engine; metrics said waiting 0 and
    every request running."""
    from test_sglang import wait_for

    from inference_server.sglang_engine import SGLangEngine

    s = servers(weight_version="0", token_delay_s=0.05)
    cfg = InferenceConfig(max_context=256, engine="sglang", sglang_urls=[s.url], sglang_max_concurrency=2)
    e = SGLangEngine(cfg, [s.url], health_thread=False)
    try:
        futs = [e.submit(PROMPT, SamplingParams(max_new_tokens=40, temperature=0.0), f"t{i}") for i in range(5)]
        wait_for(lambda: len(s.reqs) == 2)
        m = e.metrics()
        assert (m["running"], m["waiting"]) == (2, 3), m
        for f in futs:
            f.cancel()
    finally:
        e.close()
