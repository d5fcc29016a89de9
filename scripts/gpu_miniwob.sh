#!/usr/bin/env bash
# The miniwob preset with screenshots as images, on a machine with a CUDA GPU (docs/benchmarks.md, "MiniWoB++ with
# screenshots on a GPU"). From the repository root, with tars's dependencies importable by $PYTHON (default:
# .venv/bin/python where the README's setup made it, else python3) and MiniWoB's host programs installed (Debian's
# chromium and chromium-driver, socat, bubblewrap; `bash scripts/offline_bundle.sh` packs them for a host without
# network):
#
#     bash scripts/gpu_miniwob.sh OUTDIR SECONDS [--set KEY=VALUE ...]
#
# 1. a browser check: headless Chromium renders a page to a PNG (OUTDIR/chromium.png);
# 2. a fresh Qwen2.5-VL checkpoint, random weights (scripts/make_vl_bench_model.py --size small, ~30 M parameters);
# 3. `tars up --preset miniwob` with that checkpoint and screenshots as images: the SFT warm start on the oracle's
#    text demonstrations, RL on screenshots (every screenshot of the episode in the prompt: actor.image_history=-1,
#    coordinates as the checkpoint's family means them), held-out evaluation of both policies with screenshots. The
#    extra --set arguments follow the preset's (the budget's cuts). SIGTERM at SECONDS: `tars up` stops in order and
#    writes its report.
# OUTDIR gets summary.txt, up.log, the run's report.json, summary.md, held-out summary and learning curve, and run.tgz
# (its episodes, learner steps, logs, held-out episodes and the GPU's load every 5 s).
set -u
out=${1:?usage: bash scripts/gpu_miniwob.sh OUTDIR SECONDS [--set KEY=VALUE ...]}
budget=${2:?usage: bash scripts/gpu_miniwob.sh OUTDIR SECONDS [--set KEY=VALUE ...]}
shift 2
if [[ -n ${PYTHON:-} ]]; then py=$PYTHON; elif [[ -x .venv/bin/python ]]; then py=.venv/bin/python; else py=python3; fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$out"
start=$(date +%s)
work=$(mktemp -d)
say() { echo "$*" | tee -a "$out/summary.txt"; }

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$py" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
            "available", torch.cuda.is_available(), "transformers", transformers.__version__)'
  echo "cores $(nproc)"; chromium --version; } 2>&1 | tee -a "$out/summary.txt"

timeout 60 chromium --headless --no-sandbox --disable-gpu --window-size=400,300 --screenshot="$out/chromium.png" \
    'data:text/html,<h1>tars</h1><button>Submit</button>' >"$work/chromium.log" 2>&1
rc=$?
say "chromium screenshot rc=$rc $(stat -c %s "$out/chromium.png" 2>/dev/null || echo no) bytes"
if (( rc != 0 )); then tail -n 20 "$work/chromium.log"; exit 1; fi

vl=$work/vl
t0=$(date +%s)
if ! "$py" scripts/make_vl_bench_model.py "$vl" --size small >"$work/make_vl.log" 2>&1; then
  tail -n 20 "$work/make_vl.log"
  exit 1
fi
say "checkpoint $(( $(date +%s) - t0 ))s: $(tail -n 1 "$work/make_vl.log")"

nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 5 >"$work/gpu.csv" 2>/dev/null &
smi=$!
left=$(( budget - ($(date +%s) - start) - 15 ))
say "tars up --preset miniwob with screenshots, SIGTERM after ${left}s: $*"
t0=$(date +%s)
timeout -s TERM -k 30 "$left" "$py" -m tars.cli up --preset miniwob --out "$work/run" --set "model.path=$vl" \
    --set actor.image_history=-1 --set actor.coordinates=auto --set actor.env_options.screenshots=1 "$@" \
    >"$out/up.log" 2>&1
say "tars up rc=$? $(( $(date +%s) - t0 ))s"
kill "$smi" 2>/dev/null
cp "$work/gpu.csv" "$work/run/" 2>/dev/null
for f in report.json summary.md heldout/summary.md; do
  [[ -f $work/run/$f ]] && cp "$work/run/$f" "$out/$(echo "$f" | tr / _)"
done
cp "$work"/run/*.png "$out/" 2>/dev/null
# the episodes, the learner's steps, the roles' logs and the held-out episodes, in one file
tar -C "$work/run" -czf "$out/run.tgz" --ignore-failed-read episodes.jsonl learner.jsonl trained.jsonl logs heldout \
    gpu.csv 2>/dev/null
tail -n 30 "$out/up.log"
say "total $(( $(date +%s) - start ))s"
