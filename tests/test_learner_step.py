"""The learner's update: behaviour tests on a bandit, chunked accumulation equals one padded batch, and truncated
episodes bootstrap from the critic's value of their final state."""
import copy
import dataclasses

import numpy as np
import pytest
import torch

from learner.ppo import PPOTrainer
from core.config import LearnerConfig, PPOConfig
from core.model import DecoderConfig
from learner.policy import TrainPolicy
from core.schema import Trajectory, Turn

V, PROMPT, GOOD = 40, [1, 5, 6, 7], 11


def sample(policy, n, version=0, gen=None):
    """One-token answers to a fixed prompt; reward 1 for token GOOD."""
    with torch.no_grad():
        logits = policy(torch.tensor([PROMPT]))
        lp = torch.log_softmax(logits[0, -1], -1)
    toks = torch.multinomial(lp.exp(), n, replacement=True, generator=gen)
    out = []
    for i, t in enumerate(toks.tolist()):
        r = 1.0 if t == GOOD else 0.0
        out.append(Trajectory(
            id=f"{version}-{i}", env_id="bandit", outcome="terminated", tokens=np.array(PROMPT + [t], np.int32),
            logprobs=np.array([0, 0, 0, 0, float(lp[t])], np.float32), versions=np.array([-1] * 4 + [version], np.int32),
            mask=np.array([0, 0, 0, 0, 1], np.uint8), turns=[Turn("", "", {}, r, 4, 5)], ret=r, success=bool(r)))
    return out, float(lp[GOOD].exp())


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_weight_decay_applies_to_the_policy_and_the_critic(wd):
    """learner.weight_decay reached the policy's AdamW only: the critic's used AdamW's default (0.01) whatever it said.
    A step with zero gradients moves each optimiser's weights by exactly lr * weight_decay * w."""
    pol = TrainPolicy.from_config(DecoderConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1), seed=0)
    critic = TrainPolicy.from_config(pol.config, value_head=True, seed=1)
    tr = PPOTrainer(pol, critic, LearnerConfig(algo="ppo", lr=1e-2, critic_lr=1e-2, weight_decay=wd), 0)
    for opt, model in ((tr.opt, pol), (tr.critic_opt, critic)):
        w = next(p for p in model.parameters() if p.requires_grad)
        before = w.detach().clone()
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        lr = opt.param_groups[0]["lr"]
        opt.step()
        torch.testing.assert_close(w.detach(), before * (1 - lr * wd), rtol=0, atol=0)


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_policy_learns_a_bandit(algo):
    torch.manual_seed(0)
    pol = TrainPolicy.from_config(DecoderConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1), seed=0)
    critic = TrainPolicy.from_config(pol.config, value_head=True, seed=1) if algo == "ppo" else None
    tr = PPOTrainer(pol, critic, LearnerConfig(algo=algo, lr=3e-3, warmup_steps=1), 0)
    g = torch.Generator().manual_seed(0)
    _, p0 = sample(pol, 1)
    for v in range(40):
        batch, _ = sample(pol, 64, v, g)
        if algo == "grpo":
            for t in batch:
                t.group = "g"
        tr.step(batch, v)
    _, p1 = sample(pol, 1)
    assert p0 < 0.1 and p1 > 0.5, (p0, p1)


def test_stale_samples_are_corrected_not_trusted():
    """Decoupled PPO: with samples from an old policy the update differs from trusting them as on-policy."""
    torch.manual_seed(0)
    pol = TrainPolicy.from_config(DecoderConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1), seed=0, std=0.3)
    batch, _ = sample(pol, 64)
    for i, t in enumerate(batch):  # pretend an older policy produced half of them, with other logprobs
        t.logprobs = t.logprobs.copy()
        t.logprobs[-1] = t.logprobs[-1] - (1.0 if i % 2 else 0.0)
        t.ret = t.turns[0].reward = float(i % 3 == 0)  # rewards that do not depend on the sampled token
    a, b = copy.deepcopy(pol), copy.deepcopy(pol)
    for t in batch:
        t.group = "g"
    ta = PPOTrainer(a, None, LearnerConfig(algo="grpo", ppo=PPOConfig(behav_cap=5.0)), 0)
    tb = PPOTrainer(b, None, LearnerConfig(algo="grpo", ppo=PPOConfig(behav_cap=1.0)), 0)
    for tr in (ta, tb):  # plain SGD: Adam's scale invariance would hide a uniform reweighting
        tr.opt = torch.optim.SGD(tr.policy.parameters(), lr=0.1)
        tr.sched = torch.optim.lr_scheduler.LambdaLR(tr.opt, lambda s: 1.0)
    ta.step(batch, 1)
    tb.step(batch, 1)
    diff = max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))
    assert diff > 1e-6


