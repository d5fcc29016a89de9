"""`tars bench actor` end to end at small sizes: real envd and scripted inference subprocesses, the JSON it writes."""
import json
import shutil

import pytest

from tars import cli


def test_bench_actor_quick_writes_figures(tmp_path, capsys):
    out = tmp_path / "actor.json"
    rc = cli.main(["bench", "actor", "--quick", "--skip-miniwob", "--concurrency", "1,4", "--min-episodes", "2",
                   "--max-turns", "3", "--json", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    f = d["figures"]["actor_overhead_p99_ms"]
    assert set(f["levels"]) == {"1", "4"}
    for c, r in f["levels"].items():
        assert r["episodes"] == max(int(c), 2) and r["infra_errors"] == 0
        assert r["turns"] == 3 * r["episodes"]                     # wait() runs each episode to its step budget
        assert r["episodes_per_s"] > 0 and 0 <= r["actor_overhead_cpu"]["p50_ms"] <= r["actor_overhead"]["p99_ms"] + 50
    assert f["value"] == f["levels"]["4"]["actor_overhead_cpu"]["p99_ms"]
    assert d["figures"]["image_dedupe_bytes_ratio"]["skipped"] == "--skip-miniwob"
    assert "episodes/s" in capsys.readouterr().out


@pytest.mark.parametrize("args", [["--concurrency", "x"], ["--concurrency", "0"], ["--max-turns", "0"]])
def test_bench_actor_bad_arguments(args):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "actor", *args])
    assert e.value.code == 2


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("chromium") and not shutil.os.path.exists("/usr/bin/chromium"),
                    reason="/usr/bin/chromium is not installed")
def test_bench_actor_miniwob_bytes(tmp_path):
    out = tmp_path / "actor.json"
    assert cli.main(["bench", "actor", "--quick", "--concurrency", "1", "--min-episodes", "1", "--max-turns", "3",
                     "--groups", "1", "--group-size", "2", "--json", str(out)]) == 0
    b = json.loads(out.read_text())["figures"]["image_dedupe_bytes_ratio"]
    assert 0 < b["value"] < 1 and b["with_dedupe"]["images_deduped"] >= 1   # the group shares its first screenshot
