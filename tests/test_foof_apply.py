"""--foof-apply inverse: one product with (A + lam I)^{-1}, formed once per round from the float64 Cholesky factor,
against the two triangular solves of 'solve', within float32's round-off bound.

The bound.  X = (A + lam I)^{-1} is formed in float64 (its error, ~kappa eps_64, is negligible) and rounded to
float32: X~ = X + E, |E| <= u |X| elementwise, u = 2^-24.  A row g of the gradient then takes one float32 product of
length d: fl(g X~) = g X~ + f with |f| <= gamma_d |g| |X~|.  The 'solve' path's two triangular solves with the
float32 factor are backward stable with an error of the same form.  With the probabilistic rounding-error bound of
Higham & Mary (SIAM J. Sci. Comput. 41(5), 2019: a length-d sum errs by about sqrt(d) u, not d u) and
|| |X| ||_2 <= sqrt(d) ||X||_2 absorbed into it, each path errs by at most about 2 sqrt(d) u ||G||_F ||X||_2, so

    ||D_inverse - D_solve||_F  <=  4 sqrt(d) u ||G||_F ||(A + lam I)^{-1}||_2
    ||D_inverse - D_solve||_F / ||D||_F  <=  4 sqrt(d) u kappa(A + lam I)   (||D||_F >= ||G||_F / ||A + lam I||_2)

The tests check the first form (tighter: the gradient's own ||G|| ||X|| / ||D|| instead of the worst case kappa)
for every FOOF block of SimpleCNN and ResNet18-GN at lam = 1 and 1e-4, TF32 off; at lam = 1 the bound is small
(it cannot pass by being vacuous), at lam = 1e-4 and kappa ~ 1e6 it allows a relative difference of ~1e-2.
"""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from fedpm_dnn import foof  # noqa: E402
from fedpm_dnn.algorithms import make_method  # noqa: E402
from fedpm_dnn.engine.sequential import ClientData  # noqa: E402
from fedpm_dnn.engine.simulation import Experiment  # noqa: E402
from fedpm_dnn.engine.training_task import DnnTask  # noqa: E402
from fedpm_dnn.mixing import mix  # noqa: E402
from fedpm_dnn.models import ResNet18GN, make_model  # noqa: E402

U = 2.0**-24


def bound(G: torch.Tensor, M: torch.Tensor, smallest: float | None = None) -> float:
    """4 sqrt(d) u ||G||_F ||M^{-1}||_2 (module doc) for gradient rows G (rows, d) and M = A + lam I (float64);
    ``smallest``: M's smallest eigenvalue, if known."""
    smallest = float(torch.linalg.eigvalsh(M)[0]) if smallest is None else smallest
    return 4 * math.sqrt(M.shape[0]) * U * float(G.double().norm()) / smallest


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def model_and_input(name):
    torch.manual_seed(0)
    if name == "cnn":
        return make_model("cnn", 10, 3, 32), torch.randn(32, 3, 32, 32)
    # the paper's ResNet18-GN (blocks up to 4,608 wide) in the slow case, an eighth-width copy in the fast one
    width = 64 if name == "resnet18gn" else 8
    return ResNet18GN(10, 3, 2, width), torch.randn(16, 3, 8, 8)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.parametrize(
    "name, device",
    [
        ("cnn", "cpu"),
        ("resnet18gn-w8", "cpu"),
        pytest.param("resnet18gn", "cpu", marks=pytest.mark.slow),
        pytest.param("cnn", "cuda", marks=CUDA),
        pytest.param("resnet18gn", "cuda", marks=CUDA),
    ],
)
def test_inverse_directions_agree_with_the_solves_within_the_float32_bound(name, device):
    torch.set_num_threads(1)
    model, x = model_and_input(name)
    model, x = model.to(device), x.to(device)
    blocks = foof.foof_blocks(model)
    A = foof.compute_foof(model, blocks, [x])
    if name == "resnet18gn":  # the widths beyond any at an eighth of the width (576): 1,152, 2,304 and 4,608, the
        # deepest block of each (the bound depends on the width and the block's own G and M, which the test computes)
        widest = {A[b].shape[0]: b for b in blocks if A[b].shape[0] > 577}
        blocks = {b: blocks[b] for b in widest.values()}
        A = {b: A[b] for b in blocks}
        assert sorted(widest) == [1152, 2304, 4608]
    F.cross_entropy(model(x), torch.arange(len(x), device=device) % 10).backward()
    # the paper's width (blocks of 2,304 and 4,608, the slow case) at the damping where the bound is tight; both
    # dampings, and the bound's non-vacuity, at the smaller widths
    for lam in (1e-4,) if name == "resnet18gn" else (1.0, 1e-4):
        solve, inverse = (foof.prepare(A, lam, torch.float32, apply) for apply in ("solve", "inverse"))
        for bname, block in blocks.items():
            m = block.module
            G = foof.get_theta(block, m.weight.grad, m.bias.grad if block.has_bias else None).T.contiguous()
            M = A[bname] + lam * torch.eye(A[bname].shape[0], dtype=torch.float64, device=device)
            d_solve, d_inv = foof.direction(G, solve[bname]), foof.direction(G, inverse[bname])
            assert inverse[bname][0].dtype == torch.float32 and torch.equal(inverse[bname][0], inverse[bname][0].mT)
            diff = float((d_inv.double() - d_solve.double()).norm())
            # ||M^-1|| from M's smallest eigenvalue; above 1,200 wide (ResNet18-GN's 2,304 and 4,608 blocks, the slow
            # case) from its lower bound lam (A is PSD up to its float32 Grams' round-off), tight there: 16 images leave
            # those A singular
            smallest = float(torch.linalg.eigvalsh(M)[0]) if M.shape[0] <= 1200 else lam
            allowed = bound(G, M, smallest)
            assert diff <= allowed, (name, lam, bname, diff, allowed)
            if lam == 1.0:  # not vacuous: kappa <= ~1e3 here, the bound a relative difference below 1e-3
                assert allowed <= 1e-3 * float(d_solve.double().norm()), (name, bname, allowed)