def test_chunked_update_equals_one_padded_batch():
    """Length-bucketed chunks with accumulation give the same parameters as one big chunk (SGD, exact)."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    pol = TrainPolicy.from_config(DecoderConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2), seed=0)
    critic = TrainPolicy.from_config(pol.config, value_head=True, seed=1)
    trajs = []
    for i in range(12):
        n = int(rng.integers(6, 30))
        m = np.zeros(n, np.uint8)
        m[n - 3:] = 1
        trajs.append(Trajectory(id=str(i), env_id="x", outcome="terminated", tokens=rng.integers(0, V, n).astype(np.int32),
                                logprobs=np.where(m, -1.5, 0).astype(np.float32), versions=np.where(m, 0, -1).astype(np.int32),
                                mask=m, turns=[Turn("", "", {}, float(i % 2), n - 3, n)], ret=float(i % 2)))
    results = []
    for chunk_tokens in (10**6, 40):
        p, c = copy.deepcopy(pol), copy.deepcopy(critic)
        tr = PPOTrainer(p, c, LearnerConfig(lr=0.1, warmup_steps=1, grad_clip=1e9), 0)
        tr.opt = torch.optim.SGD(p.parameters(), lr=0.1)
        tr.critic_opt = torch.optim.SGD(c.parameters(), lr=0.1)
        tr.sched = torch.optim.lr_scheduler.LambdaLR(tr.opt, lambda s: 1.0)
        tr.chunk_tokens = chunk_tokens
        tr.step(trajs, 0)
        results.append((p, c))
    for x, y in zip(results[0][0].parameters(), results[1][0].parameters()):
        assert torch.allclose(x, y, atol=1e-6)
    for x, y in zip(results[0][1].parameters(), results[1][1].parameters()):
        assert torch.allclose(x, y, atol=1e-6)


def test_no_policy_step_without_advantage_signal():
    """A batch whose advantages are all zero (every group member equal) leaves the policy exactly as it was,
    even after earlier steps filled Adam's momentum."""
    torch.manual_seed(0)
    pol = TrainPolicy.from_config(DecoderConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1), seed=0)
    tr = PPOTrainer(pol, None, LearnerConfig(algo="grpo", lr=1e-2, warmup_steps=1), 0)
    batch, _ = sample(pol, 32)
    for i, t in enumerate(batch):
        t.group, t.ret = "g", float(i % 2)
        t.turns[0].reward = t.ret
    tr.step(batch, 0)  # a real update: momentum is now non-zero
    for t in batch:
        t.ret = t.turns[0].reward = 0.0
    before = [p.detach().clone() for p in pol.parameters()]
    m = tr.step(batch, 1)
    assert m["policy_step_skipped"]
    assert all(torch.equal(a, b) for a, b in zip(before, pol.parameters()))


def test_kl_anchor_keeps_the_policy_near_its_start():
    """kl_coef > 0 penalises drift from the starting policy: after the same updates it is measurably closer."""
    def run(kl_coef):
        torch.manual_seed(0)
        pol = TrainPolicy.from_config(DecoderConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1), seed=0)
        start = copy.deepcopy(pol)
        tr = PPOTrainer(pol, None, LearnerConfig(algo="grpo", lr=3e-3, warmup_steps=1, ppo=PPOConfig(kl_coef=kl_coef)), 0)
        g = torch.Generator().manual_seed(0)
        m = {}
        for v in range(20):
            batch, _ = sample(pol, 64, v, g)
            for t in batch:
                t.group = "g"
            m = tr.step(batch, v)
        with torch.no_grad():
            p = torch.log_softmax(pol(torch.tensor([PROMPT]))[0, -1], -1)
            q = torch.log_softmax(start(torch.tensor([PROMPT]))[0, -1], -1)
        return float((p.exp() * (p - q)).sum()), m

    free, m_free = run(0.0)
    anchored, m_anchored = run(5.0)
    assert "kl_ref" not in m_free and m_anchored["kl_ref"] >= 0.0
    assert anchored < 0.7 * free, (anchored, free)



