#!/usr/bin/env bash
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1
S=$(date +%s); step() { echo; echo "=== $1 (t=$(( $(date +%s) - S ))s)"; }
step machine
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import sys, numpy, torch; print(sys.version.split()[0], numpy.__version__, torch.__version__)"
step "bench_dnn cnn, paper's 5 local epochs"
timeout 150 python3 -m validation.bench_dnn --device cuda --json --models cnn --sizes 10,5000,5,2 --repeats 1 > "$OUT/bench_dnn_cuda_cnn.json" || echo "bench rc=$?"
cat "$OUT/bench_dnn_cuda_cnn.json"; echo
step "vectorized FedAvg vs FedPM, alternated"
timeout 100 python3 .gpuprof/ratio.py 3 | tee "$OUT/ratio.txt" || echo "ratio rc=$?"
step "profile"
timeout 90 python3 .gpuprof/profile_round.py 5000 > "$OUT/profile.txt" 2>&1 || echo "profile rc=$?"
head -c 6000 "$OUT/profile.txt"
step "bench_dnn resnet18gn"
timeout 80 python3 -m validation.bench_dnn --device cuda --json --models resnet18gn --sizes 10,200,1,2 --repeats 1 > "$OUT/bench_dnn_cuda_resnet.json" || echo "resnet rc=$?"
cat "$OUT/bench_dnn_cuda_resnet.json"; echo
step "cupy tests"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_every_method.py tests/test_generic_backend.py -k "cupy or backend" 2>&1 | tail -5
step "bench_convex cupy"
timeout 100 python3 -m validation.bench_convex --backend cupy --all-methods --json > "$OUT/bench_convex_cupy.json" || echo "bench_convex cupy rc=$?"
head -c 1500 "$OUT/bench_convex_cupy.json"; echo
step done
