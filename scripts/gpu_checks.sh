#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (docs/benchmarks.md "On a GPU"). Run from the repository root on a
# machine with a CUDA GPU and tars's dependencies importable by $PYTHON (default: .venv/bin/python where the README's
# setup made it, else python3):
#
#     bash scripts/gpu_checks.sh OUTDIR [SECONDS] [STEPS]
#
# STEPS (optional): a comma-separated list of the step names below to run (the others are skipped), e.g.
# make_vl,bench_learner_vl.
#
# Steps, most important first, each under its own deadline (the whole run stays within SECONDS, default 540):
#   1. the tests marked gpu (`pytest -m gpu`: the learner's bf16 steps on CUDA publishing fp32 CPU weights, SFT on
#      CUDA, the engine sampling on the device, the publish's pinned host copy);
#   2. `tars bench inference --gpu`: the local engine against transformers' generate, batch 1 and 64;
#   3. `tars bench learner --model VLDIR`: a Qwen2.5-VL checkpoint (Qwen2-0.5B's text shape, Qwen2.5-VL's 32-layer
#      vision tower, random weights) trained on screenshots on the GPU and published to a real `tars serve` on it;
#   4. scripts/gpu_profile_learner.py on that checkpoint: the step's kernels and top operators, the publish phases;
#   5. `tars bench learner --quick`: the stream figures on this machine's cores and the quickstart model's publish
#      share with the learner on the GPU.
# OUTDIR gets summary.txt (one line per step with its exit status and seconds) and each step's log or JSON. The
# script's exit status is 1 when any step that ran failed (or ran out of its time), else 0.
set -u
out=${1:?usage: bash scripts/gpu_checks.sh OUTDIR [SECONDS] [STEPS]}
budget=${2:-540}
only=${3:-}
if [[ -n ${PYTHON:-} ]]; then py=$PYTHON; elif [[ -x .venv/bin/python ]]; then py=.venv/bin/python; else py=python3; fi
failed=0
mkdir -p "$out"
start=$(date +%s)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

step() {  # step NAME SECONDS COMMAND...: run within min(SECONDS, what is left of the budget); log to OUTDIR/NAME.log
  local name=$1 limit=$2 t0 rc left
  shift 2
  if [[ -n $only && ",$only," != *",$name,"* ]]; then echo "$name skipped: not in $only" >>"$out/summary.txt"; return; fi
  left=$(( budget - ($(date +%s) - start) ))
  if (( left < 20 )); then echo "$name skipped: budget spent" | tee -a "$out/summary.txt"; return; fi
  (( limit > left )) && limit=$left
  t0=$(date +%s)
  timeout -k 5 "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  (( rc != 0 )) && failed=1
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s (limit ${limit}s)" | tee -a "$out/summary.txt"
  tail -n 25 "$out/$name.log"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$py" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
            "available", torch.cuda.is_available(), "transformers", transformers.__version__)'
  nproc; } 2>&1 | tee "$out/summary.txt"

step pytest_gpu 150 "$py" -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_learner_device.py \
    tests/test_inference_precision.py tests/test_weights_shm.py
step bench_inference_gpu 150 "$py" -m tars.cli bench inference --gpu --skip-front --skip-updates --skip-multiturn \
    --json "$out/bench_inference_gpu.json"

vl=$(mktemp -d)/vl
step make_vl 120 "$py" scripts/make_vl_bench_model.py "$vl"
[ -f "$vl/config.json" ] && step bench_learner_vl 300 "$py" -m tars.cli bench learner --model "$vl" --n 200 \
    --repeats 1 --steps 2 --images 2 --image-size 640x400 --set learner.batch_size=8 \
    --json "$out/bench_learner_vl.json"
[ -f "$vl/config.json" ] && step profile_learner_vl 240 "$py" scripts/gpu_profile_learner.py "$vl" "$out/profile_learner_vl.json"
step bench_learner 120 "$py" -m tars.cli bench learner --quick --json "$out/bench_learner.json"
echo "total $(( $(date +%s) - start ))s" | tee -a "$out/summary.txt"
exit $failed
