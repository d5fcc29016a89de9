"""Crash safety of what the run writes to disk: learner checkpoints (a kill inside the save, a truncated newest copy,
a pickled payload in train_state.pt, --resume with nothing to resume), the actor's spool (a truncated file) and the
end of `tars up` (no "wrote" line for what was not written). Kills, attacks and the actor are real processes."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import types

import numpy as np
import pytest
import torch

from core import config as C
from core.model import DecoderConfig
from core.schema import Trajectory, Turn
from core.stream.spool import Spool
from learner.checkpoint import MANIFEST, CheckpointError, Checkpointer, locate
from learner.main import Learner
from learner.policy import TrainPolicy

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
V = 40
OVERRIDES = ["learner.device=cpu", "learner.batch_size=4", "learner.algo=ppo"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> pathlib.Path:
    d = tmp_path_factory.mktemp("model") / "m"
    TrainPolicy.from_config(DecoderConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1),
                            seed=0).save_hf(d)
    return d


def learner(run: pathlib.Path, model: pathlib.Path, **kw) -> Learner:
    run.mkdir(exist_ok=True)
    return Learner(C.load(overrides=OVERRIDES), str(run), str(model), [], **kw)


def close(ln: Learner) -> None:
    for f in (ln.episodes, ln.metrics_log, ln.trained_log):
        f.close()


def saved_at(run: pathlib.Path, model: pathlib.Path, *versions: int) -> Learner:
    """A learner that checkpointed at each of `versions` (the optimizer state moved in between)."""
    ln = learner(run, model)
    for v in versions:
        for p in ln.policy.parameters():
            p.grad = torch.ones_like(p)
        ln.trainer.opt.step()
        ln.version = v
        ln.checkpoint()
    return ln


# ---- a kill inside the save ---------------------------------------------------------------------------------------
KILLER = textwrap.dedent("""
    import os, pathlib, shutil, signal, sys
    from core import config as C
    from learner.main import Learner

    run, model, point = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    ln = Learner(C.load(overrides={overrides!r}), str(run), model, [])
    ln.version = 1
    ln.checkpoint()                                    # a whole checkpoint at version 1
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)
    real_replace, real_rmtree = os.replace, shutil.rmtree

    def replace(src, dst, *a, **k):
        if point == "rename-" + pathlib.Path(dst).name:  # SIGKILL just before this rename
            die()
        return real_replace(src, dst, *a, **k)

    def rmtree(path, *a, **k):
        if point == "remove-old" and pathlib.Path(path) == run / "ckpt.old" and not (run / "ckpt.tmp").exists():
            real_rmtree(path / "policy", *a, **k)       # killed half way through removing the old one
            die()
        return real_rmtree(path, *a, **k)

    os.replace, shutil.rmtree = replace, rmtree
    ln.version = 2
    ln.checkpoint()
    print("the save finished: no kill point was reached", flush=True)
