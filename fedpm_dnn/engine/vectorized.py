"""Vectorized engine: the round's participants trained together on one device, clients as a batch axis.

The participants' parameters are stacked on a leading client axis and every local step is one
forward (``stacked_model.StackedModel``: grouped convolutions, batched matrix products; other layer types
through ``vmap`` over ``functional_call``; on the CPU the model client by client inside the one graph,
``StackedModel.per_client``) and one backward for all of them -- FedJAX's ``ClientBlock`` recipe in PyTorch.  The
result is the
sequential engine's (``sequential.local_train`` / ``sequential.client_round``), client by client:

* random streams: each client's generator is consumed on the CPU in exactly the sequential order
  (first-participation FOOF subset, per epoch ``randperm``, per batch the crop offsets oy, ox and
  the flip mask, refresh subsets, end-of-round subset) before training; the draws are then applied
  in batch;
* unequal client sizes: batches are padded to ``batch_size`` with a mask (a last partial batch, a
  client smaller than one batch); a client that has taken all its steps drops out of the stack
  (no update) while the others go on;
* the step: gradient (+ the method's ``grad_hook`` on the stacks, + coupled weight decay),
  per-client clipping of the raw gradient or of the step direction, FOOF preconditioning with
  batched triangular solves or one batched product with the round's inverse (``foof.direction``,
  ``--foof-apply``; on CUDA replayed as one graph per step, ``solve_graph``), theta -= lr direction,
  decoupled weight decay;
* the steps every client of a chunk takes (all but the last few of a client that finishes early) as one function
  of static buffers, on CUDA captured once per chunk and round and replayed as one CUDA graph a step
  (``step_graph``, ``--step-graph``; the partial steps stay in the loop below);
* FOOF matrices from batched Gram products (``foof.batched``) with the same first-layer cache.

Replies are built by the method's ``client_reply``, shared with the sequential engine, so the message
format, codecs and screening apply unchanged.  Clients are processed in chunks of ``client_chunk``
when the whole stack does not fit in memory (chosen from the free device memory by default).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch.func import functional_call, vmap

from .. import foof
from ..data.augment import crop_flip
from ..foof import batched, precision, solve_graph
from . import checkpoint, stacked_model, step_graph
from .sequential import batch_starts_end

STATS_BATCH = 512  # the sequential path's plain-data chunk (sequential.ClientData.plain_batches)
PAD = 4  # augment.random_crop_flip's padding


def _subset(cfg, n, gen):
    """The FOOF-sample draw of client.foof_matrices (None: the whole data, cache allowed)."""
    if cfg.foof_samples is None or cfg.foof_samples >= n:
        return None
    return torch.randperm(n, generator=gen)[: cfg.foof_samples]


def client_schedule(cfg, data, gen, first_foof: bool) -> dict:
    """Every draw the sequential client makes from ``gen`` in one round, in the same order."""
    n, B = len(data), cfg.batch_size
    sched = {"first": _subset(cfg, n, gen) if first_foof else None, "steps": [], "refresh": {}}
    steps = 0
    for _ in range(cfg.local_epochs):
        order = torch.randperm(n, generator=gen)
        for s in range(0, batch_starts_end(n, B, cfg.last_batch), B):
            idx = order[s : s + B]
            b = len(idx)
            if data.augment:
                oy = torch.randint(0, 2 * PAD + 1, (b,), generator=gen)
                ox = torch.randint(0, 2 * PAD + 1, (b,), generator=gen)
                flip = torch.rand(b, generator=gen) < 0.5
            else:  # an offset of PAD in the padded image, no flip: the image itself
                oy = ox = torch.full((b,), PAD, dtype=torch.long)
                flip = torch.zeros(b, dtype=torch.bool)
            sched["steps"].append((idx, oy, ox, flip))
            steps += 1
            if cfg.uses_foof and cfg.refresh_every and steps % cfg.refresh_every == 0:
                sched["refresh"][steps] = _subset(cfg, n, gen)
    sched["end"] = _subset(cfg, n, gen) if cfg.uses_foof else None
    return sched


def _pad(rows, width, fill=0, dtype=torch.long):
    out = torch.full((len(rows), width), fill, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def schedule_tensors(steps: list, offsets: list, T: int, B: int) -> tuple:
    """The round's draws as (T, K, B) tensors (gidx, mask, oy, ox, flip) from each client's ``client_schedule``
    steps [(idx, oy, ox, flip)] and its first row in the engine's data (``offsets``): rows beyond a batch's draws read
    the client's first image, masked out; steps after a client's last are all padding.  One write per tensor and
    client, not per step: each write is a host operator, and a round has hundreds of steps."""
    K = len(steps)
    gidx = torch.zeros(T, K, B, dtype=torch.long)
    mask = torch.zeros(T, K, B, dtype=torch.bool)
    oy = torch.full((T, K, B), PAD, dtype=torch.long)
    ox = torch.full((T, K, B), PAD, dtype=torch.long)
    flip = torch.zeros(T, K, B, dtype=torch.bool)
    for j, (own, offset) in enumerate(zip(steps, offsets, strict=True)):
        n = len(own)
        lens = torch.tensor([len(st[0]) for st in own])
        t_of = torch.repeat_interleave(torch.arange(n), lens)  # each drawn row's step and place in its batch
        b_of = torch.arange(len(t_of)) - torch.repeat_interleave(lens.cumsum(0) - lens, lens)
        gidx[:n, j] = offset
        gidx[t_of, j, b_of] = torch.cat([st[0] for st in own]) + offset
        mask[t_of, j, b_of] = True
        oy[t_of, j, b_of] = torch.cat([st[1] for st in own])
        ox[t_of, j, b_of] = torch.cat([st[2] for st in own])
        flip[t_of, j, b_of] = torch.cat([st[3] for st in own])
    return gidx, mask, oy, ox, flip


_clip_ = step_graph.clip_  # torch.nn.utils.clip_grad_norm_ per client on (K, ...) stacks


FREE_SHARE = 0.7  # of the free memory a chunk may plan for (the allocator's fragmentation, the model's misses)
STATS_SHARED_BYTES = 4 * 2 * 2**25  # a statistics pass's patches and their copy (foof._chunk), whatever its clients


def memory_model(model, cfg, sample, blocks) -> dict:
    """Bytes per client of the engine's phases, from one forward's outputs:

    * ``train``: a local step -- the parameters and their per-step copies (8 x), the activations a backward keeps
      for a batch (3 x their outputs, as measured for autograd's saved tensors and gradients), and for FOOF methods
      the round's factorisation: the stacked float64 A, its float64 factor and the float32 step operators
      (24 bytes per matrix entry);
    * ``stats``: a statistics pass over ``STATS_BATCH`` plain images -- every block's captured input and the
      forward's two largest outputs at a time, the float64 sums, the matrices and a client's own copy of them
      (24 bytes per matrix entry); 0 for a method without FOOF;
    * ``state``: the FOOF matrices a client keeps between rounds (``foof_state_dtype``); ``reply``: their float32
      copy in its reply (none when they are kept in float32).
    The statistics pass's patch products take ``STATS_SHARED_BYTES`` for the whole stack."""
    sizes, inputs = [], [0]
    block_modules = {b.module for b in blocks.values()}

    def hook(mod, inp, out):
        sizes.append(out.numel() if torch.is_tensor(out) else 0)
        if mod in block_modules and inp and torch.is_tensor(inp[0]):
            inputs[0] += inp[0].numel()

    hooks = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
    try:
        with torch.no_grad(), foof.buffers_kept(model):  # a BatchNorm's running statistics stay as they were
            model(sample[:1])
    finally:
        for h in hooks:
            h.remove()
    act = sum(sizes) + sample[:1].numel() * 3
    params = sum(p.numel() for p in model.parameters())
    mats = sum((b.module.weight[0].numel() + 1) ** 2 for b in blocks.values()) if cfg.uses_foof else 0
    largest = sum(sorted(sizes)[-2:])
    kept = 4 if getattr(cfg, "foof_state_dtype", "float64") == "float32" else 8
    return {
        "train": 4 * (8 * params + 3 * act * cfg.batch_size) + 24 * mats,
        "stats": 4 * (inputs[0] + largest) * STATS_BATCH + 24 * mats if cfg.uses_foof else 0,
        "state": kept * mats,
        "reply": 4 * mats if kept == 8 else 0,  # a float32 state is sent as it is
    }


def _cuda_memory(device) -> tuple:
    free, _ = torch.cuda.mem_get_info(device)
    return free, torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)