def test_negative_advantages_can_be_tempered():
    """neg_adv_weight scales only the pushes away from failed samples, and the bandit is still learned at 0.2."""
    from learner.algorithms import asymmetric_advantages

    a = torch.tensor([[1.5, -2.0, 0.0], [-0.5, 0.25, -1.0]])
    ref = torch.tensor([[x if x > 0 else 0.2 * x for x in row] for row in a.tolist()])
    assert torch.allclose(asymmetric_advantages(a, 0.2), ref)
    assert torch.equal(asymmetric_advantages(a, 1.0), a)
    with pytest.raises(ValueError):
        asymmetric_advantages(a, 1.5)

    torch.manual_seed(0)
    pol = TrainPolicy.from_config(DecoderConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1), seed=0)
    tr = PPOTrainer(pol, TrainPolicy.from_config(pol.config, value_head=True, seed=1),
                    LearnerConfig(lr=3e-3, warmup_steps=1, ppo=PPOConfig(neg_adv_weight=0.2)), 0)
    g = torch.Generator().manual_seed(0)
    _, p0 = sample(pol, 1)
    for v in range(40):
        tr.step(sample(pol, 64, v, g)[0], v)
    _, p1 = sample(pol, 1)
    assert p0 < 0.1 and p1 > 0.5, (p0, p1)


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_fused_single_pass_equals_the_separate_proximal_pass(algo):
    """One epoch, one minibatch: taking pi_prox and the critic's values from the training forward gives the same
    parameters and metrics as recomputing them in separate no-grad passes first (with stale behaviour logprobs, so
    the decoupled weight and the clip are live), across several length chunks and two updates."""
    from learner.dist_check import batch
    torch.manual_seed(0)
    pol = TrainPolicy.from_config(DecoderConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2), seed=0)
    critic = TrainPolicy.from_config(pol.config, value_head=True, seed=1) if algo == "ppo" else None
    runs = []
    for fused in (True, False):
        p, c = copy.deepcopy(pol), copy.deepcopy(critic)
        tr = PPOTrainer(p, c, LearnerConfig(algo=algo, lr=3e-2, warmup_steps=1, critic_lr=3e-2), 0)
        tr.fuse_single_pass = fused
        tr.chunk_tokens = 60
        ms = [tr.step(batch(s, n=12, max_len=30), s) for s in range(2)]
        runs.append((p, c, ms))
    (p1, c1, m1), (p2, c2, m2) = runs
    for x, y in zip(p1.parameters(), p2.parameters()):
        assert torch.allclose(x, y, atol=1e-6)
    if algo == "ppo":
        for x, y in zip(c1.parameters(), c2.parameters()):
            assert torch.allclose(x, y, atol=1e-6)
    assert not torch.allclose(next(p1.parameters()), next(pol.parameters()))  # the updates did move the weights
    for a, b in zip(m1, m2):
        for k in ("pg_loss", "v_loss", "entropy", "clipfrac", "behav_prox_kl", "explained_variance"):
            if k in b:
                assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k


def test_adaptive_entropy_bonus_holds_the_entropy_at_its_target():
    """With target_entropy set, the bonus's coefficient rises while the policy is below the target and stays within
    [0, entropy_coef_max]; the policy learning the bandit keeps far more entropy than the same run without it."""
    def run(target):
        torch.manual_seed(0)
        pol = TrainPolicy.from_config(DecoderConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1), seed=0)
        cfg = LearnerConfig(algo="grpo", lr=3e-3, warmup_steps=1,
                            ppo=PPOConfig(target_entropy=target, entropy_coef_lr=0.2, entropy_coef_max=1.0))
        tr = PPOTrainer(pol, None, cfg, 0)
        g = torch.Generator().manual_seed(0)
        coefs = []
        for v in range(60):
            batch, _ = sample(pol, 64, v, g)
            for t in batch:
                t.group = "g"
            coefs.append(tr.step(batch, v)["entropy_coef"])
        with torch.no_grad():
            lp = torch.log_softmax(pol(torch.tensor([PROMPT]))[0, -1], -1)
        return float(-(lp.exp() * lp).sum()), float(lp[GOOD].exp()), coefs

    ent_off, p_off, coefs_off = run(0.0)
    ent_on, p_on, coefs_on = run(1.0)
    assert set(coefs_off) == {0.0}
    assert p_off > 0.95 and ent_off < 0.2, (p_off, ent_off)  # without it the bandit collapses onto GOOD
    assert ent_on > 4 * ent_off and ent_on > 0.4, (ent_on, ent_off)
    assert max(coefs_on) > 0 and all(0.0 <= c <= 1.0 for c in coefs_on)
    assert p_on > 0.6, p_on  # and still learns what pays


