"""`tars bench learner` end to end on a small setting: both figures measured, a real server serves each version."""
import json

from tars import cli


def test_bench_learner_small_run(tmp_path, capsys):
    out = tmp_path / "b.json"
    rc = cli.main(["bench", "learner", "--n", "40", "--payload-bytes", "4096", "--repeats", "1", "--steps", "1",
                   "--set", "learner.batch_size=4", "--json", str(out)])
    assert rc == 0
    b = json.loads(out.read_text())
    s, p = b["figures"]["stream_over_raw"], b["figures"]["publish_share_of_step"]
    assert s["stream_per_s"] > 0 and s["raw_per_s"] > 0 and s["value"] == round(s["stream_per_s"] / s["raw_per_s"], 3)
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
                   "--set", "learner.batch_size=2", "--set", "learner.precision=bf16", "--json", str(out)])
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
