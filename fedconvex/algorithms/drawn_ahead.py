"""Random numbers drawn by a helper thread ahead of the loop that consumes them (FedNS's sketches).

NumPy releases the GIL while it fills an array, so a second core draws the next client's numbers while the
first computes with the last ones; the numbers and the generator's final state are those of drawing them in
the loop.
"""

from __future__ import annotations

import math
import queue
import threading


class DrawnAhead:
    """``rng.standard_normal(shape)`` for each shape in order (None for None), drawn by a helper thread ahead
    of the loop that iterates over them.  The numbers are those of drawing them
    in that loop (the same generator, the same order, and nothing else draws from it until ``join`` returns).
    ``join`` (always call it) waits until every draw is made, so the generator's state afterwards is the same
    as without the thread."""

    def __init__(self, rng, shapes, memo=None):
        self._shapes = list(shapes)
        self._q = queue.SimpleQueue()
        # kept for ``memo`` (a normal_memo.NormalMemo with room for them), keyed by the state they start from
        self._memo = (
            memo
            if memo is not None and memo.wants(8 * sum(math.prod(sh) for sh in self._shapes if sh is not None))
            else None
        )
        self._key = self._memo.key(rng, self._shapes) if self._memo is not None else None
        self._drawn = []
        self._rng = rng
        self._thread = threading.Thread(target=self._draw, args=(rng,), daemon=True)
        self._thread.start()

    def _draw(self, rng):
        try:
            for shape in self._shapes:
                a = None if shape is None else rng.standard_normal(shape)
                if self._memo is not None:
                    self._drawn.append(a)
                self._q.put(a)
        except BaseException as exc:  # pragma: no cover - handed to the consumer
            self._memo = None
            self._q.put(exc)

    def __iter__(self):
        for _ in self._shapes:
            item = self._q.get()
            if isinstance(item, BaseException):  # pragma: no cover
                raise item
            yield item

    def join(self):
        self._thread.join()
        if self._memo is not None:  # every draw made: the generator is in the state they leave it in
            self._memo.keep(self._key, self._drawn, self._rng.bit_generator.state)
            self._memo = self._drawn = None
