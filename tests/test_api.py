"""FedPM for any PyTorch model: the FOOF optimizer, ``mix`` over state dicts and the ``federated`` simulator."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from fedpm_dnn import FOOF, federated, mix  # noqa: E402
from fedpm_dnn import foof as _foof  # noqa: E402
from fedpm_dnn.algorithms import METHODS, applicable  # noqa: E402


class TokenNet(nn.Module):
    """Embedding -> Linear on every token (3-D input) -> LayerNorm -> ReLU -> mean over tokens -> Linear."""

    def __init__(self, vocab=12, dim=6, hidden=10, classes=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, tokens):
        return self.head(torch.relu(self.norm(self.proj(self.emb(tokens)))).mean(1))


def token_data(n=64, seed=0, length=5):
    """A sequence of class c holds tokens c, c + 3, c + 6 and c + 9 only: learnable only through the embedding."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 3, (n,), generator=g)
    return labels[:, None] + 3 * torch.randint(0, 4, (n, length), generator=g), labels


def test_foof_covers_linear_layers_only_and_the_rest_takes_plain_sgd():
    torch.manual_seed(0)
    model = TokenNet()
    opt = FOOF(model, lr=0.5, damping=0.1)
    assert [layer.name for layer in opt.blocks() if layer.preconditioned] == ["proj", "head"]
    x, y = token_data()
    A = opt.update_statistics([(x, y)])
    assert A["proj"].shape == (7, 7) and A["head"].shape == (11, 11) and A["proj"].dtype == torch.float64
    emb, norm = model.emb.weight.detach().clone(), model.norm.weight.detach().clone()
    F.cross_entropy(model(x), y).backward()
    g_emb, g_norm = model.emb.weight.grad.clone(), model.norm.weight.grad.clone()
    opt.step()
    torch.testing.assert_close(model.emb.weight.detach(), emb - 0.5 * g_emb)
    torch.testing.assert_close(model.norm.weight.detach(), norm - 0.5 * g_norm)


