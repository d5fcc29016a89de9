"""The SGLang stand-in (inference_server.sglang_conformance) and SGLangEngine against it, over real sockets."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from inference_server.engine import LocalEngine, SamplingParams
from inference_server.sglang_conformance import ConformanceServer
from inference_server.sglang_engine import SGLangEngine
from inference_server.sglang_http import http_json
from core.config import InferenceConfig
from core.model import CausalLM, DecoderConfig

DC = DecoderConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=512)
PROMPT = list(range(2, 22))  # 20 tokens (the stand-in's prefix-cache key is the first 16)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("sglang")
    paths = {}
    for name, seed in (("a", 0), ("b", 1)):
        CausalLM(DC).init_weights(seed, std=0.1).save_hf(d / name)
        paths[name] = str(d / name)
    return paths


@pytest.fixture
def servers(models):
    made = []

    def make(model="a", port=0, **kw):
        s = ConformanceServer(models[model], port=port, cfg=InferenceConfig(max_context=256, max_stale_versions=1 << 30), **kw)
        s.start()
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


def greedy(path: str, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """The local engine's greedy continuation (the reference)."""
    e = LocalEngine(InferenceConfig(max_context=256), path)
    try:
        out = e.generate(ids, SamplingParams(max_new_tokens=n, temperature=0.0), timeout=30)
        return out.output_ids, out.logprobs
    finally:
        e.close()


