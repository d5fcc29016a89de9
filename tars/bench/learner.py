"""`tars bench learner`: what the learner's plumbing costs, each figure against a baseline from the same run.

    tars bench learner [--json FILE] [--quick] [--preset quickstart] [--set K=V] [--n N] [--payload-bytes B] [--steps K]
                       [--model DIR [--images N] [--image-size WxH]]

Figures:
  stream_over_raw          trajectories/s consumed through the stream (TrajectorySender -> TrajectoryReceiver:
                           credits, acks, outbox, and the preset's learner.stream.durability: "checkpoint" = held
                           notices and acks after each commit, "wal" = WAL append + batched fdatasync before each
                           ack) / trajectories/s through a raw DEALER->ROUTER msgpack link with the same payloads;
                           all decode + validate and hand each trajectory to a consumer thread; the actor side is a
                           child process (tars/bench/stream.py)                                    goal >= 0.8
  stream_over_raw_wal      the same with the other durability (or _checkpoint when the preset uses the WAL)
  publish_share_of_step    median time to publish a version (HF-layout safetensors written and renamed, a real
                           `tars serve` subprocess told to load it and answering that it serves it) / median time of
                           one training step (PPOTrainer.step with the critic on a batch shaped like the preset's
                           episodes, on learner.device in learner.precision as the learner runs it), same model
                                                                                                   goal <= 0.05
                           --model DIR: that checkpoint as the learner loads it (TrainPolicy.load) and `tars serve
                           --model DIR`; a Qwen2-VL / Qwen2.5-VL one trains on trajectories with --images screenshots
                           of --image-size each (tars/bench/episodes.py), so the step includes the vision tower's
                           forward and backward and the published weights include it
  publish_share_of_step_shm     the same through shared memory (learner.publish.mode=shm: a /dev/shm segment
                           named over gRPC, mapped by the server); publish = until the server answered that it serves
                           the version; publish_total_ms adds the weights/vN copy written after it (for restarts)
  publish_share_of_step_stream  the same through UpdateWeightsStream (raw tensor pieces over gRPC)
"""
from __future__ import annotations

import argparse
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

import torch

from tars.bench import report
from tars.topology import LaunchError, Process, daemon_spec, pythonpath

REPO = pathlib.Path(__file__).resolve().parents[2]


def _machine() -> dict:
    return {"cores": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
            "load_avg_start": round(os.getloadavg()[0], 2), "torch_threads": torch.get_num_threads()}


def _start_server(model_dir: pathlib.Path, tmp: pathlib.Path) -> tuple[Process, str]:
    spec = daemon_spec("inference", ["--model", str(model_dir), "--port", "0"], tmp, {"PYTHONPATH": pythonpath(REPO)},
                       REPO)
    spec.stop_s = 10.0
    server = Process(spec)
    try:
        return server, server.wait_ready()["address"]
    except LaunchError:
        server.kill()
        raise RuntimeError(f"tars serve did not start: {spec.log.read_text()[-2000:]}") from None


MODES = ("disk", "shm", "stream")


def _policy(cfg, model_dir: pathlib.Path | None, tmp: pathlib.Path, images: int, size: tuple[int, int]):
    """The policy, the directory `tars serve` starts from, the tokenizer directory for published versions and a batch
    shaped like the preset's episodes: the preset's model.* shape with text trajectories, or the checkpoint in
    model_dir as the learner loads it (TrainPolicy.load; model.freeze_vision as the learner applies it) with text
    trajectories, or, for a vision-language checkpoint, trajectories with `images` screenshots of `size` each."""
    from core.model import DecoderConfig
    from learner.policy import TrainPolicy
    from tars.bench.episodes import text_episodes, vl_episodes

    turns, gen = max(1, cfg.actor.max_turns), cfg.actor.max_new_tokens
    if model_dir is None:
        m = cfg.model
        dc = DecoderConfig(vocab_size=512, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                           num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
                           num_key_value_heads=m.num_kv_heads, max_position_embeddings=m.max_positions,
                           rope_theta=m.rope_theta, tie_word_embeddings=m.tie_embeddings)
        policy = TrainPolicy.from_config(dc, seed=0)
        policy.save_hf(tmp / "model")
        return policy, tmp / "model", None, text_episodes(cfg.learner.batch_size, dc.vocab_size, turns, 120, gen)
    policy = TrainPolicy.load(model_dir)
    if cfg.model.freeze_vision:
        policy.freeze_vision()
    if policy.vl is not None:
        batch = vl_episodes(model_dir, cfg.learner.batch_size, images=images, size=size, gen_len=gen)
    else:
        batch = text_episodes(cfg.learner.batch_size, policy.config.vocab_size, turns, 120, gen)
    return policy, model_dir, model_dir, batch