def test_prepare_inverse_is_the_inverse_of_the_damped_matrix_for_a_stack():
    """The stacked engines' form: cholesky_inverse of each factor of a stack, symmetric, in the training dtype."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(3, 40, 12, generator=g, dtype=torch.float64)
    A = a.mT @ a / 40
    L = torch.linalg.cholesky(A + 0.1 * torch.eye(12, dtype=torch.float64))
    (X,) = foof.operators({"b": L}, torch.float32, "inverse")["b"]
    assert X.shape == (3, 12, 12) and X.dtype == torch.float32 and torch.equal(X, X.mT)
    eye = torch.eye(12, dtype=torch.float64).expand(3, 12, 12)
    torch.testing.assert_close((A + 0.1 * eye) @ X.double(), eye, atol=1e-5, rtol=0)


def experiment(model, apply, damping, engine, images=8):
    """Two clients, one local step each (as many images as the batch), no clipping or weight decay, no
    augmentation: each reply is theta0 - lr (A + lam I)^{-1} G with G the full-batch gradient at theta0."""
    g = np.random.default_rng(0)
    size = 32 if model == "cnn" else 8
    clients = [
        ClientData(
            torch.as_tensor(g.integers(0, 256, (images, 3, size, size)).astype(np.uint8)),
            torch.as_tensor(g.integers(0, 10, images)),
            (0.5, 0.5, 0.5),
            (0.25, 0.25, 0.25),
            augment=False,
        )
        for _ in range(2)
    ]
    cfg = make_method(
        "fedpm",
        lr=LR,
        damping=damping,
        clip=None,
        weight_decay=0.0,
        local_epochs=1,
        batch_size=images,
        foof_apply=apply,
    )
    xt = torch.as_tensor(g.integers(0, 256, (10, 3, size, size)).astype(np.uint8))
    return Experiment(
        cfg=cfg,
        model="cnn" if model == "cnn" else "resnet18gn",
        num_classes=10,
        clients=clients,
        x_test=xt,
        y_test=torch.arange(10),
        mean=(0.5,) * 3,
        std=(0.25,) * 3,
        rounds=1,
        image_size=size,
        engine=engine,
    )


LR = 0.05


def one_round(model, apply, damping, engine):
    """(task, broadcast, replies) of the first round; ResNet18-GN at an eighth of its width (the fast case)."""
    exp = experiment(model, apply, damping, engine)
    torch.manual_seed(0)
    net = make_model("cnn", 10, 3, 32) if model == "cnn" else ResNet18GN(10, 3, 2, 8)
    task = DnnTask(net, exp.clients, "cpu", 0, engine)
    state = exp.cfg.init(task, task.initial_params())
    down = exp.cfg.broadcast(state)
    replies, _, _ = exp.cfg.client_replies(task, down, state.clients, np.arange(2))
    return task, down, replies


def gradient_and_matrices(task, params, data):
    """The full-batch gradient G_Theta per block and the FOOF matrices A at ``params`` on the client's data."""
    model, blocks = task.model, task.blocks
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n])
    model.zero_grad(set_to_none=True)
    x = next(data.plain_batches(torch.arange(len(data))))
    A = foof.compute_foof(model, blocks, [x])
    F.cross_entropy(model(x), data.y).backward()
    G = {
        b: foof.get_theta(k, k.module.weight.grad, k.module.bias.grad if k.has_bias else None).T
        for b, k in blocks.items()
    }
    return G, A


