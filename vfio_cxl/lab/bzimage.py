"""The kernel inside an x86 bzImage, unpacked once so the lab can boot it without its boot stub.

A bzImage is a real-mode setup, a decompressor and the kernel proper as a compressed ELF
(``vmlinux.bin``, with the relocation table after it).  QEMU enters an uncompressed ELF
kernel built with ``CONFIG_PVH=y`` directly at its PVH entry point, so nothing is
decompressed on every boot: under TCG that decompression cost the Debian kernel 0.7 s of
its 5.3 s to SSH.

Where the payload is comes from the boot protocol's setup header
(Documentation/arch/x86/boot.rst): ``setup_sects`` at 0x1f1, the ``HdrS`` magic at 0x202,
``payload_offset`` and ``payload_length`` at 0x248 and 0x24c (protocol 2.08 and later), the
offset counted from the protected-mode code, which starts after the setup sectors.  The
kernel's build appends the uncompressed size, little-endian 32-bit, to the compressed
stream; it is checked here.
"""

from __future__ import annotations

import bz2
import lzma
import os
import signal
import struct
import subprocess
import threading
import zlib
from pathlib import Path

from ..errors import LabError

MAX_KERNEL = 512 << 20   # the largest uncompressed kernel accepted (Debian's: 57 MB)

# the compressed stream's first bytes -> the format's name
MAGICS = {
    b"\x28\xb5\x2f\xfd": "zstd",
    b"\x1f\x8b": "gzip",
    b"\xfd7zXZ\x00": "xz",
    b"BZh": "bzip2",
    b"\x5d\x00\x00": "lzma",
    b"\x02\x21\x4c\x18": "lz4",
    b"\x89LZO": "lzo",
}


def _payload_span(head: bytes, name: str) -> tuple[int, int]:
    """(file offset, length) of the payload the boot header at the start of ``head`` names."""
    if len(head) < 0x250 or head[0x202:0x206] != b"HdrS":
        raise LabError(f"{name} is not an x86 bzImage (no 'HdrS' boot header at 0x202)",
                       "give arch/x86/boot/bzImage of a kernel build")
    (version,) = struct.unpack_from("<H", head, 0x206)
    if version < 0x208:
        raise LabError(f"{name}: boot protocol {version >> 8}.{version & 0xff} names no payload",
                       "a kernel of boot protocol 2.08 or later (Linux 2.6.26 and later)")
    setup_sects = head[0x1F1] or 4
    offset, length = struct.unpack_from("<II", head, 0x248)
    return (setup_sects + 1) * 512 + offset, length


def _kind(stream: bytes) -> str | None:
    return next((k for magic, k in MAGICS.items() if stream.startswith(magic)), None)


def payload(image: bytes, name: str = "bzImage") -> tuple[str, bytes, int]:
    """(format, compressed stream without the size after it, uncompressed size) of a bzImage."""
    start, length = _payload_span(image, name)
    if length < 8 or start + length > len(image):
        raise LabError(f"{name}: its payload ({length} bytes at {start}) lies outside the file "
                       f"({len(image)} bytes)", "the file is truncated or not a bzImage")
    stream = image[start:start + length]
    (size,) = struct.unpack_from("<I", stream, length - 4)
    kind = _kind(stream)
    if kind is None:
        raise LabError(f"{name}: its payload starts with {stream[:6].hex()}, no compression a kernel uses",
                       "the file is not a bzImage")
    return kind, stream[:-4], size


