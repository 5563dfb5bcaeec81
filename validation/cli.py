"""The ``fedpm`` command: each tool of the toolkit as a subcommand, the same as its ``python -m`` form.

fedpm superlinear --dataset w8a       # = python -m validation.superlinear --dataset w8a
fedpm dnn --help                      # = python -m validation.dnn --help
"""

from __future__ import annotations

import runpy
import sys

# subcommand -> (the module ``python -m`` runs, what it does); nothing is imported before a subcommand is chosen
COMMANDS = {
    "superlinear": ("validation.superlinear", "Test 1: superlinear convergence on w8a / a9a"),
    "dnn": ("validation.dnn", "Test 2: federated DNN training (CIFAR-10/100, FEMNIST)"),
    "flower": ("validation.flower", "any method on Flower: simulation or a deployment; prepare, keys"),
    "experiments": ("validation.experiments", "the runs behind the figures, per profile (budgeted, resumable)"),
    "figures": ("figures", "every figure and table of the paper from saved runs"),
    "bench-convex": ("validation.bench_convex", "FedPM rounds on w8a: seconds per round and to 1e-9"),
    "bench-dnn": ("validation.bench_dnn", "the DNN engines' throughput and FedPM / FedAvg round time"),
    "splits": ("validation.splits", "how heterogeneous a seed's Dirichlet split is"),
}
PROG = "fedpm"


def usage() -> str:
    listed = "\n".join(f"  {name:13s} {what}" for name, (_, what) in COMMANDS.items())
    return (
        f"usage: {PROG} COMMAND [FLAGS]   ({PROG} COMMAND --help: the command's flags; {PROG} --version)\n\n"
        f"FedPM toolkit: each command is also `python -m MODULE`.\n\ncommands:\n{listed}\n"
    )


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        sys.stdout.write(usage())
        return 0
    if argv[:1] in (["-V"], ["--version"]):
        from validation.common import toolkit_version

        sys.stdout.write(f"{PROG} {toolkit_version()}\n")
        return 0
    if not argv or argv[0] not in COMMANDS:
        given = f"unknown command {argv[0]!r}" if argv else "no command given"
        sys.stderr.write(f"{PROG}: error: {given}; choose one of {', '.join(COMMANDS)} ({PROG} --help)\n")
        return 2
    module = COMMANDS[argv[0]][0]
    sys.argv = [module, *argv[1:]]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)  # exactly what python -m MODULE does
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) or exc.code is None else _message(exc.code)
    return 0


def _message(text) -> int:
    sys.stderr.write(f"{text}\n")
    return 1


if __name__ == "__main__":
    sys.exit(main())