@pytest.mark.parametrize(
    "model, engine",
    [("cnn", "vectorized"), ("cnn", "sequential"), ("resnet18gn-w8", "vectorized")],
)
@pytest.mark.parametrize("damping", [1.0, 1e-4])
def test_one_round_of_replies_agrees_with_solve_within_the_bound(model, damping, engine):
    """A one-step round: each reply is theta0 - lr D per block, so the two applies' replies differ by lr times
    their directions' difference (bounded as above) plus the float32 rounding of theta0 - lr D in each,
    u (||theta0|| + lr ||D||) per path."""
    torch.set_num_threads(1)
    task, down, r_solve = one_round(model, "solve", damping, engine)
    _, _, r_inv = one_round(model, "inverse", damping, engine)
    for k in range(2):
        G, A = gradient_and_matrices(task, down["params"], task.clients[k])
        for bname, block in task.blocks.items():
            wn, bn = foof.param_name(bname, "weight"), foof.param_name(bname, "bias")

            def theta(params, block=block, wn=wn, bn=bn):
                return foof.get_theta(block, params[wn], params[bn] if block.has_bias else None).double()

            t0, ts, ti = theta(down["params"]), theta(r_solve[k]["params"]), theta(r_inv[k]["params"])
            M = A[bname] + damping * torch.eye(A[bname].shape[0], dtype=torch.float64)
            step = float((t0 - ts).norm())
            allowed = LR * bound(G[bname], M) + 2 * U * (float(t0.norm()) + step)
            assert float((ti - ts).norm()) <= allowed, (model, damping, engine, k, bname)
            assert step > 10 * allowed or damping < 1  # at lam = 1 the step itself is far above the bound


def reply_bound(task, down, reply, G, A, bname, damping):
    """The previous test's bound on ||Theta_inverse - Theta_solve||_F for one client's solve ``reply``, block
    ``bname``, from that client's gradient G and FOOF matrices A at the broadcast model."""
    t0, ts = (block_theta(task, bname, p) for p in (down["params"], reply["params"]))
    M = A[bname] + damping * torch.eye(A[bname].shape[0], dtype=torch.float64)
    return LR * bound(G[bname], M) + 2 * U * (float(t0.norm()) + float((t0 - ts).norm()))


def block_theta(task, bname, params):
    block = task.blocks[bname]
    wn, bn = foof.param_name(bname, "weight"), foof.param_name(bname, "bias")
    return foof.get_theta(block, params[wn], params[bn] if block.has_bias else None).double()


