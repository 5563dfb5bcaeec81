"""One training step of the vectorized engine's forms on the CPU against ten sequential-engine steps: SimpleCNN,
10 clients x 64 images, forward + backward (+ an SGD update of the stack), min of 15, three alternating rounds.

    python benchmarks/vectorized_step_forms.py [threads]
"""

import sys

import torch
import torch.nn.functional as F

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
from fedpm_dnn.models import SimpleCNN  # noqa: E402
from fedpm_dnn.stacked import StackedModel  # noqa: E402
from validation.timing import best_seconds  # noqa: E402

torch.manual_seed(0)
K, B = 10, 64
model = SimpleCNN()
names = [n for n, _ in model.named_parameters()]
P = {n: p.detach().unsqueeze(0).repeat(K, *([1] * p.dim())).contiguous() for n, p in model.named_parameters()}
stacked = StackedModel(model)
x = torch.randn(K, B, 3, 32, 32)
y = torch.randint(0, 10, (K * B,))


def vectorized_step(forward):
    def step():
        Pk = {n: P[n].detach().requires_grad_(True) for n in names}
        loss = F.cross_entropy(forward(Pk, x).reshape(K * B, -1), y, reduction="none").view(K, B).mean(1).sum()
        with torch.no_grad():
            for n, g in zip(names, torch.autograd.grad(loss, [Pk[n] for n in names]), strict=False):
                P[n].sub_(g, alpha=1e-3)

    return step


opt = torch.optim.SGD(model.parameters(), lr=1e-3)


def sequential_steps():
    for k in range(K):
        opt.zero_grad()
        F.cross_entropy(model(x[k]), y[k * B : (k + 1) * B]).backward()
        opt.step()


def ms(f, reps=15):
    return best_seconds(f, reps) * 1e3


for _ in range(3):
    print(
        f"torch threads {torch.get_num_threads()}: stacked {ms(vectorized_step(stacked)):.1f} ms   "
        f"per client {ms(vectorized_step(stacked.per_client)):.1f} ms   "
        f"10 sequential steps {ms(sequential_steps):.1f} ms"
    )
