"""The CNN on Flower, for every registered fedpm_dnn method, through the round driver (fedconvex.driver).

A SuperNode runs fedpm_dnn's ``client_round`` -- the very function the in-process simulator's sequential
engine runs -- for its one client, keeping that client's state (FOOF matrices, SCAFFOLD's control, ...) in
the node's ``Context.state``; ``CnnTransport`` brings the replies back as the DNN per-client reply dicts,
checks them against the server's own template and stacks them (``fedpm_flower.replies``), and the driver does
the rest as in-process: decoding, screening from the method's ``message_fields``, mixing weights, the method's
``server_update``, byte counts, history rows.
Per-client state the server's own steps write (FedPM's delta codec: the acknowledgement digests
``receive`` and ``server_update`` give each participant, fedpm_dnn.algorithms.fedpm_wire) stays in the server's state --
the only client state it holds, as the nodes keep the rest -- and goes to each client with its next
'train' message (``held_entries``); the node uses it for that round and does not keep it.
Data: the seeded synthetic task (every process rebuilds the same partitions), or a prepared data set
(``cfg.data_dir``; fedpm_flower.prepared): each SuperNode reads only its own folder."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import numpy as np
import torch

from fedconvex.driver import Delivery
from fedpm_dnn import foof
from fedpm_dnn.algorithms import applicable, make_method, method_class
from fedpm_dnn.data.augment import default_augment
from fedpm_dnn.data.synthetic import MEAN, STD, synthetic_task
from fedpm_dnn.engine.sequential import ClientData, client_round
from fedpm_dnn.engine.training_task import client_generator
from fedpm_dnn.engine.transport import check_and_stack, reply_template
from fedpm_dnn.models import make_model

from . import prepared
from .transport import FlowerTransport

log = logging.getLogger("fedpm.server")
CLASSES, IMAGE = 3, 16
# the synthetic task's clients hold 48 images each: batches of 16 give three local steps per epoch where the
# registry's default batch (64) would be a single full-batch step -- a test setting, not used on prepared data
SYNTHETIC_BATCH = 16
_CACHE = {}


def algorithm(cfg):
    """The fedpm_dnn method for the run's settings (those the method takes; every other hyper-parameter
    its registry default), then ``cfg.params`` (JSON) on top."""
    method_class(cfg.method)  # an unknown method is named as such, not as a missing hyper-parameter
    settings = dict(
        lr=cfg.lr,
        local_epochs=cfg.local_steps,
        weighting=cfg.weighting,
        precond_dtype="float16" if cfg.precond_dtype == "float16" else "float32",
        precond_codec=cfg.precond_codec,
    )
    if not cfg.data_dir:
        settings["batch_size"] = SYNTHETIC_BATCH
    extra = json.loads(cfg.params) if cfg.params else {}
    if not isinstance(extra, dict):
        raise ValueError(f"params {cfg.params!r}: expected a JSON object of hyper-parameters")
    return make_method(cfg.method, **{**applicable(cfg.method, settings), **extra})


def task(cfg):
    key = ("task", cfg.clients, cfg.seed)
    if key not in _CACHE:
        _CACHE[key] = synthetic_task(cfg.clients, seed=cfg.seed, classes=CLASSES, image_size=IMAGE)
    return _CACHE[key]


def shape(cfg) -> tuple:
    """(classes, channels, image size): the synthetic task's, or a prepared data set's (its server/ meta)."""
    if not cfg.data_dir:
        return CLASSES, 3, IMAGE
    m = prepared.meta(prepared.server_folder(cfg.data_dir))
    return m["num_classes"], m["channels"], m["image_size"]


def _shape_of(cfg, folder):
    if folder:  # a SuperNode knows the data set's shape from its own folder
        m = prepared.meta(folder)
        return m["num_classes"], m["channels"], m["image_size"]
    return shape(cfg)


def new_model(seed, classes=CLASSES, channels=3, image=IMAGE):
    torch.manual_seed(seed)
    model = make_model("cnn", classes, in_channels=channels, image_size=image)
    return model, foof.foof_blocks(model)


def client_data(cfg, partition, folder=None):
    """The node's data: its prepared folder (``folder``, from its node config; in simulation, without
    one, the prepared root's client-<partition>/), else its part of the synthetic task."""
    folder = folder or (prepared.client_folder(cfg.data_dir, partition) if cfg.data_dir else None)
    if folder:
        key = ("data", folder)
        if key not in _CACHE:
            x, y, meta = prepared.load(folder, "train.npz")
            augment = default_augment(str(meta.get("dataset", ""))) == "crop-flip"  # as validation.dnn's auto
            _CACHE[key] = ClientData(
                torch.as_tensor(x), torch.as_tensor(y), tuple(meta["mean"]), tuple(meta["std"]), augment=augment
            )
        return _CACHE[key]
    x, y = task(cfg)[0][partition]
    return ClientData(torch.as_tensor(x), torch.as_tensor(y), MEAN, STD)