def publish_vs_step(cfg, steps: int, tmp: pathlib.Path, device: torch.device, amp: torch.dtype | None,
                    model_dir: pathlib.Path | None = None, images: int = 2, size: tuple[int, int] = (160, 210)) -> dict:
    """Median publish time (to a real inference server) per learner.publish.mode and median training step time, same
    model; the modes take turns step by step so that load drifts hit them alike. The step runs on `device` under
    `amp` (learner.device / learner.precision resolved). model_dir: a checkpoint directory (text or
    vision-language) trained and served instead of the preset's model.* shape (see _policy)."""
    import collections

    from core import weights_shm
    from core.config_learner import PublishConfig
    from learner.device import describe
    from learner.publish import Publisher
    from learner.ppo import PPOTrainer
    from core import rpc
    from learner.policy import TrainPolicy
    from core.v1 import inference_pb2, inference_pb2_grpc

    torch.manual_seed(0)
    policy, serve_dir, tokenizer_from, batch = _policy(cfg, model_dir, tmp, images, size)
    # As the learner builds it: the policy's trunk and a zero value head.
    critic = TrainPolicy.critic_from(policy) if cfg.learner.algo == "ppo" else None
    torch.set_num_threads(max(1, cfg.learner.threads))
    for m in (policy, critic):  # moved as learner/main.py moves them
        if m is not None:
            m.to(device)
    trainer = PPOTrainer(policy, critic, cfg.learner, policy.config.pad_token_id or 0, amp_dtype=amp)
    server, addr = _start_server(serve_dir, tmp)
    try:
        stub = inference_pb2_grpc.InferenceServiceStub(rpc.sync_channel(addr, cfg.inference.auth_token, 512 << 20))
        modes = [m for m in MODES if m != "shm" or weights_shm.available()]
        run = tmp / "run"
        run.mkdir()
        counters = collections.Counter()
        pubs = {m: Publisher(policy, run, [addr], cfg.inference.auth_token, PublishConfig(keep_versions=2, mode=m),
                             counters, tokenizer_from=tokenizer_from)
                for m in modes}
        step_s: list[float] = []
        publish_s = {m: [] for m in modes}
        total_s = {m: [] for m in modes}
        served_versions = {m: [] for m in modes}
        vision = [q for q in policy.vision_parameters() if q.requires_grad]
        vision_before = [q.detach().clone() for q in vision]
        v = skipped = 0
        for i in range(steps):
            for m in modes:
                v += 1
                t0 = time.perf_counter()
                metrics = trainer.step(batch, v - 1)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # the step's kernels, not only their launches
                t1 = time.perf_counter()
                skipped += bool(metrics.get("policy_step_skipped"))
                step_s.append(t1 - t0)
                publish_s[m].append(pubs[m].publish(v))
                total_s[m].append(time.perf_counter() - t1)
                served = stub.GetVersion(inference_pb2.GetVersionRequest(), timeout=10).version
                served_versions[m].append(served)
                if served != v or counters["publish_failures"]:
                    raise RuntimeError(f"the server serves version {served} after publishing {v} ({m}); {dict(counters)}")
    finally:
        server.stop()
    vision_trained = bool(vision) and any(not torch.equal(a, q) for a, q in zip(vision_before, vision))
    vision = policy.vision_parameters()
    sd = policy.hf_state_dict()
    return {"device": describe(device, amp), "step_s": step_s, "publish_s": publish_s, "publish_total_s": total_s,
            "served_versions": served_versions, "skipped_steps": skipped,
            "model": str(model_dir) if model_dir is not None else f"preset model.* ({cfg.model.num_layers} layers, "
                                                                  f"hidden {cfg.model.hidden_size})",
            "vl": policy.vl is not None, "vision_trained": vision_trained,
            "params": sum(p.numel() for p in policy.parameters()),
            "vision_params": sum(p.numel() for p in vision),
            "weights_bytes": int(sum(t.numel() * t.element_size() for t in sd.values())),
            "vision_bytes": int(sum(p.numel() * p.element_size() for p in vision)),
            "batch": {"trajectories": len(batch), "tokens": int(sum(len(t.tokens) for t in batch)),
                      "generated_tokens": int(sum(int(t.mask.sum()) for t in batch)),
                      "images": int(sum(len(t.image_refs) for t in batch)),
                      "image_size": list(size) if policy.vl is not None else None,
                      "segments": int(sum(1 + len(t.segments) for t in batch))}}


