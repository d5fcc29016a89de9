"""SGLangEngine's pool mechanics: rids, per-token versions, load-aware stickiness, launching servers as processes,
and the checks against the `sglang` package's own request types."""
from __future__ import annotations

import asyncio
import os
import random
import socket
import sys
import textwrap

import pytest

from core.inference_client import InferenceClient
from inference_server.engine import SamplingParams
from inference_server.sglang_engine import SGLangEngine, _Call
from inference_server.sglang_http import http_json, token_versions
from inference_server.sglang_launch import launch_sglang_servers, stop_sglang_servers
from inference_server.sglang_start import server_context
from inference_server.sglang_types import SGLangTypes
from core.config import InferenceConfig
from test_sglang import DC, PROMPT, gen_body, greedy, models, servers  # noqa: F401 - fixtures


def test_rids_never_prefix_each_other():
    cfg = InferenceConfig(engine="sglang")
    engines = [SGLangEngine(cfg, ["http://127.0.0.1:9"], health_thread=False) for _ in range(2)]
    try:
        rids = set()
        for e in engines:
            for traj in ("", "t", "t1", "a-very-long-trajectory-id" * 4):
                for seq in (1, 9, 10, 11, 99, 100, 123456):
                    for seg in (0, 1, 10, 11):
                        rids.add(e._rid(_Call(seq, [1], SamplingParams(), traj, None, None, segment=seg)))
        assert len(rids) == 2 * 4 * 7 * 4 and len({len(r) for r in rids}) == 1  # distinct, one length
        ordered = sorted(rids)
        # In sorted order a prefix sits right before the strings it prefixes: neighbours suffice.
        assert not any(b.startswith(a) for a, b in zip(ordered, ordered[1:]))
    finally:
        for e in engines:
            e.close()


def test_token_versions_from_spans_and_fallbacks():
    spans = {"weight_versions": [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}],
             "weight_version": "4"}
    assert token_versions(spans, 5, 0) == [3, 3, 4, 4, 4]
    assert token_versions({"weight_version": "7"}, 3, 0) == [7, 7, 7]               # no spans: the one version
    assert token_versions({"weight_version": "default"}, 2, 5) == [5, 5]            # non-integer: the base version
    assert token_versions({"weight_versions": [{"version": "2", "start": 1, "end": 9}], "weight_version": "1"}, 3, 0) == [1, 2, 2]


def test_sticky_routing_yields_to_load():
    cfg = InferenceConfig(engine="sglang", sticky_max_imbalance=2)
    e = SGLangEngine(cfg, ["http://127.0.0.1:9", "http://127.0.0.1:10"], health_thread=False)
    try:
        a, b = e.replicas
        home = e.route("t")
        other = b if home is a else a
        home.in_flight = 2
        assert e.route("t") is home                    # within the slack: stays with its cache
        home.in_flight = 3
        assert e.route("t") is other                   # beyond it: moves to the least loaded replica, and sticks there
        home.in_flight = 0
        assert e.route("t") is other and e.metrics()["sticky_moved_for_load"] == 1
        other.healthy = False
        assert e.route("t") is home                    # a replica taken out loses its trajectories
    finally:
        e.close()

    async def client_side():  # the gRPC client's routing follows the same rule (its channels need a loop)
        c = InferenceClient(["127.0.0.1:9", "127.0.0.1:10"], sticky_max_imbalance=1)
        i = c.route("t")
        c._replicas[i].in_flight = 1
        assert c.route("t") == i
        c._replicas[i].in_flight = 2
        assert c.route("t") == 1 - i and c.moved_for_load == 1
        never = InferenceClient(["127.0.0.1:9", "127.0.0.1:10"], sticky_max_imbalance=0)
        j = never.route("t")
        never._replicas[j].in_flight = 100
        assert never.route("t") == j
        await c.close()
        await never.close()

    asyncio.run(client_side())


def _free_port_run(n, tries=200):
    """A base port whose n consecutive ports are all free now: bound together, then released. Drawn below Linux's
    ephemeral range (32768+), where the clients' sockets of other tests and processes take their ports."""
    rng = random.Random()
    for _ in range(tries):
        base = rng.randrange(20000, 32768 - n)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {n} free ports found")


def test_launches_servers_as_processes_and_stops_their_groups(models):  # noqa: F811
    procs, urls = [], []
    try:
        procs, urls = launch_sglang_servers(models["a"], 256, n=2, base_port=_free_port_run(2), wait_s=60,
                                            module="inference_server.sglang_conformance")
        # the same command line as a supervised launch: --context-length max_context, not the model's own 512
        assert [server_context(u) for u in urls] == [256, 256]
        e = SGLangEngine(InferenceConfig(max_context=256, engine="sglang"), urls, vocab_size=DC.vocab_size, health_thread=False)
        try:
            out = e.generate(PROMPT, SamplingParams(max_new_tokens=4, temperature=0.0), "t")
            assert out.output_ids == greedy(models["a"], PROMPT, 4)[0] and out.versions == [0] * 4
        finally:
            e.close()
        assert all(os.getpgid(p.pid) == p.pid for p in procs)     # each its own group
    finally:
        stop_sglang_servers(procs)
    assert all(p.returncode is not None for p in procs)
    for p in procs:
        with pytest.raises(ProcessLookupError):
            os.killpg(p.pid, 0)
    # A launcher that dies at once is reported at once, not after wait_s.
    with pytest.raises(RuntimeError, match="exited"):
        launch_sglang_servers(models["a"] + "/missing", 256, n=1, base_port=_free_port_run(1), wait_s=60,
                              module="inference_server.sglang_conformance")


