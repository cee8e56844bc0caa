"""ssh(1)'s ProxyCommand for a VM's private SSH socket: stdin to the socket, the socket to stdout.

    ssh -o ProxyCommand='python3 -m vfio_cxl.lab.unix_proxy RUNDIR/ssh.sock' ... root@127.0.0.1

OpenSSH reaches TCP hosts only; this joins its stdio to a UNIX socket (what ``nc -U`` does,
without needing netcat on the host).  Exits 255, as ssh does, when the socket cannot be reached."""

from __future__ import annotations

import os
import selectors
import socket
import sys

CHUNK = 1 << 16


def pump(sock: socket.socket, stdin: int, stdout: int) -> None:
    """Copy both ways until the socket closes; EOF on stdin half-closes the socket."""
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(stdin, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            if key.fileobj is sock:
                data = sock.recv(CHUNK)
                if not data:
                    return
                view = memoryview(data)
                while view:
                    view = view[os.write(stdout, view):]
            else:
                data = os.read(stdin, CHUNK)
                if data:
                    sock.sendall(data)
                else:
                    sel.unregister(stdin)
                    sock.shutdown(socket.SHUT_WR)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python3 -m vfio_cxl.lab.unix_proxy SOCKET", file=sys.stderr)
        return 2
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(argv[0])
    except OSError as err:
        print(f"unix_proxy: cannot connect to {argv[0]}: {err.strerror} (is the lab up? vfio-cxl vm status)",
              file=sys.stderr)
        return 255
    with sock:
        try:
            pump(sock, sys.stdin.fileno(), sys.stdout.fileno())
        except (BrokenPipeError, ConnectionResetError):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