def test_value_pretraining_stops_on_the_mean_of_recent_batches_not_one_lucky_batch():
    from learner.update import EV_WINDOW, value_pretrain_done

    assert EV_WINDOW == 10
    assert not value_pretrain_done([0.9] * 9, 0.5)  # too few batches to judge
    assert value_pretrain_done([0.9] * 10, 0.5)
    assert not value_pretrain_done([0.3] * 9 + [0.95], 0.5)  # one batch passing the bar is not enough
    assert value_pretrain_done([0.0] * 5 + [0.45] * 5 + [0.6] * 5, 0.5)  # only the last 10 count
    assert not value_pretrain_done([0.5] * 9 + [0.0], 0.5)  # mean 0.45


def test_sft_in_length_chunks_gives_the_gradient_of_one_padded_batch():
    from learner.ppo import sft_loss
    from learner.sft import pad, sft_backward

    V = 50
    pol = TrainPolicy.from_config(DecoderConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2), seed=0)
    g = np.random.default_rng(0)
    batch = []
    for n in g.integers(5, 60, 12):
        toks = g.integers(1, V, n).tolist()
        mask = [0] * (n - 4) + [1] * 4
        batch.append((toks, mask))
    pol.zero_grad()
    ref_loss = sft_loss(pol, *pad(batch, 0))
    ref_loss.backward()
    ref = {k: p.grad.clone() for k, p in pol.named_parameters() if p.grad is not None}
    pol.zero_grad()
    loss = sft_backward(pol, batch, 0, chunk_tokens=120, device=torch.device("cpu"))  # several chunks
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    for k, p in pol.named_parameters():
        if k in ref:
            assert torch.allclose(p.grad, ref[k], atol=1e-6), k


# ---- truncation: the return bootstraps from the critic's value of the state the episode was cut in ----------------
def two_turns(outcome, boot_at=0, final=()):
    """Prompt, answer, prompt, answer (rewards 0 then 1); a truncated one carries the next prompt and boot_at."""
    toks = [1, 5, 6, 11, 7, 8, 12, *final]
    m = np.array([0, 0, 0, 1, 0, 0, 1] + [0] * len(final), np.uint8)
    return Trajectory(id=f"{outcome}-{boot_at}", env_id="x", outcome=outcome, tokens=np.array(toks, np.int32),
                      logprobs=np.where(m, -1.0, 0).astype(np.float32), versions=np.where(m, 0, -1).astype(np.int32),
                      mask=m, turns=[Turn("", "", {}, 0.0, 3, 4), Turn("", "", {}, 1.0, 6, 7)], ret=1.0,
                      boot_at=boot_at).validate()


def test_truncated_returns_bootstrap_by_hand_plain_and_length_adaptive():
    """V = 0.5, 0.8 at the two answers, V(final state) = 2.0, gamma 0.9 (hand values in tests/test_algorithms.py):
    the truncated episode's advantages and lambda = 1 targets include gamma^k * 2.0; the terminated one's, and a
    truncated frame without its final state (boot_at 0, from before the field), do not."""
    from learner.batch import collate

    trajs = [two_turns("terminated"), two_turns("truncated", 9, final=(7, 9)), two_turns("truncated")]
    b = collate(trajs)
    assert b.tokens.shape[1] == 10 and b.widths.tolist() == [7, 10, 7] and b.boot.sum() == 1 and b.boot[1, 9] == 1
    values = torch.zeros(b.mask.shape)
    values[:, 3], values[:, 6], values[1, 9] = 0.5, 0.8, 2.0
    pol = TrainPolicy.from_config(DecoderConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1), seed=0)
    want_targets = [[0.9, 1.0], [2.52, 2.8], [0.9, 1.0]]
    for ppo, a0 in ((PPOConfig(gamma=0.9, lam_policy=1.0), (0.40, 2.02)),                       # plain GAE, lambda 1
                    (PPOConfig(gamma=0.9, length_adaptive=True, length_alpha=1.0), (0.31, 1.12))):  # lambda = 1 - 1/2
        tr = PPOTrainer(pol, TrainPolicy.from_config(pol.config, value_head=True, seed=1), LearnerConfig(ppo=ppo), 0)
        adv, targets = tr.advantages(b, values, None)
        np.testing.assert_allclose(adv[:, [3, 6]].numpy(), [[a0[0], 0.2], [a0[1], 2.0], [a0[0], 0.2]], atol=1e-6)
        np.testing.assert_allclose(targets[:, [3, 6]].numpy(), want_targets, atol=1e-6)


