"""Where a vision-language learner step and a weight publish spend their time on a GPU, phase by phase.

    python scripts/gpu_profile_learner.py MODEL_DIR OUT.json [IMAGES] [WxH] [--batch=N]
                                          [--profile | --publish-only | --rope-ab]

MODEL_DIR: a checkpoint as `tars bench learner --model` takes it (scripts/make_vl_bench_model.py makes the 1.0 B one).
The batch, trainer and server are the bench's (tars/bench/learner.py), on learner.device / learner.precision.
Reports: the step's wall time against its summed CUDA kernel time and the top operators (torch.profiler); the
learner-side publish phases timed alone (state dict, device-to-host copy, the shared-memory segment, the disk copy)
and the server's install of a segment timed alone (twice; its log's split of each install is in the JSON). Runs on a
CPU too, without kernel figures; --publish-only skips the steps (the publish phases of a large model on a CPU).
--batch=N: trajectories a step (default 8). --rope-ab: after the three steps, six more, alternating the M-RoPE
positions from transformers' get_rope_index and the learner's own (TrainPolicy._segment_positions), then stop.
"""
from __future__ import annotations

import json
import pathlib
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _top(prof, key: str, n: int = 15) -> list[dict]:
    rows = []
    for e in sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:n]:
        rows.append({"op": e.key[:80], "calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2),
                     "self_device_ms": round(getattr(e, "self_device_time_total", 0.0) / 1e3, 2)})
    return rows


