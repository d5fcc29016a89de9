"""`tars bench learner` end to end on a small setting: both figures measured, a real server serves each version."""
import json
import os
import re

import pytest

from tars import cli


def test_bench_learner_small_run(tmp_path, capsys):
    out = tmp_path / "b.json"
    rc = cli.main(["bench", "learner", "--n", "40", "--payload-bytes", "4096", "--repeats", "1", "--steps", "1",
                   "--set", "learner.batch_size=4", "--json", str(out)])
    assert rc == 0
    b = json.loads(out.read_text())
    s, p = b["figures"]["stream_over_raw"], b["figures"]["publish_share_of_step"]
    # value is the ratio of the unrounded rates, rounded to 3 places; the rates are shown to 0.1 (1.693 against 1.694
    # recomputed from them failed once)
    assert s["stream_per_s"] > 0 and s["raw_per_s"] > 0
    assert s["value"] == pytest.approx(s["stream_per_s"] / s["raw_per_s"], abs=1e-3)
    assert s["detail"]["n"] == 40 and s["goal"] == ">= 0.8"
    modes = sorted(p["detail"]["publish_s"])
    assert modes == ["disk", "shm", "stream"] and len(p["detail"]["step_s"]) == 3   # one step per mode
    assert all(len(p["detail"]["publish_s"][m]) == 1 for m in modes)
    for name, m in (("publish_share_of_step", "disk"), ("publish_share_of_step_shm", "shm"),
                    ("publish_share_of_step_stream", "stream")):
        f = b["figures"][name]
        assert f["mode"] == m and f["publish_ms"] > 0 and f["publish_total_ms"] >= f["publish_ms"]
    assert p["publish_ms"] > 0 and p["step_ms"] > 0 and p["detail"]["batch"]["trajectories"] == 4
    import torch
    # learner.device=auto: the GPU in bf16 autocast where there is one, else the CPU in fp32
    dev = p["detail"]["device"]
    assert dev.startswith("cuda") if torch.cuda.is_available() else dev == "cpu fp32"
    text = capsys.readouterr().out
    assert "publish_share_of_step_shm" in text and "publish_share_of_step_stream" in text


def test_bench_learner_steps_on_the_learners_device_and_precision(tmp_path, capsys):
    """The step is measured where the learner would run it: learner.precision=bf16 is bf16 autocast, and a device
    that is not there is refused as the learner refuses it (not measured on the CPU instead)."""
    import pytest
    import torch

    out = tmp_path / "b.json"
    rc = cli.main(["bench", "learner", "--n", "20", "--payload-bytes", "2048", "--repeats", "1", "--steps", "1",
                   "--set", "learner.batch_size=2", "--set", "learner.device=cpu", "--set", "learner.precision=bf16",
                   "--json", str(out)])
    assert rc == 0
    p = json.loads(out.read_text())["figures"]["publish_share_of_step"]
    assert p["detail"]["device"] == "cpu bf16 autocast (fp32 master weights)", p["detail"]["device"]
    assert "steps on cpu bf16 autocast" in capsys.readouterr().out
    if torch.cuda.is_available():
        pytest.skip("the refusal needs a machine without CUDA")
    rc = cli.main(["bench", "learner", "--n", "20", "--payload-bytes", "2048", "--repeats", "1", "--steps", "1",
                   "--set", "learner.device=cuda", "--json", str(tmp_path / "c.json")])
    assert rc == 2 and "learner.device='cuda'" in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists()


def test_bench_learner_rejects_bad_arguments(capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "learner", "--steps", "0"])
    assert e.value.code == 2 and "--steps must be >= 1" in capsys.readouterr().err


