"""One real secure deployment (fedpm_flower.deploy.LocalFederation: a SuperLink and three SuperNodes on loopback,
TLS and SuperNode authentication) shared by the deployment tests of several modules: starting the processes is
most of a deployment test's time, and a federation serves any number of ``flwr run`` submissions, each a run
with its own node contexts.  ``deployment_runs`` (tests/conftest.py) does every run once, in this order:

* two intruders are started beside the three SuperNodes (an unregistered key; a registered key with a CA of its
  own) and must never get a node id;
* ``fednl`` and ``cnn`` (FedPM on the CNN): plain runs, each to equal its in-process run (FedNL keeps state on
  the nodes; every method's Flower run is compared with its in-process run in tests/test_flower.py); the launcher
  draws ``fednl``'s progress bar on a terminal from the ServerApp's count of rounds done;
* ``hostile``: SuperNodes 1 and 2 run tests/hostile_clientapp.py and each falsifies its replies, round t the t-th
  of its ``HOSTILE_MODES`` (the ``HOSTILE`` ways shared out between them, two falsified replies a round); SuperNode 0
  is honest.  SuperNode 2, its ways shown, is killed once it has received the last round's message (a node dropping
  out mid-round): that round waits the run's ``KILL_TIMEOUT`` for it;
* ``dead``: a run submitted with SuperNode 2 dead (a node dropping out), once the SuperLink has missed its
  heartbeats long enough to list it offline; the launcher's timeout is the round's (``cfg.timeout``), so it must
  bound each wait, not the whole run: the ServerApp's setup waits that long for a third node before it trains with
  the two it has.  The wait is DEAD_TIMEOUT: each reply comes from a ClientApp process started for that message,
  seconds on an idle machine and up to a minute beside a busy test suite, so the live nodes get well over that.

A run that fails keeps its exception, raised again by the tests that assert on that run alone."""

import json
import os
import sys
import time

from federations import federation

from fedpm_flower.config import FlowerRunConfig
from fedpm_flower.credentials import write_credentials
from fedpm_flower.deploy import LocalFederation

TESTS = os.path.dirname(os.path.abspath(__file__))
NODES = 3
HOSTILE = ("spoof", "nan", "huge", "dtype", "shape", "oversized", "codec")
# the falsifying SuperNodes and their ways, in the order of the rounds: every way once in as few rounds as two nodes
# take (each round starts a ClientApp process per node); SuperNode 2's ways end a round early, as it is killed in the
# last one
HOSTILE_MODES = {1: HOSTILE[0::2], 2: HOSTILE[1::2]}
HOSTILE_ROUNDS = max(len(modes) for modes in HOSTILE_MODES.values())
KILLED = 2  # killed in the hostile run's last round, after its ways
assert len(HOSTILE_MODES[KILLED]) < HOSTILE_ROUNDS
MARK = "FEDPM_TEST_RUN"  # in the environment of every process of this federation (live_flower_processes)
# the hostile run's wait for each round's replies, and so for the node killed in its last round: the honest and the
# falsified replies of the rounds before must arrive within it (ClientApps starting beside a busy suite)
KILL_TIMEOUT = 60.0
# the dead run's wait: its live nodes' replies took up to 55 s beside the suite (ClientApp processes starting on two
# loaded cores), and a wait sized from the earlier rounds was once too short when the load rose in between
DEAD_TIMEOUT = 150.0


def logreg(method, **kw):
    from fedconvex.algorithms import REGISTRY

    lr = REGISTRY[method].__dataclass_fields__["lr"].default
    return FlowerRunConfig(**{"method": method, "dataset": "a9a", "clients": NODES, "rounds": 2, "lr": lr, **kw})


def wait_until_listed_offline(killed_at: float) -> None:
    """Sleep until the SuperLink lists a node killed at ``killed_at`` offline: after HEARTBEAT_PATIENCE of its
    heartbeat intervals without one (flwr's defaults), and a few seconds more."""
    from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL, HEARTBEAT_PATIENCE

    time.sleep(max(0.0, killed_at + HEARTBEAT_PATIENCE * HEARTBEAT_DEFAULT_INTERVAL + 5.0 - time.time()))


