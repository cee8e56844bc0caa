"""Guest network set-up with pyroute2 (run by the lab over SSH once a VM is up).

The lab gives each VM NICs with MAC addresses that say what they are for
(see ``vfio_cxl.lab.argv``):

* ``52:54:00:5c:00:xx`` -- the SSH NIC on QEMU user networking (restrict=on):
  slirp's fixed address 10.0.2.15/24 (the init sets it at boot with ip(8),
  since importing pyroute2 costs seconds under TCG; here it is only checked);
  the host reaches it only through a port forwarded on 127.0.0.1;
* ``52:54:00:5d:00:xx`` -- the lab's own SSH NIC, another user network that the
  host reaches only through a UNIX socket in the VM's run directory: 10.0.3.15/24
  (set by the init too), so the lab's connections come from 10.0.3.2;
* ``52:54:00:1c:LL:VV`` -- private point-to-point link number LL to another VM
  (VV: this VM's index in its topology): link-local addresses only (IPv4
  169.254.LL.VV/24, derived from the MAC, plus the kernel's IPv6 fe80:: address).
"""

from __future__ import annotations

import sys

from pyroute2 import IPRoute

SSH_NIC_PREFIX = "52:54:00:5c:00:"
LINK_NIC_PREFIX = "52:54:00:1c:"
SLIRP_GUEST_ADDRESS = "10.0.2.15"
CTL_NIC_PREFIX = "52:54:00:5d:00:"
CTL_GUEST_ADDRESS = "10.0.3.15"


def link_local_address(mac: str) -> str:
    """The IPv4 link-local address of a link NIC: 169.254.<link>.<VM index> (its last two MAC bytes)."""
    link, vm = mac.split(":")[-2:]
    return f"169.254.{int(link, 16)}.{int(vm, 16)}"


def configure(ipr: IPRoute) -> list[tuple[str, str]]:
    """Bring up lo and every lab NIC; returns (interface, address) pairs set."""
    configured = []
    for link in ipr.get_links():
        name = link.get_attr("IFLA_IFNAME")
        mac = (link.get_attr("IFLA_ADDRESS") or "").lower()
        index = link["index"]
        if name == "lo":
            ipr.link("set", index=index, state="up")
            continue
        if mac.startswith(SSH_NIC_PREFIX):
            address, prefix = SLIRP_GUEST_ADDRESS, 24
        elif mac.startswith(CTL_NIC_PREFIX):
            address, prefix = CTL_GUEST_ADDRESS, 24
        elif mac.startswith(LINK_NIC_PREFIX):
            address, prefix = link_local_address(mac), 24
        else:
            continue
        ipr.link("set", index=index, state="up")
        existing = {a.get_attr("IFA_ADDRESS") for a in ipr.get_addr(index=index, family=2)}
        if address not in existing:
            ipr.addr("add", index=index, address=address, prefixlen=prefix)
        configured.append((name, f"{address}/{prefix}"))
    return configured


def main(argv: list[str]) -> int:
    if argv[:1] != ["up"]:
        print("usage: python3 -m vfio_cxl.guest.cmd.netconfig up", file=sys.stderr)
        return 2
    with IPRoute() as ipr:
        for name, address in configure(ipr):
            print(f"netconfig: {name} {address}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