""").format(overrides=OVERRIDES)


@pytest.mark.parametrize("point,expect", [("rename-ckpt.old", 1), ("rename-ckpt", 1), ("remove-old", 2)])
def test_a_learner_killed_inside_the_save_resumes_at_the_last_whole_version(tmp_path, model, point, expect, caplog):
    """SIGKILL before the old checkpoint is renamed aside, between the two renames (no ckpt/ at all: the old code
    came up at version 0) and half way through removing the old one: the resume is at the last whole version."""
    run = tmp_path / "run"
    run.mkdir()
    p = subprocess.run([sys.executable, "-c", KILLER, str(run), str(model), point], env=ENV, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stdout, p.stderr[-3000:])
    caplog.set_level("WARNING", logger="tars.learner")
    ln = learner(run, model, resume=True)
    assert ln.version == expect
    assert ("resuming from the previous one" in caplog.text) == (point == "rename-ckpt")
    # The next save after such a resume leaves one whole checkpoint and nothing else.
    ln.version = 3
    ln.checkpoint()
    assert locate(run) == run / "ckpt" and json.loads((run / "ckpt" / "meta.json").read_text())["version"] == 3
    assert not (run / "ckpt.old").exists() and not (run / "ckpt.tmp").exists()
    close(ln)


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, model, caplog):
    """Only a directory whose manifest (written last) matches its files is a checkpoint: a truncated train_state.pt
    in ckpt/ sends the resume to a whole ckpt.old, with its optimizer state, not a crash; a ckpt/ without its
    manifest and no ckpt.old is an error even with fresh_if_none."""
    run = tmp_path / "run"
    ln = saved_at(run, model, 1)
    opt_v1 = {k: v.clone() for k, v in ln.trainer.opt.state_dict()["state"][0].items()}
    shutil.copytree(run / "ckpt", tmp_path / "v1")
    ln.trainer.opt.step()
    ln.version = 2
    ln.checkpoint()
    close(ln)
    # ckpt/ at version 2 with its train_state.pt cut in half, ckpt.old/ the whole version 1
    ts = run / "ckpt" / "train_state.pt"
    ts.write_bytes(ts.read_bytes()[: ts.stat().st_size // 2])
    shutil.copytree(tmp_path / "v1", run / "ckpt.old")
    caplog.set_level("WARNING", logger="tars.learner")
    r = learner(run, model, resume=True)
    assert r.version == 1 and "train_state.pt has" in caplog.text and "resuming from the previous one" in caplog.text
    assert all(torch.equal(r.trainer.opt.state_dict()["state"][0][k], v) for k, v in opt_v1.items())
    close(r)
    # No manifest in ckpt/ (a save killed while writing it) and no ckpt.old: an error, never a silent version 0.
    shutil.rmtree(run / "ckpt.old")
    (run / "ckpt" / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=r"no whole checkpoint .*no MANIFEST\.json"):
        learner(run, model, resume=True, fresh_if_none=True)


# ---- a pickled payload in train_state.pt -------------------------------------------------------------------------
class Payload:
    def __init__(self, marker: pathlib.Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_that_cannot_be_written_is_discarded_and_training_goes_on(tmp_path, model, monkeypatch, caplog):
    """A full disk inside the save: the learner used to crash, and restarted, train from its last checkpoint to the
    same failing save. Now the partial ckpt.tmp is removed (its space given back), the error is counted and shown
    in status, the last whole checkpoint stays, and the next checkpoint tries again."""
    run = tmp_path / "run"
    ln = saved_at(run, model, 1)
    real_save = torch.save

    def disk_full(obj, f, *a, **kw):
        pathlib.Path(f).write_bytes(b"\0" * 4096)  # part of it written, then no space is left
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    ln.version = 2
    ln.checkpoint()  # does not raise
    st = ln.status()
    assert st["checkpoint_error"]["version"] == 2 and "No space left on device" in st["checkpoint_error"]["error"]
    assert st["counters"]["checkpoint_failures"] == 1 and st["last_checkpoint"]["version"] == 1
    assert not (run / "ckpt.tmp").exists() and locate(run) == run / "ckpt"
    assert json.loads((run / "ckpt" / "meta.json").read_text())["version"] == 1
    assert "checkpoint at version 2 failed" in caplog.text
    monkeypatch.setattr(torch, "save", real_save)
    ln.version = 3
    ln.checkpoint()
    assert ln.status()["checkpoint_error"] is None and ln.last_checkpoint["version"] == 3
    close(ln)
    back = learner(run, model, resume=True)
    assert back.version == 3
    close(back)


FULL_DISK = textwrap.dedent("""
    import json, pathlib, resource, signal, sys
    from core import config as C
    from learner.main import Learner

    run, model, where = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    ln = Learner(C.load(overrides={overrides!r}), str(run), model, [])
    ln.version = 1
    ln.checkpoint()
    size = lambda rel: (run / "ckpt" / rel).stat().st_size
    # A file grows past this limit as on a full disk: the write fails (EFBIG, SIGXFSZ ignored), in the policy's
    # safetensors or, the policy written, in train_state.pt.
    limit = size("policy/model.safetensors") // 2 if where == "policy" else \
        (size("policy/model.safetensors") + size("train_state.pt")) // 2
    assert where == "policy" or size("policy/model.safetensors") < limit < size("train_state.pt")
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    ln.version = 2
    ln.checkpoint()
    failed = ln.status()["checkpoint_error"]
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    left = (run / "ckpt.tmp").exists()
    ln.version = 3
    ln.checkpoint()
    print(json.dumps({{"failed": failed, "tmp_left": left, "after": ln.status()["checkpoint_error"],
                      "failures": ln.counters["checkpoint_failures"]}}))
