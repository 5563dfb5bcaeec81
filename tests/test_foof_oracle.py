"""FOOF's matrices and step against independent constructions, in float64, for Linear and Conv2d blocks (kernels 3
and 5, stride 2, padding 0 / 1 / 'same', dilation 2, with and without bias):

* curvlinops (``curvlinops-for-pytorch``, Dangel et al.): its KFAC in the forward-only (FOOF) mode with weight and
  bias joined -- A = E[a a^T] of the layer's unfolded inputs with a constant 1 appended, the output factor the
  identity -- and its matrix-vector product as the step's check: (A + lam I) times FOOF's direction gives back the
  gradient.  Skipped where curvlinops is not installed (it is in no extra of this project: its dependency
  backpack-for-pytorch pulls torchvision and another torch; ``pip install --no-deps curvlinops-for-pytorch einops
  einconv linear_operator`` is what it needs for this test).
* always: the published definition written out with ``torch.nn.functional.unfold`` (FOOF builds its patches from
  strided views, ``Tensor.unfold``) and the step as ``torch.linalg.solve``.
"""

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fedpm_dnn import FOOF  # noqa: E402

DAMPING = 0.3
TOL = dict(rtol=1e-14, atol=1e-14)

LAYERS = {
    "linear": lambda bias: nn.Linear(12, 5, bias=bias),
    "conv k3 s2 p0": lambda bias: nn.Conv2d(3, 4, 3, stride=2, padding=0, bias=bias),
    "conv k3 s2 p1": lambda bias: nn.Conv2d(3, 4, 3, stride=2, padding=1, bias=bias),
    "conv k5 s2 p1": lambda bias: nn.Conv2d(3, 4, 5, stride=2, padding=1, bias=bias),
    "conv k3 same": lambda bias: nn.Conv2d(3, 4, 3, padding="same", bias=bias),
    "conv k5 same dilation 2": lambda bias: nn.Conv2d(3, 4, 5, padding="same", dilation=2, bias=bias),
    "conv k3 s2 p1 dilation 2": lambda bias: nn.Conv2d(3, 4, 3, stride=2, padding=1, dilation=2, bias=bias),
}
CASES = [(name, bias) for name in LAYERS for bias in (True, False)]


def setup(name, bias, batches=3, size=7):
    """A one-block float64 model (the layer, flattened) and a few (input, target) batches."""
    torch.manual_seed(0)
    layer = LAYERS[name](bias).double()
    model = nn.Sequential(layer, nn.Flatten()).double()
    shape = (12,) if name == "linear" else (3, 11, 11)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(size, *shape, generator=g, dtype=torch.float64) for _ in range(batches)]
    with torch.no_grad():
        outs = [model(x) for x in xs]
    data = [(x, torch.randn(o.shape, generator=g, dtype=torch.float64)) for x, o in zip(xs, outs, strict=True)]
    return model, layer, data


def unfolded(layer, x):
    """The rows a whose outer products make A: F.unfold's patches (conv; numeric padding for 'same'), or x."""
    if isinstance(layer, nn.Linear):
        return x
    pad = layer.padding
    if pad == "same":
        pad = tuple(d * (k - 1) // 2 for d, k in zip(layer.dilation, layer.kernel_size, strict=True))
    cols = F.unfold(x, layer.kernel_size, dilation=layer.dilation, padding=pad, stride=layer.stride)
    return cols.transpose(1, 2).reshape(-1, cols.shape[1])  # (N L, C kh kw)


def definition(layer, data):
    """A = E[a a^T] over every row of every batch, a constant 1 appended for a bias (FOOF, Benzing 2022)."""
    rows = torch.cat([unfolded(layer, x) for x, _ in data])
    if layer.bias is not None:
        rows = torch.cat([rows, torch.ones(len(rows), 1, dtype=rows.dtype)], 1)
    return rows.T @ rows / len(rows)


def foof_step(model, layer, data):
    """(A of FOOF, the parameters' change of one FOOF step with lr 1, the gradient it stepped from)."""
    opt = FOOF(model, lr=1.0, damping=DAMPING, stats_every=None)
    A = opt.update_statistics([x for x, _ in data])["0"]
    x, y = data[0]
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    grads = [p.grad.clone() for p in layer.parameters()]
    before = [p.detach().clone() for p in layer.parameters()]
    opt.step()
    moved = [b - p.detach() for b, p in zip(before, layer.parameters(), strict=True)]
    return A, moved, grads


def theta(layer, tensors):
    """(d_out, d) rows of [W b] from per-parameter tensors (weight, optional bias)."""
    W = tensors[0].reshape(tensors[0].shape[0], -1)
    return torch.cat([W, tensors[1][:, None]], 1) if len(tensors) > 1 else W


@pytest.mark.parametrize("name, bias", CASES)
def test_foof_matrix_and_step_equal_the_published_definition(name, bias):
    model, layer, data = setup(name, bias)
    A, moved, grads = foof_step(model, layer, data)
    ref = definition(layer, data)
    torch.testing.assert_close(A, ref, **TOL)
    # the step: rows of G_Theta^T (A + lam I)^{-1}, by a solve against the reference matrix
    expected = torch.linalg.solve(ref + DAMPING * torch.eye(len(ref), dtype=ref.dtype), theta(layer, grads).T).T
    torch.testing.assert_close(theta(layer, moved), expected, **TOL)


@pytest.mark.parametrize("name, bias", CASES)
def test_foof_matrix_and_step_equal_curvlinops_forward_only_kfac(name, bias):
    curvlinops = pytest.importorskip("curvlinops")
    model, layer, data = setup(name, bias)
    A, moved, grads = foof_step(model, layer, data)
    params = list(layer.parameters())
    kfac = curvlinops.KFACLinearOperator(
        model,
        nn.MSELoss(),
        params,
        data,
        fisher_type=curvlinops.FisherType.FORWARD_ONLY,
        separate_weight_and_bias=False,
        check_deterministic=False,
    )
    kfac.compute_kronecker_factors()
    (theirs,) = kfac.state_dict()["input_covariances"].values()
    torch.testing.assert_close(A, theirs, **TOL)
    # (A (x) I + lam I) applied to FOOF's direction by curvlinops' own product gives back the gradient
    direction = torch.cat([m.flatten() for m in moved])
    back = kfac @ direction + DAMPING * direction
    gradient = torch.cat([g.flatten() for g in grads])
    torch.testing.assert_close(back, gradient, **TOL)
