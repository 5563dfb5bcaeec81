"""Stacked SimpleCNN convolutions, per-client loop vs grouped: forward + weight, bias and input gradients
(10 clients x 64 images), best of 3 x 10 at 1 and 2 torch threads.  python benchmarks/stacked_conv_forms.py"""

import time

import torch
import torch.nn as nn

from fedpm_dnn.stacked import _conv_grouped, _conv_loop

torch.manual_seed(0)
K, B = 10, 64
for th in (1, 2):
    torch.set_num_threads(th)
    for cin, cout, hw in ((3, 6, 32), (6, 16, 14)):
        m = nn.Conv2d(cin, cout, 5)
        W = torch.randn(K, cout, cin, 5, 5, requires_grad=True)
        b = torch.randn(K, cout, requires_grad=True)
        x = torch.randn(K * B, cin, hw, hw, requires_grad=True)
        res = {}
        for _rep in range(3):
            for fn in (_conv_loop, _conv_grouped):
                t = time.perf_counter()
                for _ in range(10):
                    out = fn(m, W, b, K, x)
                    torch.autograd.grad(out.sum(), [W, b, x])
                res.setdefault(fn.__name__, []).append((time.perf_counter() - t) / 10 * 1e3)
        print(th, "threads", (cin, cout, hw), {k: round(min(v), 2) for k, v in res.items()}, "ms per fwd+bwd(W,b,x)")
