#!/usr/bin/env bash
# The GPU checks in one command, on a machine with a CUDA GPU, torch's CUDA build and rankwatch's
# dependencies importable by python3 (run from the project's root):
#   bash bench/gpu_checks.sh OUTDIR [CHECK...]      (default: every check, in this order)
# Each check's whole output goes to a log in OUTDIR; a line per check is printed as it ends.
#   gpu         bench/gpu.py: the agent's cost (its own export, and through the node's sidecar) and its view
#               of a step against the profiler's
#   frameworks  bench/frameworks.py --cuda: the Hugging Face Trainer (GPT-2 124M), Lightning and a plain DDP
#               script, each alone and under `rankwatch run`, a rank per GPU
#   tests       the CUDA tests (pytest -m cuda)
#   live        a live GPT-2 job on the GPU with a loss spike, its collector finding it and rolling it
#               back (OUTDIR/live.duckdb is its store; its steps and commands are printed)
#   gil         bench/gil.py: the training thread's wait for the GIL while spans are encoded
#   checkpoint  bench/checkpoint.py --device cuda: training time with checkpoints, against none
set -u
out=${1:?usage: bash bench/gpu_checks.sh OUTDIR [gpu frameworks tests live gil checkpoint]}
shift
checks=${*:-gpu frameworks tests live gil checkpoint}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
done_() { echo "$1: exit $2 after $(($(date +%s) - t0)) s"; }

tests() {
  # the files with CUDA tests alone: the others may need what a GPU machine lacks (the dashboard's)
  timeout "${CUDA_TESTS_S:-240}" python3 -m pytest -m cuda -q -p no:cacheprovider -rA $(grep -l "mark.cuda" tests/*.py) \
    >"$out/cuda-tests.log" 2>&1
  done_ "cuda tests" $?
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$out/cuda-tests.log" | tail -20
}

live() {
  local store
  store=$(mktemp -d)/rankwatch.duckdb
  RANKWATCH_DB=$store python3 -m rankwatch collector --port 4318 --analyze-every 1 >"$out/live-collector.log" 2>&1 &
  local collector=$!
  for _ in $(seq 100); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:4318/healthz', timeout=1)" 2>/dev/null && break
    sleep 0.3
  done
  RANKWATCH_DB=$store timeout "${LIVE_S:-150}" python3 -m rankwatch train --nproc 1 --steps "${LIVE_STEPS:-300}" \
    --model gpt2 --inject spike:at=200,scale=50 --collector http://127.0.0.1:4318 --run gpu-live --device cuda \
    >"$out/live-train.log" 2>&1
  done_ "live job" $?
  sleep 2
  kill -INT $collector
  wait $collector
  cp "$store" "$out/live.duckdb"
  export RANKWATCH_DB=$store
  python3 -m rankwatch query "SELECT count(*) AS steps, round(median(duration_s) * 1e3, 2) AS step_ms,
    round(max(duration_s) * 1e3, 1) AS max_ms, arg_max(step, duration_s) AS slowest,
    round(median(compute_s) * 1e3, 2) AS compute_ms, round(median(comm_wait_s) * 1e3, 3) AS wait_ms
    FROM steps WHERE run_id = 'gpu-live' AND step >= 3"
  python3 -m rankwatch query "SELECT kind, state, args->>'$.anomaly' AS anomaly, result FROM commands
    WHERE run_id = 'gpu-live'"
  python3 -m rankwatch analyze gpu-live >"$out/live-analyze.txt" 2>&1
  unset RANKWATCH_DB
}

gpu() {
  timeout "${BENCH_GPU_S:-150}" python3 bench/gpu.py --rounds "${ROUNDS:-4}" --steps 30 --profile-steps 8 \
    >"$out/bench-gpu.log" 2>&1
  done_ "bench/gpu.py" $?
  tail -25 "$out/bench-gpu.log"
}

frameworks() {
  timeout "${BENCH_FRAMEWORKS_S:-240}" python3 bench/frameworks.py --cuda --rounds "${ROUNDS:-3}" --steps 30 \
    >"$out/bench-frameworks.log" 2>&1
  done_ "bench/frameworks.py --cuda" $?
  tail -6 "$out/bench-frameworks.log"
}

gil() {
  python3 bench/gil.py --rounds 4 >"$out/bench-gil.log" 2>&1
  done_ "bench/gil.py" $?
  cat "$out/bench-gil.log"
}

checkpoint() {
  timeout "${BENCH_CKPT_S:-240}" python3 bench/checkpoint.py --device cuda --steps 30 >"$out/bench-checkpoint.log" 2>&1
  done_ "bench/checkpoint.py --device cuda" $?
  tail -25 "$out/bench-checkpoint.log"
}

python3 -c "import torch; print('GPU:', torch.cuda.get_device_name(0), '| torch', torch.__version__)"
for check in $checks; do
  "$check"
done
