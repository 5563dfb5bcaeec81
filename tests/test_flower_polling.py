"""The ServerApp's wait for replies (fedpm_flower.transport.FinePolling): every reply, soon after it arrives, and
never past the wait's timeout -- against a Flower grid whose replies arrive at set times."""

import time
from types import SimpleNamespace

import pytest

pytest.importorskip("flwr")

from flwr.serverapp import Grid  # noqa: E402

from fedpm_flower.transport import POLL_LAST, FinePolling, fine_polling  # noqa: E402


class TimedGrid(Grid):
    """Message i's reply can be pulled ``after[i]`` seconds after the push (never, for None); counts the pulls."""

    def __init__(self, after):
        self.after, self.pulls, self.pushed = after, 0, None

    def set_run(self, run):
        pass

    @property
    def run(self):
        return None

    def create_message(self, *args, **kwargs):
        raise NotImplementedError

    def get_node_ids(self):
        return list(range(len(self.after)))

    def push_messages(self, messages):
        self.pushed = time.monotonic()
        return [f"m{i}" for i, _ in enumerate(messages)]

    def pull_messages(self, message_ids):
        self.pulls += 1
        now = time.monotonic() - self.pushed
        ready = [f"m{i}" for i, t in enumerate(self.after) if t is not None and t <= now]
        return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=m)) for m in ready if m in message_ids]

    def send_and_receive(self, messages, *, timeout=None):
        raise AssertionError("FinePolling waits itself")


def replied(replies):
    return sorted(r.metadata.reply_to_message_id for r in replies)


def test_every_reply_comes_back_soon_after_the_last_one_arrives():
    grid = TimedGrid([0.0, 0.3, 0.6])
    start = time.monotonic()
    replies = FinePolling(grid).send_and_receive(["a", "b", "c"], timeout=60)
    waited = time.monotonic() - start
    assert replied(replies) == ["m0", "m1", "m2"]  # each once
    # Flower's own deployment grid looks every 3 s; here the last look comes at most one interval after 0.6 s
    assert 0.6 <= waited < 0.6 + POLL_LAST, waited
    assert grid.pulls <= 20  # backing off, not spinning


def test_a_wait_ends_at_its_timeout_with_the_replies_that_came():
    grid = TimedGrid([0.1, None, 5.0])
    start = time.monotonic()
    replies = FinePolling(grid).send_and_receive(["a", "b", "c"], timeout=0.8)
    waited = time.monotonic() - start
    assert replied(replies) == ["m0"]
    assert 0.8 <= waited < 0.8 + 0.25, waited  # neither before nor long after the timeout


def test_no_message_is_no_wait():
    grid = TimedGrid([])
    assert FinePolling(grid).send_and_receive([], timeout=30) == [] and grid.pulls == 0


def test_only_a_flower_grid_is_wrapped_and_the_rest_of_it_is_the_grids():
    grid = TimedGrid([0.0])
    wrapped = fine_polling(grid)
    assert isinstance(wrapped, FinePolling) and wrapped.get_node_ids() == [0]
    stand_in = SimpleNamespace(send_and_receive=lambda messages, timeout=None: [])
    assert fine_polling(stand_in) is stand_in
