"""The guest's ``vfio-cxl`` command as the image's wrapper runs it: ``python3 -S warm_client.py
MODULE ARGS...`` hands the command to the warm server (vfio_cxl.guest.cmd.warm) and exits as the
command does; without a server (the first command of a boot, ``VFIO_CXL_WARM=0``, a server
that found its files edited) it runs ``python3 -m MODULE ARGS...`` itself, and starts a server
for the next command.  Run as a script, not imported: it loads nothing of the package."""

import array
import json
import os
import signal
import socket
import struct
import sys

SOCKET = os.environ.get("VFIO_CXL_WARM_SOCKET", "/run/vfio-cxl/warm.sock")
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def run_here(module: str, args: list[str]) -> None:
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


def main() -> None:
    module, args = sys.argv[1], sys.argv[2:]
    if os.environ.get("VFIO_CXL_WARM") == "0":
        run_here(module, args)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(SOCKET)
        mask = os.umask(0o022)
        os.umask(mask)
        body = json.dumps({"module": module, "argv": args, "env": dict(os.environ), "cwd": os.getcwd(),
                           "umask": mask}).encode()
        conn.sendmsg([struct.pack("!I", len(body))],
                     [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
        conn.sendall(body)
        replies = conn.makefile("r")
        first = json.loads(replies.readline() or "{}")
    except (OSError, ValueError):
        first = {}
    if "pid" not in first:                 # no server, a stale one, or one that refused
        conn.close()
        start_server()
        run_here(module, args)
    pid = first["pid"]

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass   # it has just ended: its status follows

    for signum in FORWARDED:
        signal.signal(signum, forward)
    try:
        last = json.loads(replies.readline() or "{}")
    except ValueError:
        last = {}
    if "signal" in last:                   # as a shell sees a command killed by a signal
        signal.signal(last["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), last["signal"])
    if "exit" not in last:
        sys.stderr.write("vfio-cxl: the warm server lost the command's status\n")
        os._exit(255)
    os._exit(last["exit"])


if __name__ == "__main__":
    main()
