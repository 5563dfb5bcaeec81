"""Local deployment: one SuperLink and N SuperNodes on 127.0.0.1 as child processes, then ``flwr run``.

Every process started here is stopped by pid when the run ends -- normally, on an error, or on
Ctrl-C / SIGTERM -- and the private temporary folder is removed.  Telemetry is off and FLWR_HOME
is inside that folder, so nothing outside loopback is contacted and the user's ~/.flwr is
untouched.  The Flower executables are taken from the folder of ``sys.executable`` (the
virtualenv's bin/, which need not be on PATH), else from PATH.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from .config import FlowerRunConfig, RoundsWatch, progress_file

APP_TOML = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fedpm-flower-app"
version = "1.0.0"
description = "FedPM on Flower (the code lives in the installed fedpm_flower package)"
license = "MIT"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "fedpm"

[tool.flwr.app.components]
serverapp = "fedpm_flower.apps:server_app"
clientapp = "{clientapp}"

[tool.flwr.app.config]
{config}
"""


CLIENT_APP = "fedpm_flower.apps:client_app"


def write_app(folder: str, cfg: FlowerRunConfig | None, clientapp: str = CLIENT_APP) -> str:
    """The Flower app folder `flwr run` needs (its code is the installed fedpm_flower package);
    ``clientapp``: the ClientApp object as ``module:attribute`` (another one wraps ours, e.g. in tests)."""
    os.makedirs(folder, exist_ok=True)
    values = (cfg or FlowerRunConfig()).to_run_config()
    with open(os.path.join(folder, "pyproject.toml"), "w") as fh:
        fh.write(
            APP_TOML.format(clientapp=clientapp, config="\n".join(f"{k} = {_toml_value(v)}" for k, v in values.items()))
        )
    return folder


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    return repr(v)


def executable(name: str) -> str:
    """``name`` next to the running interpreter (a virtualenv's bin/), else on PATH."""
    here = os.path.join(os.path.dirname(os.path.abspath(sys.executable)), name)
    if os.path.isfile(here) and os.access(here, os.X_OK):
        return here
    found = shutil.which(name)
    if found is None:
        from fedconvex.extras import install_hint

        hint = install_hint("Flower", "flower")
        raise RuntimeError(f"{name} not found next to {sys.executable} nor on PATH; {hint}")
    return found


def _last_line(path: str) -> str:
    try:
        with open(path, errors="replace") as fh:
            lines = [ln.strip() for ln in fh.read().splitlines() if ln.strip()]
        return lines[-1][-300:] if lines else "(empty log)"
    except OSError:
        return "(no log)"


