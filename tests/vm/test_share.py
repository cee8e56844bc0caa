"""Two hosts, one CXL memory: the seed's flow and the private control link."""

import re

from vfio_cxl.demos.share import seed_flow


def test_gpu_in_a_writes_what_b_reads_with_no_copy(shared_lab):
    result = seed_flow(shared_lab, 1 << 20, 0x400000)
    assert result["a"]["message"] == "DMA FROM GPU TO CXL MEMORY"
    assert result["b"]["head"].startswith("DMA FROM GPU TO CXL MEMORY")
    assert result["a_match"] and result["b_match"] and result["host_match"], result


def test_b_has_no_gpu(shared_lab):
    assert shared_lab["b"].run("lspci -n -d 0601:1991").stdout.strip() == ""
    assert "0601:1991" in shared_lab["a"].run("lspci -n -d 0601:1991").stdout


def test_private_link_between_the_guests_is_link_local_only(shared_lab):
    a, b = shared_lab["a"], shared_lab["b"]
    out = a.run("ip -4 -o addr show").stdout
    link = [line for line in out.splitlines() if "169.254." in line]
    assert link, out
    assert re.search(r"169\.254\.0\.1/16", link[0])
    # Nothing but slirp's SSH address and the link-local address.
    assert set(re.findall(r"inet (\S+)", out)) == {"127.0.0.1/8", "10.0.2.15/24", "169.254.0.1/16"}
    # b reaches a's sshd over the link (a stream socket between the two QEMUs).
    banner = b.run("python3 -c \"import socket; s=socket.create_connection(('169.254.0.1', 22), 5); "
                   "print(s.recv(64).decode())\"").stdout
    assert banner.startswith("SSH-2.0-")
