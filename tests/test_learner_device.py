"""learner.device / learner.precision: resolution and clear errors, the CPU path unchanged bit for bit, bf16 autocast
(on the CPU here; on CUDA in the gpu-marked test), checkpoints and published weights as fp32 CPU tensors."""
import pathlib

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from learner import dist_check
from learner.device import autocast, resolve_device, resolve_precision
from learner.main import Learner
from learner.publish import publish_weights
from learner.ppo import PPOTrainer
from core import config as C
from core.config import ConfigError, LearnerConfig, PPOConfig
from core.model import DecoderConfig
from learner.policy import TrainPolicy
from core.schema import Trajectory

V = dist_check.V


def batch(seed: int, n: int = 8) -> list[Trajectory]:
    """Mixed lengths, rewards at the end, two groups (the distributed check's batches, shorter)."""
    return dist_check.batch(seed, n, max_len=24)


def tiny() -> TrainPolicy:
    return TrainPolicy.from_config(DecoderConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2), seed=0)


# ---- resolution ------------------------------------------------------------------------------------------------
def test_auto_is_the_cpu_without_cuda_and_cuda_without_cuda_is_a_config_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    for spec in ("cuda", "cuda:0", "CUDA:1"):
        with pytest.raises(ConfigError, match=r"learner\.device=.*(without CUDA|no CUDA device).*learner\.device=cpu"):
            resolve_device(spec)
    for bad in ("gpu", "cuda:", "cuda:x", "mps"):
        with pytest.raises(ConfigError, match=r"learner\.device: .* is not one of auto \| cpu \| cuda"):
            resolve_device(bad)


def test_this_machine_resolves_without_touching_cuda():
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        assert resolve_precision("auto", resolve_device("auto")) is None
    else:
        assert resolve_device("auto").type == "cuda"


