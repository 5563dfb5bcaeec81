#!/usr/bin/env bash
# call1: main at aa73f44 (eager solves).  Its ratio step ran an earlier ratio.py that timed FedAvg and FedPM
# only (3 repeats); the ratio.py here also times FedPM with eager solves.
source "$(dirname "$0")/checks.sh"
bench cnn 10,5000,5,2 150
ratio 3 100
profile 90
bench resnet18gn 10,200,1,2 80
cupy 60 100
step done
