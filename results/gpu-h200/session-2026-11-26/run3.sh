#!/usr/bin/env bash
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1
S=$(date +%s); step() { echo; echo "=== $1 (t=$(( $(date +%s) - S ))s)"; }
step machine
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
step "CUDA tests of the vectorized engine"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_vectorized.py -k "cuda" 2>&1 | tail -15
step "FedAvg vs FedPM, graphed and eager solves, alternated"
timeout 110 python3 .gpuprof/ratio.py 2 | tee "$OUT/ratio.txt" || echo "ratio rc=$?"
step "bench_dnn cnn, paper's 5 local epochs"
timeout 120 python3 -m validation.bench_dnn --device cuda --json --models cnn --sizes 10,5000,5,2 --repeats 1 > "$OUT/bench_dnn_cuda_cnn.json" || echo "bench rc=$?"
cat "$OUT/bench_dnn_cuda_cnn.json"; echo
step "profile"
timeout 60 python3 .gpuprof/profile_round.py 5000 > "$OUT/profile.txt" 2>&1 || echo "profile rc=$?"
grep -n "==\|launches\|Self CPU time total\|Self CUDA time total" "$OUT/profile.txt"
step done
