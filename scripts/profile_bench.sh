#!/usr/bin/env bash
# Flame graphs (py-spy, SVG) of the processes behind the figures of docs/benchmarks.md (issue 26):
#
#   scripts/profile_bench.sh [WHAT ...]    WHAT: stream-wal stream-checkpoint grpc-front envd-miniwob soak (default: all)
#
# writes docs/img/flame-WHAT.svg (OUT=DIR to write elsewhere). Each attaches py-spy to one process once its load is
# in its steady state and records it for PROFILE_SECONDS (8; envd-miniwob PROFILE_SECONDS_ENVD, 20) at RATE (50) samples/s, without pausing it
# (--nonblocking), idle threads left out, samples merged per function (--function), so the SVGs stay small:
#   stream-wal, stream-checkpoint  the learner's receiver under tars/bench/stream.py's stream run (WAL or checkpoint
#                                  durability; the actor is a child process, not recorded)
#   grpc-front                     the inference server's process under the front bench's 64 concurrent calls (the
#                                  client is its own process, not recorded)
#   envd-miniwob                   the `tars envd` daemon stepping miniwob/click-checkboxes (tars/bench/envd.py)
#   soak-inference (WHAT=soak)     the inference process of a short `tars bench soak` (the quickstart topology)
# The loads are scripts/profile_bench.py's. Needs py-spy (pip install -e '.[dev]') and ptrace allowed; PYTHON
# (.venv/bin/python) and PYSPY (py-spy beside it) override the tools.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
PYSPY=${PYSPY:-$(dirname "$PYTHON")/py-spy}
OUT=${OUT:-docs/img}
RATE=${RATE:-50}
SECS=${PROFILE_SECONDS:-8}
ENVD_SECS=${PROFILE_SECONDS_ENVD:-20}  # the daemon is busy ~20 % of a step (Chromium is the rest): longer
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
[ -x "$PYSPY" ] || PYSPY=$(command -v py-spy) || { echo "py-spy not found (pip install -e '.[dev]')" >&2; exit 2; }

wait_for() {  # wait_for FILE SECONDS PID: until FILE is there; fails when PID ends first or the time is up
    local deadline=$((SECONDS + $2))
    until [ -s "$1" ]; do
        kill -0 "$3" 2>/dev/null || { echo "the load (pid $3) ended before $1 appeared" >&2; return 1; }
        [ "$SECONDS" -lt "$deadline" ] || { echo "no $1 after $2 s" >&2; return 1; }
        sleep 0.5
    done
}

spy() {  # spy NAME PID [SECONDS]
    "$PYSPY" record --rate "$RATE" --nonblocking --function --duration "${3:-$SECS}" -o "$OUT/flame-$1.svg" --pid "$2"
    echo "wrote $OUT/flame-$1.svg ($(du -k "$OUT/flame-$1.svg" | cut -f1) kB)"
}

profile() {  # profile NAME: scripts/profile_bench.py's load NAME, recorded once it has announced its pid
    local tmp pid rc=0 secs=$SECS
    [ "$1" != envd-miniwob ] || secs=$ENVD_SECS
    tmp=$(mktemp -d)
    "$PYTHON" scripts/profile_bench.py "$1" $((secs + 5)) "$tmp/pid" &
    pid=$!
    wait_for "$tmp/pid" 300 "$pid" && spy "$1" "$(cat "$tmp/pid")" "$secs" || rc=1
    wait "$pid" || rc=1
    rm -rf "$tmp"
    return $rc
}

profile_soak() {  # the inference process of `tars bench soak`, once the topology has run for a while
    local tmp pid ready rc=0
    tmp=$(mktemp -d)
    "$PYTHON" -m tars.cli bench soak --minutes 1.5 --every 3 --out "$tmp/run" > "$tmp/soak.log" 2>&1 &
    pid=$!
    ready="$tmp/run/run/inference.json"
    if wait_for "$ready" 300 "$pid"; then
        sleep 20  # past the start-up: the learner and the actor are running
        spy soak-inference "$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["pid"])' "$ready")" || rc=1
    else
        rc=1
    fi
    wait "$pid" || { echo "tars bench soak failed; its output ends:" >&2; tail -20 "$tmp/soak.log" >&2; }
    rm -rf "$tmp"
    return $rc
}

[ $# -gt 0 ] || set -- stream-wal stream-checkpoint grpc-front envd-miniwob soak
for w in "$@"; do
    case "$w" in
        stream-wal | stream-checkpoint | grpc-front | envd-miniwob) profile "$w" ;;
        soak) profile_soak ;;
        *) echo "unknown profile '$w' (stream-wal stream-checkpoint grpc-front envd-miniwob soak)" >&2; exit 2 ;;
    esac
done
