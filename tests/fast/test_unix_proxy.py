"""vfio_cxl.lab.unix_proxy, the ProxyCommand `vm ssh` gives ssh(1) for a VM's private SSH socket:
run as ssh runs it, against a real UNIX socket server."""

import socket
import subprocess
import sys
import threading


def test_it_joins_stdio_to_the_socket_both_ways_and_half_closes_on_eof(tmp_path):
    path = tmp_path / "ssh.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen(1)
    got = []

    def serve():
        conn, _ = server.accept()
        with conn:
            conn.sendall(b"SSH-2.0-banner\r\n")
            data = b""
            while chunk := conn.recv(65536):     # until the proxy's stdin ended (half-close)
                data += chunk
            got.append(data)
            conn.sendall(b"bye")

    t = threading.Thread(target=serve)
    t.start()
    payload = bytes(range(256)) * 1024
    run = subprocess.run([sys.executable, "-m", "vfio_cxl.lab.unix_proxy", str(path)], input=payload,
                         capture_output=True, timeout=60)
    t.join(10)
    server.close()
    assert run.returncode == 0, run.stderr
    assert run.stdout == b"SSH-2.0-banner\r\nbye" and got == [payload]


def test_a_missing_socket_exits_255_as_ssh_does_and_says_what_to_check(tmp_path):
    run = subprocess.run([sys.executable, "-m", "vfio_cxl.lab.unix_proxy", str(tmp_path / "gone.sock")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 255
    assert f"cannot connect to {tmp_path / 'gone.sock'}" in run.stderr and "vm status" in run.stderr