def test_each_rank_takes_its_local_gpu(monkeypatch):
    """Under accelerate (WORLD_SIZE > 1) auto/cuda mean cuda:LOCAL_RANK; one named GPU for all ranks is refused."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto", local_rank=1, world=2) == torch.device("cuda", 1)
    assert resolve_device("cuda", local_rank=0, world=2) == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert resolve_device("cuda") == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match="names one GPU, but 2 processes"):
        resolve_device("cuda:0")
    with pytest.raises(ConfigError, match="cuda:3 does not exist"):
        resolve_device("cuda", local_rank=3, world=4)
    assert resolve_device("cuda:1", world=1) == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match="cuda:2 does not exist"):
        resolve_device("cuda:2", world=1)


def test_precision_choice():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_precision("auto", cpu) is None
    assert resolve_precision("auto", gpu) is torch.bfloat16
    assert resolve_precision("fp32", gpu) is None
    assert resolve_precision("bf16", cpu) is torch.bfloat16  # decided: allowed on the CPU, via CPU autocast
    for bad in ("fp16", "bfloat16", "half"):
        with pytest.raises(ConfigError, match=r"learner\.precision: .* is not one of auto \| fp32 \| bf16"):
            resolve_precision(bad, cpu)


def test_config_fields_and_help():
    cfg = C.load(overrides=["learner.device=cpu", "learner.precision=bf16"])
    assert (cfg.learner.device, cfg.learner.precision) == ("cpu", "bf16")
    assert (C.RunConfig().learner.device, C.RunConfig().learner.precision) == ("auto", "auto")
    text = C.help_text()
    assert "learner.device" in text and "cuda:N" in text and "learner.precision" in text


def test_a_learner_with_cuda_asked_for_and_none_there_exits_with_a_clear_error(monkeypatch, tmp_path, capsys):
    from learner.main import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("core.proc.die_with_parent", lambda: None)
    cfg = C.load(overrides=["learner.device=cuda"])
    assert main(cfg, str(tmp_path), str(tmp_path / "no-model"), []) == 2
    assert "tars learner: learner.device='cuda'" in capsys.readouterr().err
    cfg = C.load(overrides=["learner.device=cpu", "learner.precision=fp16"])
    assert main(cfg, str(tmp_path), str(tmp_path / "no-model"), []) == 2
    assert "learner.precision" in capsys.readouterr().err


# ---- the CPU path --------------------------------------------------------------------------------------------
def _train(device_kw: dict, steps: int = 3, algo: str = "ppo"):
    torch.manual_seed(0)
    pol = tiny()
    critic = TrainPolicy.from_config(pol.config, value_head=True, seed=1) if algo == "ppo" else None
    dev = device_kw.pop("device", None)
    if dev is not None:
        pol.to(dev)
        if critic is not None:
            critic.to(dev)
    cfg = LearnerConfig(algo=algo, lr=1e-2, warmup_steps=1, ppo=PPOConfig(epochs=2, minibatches=2, kl_coef=0.05))
    tr = PPOTrainer(pol, critic, cfg, 0, **device_kw)
    tr.chunk_tokens = 50
    ms = [tr.step(batch(v), v) for v in range(steps)]
    return pol, critic, ms


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_cpu_explicitly_is_bit_identical_to_the_default_path(algo):
    """device=cpu resolved and fp32 ("auto" on the CPU) changes nothing: the same parameters, bit for bit."""
    dev = resolve_device("cpu")
    p0, c0, m0 = _train({}, algo=algo)
    p1, c1, m1 = _train({"device": dev, "amp_dtype": resolve_precision("auto", dev)}, algo=algo)
    for (k, x), y in zip(p0.state_dict().items(), p1.state_dict().values()):
        assert torch.equal(x, y), k
    if c0 is not None:
        for (k, x), y in zip(c0.state_dict().items(), c1.state_dict().values()):
            assert torch.equal(x, y), k
    assert [m["pg_loss"] for m in m0] == [m["pg_loss"] for m in m1]
    assert max(float((x.detach() - y.detach()).abs().max()) for x, y in zip(p0.parameters(), tiny().parameters())) > 1e-3  # it trained


def test_bf16_autocast_on_the_cpu_trains_with_fp32_master_weights():
    """bf16 on the CPU runs (CPU autocast): finite losses, fp32 parameters and optimizer state, close to fp32."""
    dev = torch.device("cpu")
    p32, _, _ = _train({})
    pbf, cbf, ms = _train({"device": dev, "amp_dtype": torch.bfloat16})
    assert all(np.isfinite(m["pg_loss"]) and np.isfinite(m["v_loss"]) for m in ms)
    assert {p.dtype for p in pbf.parameters()} == {torch.float32} == {p.dtype for p in cbf.parameters()}
    with torch.no_grad():
        diff = max(float((x - y).abs().max()) for x, y in zip(p32.parameters(), pbf.parameters()))
        moved = max(float((x - y).abs().max()) for x, y in zip(p32.parameters(), tiny().parameters()))
    assert 0 < diff < moved, (diff, moved)  # really bf16 (not identical), yet the same training
    with autocast(dev, torch.bfloat16):
        logits = pbf(torch.tensor([[1, 2, 3]]))
    assert logits.dtype == torch.bfloat16  # the forward really ran in bf16


def test_sft_follows_the_learner_choice(monkeypatch, tmp_path):
    """tars sft: cuda without CUDA is refused before any work; bf16 on the CPU trains and saves fp32 weights."""
    from learner.sft import run, train_sft

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"learner\.device='cuda'"):
        run(C.load(overrides=["learner.device=cuda"]), str(tmp_path / "absent"), str(tmp_path / "out"), ["x.twl"])
    assert not (tmp_path / "out").exists()
    pol = tiny()
    demos = [(t.tokens.tolist(), t.mask.tolist()) for t in batch(0)]
    m = train_sft(pol, demos, 10, 4, 1e-2, 0, 0, device=torch.device("cpu"), amp_dtype=torch.bfloat16)
    assert np.isfinite(m["sft_loss"]) and {p.dtype for p in pol.parameters()} == {torch.float32}
    pol.save_hf(tmp_path / "m")
    assert {t.dtype for t in load_file(str(tmp_path / "m" / "model.safetensors")).values()} == {torch.float32}


def test_sft_takes_a_negative_seed(tmp_path):
    """seed=-3 is a legal config value (tests/test_config.py), but train_sft gave it to np.random.default_rng, which
    refuses negative seeds: `tars sft` and `tars up`'s warm start failed with "expected non-negative integer" after
    the demonstrations were rolled. The seed is taken modulo 2**64; two seeds still draw different batches."""
    from learner.sft import train_sft

    demos = [(t.tokens.tolist(), t.mask.tolist()) for t in batch(0)]
    losses = {s: train_sft(tiny(), demos, 3, 2, 1e-2, s, 0, device=torch.device("cpu"))["sft_loss"] for s in (-3, 3)}
    assert all(np.isfinite(v) for v in losses.values()) and losses[-3] != losses[3]


# ---- the Learner: placement, checkpoints, published weights ------------------------------------------------------
def _learner(tmp_path: pathlib.Path, run: str, overrides: list[str], resume: bool = False) -> Learner:
    model = tmp_path / "model"
    if not model.exists():
        tiny().save_hf(model)
    cfg = C.load(overrides=["learner.batch_size=8", "learner.lr=0.01", "learner.warmup_steps=1"] + overrides)
    return Learner(cfg, str(tmp_path / run), str(model), [], resume=resume)


def _close(ln: Learner) -> None:
    for f in (ln.episodes, ln.metrics_log, ln.trained_log):
        f.close()


def test_learner_on_cpu_checkpoints_resume_to_the_same_state(tmp_path):
    (tmp_path / "a").mkdir()
    a = _learner(tmp_path, "a", ["learner.device=cpu"])
    assert a.device == torch.device("cpu") and a.amp_dtype is None
    for v in range(2):
        a._update(batch(v))
        a.version += 1
    a.checkpoint()
    state = torch.load(tmp_path / "a" / "ckpt" / "train_state.pt", weights_only=True)
    assert "cuda_rng" not in state and state["torch_rng"].device.type == "cpu"
    b = _learner(tmp_path, "a", ["learner.device=cpu"], resume=True)
    assert b.version == 2
    for x, y in zip(a.policy.parameters(), b.policy.parameters()):
        assert torch.equal(x, y)
    for x, y in zip(a.critic.parameters(), b.critic.parameters()):
        assert torch.equal(x, y)
    # The next update after the resume equals the next update without one (optimizer and schedule restored).
    ma, mb = a._update(batch(7)), b._update(batch(7))
    assert ma["pg_loss"] == mb["pg_loss"]
    for x, y in zip(a.policy.parameters(), b.policy.parameters()):
        assert torch.equal(x, y)
    _close(a)
    _close(b)


def test_a_resume_trains_at_the_configured_learning_rates_and_weight_decay(tmp_path):
    """The optimizers' state dicts carry the checkpoint's lr and weight decay: a restart with other settings trains
    at the configured ones (before: at the checkpoint's, 0.01 here, silently), at the schedule's step."""
    (tmp_path / "a").mkdir()
    over = ["learner.device=cpu", "learner.warmup_steps=4"]
    a = _learner(tmp_path, "a", over)
    for v in range(2):
        a._update(batch(v))
        a.version += 1
    assert a.trainer.opt.param_groups[0]["lr"] == pytest.approx(0.01 * 3 / 4)
    a.checkpoint()
    new = ["learner.lr=0.001", "learner.critic_lr=0.0005", "learner.weight_decay=0.1", "learner.warmup_steps=2"]
    b = _learner(tmp_path, "a", over + new, resume=True)
    g, cg = b.trainer.opt.param_groups[0], b.trainer.critic_opt.param_groups[0]
    assert (g["lr"], g["weight_decay"], cg["lr"], cg["weight_decay"]) == (0.001, 0.1, 0.0005, 0.1)  # step 2: warm
    assert b.trainer.sched.get_last_lr() == [0.001] and b.trainer.sched.last_epoch == 2
    assert b._update(batch(7))["lr"] == 0.001
    same = _learner(tmp_path, "a", over, resume=True)  # the same settings: the checkpoint's schedule, unchanged
    assert same.trainer.opt.param_groups[0]["lr"] == pytest.approx(0.01 * 3 / 4)
    for ln in (a, b, same):
        _close(ln)


def test_published_and_final_weights_carry_the_model_directorys_tokenizer(tmp_path):
    """Each published version and the final export are model directories of their own: the HF layout the engine
    loads (the policy's exact weights) and the starting model directory's tokenizer files."""
    from core.model import CausalLM
    from learner.publish import export

    (tmp_path / "p").mkdir()
    tiny().save_hf(tmp_path / "model", extra_files={"tokenizer.json": "{}", "chat_template.jinja": "{{ messages }}"})
    ln = _learner(tmp_path, "p", ["learner.device=cpu", "learner.algo=grpo"])
    ln._update(batch(0))
    ln.publisher.publish(1)
    export(ln.policy, ln.model_dir, tmp_path / "p" / "final")
    for d in (tmp_path / "p" / "weights" / "v000001", tmp_path / "p" / "final"):
        assert (d / "tokenizer.json").read_text() == "{}" and (d / "chat_template.jinja").exists()
        engine = CausalLM.load_hf(d)
        assert all(torch.equal(engine.hf_state_dict()[k], v) for k, v in ln.policy.hf_state_dict().items())
    _close(ln)


@pytest.mark.gpu
def test_cuda_bf16_steps_train_and_publish_fp32_cpu_weights(tmp_path):
    """A few PPO steps on CUDA in bf16: finite losses, the parameters move, they stay fp32 on the GPU; published
    weights and checkpoints are fp32 CPU tensors; a resume restores the CUDA RNG and the same state."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    (tmp_path / "g").mkdir()
    ln = _learner(tmp_path, "g", ["learner.device=cuda", "learner.precision=auto", "learner.ppo.kl_coef=0.05"])
    assert ln.device.type == "cuda" and ln.amp_dtype is torch.bfloat16
    assert next(ln.policy.parameters()).device.type == "cuda" and next(ln.critic.parameters()).device.type == "cuda"
    before = [p.detach().clone() for p in ln.policy.parameters()]
    for v in range(3):
        m = ln._update(batch(v))
        ln.version += 1
        assert np.isfinite(m["pg_loss"]) and np.isfinite(m["v_loss"]) and np.isfinite(m["grad_norm"]), m
    assert {p.dtype for p in ln.policy.parameters()} == {torch.float32}
    moved = max(float((p - q).abs().max()) for p, q in zip(ln.policy.parameters(), before))
    assert moved > 1e-4, moved
    publish_weights(ln.policy, tmp_path / "weights", 3, [], keep=2)
    sd = load_file(str(tmp_path / "weights" / "v000003" / "model.safetensors"))
    assert {t.dtype for t in sd.values()} == {torch.float32} and {t.device.type for t in sd.values()} == {"cpu"}
    own = ln.policy.hf_state_dict()
    assert all(torch.equal(sd[k], own[k].cpu()) for k in sd)
    ln.checkpoint()
    state = torch.load(tmp_path / "g" / "ckpt" / "train_state.pt", weights_only=True)
    assert "cuda_rng" in state

    def devices(o):
        if isinstance(o, torch.Tensor):
            return {o.device.type}
        if isinstance(o, dict):
            return set().union(*(devices(v) for v in o.values())) if o else set()
        if isinstance(o, (list, tuple)):
            return set().union(*(devices(v) for v in o)) if o else set()
        return set()

    assert devices(state) == {"cpu"}
    r = _learner(tmp_path, "g", ["learner.device=cuda", "learner.precision=auto", "learner.ppo.kl_coef=0.05"], resume=True)
    for x, y in zip(ln.policy.parameters(), r.policy.parameters()):
        assert torch.equal(x, y)
    assert torch.equal(torch.cuda.get_rng_state(r.device), state["cuda_rng"])
    m1, m2 = ln._update(batch(9)), r._update(batch(9))
    assert m1["pg_loss"] == pytest.approx(m2["pg_loss"], rel=1e-3, abs=1e-4)
    _close(ln)
    _close(r)


@pytest.mark.gpu
def test_sft_on_cuda_in_bf16(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from learner.sft import train_sft

    pol = tiny()
    demos = [(t.tokens.tolist(), t.mask.tolist()) for t in batch(0)]
    m = train_sft(pol, demos, 20, 4, 1e-2, 0, 0, device=torch.device("cuda"), amp_dtype=torch.bfloat16)
    assert np.isfinite(m["sft_loss"]) and next(pol.parameters()).dtype == torch.float32
    pol.save_hf(tmp_path / "m")
    assert {t.device.type for t in load_file(str(tmp_path / "m" / "model.safetensors")).values()} == {"cpu"}


def test_value_pretraining_stops_at_the_same_update_across_a_resume(tmp_path):
    """The early stop reads the explained variance of the last 10 batches: a resume keeps that window, so value
    pretraining ends at the same update as in a run that was never stopped."""
    (tmp_path / "a").mkdir()
    over = ["learner.value_pretrain.steps=30", "learner.value_pretrain.target_ev=-1e9"]  # stops on the window alone
    a = _learner(tmp_path, "a", over)
    for v in range(6):
        assert a._update(batch(v))["phase"] == "value_pretrain"
    a.checkpoint()
    b = _learner(tmp_path, "a", over, resume=True)
    assert list(b.updater.evs) == list(a.updater.evs)
    for v in range(6, 10):
        ma, mb = a._update(batch(v)), b._update(batch(v))
        assert ma["phase"] == mb["phase"] == "value_pretrain"
    assert a.updater.value_pretrain_left == b.updater.value_pretrain_left == 0  # 10 batches: the window is full
    _close(a)
    _close(b)


def test_a_resume_takes_the_configured_entropy_coef_unless_it_adapts(tmp_path):
    """learner.ppo.entropy_coef is a setting when target_entropy is 0: a restart with another value trains with it
    (before: with the checkpoint's 0.01, silently). Adapted (target_entropy > 0), the coefficient is state and goes
    on from the checkpoint's value."""
    (tmp_path / "a").mkdir()
    a = _learner(tmp_path, "a", ["learner.ppo.entropy_coef=0.01"])
    a.checkpoint()
    b = _learner(tmp_path, "a", ["learner.ppo.entropy_coef=0"], resume=True)
    assert b.trainer.entropy_coef == 0.0
    adapt = ["learner.ppo.target_entropy=1.0", "learner.ppo.entropy_coef=0.01"]
    b.trainer.entropy_coef = 0.0123                 # as an adapting run's updates would have moved it
    b.checkpoint()
    c = _learner(tmp_path, "a", adapt, resume=True)
    assert c.trainer.entropy_coef == 0.0123
    for ln in (a, b, c):
        _close(ln)


def test_a_grpo_checkpoint_resumed_under_ppo_pretrains_its_fresh_critic(tmp_path):
    """A checkpoint holds no critic when it was taken under algo=grpo: resumed under ppo, the critic is a fresh one
    (zero value head), so value pretraining runs as configured. Before, the GRPO checkpoint's value_pretrain_left (0)
    was taken and PPO trained the policy at once against the untrained critic; a PPO checkpoint keeps its own."""
    (tmp_path / "a").mkdir()
    a = _learner(tmp_path, "a", ["learner.algo=grpo"])
    for v in range(2):
        assert a._update(batch(v))["phase"] == "grpo"
        a.version += 1
    a.checkpoint()
    over = ["learner.algo=ppo", "learner.value_pretrain.steps=3"]
    b = _learner(tmp_path, "a", over, resume=True)
    assert b.version == 2 and b.updater.value_pretrain_left == 3
    assert b._update(batch(2))["phase"] == "value_pretrain"
    b.checkpoint()                                  # a PPO checkpoint: its critic and pretraining state go on
    c = _learner(tmp_path, "a", over, resume=True)
    assert c.updater.value_pretrain_left == 2 and list(c.updater.evs) == list(b.updater.evs)
    for x, y in zip(b.critic.parameters(), c.critic.parameters()):
        assert torch.equal(x, y)
    for ln in (a, b, c):
        _close(ln)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1e-7])
def test_the_learner_recomputes_the_actors_tempered_policy(tmp_path, temperature):
    """The engine reports behaviour logprobs as log_softmax(logits / T) at actor.temperature T
    (inference_server/sampling.py): the learner's pi_prox is that same tempered policy, so an on-policy batch has
    importance ratios of 1 and no behaviour-proximal KL, whatever T."""
    (tmp_path / "a").mkdir()
    ln = _learner(tmp_path, "a", [f"actor.temperature={temperature}"])
    trajs = batch(3)
    with torch.no_grad():  # the engine's formula, from the logits
        for t in trajs:
            ids = torch.from_numpy(t.tokens.astype(np.int64))[None]
            T = temperature if temperature >= 1e-6 else 1.0  # the engine samples greedily below 1e-6, reports T = 1
            lp = torch.log_softmax(ln.policy(ids)[0, :-1].float() / T, -1).gather(-1, ids[0, 1:, None])[:, 0]
            t.logprobs = np.where(t.mask > 0, np.concatenate([[0.0], lp.numpy()]), 0.0).astype(np.float32)
    m = ln._update(trajs)
    assert m["is_ratio_mean"] == pytest.approx(1.0, abs=1e-5) and abs(m["behav_prox_kl"]) < 1e-5, m
    _close(ln)