def decompress(kind: str, stream: bytes, size: int, name: str = "bzImage") -> bytes:
    """The payload, uncompressed: exactly ``size`` bytes or a LabError."""
    if size > MAX_KERNEL:
        raise LabError(f"{name}: its kernel would be {size} bytes uncompressed, over {MAX_KERNEL}",
                       "the file is not a bzImage")
    try:
        if kind == "gzip":
            data = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(stream, size + 1)
        elif kind in ("xz", "lzma"):
            data = lzma.LZMADecompressor(lzma.FORMAT_XZ if kind == "xz" else lzma.FORMAT_ALONE).decompress(
                stream, size + 1)
        elif kind == "bzip2":
            data = bz2.BZ2Decompressor().decompress(stream, size + 1)
        elif kind == "zstd":
            data = _zstd(stream, size + 1, name)
        else:
            raise LabError(f"{name}: its kernel is {kind}-compressed, which the lab cannot unpack",
                           "a kernel built with CONFIG_KERNEL_ZSTD, _GZIP, _XZ, _LZMA or _BZIP2")
    except (zlib.error, lzma.LZMAError, OSError, EOFError) as e:   # bz2 raises OSError
        raise LabError(f"{name}: its {kind} payload is damaged: {e}", "the file is truncated or damaged") from None
    if len(data) != size:
        raise LabError(f"{name}: its {kind} payload unpacked to {len(data)} bytes, the build recorded {size}",
                       "the file is truncated or damaged")
    return data


def _zstd(stream: bytes, limit: int, name: str) -> bytes:
    """The host's ``zstd -d`` over ``stream``: at most ``limit`` bytes of its output are read
    (a stream that unpacks to more is cut off there, and the size check then names it)."""
    try:
        proc = subprocess.Popen(["zstd", "-d", "-c", "-q"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
    except FileNotFoundError:
        raise LabError(f"{name} is zstd-compressed and the host has no zstd", "apt-get install zstd") from None
    with proc:
        # the input goes in from a thread: zstd writes while it reads, and a full output pipe
        # with nobody reading it would stall both
        feeder = threading.Thread(target=_feed, args=(proc.stdin, stream), daemon=True)
        feeder.start()
        data = proc.stdout.read(limit)
        cut = len(data) >= limit
        if cut:
            proc.kill()
        feeder.join()
        errors = proc.stderr.read(4096).decode(errors="replace").strip()
        status = proc.wait()
    if status != 0 and not (cut and status == -signal.SIGKILL):
        raise LabError(f"{name}: zstd -d failed: {errors}", "the file is truncated or not a bzImage")
    return data


def _feed(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
    except (BrokenPipeError, ValueError):
        pass   # zstd ended (or was killed) before it took everything: its status says why
    finally:
        try:
            pipe.close()   # closes the fd even when flushing what is left fails
        except (BrokenPipeError, ValueError):
            pass


def elf_end(data: bytes, name: str = "bzImage") -> int:
    """Where the ELF at the start of ``data`` ends (its section headers or its last segment):
    the payload carries the relocation table after it, which is no part of the ELF."""
    if not data.startswith(b"\x7fELF\x02\x01"):
        raise LabError(f"{name}: its payload is not a 64-bit little-endian ELF kernel", "an x86-64 bzImage")
    phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
    if phentsize != 56 or phoff + phnum * phentsize > len(data):
        raise LabError(f"{name}: its ELF's program headers ({phnum} of {phentsize} bytes at {phoff}) "
                       f"do not fit its {len(data)} bytes", "the file is damaged")
    end = shoff + shentsize * shnum
    for i in range(phnum):
        _type, _flags, offset, _vaddr, _paddr, filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
        end = max(end, offset + filesz)
    if end > len(data):
        raise LabError(f"{name}: its ELF claims {end} bytes, the payload holds {len(data)}", "the file is damaged")
    return end


def unpack(bzimage: Path, out: Path) -> None:
    """Write the ELF kernel inside ``bzimage`` to ``out``; ``out`` appears whole or not at all."""
    name = str(bzimage)
    kind, stream, size = payload(bzimage.read_bytes(), name)
    data = decompress(kind, stream, size, name)
    data = data[:elf_end(data, name)]
    scratch = out.with_name(f".{out.name}.{os.getpid()}")
    try:
        scratch.write_bytes(data)
        os.replace(scratch, out)
    finally:
        scratch.unlink(missing_ok=True)


def compression(bzimage: Path) -> str:
    """The payload's compression (e.g. to install its tool first), or "unknown"; reads only the
    header and the payload's first bytes."""
    with open(bzimage, "rb") as f:
        try:
            start, _ = _payload_span(f.read(0x250), str(bzimage))
        except LabError:
            return "unknown"
        f.seek(start)
        return _kind(f.read(8)) or "unknown"
