"""FOOF conv Gram on the CPU: the patch form (conv_gram before the row form; "+cast": with the float64 cast its
callers then apply) against conv_gram now (the row form where foof.row_form_pays, named in the last column),
for SimpleCNN's conv2 and two ResNet18-GN layers, at 1 and 2 torch threads, min of 15 runs of each, alternating
in one process.  python benchmarks/foof_conv_gram_forms.py"""

import time

import torch
import torch.nn as nn

from fedpm_dnn import foof

CASES = [
    ("SimpleCNN conv2, 300 images", nn.Conv2d(6, 16, 5), (1, 300, 6, 14, 14)),
    ("SimpleCNN conv2, 10 stacks of 30", nn.Conv2d(6, 16, 5), (10, 30, 6, 14, 14)),
    ("ResNet18-GN 64ch 32x32 pad 1, 16 images", nn.Conv2d(64, 64, 3, padding=1, bias=False), (1, 16, 64, 32, 32)),
    ("ResNet18-GN 256ch 8x8 pad 1, 16 images", nn.Conv2d(256, 256, 3, padding=1, bias=False), (1, 16, 256, 8, 8)),
    ("ResNet18-GN 256ch 8x8 pad 1, 64 images", nn.Conv2d(256, 256, 3, padding=1, bias=False), (1, 64, 256, 8, 8)),
]


def patch_cast(m, x):
    S, total, L = foof.patch_gram(m, x)
    return S.to(torch.float64), total.to(torch.float64), L


def main():
    torch.manual_seed(0)
    print(f"{'case':42s} thr  patch ms  +cast ms  now ms  speed-up (vs +cast)  form")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for name, m, shape in CASES:
            x = torch.randn(*shape).relu()
            runs = {foof.patch_gram: [], patch_cast: [], foof.conv_gram: []}
            for _ in range(15):
                for fn, times in runs.items():
                    t = time.perf_counter()
                    fn(m, x)
                    times.append(time.perf_counter() - t)
            old, cast, new = (min(t) * 1e3 for t in runs.values())
            form = "row" if foof.row_form_pays(m, shape) else "patch"
            print(
                f"{name:42s} {threads:3d} {old:9.2f} {cast:9.2f} {new:7.2f} {old / new:7.2f}x "
                f"({cast / new:.2f}x)    {form}",
                flush=True,
            )


if __name__ == "__main__":
    main()