def test_bench_learner_vl_model(tmp_path, capsys):
    """--model with a (tiny) Qwen2.5-VL checkpoint: the learner's policy loaded from it trains on trajectories with
    screenshots (the vision tower is updated), and a `tars serve --model DIR` serves each published version, in
    every publish mode; the report counts the vision tower's parameters in the model's."""
    from tars.bench.episodes import vl_episodes
    from tests.hf_dirs import make_vl_checkpoint

    d = tmp_path / "vl"
    ref = make_vl_checkpoint(d, max_pixels=64 * 28 * 28, min_pixels=4 * 28 * 28)
    out = tmp_path / "b.json"
    rc = cli.main(["bench", "learner", "--model", str(d), "--n", "20", "--payload-bytes", "2048", "--repeats", "1",
                   "--steps", "1", "--set", "learner.batch_size=2", "--json", str(out)])
    assert rc == 0
    b = json.loads(out.read_text())
    p = b["figures"]["publish_share_of_step"]["detail"]
    assert p["model"] == str(d) and p["vl"] and p["vision_trained"] and p["skipped_steps"] == 0
    # every mode published once; the server answered that it serves each new version (disk, shm, stream in turn)
    assert p["served_versions"] == {"disk": [1], "shm": [2], "stream": [3]}
    assert all(len(p["publish_s"][m]) == 1 and p["publish_s"][m][0] > 0 for m in ("disk", "shm", "stream"))
    n_ref = sum(t.numel() for t in ref.parameters())
    n_vis = sum(t.numel() for t in ref.model.visual.parameters())
    assert p["params"] == n_ref and p["vision_params"] == n_vis > 0 and p["weights_bytes"] == 4 * n_ref
    # the batch the bench trained on: 2 screenshots of 160x210 per trajectory, the first in two segments
    assert p["batch"] == {"trajectories": 2, "tokens": p["batch"]["tokens"], "generated_tokens": 2 * 2 * 8,
                          "images": 4, "image_size": [160, 210], "segments": 3}
    trs = vl_episodes(d, 2)
    assert p["batch"]["tokens"] == sum(len(t.tokens) for t in trs)
    assert "vision tower" in capsys.readouterr().out


def test_vl_episodes_bind_their_screenshots(tmp_path):
    """The synthetic VL trajectories pass the learner's own binding checks: one framed run of image_tokens(w, h)
    pads per screenshot, in token order, no run across a segment start; generated ids are never special tokens."""
    import numpy as np

    from core.vlm import VLSpec, image_runs
    from learner.batch import binding_error
    from tars.bench.episodes import vl_episodes
    from tests.hf_dirs import make_vl_checkpoint

    d = tmp_path / "vl"
    make_vl_checkpoint(d, arch="qwen2_vl", max_pixels=64 * 28 * 28, min_pixels=4 * 28 * 28)
    spec = VLSpec.load(d)
    trs = vl_episodes(d, 3, images=3, size=(120, 90), gen_len=5, seed=1)
    assert [len(t.segments) for t in trs] == [1, 0, 0]
    for t in trs:
        assert binding_error(t, spec) is None
        runs = image_runs(t.tokens, spec.image_token_id)
        assert len(runs) == len(t.image_refs) == 3 and set(t.images) == set(t.image_refs)
        assert all(b - a == spec.image_tokens(120, 90) for a, b in runs)
        gen = t.tokens[t.mask > 0]
        assert len(gen) == 15 and not np.isin(gen, [spec.image_token_id, spec.vision_start_token_id,
                                                    spec.vision_end_token_id]).any()
    assert len({r for t in trs for r in t.image_refs}) == 9   # every screenshot its own image


def test_bench_learner_rejects_bad_model_arguments(tmp_path, capsys):
    import pytest

    for args, msg in ((["--model", str(tmp_path)], "no config.json there"),
                      (["--images", "0"], "--images must be >= 1"),
                      (["--image-size", "160"], "is not WIDTHxHEIGHT")):
        with pytest.raises(SystemExit) as e:
            cli.main(["bench", "learner", *args])
        assert e.value.code == 2 and msg in capsys.readouterr().err


@pytest.mark.parametrize("what", ["stream-wal", "stream-checkpoint"])
def test_the_profile_scripts_stream_loads_run(tmp_path, what):
    """scripts/profile_bench.py's stream loads (what scripts/profile_bench.sh attaches py-spy to) run their transfers
    and say how fast: they broke silently once when the bench's _run_stream began returning CPU figures too."""
    import subprocess
    import sys

    pidfile = tmp_path / "pid"
    r = subprocess.run([sys.executable, "scripts/profile_bench.py", what, "0.5", str(pidfile)], capture_output=True,
                       text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stderr[-2000:]
    assert pidfile.read_text().strip().isdigit()
    assert re.search(r"stream \w+: \d+ runs, \d+-\d+ trajectories/s", r.stdout), r.stdout
