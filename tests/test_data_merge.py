"""The data flywheel's split, `tars sft` on stored trajectories, and `tars merge` (parameter interpolation)."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from learner.data import read_trajectories, write_trajectories
from tars import cli
from core.model import CausalLM, DecoderConfig
from learner.policy import TrainPolicy
from core.schema import Trajectory, Turn

V, PROMPT, GOOD = 40, [1, 5, 6, 7], 11


def traj(tid, outcome="terminated", success=False, ret=0.0, answer=GOOD):
    return Trajectory(id=tid, env_id="bandit", outcome=outcome, tokens=np.array(PROMPT + [answer], np.int32),
                      logprobs=np.array([0, 0, 0, 0, -2.0], np.float32), versions=np.array([-1] * 4 + [0], np.int32),
                      mask=np.array([0, 0, 0, 0, 1], np.uint8), turns=[Turn("", "", {}, ret, 4, 5)], ret=ret,
                      success=success)


def model(seed=0, hidden=32):
    return CausalLM(DecoderConfig(vocab_size=V, hidden_size=hidden, intermediate_size=64, num_hidden_layers=1)).init_weights(seed)


def test_split_sends_validated_trajectories_to_sft_and_the_rest_to_ct(tmp_path, capsys):
    a = [traj("win", success=True, ret=1.0), traj("lose", ret=-0.1), traj("cut", "truncated", ret=0.6),
         traj("broken", "infra_error"), traj("close", ret=0.7)]
    b = [traj("win", success=True, ret=1.0), traj("win2", success=True, ret=1.0)]  # "win" again: counted once
    write_trajectories(tmp_path / "a.twl", a)
    write_trajectories(tmp_path / "b.twl", b)
    assert cli.main(["data", "split", str(tmp_path / "a.twl"), str(tmp_path / "b.twl"), "--out", str(tmp_path / "s")]) == 0
    ids = lambda name: sorted(t.id for t in read_trajectories([tmp_path / "s" / name]))  # noqa: E731
    assert ids("sft.twl") == ["win", "win2"]
    assert ids("ct.twl") == ["close", "cut", "lose"]  # infra errors say nothing about the policy: in neither set
    counts = json.loads((tmp_path / "s" / "split.json").read_text())
    assert (counts["sft"], counts["ct"], counts["infra_error_dropped"]) == (2, 3, 1)
    # a return threshold lets near-misses through too (a truncated episode with a high return counts)
    assert cli.main(["data", "split", str(tmp_path / "a.twl"), "--out", str(tmp_path / "t"), "--min-return", "0.5"]) == 0
    assert sorted(t.id for t in read_trajectories([tmp_path / "t" / "sft.twl"])) == ["close", "cut", "win"]
    # the trajectories come back byte for byte
    back = {t.id: t for t in read_trajectories([tmp_path / "s" / "sft.twl"])}
    assert back["win"].encode() == a[0].encode()


def test_split_of_a_missing_or_corrupt_file_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["data", "split", str(tmp_path / "nope.twl"), "--out", str(tmp_path / "s")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_split_and_merge_with_an_out_that_cannot_be_a_directory_or_a_bad_min_return_are_user_errors(tmp_path, capsys):
    """--out naming a file (or a path under one), and a --min-return that is no finite number: one line, exit 2,
    nothing written (a file --out was an exit 1 'failed: FileExistsError' after the inputs were read, and merge's
    'NotADirectoryError' after the interpolation; --min-return nan passed nothing and wrote NaN into split.json)."""
    write_trajectories(tmp_path / "a.twl", [traj("win", success=True, ret=1.0)])
    model(0).save_hf(tmp_path / "m")
    (tmp_path / "f").write_text("not a directory")
    for out in (tmp_path / "f", tmp_path / "f" / "s"):
        assert cli.main(["data", "split", str(tmp_path / "a.twl"), "--out", str(out)]) == 2
        assert f"tars data: --out {out}:" in capsys.readouterr().err
        assert cli.main(["merge", str(tmp_path / "m"), str(tmp_path / "m"), "--weights", "0.5,0.5", "--out", str(out)]) == 2
        assert f"tars merge: --out {out}:" in capsys.readouterr().err
    assert (tmp_path / "f").read_text() == "not a directory"
    for bad in ("nan", "inf"):
        assert cli.main(["data", "split", str(tmp_path / "a.twl"), "--out", str(tmp_path / "s"), "--min-return", bad]) == 2
        assert "--min-return" in capsys.readouterr().err and not (tmp_path / "s").exists()


def test_split_reads_its_inputs_read_only_and_a_damaged_one_is_an_error_naming_the_offset(tmp_path, capsys):
    """An input is never modified: a flipped byte in record 3 of 10 is an error naming the file and the offset (the
    file keeps every byte), and so is a file that is no trajectory log (episodes.jsonl by mistake)."""
    f = tmp_path / "trajectories.twl"
    write_trajectories(f, [traj(f"t{i}", success=True, ret=1.0) for i in range(10)])
    data = bytearray(f.read_bytes())
    rec = len(data) // 10
    data[2 * rec + rec // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    assert cli.main(["data", "split", str(f), "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert f"{f} is damaged at byte offset {2 * rec} of {len(data)}" in err and "2 valid record(s)" in err
    assert f.read_bytes() == bytes(data) and not (tmp_path / "s").exists()
    g = tmp_path / "episodes.jsonl"
    g.write_text('{"task": "a", "episode": 0, "success": true}\n' * 100)
    before = g.read_bytes()
    assert cli.main(["data", "split", str(g), "--out", str(tmp_path / "s2")]) == 2
    assert f"{g} is not a trajectory file" in capsys.readouterr().err and g.read_bytes() == before
    model().save_hf(tmp_path / "m0")                                 # `tars sft --data` reads them the same way
    assert cli.main(["sft", "--model", str(tmp_path / "m0"), "--out", str(tmp_path / "m1"), "--data", str(f)]) == 2
    assert "is damaged at byte offset" in capsys.readouterr().err and f.read_bytes() == bytes(data)


def test_split_of_a_live_log_leaves_out_its_unfinished_append_with_a_warning(tmp_path, caplog):
    """A learner appending to its archive (or one killed inside an append) leaves records cut short at the end, or
    group-committed records whose commit is not written yet: those were never acked, so they are left out with a
    warning giving the count read, and the file is not touched (the learner may finish the append)."""
    from core.stream.wal import WriteAheadLog

    full = tmp_path / "full.twl"
    write_trajectories(full, [traj(f"t{i}", success=True, ret=1.0) for i in range(4)])
    cut = tmp_path / "cut.twl"
    cut.write_bytes(full.read_bytes()[:-10])                         # the 4th record half written
    live = tmp_path / "live.twl"
    w = WriteAheadLog(live, fsync=False).open()
    for i in range(3):
        w.append(f"t{i}", traj(f"t{i}", success=True, ret=1.0).encode())
    w.stage("t3", traj("t3", success=True, ret=1.0).encode())
    w.sync()
    w.close()
    data = live.read_bytes()
    live.write_bytes(data[:-16])                                     # the batch is there, its commit is not yet
    for p in (cut, live):
        before = p.read_bytes()
        caplog.clear()
        with caplog.at_level("WARNING", logger="learner.data"):
            assert [t.id for t in read_trajectories([p])] == ["t0", "t1", "t2"]
        assert p.read_bytes() == before
        assert any("3 record(s) read" in r.getMessage() and str(p) in r.getMessage() for r in caplog.records)
    # a learner's stream.wal: its log writer pads its last block with zeros (O_DIRECT) until it exits
    padded = tmp_path / "stream.wal"
    padded.write_bytes(data + bytes(-len(data) % 4096))
    caplog.clear()
    with caplog.at_level("WARNING", logger="learner.data"):
        assert [t.id for t in read_trajectories([padded])] == ["t0", "t1", "t2", "t3"]
    assert any("4 record(s) read" in r.getMessage() for r in caplog.records)
    # the same batch with its commit but a byte of it changed: damage, not an unfinished append
    bad = bytearray(data)
    bad[-30] ^= 0xFF
    live.write_bytes(bytes(bad))
    with pytest.raises(ValueError, match="damaged at byte offset"):
        list(read_trajectories([live]))
    assert live.read_bytes() == bytes(bad)


def test_sft_leaves_answers_that_did_not_parse_out_of_the_loss():
    """A successful episode whose first answer did not parse (format penalty, Turn.parse_error) goes to sft.twl
    whole, but SFT imitates only its valid answers; an episode with no valid answer gives no example."""
    from learner.data import sft_examples

    bad, ok = [30, 31, 32], [11, 2]
    toks = PROMPT[:3] + bad + [7, 8] + ok
    mask = [0] * 3 + [1] * 3 + [0] * 2 + [1] * 2
    tr = Trajectory(id="t", env_id="bandit", outcome="terminated", tokens=np.array(toks, np.int32),
                    logprobs=np.zeros(len(toks), np.float32), versions=np.array([m - 1 for m in mask], np.int32),
                    mask=np.array(mask, np.uint8), ret=0.9, success=True,
                    turns=[Turn("", "clikc(", {}, -0.1, 3, 6, parse_error="no action found"),
                           Turn("", "click(target='OK')", {"type": "click"}, 1.0, 8, 10)])
    ((tokens, loss),) = sft_examples([tr])
    assert tokens == toks and loss == [0] * 8 + [1, 1]
    tr.turns[1].parse_error = "no action found"
    assert sft_examples([tr]) == []


def test_sft_on_stored_trajectories_learns_them(tmp_path, capsys):
    torch.manual_seed(0)
    m = model()
    m.save_hf(tmp_path / "m0")
    write_trajectories(tmp_path / "sft.twl", [traj(f"w{i}", success=True, ret=1.0) for i in range(16)])

    def p_good(path):
        pol = CausalLM.load_hf(path)
        with torch.no_grad():
            logits, _ = pol(torch.tensor([PROMPT]))
        return float(torch.softmax(logits[0, -1], -1)[GOOD])

    rc = cli.main(["sft", "--model", str(tmp_path / "m0"), "--out", str(tmp_path / "m1"), "--data",
                   str(tmp_path / "sft.twl"), "--steps", "40", "--set", "sft.lr=0.01", "--set", "sft.batch_size=8"])
    assert rc == 0
    assert p_good(tmp_path / "m0") < 0.1 and p_good(tmp_path / "m1") > 0.8
    info = json.loads((tmp_path / "m1" / "sft.json").read_text())
    assert info["trajectories"] == 16 and info["sft_steps"] == 40
    # nothing to train on is an error, not an untouched copy
    assert cli.main(["sft", "--model", str(tmp_path / "m0"), "--out", str(tmp_path / "m2")]) == 2
    assert "nothing to train on" in capsys.readouterr().err


def test_sft_on_demonstrations_uses_the_model_directorys_tokenizer(tmp_path):
    """The demonstration source gets the checkpoint's ChatTokenizer; the output carries the same tokenizer files."""
    from core import config as C
    from core.bpe import save_tokenizer, train_bpe
    from core.chat import ChatTokenizer
    from learner.sft import run

    hf = train_bpe(["click Save", "type carol into Name", "open File then click Save"] * 20, 300)
    TrainPolicy.from_config(DecoderConfig(vocab_size=len(hf), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          pad_token_id=hf.pad_token_id), seed=0).save_hf(tmp_path / "m0")
    save_tokenizer(hf, tmp_path / "m0")
    seen = []

    def demos(tok):
        seen.append(tok)
        prompt, answer = tok.first_prompt("", "Goal: click Save"), tok.answer("click(target='Save')")
        return [(prompt + answer, [0] * len(prompt) + [1] * len(answer))] * 4

    m = run(C.load(overrides=["sft.batch_size=2"]), str(tmp_path / "m0"), str(tmp_path / "m1"), [], demos=demos, steps=3,
            log=lambda *_: None)
    assert isinstance(seen[0], ChatTokenizer) and m["demonstrations"] == 4
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "m1" / name).read_bytes() == (tmp_path / "m0" / name).read_bytes()
    assert ChatTokenizer.load(tmp_path / "m1").encode("click Save") == seen[0].encode("click Save")
    # no tokenizer in the model directory: demonstrations are a clear error
    TrainPolicy.from_config(DecoderConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1),
                            seed=0).save_hf(tmp_path / "bare")
    with pytest.raises(ValueError, match="no tokenizer.json"):
        run(C.load(), str(tmp_path / "bare"), str(tmp_path / "m2"), [], demos=demos, steps=1, log=lambda *_: None)


