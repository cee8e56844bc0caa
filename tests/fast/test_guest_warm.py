"""The guest's warm server and its client (vfio_cxl.guest.cmd.warm, warm_client.py), as the
image's ``vfio-cxl`` wrapper runs them: real processes on this host, over a copy of the package
(the guest reads it from a share the host may edit at any time).  The guest CLI's ``gpu ls``
finds no GPU here and says so; ``gpu bind --wait`` waits for one (a command to interrupt)."""

from __future__ import annotations

import array
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

import vfio_cxl

MODULE = "vfio_cxl.guest.cmd.cli"


@pytest.fixture
def guest(tmp_path):
    """A copy of the package, an environment like the guest's SSH session, and the socket's path;
    the server the first command starts is killed at the end."""
    root = tmp_path / "src"
    shutil.copytree(Path(vfio_cxl.__file__).parent, root / "vfio_cxl",
                    ignore=shutil.ignore_patterns("__pycache__", "_native"))
    sock = tmp_path / "run" / "warm.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VFIO_CXL"))}
    env.update(PYTHONPATH=str(root), VFIO_CXL_WARM_SOCKET=str(sock), PATH=f"{Path(sys.executable).parent}:"
               f"{env['PATH']}")
    yield {"root": root, "sock": sock, "env": env, "cwd": tmp_path}
    for pid in server_pids(sock):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass   # a waiter that has just ended


def server_pids(sock: Path) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(sock).encode() in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:
            pass
    return found


