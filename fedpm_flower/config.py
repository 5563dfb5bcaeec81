"""Run configuration shared by the ServerApp, the ClientApp and the launcher.

In deployment the values arrive as Flower run config (``flwr run --run-config``); in
simulation the apps are built with them directly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


def progress_file(out: str) -> str:
    """Where the ServerApp shows it is alive (its mtime) and how many rounds it has done (its text), both kept by
    fedpm_flower.apps.Heartbeat: beside its result ``out``, named to be cleaned with the other .tmp files there."""
    return out + ".progress.tmp"


def rounds_done(out: str) -> int:
    """The rounds the ServerApp writing ``out`` has done so far, from its progress file: 0 before the first (the
    file absent or still empty).  The file is replaced whole, so a reader never sees half a number."""
    try:
        with open(progress_file(out)) as fh:
            text = fh.read(32).strip()
    except OSError:
        return 0
    return int(text) if text.isdigit() else 0


class RoundsWatch:
    """``watch()`` in a launcher's wait loop calls ``on_rounds(done)`` each time the count of rounds done of the
    ServerApp writing ``out`` grows (fedpm_flower.deploy in deployment, validation.flower in simulation)."""

    def __init__(self, out: str, on_rounds=None):
        self.out, self.on_rounds, self.seen = out, on_rounds, 0

    def __call__(self) -> None:
        done = rounds_done(self.out) if self.out else 0
        if self.on_rounds is not None and done > self.seen:
            self.on_rounds(done)
        self.seen = max(self.seen, done)


@dataclass(frozen=True)
class FlowerRunConfig:
    problem: str = "logreg"  # logreg
    method: str = "fedpm"  # any registered fedconvex method (logreg), any registered fedpm_dnn method (cnn)
    params: str = ""  # more hyper-parameters of the method, a JSON object, e.g. '{"compressor": "topk", "k": 50}'
    participants: int = 0  # clients sampled per round (0: all)
    weighting: str = "uniform"  # client weights: uniform (1/N) | samples (M_i / M)
    dataset: str = "a9a"  # logreg: bundled name or LibSVM path; cnn: what it trains on (recorded, not read)
    data_dir: str = ""  # cnn: a prepared data set (fedpm_flower.prepared) instead of the synthetic task
    clients: int = 3
    rounds: int = 2
    lr: float = 1.0
    local_steps: int = 1
    lam: float = 1e-3
    seed: int = 0
    precond_dtype: str = "float64"  # how preconditioners travel: float64 | float32 | float16
    precond_codec: str = "none"  # or a codec of fedconvex.codecs (delta: the estimates live on the nodes)
    timeout: float = 120.0  # seconds the server waits for replies in a round
    max_ratio: float = 1000.0  # magnitude guard: reject a reply whose preconditioner trace or
    # parameter norm exceeds this x the round's median (0 = off)
    out: str = ""  # where the ServerApp writes its result JSON

    def to_run_config(self) -> dict:
        return asdict(self)

    @classmethod
    def from_mapping(cls, values) -> FlowerRunConfig:
        kw = {}
        for f in fields(cls):
            if f.name in values:
                kw[f.name] = type(f.default)(values[f.name])
        return cls(**kw)
