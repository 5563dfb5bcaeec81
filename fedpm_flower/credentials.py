"""TLS certificates and SuperNode key pairs for a Flower deployment (Flower 1.42).

A SuperLink serves its APIs over TLS with a certificate signed by a certificate authority (CA) that the
SuperNodes and the ``flwr`` CLI trust (``--root-certificates`` / ``root-certificates``); with
``--enable-supernode-auth`` it admits only SuperNodes whose public key was registered beforehand
(``flwr supernode register``), each proving it holds the private key.  ``write_credentials`` makes all of
it with ``cryptography`` (installed with flwr): a CA that exists only while the files are written -- its
private key is never stored, so nobody can sign another server certificate with it later --, the
SuperLink's certificate for the given host names and addresses, and one EC P-384 key pair per SuperNode
(both in OpenSSH format, as flower-supernode reads them).  Every folder is created owner-only (0700)
and every file owner-only (0600): private keys never exist with wider permissions, even for an instant.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from dataclasses import dataclass

SUPERLINK_DIR = "superlink"
CA_CERT = "ca.crt"
SERVER_CERT = "server.pem"
SERVER_KEY = "server.key"
NODE_KEY = "node.key"
NODE_PUB = "node.pub"
DEFAULT_HOSTS = ("127.0.0.1", "localhost")
MAX_DAYS = 36500  # validity of 100 years at most: a longer one would overflow the dates a certificate holds


def node_dir(folder: str, i: int) -> str:
    return os.path.join(folder, f"supernode-{i}")


@dataclass(frozen=True)
class Credentials:
    """Paths of the files ``write_credentials`` made below ``folder``."""

    folder: str
    nodes: int

    @property
    def ca_cert(self) -> str:
        return os.path.join(self.folder, SUPERLINK_DIR, CA_CERT)

    @property
    def server_cert(self) -> str:
        return os.path.join(self.folder, SUPERLINK_DIR, SERVER_CERT)

    @property
    def server_key(self) -> str:
        return os.path.join(self.folder, SUPERLINK_DIR, SERVER_KEY)

    def node_key(self, i: int) -> str:
        return os.path.join(node_dir(self.folder, i), NODE_KEY)

    def node_pub(self, i: int) -> str:
        return os.path.join(node_dir(self.folder, i), NODE_PUB)

    def node_ca(self, i: int) -> str:
        return os.path.join(node_dir(self.folder, i), CA_CERT)

    def superlink_args(self) -> list[str]:
        return [
            "--ssl-ca-certfile",
            self.ca_cert,
            "--ssl-certfile",
            self.server_cert,
            "--ssl-keyfile",
            self.server_key,
            "--enable-supernode-auth",
        ]

    def supernode_args(self, i: int) -> list[str]:
        return [
            "--root-certificates",
            self.node_ca(i),
            "--auth-supernode-private-key",  # flwr 1.42 derives the public key from it
            self.node_key(i),
        ]


def _private_dir(path: str) -> None:
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)  # makedirs' mode is filtered by the umask, and an existing folder keeps its own


def _write_private(path: str, data: bytes) -> None:
    """Create ``path`` owner-only from the start (O_EXCL: never through someone else's file or link)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def check_host(host) -> str:
    """``host`` as a certificate and an address name it: an IP address (IPv6 with or without its brackets, given
    back without them) or a DNS name of letters, digits and hyphens in dot-separated labels; else a ValueError
    naming it (a port, a scheme, a path or spaces belong to no host name)."""
    if not isinstance(host, str) or not host.strip():
        raise ValueError(f"host must be a DNS name or an IP address, got {host!r}")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        pass
    name = host[:-1] if host.endswith(".") else host  # a fully qualified name's root dot
    if len(name) > 253 or not all(_DNS_LABEL.fullmatch(label) for label in name.split(".")):
        hint = " (the port is 9092, set by the commands; give the host alone)" if ":" in host else ""
        raise ValueError(f"{host!r} is neither a DNS name nor an IP address{hint}")
    return name


def address(host: str, port: int) -> str:
    """host:port as gRPC and Flower read it: an IPv6 address in brackets ([::1]:9092)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _host_names(hosts) -> list:
    from cryptography import x509

    names = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return names


def write_credentials(folder: str, nodes: int, hosts=DEFAULT_HOSTS, days: int = 30) -> Credentials:
    """Write a throw-away CA's certificate, the SuperLink's certificate and key for ``hosts`` (IP addresses
    and DNS names), and ``nodes`` SuperNode key pairs into ``folder``, laid out one sub-folder per machine:
    ``superlink/`` (ca.crt, server.pem, server.key) and ``supernode-i/`` (ca.crt, node.key, node.pub).
    ``folder`` must not hold any of these files already (nothing is overwritten)."""
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
        raise ValueError(f"nodes must be a positive integer, got {nodes!r}")
    if not isinstance(days, int) or isinstance(days, bool) or not 1 <= days <= MAX_DAYS:
        raise ValueError(f"days must be an integer in 1..{MAX_DAYS}, got {days!r}")
    hosts = tuple(hosts) if not isinstance(hosts, str) else (hosts,)
    if not hosts:
        raise ValueError("hosts must name at least one DNS name or IP address")
    hosts = tuple(check_host(h) for h in hosts)
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def pkcs8(key) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "FedPM deployment CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )  # digital signature, certificate and CRL signing
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP384R1())
    server = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(_host_names(hosts)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    ca_pem = ca.public_bytes(serialization.Encoding.PEM)
    creds = Credentials(os.path.abspath(folder), nodes)
    _private_dir(creds.folder)
    _private_dir(os.path.join(creds.folder, SUPERLINK_DIR))
    _write_private(creds.ca_cert, ca_pem)
    _write_private(creds.server_cert, server.public_bytes(serialization.Encoding.PEM))
    _write_private(creds.server_key, pkcs8(server_key))
    for i in range(nodes):
        key = ec.generate_private_key(ec.SECP384R1())
        _private_dir(node_dir(creds.folder, i))
        _write_private(creds.node_ca(i), ca_pem)
        _write_private(  # OpenSSH format: what flower-supernode reads
            creds.node_key(i),
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
            ),
        )
        _write_private(
            creds.node_pub(i),
            key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH),
        )
    return creds