def configs(folder):
    """The runs, in the order they are submitted."""
    out = lambda name: os.path.join(folder, f"{name}.json")  # noqa: E731
    return {
        "fednl": logreg("fednl", out=out("fednl")),
        # one round each: carrying state from round to round is fednl's and hostile's to show
        "cnn": FlowerRunConfig(problem="cnn", method="fedpm", clients=NODES, rounds=1, lr=0.1, out=out("cnn")),
        "hostile": logreg(
            "fedpm", rounds=HOSTILE_ROUNDS, precond_codec="sym", timeout=KILL_TIMEOUT, out=out("hostile")
        ),
        "dead": logreg("fedpm", rounds=1, timeout=DEAD_TIMEOUT, out=out("dead")),
    }


def log_of(fed, name):
    with open(os.path.join(fed.log_dir, f"{name}.log"), errors="replace") as fh:
        return fh.read()


class Federation(LocalFederation):
    """SuperNodes 1 and 2 carry their hostile modes in their node configs; only the hostile ClientApp reads them."""

    def node_config(self, i):
        modes = HOSTILE_MODES.get(i)
        return super().node_config(i) + (f' hostile="{",".join(modes)}"' if modes else "")


def run_all(folder, report=None) -> dict:
    """Every run, in order; ``report(line)`` (default: stderr) hears how long each took."""
    from test_flower import live_flower_processes

    report = report or (lambda line: print(line, file=sys.stderr))
    folder = str(folder)
    cfgs = configs(folder)
    found = {"configs": cfgs, "errors": {}}
    strangers = write_credentials(os.path.join(folder, "strangers"), 2)
    old_mark = os.environ.get(MARK)
    os.environ[MARK] = folder
    mark = f"{MARK}={folder}"
    found["mark"] = mark
    old_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = TESTS + os.pathsep + (old_path or "")  # the ClientApps import hostile_clientapp
    try:
        with federation(), Federation(NODES) as fed:
            found["superlink_args"] = list(fed.procs[0].args)
            found["private"] = fed.dir
            # our CA, a key that was never registered
            fed.start_node(
                "unregistered",
                "partition-id=0",
                ["--root-certificates", fed.creds.ca_cert, "--auth-supernode-private-key", strangers.node_key(0)],
            )
            # a registered key, but a CA of its own: it cannot verify the SuperLink's certificate
            fed.start_node(
                "untrusting",
                "partition-id=1",
                ["--root-certificates", strangers.ca_cert, "--auth-supernode-private-key", fed.creds.node_key(1)],
            )
            for name in list(cfgs):
                if name == "dead" and "killed_at" in found:
                    wait_until_listed_offline(found["killed_at"])
                cfg, start = cfgs[name], time.time()
                try:
                    found[name] = _submit(fed, name, cfg, found)
                    found[name]["seconds"] = time.time() - start
                except Exception as exc:  # kept for the tests of this run; the other runs go on
                    found["errors"][name] = exc
                report(f"deployment run {name}: {time.time() - start:.1f} s")
            found["logs"] = {name: log_of(fed, name) for name in ("unregistered", "untrusting", "superlink")}
            found["sqlite_files"] = sqlite_files(fed.dir)
    finally:
        for name, value in (("PYTHONPATH", old_path), (MARK, old_mark)):
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    time.sleep(1)
    found["private_left"] = os.path.exists(found.get("private", ""))
    found["procs_left"] = live_flower_processes(mark)
    return found


# --------------------------------------------------------------------------- the runs in a process of their own
# Under pytest-xdist the deployment runs beside the tests, in a process the first worker starts when a selected test
# needs it (tests/conftest.py: shared_deployment): most of a deployment's time is waiting for Flower's polls and
# process starts, which would otherwise hold a worker -- and so a core -- for its whole length.  Its findings come
# back as JSON: what the tests compare stays the same, exceptions come back as their type and message.
FOUND = "found.json"


