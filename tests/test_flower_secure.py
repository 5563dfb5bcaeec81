"""Flower deployment with TLS and SuperNode authentication (fedpm_flower.credentials, LocalFederation's
default): the credentials themselves, the keys command, and real SuperLink/SuperNode processes on loopback
-- a secure run equals the in-process run, a SuperNode with an unregistered key or that does not trust the
CA never takes part, hostile SuperNodes' replies are each rejected with their reason and the model equals
the run without them, a SuperNode killed mid-round is dropped, and nothing is left behind."""

import glob
import os
import re
import stat
import subprocess

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")

from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from flower_deployment import HOSTILE, HOSTILE_MODES, KILLED, result_of  # noqa: E402

from fedpm_flower.credentials import write_credentials  # noqa: E402

os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
TESTS = os.path.dirname(os.path.abspath(__file__))


def modes_below(folder):
    """{relative path: permission bits} of every file and folder below ``folder`` (itself included)."""
    found = {".": stat.S_IMODE(os.stat(folder).st_mode)}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            found[os.path.relpath(path, folder)] = stat.S_IMODE(os.lstat(path).st_mode)
    return found


# ----------------------------------------------------------------------------- the credentials
def test_credentials_chain_to_the_ca_name_the_hosts_and_are_owner_only(tmp_path):
    creds = write_credentials(str(tmp_path / "k"), 2, hosts=("10.1.2.3", "server.example.org"))
    ca = x509.load_pem_x509_certificate(open(creds.ca_cert, "rb").read())
    server = x509.load_pem_x509_certificate(open(creds.server_cert, "rb").read())
    server.verify_directly_issued_by(ca)  # raises unless the CA signed it
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == ["10.1.2.3"]
    assert san.get_values_for_type(x509.DNSName) == ["server.example.org"]
    key = serialization.load_pem_private_key(open(creds.server_key, "rb").read(), None)
    assert key.public_key().public_numbers() == server.public_key().public_numbers()
    for i in range(2):
        node = serialization.load_ssh_private_key(open(creds.node_key(i), "rb").read(), None)
        pub = serialization.load_ssh_public_key(open(creds.node_pub(i), "rb").read())
        assert isinstance(node, ec.EllipticCurvePrivateKey) and node.curve.name == "secp384r1"
        assert node.public_key().public_numbers() == pub.public_numbers()
        assert open(creds.node_ca(i), "rb").read() == open(creds.ca_cert, "rb").read()
    n0 = serialization.load_ssh_public_key(open(creds.node_pub(0), "rb").read()).public_numbers()
    n1 = serialization.load_ssh_public_key(open(creds.node_pub(1), "rb").read()).public_numbers()
    assert n0 != n1
    modes = modes_below(creds.folder)
    assert all(m == 0o700 for p, m in modes.items() if os.path.isdir(os.path.join(creds.folder, p)))
    assert all(m == 0o600 for p, m in modes.items() if not os.path.isdir(os.path.join(creds.folder, p)))
    assert not any("ca.key" in p for p in modes)  # the CA's private key is never stored


def test_credentials_never_overwrite_or_follow_a_link(tmp_path):
    folder = tmp_path / "k"
    write_credentials(str(folder), 1)
    before = open(folder / "superlink" / "server.key", "rb").read()
    with pytest.raises(FileExistsError):
        write_credentials(str(folder), 1)
    assert open(folder / "superlink" / "server.key", "rb").read() == before
    other = tmp_path / "other"
    os.makedirs(other / "superlink")
    os.symlink(tmp_path / "victim", other / "superlink" / "ca.crt")
    with pytest.raises(OSError):
        write_credentials(str(other), 1)
    assert not os.path.exists(tmp_path / "victim")
    with pytest.raises(ValueError, match="positive integer"):
        write_credentials(str(tmp_path / "n"), 0)
    with pytest.raises(ValueError, match="neither a DNS name nor an IP address"):
        write_credentials(str(tmp_path / "h"), 1, hosts=("a b",))


