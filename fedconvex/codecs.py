"""Preconditioner codecs: how FedPM's symmetric PSD matrices travel from a client to the server.

Shared by fedconvex (exact Hessian blocks on a client's active features), fedpm_dnn (FOOF
matrices, torch) and the Flower apps; backend-agnostic over NumPy and torch like
``fedconvex.mixing``.  A codec turns one symmetric n x n matrix into a *payload* -- a dict of
arrays, which is exactly what is sent and counted -- and back::

    payload        = codec.encode(M, state)                      # client
    est, new_state = codec.decode(payload, n, state, damping)     # server, and the client itself

``est`` is the matrix the server mixes (and, in fedconvex, the client's last local step uses),
``state`` is the per-client estimate of the stateful ``delta`` codec (None otherwise).
``decode`` validates what it receives -- keys, shapes, dtypes, index ranges, finiteness -- and
raises ``CodecError`` (a rejection of that client, not a crash) on anything malformed.

Codecs (``parse(spec)``):

``none``        the matrix as it is (no payload framing; callers keep their old path).
``sym``         the upper triangle, n(n+1)/2 entries of the matrix's dtype.  Lossless.
``fp16``        the upper triangle in IEEE half precision.
``bf16``        the upper triangle in bfloat16 (sent as its int16 bit pattern, so NumPy carries it).
``lowrank:R``   the top-R eigenpairs (partial eigensolver) plus the diagonal of the residual,
                M ~ V diag(l) V^T + diag(r); R absolute (``8``) or a fraction of n (``0.1``).
                PSD by construction (l, r clipped at 0: the residual of a PSD matrix has a
                non-negative diagonal).
``delta:C``     FedNL-style learned preconditioner.  Client and server keep an estimate A_hat;
                the first participation (and a resync) sends A in full (``sym``, counted), afterwards the client
                sends C(A - A_hat) with a compressor C of fedconvex.algorithms.compressors
                (``identity``, ``topk:K``, ``rankr:R``; K, R absolute or fractions) and both set
                A_hat <- A_hat + C(A - A_hat).  The server mixes with A_hat.

Resynchronising ``delta`` (``digest``, ``resync``).  A_hat may only move on a round the server *accepted*:
a reply that does not decode, fails screening or is an outlier must not change the server's estimate, and
the client cannot know the server's verdict by itself.  So both sides advance on acknowledged rounds only:

* the client encodes against its *committed* estimate and keeps the estimate its payload leads to as
  *pending*;
* the server decodes into a pending estimate too and commits it only for the clients it keeps after
  screening; it acknowledges to each participant ``digest`` of the estimate it now holds for that client
  (8 bytes; ``digest(None)`` when it holds none);
* before its next upload the client ``resync``s: pending if the server holds that, else committed if the
  server holds that (the round was rejected: both sides are where they were), else neither -- the
  estimates diverged (a payload altered in transit, a server that lost its state) and the client sends the
  full matrix again, which resets the server's estimate (``decode`` accepts a ``full`` payload any time).

Lossy codecs' decoded matrices (fp16, bf16, delta) get the PSD repair the FOOF clients already
apply (fedpm_dnn.foof.factorize): a matrix that fails the server's PSD screening has its negative
eigenvalues set to 0.  A deterministic function of the payload, so client and server agree exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .backend import is_torch, namespace

CODECS = ("none", "sym", "fp16", "bf16", "lowrank:R", "delta:identity", "delta:topk:K", "delta:rankr:R")


class CodecError(ValueError):
    """A payload that cannot be decoded (wrong keys, shapes, dtypes, indices, non-finite values)."""


# ---------------------------------------------------------------------------- backend helpers


def _xp(a):
    return namespace(a)


def _dtype_name(a) -> str:
    return str(a.dtype).split(".")[-1]


def _triu(xp, n, like):
    iu, ju = np.triu_indices(n)
    if is_torch(xp):
        return xp.as_tensor(iu, device=like.device), xp.as_tensor(ju, device=like.device)
    return iu, ju


def _zeros(xp, shape, like, dtype=None):
    dtype = like.dtype if dtype is None else dtype
    if is_torch(xp):
        return xp.zeros(shape, dtype=dtype, device=like.device)
    return xp.zeros(shape, dtype=dtype)


def _to_numpy64(a) -> np.ndarray:
    if is_torch(_xp(a)):
        return a.detach().cpu().to(dtype=__import__("torch").float64).numpy()
    return np.asarray(a, dtype=np.float64)


def _from_numpy(v: np.ndarray, like, dtype=None):
    xp = _xp(like)
    if is_torch(xp):
        return xp.as_tensor(np.ascontiguousarray(v), device=like.device, dtype=like.dtype if dtype is None else dtype)
    return np.ascontiguousarray(v, dtype=like.dtype if dtype is None else dtype)


def pack_upper(M):
    """The upper triangle (diagonal included), row by row: n(n+1)/2 entries."""
    xp = _xp(M)
    iu, ju = _triu(xp, M.shape[0], M)
    return M[iu, ju]


def unpack_upper(v, n: int):
    """The symmetric n x n matrix whose upper triangle is ``v`` (the inverse of ``pack_upper``)."""
    xp = _xp(v)
    iu, ju = _triu(xp, n, v)
    M = _zeros(xp, (n, n), v)
    M[ju, iu] = v
    M[iu, ju] = v
    return M


def _half_bits(M, kind: str):
    """Upper triangle rounded to fp16 (float16 array) or bf16 (int16 bit pattern, round to nearest even)."""
    xp = _xp(M)
    v = pack_upper(M)
    if kind == "fp16":
        return v.to(xp.float16) if is_torch(xp) else v.astype(np.float16)
    if is_torch(xp):
        return v.to(xp.float32).to(xp.bfloat16).view(xp.int16)
    bits = v.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest, ties to even
    return bits.astype(np.uint16).view(np.int16)


def _bf16_to_float32(bits):
    xp = _xp(bits)
    if is_torch(xp):
        return bits.view(xp.bfloat16).to(xp.float32)
    return (bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def psd_repair(M, damping: float = 0.0):
    """M unchanged if it passes the server's PSD screening (fedconvex.screening.psd_problem: one
    Cholesky), else M with its negative eigenvalues set to 0 -- the nearest PSD matrix, as
    fedpm_dnn.foof.factorize repairs a FOOF matrix.  ``damping`` is not added here: the mixing
    adds it to every matrix alike."""
    from .screening import psd_problem

    xp = _xp(M)
    if M.shape[0] == 0 or psd_problem(M) is None:
        return M
    if is_torch(xp):
        w, V = xp.linalg.eigh(M.to(xp.float64))
        P = (V * w.clamp(min=0)) @ V.T
        return (0.5 * (P + P.T)).to(M.dtype)
    w, V = np.linalg.eigh(np.asarray(M, dtype=np.float64))
    P = (V * np.maximum(w, 0)) @ V.T
    return (0.5 * (P + P.T)).astype(M.dtype)


def top_eigenpairs(M, r: int):
    """The r largest eigenvalues (ascending) and their eigenvectors of a symmetric matrix.

    NumPy and CPU torch: LAPACK's partial solver (scipy.linalg.eigh(subset_by_index), MRRR),
    which computes only the r wanted pairs; other devices: a full eigh, sliced."""
    xp = _xp(M)
    n = M.shape[0]
    if r <= 0:
        return _zeros(xp, (0,), M), _zeros(xp, (n, 0), M)
    if is_torch(xp) and M.device.type != "cpu":
        w, V = xp.linalg.eigh(M.to(xp.float64))
        return w[n - r :].to(M.dtype), V[:, n - r :].to(M.dtype)
    from scipy.linalg import eigh

    w, V = eigh(_to_numpy64(M), subset_by_index=[n - r, n - 1], driver="evr")
    return _from_numpy(w, M), _from_numpy(V, M)


# ---------------------------------------------------------------------------- validation


def _check_keys(payload, keys):
    if not isinstance(payload, dict):
        raise CodecError(f"payload is a {type(payload).__name__}, expected a dict of arrays")
    if set(payload) != set(keys):
        raise CodecError(f"payload has keys {sorted(payload)}, expected {sorted(keys)}")
    for k in keys:
        if not hasattr(payload[k], "shape") or not hasattr(payload[k], "dtype"):
            raise CodecError(f"payload[{k!r}] is not an array")


def _check(payload, key, shape, dtypes):
    a = payload[key]
    if tuple(a.shape) != tuple(shape):
        raise CodecError(f"payload[{key!r}] has shape {tuple(a.shape)}, expected {tuple(shape)}")
    name = _dtype_name(a)
    if name not in dtypes:
        raise CodecError(f"payload[{key!r}] has dtype {name}, expected {' or '.join(dtypes)}")
    if name.startswith(("float", "bfloat")):
        xp = _xp(a)
        if not bool(xp.all(xp.isfinite(a))):
            raise CodecError(f"payload[{key!r}] contains NaN or Inf")
    return a


FLOATS = ("float64", "float32")


def _count(spec_value: str, total: int, what: str) -> int:
    """An absolute count ('8') or a fraction of ``total`` ('0.1'), clipped to 1..total; 0 of nothing (a client
    without features has a 0 x 0 block: an empty payload, not one entry it does not have)."""
    s = str(spec_value)
    try:
        x = float(s)
    except ValueError:
        raise ValueError(f"{what} must be a count or a fraction, got {s!r}") from None
    if not (x > 0 and math.isfinite(x)):
        raise ValueError(f"{what} must be > 0, got {s!r}")
    if x < 1:
        k = math.ceil(x * total)
    elif x == int(x):
        k = int(x)
    else:
        raise ValueError(f"{what} must be an integer or a fraction in (0, 1), got {s!r}")
    return max(1, min(total, k)) if total else 0


# ---------------------------------------------------------------------------- codecs


@dataclass(frozen=True)
class Codec:
    """Base class; ``spec`` is the string it was parsed from."""

    spec: str
    lossless = False
    stateful = False

    def encode(self, M, state=None) -> dict:
        raise NotImplementedError

    def decode(self, payload, n: int, state=None, damping: float = 0.0):
        raise NotImplementedError

    def payload_bytes(self, n: int, itemsize: int = 4, first: bool = False) -> int:
        """Bytes of one n x n matrix's payload, by formula (``first``: a delta codec's first upload)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Sym(Codec):
    lossless = True

    def encode(self, M, state=None):
        return {"upper": pack_upper(M)}

    def decode(self, payload, n, state=None, damping=0.0):
        _check_keys(payload, ("upper",))
        v = _check(payload, "upper", (n * (n + 1) // 2,), FLOATS)
        return unpack_upper(v, n), None

    def payload_bytes(self, n, itemsize=4, first=False):
        return n * (n + 1) // 2 * itemsize


@dataclass(frozen=True)
class Half(Codec):
    kind: str = "fp16"  # 'fp16' | 'bf16'

    def encode(self, M, state=None):
        return {"upper": _half_bits(M, self.kind)}

    def decode(self, payload, n, state=None, damping=0.0):
        _check_keys(payload, ("upper",))
        m = n * (n + 1) // 2
        if self.kind == "fp16":
            v = _check(payload, "upper", (m,), ("float16",))
            xp = _xp(v)
            v = v.to(xp.float32) if is_torch(xp) else v.astype(np.float32)
        else:
            v = _bf16_to_float32(_check(payload, "upper", (m,), ("int16",)))
            xp = _xp(v)
            if not bool(xp.all(xp.isfinite(v))):
                raise CodecError("payload['upper'] contains NaN or Inf")
        if not is_torch(xp):  # NumPy callers (fedconvex) work in float64: repair at that precision
            v = v.astype(np.float64)
        return psd_repair(unpack_upper(v, n), damping), None

    def payload_bytes(self, n, itemsize=4, first=False):
        return n * (n + 1) // 2 * 2


@dataclass(frozen=True)
class LowRank(Codec):
    rank: str = "8"  # absolute or a fraction of n

    def r(self, n: int) -> int:
        return _count(self.rank, n, "lowrank rank")

    def encode(self, M, state=None):
        n = M.shape[0]
        w, V = top_eigenpairs(M, self.r(n))
        xp = _xp(M)
        w = w.clamp(min=0) if is_torch(xp) else np.maximum(w, 0)
        resid = xp.diagonal(M) - ((V * V) * w[None, :]).sum(1)
        resid = resid.clamp(min=0) if is_torch(xp) else np.maximum(resid, 0)
        return {"eigvals": w, "eigvecs": V, "diag": resid}

    def decode(self, payload, n, state=None, damping=0.0):
        _check_keys(payload, ("eigvals", "eigvecs", "diag"))
        r = self.r(n)
        w = _check(payload, "eigvals", (r,), FLOATS)
        V = _check(payload, "eigvecs", (n, r), FLOATS)
        D = _check(payload, "diag", (n,), FLOATS)
        xp = _xp(w)
        if _dtype_name(V) != _dtype_name(w) or _dtype_name(D) != _dtype_name(w):
            raise CodecError("payload arrays of mixed dtypes")
        if bool((w < 0).any()) or bool((D < 0).any()):
            raise CodecError("negative eigenvalue or diagonal in a low-rank payload")
        M = (V * w[None, :]) @ V.T
        M = 0.5 * (M + M.T)
        idx = xp.arange(n, device=w.device) if is_torch(xp) else np.arange(n)
        M[idx, idx] += D
        return M, None

    def payload_bytes(self, n, itemsize=4, first=False):
        r = self.r(n)
        return (r + n * r + n) * itemsize


@dataclass(frozen=True)
class Delta(Codec):
    compressor: str = "identity"  # 'identity' | 'topk' | 'rankr'
    amount: str | None = None  # K or R: absolute or a fraction
    stateful = True

    def _size(self, n):
        if self.compressor == "topk":
            return _count(self.amount, n * (n + 1) // 2, "topk K")
        if self.compressor == "rankr":
            return _count(self.amount, n, "rankr R")
        return None

    def _compressor(self, n):
        from .algorithms.compressors import RankR, TopK

        return TopK(self._size(n)) if self.compressor == "topk" else RankR(self._size(n))

    def encode(self, M, state=None):
        if state is None:  # first participation: the matrix itself
            return {"full": pack_upper(M)}
        diff = M - state
        if self.compressor == "identity":
            return {"upper": pack_upper(diff)}
        n = M.shape[0]
        msg = self._compressor(n).encode(np, _to_numpy64(diff)[None], None)
        if self.compressor == "topk":
            return {"values": _from_numpy(msg["values"][0], M), "index": _from_numpy(msg["index"][0], M, _int32(M))}
        return {"eigvals": _from_numpy(msg["eigvals"][0], M), "eigvecs": _from_numpy(msg["eigvecs"][0], M)}

    def decode(self, payload, n, state=None, damping=0.0):
        if state is None or (isinstance(payload, dict) and "full" in payload):  # a full upload (re)sets A_hat
            _check_keys(payload, ("full",))
            new = unpack_upper(_check(payload, "full", (n * (n + 1) // 2,), FLOATS), n)
        else:
            new = state + self._correction(payload, n, state)
        return psd_repair(new, damping), new

    def _correction(self, payload, n, like):
        m = n * (n + 1) // 2
        if self.compressor == "identity":
            _check_keys(payload, ("upper",))
            S = unpack_upper(_check(payload, "upper", (m,), FLOATS), n)
            return S.to(like.dtype) if is_torch(_xp(like)) else S.astype(like.dtype, copy=False)
        k = self._size(n)
        if self.compressor == "topk":
            _check_keys(payload, ("values", "index"))
            vals = _check(payload, "values", (k,), FLOATS)
            idx = _check(payload, "index", (k,), ("int32", "int64"))
            idx_np = np.asarray(idx.cpu() if is_torch(_xp(idx)) else idx, dtype=np.int64)
            if k and (idx_np.min() < 0 or idx_np.max() >= m):
                raise CodecError(f"payload['index'] outside 0..{m - 1}")
            if len(np.unique(idx_np)) != k:
                raise CodecError("payload['index'] has repeated entries")
            S = self._compressor(n).decode(np, {"values": _to_numpy64(vals)[None], "index": idx_np[None]}, n)[0]
        else:
            _check_keys(payload, ("eigvals", "eigvecs"))
            w = _check(payload, "eigvals", (k,), FLOATS)
            V = _check(payload, "eigvecs", (n, k), FLOATS)
            S = self._compressor(n).decode(np, {"eigvals": _to_numpy64(w)[None], "eigvecs": _to_numpy64(V)[None]}, n)[0]
        return _from_numpy(S, like)

    def payload_bytes(self, n, itemsize=4, first=False):
        m = n * (n + 1) // 2
        if first or self.compressor == "identity":
            return m * itemsize
        k = self._size(n)
        if self.compressor == "topk":
            return k * (itemsize + 4)  # values + int32 indices
        return (k + n * k) * itemsize  # eigenvalues + eigenvectors


def _int32(like):
    xp = _xp(like)
    return xp.int32 if is_torch(xp) else np.int32


def parse(spec: str | None) -> Codec | None:
    """The codec named by ``spec`` (None for 'none'); ValueError with the choices otherwise."""
    if spec is None or spec == "none":
        return None
    parts = str(spec).split(":")
    try:
        if parts == ["sym"]:
            return Sym(spec)
        if parts[0] in ("fp16", "bf16") and len(parts) == 1:
            return Half(spec, parts[0])
        if parts[0] == "lowrank" and len(parts) == 2:
            _count(parts[1], 10**6, "lowrank rank")
            return LowRank(spec, parts[1])
        if parts[0] == "delta":
            if parts[1:] == ["identity"]:
                return Delta(spec, "identity")
            if len(parts) == 3 and parts[1] in ("topk", "rankr"):
                _count(parts[2], 10**6, f"{parts[1]} size")
                return Delta(spec, parts[1], parts[2])
    except (ValueError, IndexError) as exc:
        raise ValueError(f"precond codec {spec!r}: {exc}") from None
    raise ValueError(
        f"unknown precond codec {spec!r}; choose from {', '.join(CODECS)} (R, K: a count or a fraction such as 0.1)"
    )


def validate(spec: str) -> str:
    """``spec`` if it names a codec (for argparse and config dataclasses)."""
    parse(spec)
    return spec


def digest(estimate) -> str:
    """A short fingerprint (16 hex digits, blake2b) of a delta estimate: a matrix, a dict of matrices (by
    name), or None / an empty dict (no estimate).  Equal digests <=> the same dtypes, shapes and bits."""
    import hashlib

    h = hashlib.blake2b(digest_size=8)
    if estimate is None or (isinstance(estimate, dict) and not estimate):
        h.update(b"none")
        return h.hexdigest()
    items = sorted(estimate.items()) if isinstance(estimate, dict) else [("", estimate)]
    for name, M in items:
        if M is None:
            h.update(f"{name}:none;".encode())
            continue
        if is_torch(_xp(M)):
            raw = M.detach().cpu().contiguous().reshape(-1).view(__import__("torch").uint8).numpy().tobytes()
        else:
            raw = np.ascontiguousarray(M).tobytes()
        h.update(f"{name}:{_dtype_name(M)}:{tuple(M.shape)};".encode())
        h.update(raw)
    return h.hexdigest()


NO_ESTIMATE = digest(None)


def resync(committed, pending, ack):
    """The estimate a client encodes its next delta against, given the server's acknowledgement ``ack``
    (``digest`` of the estimate the server holds for it; None: nothing acknowledged yet, i.e. no estimate):
    ``pending`` if the server took the last upload, ``committed`` if it rejected it, else None (send the
    full matrix again)."""
    ack = NO_ESTIMATE if ack is None else ack
    if pending is not None and digest(pending) == ack:
        return pending
    if digest(committed) == ack:
        return committed
    return None


def payload_nbytes(payload) -> int:
    """Bytes of a payload as sent (its arrays' raw buffers)."""
    from .backend import nbytes

    if isinstance(payload, dict):
        return sum(payload_nbytes(v) for v in payload.values())
    return nbytes(payload)


class DecodeProblems(tuple):
    """Per participant: None, or why its payload could not be decoded (screening rejects those)."""

    nbytes = 0