def fd_target(pid: int, fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return None   # it has ended


def client(guest, *args: str, module: str = MODULE, **kwargs) -> subprocess.CompletedProcess:
    script = guest["root"] / "vfio_cxl/guest/cmd/warm_client.py"
    return subprocess.run([sys.executable, "-S", str(script), module, *args], env=guest["env"], cwd=guest["cwd"],
                          capture_output=True, text=True, timeout=60, **kwargs)


def wait_for(what: str, check, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout:.0f} s")
        time.sleep(0.05)   # polling for a process's socket; not synchronisation


def test_the_first_command_runs_itself_and_starts_the_server_the_next_one_is_forked(guest):
    first = client(guest, "gpu", "ls")
    assert (first.returncode, first.stdout) == (0, "no GPU in this VM\n"), first.stderr
    wait_for("server socket", guest["sock"].exists)
    second = client(guest, "gpu", "ls", "--json")
    assert (second.returncode, json.loads(second.stdout)) == (0, {"gpus": []}), second.stderr
    assert len(server_pids(guest["sock"])) == 1


def test_any_guest_command_runs_forked_as_vfio_cxl_m_runs_it(guest):
    """The image's vfio-cxl-m: ``python3 -m vfio_cxl.guest.cmd.NAME ARGS``, forked from the server
    (the module imported in the fork: an edit of it is seen by the next command)."""
    client(guest, "gpu", "ls")
    wait_for("server socket", guest["sock"].exists)
    pids = server_pids(guest["sock"])
    bad = client(guest, "frobnicate", module="vfio_cxl.guest.cmd.cxltool")
    assert bad.returncode == 2 and "unknown command 'frobnicate'" in bad.stderr, bad.stderr
    tool = guest["root"] / "vfio_cxl/guest/cmd/cxltool.py"
    tool.write_text(tool.read_text().replace("unknown command", "no such command"))
    again = client(guest, "frobnicate", module="vfio_cxl.guest.cmd.cxltool")
    assert again.returncode == 2 and "no such command 'frobnicate'" in again.stderr, again.stderr
    assert server_pids(guest["sock"]) == pids   # the same server forked both


def test_exit_status_and_stderr_are_the_commands(guest):
    client(guest, "gpu", "ls")
    wait_for("server socket", guest["sock"].exists)
    bad = client(guest, "gpu", "dma", "--size", "lots")
    assert bad.returncode == 2 and "'lots' is not a size" in bad.stderr and bad.stdout == ""


def test_the_runner_takes_the_clients_stdio_cwd_environment_umask_and_argv(tmp_path):
    """warm.run, the runner's half, on a module of the test's own: what it sees and how it exits."""
    (tmp_path / "probe.py").write_text(
        "import os, sys\n"
        "def main(argv):\n"
        "    print(os.getcwd(), os.environ['PROBE'], oct(os.umask(0)), argv, sys.stdin.read().strip())\n"
        "    print('to stderr', file=sys.stderr)\n"
        "    sys.exit(7)\n")
    (tmp_path / "sub").mkdir()
    code = ("import os, sys, probe; from vfio_cxl.guest.cmd import warm; "
            "fds = [os.open(p, f) for p, f in ((sys.argv[1], os.O_RDONLY), (sys.argv[2], os.O_WRONLY | os.O_CREAT), "
            "(sys.argv[3], os.O_WRONLY | os.O_CREAT))]; "
            "warm.run({'module': 'probe', 'argv': ['a', 'b c'], 'env': {'PROBE': 'yes', 'PYTHONPATH': sys.argv[4]}, "
            "'cwd': sys.argv[5], 'umask': 0o027}, fds)")
    (tmp_path / "in").write_text("from stdin\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "in"), str(tmp_path / "out"),
                           str(tmp_path / "err"), str(tmp_path), str(tmp_path / "sub")],
                          env={**os.environ, "PYTHONPATH": f"{tmp_path}:{Path(vfio_cxl.__file__).parent.parent}"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 7, done.stderr
    assert (tmp_path / "out").read_text() == f"{tmp_path / 'sub'} yes 0o27 ['a', 'b c'] from stdin\n"
    assert (tmp_path / "err").read_text() == "to stderr\n"


def test_a_command_killed_by_ctrl_c_dies_of_sigint_and_leaves_no_runner(guest):
    client(guest, "gpu", "ls")
    wait_for("server socket", guest["sock"].exists)
    script = guest["root"] / "vfio_cxl/guest/cmd/warm_client.py"
    proc = subprocess.Popen([sys.executable, "-S", str(script), MODULE, "gpu", "bind", "--wait", "60"],
                            env=guest["env"], cwd=guest["cwd"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    # the runner (a fork of the server: the same command line) with the client's stderr as its
    # own: from there on an interrupt's traceback shows on the client's stderr
    stderr = os.readlink(f"/proc/{proc.pid}/fd/2")
    wait_for("the command's runner", lambda: any(fd_target(pid, 2) == stderr for pid in server_pids(guest["sock"])))
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGINT, err
    assert "KeyboardInterrupt" in err
    wait_for("the runner to end", lambda: len(server_pids(guest["sock"])) == 1)


def test_an_edited_file_makes_the_server_step_down_and_the_command_still_runs_as_edited(guest):
    client(guest, "gpu", "ls")
    wait_for("server socket", guest["sock"].exists)
    (old,) = server_pids(guest["sock"])
    cli = guest["root"] / "vfio_cxl/guest/cmd/cli.py"
    cli.write_text(cli.read_text().replace('print("no GPU in this VM")', 'print("no GPU in this VM (edited)")'))
    edited = client(guest, "gpu", "ls")
    assert edited.stdout == "no GPU in this VM (edited)\n", edited.stderr
    wait_for("the stale server to exit", lambda: not Path(f"/proc/{old}").exists())
    wait_for("a fresh server", lambda: guest["sock"].exists() and server_pids(guest["sock"]))
    again = client(guest, "gpu", "ls")
    assert again.stdout == "no GPU in this VM (edited)\n"


def test_a_bad_request_is_refused_and_the_server_serves_on(guest):
    client(guest, "gpu", "ls")
    wait_for("server socket", guest["sock"].exists)
    for payload in (struct.pack("!I", 1 << 30), struct.pack("!I", 5) + b"[1,2]", b"xy"):   # no descriptors
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(guest["sock"]))
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            assert s.makefile().readline().startswith("error expected a 4-byte length and 3 descriptors")
    null = os.open(os.devnull, os.O_RDWR)
    try:
        cli = "vfio_cxl.guest.cmd.cli"
        for fields, why in ((["v2", "x"], "not a v1 request"), (["v1", "os", "/", "022", "0"], "module 'os' is not one"),
                            (["v1", "vfio_cxl.guest.cmd.warm", "/", "022", "0"], "is not one this server runs"),
                            (["v1", "vfio_cxl.guest.cmd.x.y", "/", "022", "0"], "is not one this server runs"),
                            (["v1", cli, "/", "x", "0"], "umask 'x'"), (["v1", cli, "/", "022", "9", "a"], "the argument count"),
                            (["v1", cli, "/", "022", "0", "NOEQUALS"], "NAME=VALUE"), (None, "request of 2097152 bytes")):
            body = None if fields is None else "\0".join(fields).encode()
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(str(guest["sock"]))
                head = struct.pack("!I", 1 << 21 if body is None else len(body))
                s.sendmsg([head], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [null] * 3))])
                try:
                    s.sendall(body or b"")
                    s.shutdown(socket.SHUT_WR)
                except (BrokenPipeError, ConnectionResetError):
                    pass   # refused on its head alone, the request may be closed before the rest is sent
                line = s.makefile().readline()
                assert line.startswith("error") and why in line, (line, why)
    finally:
        os.close(null)
    assert client(guest, "gpu", "ls").stdout == "no GPU in this VM\n"