@pytest.mark.parametrize("model", ["cnn", "resnet18gn-w8"])
@pytest.mark.parametrize("damping", [1.0, 1e-4])
def test_one_round_of_the_mixed_model_agrees_with_solve_within_the_propagated_bound(model, damping):
    """The server mixes in float64: per block Theta = Pbar^{-1} sum_i w_i M_i Theta_i, M_i = A_i + lam I, Pbar =
    sum_i w_i M_i, with A_i the FOOF matrix each client sends from the end of its round.  Between the two applies
    the replies differ in Theta_i (bounded above: delta_i) and, through the changed activations, in A_i.  Exactly,

        Theta' - Theta = Pbar^{-1} [ sum_i w_i M_i (Theta_i' - Theta_i) + sum_i w_i (A_i' - A_i) (Theta_i' - Theta') ]

    so ||Theta' - Theta||_F <= sum_i w_i ||Pbar^{-1} M_i||_2 delta_i + ||Pbar^{-1}||_2 sum_i w_i ||A_i' - A_i||_2
    ||Theta_i' - Theta'||_F, plus each path's own float64 solve (<= 4 d kappa(Pbar) eps_64 ||Theta||) and its
    rounding to float32 (u ||Theta||).  ||Pbar^{-1} M_i||_2 is at most about kappa(Pbar): the reply bound propagates
    with Pbar's conditioning.  The model is mixed by fedpm_dnn.mixing.mix, the server's kernel (mix_blocks)."""
    torch.set_num_threads(1)
    task, down, r_solve = one_round(model, "solve", damping, "vectorized")
    _, _, r_inv = one_round(model, "inverse", damping, "vectorized")
    w = [0.5, 0.5]  # FedPM's uniform 1/N
    mixed = {
        apply: mix([r["params"] for r in replies], [r["foof"] for r in replies], damping=damping)
        for apply, replies in (("solve", r_solve), ("inverse", r_inv))
    }
    eps64 = float(np.finfo(np.float64).eps)
    at_start = [gradient_and_matrices(task, down["params"], task.clients[k]) for k in range(2)]
    for bname in task.blocks:
        A = [[r[k]["foof"][bname].double() for k in range(2)] for r in (r_solve, r_inv)]
        eye = torch.eye(A[0][0].shape[0], dtype=torch.float64)
        M = [a + damping * eye for a in A[0]]
        Pbar = sum(wi * m for wi, m in zip(w, M, strict=True))
        Pbar = 0.5 * (Pbar + Pbar.T)
        evals = torch.linalg.eigvalsh(Pbar)
        theta_s, theta_i = (block_theta(task, bname, mixed[a]) for a in ("solve", "inverse"))
        allowed = 0.0
        for k in range(2):
            through_theta = float(torch.linalg.matrix_norm(torch.linalg.solve(Pbar, M[k]), ord=2))
            allowed += w[k] * through_theta * reply_bound(task, down, r_solve[k], *at_start[k], bname, damping)
            dA = float(torch.linalg.matrix_norm(A[1][k] - A[0][k], ord=2))
            spread = float((block_theta(task, bname, r_inv[k]["params"]) - theta_i).norm())
            allowed += w[k] * dA * spread / float(evals[0])
        kappa = float(evals[-1] / evals[0])
        allowed += (2 * 4 * Pbar.shape[0] * kappa * eps64 + 2 * U) * float(theta_s.norm())
        diff = float((theta_i - theta_s).norm())
        assert diff <= allowed, (model, damping, bname, diff, allowed)
        if damping == 1.0:  # not vacuous: the round moved the block far more than the bound allows
            moved = float((theta_s - block_theta(task, bname, down["params"])).norm())
            assert moved > 10 * allowed, (model, bname, moved, allowed)


def test_auto_follows_the_stated_rule():
    """auto: every block 'inverse' on CUDA; on a CPU per block, inverse where d <= INVERSE_MAX_SIDE_CPU and the
    factor serves at least INVERSE_STEPS_CPU d / rows steps -- so SimpleCNN's fc1 (401 wide, 120 rows) turns to the
    inverse at 54 steps, and ResNet18-GN's 4,608-wide blocks never do."""
    cnn, resnet = (foof.foof_blocks(make_model(m, 10, 3, 32)) for m in ("cnn", "resnet18gn"))
    assert set(foof.resolve_apply("auto", "cuda", cnn).values()) == {"inverse"}
    assert foof.resolve_apply("solve", "cuda", cnn) == dict.fromkeys(cnn, "solve")
    fc1 = 16 * 401 / 120
    assert foof.resolve_apply("auto", "cpu", cnn, math.ceil(fc1))["fc1"] == "inverse"
    assert foof.resolve_apply("auto", "cpu", cnn, math.floor(fc1))["fc1"] == "solve"
    wide = [n for n, b in resnet.items() if b.module.weight[0].numel() == 4608]
    assert len(wide) == 3 and all(foof.resolve_apply("auto", "cpu", resnet, 10**6)[n] == "solve" for n in wide)
    mixed = foof.operators(
        {"a": torch.eye(3, dtype=torch.float64), "b": torch.eye(2, dtype=torch.float64)},
        torch.float32,
        {"a": "inverse", "b": "solve"},
    )
    assert len(mixed["a"]) == 1 and len(mixed["b"]) == 2