def test_malformed_bodies_get_400(servers):  # noqa: F811
    s = servers()
    assert http_json(s.url, "/generate", [1, 2])[0] == 400                       # not an object
    assert http_json(s.url, "/generate", {"input_ids": "abc"})[0] == 400
    assert http_json(s.url, "/pause_generation", {"mode": "sideways"})[0] == 400
    assert http_json(s.url, "/generate", gen_body(None, 2))[0] == 200           # and it still serves


FAKE_IO = '''
from dataclasses import dataclass
from typing import Optional

@dataclass
class GenerateReqInput:
    text: Optional[str] = None
    input_ids: Optional[list] = None
    sampling_params: Optional[dict] = None
    rid: Optional[str] = None
    return_logprob: Optional[bool] = None
    logprob_start_len: Optional[int] = None
    stream: bool = False

    def normalize_batch_and_arguments(self):
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("Either text or input_ids should be provided.")

@dataclass
class PauseGenerationReqInput:
    mode: str = "abort"
'''
FAKE_SP = '''
class SamplingParams:
    def __init__(self, max_new_tokens=128, temperature=1.0, top_p=1.0, top_k=-1, stop_token_ids=None,
                 ignore_eos=False, no_stop_trim=False, sampling_seed=None):
        self.temperature, self.max_new_tokens = temperature, max_new_tokens

    def verify(self, vocab_size):
        if self.max_new_tokens < 0:
            raise ValueError("max_new_tokens must be at least 0, got %d." % self.max_new_tokens)
'''


@pytest.fixture
def fake_sglang(tmp_path, monkeypatch):
    """A minimal package with the module layout and constructor behaviour of sglang's request types."""
    root = tmp_path / "site"
    for d in ("sglang", "sglang/srt", "sglang/srt/managers"):
        (root / d).mkdir(parents=True)
        (root / d / "__init__.py").write_text("__version__ = '0.0-test'\n" if d == "sglang" else "")
    (root / "sglang/srt/managers/io_struct.py").write_text(textwrap.dedent(FAKE_IO))
    (root / "sglang/srt/sampling_params.py").write_text(textwrap.dedent(FAKE_SP))
    monkeypatch.syspath_prepend(str(root))
    yield
    for k in [k for k in sys.modules if k == "sglang" or k.startswith("sglang.")]:
        del sys.modules[k]


def test_type_checks_are_skipped_cleanly_without_sglang():
    t = SGLangTypes.load()
    if t.available:
        pytest.skip("the sglang package is installed here; see test_real_sglang_types_accept_what_the_engine_sends")
    t.check("/generate", {"anything": 1})                                          # inactive: no error


def test_conformance_server_refuses_what_sglang_types_refuse(fake_sglang, models):  # noqa: F811
    from inference_server.sglang_conformance import ConformanceServer

    t = SGLangTypes.load()
    assert t.available and t.version == "0.0-test"
    s = ConformanceServer(models["a"], cfg=InferenceConfig(max_context=256))
    s.start()
    try:
        st, r = http_json(s.url, "/generate", {**gen_body(None, 2), "frobnicate": True})  # the hand checks allow it
        assert st == 400 and "frobnicate" in r["message"]
        st, r = http_json(s.url, "/generate", {**gen_body(None, 2), "text": "hi"})
        assert st == 400 and "Either text or input_ids" in r["message"]
        e = SGLangEngine(InferenceConfig(max_context=256, engine="sglang"), [s.url], vocab_size=DC.vocab_size, health_thread=False)
        try:  # what the engine sends passes SGLang's types
            assert len(e.generate(PROMPT, SamplingParams(max_new_tokens=3, seed=5), "t").output_ids) == 3
        finally:
            e.close()
    finally:
        s.stop()


def test_real_sglang_types_accept_what_the_engine_sends():
    t = SGLangTypes.load()
    if not t.available:
        pytest.skip("the sglang package is not importable here (it needs a GPU build); the conformance checks apply alone")
    body = gen_body("rid-1", 4)
    body["sampling_params"].update({"top_k": -1, "top_p": 1.0, "stop_token_ids": [], "no_stop_trim": True, "sampling_seed": 3})
    t.check("/generate", body, DC.vocab_size)
    with pytest.raises(ValueError):
        t.check("/generate", {**body, "frobnicate": True}, DC.vocab_size)