def test_the_critic_reads_the_bootstrap_value_at_the_final_state():
    """The value a truncated row bootstraps from is the critic's V(tokens[:boot_at]): the final prompt's last hidden
    state, read one column past the row's tokens; nothing is read for a terminated row."""
    from learner.batch import bootstrap_values, collate, length_chunks

    torch.manual_seed(0)
    pol = TrainPolicy.from_config(DecoderConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2), seed=0)
    critic = TrainPolicy.from_config(pol.config, value_head=True, seed=1)
    tr = PPOTrainer(pol, critic, LearnerConfig(), 0)
    trajs = [two_turns("terminated"), two_turns("truncated", 10, final=(7, 9, 13))]
    b = collate(trajs)
    _, values = tr._forward_old(b, length_chunks(b.widths, torch.arange(2), tr.chunk_tokens), with_prox=False)
    boot = bootstrap_values(values, b.boot)
    with torch.no_grad():
        h = critic.hidden(torch.tensor([trajs[1].tokens.tolist()]))
        want = float(critic.score(h[0, -1]))
    assert boot[0] == 0.0 and float(boot[1]) == pytest.approx(want, abs=1e-5) and abs(want) > 1e-3


def test_fused_single_pass_equals_the_separate_pass_with_truncated_episodes():
    """The single pass reads the bootstrap values in the critic's own training forward; the separate pass in its
    no-grad pass: the same parameters either way, and different ones from the same batch read as terminated."""
    from learner.dist_check import batch
    trajs = batch(3, n=12, max_len=30)
    for i, t in enumerate(trajs[::2]):  # every other episode cut by a limit, with its final prompt appended
        t.outcome, t.tokens = "truncated", np.concatenate([t.tokens, np.array([3, 4, 5][: 1 + i % 3], np.int32)])
        for k in ("logprobs", "versions", "mask"):
            pad = np.zeros(len(t.tokens) - len(getattr(t, k)), getattr(t, k).dtype) - (k == "versions")
            setattr(t, k, np.concatenate([getattr(t, k), pad]))
        t.boot_at = len(t.tokens)
        t.validate()
    torch.manual_seed(0)
    pol = TrainPolicy.from_config(DecoderConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2), seed=0)
    critic = TrainPolicy.from_config(pol.config, value_head=True, seed=1)
    runs = []
    for fused, boot in ((True, True), (False, True), (True, False)):
        p, c = copy.deepcopy(pol), copy.deepcopy(critic)
        tr = PPOTrainer(p, c, LearnerConfig(lr=3e-2, warmup_steps=1, critic_lr=3e-2), 0)
        tr.fuse_single_pass, tr.chunk_tokens = fused, 60
        # plain SGD: Adam divides each gradient by its own size, which turns rounding noise in the near-zero
        # gradients of an initial step into 1e-6 parameter differences
        tr.opt, tr.critic_opt = torch.optim.SGD(p.parameters(), lr=0.1), torch.optim.SGD(c.parameters(), lr=0.1)
        tr.sched = torch.optim.lr_scheduler.LambdaLR(tr.opt, lambda s: 1.0)
        batch_ = trajs if boot else [dataclasses.replace(t, boot_at=0) for t in trajs]
        m = tr.step(batch_, 0)
        assert m["bootstrapped"] == (6 if boot else 0)
        runs.append((p, c))
    for x, y in zip(runs[0][0].parameters(), runs[1][0].parameters()):
        assert torch.allclose(x, y, atol=1e-6)
    for x, y in zip(runs[0][1].parameters(), runs[1][1].parameters()):
        assert torch.allclose(x, y, atol=1e-6)
    assert any(not torch.allclose(x, y, atol=1e-5) for x, y in zip(runs[0][1].parameters(), runs[2][1].parameters()))


