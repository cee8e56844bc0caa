"""Issue: two VMs whose Type3 devices share one memory backend file.

VM A writes 4 KiB of random bytes through its /dev/dax mmap; VM B reads the
same bytes at the same offset; the host's backend file holds them too."""

import base64
import json
import os


def test_bytes_written_in_a_are_read_in_b_and_in_the_backend_file(shared_lab):
    a, b = shared_lab["a"], shared_lab["b"]
    dax_a = json.loads(a.run("vfio-cxl-m vfio_cxl.guest.cmd.cxltool up").stdout)
    dax_b = json.loads(b.run("vfio-cxl-m vfio_cxl.guest.cmd.cxltool up").stdout)
    assert dax_a["size"] == dax_b["size"] == 256 << 20

    payload = os.urandom(4096)
    offset = 0x2345000
    a.run(f"vfio-cxl-m vfio_cxl.guest.cmd.cxltool write {dax_a['path']} {offset:#x}",
          stdin=base64.b64encode(payload).decode())
    seen_by_b = base64.b64decode(
        b.run(f"vfio-cxl-m vfio_cxl.guest.cmd.cxltool read {dax_b['path']} {offset:#x} 4096").stdout)
    assert seen_by_b == payload

    # The region covers the memdev from DPA 0, so devdax offset == file offset.
    assert shared_lab.read_backend("shared", offset, 4096) == payload


def test_region_up_is_idempotent(shared_lab):
    a = shared_lab["a"]
    first = json.loads(a.run("vfio-cxl-m vfio_cxl.guest.cmd.cxltool up").stdout)
    again = json.loads(a.run("vfio-cxl-m vfio_cxl.guest.cmd.cxltool up").stdout)
    assert first == again
    assert a.run("ls /sys/bus/cxl/devices | grep -c '^region'").stdout.strip() == "1"
