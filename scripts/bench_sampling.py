"""The local engine's per-step sampling cost, before and after sampling moved to the logits' device (issue 21).

    python scripts/bench_sampling.py [--batch 64] [--vocab 151936] [--steps 10] [--threads 1] [--before-rev REV]
                                     [--device cpu|cuda]

What one decode step costs between the model's logits and the token ids the scheduler hands out, at `batch` rows x
`vocab` (Qwen's 151936 by default):
  before  the scheduler's old call: logits.float().cpu() -> the sampler of git revision REV (default main; the
          file is read with `git show`) -> .tolist()
  after   this tree's: sample(logits) where they are -> tok.cpu() / lp.cpu() ([B] each) -> .tolist()
for the actors' sampling (temperature 1, no truncation), and for seeded requests with temperature 0.7, top-k 40 and
top-p 0.95. Rounds alternate before / after, the figure is the median step time of each and their ratio. On the CPU
the two give the same tokens (checked here each step). A benchmark to run by hand, not a test.
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from inference_server import sampling as after  # noqa: E402


def load_before(rev: str):
    src = subprocess.run(["git", "show", f"{rev}:inference_server/sampling.py"], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    path = pathlib.Path(tempfile.mkdtemp(prefix="tars-sampling-")) / "sampling_before.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("sampling_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sampling_before"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per round (3 rounds each way)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (inference.threads, default 1)")
    ap.add_argument("--before-rev", default="main", help="git revision whose sampler is 'before'")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    before = load_before(a.before_rev)
    B, V = a.batch, a.vocab
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(0)).mul_(3).to(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    cases = {"T=1": ([1.0] * B, [1.0] * B, [0] * B, False),
             "T=0.7 top-k 40 top-p 0.95 seeded": ([0.7] * B, [0.95] * B, [40] * B, True)}
    print(f"batch {B} x vocab {V}, {a.threads} thread(s), device {dev}, before = {a.before_rev}")
    for name, (t, p, k, seeded) in cases.items():
        gens = lambda d: [torch.Generator(d).manual_seed(i + 1) for i in range(B)] if seeded else [None] * B  # noqa: E731

        def step_before(g):
            rp = before.RowParams.build(t, p, k, g[0])
            tok, lp = before.sample(logits.float().cpu(), rp, g[1])
            return tok.tolist(), lp.tolist()

        def step_after(g):
            rp = after.RowParams.build(t, p, k, g[0], dev)
            tok, lp = after.sample(logits, rp, g[1])
            return tok.cpu().tolist(), lp.cpu().tolist()

        g_b = (gens("cpu"), torch.Generator().manual_seed(0))
        g_a = (gens(dev), torch.Generator(dev).manual_seed(0))
        times = {"before": [], "after": []}
        for _ in range(3):
            for label, fn, g in (("before", step_before, g_b), ("after", step_after, g_a)):
                fn(g)  # warm-up
                for _ in range(a.steps):
                    sync()
                    t0 = time.perf_counter()
                    out = fn(g)
                    sync()
                    times[label].append(time.perf_counter() - t0)
                if label == "before":
                    ref = out
                elif dev.type == "cpu":
                    assert out == ref, "the CPU draws differ from the sampler before"
        mb, ma = statistics.median(times["before"]) * 1e3, statistics.median(times["after"]) * 1e3
        print(f"{name:36s} before {mb:7.1f} ms/step   after {ma:7.1f} ms/step   before/after {mb / ma:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