def _grouped_batch(seed: int, n_groups: int = 4, size: int = 4) -> list[Trajectory]:
    """GRPO groups of varied lengths: the first all fail, the second all succeed (no advantage in either), the rest
    mixed; behaviour logprobs off the policy's, so the clip and the decoupled weight are live."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n_groups):
        for k in range(size):
            n = int(rng.integers(8, 40))
            m = np.zeros(n, np.uint8)
            m[n // 2:] = 1
            r = 0.0 if g == 0 else 1.0 if g == 1 else float(rng.integers(0, 2) if k else 1 - (g % 2))
            if g >= 2 and k == size - 1 and all(o.ret == r for o in out[-(size - 1):]):
                r = 1.0 - r  # a mixed group really is mixed
            out.append(Trajectory(id=f"{seed}-{g}-{k}", env_id="x", outcome="terminated",
                                  tokens=rng.integers(0, V, n).astype(np.int32),
                                  logprobs=np.where(m, -rng.uniform(0.5, 4.0, n), 0).astype(np.float32),
                                  versions=np.where(m, 0, -1).astype(np.int32), mask=m, group=f"{seed}-{g}",
                                  turns=[Turn("", "", {}, r, n // 2, n)], ret=r))
    return out


@pytest.mark.parametrize("epochs,minibatches", [(1, 1), (2, 2)])
def test_rows_without_advantage_are_skipped_with_the_same_update(epochs, minibatches):
    """GRPO without critic, KL or entropy term: the rows of all-fail / all-succeed groups are not run, and the
    parameters after two updates are those of running every row (plain SGD: Adam would turn the rounding noise of
    differently shaped chunks into whole steps); the figures that are sums (pg_loss) agree."""
    torch.manual_seed(0)
    pol = TrainPolicy.from_config(DecoderConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2), seed=0)
    runs = []
    for skip in (True, False):
        p = copy.deepcopy(pol)
        cfg = LearnerConfig(algo="grpo", lr=3e-2, warmup_steps=1,
                            ppo=PPOConfig(skip_zero_adv=skip, epochs=epochs, minibatches=minibatches))
        tr = PPOTrainer(p, None, cfg, 0)
        tr.opt = torch.optim.SGD(p.parameters(), lr=0.3)
        tr.sched = torch.optim.lr_scheduler.LambdaLR(tr.opt, lambda s: 1.0)
        tr.chunk_tokens = 60
        rows = []
        orig = p.logprobs_at

        def counting(tok, *a, _orig=orig, _rows=rows, **k):
            _rows.append(int(tok.shape[0]))
            return _orig(tok, *a, **k)

        p.logprobs_at = counting
        torch.manual_seed(1)  # the minibatch permutation
        ms = [tr.step(_grouped_batch(s), s) for s in range(2)]
        runs.append((p, ms, sum(rows)))
    (p1, m1, rows1), (p2, m2, rows2) = runs
    for x, y in zip(p1.parameters(), p2.parameters()):
        assert torch.allclose(x, y, atol=1e-6)
    assert not torch.allclose(next(p1.parameters()), next(pol.parameters()))
    assert all(m["rows_skipped"] == 8 for m in m1) and all(m["rows_skipped"] == 0 for m in m2)
    assert rows2 - rows1 == 8 * epochs * 2, (rows1, rows2)  # 8 rows fewer in each training pass of each update
    for a, b in zip(m1, m2):
        assert a["pg_loss"] == pytest.approx(b["pg_loss"], rel=1e-4, abs=1e-7)


def test_rows_are_not_skipped_when_another_term_reads_them():
    """An entropy bonus has a gradient on every row: nothing is skipped."""
    pol = TrainPolicy.from_config(DecoderConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1), seed=0)
    tr = PPOTrainer(pol, None, LearnerConfig(algo="grpo", ppo=PPOConfig(entropy_coef=0.01)), 0)
    assert tr.step(_grouped_batch(0), 0)["rows_skipped"] == 0


# ---- GRPO without a critic: learner.ppo.truncated_value scores the state a limit cut an episode in ----------------
def _one_turn(tid, outcome, reward, group="g", boot_at=0):
    final = (7, 9) if boot_at else ()
    toks = [1, 5, 6, 11, *final]
    m = np.array([0, 0, 0, 1] + [0] * len(final), np.uint8)
    return Trajectory(id=tid, env_id="x", outcome=outcome, tokens=np.array(toks, np.int32),
                      logprobs=np.where(m, -1.0, 0).astype(np.float32), versions=np.where(m, 0, -1).astype(np.int32),
                      mask=m, turns=[Turn("", "", {}, reward, 3, 4)], ret=reward, group=group,
                      boot_at=boot_at).validate()


@pytest.mark.parametrize("value,want", [(0.0, [7 / 6, -5 / 6, -1 / 3, 1 / 32]),   # the rewards so far: above a wrong answer
                                        (-1.0, [1.5, -0.5, -1.0, 9 / 32])])      # scored as a failure: below it
def test_truncated_value_scores_a_cut_off_episode_in_grpo(value, want):
    """A group of a success (+1), a wrong answer (-1) and an episode the turn limit cut after rewards of -0.5:
    Dr. GRPO's centred advantages (adv_norm off, by hand) put the cut-off one above the wrong answer at
    truncated_value 0 (what taught MiniWoB policies to stall) and below it at -1. A lone row of another group is
    centred on the batch mean of the returns as scored (-5/32 at 0, -13/32 at -1)."""
    from learner.batch import collate

    trajs = [_one_turn("ok", "terminated", 1.0), _one_turn("wrong", "terminated", -1.0),
             _one_turn("cut", "truncated", -0.5, boot_at=6), _one_turn("alone", "terminated", -1 / 8, group="h")]
    b = collate(trajs)
    assert b.truncated.tolist() == [False, False, True, False]
    pol = TrainPolicy.from_config(DecoderConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1), seed=0)
    tr = PPOTrainer(pol, None, LearnerConfig(algo="grpo", ppo=PPOConfig(adv_norm=False, truncated_value=value)), 0)
    adv, _ = tr.advantages(b, None, None)
    np.testing.assert_allclose(adv[:, 3].numpy(), want, atol=1e-6)
    assert float(adv[:, :3].abs().sum() + adv[:, 4:].abs().sum()) == 0       # only the generated token carries it


def test_truncated_value_is_checked():
    from core import config as C

    assert C.load(None, None, []).learner.ppo.truncated_value == 0.0
    assert C.load(None, None, ["learner.ppo.truncated_value=-1"]).learner.ppo.truncated_value == -1.0
    with pytest.raises(C.ConfigError, match="truncated_value = nan: must be a finite number"):
        C.load(None, None, ["learner.ppo.truncated_value=nan"])


def test_a_row_with_no_trained_token_costs_nothing_and_loses_no_update():
    """A row whose only generated token is its first (collate takes no loss there) alone in a length chunk took
    means over nothing: NaN, and the whole batch's update was skipped (nonfinite_steps 1), in PPO and in value
    pretraining. Such a row now adds nothing, and the update equals the one without it (SGD, exact)."""
    from core.schema import trained_positions

    rng = np.random.default_rng(1)
    pol = TrainPolicy.from_config(DecoderConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1), seed=0)
    critic = TrainPolicy.from_config(pol.config, value_head=True, seed=1)

    def row(tid, n, first_only=False):
        m = np.zeros(n, np.uint8)
        m[[0] if first_only else slice(n - 3, n)] = 1
        end = 1 if first_only else n
        return Trajectory(id=tid, env_id="x", outcome="terminated", tokens=rng.integers(2, V, n).astype(np.int32),
                          logprobs=np.where(m, -1.5, 0).astype(np.float32), versions=np.where(m, 0, -1).astype(np.int32),
                          mask=m, turns=[Turn("", "", {}, 1.0, end - int(m.sum()), end)], ret=1.0)

    good = [row("a", 12), row("b", 20)]
    empty = row("c", 30, first_only=True)
    assert not trained_positions(empty).any() and trained_positions(good[0]).any()
    results = []
    for trajs in (good, good + [empty]):
        p, c = copy.deepcopy(pol), copy.deepcopy(critic)
        tr = PPOTrainer(p, c, LearnerConfig(lr=0.1, warmup_steps=1, grad_clip=1e9, ppo=PPOConfig(kl_coef=0.1)), 0)
        tr.opt, tr.critic_opt = torch.optim.SGD(p.parameters(), lr=0.1), torch.optim.SGD(c.parameters(), lr=0.1)
        tr.sched = torch.optim.lr_scheduler.LambdaLR(tr.opt, lambda s: 1.0)
        tr.chunk_tokens = 25  # the empty row alone in its chunk
        m = tr.step(trajs, 0)
        assert m["nonfinite_steps"] == 0 and not m["policy_step_skipped"], m
        v = tr.value_pretrain_step(trajs)
        assert v["nonfinite_steps"] == 0 and np.isfinite(v["v_loss"]), v
        results.append((p, c))
    for a, b in zip(results[0], results[1]):
        for x, y in zip(a.parameters(), b.parameters()):
            assert torch.allclose(x, y, atol=1e-6)


def test_the_reward_of_a_turn_that_generated_nothing_is_still_in_the_critics_targets():
    """A turn with no output (its format penalty) put its reward on a prompt token, which GAE never reads: the
    critic's target was 1.0 for a return of 0.9. It now sits on the last generated token before it."""
    from core.schema import turn_rewards
    from learner.batch import collate

    toks = [1, 5, 6, 11, 7, 8, 7, 9, 12]
    m = np.array([0, 0, 0, 1, 0, 0, 0, 0, 1], np.uint8)
    t = Trajectory(id="e", env_id="x", outcome="terminated", tokens=np.array(toks, np.int32),
                   logprobs=np.where(m, -1.0, 0).astype(np.float32), versions=np.where(m, 0, -1).astype(np.int32),
                   mask=m, turns=[Turn("", "", {}, 0.0, 3, 4), Turn("", "", {}, -0.1, 6, 6), Turn("", "", {}, 1.0, 8, 9)],
                   ret=0.9).validate()
    r = turn_rewards(t)
    assert r[3] == np.float32(-0.1) and r[8] == 1.0 and abs(float(r[m.astype(bool)].sum()) - 0.9) < 1e-6
    b = collate([t])
    pol = TrainPolicy.from_config(DecoderConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1), seed=0)
    tr = PPOTrainer(pol, TrainPolicy.from_config(pol.config, value_head=True, seed=1),
                    LearnerConfig(ppo=PPOConfig(gamma=1.0, lam_policy=1.0, lam_critic=1.0)), 0)
    _, targets = tr.advantages(b, torch.zeros(b.mask.shape), None)
    np.testing.assert_allclose(targets[0, [3, 8]].numpy(), [0.9, 1.0], atol=1e-6)
    only = Trajectory(**{**t.__dict__, "turns": [Turn("", "", {}, -0.1, 2, 2), *t.turns[:1]], "ret": -0.1})
    assert turn_rewards(only)[3] == np.float32(-0.1)  # nothing generated before it: the first generated token after


