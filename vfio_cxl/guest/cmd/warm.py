"""A warm Python for the guest's ``vfio-cxl`` command: the package imported once, each command
forked from it.

A guest command's start is mostly imports -- ``vfio-cxl gpu ls`` spends ~0.35 s of its ~0.5 s
under TCG loading argparse, pathlib, json and a dozen of the package's modules -- so the image's
``vfio-cxl`` wrapper runs ``warm_client.py``, which hands its command to this server over
``/run/vfio-cxl/warm.sock`` and waits.  The server has ``vfio_cxl.guest.cmd.cli`` imported;
for each request it forks a *runner*, which takes the client's stdin/stdout/stderr (passed as
file descriptors), its environment, working directory, umask and argv, and calls the module's
``main(argv)`` as ``python3 -m MODULE`` does (a module that has ``warm()`` had it called once in
the server: the CLI builds its parser there).  The server reports the runner's pid, then its
exit status or the signal that killed it (it waits on each runner's pidfd), and terminates a
runner whose client has gone away.  The client forwards SIGINT, SIGTERM, SIGHUP and SIGQUIT to
the runner.

Never stale: the server notes the mtime and size of every package file it imported, and
before each fork checks them again; after an edit (the host's checkout is shared live) it
answers "stale", removes its socket, and exits once the commands it runs have ended; the client
runs the command the usual way and starts a fresh server.  ``VFIO_CXL_WARM=0`` bypasses it altogether.

    python3 -m vfio_cxl.guest.cmd.warm SOCKET     (the client starts it; it runs until stale)
"""

from __future__ import annotations

import array
import errno
import importlib
import os
import select
import signal
import socket
import struct
import sys
import time

PRELOAD = ("vfio_cxl.guest.cmd.cli",)
# Any other guest command it runs too (the image's vfio-cxl-m: ``python3 -m MODULE``, forked):
# imported by the runner, after the fork, so an edit of it is always seen.
COMMANDS = "vfio_cxl.guest.cmd."
NOT_RUN = ("vfio_cxl.guest.cmd.warm", "vfio_cxl.guest.cmd.warm_client")
REQUEST_MAX = 1 << 20          # bytes of one request (its arguments and environment)
HEADER = struct.Struct("!I")
CLIENT_GONE_GRACE = 5.0        # s between SIGTERM and SIGKILL to a runner whose client has gone


class BadRequest(Exception):
    pass


