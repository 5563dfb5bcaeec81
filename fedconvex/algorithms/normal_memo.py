"""Standard normals remembered by the generator state they were drawn from (FedNS's Gaussian sketches).

A learning-rate search runs one method again and again from the same seed, and FedNS's Gaussian sketches
depend on the generator's state and their shapes only, not on the model: every candidate draws the very same
sketches, round by round.  Drawing them is most of a FedNS round (w8a: 142 x 350 x 300 = 15 M normals,
~0.14 s of CPU), so while ``remembering_normals`` is on, draws are kept (the first ones, up to a byte budget)
keyed by (generator state, shapes); a later draw from the same state with the same shapes is answered with
the kept arrays, and the generator is set to the state that draw left it in.  The numbers, and the generator
afterwards, are those of drawing: only the drawing is skipped.
"""

from __future__ import annotations

import pickle
from contextlib import contextmanager


class NormalMemo:
    """Kept ``rng.standard_normal(shape)`` draws (float64), read-only, keyed by the generator's full state."""

    def __init__(self):
        self.budget = 0  # bytes that may be kept; 0: off (nothing is kept or recalled)
        self.entries = 0  # and at most this many draws (a FedNS round's sketches are one draw)
        self.used = 0
        self.owner = None  # what the kept draws serve (remembering_normals' ``owner``)
        self._kept = {}

    @staticmethod
    def key(rng, shapes):
        # the bit generator's whole state (its name, counter and any buffered half-word), so that a hit is a
        # draw from exactly this point of exactly this stream
        # (pickled: exact for every bit generator, including those whose state holds arrays, which JSON refuses)
        return pickle.dumps(rng.bit_generator.state), tuple(shapes)

    def recall(self, rng, shapes):
        """The kept draws (None for None shapes) from ``rng``'s state, ``rng`` moved on as drawing them would
        move it; None when they are not kept."""
        if not self.budget or not self._kept:
            return None
        hit = self._kept.get(self.key(rng, shapes))
        if hit is None:
            return None
        arrays, after = hit
        rng.bit_generator.state = after
        return list(arrays)

    def wants(self, nbytes: int) -> bool:
        return bool(self.budget) and self.used + nbytes <= self.budget and len(self._kept) < self.entries

    def keep(self, key, arrays, after) -> None:
        nbytes = sum(a.nbytes for a in arrays if a is not None)
        if key in self._kept or not self.wants(nbytes):
            return
        for a in arrays:
            if a is not None:
                a.flags.writeable = False  # shared with later runs: nobody may write into them
        self._kept[key] = (tuple(arrays), after)
        self.used += nbytes

    def clear(self) -> None:
        self._kept.clear()
        self.used = 0


NORMALS = NormalMemo()


@contextmanager
def remembering_normals(budget: int, entries: int = 4, owner=None):
    """Keep and recall Gaussian draws (the first ``entries`` draws, up to ``budget`` bytes in all) inside the
    block.  What was kept stays kept after it (the next candidate of a search recalls it) until a block with
    another ``owner`` (a search: the method whose candidates run) starts, or ``NORMALS.clear()``."""
    if owner is not None and owner != NORMALS.owner:
        NORMALS.clear()
        NORMALS.owner = owner
    was = NORMALS.budget, NORMALS.entries
    NORMALS.budget, NORMALS.entries = max(was[0], int(budget)), max(was[1], int(entries))
    try:
        yield NORMALS
    finally:
        NORMALS.budget, NORMALS.entries = was