# ------------------------------------------------------------------------------------ the wire
def flat(tree: dict, prefix: str = "") -> dict:
    """Nested dicts of tensors (a broadcast, a reply, a client state) -> {'a/b/c': numpy array}."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat(v, key + "/"))
        else:
            out[key] = v.detach().cpu().numpy()
    return out


def nest(arrays: dict) -> dict:
    """The inverse of ``flat``, as tensors.  A key that names both an array and a folder (a hostile reply)
    keeps the array: the structure check then rejects the reply."""
    out = {}
    for key, a in arrays.items():
        *path, last = key.split("/")
        node = out
        for p in path:
            node = node.setdefault(p, {}) if isinstance(node.get(p, {}), dict) else {}
        node[last] = torch.as_tensor(a)
    return out


HELD = "state/"  # the arrays of the server-held client state entries in a 'train' message


def held_entries(row: dict) -> tuple[dict, dict]:
    """A client's server-held state entries (``row``: what the server's steps wrote for it) for its 'train'
    message: (arrays under ``HELD``, config: 'state-held' -> JSON of its string entries and of the keys
    of its array entries)."""
    arrays, strings, tensors = {}, {}, []
    for key, v in row.items():
        if isinstance(v, str):
            strings[key] = v
        elif isinstance(v, (dict, torch.Tensor)):
            arrays.update(flat({key: v}, HELD))
            tensors.append(key)
        else:
            raise TypeError(f"client state {key!r}: cannot send a {type(v).__name__} to a node")
    return arrays, ({"state-held": json.dumps({"str": strings, "arrays": tensors})} if row else {})


def read_held(arrays: dict, config) -> tuple[dict, dict]:
    """A node's side of ``held_entries``: (the broadcast's arrays, the server-held entries)."""
    down = {k: v for k, v in arrays.items() if not k.startswith(HELD)}
    if "state-held" not in config:
        return down, {}
    spec = json.loads(str(config["state-held"]))
    held = nest({k[len(HELD) :]: v for k, v in arrays.items() if k.startswith(HELD)})
    return down, {**dict(spec["str"]), **{k: held[k] for k in spec["arrays"]}}


# ------------------------------------------------------------------------------------ a SuperNode
def client_train(cfg, partition: int, down: dict, round_: int, cs: dict, folder=None) -> tuple[dict, float, int]:
    """One round of client ``partition``: (reply, mean training loss, number of samples).  ``down`` is
    the broadcast and ``cs`` the client's persistent state (nested dicts of tensors), updated in place."""
    alg = algorithm(cfg)
    key = ("model", cfg.seed, _shape_of(cfg, folder))  # one model per data shape (a process may run several)
    if key not in _CACHE:
        _CACHE[key] = new_model(cfg.seed, *key[2])
    model, blocks = _CACHE[key]
    data = client_data(cfg, partition, folder)
    alg.prepare_client(cs, down)  # what a first participation needs (SCAFFOLD's zero control), as in-process
    reply, loss = client_round(alg, model, blocks, data, cs, down, client_generator(cfg.seed, round_, partition))
    return reply, loss, len(data)


# ------------------------------------------------------------------------------------ the ServerApp
def server_task(cfg):
    """(what ``receive``/``server_update`` see, the initial parameters): the in-process simulator's model."""
    model, blocks = new_model(cfg.seed, *shape(cfg))
    return SimpleNamespace(blocks=blocks, n_clients=cfg.clients), {
        k: v.detach().clone() for k, v in model.named_parameters()
    }


def client_sizes(cfg):
    """Samples per client where the server knows the split (the synthetic task; a prepared data set's
    ``client_sizes``), else None."""
    if not cfg.data_dir:
        return np.array([len(y) for _, y in task(cfg)[0]], dtype=np.float64)
    sizes = prepared.meta(prepared.server_folder(cfg.data_dir)).get("client_sizes")
    return np.asarray(sizes, dtype=np.float64) if sizes is not None and len(sizes) == cfg.clients else None