def package_files() -> dict[str, tuple[int, int]]:
    """(mtime_ns, size) of every source file of the package this process has imported."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    found = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path and path.startswith(root + os.sep):
            st = os.stat(path)
            found[path] = (st.st_mtime_ns, st.st_size)
    return found


def changed(snapshot: dict[str, tuple[int, int]]) -> str | None:
    """The first imported file that is not as it was, or None."""
    for path, stamp in snapshot.items():
        try:
            st = os.stat(path)
        except OSError:
            return path
        if (st.st_mtime_ns, st.st_size) != stamp:
            return path
    return None


def receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """One request and the client's three stdio descriptors.  The request: a 4-byte length,
    then NUL-separated fields (no argument or variable can hold a NUL): ``v1``, the module, the
    working directory, the umask in octal, the argument count, the arguments, ``NAME=VALUE``
    for each environment variable.  The client imports no json for it (``re`` costs its start)."""
    fds = array.array("i")
    data, ancillary, _, _ = conn.recvmsg(HEADER.size, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    try:
        if len(data) != HEADER.size or len(fds) != 3:
            raise BadRequest(f"expected a {HEADER.size}-byte length and 3 descriptors, got {len(data)} bytes "
                             f"and {len(fds)} descriptors")
        (length,) = HEADER.unpack(data)
        if length > REQUEST_MAX:
            raise BadRequest(f"request of {length} bytes (at most {REQUEST_MAX})")
        body = b""
        while len(body) < length:
            chunk = conn.recv(length - len(body))
            if not chunk:
                raise BadRequest("the client closed mid-request")
            body += chunk
        return parse(body), list(fds)
    except BadRequest:
        for fd in fds:
            os.close(fd)
        raise


def parse(body: bytes) -> dict:
    fields = [os.fsdecode(f) for f in body.split(b"\0")]
    if len(fields) < 5 or fields[0] != "v1":
        raise BadRequest("not a v1 request (v1, module, cwd, umask, argc, argv..., NAME=VALUE...)")
    _, module, cwd, umask, argc, *rest = fields
    if not runnable(module):
        raise BadRequest(f"module {module!r} is not one this server runs (the guest commands, "
                         f"{COMMANDS}NAME)")
    try:
        umask_value, count = int(umask, 8), int(argc)
    except ValueError:
        raise BadRequest(f"umask {umask!r} or argument count {argc!r} is not a number") from None
    if not 0 <= count <= len(rest) or not all("=" in item for item in rest[count:]):
        raise BadRequest("the argument count or an environment entry (NAME=VALUE) is wrong")
    env = dict(item.split("=", 1) for item in rest[count:])
    return {"module": module, "cwd": cwd, "umask": umask_value, "argv": rest[:count], "env": env}


def runnable(module: str) -> bool:
    """A guest command this server runs: vfio_cxl.guest.cmd.NAME (NAME an identifier; not the
    server and its client)."""
    name = module[len(COMMANDS):]
    return module.startswith(COMMANDS) and name.isidentifier() and module not in NOT_RUN


def reply(conn: socket.socket, what: str, value) -> None:
    """One line to the client: ``pid N``, ``exit N``, ``signal N``, ``stale PATH`` or ``error TEXT``."""
    conn.sendall(f"{what} {value}".replace("\n", " ").encode(errors="replace") + b"\n")


def run(request: dict, fds: list[int]) -> None:
    """The runner: become the client's command, as ``python3 -m MODULE ARGV`` would run it, and
    end as it ends (never returns: an interrupt during the set-up ends it the same way)."""
    import traceback

    code = 1
    try:
        code = _become(request, fds)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:   # noqa: BLE001 -- as the interpreter does: the traceback, exit 1
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        if code < 0:   # died of SIGINT, as python3 does after a KeyboardInterrupt
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code)


def _become(request: dict, fds: list[int]) -> int:
    import io

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    # new stdio objects: line-buffered on a terminal, as at a normal start
    sys.stdin = sys.__stdin__ = io.open(0, "r", closefd=False)
    sys.stdout = sys.__stdout__ = io.open(1, "w", closefd=False)
    sys.stderr = sys.__stderr__ = io.open(2, "w", closefd=False, buffering=1)
    try:
        os.chdir(request["cwd"])
    except OSError as err:
        print(f"vfio-cxl: cannot work in {request['cwd']}: {err.strerror}", file=sys.stderr)
        return 1
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    module = importlib.import_module(request["module"])   # preloaded, or imported here, in the fork
    sys.argv = [module.__file__, *request["argv"]]
    try:
        code = module.main(request["argv"])      # what `python3 -m MODULE` runs: sys.exit(main())
    except SystemExit as exit_:
        code = exit_.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xff
    print(code, file=sys.stderr)
    return 1


class Command:
    """A runner the server forked: its client's connection, its pidfd, and when it gets SIGKILL
    (a client that went away: SIGTERM first, SIGKILL after CLIENT_GONE_GRACE)."""

    def __init__(self, conn: socket.socket, pid: int):
        self.conn, self.pid = conn, pid
        self.pidfd = os.pidfd_open(pid)
        self.kill_at: float | None = None

    def client_gone(self) -> None:
        os.kill(self.pid, signal.SIGTERM)
        self.kill_at = time.monotonic() + CLIENT_GONE_GRACE

    def finish(self) -> None:
        """Reap it; tell the client how it ended (if the client is still there)."""
        _, status = os.waitpid(self.pid, 0)
        try:
            if os.WIFSIGNALED(status):
                reply(self.conn, "signal", os.WTERMSIG(status))
            else:
                reply(self.conn, "exit", os.WEXITSTATUS(status))
        except OSError:
            pass   # the client has gone
        self.conn.close()
        os.close(self.pidfd)


def _still_there(conn: socket.socket) -> bool:
    """False when the client has closed its end (EOF, or a reset: it closed with our reply unread)."""
    try:
        return conn.recv(64) != b""
    except OSError:
        return False


def listen(path: str) -> socket.socket:
    """The server's socket at ``path`` (its directory 0700); a socket file nobody listens on
    (a server that died) is replaced.  OSError(EADDRINUSE) when another server has it."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError as err:
        if err.errno != errno.EADDRINUSE:
            raise
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
            raise                                   # a live server has it
        except ConnectionRefusedError:
            os.unlink(path)
            sock.bind(path)
        finally:
            probe.close()
    sock.listen(16)
    return sock


def serve(path: str) -> int:
    for name in PRELOAD:   # each has main(argv) -> exit status, and may have warm()
        module = importlib.import_module(name)
        getattr(module, "warm", lambda: None)()
    snapshot = package_files()
    # What is imported stays as it is: the collector never walks it again, in the server or in a
    # fork (a walk writes to every object's header: a page copied per page of them, after a fork)
    import gc

    gc.collect()
    gc.freeze()
    try:
        sock = listen(path)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            return 0        # another client's server won the race: it serves
        raise
    commands: list[Command] = []
    while sock is not None or commands:   # stale: no new commands, the running ones end first
        waits = [c.kill_at for c in commands if c.kill_at is not None]
        timeout = max(0.0, min(waits) - time.monotonic()) if waits else None
        watch = [*([sock] if sock else []), *(c.pidfd for c in commands),
                 *(c.conn for c in commands if c.kill_at is None)]
        ready, _, _ = select.select(watch, [], [], timeout)
        for command in list(commands):
            if command.pidfd in ready:
                command.finish()
                commands.remove(command)
            elif command.conn in ready and not _still_there(command.conn):
                command.client_gone()            # the client is gone: its command goes too
            elif command.kill_at is not None and time.monotonic() >= command.kill_at:
                os.kill(command.pid, signal.SIGKILL)
                command.kill_at = None
        if sock is None or sock not in ready:
            continue
        conn, _ = sock.accept()
        try:
            request, fds = receive(conn)
        except (BadRequest, OSError) as err:
            try:
                reply(conn, "error", err)
            except OSError:
                pass
            conn.close()
            continue
        stale = changed(snapshot)
        if stale:
            for fd in fds:
                os.close(fd)
            reply(conn, "stale", stale)
            conn.close()
            os.unlink(path)
            sock.close()
            sock = None
            continue
        pid = os.fork()
        if pid == 0:       # the runner holds nothing of the server's: no socket, no other command
            sock.close()
            conn.close()
            for command in commands:
                command.conn.close()
                os.close(command.pidfd)
            run(request, fds)
        for fd in fds:
            os.close(fd)
        command = Command(conn, pid)
        commands.append(command)
        try:
            reply(conn, "pid", pid)
        except OSError:
            command.client_gone()                # it went while its command was being forked
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    return serve(argv[0])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