def test_a_checkpoint_from_before_foof_apply_resumes_with_the_default():
    """Written before the option: no config.foof_apply (it solved) and no --foof-apply flag; it resumes under the
    default, not under --foof-apply inverse."""
    from fedpm_dnn.engine.checkpoint import first_difference

    old = {"run.lr": 0.5, "config.damping": 1.0}
    now = {"run.lr": 0.5, "run.foof_apply": None, "config.damping": 1.0, "config.foof_apply": "solve"}
    assert first_difference(old, now) is None
    other = {**now, "run.foof_apply": "inverse", "config.foof_apply": "inverse"}
    assert "foof" in first_difference(old, other)


def _cli_run(tmp_path, out, *extra):
    from validation import dnn

    argv = ["--dataset", "cifar10", "--data-dir", str(tmp_path / "data"), "--method", "fedpm", "--clients", "2"]
    argv += ["--local-epochs", "1", "--foof-samples", "64", "--train-subset", "40", "--test-subset", "20"]
    return dnn.main(argv + ["--quiet", "--threads", "1", "--out", str(out), *extra])


def _history(out):
    import csv

    with open(out / "history.csv") as fh:
        rows = list(csv.DictReader(fh))
    return [{k: v for k, v in row.items() if "seconds" not in k and "memory" not in k} for row in rows]


def test_a_run_started_under_the_old_default_resumes_with_the_apply_it_recorded(tmp_path, monkeypatch):
    """--foof-apply auto is the default and is made concrete once per run (inverse on CUDA); a checkpoint written
    under the earlier default (solve; no flag given) -- or before the option existed (no apply recorded) -- resumes
    with solve where auto now means inverse, without a flag, to the history of the uninterrupted solve run.  The
    same for --foof-precision auto (split-tf32 on CUDA): such a run resumes in fp32."""
    from fake_cifar import cifar_pickle

    from fedpm_dnn.engine import checkpoint
    from fedpm_dnn.foof import precision
    from validation import dnn

    cifar_pickle(str(tmp_path / "data" / "cifar-10-batches-py"), balanced=True)  # class-balanced subsets exist
    whole = tmp_path / "whole"
    assert _cli_run(tmp_path, whole, "--rounds", "2", "--foof-apply", "solve") == 0
    for name, forget in (("old-default", False), ("before-option", True)):
        out = tmp_path / name
        assert _cli_run(tmp_path, out, "--rounds", "1") == 0  # the CPU's auto: solve, as the old default
        ck = checkpoint.load(str(out / "checkpoint.pt"))
        fp = ck["fingerprint"]
        # what the old default wrote: the resolved apply in the config, no flag (the run's flags no longer record
        # the method's settings as given: validation.dnn.NOT_IN_FINGERPRINT)
        assert fp["config.foof_apply"] == "solve" and fp.get("run.foof_apply") is None
        assert fp["config.foof_precision"] == "fp32" and fp.get("run.foof_precision") is None
        if forget:
            for key in ("config.foof_apply", "run.foof_apply", "config.foof_precision", "run.foof_precision"):
                fp.pop(key, None)
            checkpoint.save(str(out / "checkpoint.pt"), ck)
        monkeypatch.setitem(dnn.AUTO_FOOF_APPLY, "cpu", "inverse")  # auto now stands for inverse, as on CUDA
        monkeypatch.setattr(precision, "default_mode", lambda device: "split-tf32")
        assert _cli_run(tmp_path, out, "--rounds", "2", "--resume") == 0
        monkeypatch.undo()
        assert _history(out) == _history(whole)
    fresh = tmp_path / "fresh"  # a new run under the same rule records the concrete apply it used
    monkeypatch.setitem(dnn.AUTO_FOOF_APPLY, "cpu", "inverse")
    monkeypatch.setattr(precision, "default_mode", lambda device: "split-tf32")
    assert _cli_run(tmp_path, fresh, "--rounds", "1") == 0
    fp = checkpoint.load(str(fresh / "checkpoint.pt"))["fingerprint"]
    assert fp["config.foof_apply"] == "inverse" and fp["config.foof_precision"] == "split-tf32"
