"""A learning-rate schedule over rounds: a linear warm-up, then step decays at milestones.

The local learning rate of round t (1-based) is ``lr * factor(t)``:

- warm-up over W rounds: ``factor`` grows linearly, t / W for t <= W, then 1 (W = 0: none);
- milestones ``(m, f)``: from round m on, the factor is multiplied by f (several multiply).

The milestones are given as a per-cent fraction of the run's rounds (``75:0.1,90:0.1``) and made absolute
here: a milestone at p % of R rounds starts at the first round t with (t - 1) >= p/100 * R, i.e. when p % of
the rounds are complete -- RelaySum's rule ``epoch >= milestone`` with a round as the unit (its epoch-based
warm-up counts fractional epochs from 0, ours whole rounds from 1, so round 1 already trains at 1/W).  The
schedule scales the clients' local learning rate only (a server optimiser's own rate is left as it is), the
same for every method; SCAFFOLD's control update divides by the rate the round trained with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from fedconvex.hyperparams import FLOAT32_MAX, POSITIVE, checked_number, number_problem


@dataclass(frozen=True)
class LrSchedule:
    warmup_rounds: int = 0
    milestones: tuple = ()  # ((first round, factor), ...), rounds ascending

    def __post_init__(self):
        if isinstance(self.warmup_rounds, bool) or not isinstance(self.warmup_rounds, int) or self.warmup_rounds < 0:
            raise ValueError(f"warm-up rounds must be a whole number >= 0, got {self.warmup_rounds!r}")
        last = 0
        for first, factor in self.milestones:
            if isinstance(first, bool) or not isinstance(first, int) or first < 1:
                raise ValueError(f"a milestone's round must be a whole number >= 1, got {first!r}")
            if first < last:
                raise ValueError("milestones must be in increasing order")
            checked_number("a milestone's factor", factor, POSITIVE, limit=FLOAT32_MAX)
            last = first

    def largest(self) -> float:
        """The largest factor of any round (the warm-up's are at most 1)."""
        f = top = 1.0
        for _, factor in self.milestones:
            f *= factor
            top = max(top, f)
        return top

    def smallest(self) -> float:
        """The smallest factor of any round."""
        f, low = 1.0, 1.0 / self.warmup_rounds if self.warmup_rounds else 1.0
        for _, factor in self.milestones:
            f *= factor
            low = min(low, f)
        return low

    def check_rate(self, lr: float) -> None:
        """A ValueError unless every round's rate ``lr * factor`` is a float32 number above 0."""
        lr = checked_number("lr", lr, POSITIVE, limit=FLOAT32_MAX)
        for what, f in (("largest", self.largest()), ("smallest", self.smallest())):
            checked_number(f"the learning rate at its {what} (lr x the milestones' factors)", lr * f, POSITIVE,
                           limit=FLOAT32_MAX)  # fmt: skip

    def factor(self, round_: int) -> float:
        """The learning-rate multiplier of round ``round_`` (1-based)."""
        f = 1.0
        if self.warmup_rounds and round_ < self.warmup_rounds:
            f = round_ / self.warmup_rounds
        for first, factor in self.milestones:
            if round_ >= first:
                f *= factor
        return f

    def as_dict(self) -> dict:
        """Plain JSON types, for the checkpoint's fingerprint and summary.json."""
        return {"warmup_rounds": self.warmup_rounds, "milestones": [[m, f] for m, f in self.milestones]}


def parse_milestones(text: str) -> tuple:
    """'75:0.1,90:0.1' -> ((Fraction(75), 0.1), (Fraction(90), 0.1)): per cent of the rounds, factor.  Raises
    ValueError naming the bad part."""
    out = []
    for part in text.split(","):
        pct, sep, factor = part.partition(":")
        try:
            if not sep:
                raise ValueError
            p, f = Fraction(pct.strip()), float(factor)
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"{part!r} is not PERCENT:FACTOR (e.g. 75:0.1)") from None
        if not 0 < p < 100:
            raise ValueError(f"{part!r}: the per cent must be between 0 and 100 (exclusive)")
        problem = number_problem(f, POSITIVE, limit=FLOAT32_MAX)
        if problem:
            raise ValueError(f"{part!r}: the factor {problem}")
        out.append((p, f))
    if any(b[0] <= a[0] for a, b in zip(out, out[1:], strict=False)):
        raise ValueError(f"{text!r}: the per cents must increase")
    return tuple(out)


def schedule_for(warmup_rounds: int | None, milestones: str | None, rounds: int) -> LrSchedule | None:
    """The schedule of a run of ``rounds`` rounds, or None when neither part is asked for (a constant rate)."""
    if not warmup_rounds and not milestones:
        return None
    absolute = []
    for pct, factor in parse_milestones(milestones) if milestones else ():
        absolute.append((math.ceil(pct * rounds / 100) + 1, factor))  # first t with (t - 1) >= pct/100 * rounds
    return LrSchedule(int(warmup_rounds or 0), tuple(absolute))
