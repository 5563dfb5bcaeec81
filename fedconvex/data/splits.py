"""Client splits: sequential (the paper / FedNL reference code), shuffled, and Dirichlet
label skew (Vogels et al. 2021, RelaySum).  Each returns a list of row-index arrays, one
per client; every returned row belongs to exactly one client.
"""

from __future__ import annotations

import numbers

import numpy as np

from .libsvm import DataError


def _integers(**counts) -> None:
    """TypeError for a count that is not an integer (1.5 clients, True, '2'); NumPy integers are integers."""
    for name, v in counts.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{name} must be an integer, got {v!r}")


def _check_counts(n_rows: int, clients: int, per_client: int | None) -> int:
    _integers(n_rows=n_rows, clients=clients, **({} if per_client is None else {"per_client": per_client}))
    if clients < 1:
        raise DataError(f"clients must be >= 1, got {clients}")
    if per_client is None:
        per_client = n_rows // clients
    if per_client < 1:
        raise DataError(f"{n_rows} rows cannot give {clients} clients at least one row each")
    if clients * per_client > n_rows:
        raise DataError(
            f"{clients} clients x {per_client} rows = {clients * per_client} exceeds the {n_rows} rows available"
        )
    return per_client


def sequential_split(n_rows: int, clients: int, per_client: int | None = None) -> list[np.ndarray]:
    """Client i gets rows [i*M, (i+1)*M) in file order (FedNL's reference split)."""
    m = _check_counts(n_rows, clients, per_client)
    return [np.arange(i * m, (i + 1) * m) for i in range(clients)]


def shuffled_split(n_rows: int, clients: int, per_client: int | None = None, seed: int = 0) -> list[np.ndarray]:
    """Equal-size clients from a seeded random permutation of the rows."""
    m = _check_counts(n_rows, clients, per_client)
    perm = np.random.default_rng(seed).permutation(n_rows)
    return [np.sort(perm[i * m : (i + 1) * m]) for i in range(clients)]


def dirichlet_split(
    labels, clients: int, alpha: float, seed: int = 0, min_size: int = 1, max_tries: int = 100
) -> list[np.ndarray]:
    """Label-skewed clients of unequal sizes (Vogels et al. 2021).

    For each class, proportions p ~ Dir(alpha * 1_N) over the clients split that class's
    (shuffled) samples; smaller alpha means stronger heterogeneity.  Draws are repeated until
    every client holds ``min_size`` samples; if ``max_tries`` draws all leave a client short
    (few classes, tiny alpha), the last draw is repaired by moving single random samples from
    the largest clients to the short ones, which always succeeds when enough samples exist.
    """
    labels = np.asarray(labels)
    _integers(clients=clients, min_size=min_size, max_tries=max_tries)
    if clients < 1:
        raise DataError(f"clients must be >= 1, got {clients}")
    if not alpha > 0:
        raise DataError(f"Dirichlet alpha must be > 0, got {alpha}")
    if clients * min_size > len(labels):
        raise DataError(f"{len(labels)} samples cannot give {clients} clients {min_size} samples each")
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(clients)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            p = rng.dirichlet(np.full(clients, float(alpha)))
            cuts = (np.cumsum(p)[:-1] * len(idx)).astype(int)
            for i, chunk in enumerate(np.split(idx, cuts)):
                parts[i].append(chunk)
        out = [np.concatenate(p) for p in parts]
        if min(len(p) for p in out) >= min_size:
            return [np.sort(p) for p in out]
    out = [list(p) for p in out]
    for i in range(clients):
        while len(out[i]) < min_size:
            donor = max(range(clients), key=lambda j: len(out[j]))
            out[i].append(out[donor].pop(int(rng.integers(len(out[donor])))))
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in out]


