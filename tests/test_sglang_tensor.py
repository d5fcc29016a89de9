"""POST /update_weights_from_tensor: the conformance server installs the weights it decodes (weight_version,
flush_cache, abort_all_requests as SGLang has them) and refuses malformed bodies as SGLang does; SGLangEngine sends
in-memory state dicts through it, to loopback servers only."""
from __future__ import annotations

import base64
import io
import pickle
import subprocess
import sys

import pytest
import torch

from core.model_files import read_weights as load_state_dict_dir
from inference_server import sglang_tensors
from inference_server.engine_types import WeightLoadError
from inference_server.sglang_engine import SGLangEngine
from inference_server.sglang_http import http_json
from core.config import InferenceConfig
from test_sglang import DC, PROMPT, gen_body, greedy, models, servers  # noqa: F401 - fixtures
from tests.served import served


def weights_b(models) -> dict[str, torch.Tensor]:
    return load_state_dict_dir(models["b"])


def test_update_from_tensor_installs_weights_sets_version_and_flushes_cache(servers, models):
    s = servers()
    first = http_json(s.url, "/generate", gen_body(None, 6))[1]
    body = gen_body(None, 6)
    body["input_ids"] = PROMPT + first["output_ids"] + [7]
    assert http_json(s.url, "/generate", body)[1]["meta_info"]["cached_tokens"] > 0
    before = http_json(s.url, "/generate", body)[1]
    named = sglang_tensors.share(weights_b(models))
    st, r = http_json(s.url, "/update_weights_from_tensor", {"serialized_named_tensors": [sglang_tensors.serialize(named)],
                                                             "load_format": None, "flush_cache": True, "weight_version": "1"})
    assert st == 200 and r["success"] and "Weight version updated to 1" in r["message"], r
    assert http_json(s.url, "/get_model_info")[1]["weight_version"] == "1"
    again = http_json(s.url, "/generate", body)[1]
    assert again["meta_info"]["cached_tokens"] == 0 and again["meta_info"]["weight_version"] == "1"
    assert again["output_ids"] == greedy(models["b"], body["input_ids"], 6)[0]
    assert again["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]
    # flush_cache=false keeps the prefix cache (as SGLang does); the weight version still moves
    http_json(s.url, "/generate", body)
    st, r = http_json(s.url, "/update_weights_from_tensor", {"serialized_named_tensors": [sglang_tensors.serialize(named)],
                                                             "flush_cache": False, "weight_version": "2"})
    assert st == 200 and r["success"]
    kept = http_json(s.url, "/generate", body)[1]
    assert kept["meta_info"]["cached_tokens"] > 0 and kept["meta_info"]["weight_version"] == "2"


def test_update_from_tensor_from_another_process(servers, models, tmp_path):
    """The handles are opened by a process that did not make them (the learner and SGLang are different processes)."""
    s = servers()
    code = ("import sys, json; from core.model_files import read_weights as load_state_dict_dir; from inference_server import sglang_tensors as t; "
            "from inference_server.sglang_http import http_json; "
            f"n = t.share(load_state_dict_dir({models['b']!r})); "
            f"print(json.dumps(http_json({s.url!r}, '/update_weights_from_tensor', "
            "{'serialized_named_tensors': [t.serialize(n)], 'weight_version': '5'})))")
    out = tmp_path / "out.txt"
    with open(out, "w") as f:  # a file, not a pipe: torch_shm_manager (the handles' keeper) inherits stdout
        rc = subprocess.run([sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT, timeout=120).returncode
    assert rc == 0 and '"success": true' in out.read_text(), out.read_text()[-3000:]
    body = gen_body(None, 6)
    out = http_json(s.url, "/generate", body)[1]
    assert out["output_ids"] == greedy(models["b"], PROMPT, 6)[0] and out["meta_info"]["weight_version"] == "5"


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_malformed_bodies_are_refused_with_sglangs_error_shapes_and_change_nothing(servers, models):
    s = servers()
    ref = http_json(s.url, "/generate", gen_body(None, 6))[1]["output_ids"]
    for body, field in (({"weight_version": "1"}, "serialized_named_tensors"),
                        ({"serialized_named_tensors": "abc"}, "serialized_named_tensors"),
                        ({"serialized_named_tensors": [3]}, "serialized_named_tensors"),
                        ({"serialized_named_tensors": ["x"], "flush_cache": "yes"}, "flush_cache")):
        st, r = http_json(s.url, "/update_weights_from_tensor", body)
        assert st == 422 and isinstance(r["detail"], list) and r["detail"][0]["loc"][:2] == ["body", field], (body, r)
    sd = weights_b(models)
    bad_shape = dict(sd)
    k = next(iter(bad_shape))
    bad_shape[k] = torch.zeros(3, 3)
    nan = {kk: (v.clone().fill_(float("nan")) if kk == k else v) for kk, v in sd.items()}
    evil = base64.b64encode(pickle.dumps([("x", _Evil())])).decode()
    for entries in ([], ["not base64!"], [base64.b64encode(b"garbage").decode()], [evil],
                    [sglang_tensors.serialize(sglang_tensors.share(bad_shape))],
                    [sglang_tensors.serialize(sglang_tensors.share({"nope": torch.zeros(2)}))],
                    [sglang_tensors.serialize(sglang_tensors.share(nan))]):
        st, r = http_json(s.url, "/update_weights_from_tensor", {"serialized_named_tensors": entries, "weight_version": "9"})
        assert st == 400 and r["success"] is False and r["message"].startswith("Failed to update weights"), (entries[:1], r)
    assert http_json(s.url, "/get_model_info")[1]["weight_version"] == "default"
    assert http_json(s.url, "/generate", gen_body(None, 6))[1]["output_ids"] == ref


def test_allow_list_refuses_foreign_globals():
    with pytest.raises(sglang_tensors.BadTensors, match="refused"):
        sglang_tensors.deserialize(base64.b64encode(pickle.dumps([("x", _Evil())])).decode())
    buf = io.BytesIO()
    pickle.dump({"a": 1}, buf)
    with pytest.raises(sglang_tensors.BadTensors, match="pairs"):
        sglang_tensors.deserialize(base64.b64encode(buf.getvalue()).decode())


def test_engine_publishes_a_state_dict_through_update_weights_from_tensor(servers, models):
    s = servers(weight_version="0")
    cfg = InferenceConfig(max_context=256, engine="sglang", sglang_urls=[s.url])
    e = SGLangEngine(cfg, [s.url], vocab_size=DC.vocab_size, health_thread=False)
    try:
        info = e.update_weights(1, None, weights_b(models))
        assert info["version"] == 1 and e.version == 1
        from inference_server.engine import SamplingParams

        out = e.generate(PROMPT, SamplingParams(max_new_tokens=8, temperature=0.0), "t")
        assert out.output_ids == greedy(models["b"], PROMPT, 8)[0] and out.versions == [1] * 8
        assert http_json(s.url, "/get_model_info")[1]["weight_version"] == "1"
    finally:
        e.close()


def test_engine_refuses_non_finite_in_memory_weights_before_sending(servers, models):
    from inference_server.engine_types import WeightsRefused

    s = servers(weight_version="0")
    cfg = InferenceConfig(max_context=256, engine="sglang", sglang_urls=[s.url])
    e = SGLangEngine(cfg, [s.url], vocab_size=DC.vocab_size, health_thread=False)
    try:
        sd = weights_b(models)
        k = next(iter(sd))
        sd[k] = sd[k].clone().fill_(float("inf"))
        with pytest.raises(WeightsRefused, match=k):
            e.update_weights(1, None, sd)
        assert e.version == 0 and http_json(s.url, "/get_model_info")[1]["weight_version"] == "0"
    finally:
        e.close()


def test_engine_refuses_in_memory_weights_for_a_remote_server(models):
    url = "http://10.255.255.1:30000"
    cfg = InferenceConfig(max_context=256, engine="sglang", sglang_urls=[url])
    e = SGLangEngine(cfg, [url], vocab_size=DC.vocab_size, health_thread=False)
    try:
        with pytest.raises(WeightLoadError, match="loopback"):
            e.update_weights(1, None, weights_b(models))
    finally:
        e.close()


def test_learner_publishes_in_memory_through_tars_serve_to_sglang(servers, models, tmp_path):
    """The whole path: Publisher (auto = shm on loopback) -> `tars serve --engine sglang` maps the segment ->
    POST /update_weights_from_tensor -> the SGLang server serves the learner's weights as version 1."""
    import collections
    import os

    from core import weights_shm
    from core.config_learner import PublishConfig
    from core.v1 import inference_pb2
    from learner.policy import TrainPolicy
    from learner.publish import Publisher

    if not weights_shm.available():
        pytest.skip("no writable /dev/shm")
    s = servers(weight_version="0")
    with served(tmp_path, "--model", str(models["a"]), "--port", "0", "--engine", "sglang", "--sglang-url", s.url,
                "--set", "inference.auth_token=t", "--set", "control.auth_token=t") as addr:
        (tmp_path / "run").mkdir()
        counters = collections.Counter()
        pub = Publisher(TrainPolicy.load(models["b"]), tmp_path / "run", [addr], "t", PublishConfig(mode="auto"), counters)
        assert pub.mode == "shm"
        pub.publish(1)
        assert counters["publish_failures"] == 0, (tmp_path / "inference.log").read_text()[-3000:]
        assert pub.stubs[0].GetVersion(inference_pb2.GetVersionRequest(), timeout=10).version == 1
        assert http_json(s.url, "/get_model_info")[1]["weight_version"] == "1"
        out = http_json(s.url, "/generate", gen_body(None, 6))[1]
        assert out["output_ids"] == greedy(models["b"], PROMPT, 6)[0]
        assert [n for n in os.listdir(weights_shm.SHM_DIR) if n.startswith(pub.shm_prefix)] == []
