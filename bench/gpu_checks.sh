#!/usr/bin/env bash
# The GPU checks in one command, on a machine with a CUDA GPU, torch's CUDA build and rankwatch's
# dependencies importable by python3 (run from the project's root):
#   bash bench/gpu_checks.sh OUTDIR
# Each check's whole output goes to a log in OUTDIR; a line per check is printed as it ends:
# - the CUDA tests (pytest -m cuda);
# - a live GPT-2 job on the GPU with a loss spike, its collector finding it and rolling it back
#   (OUTDIR/live.duckdb is its store; steps, commands and the analysis are printed);
# - bench/gpu.py (the agent's cost and its view of a step against the profiler's);
# - bench/checkpoint.py --device cuda (training time with checkpoints, against none);
# - bench/gil.py (the training thread's wait for the GIL while spans are encoded).
set -u
out=${1:?usage: bash bench/gpu_checks.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
since() { echo "$(($(date +%s) - t0)) s"; }
python3 -c "import torch; print('GPU:', torch.cuda.get_device_name(0), '| torch', torch.__version__)"

timeout "${CUDA_TESTS_S:-240}" python3 -m pytest -m cuda -q -p no:cacheprovider -rA tests/ >"$out/cuda-tests.log" 2>&1
echo "cuda tests: exit $? after $(since): $(tail -1 "$out/cuda-tests.log")"

live=$(mktemp -d)
export RANKWATCH_DB=$live/rankwatch.duckdb
python3 -m rankwatch collector --port 4318 --analyze-every 1 >"$out/live-collector.log" 2>&1 &
collector=$!
for _ in $(seq 100); do
  python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:4318/healthz', timeout=1)" 2>/dev/null && break
  sleep 0.3
done
timeout "${LIVE_S:-150}" python3 -m rankwatch train --nproc 1 --steps "${LIVE_STEPS:-300}" --model gpt2 \
  --inject spike:at=200,scale=50 --collector http://127.0.0.1:4318 --run gpu-live --device cuda >"$out/live-train.log" 2>&1
echo "live job: exit $? after $(since)"
sleep 2
kill -INT $collector
wait $collector
cp "$RANKWATCH_DB" "$out/live.duckdb"
python3 -m rankwatch query "SELECT count(*) AS steps, round(median(duration_s) * 1e3, 2) AS step_ms,
  round(max(duration_s) * 1e3, 1) AS max_ms, round(median(compute_s) * 1e3, 2) AS compute_ms,
  round(median(comm_wait_s) * 1e3, 3) AS wait_ms FROM steps WHERE run_id = 'gpu-live' AND step >= 3"
python3 -m rankwatch query "SELECT kind, state, args->>'$.anomaly' AS anomaly, result FROM commands WHERE run_id = 'gpu-live'"
python3 -m rankwatch analyze gpu-live >"$out/live-analyze.txt" 2>&1
unset RANKWATCH_DB

timeout "${BENCH_GPU_S:-150}" python3 bench/gpu.py --rounds "${ROUNDS:-4}" --steps 30 --profile-steps 8 >"$out/bench-gpu.log" 2>&1
echo "bench/gpu.py: exit $? after $(since)"
timeout "${BENCH_CKPT_S:-200}" python3 bench/checkpoint.py --device cuda --steps 30 >"$out/bench-checkpoint.log" 2>&1
echo "bench/checkpoint.py --device cuda: exit $? after $(since)"
python3 bench/gil.py --rounds 4 >"$out/bench-gil.log" 2>&1
echo "bench/gil.py: exit $? after $(since)"
