"""Contracts and shared pieces: generated code in sync, schema, tokenizer, config, model vs transformers."""
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from core import config as C
from core.model import CausalLM, DecoderConfig
from core.schema import SCHEMA_VERSION, SchemaError, Trajectory, Turn, turn_rewards

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_generated_code_in_sync():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_protos_reserve_and_status_enums():
    env = (ROOT / "proto" / "tars" / "v1" / "common.proto").read_text()
    assert "INFRA_ERROR" in env and "TRUNCATED" in env and "TERMINATED" in env


def _traj(n=12, **kw):
    m = np.zeros(n, np.uint8)
    m[5:9] = 1
    d = dict(id="a-1", env_id="builtin/click", outcome="terminated", tokens=np.arange(n, dtype=np.int32),
             logprobs=np.where(m, -0.5, 0.0).astype(np.float32), versions=np.where(m, 3, -1).astype(np.int32),
             mask=m, turns=[Turn("text:x", "click(target='A')", {"type": "click", "target": "A"}, 1.0, 5, 9)], ret=1.0, success=True)
    d.update(kw)
    return Trajectory(**d)


def test_schema_round_trip():
    t = _traj(images={"ab": b"\x89PNG"})
    u = Trajectory.decode(t.encode())
    assert u.id == t.id and u.outcome == "terminated" and u.success
    np.testing.assert_array_equal(u.tokens, t.tokens)
    np.testing.assert_array_equal(u.versions, t.versions)
    assert u.turns[0].action == {"type": "click", "target": "A"}
    assert u.images == {"ab": b"\x89PNG"}
    assert u.versions_spanned == (3, 3)
    r = turn_rewards(u)
    assert r[8] == 1.0 and r.sum() == 1.0


@pytest.mark.parametrize("frame,why", [
    (b"\xc1garbage", "not msgpack"),
    (b"\x92\x01\x02", "expected a map"),
])
def test_schema_rejects_garbage(frame, why):
    with pytest.raises(SchemaError, match=why):
        Trajectory.decode(frame)


def test_schema_rejects_bad_content():
    import msgpack

    d = _traj().to_dict()
    with pytest.raises(SchemaError, match="unknown schema version"):
        Trajectory.from_dict({**d, "schema": SCHEMA_VERSION + 1})
    with pytest.raises(SchemaError, match="outcome"):
        Trajectory.from_dict({**d, "outcome": "crashed"})
    with pytest.raises(SchemaError, match="entries"):
        Trajectory.from_dict({**d, "mask": b"\x01"})
    bad = _traj(versions=np.full(12, -1, np.int32))
    with pytest.raises(SchemaError, match="no policy version"):
        Trajectory.decode(bad.encode())
    with pytest.raises(SchemaError, match="exceeds"):
        Trajectory.decode(msgpack.packb(d), max_bytes=10)


def test_config_overrides_and_errors(tmp_path):
    cfg = C.load("quickstart", None, ["learner.staleness.eta=5", "actor.env_ids=[builtin/click,builtin/menu]", "learner.ppo.adv_norm=false"])
    assert cfg.learner.staleness.eta == 5 and cfg.actor.env_ids == ["builtin/click", "builtin/menu"] and cfg.learner.ppo.adv_norm is False
    C.save(cfg, tmp_path / "c.yaml")
    assert C.load(None, str(tmp_path / "c.yaml")).learner.staleness.eta == 5
    with pytest.raises(C.ConfigError, match="unknown config key"):
        C.load(None, None, ["learner.etaa=1"])
    with pytest.raises(C.ConfigError, match="not int"):
        C.load(None, None, ["learner.batch_size=abc"])
    with pytest.raises(C.ConfigError, match="no preset"):
        C.load("nope")


