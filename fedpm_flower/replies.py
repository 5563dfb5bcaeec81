"""What a Flower server accepts from a node beyond the reply's structure: the sample count it claims
(``num_examples_problem``) and the template of the arrays the strategy sent (``entries_of``).

The structure of a DNN reply is checked by the one rule of every path that stacks DNN replies,
``fedpm_dnn.engine.transport.reply_problem``: against the server's own template, never against another reply.  The
strategy ``fedpm_flower.strategy.FedPM`` builds its template from the arrays it sent and the FOOF blocks of that
model; the CNN app's transport (``fedpm_flower.cnn.CnnTransport``) from the broadcast, the method's reply shapes and
its wire dtypes (``fedpm_dnn.engine.transport.reply_template``), as the in-process transport does.  Content
(NaN/Inf, PSD matrices, the magnitude guard) is the round driver's screening, after the replies are stacked.
"""

from __future__ import annotations

import math

# the largest sample count a reply may claim: an integer float64 holds exactly, and thousands of them still sum
# to a finite number (an unbounded claim would make the normalised weights inf / inf)
MAX_EXAMPLES = float(2**53)


def entries_of(arrays: dict, dtype=None) -> dict:
    """name -> (shape, dtype) of ``arrays`` (tensors), with ``dtype`` in place of theirs when given."""
    return {k: (tuple(v.shape), dtype or v.dtype) for k, v in arrays.items()}


def num_examples_problem(value, positive: bool) -> str | None:
    """None if ``value`` is a usable sample count: a finite number in 0..2**53 (above 0 when it weights the
    mixing, ``positive``), else why not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"is {value!r}, not a number"
    if not math.isfinite(value) or not 0 <= value <= MAX_EXAMPLES:
        return f"is {value!r}, not a finite number in 0..2**53"
    if positive and value == 0:
        return "is 0: the reply would have no weight"
    return None