class CnnTransport(FlowerTransport):
    """The driver's transport for the CNN: node discovery, claims, drops and acknowledgements as for logreg
    (``FlowerTransport``); each sampled client's node gets the broadcast, and its reply -- the DNN reply
    dict -- is structure-checked and stacked as the in-process DNN transport does.  A node reports its
    number of samples (``weighting='samples'``) and its training loss with the reply."""

    def __init__(self, grid, cfg, blocks, sizes=None):
        super().__init__(grid, cfg, templates={}, d=None, shift=0.0, roles={})
        self.blocks = blocks
        # samples per client: the split's, where the server knows it (a node reporting otherwise is rejected:
        # with weighting='samples' an inflated count would buy it the round), else as its node reported them
        self.known = None if sizes is None else np.asarray(sizes, dtype=np.float64)
        self.sizes = np.zeros(cfg.clients) if sizes is None else self.known.copy()

    def __call__(self, alg, down, cstate, sel, rng, round_):
        arrays = flat(down)
        per_client, extra = {}, {}
        for k, c in enumerate(sel):  # the server-held entries of each client's state go with its message
            held, config = held_entries(cstate[k])
            per_client[int(c)] = {**arrays, **held}
            extra[int(c)] = {**config, **({"last-used": self.verdict[int(c)]} if int(c) in self.verdict else {})}
        got, rejected, dropped = self._exchange("train", per_client, round_, extra=extra)
        clients, replies, losses = [], [], []
        for c in sorted(got):
            m = self.metrics[c]
            n, loss = m.get("samples"), m.get("loss")
            if isinstance(n, bool) or not isinstance(n, int) or n < 1 or not isinstance(loss, float):
                log.warning(
                    "round %d: client %d rejected: sample count %r / loss %r are not a positive integer and a number",
                    round_,
                    c,
                    n,
                    loss,
                )
                rejected.append((c, "malformed metrics"))
                continue
            if self.known is not None and n != self.known[c]:
                log.warning(
                    "round %d: client %d rejected: reports %d samples, its partition has %d",
                    round_,
                    c,
                    n,
                    self.known[c],
                )
                rejected.append((c, "wrong sample count"))
                continue
            self.sizes[c] = n
            clients.append(c)
            replies.append(nest(got[c]))
            losses.append(loss)
        if dropped:
            log.warning("round %d: %d of %d clients did not reply (dropped)", round_, dropped, len(sel))
        template = reply_template(alg, down["params"], self.blocks)  # the server's own, never another reply
        up, kept, more = check_and_stack(template, replies, clients, round_)
        ok = [clients[k] for k in kept]
        # bytes as they travelled (FedPM's matrices may travel in float16)
        sent = sum(a.nbytes for c in ok for a in got[c].values())
        row = {"asked": len(sel), "dropped": dropped}
        if ok:
            row["train_loss"] = float(np.average([losses[k] for k in kept], weights=self.sizes[ok]))
        return Delivery(
            up=up, cstate=None, sel=np.asarray(ok, dtype=np.int64), rejected=rejected + more, extra=row, wire_bytes=sent
        )


def test_accuracy(cfg, theta: dict) -> float:
    """``theta``'s accuracy on the prepared data set's server/ test images."""
    from fedpm_dnn.engine.training_task import DnnTask

    x, y, meta = prepared.load(prepared.server_folder(cfg.data_dir), "test.npz")
    return DnnTask(new_model(cfg.seed, *shape(cfg))[0], []).accuracy(
        theta, torch.as_tensor(x), torch.as_tensor(y), tuple(meta["mean"]), tuple(meta["std"])
    )


def finite(state) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in state.theta.values())


def flat_theta(theta: dict) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in theta.values()]).numpy().astype(np.float64)


def in_process(cfg, tamper=None) -> np.ndarray:
    """The same method and data in fedpm_dnn's in-process simulator (sequential engine): final parameters,
    flattened.  The data: the synthetic task, or the prepared data set (``cfg.data_dir``: every client
    folder, read as its node reads it, and server/'s test set).  ``tamper(round, client, reply) -> reply``:
    fault injection (``run_experiment``)."""
    import os
    import tempfile

    from fedpm_dnn.engine.simulation import Experiment, run_experiment

    classes, channels, image = shape(cfg)
    if cfg.data_dir:
        clients = [client_data(cfg, i) for i in range(cfg.clients)]
        xt, yt, meta = prepared.load(prepared.server_folder(cfg.data_dir), "test.npz")
        mean, std = tuple(meta["mean"]), tuple(meta["std"])
    else:
        parts, (xt, yt) = task(cfg)
        clients = [ClientData(torch.as_tensor(x), torch.as_tensor(y), MEAN, STD) for x, y in parts]
        mean, std = MEAN, STD
    exp = Experiment(
        cfg=algorithm(cfg),
        model="cnn",
        num_classes=classes,
        clients=clients,
        x_test=torch.as_tensor(xt),
        y_test=torch.as_tensor(yt),
        mean=mean,
        std=std,
        rounds=cfg.rounds,
        participants=cfg.participants or None,
        seed=cfg.seed,
        in_channels=channels,
        image_size=image,
        max_ratio=cfg.max_ratio or None,
    )
    with tempfile.TemporaryDirectory() as tmp:
        ck = os.path.join(tmp, "ck.pt")
        run_experiment(exp, checkpoint=ck, tamper=tamper)
        params = torch.load(ck, weights_only=True)["server"]["params"]
    return flat_theta(params)
