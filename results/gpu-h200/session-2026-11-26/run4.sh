#!/usr/bin/env bash
# call3: as call2, the directions used as views
source "$(dirname "$0")/checks.sh"
cuda_tests 60
ratio 2 75
bench cnn 10,5000,5,2 80
bench resnet18gn 10,200,1,2 40
step done
