"""One busy Flower federation at a time.  On two cores, the twenty-SuperNode test (sixty processes starting at once)
beside the shared deployment or another Flower run starved both: replies came after their round's wait and Ray's
simulation failed.  Runs that can share the machine take the lock shared; the twenty-SuperNode test takes it alone.
The lock file's path comes from the environment that pytest's main process sets before its workers start
(tests/conftest.py), so every worker and the shared deployment's process use the same file."""

import contextlib
import fcntl
import os
import time

LOCK_VARIABLE = "FEDPM_TEST_FEDERATIONS_LOCK"
WAIT = 1800.0  # the longest wait for the lock: the shared deployment's runs, about ten minutes, and a margin


@contextlib.contextmanager
def federation(alone: bool = False, wait: float = WAIT):
    """Hold the lock while the block runs: shared, or ``alone`` (no other holder); a TimeoutError after ``wait``
    seconds without it (a federation that hangs fails the tests waiting for it, not the whole suite's time)."""
    path = os.environ.get(LOCK_VARIABLE)
    if not path:  # outside pytest (python tests/flower_deployment.py FOLDER by hand): nothing to share with
        yield
        return
    with open(path, "a") as fh:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fh, (fcntl.LOCK_EX if alone else fcntl.LOCK_SH) | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another Flower federation of the suite held {path} for {wait:.0f} s") from None
                time.sleep(1.0)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
