"""One busy Flower federation at a time.  On two cores, the twenty-SuperNode test (sixty processes starting at once)
beside the shared deployment or another Flower run starved both: replies came after their round's wait and Ray's
simulation failed.  Runs that can share the machine take the lock shared; the twenty-SuperNode test takes it alone.
The lock file's path comes from the environment that pytest's main process sets before its workers start
(tests/conftest.py), so every worker and the shared deployment's process use the same file."""

import contextlib
import fcntl
import os

LOCK_VARIABLE = "FEDPM_TEST_FEDERATIONS_LOCK"


@contextlib.contextmanager
def federation(alone: bool = False):
    """Hold the lock while the block runs: shared, or ``alone`` (no other holder)."""
    path = os.environ.get(LOCK_VARIABLE)
    if not path:  # outside pytest (python tests/flower_deployment.py FOLDER by hand): nothing to share with
        yield
        return
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