def run(a) -> dict:
    from core import config as C
    from learner.device import resolve_device, resolve_precision
    from tars.bench.stream import bench as stream_bench

    cfg = C.load(a.preset, None, a.set)
    # Where the learner would train (a device not there fails here, before the stream figures run).
    device = resolve_device(cfg.learner.device)
    amp = resolve_precision(cfg.learner.precision, device)
    out = {"machine": _machine(), "preset": a.preset, "model": a.model, "figures": {}}
    s = stream_bench(n=a.n, payload_bytes=a.payload_bytes, repeats=a.repeats, subprocess=True)
    # Headline: the durability the preset runs with; the other is reported beside it.
    by_mode = {"wal": (s["ratio"], s["stream_per_s"]), "checkpoint": (s["ratio_checkpoint"], s["stream_checkpoint_per_s"])}
    mode = cfg.learner.stream.durability
    other = "wal" if mode == "checkpoint" else "checkpoint"
    for name, m in (("stream_over_raw", mode), (f"stream_over_raw_{other}", other)):
        ratio, rate = by_mode[m]
        out["figures"][name] = {"value": ratio, "unit": "x", "goal": ">= 0.8", "pass": ratio >= 0.8, "durability": m,
                                "stream_per_s": rate, "raw_per_s": s["raw_per_s"], "detail": s}
    with tempfile.TemporaryDirectory() as tmp:
        p = publish_vs_step(cfg, a.steps, pathlib.Path(tmp), device, amp, a.model and pathlib.Path(a.model), a.images,
                            a.image_size)
    step = statistics.median(p["step_s"])
    for m in p["publish_s"]:
        pub, total = statistics.median(p["publish_s"][m]), statistics.median(p["publish_total_s"][m])
        share = pub / step
        out["figures"]["publish_share_of_step" + ("" if m == "disk" else f"_{m}")] = {
            "value": round(share, 4), "unit": "x", "goal": "<= 0.05", "pass": share <= 0.05, "mode": m,
            "step_ms": round(step * 1e3, 1), "publish_ms": round(pub * 1e3, 1), "publish_total_ms": round(total * 1e3, 1),
            "detail": p}
    out["machine"]["load_avg_end"] = round(os.getloadavg()[0], 2)
    return out


def _describe(d: dict) -> str:
    b = d["batch"]
    vis = f" ({d['vision_params']} in the vision tower)" if d["vl"] else ""
    ims = (f", {b['images']} screenshots of {b['image_size'][0]}x{b['image_size'][1]}, {b['segments']} segments"
           if d["vl"] else "")
    return (f"{d['model']}: {d['params']} params{vis}, {d['weights_bytes']} B; {b['trajectories']} trajectories, "
            f"{b['tokens']} tokens{ims}; steps on {d['device']}")


def _size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not WIDTHxHEIGHT (e.g. 160x210)") from None
    if w < 1 or h < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: width and height must be >= 1")
    return w, h


def table(out: dict) -> str:
    rows = [("figure", "value", "goal", "pass", "baseline / detail")]
    for name in [k for k in out["figures"] if k.startswith("stream_over_raw")]:
        f = out["figures"][name]
        rows.append((name, f"{f['value']:g}", f["goal"], "PASS" if f["pass"] else "FAIL",
                     f"stream ({f['durability']} durability) {f['stream_per_s']:.0f}/s vs raw {f['raw_per_s']:.0f}/s, "
                     f"{f['detail']['payload_bytes']} B each"))
    for name in [k for k in out["figures"] if k.startswith("publish_share_of_step")]:
        f = out["figures"][name]
        rows.append((name, f"{f['value']:g}", f["goal"], "PASS" if f["pass"] else "FAIL",
                     f"publish ({f['mode']}) {f['publish_ms']:.1f} ms (with the disk copy {f['publish_total_ms']:.1f} ms) / "
                     f"step {f['step_ms']:.1f} ms ({_describe(f['detail'])})"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tars bench learner", description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="FILE", help="write the figures here as JSON")
    ap.add_argument("--preset", default="quickstart", help="model and learner settings (default quickstart)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, e.g. learner.batch_size=16")
    ap.add_argument("--n", type=int, default=2000, help="trajectories per stream run")
    ap.add_argument("--payload-bytes", type=int, default=32 << 10, help="encoded size of each trajectory")
    ap.add_argument("--repeats", type=int, default=3, help="stream/raw runs, interleaved; the best of each counts")
    ap.add_argument("--steps", type=int, default=5, help="training steps (each followed by a publish)")
    ap.add_argument("--model", metavar="DIR", help="train and publish this checkpoint directory (text or Qwen2-VL / "
                    "Qwen2.5-VL) instead of the preset's model.* shape; a VL one trains on screenshots")
    ap.add_argument("--images", type=int, default=2, help="screenshots per trajectory with a VL --model (default 2)")
    ap.add_argument("--image-size", type=_size, default=(160, 210), metavar="WxH",
                    help="screenshot size with a VL --model (default 160x210)")
    ap.add_argument("--quick", action="store_true", help="short run: 1000 trajectories, 2 repeats, 2 steps (200 x 1, "
                    "as before, timed ~30 ms transfers once: ratios of 0.9 where longer runs gave 0.65)")
    a = ap.parse_args(argv)
    if a.quick:
        a.n, a.repeats, a.steps = 1000, 2, 2
    for k in ("n", "payload_bytes", "repeats", "steps", "images"):
        if getattr(a, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1")
    if a.model is not None and not (pathlib.Path(a.model) / "config.json").is_file():
        ap.error(f"--model {a.model}: no config.json there (give a Hugging Face checkpoint directory)")
    return report(run(a), table, a.json)


if __name__ == "__main__":
    sys.exit(main())
