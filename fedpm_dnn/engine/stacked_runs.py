"""Several runs as one stack: their rounds' participants trained together on the vectorized engine.

Runs of one model and method that differ in seed or Dirichlet alpha (so in split, initial model, client streams,
server state, screening, history and checkpoint) each keep their own round driver (``simulation.run_experiment``,
unchanged, one thread per run); only local training is shared.  Every round each run submits its participants,
broadcast, client states and generators to one ``VectorizedEngine`` over all the runs' clients, and the last run to
submit trains them all at once -- runs x participants on the leading axis -- and hands each run its replies.  The
replies are those the run gets trained alone on the vectorized engine (the clients' computations do not depend on
their neighbours in the stack; tests/test_run_stack.py), so each run's results, checkpoint and resume are its own.

A run that has no more rounds (it finished, or it resumed from a later checkpoint than the others) leaves the stack
and the others go on.  Where the stacked call fails (a diverging client's FOOF matrix), every run's part is trained
alone, so that the error reaches the run it belongs to and the others continue.  ``--client-chunk`` and the automatic
chunking count the participants of all the runs together (the engine's chunks span runs).

In a stack a run's ``client_seconds`` is the stacked round's time (the run waits for the stack), and its peak memory
is the process's.
"""

from __future__ import annotations

import threading

from .. import foof
from ..models import make_model
from .vectorized import VectorizedEngine


class StackFailed(RuntimeError):
    """Another run of the stack failed inside the shared call; this one stops too."""


class _TrainAlone(Exception):
    """The runs of one shared call cannot train together."""


class RunStack:
    """One vectorized engine over every run's clients, and the rendezvous of the runs' rounds."""

    def __init__(self, exps: list):
        first = exps[0]
        for e in exps[1:]:
            same = (e.model, e.num_classes, e.in_channels, e.image_size, e.device, e.cfg)
            if same != (first.model, first.num_classes, first.in_channels, first.image_size, first.device, first.cfg):
                raise ValueError("a stack's runs must share model, data shape, device and method settings")
        # the engine's own model (only its structure is used): the runs' models evaluate concurrently
        model = make_model(first.model, first.num_classes, first.in_channels, first.image_size).to(first.device)
        clients, self.offsets = [], []
        for e in exps:
            self.offsets.append(len(clients))
            clients += e.clients
        self.engine = VectorizedEngine(
            model, foof.foof_blocks(model), clients, first.device, first.client_chunk, first.step_graph
        )
        self.last_chunk = None
        self._cond = threading.Condition()
        self._active = set(range(len(exps)))
        self._pending, self._results = {}, {}
        self._failed = None

    def member(self, run: int) -> StackMember:
        return StackMember(self, run)

    def submit(self, run: int, cfg, sel, states, down, gens) -> list:
        """Run ``run``'s round request; returns its [(reply, loss)] once the stack has trained it."""
        with self._cond:
            self._pending[run] = (cfg, [self.offsets[run] + int(i) for i in sel], states, down, gens)
            self._train_if_complete()
            while run not in self._results and self._failed is None:
                self._cond.wait()
            if run not in self._results:
                raise StackFailed(f"another run of the stack failed ({self._failed})")
            out = self._results.pop(run)
        if isinstance(out, BaseException):
            raise out
        return out

    def leave(self, run: int, error: BaseException | None = None) -> None:
        """``run`` has no more rounds (or stopped on ``error``); the others no longer wait for it.  An interrupt
        (Ctrl-C, SIGTERM) stops the whole stack."""
        with self._cond:
            self._active.discard(run)
            self._pending.pop(run, None)
            if isinstance(error, KeyboardInterrupt) and self._failed is None:
                self._failed = f"run {run} interrupted"
            self._train_if_complete()
            self._cond.notify_all()

    def _train_if_complete(self) -> None:
        """With every active run's request in: train them (under the lock; every other run is waiting)."""
        if not self._pending or set(self._pending) != self._active or self._failed is not None:
            return
        runs = sorted(self._pending)
        reqs = [self._pending.pop(r) for r in runs]
        cfg = reqs[0][0]
        sel = [i for r in reqs for i in r[1]]
        states = [s for r in reqs for s in r[2]]
        downs = [r[3] for r in reqs for _ in r[1]]
        gens = [g for r in reqs for g in r[4]]
        drawn = [g.get_state() for g in gens]  # the generators as submitted, for a retry run by run
        try:
            if any(r[0] != cfg for r in reqs):  # runs at rounds of different learning rates (a schedule, resumed
                raise _TrainAlone  # from different rounds): each trains alone, as it would outside the stack
            out = self.engine.round(cfg, sel, states, downs, gens)
        except Exception:  # train each run alone: the error goes to its own run, the others go on
            for g, state in zip(gens, drawn, strict=True):
                g.set_state(state)
            for r, req in zip(runs, reqs, strict=True):
                try:
                    self._results[r] = self.engine.round(*req)
                except Exception as exc:
                    self._results[r] = exc
        else:
            k = 0
            for r, req in zip(runs, reqs, strict=True):
                self._results[r] = out[k : k + len(req[1])]
                k += len(req[1])
        self.last_chunk = self.engine.last_chunk
        self._cond.notify_all()


class StackMember:
    """A run's view of the stack, in the place of its task's vectorized engine (``task.engine_state``)."""

    def __init__(self, stack: RunStack, run: int):
        self.stack, self.run = stack, run

    @property
    def last_chunk(self):
        return self.stack.last_chunk

    @property
    def executed(self):
        return self.stack.engine.executed  # the stack's rounds, which every run of it shares

    def round(self, cfg, sel, states, down, gens):
        return self.stack.submit(self.run, cfg, sel, states, down, gens)


def run_stack(exps: list, checkpoints: list, resume: list, on_rounds: list, stop=None) -> list:
    """``simulation.run_experiment`` for every run of ``exps`` (vectorized engine), trained as one stack; returns
    per run its history, or the exception that stopped it (a Ctrl-C or SIGTERM is re-raised after every run
    stopped).  ``stop(row) -> bool``, asked after each of a run's rounds, ends that run there (checkpointed), as it
    ends a run alone (e.g. a deadline)."""
    from .simulation import run_experiment

    stack = RunStack(exps)
    out = [None] * len(exps)

    def one(r):
        error = None
        try:
            out[r] = run_experiment(
                exps[r],
                checkpoint=checkpoints[r],
                resume=resume[r],
                on_round=on_rounds[r],
                engine=stack.member(r),
                stop=stop,
            )
        except BaseException as exc:  # kept for the caller; the stack must not wait for this run
            out[r] = error = exc
        finally:
            stack.leave(r, error)

    threads = [threading.Thread(target=one, args=(r,), name=f"run-{r}") for r in range(len(exps))]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except BaseException:  # Ctrl-C / SIGTERM in the main thread: stop every run at its next round
        stack.leave(-1, KeyboardInterrupt())
        for t in threads:
            t.join()
        raise
    interrupts = [o for o in out if isinstance(o, KeyboardInterrupt)]
    if interrupts:
        raise interrupts[0]
    return out
