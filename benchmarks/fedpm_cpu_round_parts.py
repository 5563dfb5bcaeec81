"""Where a CPU FedPM round's extra time over FedAvg goes, per client, at bench_dnn's CPU size (300 images,
5 local epochs of batch 64 = 25 steps, SimpleCNN), measured piece by piece (min of repeats):

    python benchmarks/fedpm_cpu_round_parts.py [threads]

Prints a training step (forward, backward, SGD update: FedAvg's whole step), the per-step FOOF preconditioning
(the paper's eq. foof_local: two triangular solves per block), the end-of-round FOOF pass over the client's
data (its forward pass and each block's Gram; conv1's is cached, it reads the data only) and the ratio
(FedAvg + FedPM's extra) / FedAvg these pieces imply, with and without the Grams."""

import sys

import torch

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
from fedpm_dnn import foof  # noqa: E402
from fedpm_dnn.models import SimpleCNN  # noqa: E402
from validation.timing import best_seconds  # noqa: E402

torch.manual_seed(0)
IMAGES, EPOCHS, BATCH = 300, 5, 64
steps = EPOCHS * -(-IMAGES // BATCH)
m = SimpleCNN()
blocks = foof.foof_blocks(m)
x = torch.randn(IMAGES, 3, 32, 32)
y = torch.randint(0, 10, (IMAGES,))
acts = {}
hooks = [
    b.module.register_forward_pre_hook(lambda mod, inp, n=n: acts.__setitem__(n, inp[0].detach()))
    for n, b in blocks.items()
]
with torch.no_grad():
    m(x)
for h in hooks:
    h.remove()


def ms(f, reps=10):
    return best_seconds(f, reps) * 1e3


opt = torch.optim.SGD(m.parameters(), lr=0.01)
xb, yb = x[:BATCH], y[:BATCH]


def step():
    opt.zero_grad()
    torch.nn.functional.cross_entropy(m(xb), yb).backward()
    opt.step()


train = ms(step, 30) * steps
factors = foof.with_uppers(foof.factorize(foof.compute_foof(m, blocks, [x]), 1.0, torch.float32))
opt.zero_grad()
torch.nn.functional.cross_entropy(m(xb), yb).backward()
precond = ms(lambda: foof.precondition_grads(m, blocks, factors), 30) * steps
with torch.no_grad():
    forward = ms(lambda: m(x))
grams = {n: ms(lambda: b.gram(acts[n])) for n, b in blocks.items() if n != "conv1"}
print(f"torch threads {torch.get_num_threads()}; per client round ({steps} steps of {BATCH}, {IMAGES} images):")
print(f"  FedAvg local training          {train:7.1f} ms")
print(f"  FedPM preconditioning          {precond:7.1f} ms  ({precond / steps:.2f} ms a step)")
print(f"  FedPM FOOF pass: forward       {forward:7.1f} ms")
for n, v in grams.items():
    print(f"  FedPM FOOF pass: {n} Gram {'':<{9 - len(n)}} {v:7.1f} ms")
base = train + precond + forward
print(f"  implied FedPM/FedAvg: {(base + sum(grams.values())) / train:.2f}; without any Gram {base / train:.2f}")