def test_keys_command_writes_a_folder_per_machine_and_refuses_a_used_folder(tmp_path, capsys, monkeypatch):
    from validation import flower

    out = tmp_path / "keys"
    monkeypatch.chdir(tmp_path)  # --out relative, as typed: printed back as given
    assert flower.main(["keys", "--out", "keys", "--nodes", "3", "--host", "lab.example.org"]) == 0
    printed = capsys.readouterr().out
    assert "\nwrote keys: superlink/" in printed and str(tmp_path) not in printed
    assert "lab.example.org:9092" in printed and "flwr supernode register supernode-0/node.pub" in printed
    assert sorted(os.listdir(out)) == ["COMMANDS.txt", "superlink", "supernode-0", "supernode-1", "supernode-2"]
    assert sorted(os.listdir(out / "supernode-1")) == ["ca.crt", "node.key", "node.pub"]
    assert set(modes_below(str(out)).values()) == {0o700, 0o600}
    with pytest.raises(SystemExit) as err:
        flower.main(["keys", "--out", str(out), "--nodes", "1"])
    assert err.value.code == 2 and "not an empty folder" in capsys.readouterr().err
    assert not glob.glob(str(tmp_path / ".keys-*"))


def test_insecure_is_refused_where_there_is_no_network(capsys):
    from validation import flower

    with pytest.raises(SystemExit):
        flower.main(["--mode", "simulation", "--insecure"])
    assert "--insecure applies to --mode deployment only" in capsys.readouterr().err


# ------------------------------------------------------------------------- real deployments
def config(method="fedpm", **kw):
    from fedconvex.algorithms import REGISTRY
    from fedpm_flower.config import FlowerRunConfig

    lr = REGISTRY[method].__dataclass_fields__["lr"].default
    return FlowerRunConfig(**{"method": method, "dataset": "a9a", "clients": 2, "rounds": 2, "lr": lr, **kw})


def in_process_without(cfg, absent=lambda t: ()):
    """The in-process model when the clients ``absent(t)`` take no part in round t (their replies rejected:
    FedPM's weights renormalised over the others)."""
    from test_flower import _in_process_parts

    from fedconvex.run import run

    problem, alg = _in_process_parts(cfg)

    def drop(t, up):
        bad = np.array(up["theta"], copy=True)
        bad[sorted(absent(t))] = np.nan
        return {**up, "theta": bad}

    state, _ = run(problem, alg, np.zeros(problem.d), cfg.rounds, tamper=drop, client_streams=True)
    return np.asarray(state.theta)


@pytest.mark.slow
def test_keys_are_registered_in_order_and_the_first_refused_one_is_named(tmp_path, monkeypatch):
    """LocalFederation registers the SuperNodes' public keys with Flower's own command, all in one process (one CLI
    start-up, not one per key): a key registers, and the first one refused ends it with one error naming that key and
    Flower's reason."""
    from fedpm_flower.deploy import LocalFederation

    other = write_credentials(str(tmp_path / "other"), 1)  # a valid key the SuperLink has not seen
    bad = tmp_path / "bad.pub"
    bad.write_text("not a public key\n")
    with LocalFederation(1) as fed:  # its own node's key registered at start-up
        started = []
        monkeypatch.setattr(subprocess, "run", lambda *a, real=subprocess.run, **k: started.append(a) or real(*a, **k))
        with pytest.raises(RuntimeError, match=r"refused to register bad\.pub: .*public key") as exc:
            fed.register([other.node_pub(0), str(bad)])
        assert "\n" not in str(exc.value) and len(started) == 1, (str(exc.value), started)


