"""torch's general product against SciPy's symmetric rank-k update (ssyrk) for the FOOF Grams, alternated, best
of 5: at one torch thread (syrk on one BLAS thread, what fedpm_dnn.gram runs there) and at two (syrk on one and
on two BLAS threads, which fedpm_dnn.gram does not run: measured here to say why).  SimpleCNN's fc1 rows at
bench_dnn's size (300 x 401) and a 512-sample chunk; the patch form of ResNet18-GN's convolutions at 32
CIFAR-100 images (bench_dnn's CPU size), each distinct shape once.

    PYTHONPATH=. python results/cpu-bench-2026-11-26/session4/gram_forms.py"""
import torch
from scipy.linalg.blas import ssyrk

from fedpm_dnn import foof, gram, models
from validation.timing import best_seconds


def patches(m, x):
    """The patch rows of images x (one client), in the patch form's chunks."""
    D = m.weight[0].numel()
    step = foof._chunk(1, foof.conv_patches(m, x[:1]).shape[1], D)
    return [foof.conv_patches(m, x[i:i + step]).reshape(-1, D) for i in range(0, x.shape[0], step)]


def torch_gram(chunks):
    S = torch.zeros(chunks[0].shape[1], chunks[0].shape[1])
    for a in chunks:
        S.addmm_(a.T, a)
    return S


def syrk_gram(chunks, blas_threads):
    S = torch.zeros(chunks[0].shape[1], chunks[0].shape[1])
    with gram._controller().limit(limits=blas_threads):
        for a in chunks:
            ssyrk(1.0, a.numpy().T, beta=1.0, c=S.numpy().T, trans=0, lower=0, overwrite_c=1)
    return gram.mirror(S)


def timed(fns, reps=5):
    """best seconds of each fn, the fns alternated rep by rep"""
    out = [[] for _ in fns]
    for _ in range(reps):
        for t, f in zip(out, fns):
            t.append(best_seconds(f, 1))
    return [min(t) * 1e3 for t in out]


torch.manual_seed(0)
net = models.make_model("resnet18gn", 100)
blocks = foof.foof_blocks(net)
acts = {}
hooks = [b.module.register_forward_pre_hook(lambda mod, inp, n=n: acts.setdefault(n, inp[0].detach()))
         for n, b in blocks.items()]
with torch.no_grad():
    net(torch.randn(32, 3, 32, 32))
for h in hooks:
    h.remove()
cases, seen = [], set()
for n in (300, 512):
    cases.append((f"SimpleCNN fc1 rows {n} x 401", [torch.relu(torch.randn(n, 401))]))
for n, b in blocks.items():
    if isinstance(b, foof.Conv2dBlock):
        x = acts[n]
        key = (tuple(x.shape), tuple(b.module.weight.shape), b.module.stride)
        if key not in seen:
            seen.add(key)
            cases.append((f"ResNet18-GN {n} (D={b.module.weight[0].numel()})", patches(b.module, x)))

for threads in (1, 2):
    torch.set_num_threads(threads)
    blas = (1,) if threads == 1 else (1, 2)
    print(f"torch threads {threads}: torch product | syrk on {' | '.join(f'{t} BLAS thread(s)' for t in blas)}")
    total = [0.0] * (1 + len(blas))
    for name, chunks in cases:
        ms = timed([lambda: torch_gram(chunks)] + [lambda t=t: syrk_gram(chunks, t) for t in blas])
        total = [a + b for a, b in zip(total, ms)]
        print(f"  {name:44s} " + " | ".join(f"{v:8.1f} ms" for v in ms)
              + "   torch/syrk " + " ".join(f"{ms[0] / v:.2f}x" for v in ms[1:]))
    print("  all of them" + " " * 34 + " | ".join(f"{v:8.0f} ms" for v in total))
