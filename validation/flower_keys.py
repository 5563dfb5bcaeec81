"""Write the TLS certificates and SuperNode keys of a Flower deployment across machines.

    python -m validation.flower keys --out DIR --nodes N --host server.example.org [--host 10.0.0.5]

DIR/superlink/ goes to the server machine (ca.crt, server.pem, server.key), DIR/supernode-i/ to client
machine i (ca.crt, node.key, node.pub); the public keys node.pub are registered with the SuperLink from the
machine that submits runs.  The commands for each machine are printed and written to DIR/COMMANDS.txt.
Every folder is owner-only (0700), every file owner-only (0600).  The certificate authority's private key
is not kept: to add a SuperNode later, make a key pair (any EC key in OpenSSH format, or rerun into a new
folder and register its node.pub); to change the server's host names, rerun and copy the new files.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from fedpm_flower.credentials import MAX_DAYS
from validation import common

PROG = "python -m validation.flower keys"


def host_arg(text):
    """--host: a DNS name or an IP address (fedpm_flower.credentials.check_host), IPv6 without brackets."""
    from fedpm_flower.credentials import check_host

    try:
        return check_host(text)
    except ValueError as exc:
        raise common.argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv):
    p = common.OneLineParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="the folder to create (must not exist, or be empty)")
    p.add_argument("--nodes", type=common.positive_int, required=True, help="how many SuperNode key pairs")
    p.add_argument(
        "--host",
        action="append",
        type=host_arg,
        default=None,
        help="a DNS name or IP address the SuperNodes use to reach the SuperLink, repeatable "
        "(default: 127.0.0.1 and localhost)",
    )
    p.add_argument("--days", type=common.certificate_days, default=30, help="how long the certificates are valid")
    args = p.parse_args(argv)
    parent = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(parent):
        p.error(f"--out {args.out}: its parent {parent} is not an existing folder")
    if args.days > MAX_DAYS:
        p.error(f"--days {args.days}: at most {MAX_DAYS} (100 years)")
    if os.path.lexists(args.out) and (os.path.islink(args.out) or not os.path.isdir(args.out) or os.listdir(args.out)):
        p.error(f"--out {args.out}: exists and is not an empty folder (nothing is overwritten)")
    common.check_out_arg(p, args.out)
    if args.nodes > 10_000:
        p.error(f"--nodes {args.nodes}: at most 10000")
    return args


def commands(folder: str, nodes: int, host: str) -> str:
    """What to run on each machine, with the files of ``folder`` copied to the same relative places."""
    from fedpm_flower.credentials import address

    last = nodes - 1
    return f"""# Flower deployment with TLS and SuperNode authentication (flwr 1.42)
# Copy superlink/ to the server machine and supernode-<i>/ to client machine i; keep them owner-only.

# 1. server machine (port 9092 reachable by the client machines and by you):
flower-superlink --ssl-ca-certfile superlink/ca.crt --ssl-certfile superlink/server.pem \\
    --ssl-keyfile superlink/server.key --enable-supernode-auth --host 0.0.0.0 --port 9092

# 2. your machine: a connection in ~/.flwr/config.toml (FLWR_HOME), trusting the CA ...
[superlink.fedpm]
address = "{address(host, 9092)}"
root-certificates = "/absolute/path/to/superlink/ca.crt"

# ... and register every SuperNode's public key (supernode-0 ... supernode-{last}):
flwr supernode register supernode-0/node.pub fedpm

# 3. client machine i (data partition i of {nodes}):
flower-supernode --superlink {address(host, 9092)} --root-certificates supernode-i/ca.crt \\
    --auth-supernode-private-key supernode-i/node.key \\
    --node-config "partition-id=i num-partitions={nodes}"

# 4. your machine: write the app folder and submit
python -m validation.flower --write-app APP --method fedpm --clients {nodes} --rounds 10
flwr run APP fedpm --run-config "out='/path/on/the/server/result.json'"
"""


def main(argv=None) -> int:
    args = parse_args(argv)
    from fedpm_flower.credentials import DEFAULT_HOSTS, write_credentials

    hosts = tuple(args.host) if args.host else DEFAULT_HOSTS
    out = os.path.abspath(args.out)
    parent = os.path.dirname(out)
    # written in a private sibling folder and renamed into place: an error leaves nothing half-written
    tmp = tempfile.mkdtemp(prefix=".keys-", dir=parent)
    try:
        write_credentials(tmp, args.nodes, hosts=hosts, days=args.days)
        text = commands(out, args.nodes, hosts[0])
        fd = os.open(os.path.join(tmp, "COMMANDS.txt"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        if os.path.isdir(out):
            os.rmdir(out)  # empty (checked above); rename needs the name free
        os.rename(tmp, out)
    except (OSError, ValueError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        common.fail(PROG, exc)
    except BaseException:  # SIGTERM, Ctrl-C, anything unforeseen: no folder of private keys is left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(text)
    # the folder as the user named it, as every command prints its output
    print(f"wrote {args.out}: superlink/ and supernode-0 ... supernode-{args.nodes - 1}/ (owner-only), COMMANDS.txt")
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run_command(PROG, main))