def main(model_dir: str, out_path: str, images: int = 2, size: tuple[int, int] = (640, 400)) -> dict:
    from core import config as C, rpc, weights_shm
    from core.v1 import inference_pb2, inference_pb2_grpc
    from learner.device import describe, resolve_device, resolve_precision
    from learner.ppo import PPOTrainer
    from learner.policy import TrainPolicy
    from tars.bench.learner import _policy, _start_server

    batch_opt = [x.split("=", 1)[1] for x in sys.argv if x.startswith("--batch=")]
    cfg = C.load("quickstart", None, [f"learner.batch_size={batch_opt[-1] if batch_opt else 8}"])
    device = resolve_device(cfg.learner.device)
    amp = resolve_precision(cfg.learner.precision, device)
    out: dict = {"device": describe(device, amp), "model": model_dir}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        t = time.perf_counter()
        policy, serve_dir, tokenizer_from, batch = _policy(cfg, pathlib.Path(model_dir), tmp, images, size)
        steps = "--publish-only" not in sys.argv
        critic = TrainPolicy.critic_from(policy) if cfg.learner.algo == "ppo" and steps else None
        for m in (policy, critic):
            if m is not None:
                m.to(device)
        out["build_s"] = round(time.perf_counter() - t, 2)

        if steps:  # --publish-only: the phases below only (a CPU cannot step a 1 B VL model soon)
            trainer = PPOTrainer(policy, critic, cfg.learner, policy.config.pad_token_id or 0, amp_dtype=amp)
            step_s = []
            for v in range(3):  # the first warms up (allocator, kernels)
                t = time.perf_counter()
                trainer.step(batch, v)
                _sync(device)
                step_s.append(round(time.perf_counter() - t, 3))
            out["step_s"] = step_s
            print(json.dumps({k: out[k] for k in ("device", "build_s", "step_s")}), flush=True)
            if "--rope-ab" in sys.argv:  # M-RoPE positions from transformers' get_rope_index (A) or the learner's (B)
                ab: dict = {"transformers_rope_index": [], "learner_positions": []}
                for k in range(6):
                    policy.hf_rope_index = k % 2 == 0
                    t = time.perf_counter()
                    trainer.step(batch, 3 + k)
                    _sync(device)
                    ab["transformers_rope_index" if k % 2 == 0 else "learner_positions"].append(
                        round(time.perf_counter() - t, 3))
                policy.hf_rope_index = False
                out["rope_ab_step_s"] = ab
                print(json.dumps({"rope_ab_step_s": ab}), flush=True)
                pathlib.Path(out_path).write_text(json.dumps(out, indent=1))
                return out
            # Attention calls in one step (transformers' Qwen2.5-VL vision tower without flash-attn ran one SDPA call
            # per window; core/vision_attention.py one per window length).
            import torch.nn.functional as F
            calls = [0]
            sdpa = F.scaled_dot_product_attention

            def counted(*a, **k):
                calls[0] += 1
                return sdpa(*a, **k)
            F.scaled_dot_product_attention = counted
            try:
                trainer.step(batch, 3)
            finally:
                F.scaled_dot_product_attention = sdpa
            out["sdpa_calls_per_step"] = calls[0]
            print(json.dumps({"sdpa_calls_per_step": calls[0]}), flush=True)
            if "--profile" in sys.argv:  # slow to process on a GPU: tens of thousands of kernels
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
                with profile(activities=acts) as prof:
                    t = time.perf_counter()
                    trainer.step(batch, 4)
                    _sync(device)
                    wall = time.perf_counter() - t
                ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
                out["profiled_step"] = {"wall_s": round(wall, 3), "kernels": len(ev),
                                        "kernel_s": round(sum(e.device_time for e in ev) / 1e6, 3),
                                        "top_self_cpu": _top(prof, "self_cpu_time_total"),
                                        "top_self_device": _top(prof, "self_device_time_total") if ev else []}

        # Learner-side publish phases, each alone.
        ph: dict = {}
        t = time.perf_counter()
        sd = policy.hf_state_dict()
        _sync(device)
        ph["hf_state_dict_s"] = time.perf_counter() - t
        t = time.perf_counter()
        cpu = {k: v.detach().to("cpu") for k, v in sd.items()}
        ph["to_cpu_s"] = time.perf_counter() - t
        ph["bytes"] = int(sum(v.numel() * v.element_size() for v in cpu.values()))
        ph["dtypes"] = sorted({str(v.dtype) for v in sd.values()})
        t = time.perf_counter()
        pinned = {k: torch.empty_like(v, pin_memory=device.type == "cuda") for k, v in cpu.items()}
        ph["pin_alloc_s"] = time.perf_counter() - t
        t = time.perf_counter()
        for k, v in sd.items():
            pinned[k].copy_(v, non_blocking=True)
        _sync(device)
        ph["to_pinned_s"] = time.perf_counter() - t
        t = time.perf_counter()
        bf = {k: v.detach().to(torch.bfloat16) for k, v in sd.items()}
        _sync(device)
        ph["cast_bf16_on_device_s"] = time.perf_counter() - t
        t = time.perf_counter()
        {k: v.to("cpu") for k, v in bf.items()}
        ph["bf16_to_cpu_s"] = time.perf_counter() - t
        del bf
        t = time.perf_counter()
        name = weights_shm.write_segment(weights_shm.run_prefix(tmp), 1, sd) if weights_shm.available() else ""
        ph["write_segment_s"] = time.perf_counter() - t
        t = time.perf_counter()
        policy.save_hf(tmp / "disk_copy", tokenizer_from=tokenizer_from)
        ph["save_hf_s"] = time.perf_counter() - t

        # The server's install of that segment, alone (nothing else running in this process meanwhile).
        if name:
            t = time.perf_counter()
            _, seg = weights_shm.read_segment(name)
            ph["read_segment_here_s"] = time.perf_counter() - t
            t = time.perf_counter()
            for v in seg.values():
                torch.isfinite(v).all()
            ph["isfinite_cpu_here_s"] = time.perf_counter() - t  # the servers' earlier check
            from inference_server.engine_types import check_finite
            t = time.perf_counter()
            check_finite(seg)
            ph["check_finite_cpu_here_s"] = time.perf_counter() - t  # theirs now (one min/max pass)
            del seg
            server, addr = _start_server(serve_dir, tmp)
            try:
                stub = inference_pb2_grpc.InferenceServiceStub(rpc.sync_channel(addr, cfg.inference.auth_token, 512 << 20))
                for v, key in ((1, "server_install_shm_s"), (2, "server_install_shm_again_s")):
                    if v == 2:
                        weights_shm.unlink(name)
                        name = weights_shm.write_segment(weights_shm.run_prefix(tmp), 2, sd)
                    t = time.perf_counter()
                    r = stub.UpdateWeights(inference_pb2.UpdateWeightsRequest(version=v, shm=name), timeout=300)
                    ph[key] = time.perf_counter() - t
                    ph[key[:-2] + "_reply"] = str(r).replace("\n", " ")[:300]
                ph["server_installs"] = [ln[ln.index("weights v"):] for ln in server.spec.log.read_text().splitlines()
                                         if "installed in" in ln]
            finally:
                server.stop()
                weights_shm.unlink(name)
        out["publish_phases"] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in ph.items()}
        print(json.dumps(out["publish_phases"]), flush=True)
    pathlib.Path(out_path).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    a = [x for x in sys.argv[1:] if not x.startswith("--")]
    wh = tuple(int(x) for x in a[3].split("x")) if len(a) > 3 else (640, 400)
    main(a[0], a[1], int(a[2]) if len(a) > 2 else 2, wh)