def test_config_sections_and_renamed_keys(tmp_path):
    """learner.* is grouped in sections; a key of the flat layout is one ConfigError that names its new place."""
    cfg = C.load(None, None, ["learner.staleness.eta=4", "learner.group.size=4", "learner.group.timeout_s=30",
                              "learner.stream.durability=checkpoint", "learner.publish.keep_versions=5"])
    assert (cfg.learner.staleness.eta, cfg.learner.group.size, cfg.learner.group.timeout_s) == (4, 4, 30.0)
    assert cfg.learner.stream.durability == "checkpoint" and cfg.learner.publish.keep_versions == 5
    C.save(cfg, tmp_path / "c.yaml")
    assert C.load(None, str(tmp_path / "c.yaml")).learner == cfg.learner
    with pytest.raises(C.ConfigError, match=r"learner\.eta is now learner\.staleness\.eta"):
        C.load(None, None, ["learner.eta=4"])
    (tmp_path / "old.yaml").write_text("learner: {eta: 4}\n")
    with pytest.raises(C.ConfigError, match=r"learner\.eta is now learner\.staleness\.eta"):
        C.load(None, str(tmp_path / "old.yaml"))
    with pytest.raises(C.ConfigError, match=r"actor\.group_size is now learner\.group\.size"):
        C.load(None, None, ["actor.group_size=4"])
    for old, new in C.LearnerConfig.MOVED.items():  # every old key names a key that exists
        node = C.RunConfig()
        for part in new.split("."):
            node = getattr(node, part)
    text = C.help_text()
    assert "[learner.staleness]" in text and "learner.stream.host = '127.0.0.1'" in text and "control.auth_token" in text


def test_control_token_is_required_with_a_service_token():
    with pytest.raises(C.ConfigError, match="control.auth_token"):
        C.load(None, None, ["envd.auth_token=x"])
    assert C.load(None, None, ["envd.auth_token=x", "control.auth_token=y"]).control.auth_token == "y"


def test_every_config_field_has_help():
    import dataclasses

    for cls in (C.RunConfig, C.ModelConfig, C.EnvdConfig, C.InferenceConfig, C.ActorConfig, C.LearnerConfig, C.SFTConfig,
                C.PPOConfig, C.StalenessConfig, C.GroupConfig, C.ValuePretrainConfig, C.CheckpointConfig,
                C.PublishConfig, C.StreamConfig, C.ControlConfig):
        for f in dataclasses.fields(cls):
            if not dataclasses.is_dataclass(f.type if not isinstance(f.type, str) else None) and f.name not in ("model", "envd", "inference", "actor", "learner", "sft"):
                assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"


@pytest.mark.parametrize("extra", [{}, {"tie_word_embeddings": False, "rope_theta": 100.0}])
def test_model_matches_transformers(tmp_path, extra):
    transformers = pytest.importorskip("transformers")
    m = CausalLM(DecoderConfig(vocab_size=300, num_key_value_heads=2, **extra)).init_weights(1, std=0.1)
    m.save_hf(tmp_path / "ck")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ck", dtype=torch.float32)
    ids = torch.randint(0, 300, (2, 17))
    with torch.no_grad():
        assert torch.allclose(m(ids)[0], hf(ids).logits, atol=1e-4)


def test_model_cache_padding_and_logprobs_at():
    m = CausalLM(DecoderConfig(vocab_size=300)).init_weights(2, std=0.1)
    ids = torch.randint(0, 300, (2, 17))
    with torch.no_grad():
        full = m(ids)[0]
        a, past = m(ids[:, :10])
        b, _ = m(ids[:, 10:], past=past)
        assert torch.allclose(torch.cat([a, b], 1), full, atol=1e-5)
        valid = torch.ones(2, 17, dtype=torch.bool)
        valid[0, :3] = False
        pos = (valid.cumsum(1) - 1).clamp(min=0)
        assert torch.allclose(m(ids, positions=pos, key_valid=valid)[0][0, 3:], m(ids[:1, 3:])[0][0], atol=1e-5)
        mask = torch.zeros(2, 17)
        mask[:, 12:15] = 1
        lp = m.logprobs_at(ids, torch.ones(2, 17, dtype=torch.bool), mask)
        ref = m.token_logprobs(ids)[:, 12:15].reshape(-1)
        assert torch.allclose(lp, ref, atol=1e-5)


