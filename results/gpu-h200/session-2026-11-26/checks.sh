#!/usr/bin/env bash
# The steps this session's three device calls ran, each once (sourced by run2.sh, run3.sh, run4.sh, which
# list a call's steps and their time limits).  Run from the repository root: OUT=DIR bash <this dir>/runN.sh
set -u
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1
S=$(date +%s); step() { echo; echo "=== $1 (t=$(( $(date +%s) - S ))s)"; }
step machine
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import sys, numpy, torch; print(sys.version.split()[0], numpy.__version__, torch.__version__)"

cuda_tests() {   # LIMIT
    step "CUDA tests of the vectorized engine"
    timeout "$1" python3 -m pytest -q -p no:cacheprovider tests/test_vectorized.py -k "cuda" 2>&1 | tail -15
}
ratio() {        # REPEATS LIMIT: vectorized FedAvg vs FedPM (CUDA graph and eager solves), alternated
    step "FedAvg vs FedPM, alternated"
    timeout "$2" python3 "$HERE/ratio.py" "$1" | tee "$OUT/ratio.txt" || echo "ratio rc=$?"
}
bench() {        # MODEL SIZES LIMIT
    step "bench_dnn $1 --sizes $2"
    timeout "$3" python3 -m validation.bench_dnn --device cuda --json --models "$1" --sizes "$2" --repeats 1 \
        > "$OUT/bench_dnn_cuda_$1.json" || echo "bench $1 rc=$?"
    cat "$OUT/bench_dnn_cuda_$1.json"; echo
}
profile() {      # LIMIT
    step "profile"
    timeout "$1" python3 "$HERE/profile_round.py" 5000 > "$OUT/profile.txt" 2>&1 || echo "profile rc=$?"
    grep -n "==\|launches\|Self CPU time total\|Self CUDA time total" "$OUT/profile.txt"
}
cupy() {         # TEST_LIMIT BENCH_LIMIT
    step "cupy tests"
    timeout "$1" python3 -m pytest -q -p no:cacheprovider tests/test_every_method.py tests/test_generic_backend.py \
        -k "cupy or backend" 2>&1 | tail -5
    step "bench_convex cupy"
    timeout "$2" python3 -m validation.bench_convex --backend cupy --all-methods --json > "$OUT/bench_convex_cupy.json" \
        || echo "bench_convex cupy rc=$?"
    head -c 1500 "$OUT/bench_convex_cupy.json"; echo
}