def _host_memory(device) -> tuple | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, 0, 0
    except OSError:
        pass
    return None


def free_bytes(device, query=None) -> int | None:
    """Memory a chunk may take on ``device``: the free memory plus what PyTorch's caching allocator holds reserved
    but unallocated (it hands that out again before asking the driver for more).  ``query(device)`` gives
    (free, reserved, allocated) or None (unknown); by default CUDA's ``mem_get_info`` free,
    ``memory_reserved`` and ``memory_allocated``, on the CPU (MemAvailable, 0, 0)."""
    dev = torch.device(device)
    q = query or (_cuda_memory if dev.type == "cuda" else _host_memory)
    got = q(dev)
    if got is None:
        return None
    free, reserved, allocated = got
    return int(free + max(0, reserved - allocated))


def client_plan(model, cfg, sample, blocks, device, participants: int, new_states: int = 0, query=None) -> dict:
    """The training chunk and what it was sized from: ``memory_model``'s bytes per client, the free bytes
    (``free_bytes``), and ``chunk`` -- as many clients as fit in ``FREE_SHARE`` of the free memory after the
    round's kept matrices (``new_states`` clients' first, every participant's reply copy), one client's
    statistics pass and the pass's shared patches; at least one, all of them where the free memory is unknown."""
    per = memory_model(model, cfg, sample, blocks)
    free = free_bytes(device, query)
    plan = {"train_bytes_per_client": per["train"], "stats_bytes_per_client": per["stats"], "free_bytes": free}
    if free is None:
        return {**plan, "chunk": participants}
    kept = new_states * per["state"] + participants * per["reply"]
    room = FREE_SHARE * free - kept - (per["stats"] + STATS_SHARED_BYTES if per["stats"] else 0)
    return {**plan, "chunk": max(1, min(participants, int(room // max(per["train"], 1))))}


def auto_client_chunk(model, cfg, sample, blocks, device, participants: int, query=None) -> int:
    """Clients per training chunk (``client_plan``)."""
    return client_plan(model, cfg, sample, blocks, device, participants, query=query)["chunk"]


def stats_client_chunk(stats_bytes: int, device, clients: int, query=None) -> int:
    """Clients per statistics pass, sized on its own from what is free when it starts: as many as fit in
    ``FREE_SHARE`` of it after the shared patches, at least one, all where the free memory is unknown."""
    free = free_bytes(device, query)
    if free is None or not stats_bytes:
        return clients
    room = FREE_SHARE * free - STATS_SHARED_BYTES
    return max(1, min(clients, int(room // stats_bytes)))


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation failure: CUDA's out-of-memory error, or the CPU allocator's."""
    text = str(exc)
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text


def _state_copy(cs: dict) -> dict:
    """A client state as a round found it: its entries, and the dicts among them (filled in place) copied."""
    return {k: dict(v) if isinstance(v, dict) else v for k, v in cs.items()}


def _stack_downs(downs: list, rows=None) -> dict:
    """Broadcasts of several runs as one: every tensor entry (field -> {name: tensor}) stacked over the
    participants (``rows``: only those), other entries taken from the first."""
    rows = range(len(downs)) if rows is None else rows
    out = {}
    for key, value in downs[0].items():
        if isinstance(value, dict) and all(torch.is_tensor(v) for v in value.values()):
            out[key] = {n: torch.stack([downs[j][key][n] for j in rows]) for n in value}
        else:
            out[key] = value
    return out


class VectorizedEngine:
    """Trains a list of participants together; ``round(...)`` returns what client_round returns, per client."""

    def __init__(
        self,
        model,
        blocks: dict,
        clients: list,
        device,
        client_chunk: int | None = None,
        step_graph_mode="auto",
        memory_query=None,
    ):
        self.model, self.blocks, self.clients, self.device = model, blocks, clients, device
        self.client_chunk = client_chunk
        self.memory_query = memory_query  # free_bytes' query (None: the device's own)
        # full steps as one function of static buffers, on CUDA replayed as a graph (fedpm_dnn.engine.step_graph)
        self.static_step = step_graph.resolve(step_graph_mode, device)
        self.last_step_graph = None  # the last chunk's full steps and graph replays (benchmarks, tests)
        # what the rounds used, summed: the chunks' local steps, those replayed as a graph, those the static step
        # function ran (graphed or, on a CPU, eagerly), and per form of the
        # step (step_graph.Runner.used, or 'loop') the chunk-rounds that ran in it
        self.executed = {"chunk_steps": 0, "graphed_steps": 0, "static_steps": 0, "step_forms": {}}
        self.last_chunk = None
        # the round's memory plan (client_plan) and the fewest clients a statistics pass took (stats_client_chunk)
        self.last_plan, self.last_stats_chunk = None, None
        self.last_pass_shapes = []  # the shape of the statistics pass each client of the last foof_for was in
        self.remaking = None  # whether remake_foof gives the end-of-round matrices again (checked once: _keep_origins)
        self.offsets, total = [], 0
        for c in clients:
            self.offsets.append(total)
            total += len(c)
        # every client's images in one tensor: a step gathers all participants' batches at once
        self.x_all = torch.cat([c.x for c in clients]).to(device)
        self.y_all = torch.cat([c.y for c in clients]).to(device)
        # every client's (mean, std) per channel, on the device: (clients, 2, C)
        self.stats = torch.tensor([[list(c.mean), list(c.std)] for c in clients], dtype=torch.float32).to(device)
        self.names = [k for k, _ in model.named_parameters()]
        self.input_blocks = batched.input_blocks(model, blocks, self._plain([0], 0, 1)[0])
        self.capture = batched.StackedCapture(blocks)

        if stacked_model.supported(model):  # Linear / Conv2d / GroupNorm: the grouped formulation
            self.forward = stacked_model.StackedModel(model)

            def stacked_capture(p, x):
                K, B = x.shape[:2]
                self.capture.store = {}
                self.forward(p, x)
                return {k: v.view(K, B, *v.shape[1:]) for k, v in self.capture.store.items()}

            self.forward_capture = stacked_capture
            # training on the CPU: client by client inside the one graph (stacked_model.py's module doc)
            self.train_forward = self.forward.per_client if torch.device(device).type == "cpu" else self.forward
        else:  # any other layer: torch.func.vmap over functional_call

            def fwd(p, x):
                return functional_call(model, p, (x,))

            def fwd_capture(p, x):
                self.capture.store = {}
                functional_call(model, p, (x,))
                return dict(self.capture.store)

            self.forward = vmap(fwd)
            self.forward_capture = vmap(fwd_capture)
            self.train_forward = self.forward

    # --- inputs -------------------------------------------------------------------------------------------------
    def _norm(self, sel, x):
        """Standardise (K, b, C, H, W) floats with each client's mean and std (data.augment.standardize)."""
        ms = self.stats[torch.as_tensor(list(sel), device=self.device)].to(x.dtype)  # (K, 2, C)
        shape = (len(sel), 1, -1, 1, 1)
        return (x - ms[:, 0].view(shape)) / ms[:, 1].view(shape)

    def _plain(self, sel, s, e, subsets=None):
        """Normalised plain images of rows s:e of each client (padded rows repeat the client's first image)."""
        rows = []
        for j, i in enumerate(sel):
            n = len(self.clients[i])
            idx = torch.arange(s, e) if subsets is None or subsets[j] is None else subsets[j][s:e]
            idx = torch.where(idx < n, idx, torch.zeros_like(idx)) if len(idx) else idx
            rows.append(self.offsets[i] + _pad([idx], e - s)[0])
        g = torch.stack(rows).to(self.device)
        return self._norm(sel, self.x_all[g].float().div_(255.0))

    # --- FOOF --------------------------------------------------------------------------------------------------
    def foof_for(self, sel, params, subsets, statics):
        """client.foof_matrices for the clients ``sel`` at their stacked ``params``; updates the statics.  The pass
        takes as many clients at a time as fit in the memory free when it starts (``stats_client_chunk``)."""
        k = len(sel)
        per = self.last_plan["stats_bytes_per_client"] if self.last_plan else 0
        step = stats_client_chunk(per, self.device, k, self.memory_query)
        self.last_stats_chunk = step if self.last_stats_chunk is None else min(step, self.last_stats_chunk)
        self.last_pass_shapes = []
        out, s = [], 0
        while s < k:
            e = min(k, s + step)
            part = {n: v[s:e] for n, v in params.items()} if e - s < k else params
            kept = [None if st is None else dict(st) for st in statics[s:e]]  # the first-layer caches it may fill
            shapes = len(self.last_pass_shapes)
            try:
                out += self._foof_pass(sel[s:e], part, subsets[s:e], statics[s:e])
            except Exception as exc:  # retried in halves, from the caches as they were
                if e - s == 1 or not out_of_memory(exc):
                    raise
                for st, was in zip(statics[s:e], kept, strict=True):
                    if st is not None:
                        st.clear()
                        st.update(was)
                del self.last_pass_shapes[shapes:]
                step = (e - s) // 2
                self.last_stats_chunk = min(self.last_stats_chunk, step)
                self._out_of_memory(f"statistics chunk {e - s} -> {step} clients")
                continue
            s = e
        return out

    def _foof_pass(self, sel, params, subsets, statics, counts=None):
        """foof_for for one statistics chunk of clients (``counts``: the rows each takes, if not all its own).  Its
        shape, the clients it takes and the most rows of any, is appended to ``last_pass_shapes`` for each of them:
        with its own parameters and data, that shape alone decides a client's matrices bit for bit (how the pass
        cuts images and rows into products), which is what ``remake_foof`` relies on."""
        if counts is None:
            counts = [len(self.clients[i]) if sub is None else len(sub) for i, sub in zip(sel, subsets, strict=False)]
        counts = torch.tensor(counts, device=self.device)
        shape = {"clients": len(sel), "rows": int(counts.max())}
        cached = [sub is None and st is not None and len(st) > 0 for sub, st in zip(subsets, statics, strict=False)]
        skip = set(self.input_blocks) if all(cached) else set()
        with self.capture:
            A = batched.stacked_foof(
                self.forward_capture,
                self.capture,
                self.blocks,
                params,
                lambda s, e: self._plain(sel, s, e, subsets),
                counts,
                skip,
                STATS_BATCH,
            )
        out = []
        for j, (sub, st) in enumerate(zip(subsets, statics, strict=False)):
            mats = {k: A[k][j].clone() for k in A}  # own storage: a view would save the whole stack
            if sub is None and st is not None:
                if cached[j]:
                    mats.update(st)
                else:
                    st.update({k: mats[k] for k in self.input_blocks})
            out.append({k: mats[k] for k in self.blocks})
        self.last_pass_shapes += [dict(shape) for _ in sel]
        return out

    # --- the kept matrices remade (compact checkpoints: fedpm_dnn.engine.checkpoint.compact_client) ---------------
    def remake_foof(self, sel, params: list, shapes: list, statics: list) -> list:
        """The end-of-round FOOF matrices of the clients ``sel`` again, from the parameters each was taken at
        (``params``: one dict per client) and the shape of the pass that took it (``shapes``, from
        ``last_pass_shapes``).  Each is remade in a pass of that shape; the places its own clients do not fill are
        taken by copies of the first, one of them given the pass's most rows, and their matrices are dropped."""
        out = [None] * len(sel)
        groups = {}
        for j, shape in enumerate(shapes):
            groups.setdefault((int(shape["clients"]), int(shape["rows"])), []).append(j)
        for (k, rows), todo in groups.items():
            while todo:
                take = todo[:k]
                if len(take) == k > 1 and all(len(self.clients[sel[j]]) < rows for j in take):
                    take = take[:-1]  # a place for the copy that brings the pass its most rows
                todo = todo[len(take) :]
                slots = take + [take[0]] * (k - len(take))
                counts = [len(self.clients[sel[j]]) for j in slots]
                if len(take) < k and max(counts) < rows:
                    counts[-1] = rows
                stacked = {n: torch.stack([params[j][n] for j in slots]) for n in self.names}
                caches = [statics[j] if t < len(take) else dict(statics[j]) for t, j in enumerate(slots)]
                mats = self._foof_pass([sel[j] for j in slots], stacked, [None] * k, caches, counts)
                for j, m in zip(take, mats, strict=False):
                    out[j] = m
        return out

    def _keep_origins(self, sel, P, states, shapes, statics, end) -> None:
        """After the end-of-round pass: where its matrices can be remade (all the clients' data, no random subset),
        each client keeps the parameters they were taken at and the pass's shape (``foof_at``, ``foof_made``), so
        that a checkpoint may hold those instead of the matrices.  The first time in an engine the remaking is
        checked bit for bit against the pass; where it differs, checkpoints keep the matrices (said once, and
        recorded in ``executed['kept_foof']``)."""
        keep = self.remaking is not False  # once found to differ, the parameters are no longer kept
        at = [{n: P[n][j].detach().clone() for n in self.names} for j in range(len(states))] if keep else None
        if self.remaking is None:
            try:
                again = self.remake_foof(sel, at, shapes, [dict(st) for st in statics])
            except Exception as exc:
                if not out_of_memory(exc):
                    raise
                why = "remaking them ran out of memory"
            else:
                worst = max(float((a[b] - e[b]).abs().max()) for a, e in zip(again, end, strict=True) for b in e)
                same = all(torch.equal(a[b], e[b]) for a, e in zip(again, end, strict=True) for b in e)
                why = None if same else f"remaking them from the parameters they were taken at differed by {worst:.3g}"
            self.remaking = why is None
            self.executed["kept_foof"] = "remade from the parameters they were taken at (checked bit for bit)"
            if why:
                self.executed["kept_foof"] = f"stored whole: {why}"
                warnings.warn(f"checkpoints keep the FOOF matrices whole on {self.device}: {why}", RuntimeWarning, 3)
        for j, cs in enumerate(states):
            if self.remaking:
                cs["foof_at"], cs["foof_made"] = at[j], shapes[j]
            else:
                cs.pop("foof_at", None)
                cs.pop("foof_made", None)

    def _remake_resumed(self, cfg, sel, states) -> None:
        """Clients resumed from a compact checkpoint: their kept matrices remade and checked against the digest the
        checkpoint holds; a difference is said and recorded (``executed['kept_foof_resumed']``)."""
        todo = [j for j, cs in enumerate(states) if "foof" not in cs and "foof_at" in cs]
        if not cfg.uses_foof or not todo:
            return
        mats = self.remake_foof(
            [sel[j] for j in todo],
            [states[j]["foof_at"] for j in todo],
            [states[j]["foof_made"] for j in todo],
            [states[j].setdefault("foof_static", {}) for j in todo],
        )
        for j, m in zip(todo, mats, strict=True):
            cs = states[j]
            cs["foof"] = getattr(cfg, "kept_foof", dict)(m)
            if checkpoint.matrices_digest(cs["foof"]) != cs.pop("foof_digest", None):
                why = f"client {sel[j]}'s remade FOOF matrices differ from those the checkpoint was written with"
                self.executed.setdefault("kept_foof_resumed", []).append(why)
                warnings.warn(f"{why}: the run goes on with them", RuntimeWarning, stacklevel=3)

    # --- one round --------------------------------------------------------------------------------------------
    def round(self, cfg, sel, states: list, down, gens: list):
        """Local training of the participants ``sel``: [(reply, loss)] in the order of ``sel``.  ``down`` is the
        round's broadcast, or one per participant (several runs stacked, ``fedpm_dnn.engine.stacked_runs``)."""
        downs = down if isinstance(down, list) else [down] * len(sel)
        k = len(sel)
        sample = self._plain([sel[0]], 0, 1)[0]
        new_states = sum(1 for cs in states if "foof" not in cs) if cfg.uses_foof else 0
        self.last_plan = client_plan(
            self.model, cfg, sample, self.blocks, self.device, k, new_states, self.memory_query
        )
        self.last_stats_chunk = None
        chunk = self.client_chunk or self.last_plan["chunk"]
        self.last_chunk = min(chunk, k)
        results, s = [], 0
        with precision.use(getattr(cfg, "foof_precision", "fp32")):  # FOOF's products (fedpm_dnn.foof.precision)
            self._remake_resumed(cfg, sel, states)
            while s < k:
                idx = list(range(s, min(k, s + chunk)))
                drawn = [gens[j].get_state() for j in idx]  # the chunk as it starts, for a retry in halves
                kept = [_state_copy(states[j]) for j in idx]
                try:
                    results += self._chunk(
                        cfg,
                        [int(sel[j]) for j in idx],
                        [states[j] for j in idx],
                        [downs[j] for j in idx],
                        [gens[j] for j in idx],
                    )
                except Exception as exc:
                    if len(idx) == 1 or not out_of_memory(exc):
                        raise
                    for j, g, st, cs in zip(idx, drawn, kept, [states[j] for j in idx], strict=True):
                        gens[j].set_state(g)
                        cs.clear()
                        cs.update(st)
                    chunk = len(idx) // 2
                    self._out_of_memory(f"training chunk {len(idx)} -> {chunk} clients")
                    continue
                s += len(idx)
                self.last_chunk = min(self.last_chunk, len(idx))
        return results

    def _out_of_memory(self, what: str) -> None:
        """After an out-of-memory error: the allocator's cached blocks released, the halving recorded and said."""
        if torch.device(self.device).type == "cuda":
            torch.cuda.empty_cache()
        self.executed.setdefault("out_of_memory", []).append(what)
        warnings.warn(f"out of memory on {self.device}: {what}, and the step retried", RuntimeWarning, stacklevel=3)

    def _chunk(self, cfg, sel, states, downs, gens):
        K, B, dev = len(sel), cfg.batch_size, self.device
        # one broadcast (one run): the gradient hook reads it as is; several (runs stacked): their tensors stacked
        # per participant, which the hooks' elementwise corrections broadcast over like the parameters
        one = all(d is downs[0] for d in downs)
        down = downs[0] if one else _stack_downs(downs)
        params = down["params"]
        dtype = params[self.names[0]].dtype
        scheds = [
            client_schedule(cfg, self.clients[i], g, cfg.uses_foof and "foof" not in cs)
            for i, g, cs in zip(sel, gens, states, strict=False)
        ]
        if one:
            P = {
                n: params[n].detach().unsqueeze(0).repeat(K, *([1] * params[n].dim())).contiguous() for n in self.names
            }
        else:
            P = {n: params[n].detach().clone() for n in self.names}
        factors = None
        if cfg.uses_foof:
            first = [j for j, cs in enumerate(states) if "foof" not in cs]
            if first:  # first participation: matrices at the received model
                sub = [sel[j] for j in first]
                mats = self.foof_for(
                    sub,
                    {n: P[n][first] for n in self.names},  # each at its own model (runs stacked differ)
                    [scheds[j]["first"] for j in first],
                    [states[j].setdefault("foof_static", {}) for j in first],
                )
                for j, m in zip(first, mats, strict=False):
                    states[j]["foof"] = getattr(cfg, "kept_foof", dict)(m)  # foof_state_dtype
            steps = max(len(sc["steps"]) for sc in scheds)  # the steps one factor serves (auto's rule)
            apply = foof.resolve_apply(cfg.foof_apply, dev, self.blocks, min(steps, cfg.refresh_every or steps))
            factors = foof.operators(
                batched.factorize_stacked(
                    {b: torch.stack([cs["foof"][b] for cs in states]) for b in self.blocks}, cfg.damping, torch.float64
                ),
                dtype,
                apply,
            )
        # the per-client tensors the method's gradient hook reads (SCAFFOLD's control), stacked
        per_client = {
            key: {n: torch.stack([cs[key][n] for cs in states]) for n in self.names} for key in cfg.client_tensors
        }
        n_steps = [len(sc["steps"]) for sc in scheds]
        T = max(n_steps)
        # the whole schedule as (T, K, B) tensors, moved to the device once
        gidx, mask, oy, ox, flip = schedule_tensors(
            [sc["steps"] for sc in scheds], [self.offsets[i] for i in sel], T, B
        )
        gidx, mask, oy, ox, flip = (v.to(dev) for v in (gidx, mask, oy, ox, flip))
        counts = mask.sum(2)  # (T, K)
        loss_sum = torch.zeros(K, dtype=torch.float64, device=dev)
        steps_t = torch.tensor(n_steps)
        blocks = list(self.blocks.items())
        graph, graph_wanted = None, factors is not None and solve_graph.enabled(dev)

        def refresh(t, due):  # FOOF matrices every refresh_every steps, at the clients ``due`` still training
            if cfg.uses_foof and cfg.refresh_every and (t + 1) % cfg.refresh_every == 0 and due:
                mats = self.foof_for(
                    [sel[j] for j in due],
                    {n: P[n][due] for n in self.names},
                    [scheds[j]["refresh"][t + 1] for j in due],
                    [states[j].get("foof_static") for j in due],
                )
                new_f = batched.factorize_stacked(
                    {b: torch.stack([m[b] for m in mats]) for b in self.blocks}, cfg.damping, torch.float64
                )
                for b, op in foof.operators(new_f, dtype, apply).items():
                    for old, new in zip(factors[b], op, strict=True):  # in place: a CUDA graph reads them
                        old[due] = new

        # every step of the chunk as one static function (a client whose steps have ended takes masked ones)
        # captured, every step (a finished client's masked: step_graph.FullStep), so that the graph covers unequal
        # clients' rounds whole; run eagerly (the CPU's 'on'), the steps every client takes, as before
        capture = step_graph.capturable(dev)
        n_full = (T if capture else min(n_steps)) if self.static_step else 0
        runner = None
        if n_full:
            hook = cfg.grad_hook(down, per_client)
            runner = step_graph.Runner(
                step_graph.FullStep(
                    cfg,
                    self.train_forward,
                    self.names,
                    P,
                    self.x_all,
                    self.y_all,
                    self.stats[torch.as_tensor(sel, device=dev)],  # float32, as the images (_norm)
                    torch.stack([gidx, oy, ox]),
                    torch.stack([mask, flip]),
                    counts.to(dtype),
                    hook,
                    factors,
                    self.blocks,
                    loss_sum,
                ),
                capture,
            )
        every, n_steps_min = list(range(K)), min(n_steps)
        for t in range(T):
            if t < n_full:
                runner()
                refresh(t, every if t < n_steps_min else [j for j in every if n_steps[j] > t])
                continue
            act = (steps_t > t).nonzero().flatten()
            full = len(act) == K
            ids = None if full else act.to(dev)
            sub_sel = sel if full else [sel[j] for j in act.tolist()]
            Pk = {n: (P[n] if full else P[n].index_select(0, ids)).detach().requires_grad_(True) for n in self.names}
            g_t = gidx[t] if full else gidx[t].index_select(0, ids)
            m_t = mask[t] if full else mask[t].index_select(0, ids)
            c_t = (counts[t] if full else counts[t].index_select(0, ids)).to(dtype)
            kk, C, H, W = g_t.shape[0], *self.x_all.shape[1:]
            x = self.x_all[g_t.reshape(-1)].float().div_(255.0)

            def sel_o(v, t=t, full=full, ids=ids):
                return v[t] if full else v[t].index_select(0, ids)

            x = crop_flip(x, sel_o(oy).reshape(-1), sel_o(ox).reshape(-1), sel_o(flip).reshape(-1))
            x = self._norm(sub_sel, x.view(kk, B, C, H, W))
            y = self.y_all[g_t.reshape(-1)]
            out = self.train_forward(Pk, x)
            ce = F.cross_entropy(out.reshape(kk * B, -1), y, reduction="none").view(kk, B)
            loss = (ce * m_t).sum(1) / c_t
            grads = torch.autograd.grad(loss.sum(), [Pk[n] for n in self.names])
            with torch.no_grad():
                G = dict(zip(self.names, [g.detach() for g in grads], strict=False))
                hook = cfg.grad_hook(
                    down if one or full else _stack_downs(downs, act.tolist()),
                    {
                        key: {n: v if full else v.index_select(0, ids) for n, v in s.items()}
                        for key, s in per_client.items()
                    },
                )
                for n in self.names:
                    p, g = Pk[n], G[n]
                    if hook is not None:
                        hook(n, p, g)
                    if cfg.weight_decay and cfg.weight_decay_mode == "coupled":
                        g.add_(p, alpha=cfg.weight_decay)
                if cfg.clip is not None and cfg.clip_stage == "gradient":
                    _clip_(list(G.values()), cfg.clip)
                if factors is not None:
                    rhs = {}  # per block: the weight gradient's rows and the bias column (None: no bias)
                    for bname, block in blocks:
                        wn = foof.param_name(bname, "weight")
                        gw = G[wn].reshape(kk, G[wn].shape[1], -1)
                        rhs[bname] = (gw, G[foof.param_name(bname, "bias")][:, :, None] if block.has_bias else None)
                    if full and graph_wanted:  # once per chunk and round: every later full step replays it
                        graph_wanted = False
                        graph = solve_graph.capture(
                            factors,
                            {b: (kk, gw.shape[1], gw.shape[2] + (gb is not None)) for b, (gw, gb) in rhs.items()},
                            dtype,
                            dev,
                        )
                    if full and graph is not None:
                        for bname, (gw, gb) in rhs.items():
                            if gb is None:
                                graph.inputs[bname].copy_(gw)
                            else:
                                torch.cat([gw, gb], 2, out=graph.inputs[bname])
                        dirs = graph.replay()
                    else:
                        dirs = {}
                        with foof.one_cpu_thread(dev):
                            for bname, (gw, gb) in rhs.items():
                                op = factors[bname] if full else tuple(f.index_select(0, ids) for f in factors[bname])
                                dirs[bname] = foof.direction(gw if gb is None else torch.cat([gw, gb], 2), op)
                    # the directions as views of the solves' results (no copies: every copy is a launch on a
                    # launch-bound GPU); the update below reads them before the next step's solves overwrite them.
                    # A clip of the update takes its norm on the strided bias view: within an ulp of the
                    # contiguous copy's (float32 round-off, like the engines' other differences)
                    for bname, block in blocks:
                        wn = foof.param_name(bname, "weight")
                        D = dirs[bname]
                        G[wn] = (D[:, :, :-1] if block.has_bias else D).reshape(G[wn].shape)
                        if block.has_bias:
                            G[foof.param_name(bname, "bias")] = D[:, :, -1]
                if cfg.clip is not None and cfg.clip_stage == "update":
                    _clip_(list(G.values()), cfg.clip)
                decay = cfg.lr * cfg.weight_decay if cfg.weight_decay_mode == "decoupled" else 0.0
                for n in self.names:
                    new = Pk[n].detach().add_(G[n], alpha=-cfg.lr) if full else Pk[n].detach().add(G[n], alpha=-cfg.lr)
                    if decay:
                        new.mul_(1.0 - decay)
                    if not full:
                        P[n].index_copy_(0, ids, new)
                loss_sum.index_add_(0, act.to(dev), (loss.detach() * c_t).to(torch.float64))
            refresh(t, act.tolist())
        used = runner.used if runner is not None else "loop"
        self.executed["chunk_steps"] += T
        self.executed["graphed_steps"] += runner.replays if runner is not None else 0
        self.executed["static_steps"] += n_full
        self.executed["step_forms"][used] = self.executed["step_forms"].get(used, 0) + 1
        if runner is not None:
            self.last_step_graph = {"full_steps": n_full, "replays": runner.replays, "used": used}
            runner.release()
        end = None
        if cfg.uses_foof:  # matrices at the end of the round, on plain data
            statics = [cs.setdefault("foof_static", {}) for cs in states]
            end = self.foof_for(sel, P, [sc["end"] for sc in scheds], statics)
            if all(sc["end"] is None for sc in scheds):
                self._keep_origins(sel, P, states, list(self.last_pass_shapes), statics, end)
        if dev != "cpu" and str(dev).startswith("cuda"):
            torch.cuda.synchronize(dev)
        results = []
        seen = [len(self.clients[i]) * cfg.local_epochs for i in sel]
        for j, cs in enumerate(states):
            local = {n: P[n][j].clone() for n in self.names}
            reply = cfg.client_reply(cs, local, n_steps[j], downs[j], end[j] if end is not None else None)
            results.append((reply, float(loss_sum[j]) / max(seen[j], 1)))
        return results
