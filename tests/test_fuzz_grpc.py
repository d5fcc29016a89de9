"""Hostile input on every gRPC service (EnvService, InferenceService, ControlService), against real server processes.

Requests are raw bytes: random, mutated from valid requests (bit flips, truncation, splices), or well-formed with
hostile values (unknown ids, huge numbers, oversize messages). Every call must come back with a clear status —
OK or one a client can act on — never UNKNOWN (an unhandled exception) nor INTERNAL (other than gRPC's own
"cannot parse the request"), and the server must still serve a real episode afterwards.
TARS_FUZZ_EXAMPLES sets the examples per service (default 300; 10000 for the full run).
"""
import json
import os
import pathlib
import subprocess
import sys

import grpc
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from core import config as C
from core.v1 import common_pb2, control_pb2, env_pb2, inference_pb2

ROOT = pathlib.Path(__file__).resolve().parent.parent
N = int(os.environ.get("TARS_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=N, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
CLEAR = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
         grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED,
         grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.DEADLINE_EXCEEDED}
COUNTS: dict[str, dict[str, int]] = {}


def _start(tmp: pathlib.Path, role: str, argv: list[str]) -> tuple[subprocess.Popen, str]:
    ready = tmp / f"{role}.json"
    log = open(tmp / f"{role}.log", "wb")
    p = subprocess.Popen([sys.executable, "-m", "tars.cli", *argv, "--ready-file", str(ready)], cwd=ROOT,
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    import time

    deadline = time.monotonic() + 90
    while not ready.exists():
        assert p.poll() is None, (tmp / f"{role}.log").read_text()[-2000:]
        assert time.monotonic() < deadline, f"{role} not ready"
        time.sleep(0.05)
    return p, json.loads(ready.read_text())["address"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from tars.up import build_model

    tmp = tmp_path_factory.mktemp("fuzz")
    cfg = C.load("quickstart", None, ["sft.steps=0", "envd.max_sessions=64"])
    C.save(cfg, tmp / "config.yaml")
    model, _ = build_model(cfg, tmp, lambda m: None)
    conf = ["--config", str(tmp / "config.yaml")]
    envd, envd_addr = _start(tmp, "envd", ["envd", *conf])
    inf, inf_addr = _start(tmp, "inference", ["serve", *conf, "--model", str(model)])
    chans = {"envd": grpc.insecure_channel(envd_addr), "inference": grpc.insecure_channel(inf_addr)}
    yield {"procs": {"envd": envd, "inference": inf}, "chans": chans, "model": model}
    for ch in chans.values():
        ch.close()
    for p in (envd, inf):
        p.terminate()
        p.wait(20)
    if COUNTS:
        print("\nfuzz counts:", json.dumps(COUNTS))


def _raw(ch: grpc.Channel, method: str, body: bytes, timeout: float = 10.0) -> grpc.StatusCode:
    call = ch.unary_unary(method, request_serializer=None, response_deserializer=None)
    try:
        call(body, timeout=timeout)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        code = e.code()
        if code == grpc.StatusCode.INTERNAL and "pars" in (e.details() or "").lower():
            return grpc.StatusCode.INVALID_ARGUMENT  # gRPC itself refused bytes that are not the request message
        assert code in CLEAR, f"{method}: {code.name}: {e.details()}"
        return code


def _mutate(seed: bytes, data) -> bytes:
    """A byte-level mutation of a valid request: flip, truncate, splice in random bytes, or duplicate a slice."""
    kind = data.draw(st.sampled_from(["flip", "truncate", "splice", "repeat", "random"]))
    b = bytearray(seed)
    if kind == "random" or not b:
        return data.draw(st.binary(max_size=512))
    i = data.draw(st.integers(0, len(b) - 1))
    if kind == "flip":
        b[i] ^= data.draw(st.integers(1, 255))
    elif kind == "truncate":
        del b[i:]
    elif kind == "splice":
        b[i:i] = data.draw(st.binary(min_size=1, max_size=64))
    else:
        j = data.draw(st.integers(i, len(b)))
        b[i:i] = bytes(b[i:j]) * data.draw(st.integers(1, 50))
    return bytes(b)


_text = st.one_of(st.text(max_size=64), st.sampled_from(["", "builtin/menu", "builtin/mixed", "../../etc/passwd",
                                                           "x" * 10000, "\x00", "sess-0"]))
_num = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2**31, 2**31 - 1).map(float))
_u64 = st.integers(0, 2**64 - 1)


def _env_requests(envd_run_id: str):
    action = st.builds(env_pb2.Action, type=st.one_of(st.sampled_from(["click", "type", "scroll", "drag", "hotkey", "wait"]), _text),
                       point=st.lists(_num, max_size=4), end_point=st.lists(_num, max_size=4), content=_text,
                       key=_text, direction=_text, target=_text, raw=_text)
    return st.one_of(
        st.tuples(st.just("CreateSession"), st.builds(env_pb2.CreateSessionRequest, env_id=_text, seed=_u64,
                                                      options=st.dictionaries(_text, _text, max_size=4),
                                                      lease_ttl_s=_num, client_id=_text)),
        st.tuples(st.just("Reset"), st.builds(env_pb2.ResetRequest, session_id=_text, seed=_u64,
                                              run_id=st.sampled_from(["", envd_run_id, "stale"]))),
        st.tuples(st.just("Step"), st.builds(env_pb2.StepRequest, session_id=_text, action=action,
                                             run_id=st.sampled_from(["", envd_run_id, "stale"]))),
        st.tuples(st.sampled_from(["Observe", "Close", "Snapshot", "Fork"]),
                  st.builds(env_pb2.SessionRef, session_id=_text, run_id=st.sampled_from(["", envd_run_id]))),
        st.tuples(st.just("Heartbeat"), st.builds(env_pb2.HeartbeatRequest, session_ids=st.lists(_text, max_size=8),
                                                  lease_ttl_s=_num)),
        st.tuples(st.just("Restore"), st.builds(env_pb2.RestoreRequest, env_id=_text, state=st.binary(max_size=2048),
                                                lease_ttl_s=_num)),
        st.tuples(st.just("ListEnvs"), st.just(env_pb2.ListEnvsRequest())),
        st.tuples(st.just("Ping"), st.builds(env_pb2.PingRequest, payload=st.binary(max_size=256))),
    )


def _healthy_episode(ch: grpc.Channel) -> None:
    from core.v1 import env_pb2_grpc

    stub = env_pb2_grpc.EnvServiceStub(ch)
    r = stub.CreateSession(env_pb2.CreateSessionRequest(env_id="builtin/menu", seed=1), timeout=10)
    obs = stub.Reset(env_pb2.ResetRequest(session_id=r.session_id, seed=1), timeout=10)
    assert obs.outcome == common_pb2.RUNNING
    s = stub.Step(env_pb2.StepRequest(session_id=r.session_id, action=env_pb2.Action(type="wait")), timeout=10)
    assert s.outcome in (common_pb2.RUNNING, common_pb2.TERMINATED, common_pb2.TRUNCATED)
    stub.Close(env_pb2.SessionRef(session_id=r.session_id), timeout=10)


def _count(boundary: str, code: grpc.StatusCode) -> None:
    c = COUNTS.setdefault(boundary, {})
    c[code.name] = c.get(code.name, 0) + 1


def test_envd_survives_hostile_requests(servers):
    ch = servers["chans"]["envd"]
    run_id = env_pb2.PingResponse.FromString(_raw_ok(ch, "/tars.v1.EnvService/Ping", b"")).run_id

    @FUZZ
    @given(req=_env_requests(run_id), data=st.data(), mutate=st.booleans())
    def one(req, data, mutate):
        method, msg = req
        body = msg.SerializeToString()
        if mutate:
            body = _mutate(body, data)
        _count("envd", _raw(ch, f"/tars.v1.EnvService/{method}", body))
        assert servers["procs"]["envd"].poll() is None

    one()
    # found by the 10,000-example run: a huge lease overflowed lease_expires_unix_ms after the session was made
    code = _raw(ch, "/tars.v1.EnvService/CreateSession", env_pb2.CreateSessionRequest(
        env_id="builtin/menu", lease_ttl_s=1.2e16).SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    # oversize: one message past the daemon's limit is refused, not fatal
    cfg = C.EnvdConfig()
    code = _raw(ch, "/tars.v1.EnvService/Ping", env_pb2.PingRequest(payload=b"x" * (cfg.max_message_bytes + 1024)).SerializeToString())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    _healthy_episode(ch)


def _raw_ok(ch, method, body) -> bytes:
    return ch.unary_unary(method, request_serializer=None, response_deserializer=None)(body, timeout=10)


def test_inference_survives_hostile_requests(servers):
    ch = servers["chans"]["inference"]
    vocab = json.loads((servers["model"] / "config.json").read_text())["vocab_size"]
    ids = st.lists(st.one_of(st.integers(0, vocab - 1), st.integers(-2**31, 2**31 - 1)), max_size=64)
    sampling = st.builds(inference_pb2.SamplingParams, max_new_tokens=st.integers(-2**31, 2**31 - 1),
                         temperature=st.floats(width=32), top_p=st.floats(width=32),
                         top_k=st.integers(-2**31, 2**31 - 1), stop_token_ids=st.lists(st.integers(-2**31, 2**31 - 1), max_size=4),
                         seed=_u64)
    reqs = st.one_of(
        st.tuples(st.just("Generate"), st.builds(inference_pb2.GenerateRequest, trajectory_id=_text, input_ids=ids,
                                                 sampling=sampling, max_stale_versions=st.integers(-2**31, 2**31 - 1))),
        st.tuples(st.just("UpdateWeights"), st.builds(inference_pb2.UpdateWeightsRequest, version=st.integers(-2**63, 2**63 - 1),
                                                      path=_text, safetensors=st.binary(max_size=1024))),
        st.tuples(st.just("GetVersion"), st.just(inference_pb2.GetVersionRequest())),
    )

    @FUZZ
    @given(req=reqs, data=st.data(), mutate=st.booleans())
    def one(req, data, mutate):
        method, msg = req
        body = msg.SerializeToString()
        if mutate:
            body = _mutate(body, data)
        _count("inference", _raw(ch, f"/tars.v1.InferenceService/{method}", body, timeout=20.0))
        assert servers["procs"]["inference"].poll() is None

    one()
    # found by the 10,000-example run: a path too long for the filesystem was an unhandled OSError (UNKNOWN)
    assert _raw(ch, "/tars.v1.InferenceService/UpdateWeights", inference_pb2.UpdateWeightsRequest(
        version=5, path="x" * 5000).SerializeToString()) == grpc.StatusCode.FAILED_PRECONDITION
    # still generates, at version 0 (no fuzzed UpdateWeights was applied)
    from core.v1 import inference_pb2_grpc

    r = inference_pb2_grpc.InferenceServiceStub(ch).Generate(inference_pb2.GenerateRequest(
        trajectory_id="after-fuzz", input_ids=[1, 2, 3], sampling=inference_pb2.SamplingParams(max_new_tokens=4)), timeout=20)
    assert 1 <= len(r.output_ids) <= 4 and list(r.versions) == [0] * len(r.output_ids)


def test_control_survives_hostile_requests(servers):
    names = st.one_of(st.sampled_from(["sessions_list", "sessions_kill", "nope", "", "update_weights"]), _text)
    reqs = st.one_of(
        st.tuples(st.just("Status"), st.just(control_pb2.StatusRequest())),
        st.tuples(st.just("Command"), st.builds(control_pb2.CommandRequest, name=names,
                                                args=st.dictionaries(_text, _text, max_size=4))),
    )

    @FUZZ
    @given(role=st.sampled_from(["envd", "inference"]), req=reqs, data=st.data(), mutate=st.booleans())
    def one(role, req, data, mutate):
        method, msg = req
        body = msg.SerializeToString()
        if mutate:
            body = _mutate(body, data)
        _count("control", _raw(servers["chans"][role], f"/tars.v1.ControlService/{method}", body))
        assert servers["procs"][role].poll() is None

    one()
    _healthy_episode(servers["chans"]["envd"])