def test_with_warm_off_nothing_is_started(guest):
    guest["env"]["VFIO_CXL_WARM"] = "0"
    assert client(guest, "gpu", "ls").stdout == "no GPU in this VM\n"
    assert not guest["sock"].exists() and not server_pids(guest["sock"])


def start_waiting(guest) -> tuple[subprocess.Popen, int]:
    """`gpu bind --wait 60` through the client (it waits for a GPU that never comes), once its
    runner has the client's stderr; the client and the runner's pid."""
    script = guest["root"] / "vfio_cxl/guest/cmd/warm_client.py"
    proc = subprocess.Popen([sys.executable, "-S", str(script), MODULE, "gpu", "bind", "--wait", "60"],
                            env=guest["env"], cwd=guest["cwd"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    stderr = os.readlink(f"/proc/{proc.pid}/fd/2")
    found: list[int] = []
    wait_for("the command's runner", lambda: found.extend(
        p for p in server_pids(guest["sock"]) if fd_target(p, 2) == stderr) or found)
    return proc, found[0]


def test_a_command_whose_client_is_killed_is_terminated(guest):
    client(guest, "gpu", "ls")
    wait_for("server socket", guest["sock"].exists)
    proc, runner = start_waiting(guest)
    proc.kill()                                   # SIGKILL: the client cannot forward anything
    proc.communicate(timeout=30)
    wait_for("the runner to end", lambda: not Path(f"/proc/{runner}").exists() or
             Path(f"/proc/{runner}/stat").read_text().split()[2] == "Z")
    assert client(guest, "gpu", "ls").stdout == "no GPU in this VM\n"   # and the server serves on


def test_a_stale_server_lets_its_running_command_finish(guest):
    client(guest, "gpu", "ls")
    wait_for("server socket", guest["sock"].exists)
    proc, runner = start_waiting(guest)
    cli = guest["root"] / "vfio_cxl/guest/cmd/cli.py"
    cli.write_text(cli.read_text() + "\n# edited\n")
    assert client(guest, "gpu", "ls").stdout == "no GPU in this VM\n"   # the stale server stepped down
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGINT and "KeyboardInterrupt" in err   # its status still came


def test_a_client_that_leaves_before_reading_its_reply_does_not_take_the_server_down(guest):
    """It closes with the server's `pid N` unread: the server sees a reset, not EOF, terminates the
    command, and serves on."""
    from vfio_cxl.guest.cmd import warm_client

    client(guest, "gpu", "ls")
    wait_for("server socket", guest["sock"].exists)
    data = warm_client.request(MODULE, ["gpu", "bind", "--wait", "60"])
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for _ in range(3):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(str(guest["sock"]))
                s.sendmsg([data[:4]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [null] * 3))])
                s.sendall(data[4:])
                wait_for("the runner", lambda: len(server_pids(guest["sock"])) >= 2)
            wait_for("the runner to be terminated", lambda: len(server_pids(guest["sock"])) == 1)
    finally:
        os.close(null)
    assert client(guest, "gpu", "ls").stdout == "no GPU in this VM\n"
