"""Kernel configs: read one (beside the image, or embedded by IKCONFIG) and check it.

Before a VM boots a kernel that is not the image's own, the lab reads that
kernel's config and refuses it, naming every missing option and the lab
feature that needs it, instead of letting the guest fail half-way through a
demo.  Where the config comes from, in order:

1. ``.config`` or ``config`` beside the image (a build tree, the lab kernel's
   cache directory), or ``config-<name>`` for ``vmlinuz-<name>`` (``/boot``);
2. the config the kernel carries itself (``CONFIG_IKCONFIG``): the same search
   as the kernel's ``scripts/extract-ikconfig``: find each compressed stream
   in the bzImage, decompress it, find ``IKCFG_ST``, gunzip what follows.
"""

from __future__ import annotations

import gzip
import lzma
import re
import shutil
import subprocess
import zlib
from dataclasses import dataclass
from pathlib import Path

from ..errors import LabError

IKCFG_START = b"IKCFG_ST"
IKCFG_END = b"IKCFG_ED"


@dataclass(frozen=True)
class Need:
    options: tuple[str, ...]
    feature: str
    builtin: bool = False     # must be =y: used before any module can be loaded
    lab_only: bool = False    # required of the lab kernel, only reported for others


NEEDS: tuple[Need, ...] = (
    # A kernel not the image's boots without the initramfs: it mounts the root disk itself.
    Need(("VIRTIO", "VIRTIO_PCI", "VIRTIO_BLK", "EXT4_FS", "DEVTMPFS"),
         "the root disk (virtio-blk, ext4: the kernel mounts it itself, no initramfs)", builtin=True),
    Need(("SERIAL_8250", "SERIAL_8250_CONSOLE"), "the serial console the lab watches for 'ready'",
         builtin=True),
    Need(("NET_9P", "NET_9P_VIRTIO", "9P_FS"), "the 9p share of the checkout at /opt/vfio-cxl",
         builtin=True),
    Need(("VIRTIO_NET", "UNIX98_PTYS", "TMPFS"), "SSH into the guest (virtio-net, ptys, /run)"),
    Need(("PCI", "PCI_MSI", "PCIEPORTBUS"), "PCIe root ports and MSI/MSI-X"),
    Need(("INTEL_IOMMU", "IRQ_REMAP"), "the vIOMMU (intel-iommu) behind which the GPU sits"),
    Need(("VFIO", "VFIO_PCI", "VFIO_IOMMU_TYPE1", "EVENTFD"), "the guest's VFIO driver stack (GPU DMA, MSI-X)"),
    Need(("CXL_BUS", "CXL_PCI", "CXL_ACPI", "CXL_MEM", "CXL_PORT", "CXL_REGION"),
         "CXL enumeration and region creation (cxl create-region)"),
    Need(("DEV_DAX", "DEV_DAX_CXL"), "CXL regions as /dev/daxN.M (devdax)"),
    # Without FS_DAX, IS_DAX() is always false and device-dax refuses every mmap (EINVAL).
    Need(("FS_DAX",), "mmap of /dev/daxN.M (device-dax checks vma_is_dax())"),
    Need(("HOTPLUG_PCI", "HOTPLUG_PCI_PCIE"), "PCIe hot-plug on the spare root port", lab_only=True),
    Need(("IOMMUFD", "VFIO_DEVICE_CDEV"), "the iommufd VFIO backend (/dev/iommu, /dev/vfio/devices/vfioN)",
         lab_only=True),
    Need(("PCI_P2PDMA",), "peer-to-peer DMA experiments", lab_only=True),
    Need(("CXL_MEM_RAW_COMMANDS",), "raw CXL mailbox commands", lab_only=True),
    Need(("IKCONFIG",), "reading the kernel's own config", lab_only=True),
    # Without it the lab brings regions up after SSH answers, as for a user's kernel (slower).
    Need(("FW_CFG_SYSFS",), "the region plan read at boot from fw_cfg (regions up while SSH starts)",
         lab_only=True),
)
# Options that must be off: they change what the lab sees.
MUST_BE_OFF = {"DEV_DAX_KMEM": "CXL regions must stay devdax (kmem would online them as system RAM)"}


def parse_config(text: str) -> dict[str, str]:
    """``CONFIG_X=v`` lines -> {X: v}; ``# CONFIG_X is not set`` -> {X: "n"}."""
    options: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if m := re.fullmatch(r"CONFIG_(\w+)=(.*)", line):
            options[m.group(1)] = m.group(2).strip('"') if m.group(2).startswith('"') else m.group(2)
        elif m := re.fullmatch(r"# CONFIG_(\w+) is not set", line):
            options[m.group(1)] = "n"
    return options


