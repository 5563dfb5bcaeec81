"""Hostile inputs to the memory and Gram-form options: a refusal naming the cause."""

import pytest

pytest.importorskip("torch")

from fedpm_dnn.algorithms import make_method  # noqa: E402
from fedpm_dnn.foof import cost  # noqa: E402


@pytest.mark.parametrize("bad", ["float16", "fp32", "", None])
def test_an_unknown_foof_state_dtype_is_refused(bad):
    with pytest.raises((ValueError, TypeError), match="foof_state_dtype"):
        make_method("fedpm", foof_state_dtype=bad)


def test_an_unknown_gram_form_is_refused():
    with pytest.raises(ValueError, match="gram_form must be one of full, half, got 'triangle'"):
        cost.foof_cost([], 1, 1, 1, 1, gram_form="triangle")
