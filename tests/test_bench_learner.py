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
    text = capsys.readouterr().out
    assert "publish_share_of_step_shm" in text and "publish_share_of_step_stream" in text


def test_bench_learner_rejects_bad_arguments(capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "learner", "--steps", "0"])
    assert e.value.code == 2 and "--steps must be >= 1" in capsys.readouterr().err