def dump(found: dict, folder) -> None:
    """``found`` as JSON in ``folder``/found.json, written whole (a reader never sees part of it)."""
    plain = {k: v for k, v in found.items() if k not in ("configs", "errors")}
    plain["errors"] = {name: f"{type(exc).__name__}: {exc}" for name, exc in found.get("errors", {}).items()}
    tmp = os.path.join(str(folder), FOUND + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(plain, fh)
    os.replace(tmp, os.path.join(str(folder), FOUND))


def load(folder) -> dict:
    """What ``dump`` wrote, as ``run_all`` returned it (a failed run's exception as a RuntimeError naming it)."""
    with open(os.path.join(str(folder), FOUND)) as fh:
        found = json.load(fh)
    found["configs"] = configs(str(folder))
    found["errors"] = {name: RuntimeError(text) for name, text in found["errors"].items()}
    found["rounds_seen"] = [tuple(pair) for pair in found.get("rounds_seen", ())]
    return found


def wait_for(folder, proc_alive, timeout: float = 3600.0) -> dict:
    """The findings of the process writing ``folder``, once it has written them; ``proc_alive()`` says whether
    it still may."""
    path, deadline = os.path.join(str(folder), FOUND), time.time() + timeout
    while not os.path.exists(path):
        if not proc_alive():
            if os.path.exists(path):  # written just before it ended
                break
            with open(os.path.join(str(folder), "log.txt"), errors="replace") as fh:
                tail = fh.read()[-2000:]
            raise RuntimeError(f"the shared deployment ended without its findings:\n{tail}")
        if time.time() > deadline:
            raise TimeoutError(f"the shared deployment gave no findings within {timeout:.0f} s")
        time.sleep(1.0)
    return load(folder)


def sqlite_files(folder) -> list:
    """The SQLite databases below ``folder`` (by their header, whatever their names)."""
    found = []
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                with open(os.path.join(root, name), "rb") as fh:
                    if fh.read(16) == b"SQLite format 3\x00":
                        found.append(os.path.relpath(os.path.join(root, name), folder))
            except OSError:
                continue
    return found


def _submit(fed, name, cfg, found):
    if name == "fednl":  # as validation.flower's run_flower draws it, on a terminal
        return _with_bar(fed, cfg, found)
    if name == "dead":
        return fed.run(cfg, timeout=cfg.timeout)
    if name != "hostile":
        return fed.run(cfg, timeout=600)
    node = f"supernode-{KILLED}"
    seen = log_of(fed, node).count("Receiving: train message")  # from the earlier runs

    def kill_in_the_last_round(fed):
        deadline = time.time() + 600
        while log_of(fed, node).count("Receiving: train message") < seen + cfg.rounds:
            assert time.time() < deadline, f"the node never reached round {cfg.rounds}"
            time.sleep(0.1)
        fed.kill_node(KILLED)
        found["killed_at"] = time.time()

    return fed.run(cfg, timeout=600, clientapp="hostile_clientapp:app", on_submitted=kill_in_the_last_round)


def _with_bar(fed, cfg, found):
    from test_cli_vocabulary import FakeTerminal
    from test_flower import live_flower_processes

    from validation.progress import Progress

    term, seen = FakeTerminal(), []
    with Progress(cfg.rounds, f"{cfg.method} rounds", stream=term, unit="round") as bar:

        def on_rounds(done):  # the federation's processes are alive while the bar moves
            seen.append((done, len(live_flower_processes(found["mark"]))))
            bar.update(done - bar.done)

        result = fed.run(cfg, timeout=600, on_rounds=on_rounds)
    found["bar"], found["rounds_seen"] = term.getvalue(), seen
    return result


def result_of(runs: dict, name: str) -> dict:
    """Run ``name``'s result, or its failure raised again."""
    if name in runs["errors"]:
        raise runs["errors"][name]
    return runs[name]


if __name__ == "__main__":  # python tests/flower_deployment.py FOLDER: every run, the findings in FOLDER/found.json
    sys.path.insert(0, TESTS)
    with open(os.path.join(sys.argv[1], "log.txt"), "a") as log:
        dump(run_all(sys.argv[1], report=lambda line: print(line, file=log, flush=True)), sys.argv[1])
