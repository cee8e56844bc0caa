"""The register map module: stdlib-only, self-consistent, and its generators."""

import ast
import hashlib
import subprocess
import sys
from pathlib import Path

from vfio_cxl.devices.gpu import regs

REGS_PATH = Path(regs.__file__)


def test_regs_imports_only_the_standard_library():
    tree = ast.parse(REGS_PATH.read_text())
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "regs.py must not import from its package"
            modules.add(node.module.split(".")[0])
    assert modules <= set(sys.stdlib_module_names), modules - set(sys.stdlib_module_names)


def test_regs_loads_standalone_without_the_package():
    # The guest may load the file on its own; nothing else of vfio_cxl may come along.
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('gpu_regs', {str(REGS_PATH)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "assert not [n for n in sys.modules if n.startswith('vfio_cxl')]\n"
        "print(hex(m.ID_MAGIC))\n"
    )
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == hex(regs.ID_MAGIC)


def test_struct_layouts_are_explicit_little_endian_and_sized():
    assert regs.DESC.format.startswith("<") and regs.COMPL.format.startswith("<")
    assert regs.DESC_SIZE == 32 and regs.COMPL_SIZE == 32
    raw = regs.pack_descriptor(regs.Op.VRAM_TO_HOST, 0x1122, 0x3344, 0x55, 1, 0x66)
    assert raw == (bytes.fromhex("2211000000000000" "4433000000000000" "55000000")
                   + bytes([1, 1, 0, 0]) + bytes.fromhex("6600000000000000"))


def test_register_offsets_are_aligned_unique_and_inside_bar0():
    offsets = [v for k, v in vars(regs).items() if k.startswith("REG_")]
    assert len(offsets) == len(set(offsets))
    assert all(o % 4 == 0 and 0 <= o < regs.REGS_SIZE for o in offsets)
    assert set(regs.reset_values()) == set(offsets)


def test_id_magic_spells_gpu1():
    assert regs.ID_MAGIC.to_bytes(4, "little") == b"GPU1"


def test_prng_stream_definition_and_random_access():
    seed = 0xDEADBEEF
    block0 = hashlib.shake_128(seed.to_bytes(8, "little") + bytes(8)).digest(regs.PRNG_BLOCK)
    block1 = hashlib.shake_128(seed.to_bytes(8, "little") + (1).to_bytes(8, "little")).digest(100)
    whole = regs.prng_bytes(seed, regs.PRNG_BLOCK + 100)
    assert whole == block0 + block1
    # any sub-range, including one straddling a block edge, regenerates on its own
    assert regs.prng_bytes(seed, 300, regs.PRNG_BLOCK - 200) == whole[-300:]
    assert regs.prng_bytes(seed, 0) == b""
    assert regs.prng_bytes(seed + 1, 64) != whole[:64]


def test_prng_mismatch_finds_the_first_wrong_byte():
    data = bytearray(regs.prng_bytes(5, 3 * regs.PRNG_BLOCK // 2, 10))
    assert regs.prng_mismatch(data, 5, 10) == -1
    data[regs.PRNG_BLOCK + 7] ^= 1
    assert regs.prng_mismatch(data, 5, 10) == regs.PRNG_BLOCK + 7
    assert regs.prng_mismatch(data, 6, 10) != -1  # another seed, another stream


def test_pattern_bytes_repeat_the_little_endian_pattern():
    assert regs.pattern_bytes(0x0807060504030201, 11) == bytes([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3])
    assert regs.pattern_bytes(1, 0) == b""


def test_status_and_op_codes_are_stable():
    # These numbers are ABI shared with the guest driver: changing one is a break.
    assert [int(o) for o in regs.Op] == [0, 1, 2, 3, 4, 5, 6, 7, 16]
    assert int(regs.Status.DMA_REFUSED) == 6 and int(regs.Status.BAD_RING_CONFIG) == 12
    # interface 1.1 (far memory and compute): COMPUTE (6) and FLUSH (7), registers 0x100-0x1FF
    assert regs.CAPS_OPS & 0xFFFF == 0xFF
    assert int(regs.Status.BAD_KERNEL) == 24 and int(regs.Status.BAD_MODE) == 28
    # interface 1.2 (GPU-initiated NVMe I/O) takes op codes 16-23 and registers 0x200-0x27F
    assert regs.CAPS_OPS >> 16 == 1
    assert regs.DEVICE_VERSION == 0x00010007   # 1.7: FAR_SIZE bounded (1.6: fault batches, UVM counters, GEMV)
    assert (int(regs.Status.QUEUE_TIMEOUT), int(regs.Status.BAD_QUEUE)) == (16, 17)
    assert 0x200 <= regs.REG_MSGWIN_BASE_LO < regs.REG_MSGWIN_READS < 0x280
    assert (regs.NVME_QUEUE_SIZE, regs.NVME_REQUEST_SIZE) == (64, 32)


def test_unpack_completion_keeps_unknown_status_numbers():
    raw = regs.COMPL.pack(7, 999, 1, 2, 3, 4)
    assert regs.unpack_completion(raw)["status"] == 999