def _decompressors():
    """(magic, decompress(bytes) -> bytes) for the formats a bzImage may use."""
    def gz(data: bytes) -> bytes:
        return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(data)

    def xz(data: bytes) -> bytes:
        return lzma.LZMADecompressor(lzma.FORMAT_XZ).decompress(data)

    def tool(*cmd):
        def run(data: bytes) -> bytes:
            if shutil.which(cmd[0]) is None:
                return b""
            return subprocess.run(cmd, input=data, capture_output=True).stdout
        return run

    return [
        (b"\x1f\x8b\x08", gz),
        (b"\xfd7zXZ\x00", xz),
        (b"\x28\xb5\x2f\xfd", tool("zstd", "-dcq")),
        (b"\x02\x21\x4c\x18", tool("lz4", "-dcq")),
        (b"BZh", tool("bzip2", "-dcq")),
    ]


def _ikconfig_in(blob: bytes) -> str | None:
    start = blob.find(IKCFG_START)
    if start < 0:
        return None
    end = blob.find(IKCFG_END, start)
    payload = blob[start + len(IKCFG_START):end if end > 0 else None]
    try:
        return gzip.decompress(payload).decode(errors="replace")
    except (OSError, EOFError, zlib.error):
        pass
    try:
        return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(payload).decode(errors="replace")
    except zlib.error:
        # Not the real thing: an LZ4 image stores the (incompressible) config.gz mostly as
        # literals, markers included, with LZ4 tokens in between.  Look inside the streams.
        return None


def extract_ikconfig(image: bytes) -> str | None:
    """The config embedded in a kernel image (vmlinux or bzImage), or None."""
    found = _ikconfig_in(image)
    if found is not None:
        return found
    for magic, decompress in _decompressors():
        pos = image.find(magic)
        tried = 0
        while pos >= 0 and tried < 8:
            try:
                inner = decompress(image[pos:])
            except (lzma.LZMAError, zlib.error, EOFError):
                inner = b""
            if inner and (found := _ikconfig_in(inner)) is not None:
                return found
            tried += 1
            pos = image.find(magic, pos + 1)
    return None


def kconfig_hz(config: dict[str, str]) -> int | None:
    """CONFIG_HZ, the timer tick a jiffy counts (None if the config does not say)."""
    value = config.get("HZ", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def config_beside(image: Path) -> Path | None:
    candidates = [image.parent / ".config", image.parent / "config"]
    if image.name.startswith("vmlinuz-"):
        candidates.insert(0, image.parent / ("config-" + image.name.removeprefix("vmlinuz-")))
    # arch/x86/boot/bzImage in a build tree: the .config is three levels up.
    if image.parent.name == "boot" and image.parent.parent.parent.name == "arch":
        candidates.append(image.parents[3] / ".config")
    return next((c for c in candidates if c.is_file()), None)


def read_kernel_config(image: Path) -> dict[str, str]:
    beside = config_beside(image)
    if beside is not None:
        return parse_config(beside.read_text(errors="replace"))
    text = extract_ikconfig(image.read_bytes())
    if text is None:
        raise LabError(f"cannot find the config of kernel {image}",
                       "put its .config beside it (as .config or config), or build it with "
                       "CONFIG_IKCONFIG=y so the lab can read the config from the image")
    return parse_config(text)


def problems(config: dict[str, str], *, lab_kernel: bool = False, modules: bool = False) -> list[str]:
    """One line per missing option: what is missing and which lab feature needs it."""
    found = []
    for need in NEEDS:
        if need.lab_only and not lab_kernel:
            continue
        for option in need.options:
            value = config.get(option, "n")
            ok = value == "y" or (value == "m" and modules and not need.builtin)
            if not ok:
                why = "" if value == "n" else f" (it is ={value}" + (
                    ": built-in needed, the root disk and shares come before modules)" if need.builtin
                    else ", but no --modules tree was given)")
                found.append(f"CONFIG_{option}=y{why}: needed for {need.feature}")
    for option, why in MUST_BE_OFF.items():
        if config.get(option, "n") == "y":
            found.append(f"CONFIG_{option} must not be =y: {why}")
    return found


def check_config(config: dict[str, str], what: str, *, lab_kernel: bool = False, modules: bool = False) -> None:
    missing = problems(config, lab_kernel=lab_kernel, modules=modules)
    if missing:
        raise LabError(f"kernel {what} lacks what the lab needs:\n  " + "\n  ".join(missing),
                       "enable these options (e.g. scripts/config --enable NAME; make olddefconfig), "
                       "rebuild, or use --kernel lab")