def _relaysum_draw(labels, clients: int, alpha: float, seed: int, min_fraction: float, max_tries: int):
    """The accepted draw of ``relaysum_split``: per client, its class chunks in the order they were dealt."""
    labels = np.asarray(labels)
    n = len(labels)
    _integers(clients=clients, max_tries=max_tries)
    if clients < 1:
        raise DataError(f"clients must be >= 1, got {clients}")
    if not (alpha > 0 and np.isfinite(alpha)):
        raise DataError(f"Dirichlet alpha must be a finite number > 0, got {alpha}")
    if not 0 <= min_fraction <= 1:
        raise DataError(f"min_fraction must be in [0, 1], got {min_fraction}")
    if n < clients:
        raise DataError(f"{n} samples cannot give {clients} clients one sample each")
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    by_class = [np.flatnonzero(labels == c) for c in classes]
    cap, floor = n / clients, max(1.0, min_fraction * n / clients)
    concentration = np.full(clients, float(alpha))
    ends = np.zeros(clients + 1, dtype=np.int64)  # 0, the cuts, the class's size: chunk i is ends[i]:ends[i + 1]
    for _ in range(max_tries):
        sizes = np.zeros(clients)
        dealt = []  # per class: its shuffled samples and where they are cut between the clients
        for members in by_class:
            idx = rng.permutation(members)
            open_ = sizes < cap
            p = rng.dirichlet(concentration) * open_
            total = p.sum()
            if not total > 0:  # every open share underflowed (alpha << 1): deal evenly among them
                p = open_.astype(float)
                total = p.sum()
            cuts = (np.cumsum(p / total)[:-1] * len(idx)).astype(int)
            ends[1:-1], ends[-1] = cuts, len(idx)
            sizes += ends[1:] - ends[:-1]  # the sizes of the chunks np.split(idx, cuts) gives
            dealt.append((idx, cuts))
        if sizes.min() >= floor:  # chunks are made for the accepted draw only: most draws of a hard split are not
            parts: list[list[np.ndarray]] = [[] for _ in range(clients)]
            for idx, cuts in dealt:
                for i, chunk in enumerate(np.split(idx, cuts)):
                    parts[i].append(chunk)
            return [np.concatenate(p) for p in parts]
    raise DataError(
        f"no Dirichlet(alpha={alpha:g}) split of {n} samples over {clients} clients gave every client "
        f">= {min_fraction:g} of the mean size in {max_tries} draws; raise alpha or use fewer clients"
    )


def relaysum_split(
    labels, clients: int, alpha: float, seed: int = 0, min_fraction: float = 0.5, max_tries: int = 10_000
) -> list[np.ndarray]:
    """The Dirichlet split as the paper cites it (Vogels et al. 2021, RelaySum, whose code uses
    Tao Lin's partitioner): classes are dealt one after another, each by proportions
    p ~ Dir(alpha * 1_K) over the K clients, except that a client already holding >= n/K samples
    gets no further share (its proportion is zeroed, the rest renormalised).  The whole draw is
    repeated (from the same seeded stream) until every client holds >= ``min_fraction`` * n/K
    samples.  Sizes stay unequal; every sample goes to exactly one client.

    The cap can never exclude every client: until the last class is dealt, fewer than n samples
    are held, so at least one client holds fewer than n/K.
    """
    return [np.sort(p) for p in _relaysum_draw(labels, clients, alpha, seed, min_fraction, max_tries)]


def relaysum_even_split(
    labels, clients: int, alpha: float, seed: int = 0, min_fraction: float = 0.5, max_tries: int = 10_000
) -> list[np.ndarray]:
    """RelaySum's ``dirichlet_split`` with ``distribute_evenly=True``, the default its CIFAR task trains with:
    the ``relaysum_split`` draw, its clients' samples concatenated (client 0's first, each client's in the order
    they were dealt: class by class, shuffled within a class) and cut into K consecutive pieces of equal size
    (``np.array_split``: the first n mod K pieces one sample larger).  Every client holds n/K samples, and a
    client mixes the tail of one drawn client with the head of the next, so it holds more classes than a
    ``relaysum`` client: at alpha = 0.1 this is the milder split (``validation.splits`` tabulates it)."""
    drawn = _relaysum_draw(labels, clients, alpha, seed, min_fraction, max_tries)
    return [np.sort(p) for p in np.array_split(np.concatenate(drawn), clients)]


def client_class_counts(labels, parts) -> np.ndarray:
    """(clients, classes) table of per-client sample counts, classes in sorted order."""
    labels = np.asarray(labels)
    classes = np.unique(labels)
    return np.stack([(labels[p][:, None] == classes[None, :]).sum(0) for p in parts])


def effective_classes(counts) -> np.ndarray:
    """Per client, exp of the entropy of its class shares (the perplexity): the number of equally held classes
    that would be as mixed -- 1 for a client holding one class, C for one holding all C alike.  Classes a
    client lacks add nothing (0 log 0 = 0)."""
    counts = np.asarray(counts, dtype=np.float64)
    shares = counts / counts.sum(axis=1, keepdims=True)
    logs = np.log(np.where(shares > 0, shares, 1.0))
    return np.exp(-(shares * logs).sum(axis=1))