def gen_body(rid=None, n=8, **sp):
    b = {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": -1,
         "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True, **sp}}
    if rid:
        b["rid"] = rid
    return b


def in_thread(fn, *a):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", fn(*a)), daemon=True)
    t.start()
    return t, box


def wait_for(cond, timeout=10.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not reached"
        time.sleep(0.005)


# ---- the conformance server -------------------------------------------------------------------------
def test_generate_shapes_logprobs_and_finish_reasons(servers, models):
    s = servers()
    st, r = http_json(s.url, "/generate", gen_body("r1", 10))
    assert st == 200 and set(r) == {"output_ids", "meta_info"}
    m = r["meta_info"]
    ref_ids, ref_lps = greedy(models["a"], PROMPT, 10)
    assert r["output_ids"] == ref_ids
    assert [x[1] for x in m["output_token_logprobs"]] == ref_ids and all(x[2] is None for x in m["output_token_logprobs"])
    assert max(abs(x[0] - y) for x, y in zip(m["output_token_logprobs"], ref_lps)) < 1e-5
    assert m["id"] == "r1" and m["finish_reason"] == {"type": "length", "length": 10}
    assert (m["prompt_tokens"], m["completion_tokens"], m["weight_version"]) == (20, 10, "default")
    assert m["weight_versions"] == [{"version": "default", "start": 0, "end": 10}]
    # A stop token ends the output (kept in it) with {"type": "stop", "matched": id}; ignore_eos turns stop_token_ids
    # off too, as SGLang's Req._check_token_based_finish does; top_k 0 is rejected (400).
    assert 1 not in ref_ids[:3]  # the model's EOS (config eos_token_id 1) would end it first
    st, r = http_json(s.url, "/generate", gen_body(None, 10, stop_token_ids=[ref_ids[2]], ignore_eos=False))
    assert r["output_ids"] == ref_ids[:3] and r["meta_info"]["finish_reason"] == {"type": "stop", "matched": ref_ids[2]}
    st, r = http_json(s.url, "/generate", gen_body(None, 10, stop_token_ids=[ref_ids[2]]))
    assert r["output_ids"] == ref_ids and r["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    # A stop token as the last allowed token: SGLang's Req.check_finished looks at the budget first, so "length".
    assert ref_ids[2] not in ref_ids[:2]
    st, r = http_json(s.url, "/generate", gen_body(None, 3, stop_token_ids=[ref_ids[2]], ignore_eos=False))
    assert r["output_ids"] == ref_ids[:3] and r["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    # Stop ids outside the vocabulary are taken and never match (SGLang keeps them in a set; no range check).
    st, r = http_json(s.url, "/generate", gen_body(None, 4, stop_token_ids=[DC.vocab_size + 5], ignore_eos=False))
    assert st == 200 and r["output_ids"] == ref_ids[:4], (st, r)
    assert http_json(s.url, "/generate", gen_body(None, 4, top_k=0))[0] == 400
    st, info = http_json(s.url, "/get_model_info")
    assert st == 200 and info["weight_version"] == "default"
    assert http_json(s.url, "/health_generate")[0] == 200


def test_malformed_bodies_get_sglangs_4xx_not_a_5xx_or_silence(servers):
    """A 5xx reads to the tars front as a dead replica (taken out of rotation, the request resumed elsewhere), and a
    body nested too deep once got no answer at all: client mistakes are 400s, and null fields take their defaults,
    max_new_tokens null meaning up to the context and 0 an empty output, as in SGLang."""
    import http.client
    import json

    s = servers()
    for sp in ("x", [1], {"max_new_tokens": 2, "stop_token_ids": 5}, {"max_new_tokens": "two"}):
        st, r = http_json(s.url, "/generate", {"input_ids": PROMPT, "sampling_params": sp})
        assert st == 400 and r["type"] == "BadRequestError", (sp, st, r)
    st, r = http_json(s.url, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": None}})
    assert st == 200 and len(r["output_ids"]) <= 2
    st, r = http_json(s.url, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": None, "ignore_eos": True}})
    assert st == 200 and r["meta_info"]["completion_tokens"] == 256 - len(PROMPT) - 2  # SGLang's scheduler cap
    st, r = http_json(s.url, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}})
    assert st == 200 and r["output_ids"] == [] and r["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert http_json(s.url, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": -1}})[0] == 400
    host, port = s.url.split("//")[1].split(":")
    for headers, body in (({"Content-Type": "application/json"}, b"[" * 100_000 + b"]" * 100_000),
                          ({"Content-Length": "-1"}, None), ({"Transfer-Encoding": "chunked"}, b"2\r\n{}\r\n0\r\n\r\n")):
        c = http.client.HTTPConnection(host, int(port), timeout=10)
        c.putrequest("POST", "/generate")
        for k, v in ({"Content-Length": str(len(body))} if body is not None and "Transfer-Encoding" not in headers
                     else {}).items() | headers.items():
            c.putheader(k, v)
        c.endheaders(body)
        resp = c.getresponse()
        assert resp.status == 400 and json.loads(resp.read())["type"] == "BadRequestError", headers
        c.close()


def test_abort_returns_partial_output_and_matches_rids_by_prefix(servers):
    s = servers(token_delay_s=0.01)
    calls = {rid: in_thread(http_json, s.url, "/generate", gen_body(rid, 200)) for rid in ("t#1", "t#10", "t#2")}
    wait_for(lambda: len(s.reqs) == 3 and all(len(r.out) > 0 for r in list(s.reqs.values())))
    assert http_json(s.url, "/abort_request", {"rid": "t#"})[0] == 200      # not an in-flight rid: dropped (1 worker)
    time.sleep(0.05)
    assert len(s.reqs) == 3
    http_json(s.url, "/abort_request", {"rid": "t#1"})                       # aborts t#1 AND t#10 (prefix)
    for rid in ("t#1", "t#10"):
        calls[rid][0].join(5)
        st, r = calls[rid][1]["r"]
        m = r["meta_info"]
        assert st == 200 and m["finish_reason"]["type"] == "abort"
        assert 0 < len(r["output_ids"]) < 200 and len(m["output_token_logprobs"]) == len(r["output_ids"])
    assert list(s.reqs) == ["t#2"]
    http_json(s.url, "/abort_request", {"abort_all": True})
    calls["t#2"][0].join(5)
    assert calls["t#2"][1]["r"][1]["meta_info"]["finish_reason"]["type"] == "abort"


def test_pause_abort_holds_new_requests_until_continue(servers):
    s = servers(token_delay_s=0.01)
    t, box = in_thread(http_json, s.url, "/generate", gen_body("p1", 200))
    wait_for(lambda: s.tokens_in_flight() > 2)
    assert http_json(s.url, "/pause_generation", {"mode": "abort"})[1]["status"] == "ok"
    t.join(5)
    assert box["r"][1]["meta_info"]["finish_reason"]["type"] == "abort" and box["r"][1]["output_ids"]
    t2, box2 = in_thread(http_json, s.url, "/generate", gen_body("p2", 3))
    time.sleep(0.3)
    assert "r" not in box2                                   # waits while paused
    http_json(s.url, "/continue_generation", {})
    t2.join(5)
    assert box2["r"][1]["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_retract_and_in_place_carry_requests_across_an_update(servers, models, mode):
    s = servers(token_delay_s=0.05)  # 2 s for the 40 tokens: the pause lands mid-request even on a slow host
    t, box = in_thread(http_json, s.url, "/generate", gen_body("q", 40))
    wait_for(lambda: s.tokens_in_flight() >= 5)
    http_json(s.url, "/pause_generation", {"mode": mode})
    if mode == "in_place":  # the engine thread adds the token it was making, then parks in on_token (the only
        wait_for(lambda: s.cv._waiters)  # waiter on s.cv here) until continue_generation; a fixed sleep raced it
    k = s.tokens_in_flight()
    st, r = http_json(s.url, "/update_weights_from_disk", {"model_path": models["b"], "weight_version": "7"})
    assert st == 200 and r["success"], r
    time.sleep(0.1)
    assert "r" not in box and s.tokens_in_flight() == k       # nothing moves while paused
    http_json(s.url, "/continue_generation", {})
    t.join(10)
    out = box["r"][1]
    m = out["meta_info"]
    assert m["finish_reason"] == {"type": "length", "length": 40}
    assert m["weight_versions"] == [{"version": "default", "start": 0, "end": k}, {"version": "7", "start": k, "end": 40}]
    assert m["weight_version"] == "7"
    ids = out["output_ids"]
    assert ids[:k] == greedy(models["a"], PROMPT, k)[0]
    if mode == "retract":  # re-prefilled from the tokens so far under the new weights
        assert m["num_retractions"] == 1
        assert ids[k:] == greedy(models["b"], PROMPT + ids[:k], 40 - k)[0]


def test_update_weights_from_disk_sets_version_and_flushes_cache(servers, models):
    s = servers()
    first = http_json(s.url, "/generate", gen_body(None, 6))[1]
    body = gen_body(None, 6)
    body["input_ids"] = PROMPT + first["output_ids"] + [7]
    assert http_json(s.url, "/generate", body)[1]["meta_info"]["cached_tokens"] > 0
    st, r = http_json(s.url, "/update_weights_from_disk", {"model_path": models["b"], "weight_version": "1"})
    assert st == 200 and r["success"] and "Weight version updated to 1" in r["message"]
    assert http_json(s.url, "/get_model_info")[1]["weight_version"] == "1"
    again = http_json(s.url, "/generate", body)[1]
    assert again["meta_info"]["cached_tokens"] == 0 and again["meta_info"]["weight_version"] == "1"
    assert again["output_ids"] == greedy(models["b"], body["input_ids"], 6)[0]
    st, r = http_json(s.url, "/update_weights_from_disk", {"model_path": models["a"] + "/missing", "weight_version": "2"})
    assert st == 400 and r["success"] is False
    assert http_json(s.url, "/flush_cache", {})[0] == 200


# ---- SGLangEngine against the stand-in --------------------------------------------------------------
def engine(urls, **kw) -> SGLangEngine:
    cfg = InferenceConfig(max_context=256, engine="sglang", sglang_urls=urls, **kw)
    return SGLangEngine(cfg, urls, vocab_size=DC.vocab_size, health_thread=False)


def test_engine_generates_like_the_local_engine(servers, models):
    s = servers(weight_version="0")
    e = engine([s.url])
    try:
        out = e.generate(PROMPT, SamplingParams(max_new_tokens=12, temperature=0.0), "traj")
        ref_ids, ref_lps = greedy(models["a"], PROMPT, 12)
        assert out.output_ids == ref_ids and max(abs(a - b) for a, b in zip(out.logprobs, ref_lps)) < 1e-5
        assert out.versions == [0] * 12 and out.finish_reason == "length" and out.prompt_tokens == 20
        stop = e.generate(PROMPT, SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(ref_ids[3],)), "traj")
        assert stop.output_ids == ref_ids[:4] and stop.finish_reason == "stop"
        # SGLang says "length" when the stop token is the last allowed one; tars says "stop", as the local engine does.
        assert ref_ids[3] not in ref_ids[:3]
        last = e.generate(PROMPT, SamplingParams(max_new_tokens=4, temperature=0.0, stop_token_ids=(ref_ids[3],)), "t2")
        assert last.output_ids == ref_ids[:4] and last.finish_reason == "stop"
        for bad in (DC.vocab_size, -1):  # refused by the front, as by the local engine (SGLang would take them)
            with pytest.raises(ValueError, match="stop_token_ids"):
                e.generate(PROMPT, SamplingParams(max_new_tokens=4, stop_token_ids=(bad,)), "t3")
        local = LocalEngine(InferenceConfig(max_context=256), models["a"])
        try:
            mine = local.generate(PROMPT, SamplingParams(max_new_tokens=4, temperature=0.0, stop_token_ids=(ref_ids[3],)),
                                  timeout=30)
            assert (mine.output_ids, mine.finish_reason) == (last.output_ids, last.finish_reason)
        finally:
            local.close()
        with pytest.raises(ValueError):
            e.submit([1, 400], SamplingParams(max_new_tokens=2))
    finally:
        e.close()


@pytest.mark.parametrize("mode", ["abort", "retract"])
def test_engine_resumes_across_a_weight_update(servers, models, mode):
    s = servers(weight_version="0", token_delay_s=0.05)  # 2 s for the 40 tokens: the update lands mid-request
    e = engine([s.url], sglang_pause_mode=mode)
    try:
        fut = e.submit(PROMPT, SamplingParams(max_new_tokens=40, temperature=0.0), "traj")
        wait_for(lambda: s.tokens_in_flight() >= 5)
        info = e.update_weights(1, models["b"])
        assert info["version"] == 1 and info["interrupted_requests"] == 1 and e.version == 1
        out = fut.result(20)
        assert out.finish_reason == "length" and len(out.output_ids) == 40 and out.interruptions >= 1
        k = out.versions.index(1)
        assert 5 <= k < 40 and out.versions == [0] * k + [1] * (40 - k)
        assert out.output_ids[:k] == greedy(models["a"], PROMPT, k)[0]
        ref_ids, ref_lps = greedy(models["b"], PROMPT + out.output_ids[:k], 40 - k)
        assert out.output_ids[k:] == ref_ids and max(abs(a - b) for a, b in zip(out.logprobs[k:], ref_lps)) < 1e-4
        assert e.metrics()["resumed_requests"] == (1 if mode == "abort" else 0)
    finally:
        e.close()


def test_engine_sticky_and_load_aware_routing(servers):
    # 50 ms a token: t1 (1.5 s) is still running on a slow host when t2 is routed
    a, b = servers(weight_version="0", token_delay_s=0.05), servers(weight_version="0", token_delay_s=0.05)
    e = engine([a.url, b.url])
    try:
        # Two long trajectories at once land on different replicas (fewest in flight).
        f1 = e.submit(PROMPT, SamplingParams(max_new_tokens=30, temperature=0.0), "t1")
        wait_for(lambda: a.tokens_in_flight() + b.tokens_in_flight() > 0)
        f2 = e.submit(PROMPT, SamplingParams(max_new_tokens=30, temperature=0.0), "t2")
        f1.result(20), f2.result(20)
        assert e.route("t1").url != e.route("t2").url
        for turn in range(3):  # later turns of each trajectory go where its first turn went
            for t in ("t1", "t2"):
                e.generate(PROMPT + [turn], SamplingParams(max_new_tokens=2, temperature=0.0), t)
        assert a.engine.stats["requests"] == 4 and b.engine.stats["requests"] == 4
        assert {r["url"]: r["requests"] for r in e.metrics()["replicas"]} == {a.url: 4, b.url: 4}
    finally:
        e.close()


def test_engine_takes_a_dead_replica_out_and_back_in(servers, models):
    a, b = servers(weight_version="0"), servers(weight_version="0")
    e = engine([a.url, b.url])
    try:
        e.generate(PROMPT, SamplingParams(max_new_tokens=2, temperature=0.0), "t")
        home = e.route("t")
        dead, live = (a, b) if home.url == a.url else (b, a)
        port = dead.port
        dead.stop()
        out = e.generate(PROMPT, SamplingParams(max_new_tokens=4, temperature=0.0), "t")
        assert len(out.output_ids) == 4 and e.route("t").url == live.url
        assert [r["healthy"] for r in e.metrics()["replicas"] if r["url"] == dead.url] == [False]
        e.update_weights(1, models["b"])                        # only the live replica gets it
        revived = servers(port=port, weight_version="0")
        e.check_health()
        rep = {r["url"]: r for r in e.metrics()["replicas"]}[revived.url]
        assert rep["healthy"] and rep["version"] == 1           # brought up to date before it was let back in
        assert http_json(revived.url, "/get_model_info")[1]["weight_version"] == "1"
        revived.stop()
        e.check_health()
        assert not {r["url"]: r for r in e.metrics()["replicas"]}[revived.url]["healthy"]
    finally:
        e.close()


def test_grpc_front_serves_the_sglang_engine(servers, models):
    from core.inference_client import InferenceClient
    from inference_server.server import InferenceServer, make_engine

    s = servers(weight_version="0")
    cfg = InferenceConfig(max_context=256, engine="sglang", sglang_urls=[s.url], sglang_health_interval_s=0.5)

    async def main():
        eng = make_engine(cfg, models["a"])
        srv = InferenceServer(cfg, eng, model_name="sglang")
        await srv.start()
        client = InferenceClient([srv.address])
        try:
            r = await client.generate("t", PROMPT, 5, temperature=0.0)
            assert r.output_ids == greedy(models["a"], PROMPT, 5)[0] and r.versions == [0] * 5
            ups = await client.update_weights(1, models["b"])
            assert ups[0]["version"] == 1 and await client.get_version() == 1
        finally:
            await client.close()
            await srv.stop()
            eng.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_launchable_as_a_process_that_prints_nothing(models):
    import socket
    import subprocess
    import sys

    from inference_server.sglang_launch import wait_healthy

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    p = subprocess.Popen([sys.executable, "-m", "inference_server.sglang_conformance", "--model", models["a"], "--port", str(port),
                          "--host", "127.0.0.1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy([url], 120)  # a process start: ~20 s on a loaded 2-core host
        st, r = http_json(url, "/generate", gen_body(None, 3))
        assert st == 200 and r["output_ids"] == greedy(models["a"], PROMPT, 3)[0]
    finally:
        p.terminate()
        out, err = p.communicate(timeout=10)
    assert out == b"" and err == b""


def test_weights_every_replica_refuses_leave_the_pool_serving_the_old_ones(servers, models, tmp_path):
    """A refused update (a missing directory) changes nothing: the replica stays in, the requests it interrupted
    resume on the old weights, and a new request is served at once."""
    s = servers(weight_version="0", token_delay_s=0.005)
    e = engine([s.url], sglang_pause_mode="abort")
    try:
        futs = [e.submit(PROMPT, SamplingParams(max_new_tokens=40, temperature=0.0), f"t{i}") for i in range(3)]
        wait_for(lambda: s.tokens_in_flight() >= 3)
        with pytest.raises(Exception, match="no replica accepted"):
            e.update_weights(1, str(tmp_path / "missing"))
        assert [r["healthy"] for r in e.metrics()["replicas"]] == [True] and e.version == 0
        ref = greedy(models["a"], PROMPT, 40)[0]
        for f in futs:
            out = f.result(20)
            assert out.output_ids == ref and set(out.versions) == {0}
        assert len(e.generate(PROMPT, SamplingParams(max_new_tokens=3, temperature=0.0), "new").output_ids) == 3
    finally:
        e.close()


def test_a_cancelled_request_stops_on_the_server_even_when_paused_or_just_posted(servers):
    """One /abort_request can be lost (the rid not registered yet, or held by a paused server): the engine aborts
    until the request's /generate returns, so nothing runs on to max_new_tokens for a caller that is gone."""
    s = servers(weight_version="0", token_delay_s=0.1)  # 230 tokens would take 23 s: far past every wait below
    aborts, real_abort = [], s.abort_request
    s.abort_request = lambda rid="", abort_all=False: aborts.append(rid) or real_abort(rid, abort_all)
    e = engine([s.url])
    params = SamplingParams(max_new_tokens=230, temperature=1.0)
    try:
        http_json(s.url, "/pause_generation", {"mode": "abort"})
        f = e.submit(PROMPT, params, "held")
        wait_for(lambda: e.replicas[0].in_flight == 1)      # posted, and held by the paused server
        assert f.cancel()
        wait_for(lambda: aborts)                            # an abort reached the paused server (which drops it)
        http_json(s.url, "/continue_generation", {})
        wait_for(lambda: not s.reqs and e.replicas[0].in_flight == 0, timeout=10.0)
        # Cancelled at once, while its /generate is being posted, and once the server runs it.
        for when in (lambda: True, lambda: e.replicas[0].in_flight > 0, lambda: s.reqs):
            f = e.submit(PROMPT, params, "early")
            wait_for(when)
            f.cancel()
            wait_for(lambda: not s.reqs and e.replicas[0].in_flight == 0, timeout=10.0)  # 230 x 100 ms would be 23 s
    finally:
        e.close()


def test_a_body_over_the_limit_gets_413_not_a_memory_error(servers):
    import http.client
    s = servers()
    host, port = s.url.split("//")[1].split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=10)
    c.putrequest("POST", "/generate")
    c.putheader("Content-Type", "application/json")
    c.putheader("Content-Length", str(10 ** 13))
    c.endheaders()
    r = c.getresponse()
    assert r.status == 413 and b"limit" in r.read()
    c.close()
    assert http_json(s.url, "/generate", gen_body(None, 2))[0] == 200   # the server is fine


def test_an_unpaused_update_never_lands_under_a_running_request(servers, models):
    """SGLang's writer lock lets an update in only once no request runs; the stand-in keeps a deadline, and when
    requests still run at update_timeout_s the update fails with nothing installed (it used to install the new
    weights under them, so their later tokens were not the labelled version's)."""
    s = ConformanceServer(models["a"], cfg=InferenceConfig(max_context=256, max_stale_versions=1 << 30,
                                                           update_timeout_s=0.3), token_delay_s=0.05, weight_version="0")
    s.start()
    try:
        t, box = in_thread(http_json, s.url, "/generate", gen_body("long", 60))  # ~3 s of tokens: running at 0.3 s on any host
        wait_for(lambda: s.reqs)
        st, r = http_json(s.url, "/update_weights_from_disk", {"model_path": models["b"], "weight_version": "1"})
        assert st == 400 and r["success"] is False and "still in flight" in r["message"], (st, r)
        t.join(30)
        out = box["r"][1]
        assert out["meta_info"]["weight_version"] == "0"
        assert out["output_ids"] == greedy(models["a"], PROMPT, 60)[0]          # every token from the old weights
        assert http_json(s.url, "/get_model_info")[1]["weight_version"] == "0"
        st, r = http_json(s.url, "/update_weights_from_disk", {"model_path": models["b"], "weight_version": "1"})
        assert st == 200 and r["success"]                                      # nothing running: it lands
    finally:
        s.stop()


def test_close_with_a_request_in_flight_aborts_it_and_fails_its_future(servers):
    """close() used to call _abort_rid with the wrong arguments: a TypeError out of close, the caller's Future never
    resolved, and the request ran on to max_new_tokens on the server."""
    from inference_server.engine_types import EngineClosed

    s = servers(weight_version="0", token_delay_s=0.1)  # 200 tokens would take 20 s
    e = engine([s.url])
    f = e.submit(PROMPT, SamplingParams(max_new_tokens=200, temperature=1.0), "going")
    wait_for(lambda: s.reqs)
    e.close()
    assert isinstance(f.exception(5), EngineClosed)
    wait_for(lambda: not s.reqs, timeout=10.0)  # aborted on the server, not 20 s of tokens for nobody


def test_requests_cancelled_before_they_start_are_not_kept(servers):
    """Every submit used to put its call (input_ids and all) on the worker pool's unbounded queue; a caller that gave
    up (a deadline) left it there until a worker freed up, so with the workers busy, submit-and-cancel grew memory
    without bound past max_queue. Calls now wait in the engine's own deque and leave it when cancelled."""
    s = servers(weight_version="0", token_delay_s=0.05)
    e = engine([s.url], sglang_max_concurrency=2, max_queue=4)
    try:
        busy = [e.submit(PROMPT, SamplingParams(max_new_tokens=100, temperature=1.0), f"b{i}") for i in range(2)]
        wait_for(lambda: len(s.reqs) == 2)
        for i in range(50):
            e.submit(PROMPT * 10, SamplingParams(max_new_tokens=4), f"x{i}").cancel()
        assert e.in_flight() == 2 and e._workers._work_queue.qsize() <= 2
        live = e.submit(PROMPT, SamplingParams(max_new_tokens=3, temperature=0.0), "live")
        for f in busy:
            f.cancel()
        assert len(live.result(30).output_ids) == 3
    finally:
        e.close()


def test_a_pause_that_fails_is_continued_all_the_same(servers, models):
    """A /pause_generation that timed out (SGLang's abort-mode pause waits for in-flight requests to clear) or failed
    returned before continue_generation was sent: the server stayed paused, answered no /health_generate, so no
    health round let it back in: the replica was lost for good (every replica, with one)."""
    from inference_server.engine_types import WeightLoadError

    s = servers(weight_version="0", health_timeout_s=1.0)
    real, release = s.pause, threading.Event()
    s.pause = lambda mode: real(mode) or release.wait(10)
    e = engine([s.url])
    try:
        with pytest.raises(WeightLoadError, match="TimeoutError|timed out"):
            e.update_weights(1, models["b"], timeout=0.5)
        wait_for(lambda: s.paused is None, timeout=10.0)
        release.set()
        e.check_health()
        assert e.healthy() and e.version == 0
        assert len(e.generate(PROMPT, SamplingParams(max_new_tokens=3, temperature=0.0), "after").output_ids) == 3
    finally:
        release.set()
        e.close()


def test_a_generation_the_server_fails_is_a_5xx_as_in_sglang(servers):
    """SGLang's tokenizer manager turns a scheduler abort with status 500/503 into an HTTPException (the client takes
    the replica out and resumes elsewhere); the stand-in answered 200 with that abort as the finish reason, so the
    client resumed on the same replica, and tests never took the real path."""
    s = servers(weight_version="0")

    def broken(key):
        raise RuntimeError("device lost")

    s.engine._sched.cache.get = broken
    st, r = http_json(s.url, "/generate", gen_body("dies", 4))
    assert st == 500 and "device lost" in r["message"] and (r["object"], r["type"], r["code"]) == ("error", "500", 500), (st, r)


def test_a_request_whose_client_went_away_is_aborted_as_in_sglang(servers):
    """SGLang aborts a /generate whose HTTP client disconnected; the stand-in generated on to max_new_tokens for
    nobody (the client's own timeout, resumed elsewhere, left its old request running here)."""
    import json
    import socket

    s = servers(weight_version="0", token_delay_s=0.1)  # 200 tokens would take 20 s
    host, port = s.url.split("//")[1].split(":")
    data = json.dumps(gen_body("gone", 200)).encode()
    c = socket.create_connection((host, int(port)), timeout=5)
    c.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
              + str(len(data)).encode() + b"\r\n\r\n" + data)
    wait_for(lambda: s.reqs)
    c.close()
    wait_for(lambda: not s.reqs, timeout=10.0)


def test_a_replica_whose_update_failed_leaves_rotation_at_once(servers, models):
    """Over two replicas, one that failed its update stayed in rotation until the other had finished updating: new
    requests could go to it and be served with the old weights. It is now taken out as soon as its update fails
    (before its continue_generation), and a request sent meanwhile waits for the updated replica; when every replica
    fails, the one taken out comes back (all keep serving the old weights)."""
    from inference_server.engine_types import WeightLoadError

    def slow(s, gate):  # the replica's update waits for the gate, then loads as SGLang does
        real = s.update_weights
        s.update_weights = lambda body, state_dict=None: (gate.wait(30), real(body, state_dict))[1]

    def broken(s):
        s.update_weights = lambda body, state_dict=None: (False, "Failed to update weights: out of memory.", 0)

    healthy = lambda e: {r["url"]: r["healthy"] for r in e.metrics()["replicas"]}  # noqa: E731
    a, b = servers(weight_version="0"), servers(weight_version="0")
    broken(a)
    gate = threading.Event()
    slow(b, gate)
    e = engine([a.url, b.url])
    try:
        t, box = in_thread(e.update_weights, 1, models["b"])
        # a out, and b paused, still updating (held by the gate): the replicas update in parallel, so a's failure
        # can come before b's pause reached it
        wait_for(lambda: not healthy(e)[a.url] and b.paused is not None)
        assert healthy(e)[b.url] and t.is_alive()
        f = e.submit(PROMPT, SamplingParams(max_new_tokens=4, temperature=0.0), "new")  # routed to b, not a
        gate.set()
        t.join(30)
        assert box["r"]["replicas"][a.url].endswith("out of memory.") and box["r"]["replicas"][b.url] == "ok"
        out = f.result(30)
        assert out.output_ids == greedy(models["b"], PROMPT, 4)[0] and out.versions == [1] * 4
        assert healthy(e) == {a.url: False, b.url: True} and e.version == 1
    finally:
        gate.set()
        e.close()
    # both fail: the first is out while the second may still take them, then both are back on the old weights
    c, d = servers(weight_version="0"), servers(weight_version="0")
    broken(c)
    broken(d)
    gate2 = threading.Event()
    slow(d, gate2)
    e = engine([c.url, d.url])
    try:
        t, box = in_thread(lambda: pytest.raises(WeightLoadError, e.update_weights, 1, models["b"]))
        wait_for(lambda: not healthy(e)[c.url])
        gate2.set()
        t.join(30)
        assert "no replica accepted" in str(box["r"].value)
        assert healthy(e) == {c.url: True, d.url: True} and e.version == 0
    finally:
        gate2.set()
        e.close()


def test_an_update_waiting_for_another_gives_up_at_its_deadline_and_is_never_installed(servers, models):
    """The pool's update lock was taken without a deadline: an update queued behind a slow one (or behind a replica
    being brought up to date) waited past its own timeout, its caller was told DEADLINE_EXCEEDED by the front, and it
    was installed all the same once the lock came free. It now gives up at its timeout (UpdateBusy), for good."""
    from inference_server.engine_types import UpdateBusy

    s = servers(weight_version="0")
    gate = threading.Event()
    real = s.update_weights
    s.update_weights = lambda body, state_dict=None: (gate.wait(30), real(body, state_dict))[1]
    e = engine([s.url])
    release = threading.Timer(3.0, gate.set)  # the first update ends after 3 s whatever happens here
    try:
        t, box = in_thread(e.update_weights, 1, models["b"])
        wait_for(lambda: s.paused is not None)             # the first update holds the pool
        release.start()
        t0 = time.monotonic()
        with pytest.raises(UpdateBusy, match="version 2 not installed"):
            e.update_weights(2, models["a"], timeout=0.5)
        assert time.monotonic() - t0 < 2.5                 # at its own deadline, not when the first one ended
        t.join(30)
        assert box["r"]["version"] == 1 and e.version == 1
        assert http_json(s.url, "/get_weight_version")[1]["weight_version"] == "1"
    finally:
        release.cancel()
        gate.set()
        e.close()


@pytest.mark.parametrize("end", ["length", "stop"])
def test_a_request_paused_after_its_last_token_is_finished_not_retracted(servers, models, end):
    """The stand-in resolves a request a moment after its last token (token_delay_s widens it); a retract pause in
    that moment suspended the request and continue_generation resubmitted it: with its budget spent that answered
    400 (max_new_tokens 0) and the /generate waited for ever; with a stop token last it generated on past the stop.
    SGLang finishes a request in the step that made its last token, so the pause finds it done."""
    ref = greedy(models["a"], PROMPT, 2)[0]
    assert ref[0] != ref[1]
    s = servers(token_delay_s=1.0)
    body = gen_body("q", 2) if end == "length" else gen_body("q", 10, ignore_eos=False, stop_token_ids=[ref[1]])
    t, box = in_thread(http_json, s.url, "/generate", body)
    wait_for(lambda: s.tokens_in_flight() == 2)             # the last token is made; the engine has not resolved it
    assert http_json(s.url, "/pause_generation", {"mode": "retract"})[0] == 200
    assert http_json(s.url, "/update_weights_from_disk", {"model_path": models["b"], "weight_version": "1"})[0] == 200
    assert http_json(s.url, "/continue_generation", {})[0] == 200
    t.join(10)
    st, out = box["r"]
    assert st == 200 and out["output_ids"] == ref
    want = {"type": "length", "length": 2} if end == "length" else {"type": "stop", "matched": ref[1]}
    assert out["meta_info"]["finish_reason"] == want and out["meta_info"]["weight_versions"][-1]["version"] == "default"
