"""A command run as from a user's shell: its stderr on a pseudo-terminal (so it draws its progress bar, and whatever
any of its processes writes to that descriptor is seen, as the user would see it), its stdout on a pipe."""

import fcntl
import os
import pty
import struct
import subprocess
import termios
import threading


def run_on_a_terminal(cmd: list, env: dict, cwd: str, timeout: float = 900.0, columns: int = 120):
    """(exit code, stdout, what reached the terminal) of ``cmd``; the terminal is ``columns`` wide."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    drawn = []

    def read_terminal():
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every process holding the terminal has closed it
                return
            if not chunk:
                return
            drawn.append(chunk)

    reader = threading.Thread(target=read_terminal, daemon=True)
    try:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave, text=True
        )
    finally:
        os.close(slave)
    reader.start()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    # a process the command started may hold the terminal a moment longer; what it writes then still counts
    reader.join(timeout=30)
    os.close(master)
    return proc.returncode, out, b"".join(drawn).decode(errors="replace")