def test_merge_interpolates_and_loads_in_transformers(tmp_path, capsys):
    # one checkpoint written by core.model (as `tars up` writes a fresh model), one by the learner (transformers'
    # save_pretrained): the same architecture, whichever wrote it
    a = model(0)
    b = TrainPolicy.from_config(a.config, seed=1)
    a.save_hf(tmp_path / "a")
    (tmp_path / "run" / "ckpt").mkdir(parents=True)
    b.save_hf(tmp_path / "run" / "ckpt" / "policy",  # a learner run directory is accepted too
              extra_files={"tokenizer.json": "{}", "tokenizer_config.json": "{}"})
    out = tmp_path / "m"
    assert cli.main(["merge", str(tmp_path / "a"), str(tmp_path / "run"), "--weights", "0.25,0.75", "--out", str(out)]) == 0
    got = load_file(str(out / "model.safetensors"))
    sa, sb = a.hf_state_dict(), b.hf_state_dict()
    assert got.keys() == sa.keys()
    for k in sa:
        assert torch.allclose(got[k], 0.25 * sa[k] + 0.75 * sb[k], atol=1e-6), k
    # the tokenizer files of the first checkpoint that has them; config.json from the first
    assert (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists()
    assert (out / "config.json").read_text() == (tmp_path / "a" / "config.json").read_text()
    merged = CausalLM.load_hf(out)
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        ours, _ = merged(ids)
        theirs = hf(ids).logits
    assert torch.allclose(ours, theirs, atol=1e-4)
    # weights (1, 0) give the first model back exactly
    assert cli.main(["merge", str(tmp_path / "a"), str(tmp_path / "run"), "--weights", "1,0", "--out", str(tmp_path / "m1")]) == 0
    assert all(torch.equal(v, sa[k]) for k, v in load_file(str(tmp_path / "m1" / "model.safetensors")).items())


@pytest.mark.parametrize("weights,message", [
    ("0.5,0.4", "sum to 1"), ("1.5,-0.5", ">= 0"), ("1", "1 weights for 2 checkpoints"), ("a,b", "numbers"),
    ("nan,0.5", "finite")])
def test_merge_rejects_bad_weights(tmp_path, capsys, weights, message):
    model(0).save_hf(tmp_path / "a")
    model(1).save_hf(tmp_path / "b")
    assert cli.main(["merge", str(tmp_path / "a"), str(tmp_path / "b"), "--weights", weights, "--out", str(tmp_path / "m")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_merge_rejects_mismatched_checkpoints(tmp_path, capsys):
    model(0).save_hf(tmp_path / "a")
    model(1, hidden=16).save_hf(tmp_path / "small")
    args = ["--weights", "0.5,0.5", "--out", str(tmp_path / "m")]
    assert cli.main(["merge", str(tmp_path / "a"), str(tmp_path / "small")] + args) == 2
    assert "not the same architecture" in capsys.readouterr().err
    # same config, one tensor reshaped / one missing
    model(1).save_hf(tmp_path / "b")
    sd = load_file(str(tmp_path / "b" / "model.safetensors"))
    k = "model.norm.weight"
    save_file({**sd, k: torch.ones(sd[k].numel() + 1)}, str(tmp_path / "b" / "model.safetensors"))
    assert cli.main(["merge", str(tmp_path / "a"), str(tmp_path / "b")] + args) == 2
    assert "has shape" in capsys.readouterr().err
    save_file({n: t for n, t in sd.items() if n != k}, str(tmp_path / "b" / "model.safetensors"))
    assert cli.main(["merge", str(tmp_path / "a"), str(tmp_path / "b")] + args) == 2
    assert "missing ['model.norm.weight']" in capsys.readouterr().err
    assert cli.main(["merge", str(tmp_path / "a"), str(tmp_path / "nothing")] + args) == 2
    assert "no model.safetensors" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()



def test_demonstrators_oracle_noisy_and_confused():
    import random

    from envd import builtin
    from tars.demos import GOAL_VERBS, confused_action, demonstrations, parse_demonstrator
    from tars.fresh import shared_tokenizer

    assert parse_demonstrator("oracle") == ("oracle", 1.0, 0)
    assert parse_demonstrator("confused:0.25") == ("confused", 0.25, 0)
    assert parse_demonstrator("confused:0:2") == ("confused", 0.0, 2)
    for bad in ("noisy:2", "confused:x", "confused", "perfect", "noisy:0.5:1", "confused:0:x", "confused:0:-1",
                "confused:0:99"):
        with pytest.raises(ValueError):
            parse_demonstrator(bad)
    # confused: the oracle's kind of action, with a word of the goal (not a verb) drawn at random
    rng, same, differ = random.Random(0), 0, 0
    for seed in range(200):
        env = builtin.make("mixed")
        r = env.reset(seed)
        o, a = env.oracle_action(), confused_action(env, rng)
        key = "content" if o.type == "type" else "target"
        assert a.type == o.type
        words = set(r.instruction.split()) - GOAL_VERBS
        assert getattr(a, key) in words and getattr(o, key) in words
        same += getattr(a, key) == getattr(o, key)
        differ += getattr(a, key) != getattr(o, key)
    assert same > 60 and differ > 30
    # confused:P:N also draws from N distractors: a visible label to click, a name to type, never a verb
    rng, off_goal = random.Random(0), 0
    for seed in range(300):
        env = builtin.make("mixed")
        r = env.reset(seed)
        o, a = env.oracle_action(), confused_action(env, rng, 1)
        key = "content" if o.type == "type" else "target"
        assert a.type == o.type and getattr(a, key) not in GOAL_VERBS
        pool = builtin.VALUES if key == "content" else env.clickable()
        assert getattr(a, key) in set(r.instruction.split()) | set(pool)
        off_goal += getattr(a, key) not in r.instruction.split()
    assert 50 < off_goal < 150  # about a third of the draws for two goal words and one distractor
    # whole demonstrations: loss only on the answers, one answer per turn, ending in the end-of-turn token
    tok = shared_tokenizer()
    for spec in ("oracle", "noisy:0.5", "confused:0", "confused:0:1"):
        demos = demonstrations(tok, ["builtin/mixed"], 20, spec, 0, 3)
        assert len(demos) == 20
        for toks, mask in demos:
            assert len(toks) == len(mask) and mask[-1] == 1 and toks[-1] == tok.eot_id
            turns = sum(1 for i in range(1, len(mask)) if mask[i] and not mask[i - 1])
            assert 1 <= turns <= 3
            # every answer ends with the end-of-turn token, and the ids are the chat template's rendering
            assert [toks[i] for i in range(len(mask)) if mask[i] and (i + 1 == len(mask) or not mask[i + 1])] == [tok.eot_id] * turns
            assert tok.decode(toks, skip_special=False).count("<|im_start|>assistant") == turns


def test_merge_reads_sharded_checkpoints(tmp_path):
    import transformers

    from hf_dirs import make_checkpoint
    from learner.merge import merge

    a = make_checkpoint(tmp_path / "a", "llama", seed=0)
    b = make_checkpoint(tmp_path / "b", "llama", seed=1)
    merge([tmp_path / "a", tmp_path / "b"], [0.25, 0.75], tmp_path / "m")
    m = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    sa, sb = a.state_dict(), b.state_dict()
    for k, v in m.state_dict().items():
        assert torch.allclose(v, 0.25 * sa[k] + 0.75 * sb[k], atol=1e-6), k
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "m").chat_template


def test_merge_of_a_vl_checkpoint_and_the_learners_publish_of_it(tmp_path):
    """The usual merge (a base Qwen2.5-VL directory and what the learner published from it) was refused: the
    learner's config says dtype float32 inside text_config and vision_config, the source says nothing there, and
    only the top-level dtype was left out of the comparison. Now it merges, and the result is the mean, loading in
    the engine."""
    from hf_dirs import make_vl_checkpoint
    from learner.merge import merge

    make_vl_checkpoint(tmp_path / "base", max_pixels=64 * 28 * 28, min_pixels=4 * 28 * 28)
    pol = TrainPolicy.load(tmp_path / "base")
    with torch.no_grad():
        for p in pol.lm.parameters():
            p.add_(0.5)
    pol.save_hf(tmp_path / "pub")
    merge([tmp_path / "base", tmp_path / "pub"], [0.5, 0.5], tmp_path / "m")
    a, b = (CausalLM.load_hf(tmp_path / d).state_dict() for d in ("base", "pub"))
    for k, v in CausalLM.load_hf(tmp_path / "m").state_dict().items():
        assert torch.allclose(v, 0.5 * a[k] + 0.5 * b[k], atol=1e-6), k


def test_demonstrations_clip_observations_as_the_actor_does():
    """SFT prompts are the RL prompts: a demonstration's observation is clipped to the actor's max_obs_tokens."""
    from envd import builtin
    from actor.tiny import turn_ids
    from tars.demos import demonstrations
    from tars.fresh import shared_tokenizer

    tok = shared_tokenizer()
    (toks, mask), = demonstrations(tok, ["builtin/mixed"], 1, "oracle", 0, 1, obs_budget=8)
    first = toks[:mask.index(1)]
    assert "[observation clipped:" in tok.decode(first, skip_special=False)
    # the same first prompt the actor builds for that observation with the same budget
    import random
    r = builtin.make("mixed", {"max_steps": "1"}).reset(random.Random(0).randrange(1 << 30))
    assert first == turn_ids(tok, "tiny", r.text, r.instruction, first=True, obs_budget=8)
    (unclipped, m2), = demonstrations(tok, ["builtin/mixed"], 1, "oracle", 0, 1)
    assert "[observation clipped:" not in tok.decode(unclipped, skip_special=False)


def test_sft_refuses_a_trajectory_its_model_cannot_train_on_before_training(tmp_path, capsys):
    """A stored trajectory with a token id past the model's vocabulary (another model's data) is a clear error,
    exit 2, before any training and with nothing written; it was an IndexError from the embedding mid-training."""
    model().save_hf(tmp_path / "m0")
    bad = traj("other-model", success=True, ret=1.0, answer=900)  # V = 40
    write_trajectories(tmp_path / "sft.twl", [traj(f"w{i}", success=True, ret=1.0) for i in range(4)] + [bad])
    rc = cli.main(["sft", "--model", str(tmp_path / "m0"), "--out", str(tmp_path / "m1"), "--data",
                   str(tmp_path / "sft.twl"), "--steps", "3"])
    err = capsys.readouterr().err
    assert rc == 2 and "trajectory other-model cannot be trained on" in err and "token id 900" in err, err
    assert not (tmp_path / "m1").exists()


def test_sft_refuses_trajectories_of_another_tokenizer_inside_its_vocabulary(tmp_path, capsys):
    """Trajectories generated with one tokenizer, trained into a checkpoint with another whose vocabulary holds their
    ids: every id passes Trajectory.validate, so `tars sft --data` trained on them silently (an answer the policy
    wrote as "click(target='Save')" was "click(target') bob S" to the checkpoint's tokenizer). Now the episode's
    recorded text is checked against the checkpoint's decode of its tokens: exit 2 naming the trajectory, nothing
    written; trajectories of the checkpoint's own tokenizer train."""
    from actor.tiny import TINY_SYSTEM
    from core.bpe import save_tokenizer, train_bpe
    from core.chat import ChatTokenizer
    from tars.fresh import shared_tokenizer

    def episode(tok, tid):
        prompt = tok.first_prompt(TINY_SYSTEM, "Screen: window Notes [button Save] Goal: click Save")
        ans = tok.answer("click(target='Save')")
        n = len(prompt) + len(ans)
        return Trajectory(id=tid, env_id="builtin/click", outcome="terminated", tokens=np.array(prompt + ans, np.int32),
                          logprobs=np.array([0.0] * len(prompt) + [-0.5] * len(ans), np.float32),
                          versions=np.array([-1] * len(prompt) + [0] * len(ans), np.int32),
                          mask=np.array([0] * len(prompt) + [1] * len(ans), np.uint8),
                          turns=[Turn("text:0", tok.decode(ans), {}, 1.0, len(prompt), n)], ret=1.0, success=True)

    other = shared_tokenizer()                        # the tokenizer the episodes were generated with
    hf = train_bpe(["Screen: window Notes [button Save] Goal: click Save", "click(target='Save')"] * 20, 300)
    TrainPolicy.from_config(DecoderConfig(vocab_size=other.vocab_size + 8, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=1, pad_token_id=hf.pad_token_id), seed=0).save_hf(tmp_path / "m0")
    save_tokenizer(hf, tmp_path / "m0")
    own = ChatTokenizer.load(tmp_path / "m0")
    write_trajectories(tmp_path / "other.twl", [episode(other, f"o{i}") for i in range(4)])
    rc = cli.main(["sft", "--model", str(tmp_path / "m0"), "--out", str(tmp_path / "m1"), "--data",
                   str(tmp_path / "other.twl"), "--steps", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "trajectory o0 was not generated with the tokenizer of" in err, err
    assert "click(target='Save')" in err
    assert not (tmp_path / "m1").exists()
    write_trajectories(tmp_path / "own.twl", [episode(own, f"w{i}") for i in range(4)])
    assert cli.main(["sft", "--model", str(tmp_path / "m0"), "--out", str(tmp_path / "m1"), "--data",
                     str(tmp_path / "own.twl"), "--steps", "2"]) == 0
    assert json.loads((tmp_path / "m1" / "sft.json").read_text())["trajectories"] == 4


def test_sft_leaves_infra_error_episodes_out(tmp_path, capsys):
    """A run's trajectories.twl holds infra_error episodes (the learner archives every arrival, then drops them):
    `tars sft --data` trained on them (6 of 6 trajectories, 2 of them infra_error). Now they are left out and counted,
    and a file of nothing else is an error saying so, exit 2, nothing written."""
    model().save_hf(tmp_path / "m0")
    write_trajectories(tmp_path / "t.twl", [traj(f"w{i}", success=True, ret=1.0) for i in range(4)]
                       + [traj(f"b{i}", "infra_error") for i in range(2)])
    assert cli.main(["sft", "--model", str(tmp_path / "m0"), "--out", str(tmp_path / "m1"), "--data",
                     str(tmp_path / "t.twl"), "--steps", "2"]) == 0
    info = json.loads((tmp_path / "m1" / "sft.json").read_text())
    assert (info["trajectories"], info["infra_error_dropped"]) == (4, 2)
    write_trajectories(tmp_path / "broken.twl", [traj(f"b{i}", "infra_error") for i in range(2)])
    capsys.readouterr()
    assert cli.main(["sft", "--model", str(tmp_path / "m0"), "--out", str(tmp_path / "m2"), "--data",
                     str(tmp_path / "broken.twl"), "--steps", "2"]) == 2
    assert "nothing to train on" in capsys.readouterr().err and not (tmp_path / "m2").exists()


def test_sft_demos_refuse_answers_longer_than_the_actor_may_generate(tmp_path):
    """A demonstrated answer longer than actor.max_new_tokens is one RL cuts short (a parse error every time); SFT
    taught it silently (the quickstart's settings with a fresh 512-id tokenizer: 398 of 968 answers over its 8
    tokens). Now the demonstrations are refused, naming the longest answer and the limit it needs; within the limit
    they train."""
    from core import config as C
    from core.bpe import save_tokenizer, train_bpe
    from learner.sft import run
    from tars.demos import source

    hf = train_bpe(["Screen: window Notes Goal: click Save"] * 20, 280)   # answers are spelled out byte by byte
    TrainPolicy.from_config(DecoderConfig(vocab_size=len(hf), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          pad_token_id=hf.pad_token_id), seed=0).save_hf(tmp_path / "m0")
    save_tokenizer(hf, tmp_path / "m0")
    cfg = C.load(preset="quickstart", overrides=["sft.batch_size=2"])
    with pytest.raises(ValueError, match=r"demonstrated answers are longer than actor.max_new_tokens=8 tokens \(the "
                                         r"longest, .+, is \d+ .*at least \d+"):
        run(cfg, str(tmp_path / "m0"), str(tmp_path / "m1"), [], demos=source(cfg, 6), steps=1, log=lambda *_: None)
    assert not (tmp_path / "m1").exists()
    cfg = C.load(preset="quickstart", overrides=["sft.batch_size=2", "actor.max_new_tokens=64"])
    m = run(cfg, str(tmp_path / "m0"), str(tmp_path / "m1"), [], demos=source(cfg, 6), steps=1, log=lambda *_: None)
    assert m["demonstrations"] == 6


def test_sft_validation_scores_answers_as_a_full_forward_does(tmp_path):
    """answer_scores against a slow reference (transformers' own forward, token by token): the mean -logprob per
    answer token and the mean probability of each whole answer (several answers a row, rows of different lengths)."""
    from learner.sft import answer_scores

    policy = TrainPolicy.from_config(DecoderConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                                   num_hidden_layers=2), seed=3)
    g = np.random.default_rng(0)
    examples = []
    for n in (9, 14, 6, 11):
        toks = [int(t) for t in g.integers(1, V, n)]
        mask = [0] * n
        for a, b in ((2, 4), (6, 8), (10, 13)):  # answers: runs of 1s (the ones that fit this row)
            for t in range(a, min(b, n)):
                mask[t] = 1
        examples.append((toks, mask))
    got = answer_scores(policy, examples, 0, torch.device("cpu"), rows=3)  # two chunks: the second of one row
    nll, n_tok, probs = 0.0, 0, []
    with torch.no_grad():
        for toks, mask in examples:
            logits = policy.lm(input_ids=torch.tensor([toks])).logits[0].double()
            lp = torch.log_softmax(logits, -1)
            run = None
            for t in range(1, len(toks)):
                if mask[t]:
                    x = float(lp[t - 1, toks[t]])
                    nll, n_tok, run = nll - x, n_tok + 1, (run or 0.0) + x
                elif run is not None:
                    probs.append(np.exp(run))
                    run = None
            if run is not None:
                probs.append(np.exp(run))
    assert len(probs) == 9
    assert got["nll"] == pytest.approx(nll / n_tok, rel=1e-4)
    assert got["p_answer"] == pytest.approx(float(np.mean(probs)), rel=1e-4)


def test_sft_measures_validation_demonstrations_of_their_own(tmp_path):
    """sft.val_episodes: demonstrations on pages the SFT set does not have, measured before, during and after; the
    history goes to sft.json; and the SFT set is the same with or without it."""
    from core import config as C
    from core.bpe import save_tokenizer, train_bpe
    from learner.sft import run
    from tars.demos import demonstrations, source, val_source

    hf = train_bpe(["click Save", "type carol into Name", "open File then click Save"] * 20, 300)
    TrainPolicy.from_config(DecoderConfig(vocab_size=len(hf), hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=1, pad_token_id=hf.pad_token_id),
                            seed=0).save_hf(tmp_path / "m0")
    save_tokenizer(hf, tmp_path / "m0")
    cfg = C.load(overrides=["sft.batch_size=4", "sft.val_episodes=12", "sft.demonstrator=oracle",
                            "actor.env_ids=[builtin/click]", "actor.max_new_tokens=64"])
    logs = []
    m = run(cfg, str(tmp_path / "m0"), str(tmp_path / "m1"), [], demos=source(cfg, 12), steps=120,
            log=logs.append, val_demos=val_source(cfg))
    assert [h["step"] for h in m["val"]] == [0, 50, 100, 120]
    assert m["val"][-1]["nll"] < m["val"][0]["nll"] and 0 <= m["val"][0]["p_answer"] < m["val"][-1]["p_answer"] <= 1
    assert json.loads((tmp_path / "m1" / "sft.json").read_text())["val"] == m["val"]
    assert any("validation: loss" in line for line in logs)
    from core.chat import ChatTokenizer

    tok = ChatTokenizer.load(tmp_path / "m0")
    train, val = source(cfg, 12)(tok), val_source(cfg)(tok)
    assert train == demonstrations(tok, ["builtin/click"], 12, "oracle", cfg.seed, cfg.actor.max_turns,
                                   cfg.actor.system_prompt, cfg.actor.max_obs_tokens, cfg.actor.env_options,
                                   cfg.actor.max_new_tokens)
    assert val != train and not {tuple(t) for t, _ in val} & {tuple(t) for t, _ in train}
    assert val_source(C.load()) is None