@pytest.mark.slow
def test_secure_run_equals_in_process_and_keeps_intruders_out(deployment_runs):
    """TLS + authentication by default; a SuperNode with an unregistered key and one that does not trust
    the CA never get a node id, so no reply of theirs can reach the server; the run equals the in-process
    run (the shared deployment's FedNL run, tests/flower_deployment.py); the private folder with every
    credential is gone afterwards."""
    runs = deployment_runs
    result, cfg = result_of(runs, "fednl"), runs["configs"]["fednl"]
    superlink = runs["superlink_args"]
    assert "--insecure" not in superlink and "--enable-supernode-auth" in superlink
    from validation.flower import in_process

    np.testing.assert_allclose(np.asarray(result["theta"]), in_process(cfg), rtol=1e-10, atol=1e-12)
    assert [h["used"] for h in result["history"][1:]] == [3, 3]
    logs = runs["logs"]
    for text in (logs["unregistered"], logs["untrusting"]):  # each tried, was turned away, never got a node id
        assert "Connection attempt failed" in text
        assert "SuperNode ID" not in text and "Receiving: train message" not in text
    # the unregistered key reached the SuperLink and was refused there; the other failed in the TLS handshake
    assert "No SuperNode found with the given public key" in logs["superlink"]
    assert re.search(r'"POST /v1/fleet/activate-node HTTP/1.1" 4\d\d', logs["superlink"])
    # the federation's one folder under the temporary folder (others there may be other runs' on this machine)
    assert not runs["private_left"]


@pytest.mark.slow
def test_the_superlink_keeps_its_state_in_memory(deployment_runs):
    """After six runs the private folder holds no SQLite database: a database file's writers wait at most 5 s for
    its lock, and with many SuperNodes on few cores a reply's write failed ("database is locked"), so its node
    dropped the reply and the round waited out its timeout."""
    assert deployment_runs["sqlite_files"] == []
    from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME

    args = deployment_runs["superlink_args"]
    assert args[args.index("--database") + 1] == FLWR_IN_MEMORY_DB_NAME


REASONS = {
    "spoof": "claims client id 0",
    "nan": "theta contains NaN or Inf",
    "huge": "preconditioner trace",
    "dtype": "theta has dtype complex128",
    "shape": "theta has shape (122,), expected (123,)",
    "oversized": "theta has shape (200000,), expected (123,)",
    "codec": "undecodable preconditioner payload",
}


@pytest.mark.slow
def test_hostile_supernodes_are_each_rejected_with_their_reason(deployment_runs):
    """Two SuperNodes falsify their replies, round t each its t-th way (every way once between them), beside an
    honest one: every falsified reply is rejected with its reason in the server's warnings (kept in result.json),
    and the model equals the in-process run in which only the honest client took part."""
    result, cfg = result_of(deployment_runs, "hostile"), deployment_runs["configs"]["hostile"]
    warnings = result["server_warnings"]
    shown = {node: modes[: cfg.rounds - (node == KILLED)] for node, modes in HOSTILE_MODES.items()}
    assert set(REASONS) == set(HOSTILE) == {mode for modes in shown.values() for mode in modes}
    rounds = result["history"][1:]
    assert [(h["used"], h["rejected"]) for h in rounds] == [(1, 2)] * (cfg.rounds - 1) + [(1, 1)], warnings
    for node, modes in shown.items():
        for t, mode in enumerate(modes, start=1):
            start = f"round {t}: client {node} rejected: "
            assert any(w.startswith(start) and REASONS[mode] in w for w in warnings), (node, t, mode, warnings)
    reference = in_process_without(cfg, lambda t: set(HOSTILE_MODES))
    np.testing.assert_allclose(np.asarray(result["theta"]), reference, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_a_supernode_killed_mid_round_is_dropped_and_reported(deployment_runs):
    """SuperNode 2 is killed by its pid once it has received the hostile run's last message: that round ends at the
    timeout without it, the history and the warnings say so (every earlier round had its reply), and the model
    equals the in-process run without client 2 in that round (nor, its replies rejected, in the earlier ones)."""
    result, cfg = result_of(deployment_runs, "hostile"), deployment_runs["configs"]["hostile"]
    rounds = result["history"][1:]
    assert [h["dropped"] for h in rounds] == [0] * (cfg.rounds - 1) + [1], result["server_warnings"]
    assert any(w.startswith(f"round {cfg.rounds}: 1 of 3 clients did not reply") for w in result["server_warnings"])
    assert not any(w.startswith(f"round {cfg.rounds}: client {KILLED} rejected") for w in result["server_warnings"])
    reference = in_process_without(cfg, lambda t: {1, KILLED})
    np.testing.assert_allclose(np.asarray(result["theta"]), reference, rtol=1e-10, atol=1e-12)
