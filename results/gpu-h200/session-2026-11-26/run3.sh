#!/usr/bin/env bash
# call2: the FOOF solves replayed as a CUDA graph
source "$(dirname "$0")/checks.sh"
cuda_tests 120
ratio 2 110
bench cnn 10,5000,5,2 120
profile 60
step done
