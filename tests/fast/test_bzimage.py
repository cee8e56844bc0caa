"""vfio_cxl.lab.bzimage and the image's unpacked kernel: synthetic bzImages in every format the
lab unpacks, each way one can be wrong, and the provisioned image's own Debian kernel."""

from __future__ import annotations

import gzip
import lzma
import shutil
import struct
import subprocess

import pytest

from vfio_cxl.errors import LabError
from vfio_cxl.lab import bzimage
from vfio_cxl.lab.image import GuestImage, image_path, unpack_kernel

needs_zstd = pytest.mark.skipif(shutil.which("zstd") is None, reason="no zstd on this host")


def fake_elf(body: int = 3000) -> bytes:
    """A 64-bit little-endian ELF header, one program header, ``body`` bytes of its segment."""
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<QQ", header, 0x20, 64, 0)             # e_phoff, e_shoff (no sections)
    struct.pack_into("<HHHH", header, 0x36, 56, 1, 64, 0)    # e_phentsize, e_phnum, e_shentsize, e_shnum
    phdr = struct.pack("<IIQQQQQQ", 1, 5, 120, 0, 0, body, body, 0)   # PT_LOAD at offset 120
    return bytes(header) + phdr + bytes(range(256)) * (body // 256) + bytes(body % 256)


RELOCS = b"\xee" * 40   # what the build appends after the ELF, inside the compressed stream


def compress(kind: str, data: bytes) -> bytes:
    if kind == "gzip":
        return gzip.compress(data)
    if kind == "xz":
        return lzma.compress(data, lzma.FORMAT_XZ, check=lzma.CHECK_CRC32)
    if kind == "zstd":
        return subprocess.run(["zstd", "-c", "-q"], input=data, capture_output=True, check=True).stdout
    raise AssertionError(kind)


def fake_bzimage(stream: bytes, size: int, *, setup_sects: int = 3, version: int = 0x20F,
                 magic: bytes = b"HdrS", offset: int = 0x1D0) -> bytes:
    """Setup sectors, the boot header naming the payload, a stub, the payload + its size."""
    payload = stream + struct.pack("<I", size)
    setup = bytearray((setup_sects + 1) * 512)
    setup[0x1F1] = setup_sects
    setup[0x202:0x206] = magic
    struct.pack_into("<H", setup, 0x206, version)
    struct.pack_into("<II", setup, 0x248, offset, len(payload))
    return bytes(setup) + b"\x90" * offset + payload + b"\xcc" * 64


@pytest.mark.parametrize("kind", ["gzip", "xz", pytest.param("zstd", marks=needs_zstd)])
def test_each_format_unpacks_to_the_elf_without_what_follows_it(tmp_path, kind):
    elf = fake_elf()
    image = tmp_path / "bzImage"
    image.write_bytes(fake_bzimage(compress(kind, elf + RELOCS), len(elf) + len(RELOCS)))
    assert bzimage.compression(image) == kind
    bzimage.unpack(image, tmp_path / "vmlinux")
    assert (tmp_path / "vmlinux").read_bytes() == elf
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bzImage", "vmlinux"]


@pytest.mark.parametrize("build, message", [
    (lambda s, n: fake_bzimage(s, n, magic=b"MZ\0\0"), "no 'HdrS' boot header"),
    (lambda s, n: fake_bzimage(s, n, version=0x207), "boot protocol 2.7 names no payload"),
    (lambda s, n: fake_bzimage(s, n)[:-200], "lies outside the file"),
    (lambda s, n: fake_bzimage(s, n + 1), "the build recorded"),
    (lambda s, n: fake_bzimage(b"\x02\x21\x4c\x18" + s, n), "lz4-compressed, which the lab cannot unpack"),
    (lambda s, n: fake_bzimage(b"\x00" * 8 + s, n), "no compression a kernel uses"),
    (lambda s, n: fake_bzimage(gzip.compress(b"not an elf" * 10), 100), "not a 64-bit little-endian ELF"),
    (lambda s, n: fake_bzimage(s[:10] + bytes(b ^ 0x55 for b in s[10:60]) + s[60:], n), "gzip payload is damaged"),
    (lambda s, n: fake_bzimage(gzip.compress(b"\x7fELF\x02\x01" + b"\xff" * 100), 106), "program headers"),
    (lambda s, n: fake_bzimage(s, bzimage.MAX_KERNEL + 1), "over"),
])
def test_a_bad_bzimage_is_named_and_nothing_is_written(tmp_path, build, message):
    elf = fake_elf()
    image = tmp_path / "bzImage"
    image.write_bytes(build(gzip.compress(elf + RELOCS), len(elf) + len(RELOCS)))
    with pytest.raises(LabError) as raised:
        bzimage.unpack(image, tmp_path / "vmlinux")
    assert message in str(raised.value) and str(image) in str(raised.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bzImage"]   # no vmlinux, no scratch file


def test_an_elf_that_claims_more_than_the_payload_holds_is_refused(tmp_path):
    elf = bytearray(fake_elf())
    struct.pack_into("<Q", elf, 64 + 32, 10**6)   # the segment's p_filesz
    image = tmp_path / "bzImage"
    image.write_bytes(fake_bzimage(gzip.compress(bytes(elf)), len(elf)))
    with pytest.raises(LabError, match="claims 1000120 bytes"):
        bzimage.unpack(image, tmp_path / "vmlinux")


def image_dir(tmp_path, vmlinuz: bytes, pvh: bool = True):
    (tmp_path / "vmlinuz").write_bytes(vmlinuz)
    (tmp_path / "config").write_text("CONFIG_HZ=250\n" + ("CONFIG_PVH=y\n" if pvh else "# CONFIG_PVH is not set\n"))
    return GuestImage(tmp_path)


def test_the_image_boots_its_unpacked_kernel_once_it_is_there(tmp_path):
    elf = fake_elf()
    image = image_dir(tmp_path, fake_bzimage(gzip.compress(elf + RELOCS), len(elf) + len(RELOCS)))
    assert image.kernel == tmp_path / "vmlinuz"
    unpack_kernel(image, log=pytest.fail)
    assert image.kernel == tmp_path / "vmlinux" and image.kernel.read_bytes() == elf
    unpack_kernel(image, log=pytest.fail)   # once: nothing to do the second time


def test_a_kernel_without_pvh_stays_compressed(tmp_path):
    elf = fake_elf()
    image = image_dir(tmp_path, fake_bzimage(gzip.compress(elf), len(elf)), pvh=False)
    unpack_kernel(image, log=pytest.fail)
    assert image.kernel == tmp_path / "vmlinuz" and not (tmp_path / "vmlinux").exists()


def test_a_kernel_that_cannot_be_unpacked_boots_compressed_with_one_line_saying_why(tmp_path):
    image = image_dir(tmp_path, b"\0" * 4096)
    lines = []
    unpack_kernel(image, log=lines.append)
    assert len(lines) == 1 and "booting the compressed kernel" in lines[0] and "HdrS" in lines[0], lines
    assert image.kernel == tmp_path / "vmlinuz"


def test_the_provisioned_images_kernel_unpacks_to_an_elf_with_a_pvh_entry_point(tmp_path):
    """The real parser on the real file: the Debian kernel the lab boots."""
    vmlinuz = image_path() / "vmlinuz"
    if not vmlinuz.is_file():
        pytest.skip("no provisioned guest image (vfio-cxl provision)")
    if bzimage.compression(vmlinuz) == "zstd" and shutil.which("zstd") is None:
        pytest.skip("no zstd on this host")
    bzimage.unpack(vmlinuz, tmp_path / "vmlinux")
    data = (tmp_path / "vmlinux").read_bytes()
    assert data.startswith(b"\x7fELF\x02\x01") and bzimage.elf_end(data) == len(data)
    assert pvh_entry(data) is not None, "no XEN_ELFNOTE_PHYS32_ENTRY note: QEMU would refuse this ELF"


def pvh_entry(elf: bytes) -> int | None:
    """The PVH entry point of an ELF kernel: its Xen note of type 18, or None."""
    phoff, = struct.unpack_from("<Q", elf, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", elf, 0x36)
    for i in range(phnum):
        kind, _, offset, _, _, filesz = struct.unpack_from("<IIQQQQ", elf, phoff + i * phentsize)
        if kind != 4:   # PT_NOTE
            continue
        at, end = offset, offset + filesz
        while at + 12 <= end:
            namesz, descsz, note = struct.unpack_from("<III", elf, at)
            name = elf[at + 12:at + 12 + namesz].rstrip(b"\0")
            desc = at + 12 + (namesz + 3) // 4 * 4
            if name == b"Xen" and note == 18:
                return struct.unpack_from("<I", elf, desc)[0]
            at = desc + (descsz + 3) // 4 * 4
    return None


@needs_zstd
def test_a_zstd_payload_longer_than_recorded_is_read_only_up_to_its_bound(tmp_path):
    elf = fake_elf(300_000)
    image = tmp_path / "bzImage"
    image.write_bytes(fake_bzimage(compress("zstd", elf), 1000))   # records 1000 bytes, holds 300 KB
    with pytest.raises(LabError, match="unpacked to 1001 bytes, the build recorded 1000"):
        bzimage.unpack(image, tmp_path / "vmlinux")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bzImage"]


@needs_zstd
def test_a_damaged_zstd_payload_is_named(tmp_path):
    elf = fake_elf(300_000)
    stream = bytearray(compress("zstd", elf))
    stream[len(stream) // 2:len(stream) // 2 + 64] = b"\xa5" * 64
    image = tmp_path / "bzImage"
    image.write_bytes(fake_bzimage(bytes(stream), len(elf)))
    with pytest.raises(LabError) as raised:
        bzimage.unpack(image, tmp_path / "vmlinux")
    assert str(image) in str(raised.value) and ("zstd -d failed" in str(raised.value)
                                                or "the build recorded" in str(raised.value))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bzImage"]
