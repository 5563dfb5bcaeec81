"""Numbers at the command line: one validator per kind of number (validation.common), used by every command's
parser, each returning a value of its kind -- the type, finite, in its range, within what it becomes downstream
(a deadline, a certificate date, a wait) -- or refusing in one line.  Property tests throw generated text at each."""

from __future__ import annotations

import argparse
import datetime
import math
import threading
import time

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_cli_help import PARSED, parser_of

from validation import common
from validation.sweep import Budget

HOSTILE = [
    "nan", "NaN", "-nan", "inf", "-inf", "Infinity", "1e309", "-1e309", "1e308", "-0", "-0.0", "0", "+0", "-1",
    "1_000", "1__0", "_1", "0x10", "1e3", "1.5", "١٢", "１２", "²", " 7 ", "7\n", "\n7\n8", "", " ", "1,5", "½",
    "9" * 5000, str(2**31), str(2**32), str(2**63), str(-(2**63)), "4294967295", "2147483647", "True", "None",
    "1e-320", "5e-324", "1e7", "10000001", "36500", "36501", "3000000", "1e9", "1e10",
]  # fmt: skip
TEXT = st.one_of(
    st.sampled_from(HOSTILE),
    st.text(max_size=30),
    st.integers().map(str),
    st.floats().map(repr),
    st.from_regex(r"[-+ ]?[0-9_]{1,12}([.][0-9]{0,6})?(e[-+]?[0-9]{1,4})?\s?", fullmatch=True),
)

# each validator and what a value it returns must be: its type, and its range
CONTRACTS = {
    common.positive_int: (int, lambda v: 1 <= v <= common.MAX_INT),
    common.seed_int: (int, lambda v: 0 <= v < 2**32),
    common.nonneg_float: (float, lambda v: v >= 0 and math.copysign(1, v) == 1),
    common.positive_float: (float, lambda v: v > 0),
    common.budget_minutes: (float, lambda v: 0 < v <= common.MAX_MINUTES),
    common.wait_seconds: (float, lambda v: 0 < v <= common.MAX_WAIT_SECONDS),
    common.certificate_days: (int, lambda v: 1 <= v <= common.MAX_DAYS),
}


def check(validator, text):
    """The value ``validator`` returns for ``text`` is of its kind, or its refusal is one short line."""
    kind, in_range = CONTRACTS[validator]
    try:
        v = validator(text)
    except argparse.ArgumentTypeError as exc:
        message = str(exc)
        assert "\n" not in message and "\r" not in message and len(message) < 120, message
        return None
    assert type(v) is kind and (kind is int or math.isfinite(v)) and in_range(v), (text, v)
    return v


@pytest.mark.parametrize("validator", list(CONTRACTS), ids=lambda f: f.__name__)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT)
@example(text="9" * 5000)
def test_each_validator_returns_its_kind_or_refuses_in_one_line(validator, text):
    check(validator, text)


@pytest.mark.parametrize("validator", list(CONTRACTS), ids=lambda f: f.__name__)
def test_each_validator_on_the_hostile_strings(validator):
    for text in HOSTILE:
        check(validator, text)


@settings(max_examples=200, deadline=None)
@given(v=st.integers(min_value=-(2**70), max_value=2**70))
def test_an_integer_written_plainly_is_read_as_itself_or_refused(v):
    for validator in (common.positive_int, common.seed_int, common.certificate_days):
        got = check(validator, str(v))
        assert got is None or got == v


@settings(max_examples=200, deadline=None)
@given(v=st.floats(allow_nan=True, allow_infinity=True))
def test_a_float_written_plainly_is_read_as_itself_or_refused(v):
    for validator in (common.nonneg_float, common.positive_float, common.budget_minutes, common.wait_seconds):
        got = check(validator, repr(v))
        assert got is None or got == v


def test_minus_zero_is_zero():
    assert math.copysign(1, common.nonneg_float("-0")) == 1 and math.copysign(1, common.nonneg_float("-0.0")) == 1


# ----------------------------------------------------------------------------------- what the numbers become


@settings(max_examples=200, deadline=None)
@given(text=TEXT)
def test_an_accepted_budget_gives_a_finite_deadline_every_run_accepts(text):
    """--budget-minutes M: the sweep's clock ends at now + 60 M, and each run is passed --deadline (end - a round),
    which validation.dnn reads with positive_float: it must be finite (1e308 minutes made it inf, and every run
    refused it)."""
    minutes = check(common.budget_minutes, text)
    if minutes is not None:
        end = Budget(minutes).end
        assert math.isfinite(end) and end >= time.time() - 1.0
        common.positive_float(repr(end - 3600.0))  # the run's --deadline (a round before the end) parses