def test_the_inverse_product_equals_the_cholesky_solves_of_the_local_training():
    """FOOF.step applies (A + lam I)^{-1} formed once; local_train solves with the factor every step."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 25, 4))
    x, y = torch.randn(16, 2, 5, 5), torch.randint(0, 4, (16,))
    twin = copy.deepcopy(model)
    opt = FOOF(model, lr=0.3, damping=0.05, weight_decay=0.01)
    A = opt.update_statistics([x])
    F.cross_entropy(model(x), y).backward()
    opt.step()
    blocks = _foof.foof_blocks(twin)
    F.cross_entropy(twin(x), y).backward()
    with torch.no_grad():
        for p in twin.parameters():
            p.grad.add_(p, alpha=0.01)
        _foof.precondition_grads(twin, blocks, _foof.with_uppers(_foof.factorize(A, 0.05, torch.float32)))
        for p in twin.parameters():
            p.add_(p.grad, alpha=-0.3)
    for (name, a), b in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_a_custom_model_with_an_embedding_and_a_layernorm_learns_with_foof():
    torch.manual_seed(2)
    model = TokenNet()
    x, y = token_data(n=96)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
    opt = FOOF(model, lr=0.2, damping=0.1, clip=1.0)
    with torch.no_grad():
        before = float(F.cross_entropy(model(x), y))
    for _ in range(15):
        opt.update_statistics(loader)  # once per "round", as a FedPM client does
        for xb, yb in loader:
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
    with torch.no_grad():
        after = float(F.cross_entropy(model(x), y))
    assert after < 0.5 * before


def test_a_grouped_convolution_is_no_block_and_steps_as_a_plain_parameter():
    torch.manual_seed(6)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, groups=2), nn.Conv2d(4, 2, 1), nn.Flatten(), nn.Linear(2 * 9, 3))
    with pytest.warns(UserWarning, match="grouped convolution"):
        opt = FOOF(model, lr=0.1, damping=0.1)
    assert [layer.name for layer in opt.blocks() if layer.preconditioned] == ["1", "3"]
    x, y = torch.randn(8, 2, 5, 5), torch.randint(0, 3, (8,))
    opt.update_statistics([x])
    w = model[0].weight.detach().clone()
    F.cross_entropy(model(x), y).backward()
    g = model[0].weight.grad.clone()
    opt.step()
    torch.testing.assert_close(model[0].weight.detach(), w - 0.1 * g)


def test_step_before_statistics_and_foreign_matrices_are_clear_errors():
    model = TokenNet()
    opt = FOOF(model, lr=0.1, damping=0.1)
    with pytest.raises(RuntimeError, match="update_statistics"):
        opt.step()
    with pytest.raises(ValueError, match="name blocks"):
        opt.set_matrices({"proj": torch.eye(7)})
    with pytest.raises(ValueError, match="expected"):
        opt.set_matrices({"proj": torch.eye(6), "head": torch.eye(11)})
    with pytest.raises(ValueError, match="lr"):
        FOOF(model, lr=0.0)


def _client_update(model, x, y, lr=0.3, damping=0.1):
    """One FedPM client: matrices at the received model, one pass of full-batch steps, matrices at the end."""
    opt = FOOF(model, lr=lr, damping=damping)
    opt.update_statistics([x])
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    opt.update_statistics([x])
    return model.state_dict(), opt.matrices()


def test_mix_of_identical_models_returns_them_whatever_their_matrices():
    torch.manual_seed(3)
    model = TokenNet()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    mats = []
    for seed in (0, 1, 2):  # three clients' data: three different sets of matrices, one model
        opt = FOOF(copy.deepcopy(model), lr=0.1, damping=0.01)
        mats.append(opt.update_statistics([token_data(seed=seed)[0]]))
    mixed = mix([state] * 3, mats, weights=[1, 2, 3], damping=0.01)
    assert list(mixed) == list(state)
    for k in state:
        torch.testing.assert_close(mixed[k], state[k], rtol=1e-5, atol=1e-6, msg=k)


def test_mix_is_precond_mix_per_block_and_the_mean_elsewhere():
    torch.manual_seed(4)
    global_model = TokenNet()
    states, mats = [], []
    for seed in (0, 1):
        x, y = token_data(seed=seed)
        s, m = _client_update(copy.deepcopy(global_model), x, y)
        states.append(s)
        mats.append(m)
    mixed = mix(states, mats, damping=0.1)
    for name in ("proj", "head"):
        theta = [torch.cat([s[f"{name}.weight"], s[f"{name}.bias"][:, None]], 1).T.double() for s in states]
        M = [m[name] + 0.1 * torch.eye(m[name].shape[0], dtype=torch.float64) for m in mats]
        expect = torch.linalg.solve(M[0] + M[1], M[0] @ theta[0] + M[1] @ theta[1]).float()
        got = torch.cat([mixed[f"{name}.weight"], mixed[f"{name}.bias"][:, None]], 1).T
        torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-6)
    for k in ("emb.weight", "norm.weight", "norm.bias"):
        torch.testing.assert_close(mixed[k], 0.5 * (states[0][k] + states[1][k]))


@pytest.mark.parametrize("damping", [0.0, 0.7])
def test_one_linear_layer_squared_loss_one_full_batch_step_mix_is_the_global_newton_step(damping):
    """The paper's identity: A is the exact Hessian (per output), so with sample-count weights the mix of
    one full-batch FOOF step per client is a (damped) Newton step on the pooled data."""
    torch.manual_seed(5)
    d_in, d_out = 4, 3
    glob = nn.Linear(d_in, d_out).double()
    data = [(torch.randn(n, d_in, dtype=torch.float64) + i, torch.randn(n, d_out, dtype=torch.float64)) for i, n in
            enumerate((5, 9, 13))]  # fmt: skip

    def loss(model, x, y):
        return 0.5 * ((model(x) - y) ** 2).sum(1).mean()

    states, mats = [], []
    for x, y in data:
        model = copy.deepcopy(glob)
        opt = FOOF(model, lr=1.0, damping=damping)
        opt.update_statistics([x])
        loss(model, x, y).backward()
        opt.step()
        states.append(model.state_dict())
        mats.append(opt.matrices())
    mixed = mix(states, mats, weights=[len(x) for x, _ in data], damping=damping)
    X, Y = torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])
    loss(glob, X, Y).backward()
    a = torch.cat([X, torch.ones(len(X), 1, dtype=torch.float64)], 1)
    H = a.T @ a / len(X) + damping * torch.eye(d_in + 1, dtype=torch.float64)
    theta = torch.cat([glob.weight, glob.bias[:, None]], 1).T.detach()
    G = torch.cat([glob.weight.grad, glob.bias.grad[:, None]], 1).T
    newton = theta - torch.linalg.solve(H, G)
    torch.testing.assert_close(torch.cat([mixed["weight"], mixed["bias"][:, None]], 1).T, newton)


def test_mix_rejects_inconsistent_clients_in_one_line():
    s = TokenNet().state_dict()
    m = {"proj": torch.eye(7), "head": torch.eye(11)}
    with pytest.raises(ValueError, match="one state and one matrix dict per client"):
        mix([s, s], [m])
    with pytest.raises(ValueError, match="names no layer"):
        mix([s], [{"nope": torch.eye(3)}])
    with pytest.raises(ValueError, match="is 5x5"):
        mix([s], [{"proj": torch.eye(5)}])
    with pytest.raises(ValueError, match="weights"):
        mix([s, s], [m, m], weights=[1, -1])


# --- federated -------------------------------------------------------------------------------------------------


def token_loaders(n_clients=3, per_client=24):
    out = []
    for i in range(n_clients):
        x, y = token_data(n=per_client, seed=10 + i)
        out.append(DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True))
    return out


def accuracy_on(x, y):
    return lambda model: {"acc": float((model(x).argmax(1) == y).float().mean())}


def _strip(history):
    return [{k: v for k, v in r.items() if "seconds" not in k and k != "peak_memory_mb"} for r in history]


@pytest.mark.parametrize("method", METHODS)
def test_every_registered_method_trains_a_custom_model_on_dataloaders(method):
    kw = applicable(method, {"lr": 0.1, "local_epochs": 1, "damping": 0.1, "server_lr": 0.1})
    run = federated(TokenNet, token_loaders(), method=method, rounds=2, evaluate=accuracy_on(*token_data()), **kw)
    assert [r["round"] for r in run.history] == [1, 2] and all(np.isfinite(r["train_loss"]) for r in run.history)
    assert run.history[-1]["bytes_up"] > 0 and 0.0 <= run.history[-1]["acc"] <= 1.0
    assert isinstance(run.model, TokenNet)


def test_federated_with_a_custom_loss_learns_and_resumes_to_the_identical_run(tmp_path):
    def smoothed(out, y):  # any loss of (outputs, targets)
        return F.cross_entropy(out, y, label_smoothing=0.1)

    kw = dict(method="fedpm", loss_fn=smoothed, evaluate=accuracy_on(*token_data()), lr=0.2, damping=0.1, clip=1.0)
    full = federated(TokenNet, token_loaders(), rounds=4, local_epochs=2, **kw)
    assert full.history[-1]["train_loss"] < 0.8 * full.history[0]["train_loss"]
    ck = str(tmp_path / "ck.pt")
    federated(TokenNet, token_loaders(), rounds=2, local_epochs=2, checkpoint=ck, **kw)  # "killed" after round 2
    resumed = federated(TokenNet, token_loaders(), rounds=4, local_epochs=2, checkpoint=ck, resume=True, **kw)
    assert _strip(resumed.history) == _strip(full.history)
    for a, b in zip(resumed.model.parameters(), full.model.parameters(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="different configuration"):
        federated(TokenNet, token_loaders(), rounds=5, local_epochs=1, checkpoint=ck, resume=True, **kw)


def test_federated_reproduces_validation_dnn_on_its_cifar_clients(tmp_path):
    """SimpleCNN and validation.dnn's CIFAR clients: the same history, row for row."""
    from fake_cifar import cifar_pickle

    from fedpm_dnn.data.augment import normalize
    from fedpm_dnn.engine.simulation import run_experiment
    from fedpm_dnn.models import make_model
    from validation import dnn

    cifar_pickle(str(tmp_path / "data" / "cifar-10-batches-py"))
    args = dnn.parse_args(
        ["--dataset", "cifar10", "--data-dir", str(tmp_path / "data"), "--cache-dir", str(tmp_path / "cache")]
        + ["--method", "fedpm", "--preset", "cifar10-a0.1", "--clients", "3", "--local-epochs", "1"]
        + ["--foof-samples", "64", "--rounds", "2", "--participants", "2", "--device", "cpu"]
    )
    exp, _ = dnn.build(args)
    reference = run_experiment(exp)

    def test_acc(model):
        hits = (model(normalize(exp.x_test, exp.mean, exp.std)).argmax(1) == exp.y_test).sum()
        return {"test_acc": int(hits) / len(exp.y_test)}

    run = federated(
        lambda: make_model(exp.model, exp.num_classes, exp.in_channels, exp.image_size),
        exp.clients,
        method=exp.cfg,
        rounds=exp.rounds,
        evaluate=test_acc,
        participants=exp.participants,
        seed=exp.seed,
    )
    assert _strip(run.history) == _strip(reference)
    assert len(reference) == 2 and reference[-1]["bytes_up"] > 0