""").format(overrides=OVERRIDES)


@pytest.mark.parametrize("where", ["policy", "train_state.pt"])
def test_a_full_disk_in_a_real_write_fails_the_checkpoint_not_the_learner(tmp_path, model, where):
    """A real failed write, not a mocked OSError: torch.save reports it as a RuntimeError and safetensors as a
    SafetensorError, which the learner did not catch (only OSError): it crashed at the checkpoint with ckpt.tmp left
    on the full disk, and restarted, trained to the same failing save. Now either is the failed checkpoint the docs
    describe: counted, shown, ckpt.tmp removed, training goes on and the next checkpoint succeeds."""
    run = tmp_path / "run"
    run.mkdir()
    p = subprocess.run([sys.executable, "-c", FULL_DISK, str(run), str(model), where], env=ENV, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["failed"]["version"] == 2 and "OSError: cannot write " + where in out["failed"]["error"]
    assert not out["tmp_left"] and out["failures"] == 1 and out["after"] is None
    assert json.loads((run / "ckpt" / "meta.json").read_text())["version"] == 3 and locate(run) == run / "ckpt"


FULL_AT_PUBLISH = textwrap.dedent("""
    import concurrent.futures, json, pathlib, resource, signal, sys
    from core import config as C
    from learner.main import Learner

    run, model, mode = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]

    class Server:  # an inference server's stub: what it was told, and when
        def __init__(self):
            self.told = []
            self.UpdateWeights = self.update
            self.UpdateWeightsStream = type("S", (), {{"future": self.stream}})()
        def update(self, req, timeout=None):
            self.told.append([req.version, req.path, sorted(p.name for p in pathlib.Path(req.path).iterdir())])
        def stream(self, pieces, timeout=None):
            self.told.append([next(iter(pieces)).version, "stream", []])
            f = concurrent.futures.Future()
            f.set_result(None)
            return f

    ln = Learner(C.load(overrides={overrides!r} + [f"learner.publish.mode={{mode}}"]), str(run), model, [])
    server = Server()
    ln.publisher.stubs = [server]
    ln._publish(1)
    v1 = run / "weights" / "v000001"
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a file grows past the limit as on a full disk: EFBIG
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, ((v1 / "model.safetensors").stat().st_size // 2, hard))
    ln._publish(2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    failed = {{"error": ln.status()["publish_error"], "failures": ln.status()["counters"].get("publish_write_failures"),
              "left": sorted(p.name for p in (run / "weights").iterdir())}}
    ln._publish(3)
    print(json.dumps({{"failed": failed, "told": server.told, "after": ln.status()["publish_error"],
                      "left": sorted(p.name for p in (run / "weights").iterdir())}}))
""").format(overrides=OVERRIDES)


@pytest.mark.parametrize("mode", ["disk", "stream"])
def test_a_full_disk_at_a_publish_fails_that_publish_not_the_learner(tmp_path, model, mode):
    """weights/v2 meets a real full disk (RLIMIT_FSIZE: the safetensors write fails): the SafetensorError went up
    through the learner's publish and ended it. Now that publish fails alone: counted, shown in the status, no
    partial directory left, v1 stays; in disk mode no server is told of v2 (they keep serving v1), in stream mode
    they got v2 from memory; the next publish (v3) is written and announced as usual."""
    run = tmp_path / "run"
    run.mkdir()
    p = subprocess.run([sys.executable, "-c", FULL_AT_PUBLISH, str(run), str(model), mode], env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    failed = out["failed"]
    assert failed["error"]["version"] == 2 and "OSError: cannot write weights/v000002" in failed["error"]["error"]
    assert failed["failures"] == 1 and failed["left"] == ["v000001"], failed
    assert out["after"] is None and out["left"] == ["v000001", "v000003"]
    told = [t[0] for t in out["told"]]
    assert told == ([1, 3] if mode == "disk" else [1, 2, 3]), out["told"]
    for version, path, files in out["told"]:  # only whole versions are announced
        assert path == "stream" or (path.endswith(f"v{version:06d}") and "model.safetensors" in files)
    assert "publish v2: cannot write" in p.stderr


FULL_AT_COMPACTION = textwrap.dedent("""
    import json, pathlib, resource, signal, sys
    from core import config as C
    from learner.main import Learner

    run, model = pathlib.Path(sys.argv[1]), sys.argv[2]
    ln = Learner(C.load(overrides={overrides!r}), str(run), model, [])
    ln.receiver.start()
    wal = ln.receiver.durability.wal
    for i in range(8):                                 # 8 acked trajectories, t0 trained
        wal.append(f"t{{i}}", b"x" * 10000)
    wal.sync()
    ln.receiver.mark_consumed(["t0"])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (40000, hard))  # the checkpoint fits, the rewritten WAL (70 KB) does not
    ln.version = 1
    ln.checkpoint()
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    first = {{"last": ln.last_checkpoint.get("version"), "left": sorted(p.name for p in run.glob("stream.wal.*")),
             "failures": ln.counters["wal_compaction_failures"]}}
    wal.append("t8", b"y" * 100)                       # the log goes on after the failed compaction
    wal.sync()
    ln.receiver.mark_consumed(["t1"])
    ln.version = 2
    ln.checkpoint()
    ln.receiver.stop()
    print(json.dumps({{"first": first, "last": ln.last_checkpoint.get("version")}}))
""").format(overrides=OVERRIDES)


def test_a_full_disk_at_the_wal_compaction_after_a_checkpoint_does_not_stop_the_learner(tmp_path, model):
    """The checkpoint was written, then compacting the stream's WAL (a rewrite of its unconsumed records) met a full
    disk: the OSError went up through checkpoint() and the learner crashed, with stream.wal.compact (what it had
    written of the copy) left on the full disk. Now the checkpoint stands, the failure is logged and counted, the
    copy is removed, the log goes on and the next checkpoint compacts it."""
    from core.stream.wal import WriteAheadLog

    run = tmp_path / "run"
    run.mkdir()
    p = subprocess.run([sys.executable, "-c", FULL_AT_COMPACTION, str(run), str(model)], env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["first"]["last"] == 1 and out["first"]["failures"] == 1
    assert "stream.wal.compact" not in out["first"]["left"] and out["last"] == 2
    wal = WriteAheadLog(run / "stream.wal", fsync=False).open()
    assert sorted(wal.index) == [f"t{i}" for i in range(2, 9)]
    wal.close()


def test_a_train_state_with_a_pickled_payload_is_refused_and_never_runs(tmp_path, model):
    """An attacker's train_state.pt (a pickled os.system call, the manifest fixed up to match) is refused by a real
    `tars learner --resume`: exit 2, a one-line error, and the payload's file never appears."""
    run, marker = tmp_path / "run", tmp_path / "PWNED"
    close(saved_at(run, model, 1))
    ts = run / "ckpt" / "train_state.pt"
    torch.save({"opt": Payload(marker), "torch_rng": torch.get_rng_state()}, ts)
    man = json.loads((run / "ckpt" / MANIFEST).read_text())
    man["files"]["train_state.pt"] = ts.stat().st_size
    (run / "ckpt" / MANIFEST).write_text(json.dumps(man))
    p = subprocess.run([sys.executable, "-m", "tars.cli", "learner", "--resume", "--run-dir", str(run), "--model",
                        str(model), "--set", "learner.device=cpu", "--set", "max_versions=0"], env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert not marker.exists(), "the pickled payload ran"
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    assert "train_state.pt refused: not a file of plain tensors" in p.stderr
    # In process too: the Checkpointer refuses it with a CheckpointError.
    ln = learner(tmp_path / "fresh", model)
    with pytest.raises(CheckpointError, match="refused"):
        Checkpointer(run, ln.policy, ln.critic, ln.trainer, ln.device).load()
    assert not marker.exists()
    close(ln)


def test_optimizer_state_dicts_load_with_weights_only(tmp_path, model):
    """What train_state.pt holds (AdamW state dicts of policy and critic, RNG states) loads with weights_only=True;
    the scheduler state lives in meta.json and round-trips."""
    run = tmp_path / "run"
    ln = saved_at(run, model, 1)
    state = torch.load(run / "ckpt" / "train_state.pt", weights_only=True)
    assert set(state) == {"opt", "torch_rng", "critic", "critic_opt"}
    assert state["opt"]["param_groups"] == ln.trainer.opt.state_dict()["param_groups"]
    assert json.loads((run / "ckpt" / "meta.json").read_text())["sched"]["last_epoch"] == ln.trainer.sched.last_epoch
    close(ln)


def test_a_checkpoint_of_another_model_is_refused_in_one_line(tmp_path, model):
    """--resume with a --model other than the run's (another width) is a CheckpointError naming the checkpoint, and a
    real `tars learner --resume` exits 2 with one line, not a traceback from the middle of loading the weights."""
    run, other = tmp_path / "run", tmp_path / "wider"
    close(saved_at(run, model, 1))
    TrainPolicy.from_config(DecoderConfig(vocab_size=V, hidden_size=32, intermediate_size=32, num_hidden_layers=1),
                            seed=0).save_hf(other)
    with pytest.raises(CheckpointError, match=r"ckpt does not fit this learner's model: .*size of tensor"):
        learner(run, other, resume=True)
    p = subprocess.run([sys.executable, "-m", "tars.cli", "learner", "--resume", "--run-dir", str(run), "--model",
                        str(other), "--set", "learner.device=cpu", "--set", "max_versions=0"], env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    assert "Traceback" not in p.stderr and "does not fit this learner's model" in p.stderr.splitlines()[-1]


# ---- --resume with nothing to resume -----------------------------------------------------------------------------
def test_resume_without_a_checkpoint_fails_and_resume_or_fresh_starts(tmp_path, model):
    cmd = [sys.executable, "-m", "tars.cli", "learner", "--run-dir", str(tmp_path / "run"), "--model", str(model),
           "--set", "learner.device=cpu", "--set", "max_versions=0", "--ready-file", str(tmp_path / "ready.json")]
    (tmp_path / "run").mkdir()
    p = subprocess.run(cmd + ["--resume"], env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--resume: no checkpoint in" in p.stderr, (p.returncode, p.stderr[-3000:])
    assert not (tmp_path / "ready.json").exists()
    p = subprocess.run(cmd + ["--resume-or-fresh"], env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads((tmp_path / "ready.json").read_text())["version"] == 0  # it came up, fresh
    assert locate(tmp_path / "run") == tmp_path / "run" / "ckpt"               # and checkpointed on the way out


def test_a_restarted_learner_in_a_topology_starts_fresh_if_it_had_no_checkpoint(tmp_path, model):
    from tars.cli import build_parser
    from tars.topology import Topology, plan

    topo = Topology(plan(C.load(), tmp_path, model, n_envd=0, inference=False, n_actors=0, inference_addr="x:1"))
    topo._resume = True  # what restart("learner") sets
    argv = topo.spec("learner").argv
    a = build_parser().parse_args(argv[3:])
    assert a.resume_or_fresh and not a.resume


def test_the_end_of_a_run_removes_the_weight_segments_a_killed_learner_left(tmp_path, model):
    """A learner SIGKILLed mid-publish leaves its /dev/shm segment to its own next start; when the run ends instead,
    nothing removed it (a policy's size in memory until the host reboots). Stopping the topology does, and only
    this run's."""
    from core import weights_shm
    from tars.topology import Topology, plan

    if not weights_shm.available():
        pytest.skip("no writable /dev/shm")
    topo = Topology(plan(C.load(), tmp_path, model, n_envd=0, inference=False, n_actors=0, inference_addr="x:1"))
    ours = pathlib.Path(weights_shm.SHM_DIR) / f"{weights_shm.run_prefix(tmp_path)}v7-123"
    other = pathlib.Path(weights_shm.SHM_DIR) / f"{weights_shm.run_prefix(tmp_path / 'elsewhere')}v7-123"
    try:
        for f in (ours, other):
            f.write_bytes(b"\0" * 64)
        topo.stop()
        assert not ours.exists() and other.exists()
    finally:
        for f in (ours, other):
            f.unlink(missing_ok=True)


# ---- a truncated spool file ---------------------------------------------------------------------------------------
def traj(tid: str, n: int = 24) -> Trajectory:
    return Trajectory(id=tid, env_id="builtin/test", outcome="terminated", tokens=np.arange(n, dtype=np.int32),
                      logprobs=np.full(n, -0.5, np.float32), versions=np.zeros(n, np.int32),
                      mask=np.ones(n, np.uint8), turns=[Turn("text:1", "out", {}, 1.0, 0, n)], ret=1.0)


IMAGES = {"ab" * 32: b"\x89PNG..."}


def spool_with_bad_files(d: pathlib.Path, images: dict | None = None) -> tuple[list[str], list[pathlib.Path]]:
    """Three whole spool records, two cut short (at the id, in the frame) and a stray file."""
    sp = Spool(str(d))
    os.makedirs(d, exist_ok=True)
    good = [f"good{i}" for i in range(3)]
    for tid in good:
        sp.save(tid, traj(tid).encode(), images)
    bad = []
    for tid, keep in (("cut-in-id", 6), ("cut-in-frame", 60)):  # a crash or a full disk in the middle of a write
        sp.save(tid, traj(tid).encode())
        p = pathlib.Path(sp._path(tid))
        p.write_bytes(p.read_bytes()[:keep])
        bad.append(p)
    (d / "stray.traj").write_bytes(b"\xff\xff\xff\xff\x00")
    bad.append(d / "stray.traj")
    return good, bad


def test_a_truncated_spool_file_is_skipped_and_the_good_ones_load(tmp_path, caplog):
    good, bad = spool_with_bad_files(tmp_path / "spool", IMAGES)
    caplog.set_level("WARNING")
    sp = Spool(str(tmp_path / "spool"))
    got = sp.load()
    assert sorted(t for t, _, _ in got) == good
    assert all(Trajectory.decode(f).id == t and imgs == IMAGES for t, f, imgs in got)
    assert sorted(sp.skipped) == sorted(map(str, bad)) and caplog.text.count("skipped") == 3
    assert all(not p.exists() and pathlib.Path(f"{p}.corrupt").exists() for p in bad)  # set aside, kept
    assert sorted(t for t, _, _ in Spool(str(tmp_path / "spool")).load()) == good   # and not seen again


def test_an_actor_with_a_truncated_spool_starts_and_resends_the_good_records(tmp_path):
    """A real `tars actor` whose spool holds truncated files: it starts, re-sends the whole records to the learner's
    stream, skips the rest with a warning, and keeps running."""
    from core.bpe import rendered_corpus, save_tokenizer, train_bpe
    from core.stream.receiver import TrajectoryReceiver
    from learner.staleness import StalenessManager

    conv = [{"role": "user", "content": "Screen: window Mail [button Save] Goal: click Save"},
            {"role": "assistant", "content": "click(target='Save')"}]
    save_tokenizer(train_bpe(rendered_corpus([conv] * 20, "chatml"), 300, "chatml"), tmp_path / "tok")
    good, bad = spool_with_bad_files(tmp_path / "spool")
    rx = TrajectoryReceiver("tcp://127.0.0.1:0", str(tmp_path / "wal.log"), StalenessManager(batch_size=1, eta=0),
                            fsync=False)
    addr = rx.start()
    log = open(tmp_path / "actor.log", "w")
    actor = subprocess.Popen(
        [sys.executable, "-m", "tars.cli", "actor", "--envd", "127.0.0.1:9", "--inference", "127.0.0.1:9",
         "--stream", addr, "--tokenizer", str(tmp_path / "tok"), "--actor-id", "a0",
         "--spool-dir", str(tmp_path / "spool"), "--set", "actor.concurrency=1"],
        env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    got: set[str] = set()
    try:
        deadline = time.monotonic() + 120
        while not set(good) <= got and time.monotonic() < deadline and actor.poll() is None:
            tr = rx.get(timeout=0.2)
            if tr is not None:
                got.add(tr.id)
        while (tr := rx.get(timeout=0.5)) is not None:  # whatever else it sends, until 0.5 s of quiet
            got.add(tr.id)
        assert actor.poll() is None, (tmp_path / "actor.log").read_text()[-3000:]
        assert set(good) <= got, (got, (tmp_path / "actor.log").read_text()[-3000:])
        assert not got & {"cut-in-id", "cut-in-frame"}
        assert (tmp_path / "actor.log").read_text().count("skipped") == 3
    finally:
        if actor.poll() is None:
            os.killpg(actor.pid, signal.SIGKILL)
        actor.wait(10)
        log.close()
        rx.stop()


# ---- the end of `tars up` -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("broken", ["final-export-failed", "final-from-an-earlier-run", "report-and-plot-unwritable"])
def test_tars_up_says_wrote_only_for_what_was_written(tmp_path, model, monkeypatch, capsys, broken):
    """The learner's final export failed (a file where final/ goes: a real learner process exits nonzero), final/
    is an earlier run's, or report.json / learning.png cannot be written: no "wrote" for them, an error line on
    stderr, the status says so, exit 1."""
    from tars import up

    out = tmp_path / "out"
    out.mkdir()
    status = "done"
    if broken == "final-export-failed":
        (out / "final").write_text("in the way")
        p = subprocess.run([sys.executable, "-m", "tars.cli", "learner", "--run-dir", str(out), "--model", str(model),
                            "--set", "learner.device=cpu", "--set", "max_versions=0"], env=ENV, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode != 0 and "final export to" in p.stderr, p.stderr[-3000:]
        assert (out / "final").is_file() and not list(out.glob("final.tmp*"))
        status = f"learner exited with {p.returncode}"
    elif broken == "final-from-an-earlier-run":
        shutil.copytree(model, out / "final")
        old = time.time() - 3600
        for f in (out / "final").iterdir():
            os.utime(f, (old, old))
    else:
        shutil.copytree(model, out / "final")
        soon = time.time() + 5  # exported during this run
        for f in (out / "final").iterdir():
            os.utime(f, (soon, soon))
        (out / "report.json").mkdir()
        (out / "learning.png").mkdir()

    class Started:  # the processes already ran (or failed) above; up() goes on to the report
        envd = inference = stream = "-"
        judge = ""  # no judge server

        def __init__(self, plan):
            self.procs = {}  # nothing for the supervisor to watch
            self.plan = types.SimpleNamespace(out=out)

        def start(self, cancel=None):
            return self

        def stop(self):
            pass

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(up, "build_model", lambda cfg, out, say: (model, None))
    monkeypatch.setattr(up, "plan", lambda *a, **k: None)
    monkeypatch.setattr(up, "Topology", Started)
    monkeypatch.setattr(up, "_watch", lambda *a: status)
    term = signal.getsignal(signal.SIGTERM)
    try:
        rc = up.up(C.load(overrides=["sft.steps=0"]), str(out))
    finally:
        signal.signal(signal.SIGTERM, term)  # up() installs its own
    o = capsys.readouterr()
    wrote = [ln for ln in o.out.splitlines() if "] wrote " in ln]
    assert rc == 1
    if broken == "report-and-plot-unwritable":
        assert wrote == [f"[tars up] wrote {out / 'final'}"], o.out
        assert f"{out / 'report.json'} not written: IsADirectoryError" in o.err
        assert f"{out / 'learning.png'} not written" in o.err
    else:
        assert not any("final" in ln for ln in wrote), o.out
        assert f"{out / 'final'} not written: " in o.err
        rep = json.loads((out / "report.json").read_text())
        assert rep["status"] == f"{status}; not written: final" and list(rep["not_written"]) == [str(out / "final")]


def test_a_rerun_of_tars_up_in_the_same_out_starts_without_the_earlier_runs_state(tmp_path, model, monkeypatch,
                                                                                      capsys):
    """The learner numbers its first publish after the newest weights/vN of its run directory (what a server
    restarted beside a restarted learner loads). An earlier run's weights/v3 left there made a rerun with the same
    max_versions=3 start at version 4 and end at once: no update, its untrained policy exported over final/. Its
    checkpoint (a learner restarted before its first one resumed it), WAL (replayed) and actors' spools (re-sent)
    reached the new run too. tars up moves them into out/earlier/N/ before any process starts (kept, not deleted);
    final/ and the logs stay."""
    from core.model_files import newest_published
    from tars import up

    out = tmp_path / "out"
    shutil.copytree(model, out / "weights" / "v3")  # the earlier run: published up to version 3, exported final/
    shutil.copytree(model, out / "final")
    (out / "ckpt").mkdir()
    (out / "ckpt" / "meta.json").write_text("{}")
    (out / "stream.wal").write_bytes(b"TWL1")
    (out / "spool" / "actor0").mkdir(parents=True)
    (out / "spool" / "actor0" / "x.twl").write_bytes(b"x")
    (out / "earlier" / "1").mkdir(parents=True)  # a run before those: the next number
    seen = {}

    class Started:
        envd = inference = stream = "-"
        judge = ""  # no judge server

        def __init__(self, plan):
            self.procs = {}
            self.plan = types.SimpleNamespace(out=out)

        def start(self, cancel=None):
            seen["published"] = newest_published(out / "weights")  # what a learner started now would number after
            seen["left"] = sorted(n for n in ("ckpt", "stream.wal", "spool") if (out / n).exists())
            return self

        def stop(self):
            pass

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(up, "build_model", lambda cfg, out, say: (model, None))
    monkeypatch.setattr(up, "plan", lambda *a, **k: None)
    monkeypatch.setattr(up, "Topology", Started)
    monkeypatch.setattr(up, "_watch", lambda *a: "done")
    term = signal.getsignal(signal.SIGTERM)
    try:
        up.up(C.load(overrides=["sft.steps=0", "max_versions=3"]), str(out))
    finally:
        signal.signal(signal.SIGTERM, term)
    assert seen["published"] is None and seen["left"] == []
    assert f"moved its weights, ckpt, stream.wal, spool to {out / 'earlier' / '2'}" in capsys.readouterr().out
    kept = out / "earlier" / "2"
    assert newest_published(kept / "weights")[1] == 3 and (kept / "ckpt" / "meta.json").read_text() == "{}"
    assert (kept / "stream.wal").read_bytes() == b"TWL1" and (kept / "spool" / "actor0" / "x.twl").is_file()
    assert (out / "final" / "config.json").is_file()  # the earlier run's results are left alone


# ---- what a resume keeps besides the weights -----------------------------------------------------------------------
def _kept(tid: str, group: str, version: int) -> Trajectory:
    return Trajectory(id=tid, env_id="test", outcome="terminated", tokens=np.array([1, 2, 3], np.int32),
                      logprobs=np.array([0.0, -0.5, -0.5], np.float32), versions=np.full(3, version, np.int32),
                      mask=np.array([0, 1, 1], np.uint8), turns=[Turn("text:1", "x", {}, 1.0, 0, 3)], ret=1.0,
                      group=group)


def test_a_resumed_learner_keeps_its_admission_bound_and_live_eta(tmp_path, model):
    """The admission ledger is restored: accepted counts what was trained (not the kept members a pending group still
    held at the checkpoint: they come again after the restart and are counted then), and a live `set eta` survives;
    the old resume restarted the ledger at 0 (capacity 32 instead of 4 here) with the configured eta."""
    run = tmp_path / "run"
    run.mkdir()
    ov = [*OVERRIDES, "learner.algo=grpo", "learner.group.size=4"]
    ln = Learner(C.load(overrides=ov), str(run), str(model), [])
    st = ln.staleness
    assert st.eta == 2
    st.set_eta(0)                                   # tars ctl set eta 0
    for v in range(1, 6):                           # 5 updates of B = 4
        assert st.try_admit(4) == 4
        st.on_accepted(4)
        ln.version = v
        st.set_version(v)
    assert st.try_admit(2) == 2                     # two members of a group of 4 arrive, kept, the group pending
    arrivals = [_kept("a", "g", 5), _kept("b", "g", 5)]
    ln.receiver.get = lambda timeout: arrivals.pop(0) if arrivals else None
    stop = __import__("threading").Event()

    def idle():                                     # no arrival for a poll: the learner checkpoints then if asked
        ln.checkpoint()
        stop.set()
    assert ln.admission.collect(4, 5, stop, on_idle=idle) is None
    assert ln.admission.held() == 2 and st.stats()["accepted"] == 22 and st.capacity() == 2
    close(ln)

    back = Learner(C.load(overrides=ov), str(run), str(model), [], resume=True)
    s = back.staleness.stats()
    assert (back.version, s["version"], s["eta"], s["accepted"]) == (5, 5, 0, 20)
    assert back.staleness.capacity() == 4           # the two held ones are not consumed: they come again
    back.staleness.adopt(2)                         # (replayed from the WAL, or re-sent by their actor)
    assert back.staleness.capacity() == 2           # where the bound was before the kill
    close(back)
    # A restart with another configured eta: the configuration wins over the live value.
    again = Learner(C.load(overrides=[*ov, "learner.staleness.eta=3"]), str(run), str(model), [], resume=True)
    assert again.staleness.eta == 3 and again.staleness.stats()["accepted"] == 20
    close(again)


def test_a_grpo_group_with_a_masked_member_is_whole_again_after_a_restart(tmp_path, model):
    """A pending group of 4 holds two kept members and an infra_error one at the checkpoint: the infra_error member
    is not consumed until its group is, so after a restart it comes again with its kept mates (WAL replay, or its
    actor's re-send) and the fourth member completes the group at once. Before, it was consumed on arrival, the
    restart saw 3 of 4 and the group waited out group.timeout_s (120 s by default) one member short."""
    import threading

    run = tmp_path / "run"
    run.mkdir()
    ov = [*OVERRIDES, "learner.algo=grpo", "learner.group.size=4", "learner.batch_size=3"]
    ln = Learner(C.load(overrides=ov), str(run), str(model), [])
    infra = _kept("b", "g", 0)
    infra.outcome = "infra_error"
    arrivals = [_kept("a", "g", 0), infra, _kept("c", "g", 0)]
    ln.staleness.try_admit(4)
    ln.receiver.get = lambda timeout: arrivals.pop(0) if arrivals else None
    stop = threading.Event()

    def idle():                                     # nothing more arrives: a checkpoint, then the kill
        ln.checkpoint()
        stop.set()
    assert ln.admission.collect(3, 0, stop, on_idle=idle) is None
    meta = json.loads((run / "ckpt" / "meta.json").read_text())
    assert meta["consumed_ids"] == [] and meta["staleness"]["rejected"] == 0
    close(ln)

    back = Learner(C.load(overrides=ov), str(run), str(model), [], resume=True)
    consumed = set(meta["consumed_ids"])            # what the restarted receiver does not replay
    again = [t for t in (_kept("a", "g", 0), infra, _kept("c", "g", 0)) if t.id not in consumed]
    back.staleness.adopt(len(again))
    assert back.staleness.try_admit(1) == 1
    arrivals = [*again, _kept("d", "g", 0)]         # the replay, then the group's last member
    back.receiver.get = lambda timeout: arrivals.pop(0) if arrivals else None
    t0 = time.monotonic()
    got = back.admission.collect(3, 0, threading.Event(), on_idle=lambda: pytest.fail("the group was not whole"))
    assert [t.id for t in got] == ["a", "c", "d"] and time.monotonic() - t0 < 5
    assert back.admission.take_masked() == ["b"] and back.counters["groups_timed_out"] == 0
    close(back)


@pytest.mark.parametrize("new_b", [1, 16])
def test_a_resume_with_another_batch_size_keeps_the_admission_bound_eta_plus_one_batches_ahead(tmp_path, model, new_b):
    """learner.batch_size changed across a restart: the ledger's accepted count is re-based on the new size. As it
    was, a smaller size left capacity 0 until a version no update could reach without admissions (training stopped
    for good: 40 accepted at version 10 of B = 4, resumed at B = 1: (2 + 11) x 1 - 40 < 0), a larger one admitted
    many batches at once."""
    run = tmp_path / "run"
    run.mkdir()
    ln = Learner(C.load(overrides=[*OVERRIDES, "learner.algo=grpo"]), str(run), str(model), [])
    st = ln.staleness
    for v in range(1, 11):                          # 10 updates of B = 4
        assert st.try_admit(4) == 4
        st.on_accepted(4)
        ln.version = v
        st.set_version(v)
    assert st.capacity() == 12                      # (eta + 1) batches ahead of training
    ln.checkpoint()
    close(ln)
    back = Learner(C.load(overrides=[*OVERRIDES, "learner.algo=grpo", f"learner.batch_size={new_b}"]), str(run),
                   str(model), [], resume=True)
    assert back.version == 10 and back.staleness.capacity() == 3 * new_b
    close(back)


def test_a_resume_numbers_after_the_newest_written_weights_when_no_server_answers(tmp_path, model, caplog):
    """The learner and its inference server died together; the server, relaunched with the newest weights/vN, does
    not answer yet when the learner resumes: the learner continues after that N (it wrote those weights), not at its
    checkpoint's version, whose next numbers the relaunched server refuses as not newer."""
    run = tmp_path / "run"
    saved_at(run, model, 5)
    for v in (6, 7):                                # published past the checkpoint before the kill
        ln = learner(run, model)
        ln.policy.save_hf(run / "weights" / f"v{v:06d}")
        close(ln)
    (run / "weights" / "v000009.tmp-x").mkdir()     # a write in progress is not a version
    caplog.set_level("WARNING", logger="tars.learner")
    with socket.socket() as s:                      # the server's port, nobody listening on it yet
        s.bind(("127.0.0.1", 0))
        down = f"127.0.0.1:{s.getsockname()[1]}"
    back = Learner(C.load(overrides=[*OVERRIDES, "learner.publish.timeout_s=5"]), str(run), str(model), [down],
                   resume=True)
    back.stop.set()
    back.train()                                    # no update: the resume, its publish, the final checkpoint
    assert back.version == 8
    assert "resuming at version 5 behind the servers' 7: continuing at 8" in caplog.text
    assert (run / "weights" / "v000008").is_dir()
    close(back)
    # With no inference server at all (a learner alone) nothing else numbers versions: the checkpoint's stands.
    alone = learner(run, model, resume=True)
    alone.stop.set()
    alone.train()
    assert alone.version == 8                       # the checkpoint the run above left at 8, not past weights/v8
    close(alone)


def test_a_learner_resumed_after_its_last_update_ends_at_max_versions(tmp_path, model):
    """Killed in the final export: the resume has nothing to train and keeps the number (it went one past
    max_versions, with the same weights under a new number)."""
    run = tmp_path / "run"
    saved_at(run, model, 3)
    ln = learner(run, model)
    ln.policy.save_hf(run / "weights" / "v000003")
    close(ln)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        down = f"127.0.0.1:{s.getsockname()[1]}"
    back = Learner(C.load(overrides=[*OVERRIDES, "max_versions=3", "learner.publish.timeout_s=5"]), str(run),
                   str(model), [down], resume=True)
    back.train()
    assert back.version == 3 and back.counters["publish_failures"] == 0
    assert (run / "final" / "model.safetensors").exists()
    assert json.loads((run / "ckpt" / "meta.json").read_text())["version"] == 3
    close(back)


class _Killed(Exception):
    """Stands for a SIGKILL of the learner: nothing after it runs."""


@pytest.mark.parametrize("how", ["stopped", "killed after a requested checkpoint"])
def test_a_masked_id_a_checkpoint_consumed_stays_in_the_ledger_after_a_resume(tmp_path, model, how):
    """An infra_error arrival is consumed at once (kept out of the loss), but trained.jsonl records it with the next
    update, above the version of a checkpoint taken meanwhile: the final one of a stopped learner (its record is the
    partial next version), or one `tars ctl checkpoint` asked for while the learner waited for a batch. The resume
    from that checkpoint drops every record above its version; the id is not received again (consumed), so it was
    in no record of the lineage: tars.faults.account counted it lost (1 of 3 here)."""
    from tars.faults import lineage

    run = tmp_path / "run"
    run.mkdir()
    ov = [*OVERRIDES, "learner.algo=grpo", "learner.batch_size=2", "learner.checkpoint.every=100",
          "max_versions=100"]
    ln = Learner(C.load(overrides=ov), str(run), str(model), [])
    infra = _kept("x", "", 0)
    infra.outcome = "infra_error"
    arrivals = [_kept("a", "", 0), _kept("b", "", 0), infra, None, _kept("c", "", 0), _kept("d", "", 0)]

    def get(timeout):
        if not arrivals:
            if how == "stopped":
                ln.stop.set()
                return None
            raise _Killed
        tr = arrivals.pop(0)
        if tr is None:                              # an idle poll: the checkpoint asked for is taken now
            ln.checkpoint_requested.set()
            if how == "stopped":
                ln.stop.set()
        else:
            ln.staleness.adopt(1)
        return tr
    ln.receiver.get = get
    if how == "stopped":
        ln.train()
    else:
        with pytest.raises(_Killed):
            ln.train()                              # v1: a, b; x masked; checkpoint at v1; v2: c, d; killed
    close(ln)
    meta = json.loads((run / "ckpt" / "meta.json").read_text())
    assert meta["version"] == 1 and "x" in meta["consumed_ids"]

    back = Learner(C.load(overrides=ov), str(run), str(model), [], resume=True)
    back.receiver.get = lambda timeout: back.stop.set()
    back.train()
    close(back)
    lin = lineage([json.loads(s) for s in (run / "trained.jsonl").read_text().splitlines()])
    assert sorted(t for r in lin.values() for t in r["ids"]) == ["a", "b"]  # (c, d: not checkpointed, come again)
    assert [t for r in lin.values() for t in r["masked"]] == ["x"]
