"""The guest's ``vfio-cxl`` command as the image's wrapper runs it: ``python3 -S warm_client.py
MODULE ARGS...`` hands the command to the warm server (vfio_cxl.guest.cmd.warm) and exits as the
command does; without a server (the first command of a boot, ``VFIO_CXL_WARM=0``, a server
that found its files edited) it runs ``python3 -m MODULE ARGS...`` itself, and starts a server
for the next command.  Run as a script, not imported: it loads nothing of the package, and of
the standard library only C modules (``socket``, ``signal`` and ``json`` would load ``enum`` and
``re``: most of what it saves, under TCG)."""

import _signal
import _socket
import array
import os
import sys

SOCKET = os.environ.get("VFIO_CXL_WARM_SOCKET", "/run/vfio-cxl/warm.sock")
FORWARDED = (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP, _signal.SIGQUIT)


def run_here(module: str, args: list) -> None:
    os.execvp("python3", ["python3", "-m", module, *args])


def start_server() -> None:
    """The server, detached (its own session, stdio on /dev/null, a log in /run/vfio-cxl)."""
    pid = os.fork()
    if pid:
        os.waitpid(pid, 0)
        return
    try:
        os.setsid()
        if os.fork() == 0:
            os.makedirs(os.path.dirname(SOCKET), mode=0o700, exist_ok=True)
            null = os.open(os.devnull, os.O_RDWR)
            log = os.open(os.path.join(os.path.dirname(SOCKET), "warm.log"),
                          os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.dup2(null, 0)
            os.dup2(null, 1)
            os.dup2(log, 2)
            os.execvp("python3", ["python3", "-m", "vfio_cxl.guest.cmd.warm", SOCKET])
    finally:
        os._exit(0)


def request(module: str, args: list) -> bytes:
    """What warm.parse reads: NUL-separated fields after a 4-byte length."""
    mask = os.umask(0o022)
    os.umask(mask)
    fields = [b"v1", module.encode(), os.fsencode(os.getcwd()), b"%o" % mask, b"%d" % len(args),
              *map(os.fsencode, args), *(k + b"=" + v for k, v in os.environb.items())]
    body = b"\0".join(fields)
    return len(body).to_bytes(4, "big") + body


def lines(conn):
    """The server's reply lines, as (word, rest)."""
    pending = b""
    while True:
        while b"\n" not in pending:
            chunk = conn.recv(4096)
            if not chunk:
                return
            pending += chunk
        line, pending = pending.split(b"\n", 1)
        word, _, rest = line.decode(errors="replace").partition(" ")
        yield word, rest


def main() -> None:
    module, args = sys.argv[1], sys.argv[2:]
    if os.environ.get("VFIO_CXL_WARM") == "0":
        run_here(module, args)
    conn = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        conn.connect(SOCKET)
        data = request(module, args)
        conn.sendmsg([data[:4]], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
        conn.sendall(data[4:])
        replies = lines(conn)
        word, pid = next(replies, ("", ""))
    except OSError:
        word = ""
    if word != "pid":                      # no server, a stale one, or one that refused
        conn.close()
        start_server()
        run_here(module, args)
    pid = int(pid)

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass   # it has just ended: its status follows

    for signum in FORWARDED:
        _signal.signal(signum, forward)
    word, value = next(replies, ("", ""))
    if word == "signal":                   # as a shell sees a command killed by a signal
        _signal.signal(int(value), _signal.SIG_DFL)
        os.kill(os.getpid(), int(value))
    if word != "exit":
        sys.stderr.write("vfio-cxl: the warm server lost the command's status\n")
        os._exit(255)
    os._exit(int(value))


if __name__ == "__main__":
    main()