def test_the_kl_anchor_still_pulls_on_a_batch_without_advantage_signal():
    """kl_coef > 0: a batch whose advantages are all 0 still has the KL term's gradient, so the policy steps back
    towards its start instead of skipping the step (the entropy bonus is treated the same way)."""
    torch.manual_seed(0)
    pol = TrainPolicy.from_config(DecoderConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1), seed=0)
    start = copy.deepcopy(pol)
    tr = PPOTrainer(pol, None, LearnerConfig(algo="grpo", lr=1e-2, warmup_steps=1, ppo=PPOConfig(kl_coef=1.0)), 0)
    tr.opt = torch.optim.SGD(pol.parameters(), lr=1.0)  # no momentum: the step is the gradient's alone
    tr.sched = torch.optim.lr_scheduler.LambdaLR(tr.opt, lambda s: 1.0)
    batch, _ = sample(pol, 32)
    for i, t in enumerate(batch):
        t.group, t.ret = "g", float(t.tokens[-1] % 2)
        t.turns[0].reward = t.ret
    tr.step(batch, 0)  # a real update: the policy moves away from its start

    def kl():
        with torch.no_grad():
            p = torch.log_softmax(pol(torch.tensor([PROMPT]))[0, -1], -1)
            q = torch.log_softmax(start(torch.tensor([PROMPT]))[0, -1], -1)
        return float((p.exp() * (p - q)).sum())

    before = kl()
    assert before > 1e-6
    for t in batch:
        t.ret = t.turns[0].reward = 0.0
    m = tr.step(batch, 1)
    assert not m["policy_step_skipped"] and kl() < before


