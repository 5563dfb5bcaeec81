"""The FOOF statistics Gram of every ResNet18-GN and SimpleCNN block in each of its forms on one device: the full
patch form, the patch form with half products (``precision.half_gram``) and, for a convolution, the row form with
half products; the form ``foof.conv_gram_form`` picks on CUDA beside the fastest, so that the unmeasured estimates
behind the CUDA rule (``foof.ROW_FORM_LAUNCH_COST_CUDA``) can be checked.  Milliseconds per call for a stack of
``--clients`` clients' ``--images`` images (the statistics chunk: 512), after one warm-up call; the least of
``--repeats``.

    python benchmarks/foof_gram_forms.py --device cuda [--precision fp32,split-tf32] [--clients 10] [--images 512]
    python benchmarks/foof_gram_forms.py --device cpu --clients 1 --images 4     # the tiny run of the tests"""

from __future__ import annotations

import os
import time

import torch

from fedpm_dnn import foof
from fedpm_dnn.foof import precision
from fedpm_dnn.models import make_model
from validation.common import OneLineParser

TINY = os.environ.get("FEDPM_BENCH_TINY") == "1"


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeats) -> float:
    fn()  # warm-up: kernels chosen, memory reserved
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def block_inputs(model, image_size) -> dict:
    """name -> (block, the (C, H, W) or (d,) shape of its input for one image)."""
    blocks = foof.foof_blocks(model)
    shapes, handles = {}, []
    for name, b in blocks.items():
        handles.append(b.module.register_forward_pre_hook(lambda m, inp, name=name: shapes.setdefault(name, inp[0])))
    with torch.no_grad():
        model(torch.zeros(1, 3, image_size, image_size))
    for h in handles:
        h.remove()
    return {name: (blocks[name], tuple(shapes[name].shape[1:])) for name in blocks}


def forms(block, x):
    """{form: callable} of the block's Gram on x (K, B, ...)."""
    if isinstance(block, foof.Conv2dBlock):
        m = block.module
        return {
            "patch": lambda: foof.patch_gram(m, x),
            "patch-half": lambda: foof.patch_gram(m, x, half=True),
            "row-half": lambda: foof.row_form_gram(m, x, half=True),
        }
    a = x.reshape(x.shape[0], -1, x.shape[-1])
    return {"patch": lambda: precision.gram(a), "patch-half": lambda: precision.gram(a, half=True)}


def main(argv=None) -> int:
    p = OneLineParser(prog="python benchmarks/foof_gram_forms.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", default="resnet18gn,cnn")
    p.add_argument("--precision", default="fp32,split-tf32")
    p.add_argument("--clients", type=int, default=1 if TINY else 10)
    p.add_argument("--images", type=int, default=4 if TINY else 512)
    p.add_argument("--repeats", type=int, default=1 if TINY else 3)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible to torch")
    modes = [precision.check(m) for m in args.precision.split(",")]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device {name}; {args.clients} clients x {args.images} images; the least of {args.repeats} (ms)")
    for model_name in args.models.split(","):
        model = make_model(model_name, 100 if model_name == "resnet18gn" else 10, 3, 32)
        inputs = block_inputs(model, 32)
        model.to(device)
        for bname, (block, shape) in inputs.items():
            g = torch.Generator().manual_seed(0)
            x = torch.rand(args.clients, args.images, *shape, generator=g).to(device)
            for mode in modes:
                with precision.use(mode):
                    ms = {f: timed(fn, device, args.repeats) for f, fn in forms(block, x).items()}
                picked = "patch-half"  # CUDA's choice: half products, the row form where its rule says
                if isinstance(block, foof.Conv2dBlock):
                    picked = foof.conv_gram_form(block.module, x.shape, "cuda", mode)[0] + "-half"
                fastest = min(ms, key=ms.get)
                times = ", ".join(f"{f} {t:.2f}" for f, t in ms.items())
                flag = "" if picked == fastest else f"  (CUDA's rule picks {picked})"
                print(f"{model_name} {bname} {mode}: {times}; fastest {fastest}{flag}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
