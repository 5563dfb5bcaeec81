"""The measurements behind foof.row_form_pays: the patch and row forms of the conv Gram over a grid of convs
(kernels 1-5, strides 1-3, 3-512 channels, 4-32 pixels, 4-64 images, 1 or 4 stacks) at 1 and 2 torch threads,
min of 4 alternating runs each; the patch form timed with the float64 cast its callers apply (the row form's
sums are float64 already).  Then the rule's two costs, chosen as the pair that gains most (sum of log speed-ups)
while no case it sends to the row form runs slower than 0.97 of the patch form at either thread count, and the
committed pair's choices.  python benchmarks/foof_conv_gram_rule.py"""

import math
import os
import time

import torch
import torch.nn as nn

from fedpm_dnn import foof

GEOMETRIES = [
    dict(kernel_size=1),
    dict(kernel_size=1, stride=2),
    dict(kernel_size=(1, 3), padding=(0, 1)),
    dict(kernel_size=2, stride=2),
    dict(kernel_size=3, stride=3),
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=3),
    dict(kernel_size=3, padding=1),
    dict(kernel_size=5),
    dict(kernel_size=5, stride=2),
    dict(kernel_size=(3, 1), padding=(1, 0)),
]
INPUTS = [
    (3, 32, 64, 1),
    (6, 14, 64, 1),
    (6, 14, 16, 4),
    (16, 16, 64, 1),
    (16, 5, 64, 1),
    (64, 32, 8, 1),
    (64, 16, 16, 1),
    (64, 16, 4, 4),
    (64, 4, 32, 1),
    (128, 16, 8, 1),
    (128, 8, 16, 1),
    (256, 8, 8, 1),
    (256, 8, 64, 1),
    (256, 4, 32, 1),
    (512, 4, 16, 1),
]  # (channels, height = width, images, stacks)
if os.environ.get("FEDPM_BENCH_TINY") == "1":  # a tiny run: one small input, two geometries
    INPUTS, GEOMETRIES = INPUTS[:1], GEOMETRIES[:2]
FLOAT64_COSTS = [50, 100, 150, 200, 250, 300, 400]
PRODUCT_COSTS = [0, 2e5, 5e5, 1e6, 1.5e6, 2e6, 3e6]


def patch_form(m, x):
    S, total, L = foof.patch_gram(m, x)
    return S.to(torch.float64), total.to(torch.float64), L


def measure(threads):
    torch.set_num_threads(threads)
    out = []
    for C, H, B, K in INPUTS:
        for g in GEOMETRIES:
            m, x = nn.Conv2d(C, 4, **g), torch.randn(K, B, C, H, H)
            if foof._out_size(H, m.kernel_size[0], m.stride[0], 1, m.padding[0]) < 1:
                continue  # the kernel is taller than the image
            times = {patch_form: [], foof.row_form_gram: []}
            for _ in range(4):
                for fn in times:
                    t = time.perf_counter()
                    fn(m, x)
                    times[fn].append(time.perf_counter() - t)
            old, new = min(times[patch_form]), min(times[foof.row_form_gram])
            out.append(dict(case=(C, H, B, K, g), old=old, new=new, feats=foof.row_form_costs(m, x.shape)))
            print(
                f"{threads} thr C={C} H={H} B={B} K={K} {g}: patch {old * 1e3:.2f} ms, row {new * 1e3:.2f} ms, "
                f"ratio {new / old:.2f}",
                flush=True,
            )
    return out


def picked(r, lam, mu):
    saved, float64_updates, products = r["feats"]
    return saved > lam * float64_updates + mu * products


def main():
    runs = {threads: measure(threads) for threads in (1, 2)}
    scores = []
    for lam in FLOAT64_COSTS:
        for mu in PRODUCT_COSTS:
            chosen = [r for rs in runs.values() for r in rs if picked(r, lam, mu)]
            worst = max([r["new"] / r["old"] for r in chosen], default=0.0)
            scores.append(
                (worst <= 0.97, sum(math.log(r["old"] / r["new"]) for r in chosen), lam, mu, len(chosen), worst)
            )
    scores.sort(key=lambda s: (s[0], s[1]), reverse=True)
    best = sum(max(0.0, math.log(r["old"] / r["new"])) for rs in runs.values() for r in rs)
    print(
        f"\nbest possible sum of log speed-ups {best:.1f}; top pairs (ok, score, float64 cost, product cost, "
        f"picks, worst):"
    )
    for s in scores[:6]:
        print("  ", s[0], round(s[1], 1), s[2], s[3], s[4], round(s[5], 2))
    lam, mu = foof.ROW_FORM_FLOAT64_COST, foof.ROW_FORM_PRODUCT_COST
    for threads, rs in runs.items():
        chosen = [r for r in rs if picked(r, lam, mu)]
        print(
            f"committed ({lam}, {mu:g}) at {threads} thread(s): {len(chosen)} of {len(rs)} cases to the row form, "
            f"worst ratio {max((r['new'] / r['old'] for r in chosen), default=0.0):.2f}; missed speed-ups: "
            f"{sorted(round(r['new'] / r['old'], 2) for r in rs if r not in chosen and r['new'] < 0.9 * r['old'])}"
        )


if __name__ == "__main__":
    main()