def test_value_pretraining_steps_without_a_critic_are_no_updates_of_a_missing_critic():
    """algo=grpo has no critic: learner.value_pretrain.steps (a preset's, say, under --set learner.algo=grpo) does not
    send the first updates to a critic that is not there (a TypeError before); GRPO trains from the first batch."""
    from core.config import ValuePretrainConfig
    from learner.dist_check import batch
    from learner.update import Updater

    pol = TrainPolicy.from_config(DecoderConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1), seed=0)
    cfg = LearnerConfig(algo="grpo", value_pretrain=ValuePretrainConfig(steps=3))
    before = [p.detach().clone() for p in pol.parameters()]
    m = Updater(PPOTrainer(pol, None, cfg, 0), cfg).update(batch(0, 8, max_len=20), 0)
    assert m["phase"] == "grpo" and not m["policy_step_skipped"]
    assert any(not torch.equal(a, b) for a, b in zip(before, pol.parameters()))


def test_groups_of_equal_returns_that_do_not_average_exactly_leave_the_policy_alone():
    """GRPO groups of 8 that all scored the same -0.1 (a format penalty): the float mean is off by a rounding, and
    those +-7e-9 advantages used to count as signal; scaled to the batch and through Adam they moved the weights a
    full step (0.0099 at lr 1e-2). Now the rows are skipped and the policy is unchanged."""
    from learner.dist_check import batch

    pol = TrainPolicy.from_config(DecoderConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1), seed=0)
    tr = PPOTrainer(pol, None, LearnerConfig(algo="grpo", lr=1e-2, warmup_steps=1), 0)
    trajs = batch(0, 16, max_len=20)
    for i, t in enumerate(trajs):
        t.group, t.ret = f"g{i // 8}", -0.1
        for u in t.turns:
            u.reward = 0.0
        t.turns[-1].reward = -0.1
    before = [p.detach().clone() for p in pol.parameters()]
    m = tr.step(trajs, 0)
    assert m["policy_step_skipped"] and m["rows_skipped"] == 16
    assert all(torch.equal(a, b) for a, b in zip(before, pol.parameters()))