@settings(max_examples=200, deadline=None)
@given(text=TEXT)
def test_an_accepted_validity_is_a_date_a_certificate_can_carry(text):
    """flower keys --days D: the certificates end at now + D days (3,000,000 days overflowed datetime)."""
    days = check(common.certificate_days, text)
    if days is not None:
        end = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=days)
        assert end.year <= 9999


@settings(max_examples=100, deadline=None)
@given(text=TEXT)
def test_an_accepted_wait_is_one_every_blocking_call_takes(text):
    seconds = check(common.wait_seconds, text)
    if seconds is not None:
        lock = threading.Lock()  # free: acquire returns at once, after checking the timeout as every wait does
        assert lock.acquire(timeout=seconds)
        lock.release()


def test_the_bounds_are_refused_one_past_them():
    with pytest.raises(argparse.ArgumentTypeError, match="at most 36500 days"):
        common.certificate_days("3000000")
    with pytest.raises(argparse.ArgumentTypeError, match="at most 10000000 minutes"):
        common.budget_minutes("1e308")
    with pytest.raises(argparse.ArgumentTypeError, match="seconds, got 1e300$"):
        common.wait_seconds("1e300")


# ------------------------------------------------------------------------------------ every command's parser

NUMERIC = (int, float, *CONTRACTS)


def numeric_flags():
    """(command, flag) of every flag whose type reads a number."""
    return [
        pytest.param(name, flag, id=f"{name} {flag}")
        for name, flags in {
            "superlinear": ["--rounds", "--clients", "--lr", "--lam", "--seed", "--max-ratio", "--jobs"],
            "dnn": ["--rounds", "--clients", "--lr", "--seed", "--damping", "--deadline", "--max-ratio", "--alpha"],
            "flower": ["--rounds", "--clients", "--timeout", "--max-ratio", "--lam", "--seed"],
            "flower keys": ["--days", "--nodes"],
            "flower prepare": ["--clients", "--alpha", "--seed"],
            "experiments": ["--budget-minutes", "--gpus-per-task", "--max-retries", "--seed"],
            "bench_convex": ["--seed"],
            "bench_dnn": ["--threads", "--client-chunk", "--repeats", "--stack", "--seed"],
            "figures": ["--budget-minutes", "--seed"],
            "splits": ["--alpha", "--clients", "--seeds"],
        }.items()
        for flag in flags
    ]


@pytest.fixture(scope="module")
def parsers():
    mp = pytest.MonkeyPatch()
    try:
        return {name: parser_of(name, mp) for name in PARSED}
    finally:
        mp.undo()


@pytest.mark.parametrize("name", sorted(PARSED))
def test_no_flag_reads_a_number_with_a_bare_int_or_float(name, parsers):
    """A bare ``type=int`` takes 10**4000 as a thread count and ``type=float`` takes nan: every number goes through
    a validator of validation.common (or a list of them)."""
    bare = [a.option_strings[-1] for a in parsers[name]._actions if a.type in (int, float)]
    assert not bare, f"{name}: {bare}"


@pytest.mark.parametrize("name,flag", numeric_flags())
def test_every_numeric_flag_refuses_a_hostile_value_in_one_line(name, flag, parsers, capsys):
    parser = parsers[name]
    (action,) = [a for a in parser._actions if flag in a.option_strings]
    assert action.type not in (None, int, float, str), f"{name} {flag}: no number validator"
    for text in ["nan", "inf", "-inf", "1e309", "-1", "9" * 5000, "", "0x10", "1,5\n2"]:
        with pytest.raises(SystemExit) as exc:
            parser.parse_known_args([f"{flag}={text}"])
        lines = capsys.readouterr().err.splitlines()
        assert exc.value.code == 2 and len(lines) == 1 and flag in lines[0] and len(lines[0]) < 240, (text, lines)


@given(value=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(10**400), 10**400)))
@settings(max_examples=300, deadline=None, derandomize=True)
def test_a_flag_takes_a_number_exactly_when_the_libraries_number_rule_does(value):
    """The flags' parser and the library's checks (hyper-parameters, FOOF, schedules, saved state) share one rule:
    a flag's text is refused as a number exactly where fedconvex.hyperparams.number_problem refuses its value."""
    from fedconvex.hyperparams import number_problem

    text = repr(value) if isinstance(value, float) else str(value)
    try:
        common._number(text)
        accepted = True
    except argparse.ArgumentTypeError as exc:
        accepted = False
        assert str(exc) == f"{number_problem(float(text))}, got {common._shown(text)}"
    parsed = float(text)
    assert accepted == (number_problem(parsed) is None)