class LocalFederation:
    """Context manager owning the SuperLink and SuperNode processes."""

    def __init__(
        self,
        clients: int,
        workdir: str | None = None,
        log_dir: str | None = None,
        data_dir: str | None = None,
        secure: bool = True,
    ):
        self.clients = clients
        # TLS and SuperNode authentication unless asked not to (fedpm_flower.credentials): throw-away credentials
        # in the private folder, removed with it
        self.secure = secure
        self.creds = None
        self.data_dir = os.path.abspath(data_dir) if data_dir else None  # prepared partitions: node i gets client-i/
        self.own_dir = workdir is None  # a folder we made is removed when the federation stops
        self.dir = workdir or tempfile.mkdtemp(prefix="fedpm-flower-")
        self.log_dir = log_dir or os.path.join(self.dir, "logs")
        self.procs: list[subprocess.Popen] = []
        bindir = os.path.dirname(os.path.abspath(sys.executable))
        # the ServerApp and ClientApps must run this very fedpm_flower (a checkout's, not whatever copy is
        # installed): its folder goes first on their PYTHONPATH
        code = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.pathsep.join(p for p in (code, os.environ.get("PYTHONPATH", "")) if p)
        # SuperExec starts flwr-serverapp / flwr-clientapp by name: they must be found on PATH
        self.env = {
            **os.environ,
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_HOME": os.path.join(self.dir, "flwr-home"),
            "PYTHONUNBUFFERED": "1",
            "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
            "PYTHONPATH": path,
        }
        self.control = self.fleet = None

    def _start(self, name, args):
        log = open(os.path.join(self.log_dir, f"{name}.log"), "w")
        p = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.dir, start_new_session=True
        )  # its own group: ServerApp/ClientApp children stop with it
        self.procs.append(p)
        return p

    def __enter__(self):
        try:
            return self._enter()
        except BaseException:
            self.__exit__()
            raise

    def _enter(self):
        os.makedirs(self.log_dir, exist_ok=True)
        os.makedirs(self.env["FLWR_HOME"], exist_ok=True)
        if self.secure:
            from .credentials import write_credentials

            self.creds = write_credentials(os.path.join(self.dir, "credentials"), self.clients)
        # flwr 1.42 serves the Runtime, Control and Fleet APIs on one HTTP address
        port = free_port()
        # the SuperLink's state in memory, by flwr's own name for it: any other name is a SQLite file, whose
        # writers wait at most 5 s for its lock -- with many nodes on few cores a reply's write then fails
        # ("database is locked", HTTP 500), the node drops the reply and the ServerApp waits out --timeout
        from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME

        self.fleet = self.control = port
        self._start(
            "superlink",
            [executable("flower-superlink")]
            + (self.creds.superlink_args() if self.secure else ["--insecure"])
            + ["--host", "127.0.0.1", "--port", str(port), "--database", FLWR_IN_MEMORY_DB_NAME],
        )
        self._wait_listening(port, 60.0)
        with open(os.path.join(self.env["FLWR_HOME"], "config.toml"), "w") as fh:
            fh.write(
                f'[superlink]\ndefault = "fedpm"\n\n[superlink.fedpm]\naddress = "127.0.0.1:{self.control}"\n'
                + (f"root-certificates = {json.dumps(self.creds.ca_cert)}\n" if self.secure else "insecure = true\n")
            )
        if self.secure:  # only registered keys may join: register ours before any SuperNode starts
            self.register([self.creds.node_pub(i) for i in range(self.clients)])
        for i in range(self.clients):
            self.start_node(
                f"supernode-{i}", self.node_config(i), self.creds.supernode_args(i) if self.secure else None
            )
        self._old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM,)}
        return self

    def start_node(self, name: str, node_config: str, credential_args: list | None) -> subprocess.Popen:
        """Start one SuperNode: with ``credential_args`` (TLS root certificate and key pair) or, with None,
        ``--insecure``."""
        return self._start(
            name,
            [executable("flower-supernode")]
            + (credential_args if credential_args is not None else ["--insecure"])
            + ["--superlink", f"127.0.0.1:{self.fleet}", "--host", "127.0.0.1", "--port", str(free_port())]
            + ["--node-config", node_config],
        )

    def register(self, public_keys: list[str], timeout: float = 600.0) -> None:
        """``flwr supernode register KEY fedpm`` for each public key file, in order, all in one process: each
        command in a process of its own started Flower's CLI anew (about 2 s of CPU: 40 s for twenty keys)."""
        if not public_keys:
            return
        cmd = [sys.executable, "-c", _REGISTER_EACH, *public_keys]
        kw = dict(env=self.env, cwd=self.dir, capture_output=True, text=True)
        try:
            done = subprocess.run(cmd, timeout=timeout, **kw)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"registering the SuperNodes' keys took over {timeout:.0f}s") from None
        if done.returncode != 0:
            before, asked, after = done.stderr.rpartition(_ASKING)
            if not asked:  # it failed before asking (Flower's CLI missing or broken): its own last line says why
                raise RuntimeError(f"registering the SuperNodes' keys failed: {before.strip()[-300:]}")
            refused, _, said = after.partition("\n")
            lines = (re.sub(r"\x1b\[[0-9;]*m", "", ln).strip() for ln in said.splitlines())
            why = " ".join(ln for ln in lines if ln and "Exit Code" not in ln and not ln.startswith("For more"))
            raise RuntimeError(f"Flower refused to register {os.path.basename(refused)}: {why[-300:]}")

    def node_config(self, i: int) -> str:
        """SuperNode i's node config: its partition and, with prepared data, the one folder it reads."""
        conf = f"partition-id={i} num-partitions={self.clients}"
        if self.data_dir:
            from .prepared import client_folder

            conf += f" data-dir={json.dumps(client_folder(self.data_dir, i))}"
        return conf

    def _wait_listening(self, port: int, timeout: float) -> None:
        """Block until the SuperLink accepts connections (``flwr run`` fails before that)."""
        start = time.time()
        while True:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.settimeout(1.0)
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            if self.procs[0].poll() is not None or time.time() - start > timeout:
                self.stop()
                raise RuntimeError(
                    f"the SuperLink did not start listening on 127.0.0.1:{port}: "
                    f"{_last_line(os.path.join(self.log_dir, 'superlink.log'))}"
                )
            time.sleep(0.2)

    def _on_signal(self, signum, frame):
        self.stop()
        before = self._old.get(signum)
        if callable(before):  # the command's own handler (validation's run_command: a one-line "terminated")
            before(signum, frame)
        raise KeyboardInterrupt(f"signal {signum}")

    def alive(self) -> list[int]:
        return [p.pid for p in self.procs if p.poll() is None]

    def descendants(self) -> list[int]:
        """Every live process below the ones started here (SuperExec starts the ServerApp and
        ClientApp processes in sessions of their own, out of reach of a process-group signal)."""
        return descendants({p.pid for p in self.procs})

    def stop(self):
        stragglers = self.descendants() if os.path.isdir("/proc") else []
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for pid in stragglers:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.time() + 10
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        for pid in stragglers:
            try:
                os.kill(pid, signal.SIGKILL)  # no-op for those that already ended
            except ProcessLookupError:
                pass

    def __exit__(self, *exc):
        try:
            self.stop()
        finally:
            for s, h in getattr(self, "_old", {}).items():
                signal.signal(s, h)
            if self.own_dir:
                shutil.rmtree(self.dir, ignore_errors=True)
        return False

    def kill_node(self, i: int) -> None:
        """Kill SuperNode i (and its ClientApp processes): a client dropping out mid-run."""
        p = self.procs[1 + i]
        for pid in [q for q in self.descendants() if _parent_chain_has(q, p.pid)] + [p.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()

    def run(
        self,
        cfg: FlowerRunConfig,
        timeout: float = 600.0,
        on_submitted=None,
        clientapp: str = CLIENT_APP,
        on_rounds=None,
    ) -> dict:
        """Submit the app with ``flwr run`` and wait for the ServerApp's result file.  ``on_rounds(done)`` each
        time the count of rounds done grows (a progress bar): the ServerApp runs in the SuperLink's processes and
        writes the count to its progress file (fedpm_flower.config.RoundsWatch), polled here."""
        out = cfg.out or os.path.join(self.dir, "result.json")
        app = write_app(
            os.path.join(self.dir, "app"), FlowerRunConfig(**{**cfg.to_run_config(), "out": out}), clientapp
        )
        if os.path.exists(out):
            os.remove(out)
        submit = subprocess.run(
            [executable("flwr"), "run", app, "fedpm"],
            env=self.env,
            cwd=self.dir,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if submit.returncode != 0:
            text = [ln.strip(" │╭╮╰╯─") for ln in (submit.stdout + submit.stderr).splitlines()]
            raise RuntimeError("flwr run failed: " + " ".join(t for t in text if t)[-400:])
        if on_submitted is not None:
            on_submitted(self)
        # --timeout bounds each wait of the ServerApp for the SuperNodes (a round's replies; the ServerApp drops
        # a node that does not answer in time), so a run of any length is healthy while the waits keep ending:
        # the ServerApp marks each (apps.Heartbeat) and only a silence longer than one wait plus the server's
        # own work (start-up included) means it is stuck
        beat, idle = progress_file(out), 2 * timeout + IDLE_GRACE
        last, count_rounds = time.time(), RoundsWatch(out, on_rounds)
        while not os.path.exists(out):
            count_rounds()
            dead = [p.args[0] for p in self.procs[:1] if p.poll() is not None]  # the SuperLink must live
            if dead:
                raise RuntimeError(
                    f"the SuperLink exited early: {_last_line(os.path.join(self.log_dir, 'superlink.log'))}"
                )
            try:
                last = max(last, os.stat(beat).st_mtime)
            except OSError:
                pass
            if time.time() - last > idle:
                raise TimeoutError(
                    f"the ServerApp made no progress for {idle:.0f}s (2 x --timeout {timeout:g}s + "
                    f"{IDLE_GRACE:.0f}s): it is stuck or gone"
                )
            time.sleep(0.5)
        time.sleep(0.2)  # the ServerApp replaces the file atomically; let a just-written one settle
        count_rounds()  # the last rounds, done since the last look
        with open(out) as fh:
            result = json.load(fh)
        if "error" in result:
            raise RuntimeError(f"the ServerApp failed: {result['error']}")
        return result


IDLE_GRACE = 60.0  # seconds of the ServerApp's own work (start-up, a server step) beyond its waits

# Flower's own `flwr supernode register KEY fedpm`, once per key given, through the CLI's entry point (flwr.cli.app,
# the `flwr` command's); each key is announced on stderr first (_ASKING KEY), so what Flower printed about a key it
# refused follows that key's line; the first refusal ends it with exit code 1
_ASKING = "registering: "
_REGISTER_EACH = f"""
import sys
from flwr.cli.app import app
for key in sys.argv[1:]:
    print({_ASKING!r} + key, file=sys.stderr, flush=True)
    try:
        code = app(["supernode", "register", key, "fedpm"], standalone_mode=False)
    except SystemExit as exc:  # Flower's CLI logs why, then exits
        code = exc.code
    except Exception as exc:  # click's errors, raised rather than printed outside its standalone mode
        print(f"{{type(exc).__name__}}: {{exc}}", file=sys.stderr)
        code = 1
    if code not in (0, None):
        sys.exit(1)
"""


def descendants(roots: set) -> list[int]:
    """Every live process below the processes ``roots`` (from /proc; [] without it)."""
    parent = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
                if fields[0] != "Z":
                    parent[int(entry)] = int(fields[1])
            except (OSError, IndexError, ValueError):
                continue
    found, changed = set(), True
    while changed:
        changed = False
        for pid, ppid in parent.items():
            if pid not in found and (ppid in roots or ppid in found):
                found.add(pid)
                changed = True
    return sorted(found)


def stop_tree(pid: int, grace: float = 10.0) -> None:
    """Stop process ``pid`` (the leader of its own process group) and everything below it: SIGTERM, then
    SIGKILL after ``grace`` seconds.  The tree is read first: a child whose parent dies is re-parented."""
    below = descendants({pid})
    for target, kill in [(pid, os.killpg), (pid, os.kill)] + [(q, os.kill) for q in below]:
        try:
            kill(target, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.time() + grace
    while time.time() < deadline and any(os.path.exists(f"/proc/{q}") and not _zombie(q) for q in [pid, *below]):
        time.sleep(0.1)
    for target, kill in [(pid, os.killpg), (pid, os.kill)] + [(q, os.kill) for q in below]:
        try:
            kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _parent_chain_has(pid: int, ancestor: int) -> bool:
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                pid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if pid == ancestor:
            return True
    return False


def cleanup(path):
    shutil.rmtree(path, ignore_errors=True)
