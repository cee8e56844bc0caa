"""The kernel's VFIO ABI (include/uapi/linux/vfio.h), defined once.

Standard library only, so both sides of the lab import it: the guest's VFIO
stack (``vfio_cxl.guest.vfio.uapi`` hands ``CDEF`` to cffi) and the
vfio-user wire code of the devices room (``vfio_cxl.devices.vfio_user.wire``
uses the constants and the ``LAYOUTS`` below: vfio-user reuses the kernel's
structs).  ``tests/fast/test_vfio_uapi_layout.py`` checks every struct,
field offset and constant here against the guest kernel's own headers with a
C probe, and every ``LAYOUTS`` entry against those structs.

Names are the kernel's.
"""

from __future__ import annotations

import re
import struct

# __aligned_u64 is uint64_t here: on x86_64 a uint64_t is already 8-aligned,
# which is all the kernel's annotation adds (it matters on 32-bit ABIs).
CDEF = """
    struct vfio_info_cap_header {
        uint16_t id;
        uint16_t version;
        uint32_t next;
    };

    struct vfio_group_status {
        uint32_t argsz;
        uint32_t flags;
    };

    struct vfio_device_info {
        uint32_t argsz;
        uint32_t flags;
        uint32_t num_regions;
        uint32_t num_irqs;
        uint32_t cap_offset;
        uint32_t pad;
    };

    struct vfio_region_info {
        uint32_t argsz;
        uint32_t flags;
        uint32_t index;
        uint32_t cap_offset;
        uint64_t size;
        uint64_t offset;
    };

    struct vfio_region_sparse_mmap_area {
        uint64_t offset;
        uint64_t size;
    };

    struct vfio_region_info_cap_sparse_mmap {
        struct vfio_info_cap_header header;
        uint32_t nr_areas;
        uint32_t reserved;
        struct vfio_region_sparse_mmap_area areas[];
    };

    struct vfio_region_info_cap_type {
        struct vfio_info_cap_header header;
        uint32_t type;
        uint32_t subtype;
    };

    struct vfio_irq_info {
        uint32_t argsz;
        uint32_t flags;
        uint32_t index;
        uint32_t count;
    };

    struct vfio_irq_set {
        uint32_t argsz;
        uint32_t flags;
        uint32_t index;
        uint32_t start;
        uint32_t count;
        uint8_t data[];
    };

    struct vfio_iommu_type1_info {
        uint32_t argsz;
        uint32_t flags;
        uint64_t iova_pgsizes;
        uint32_t cap_offset;
        uint32_t pad;
    };

    struct vfio_iova_range {
        uint64_t start;
        uint64_t end;
    };

    struct vfio_iommu_type1_info_cap_iova_range {
        struct vfio_info_cap_header header;
        uint32_t nr_iovas;
        uint32_t reserved;
        struct vfio_iova_range iova_ranges[];
    };

    struct vfio_iommu_type1_info_dma_avail {
        struct vfio_info_cap_header header;
        uint32_t avail;
    };

    struct vfio_iommu_type1_dma_map {
        uint32_t argsz;
        uint32_t flags;
        uint64_t vaddr;
        uint64_t iova;
        uint64_t size;
    };

    struct vfio_iommu_type1_dma_unmap {
        uint32_t argsz;
        uint32_t flags;
        uint64_t iova;
        uint64_t size;
        uint8_t data[];
    };
"""


def ioctl_number(type_: int, nr: int) -> int:
    """The kernel's _IO(): no direction and no size bits (VFIO and iommufd pass argsz instead)."""
    return (type_ << 8) | nr


_IO = ioctl_number   # the kernel's spelling, for the tables below


VFIO_API_VERSION = 0

# Extensions (VFIO_CHECK_EXTENSION arguments)
VFIO_TYPE1_IOMMU = 1
VFIO_TYPE1v2_IOMMU = 3
VFIO_DMA_CC_IOMMU = 4
VFIO_NOIOMMU_IOMMU = 8
VFIO_UNMAP_ALL = 9

VFIO_TYPE = ord(";")
VFIO_BASE = 100

# ioctls on the container (/dev/vfio/vfio)
VFIO_GET_API_VERSION = _IO(VFIO_TYPE, VFIO_BASE + 0)
VFIO_CHECK_EXTENSION = _IO(VFIO_TYPE, VFIO_BASE + 1)
VFIO_SET_IOMMU = _IO(VFIO_TYPE, VFIO_BASE + 2)
# ioctls on a group (/dev/vfio/N)
VFIO_GROUP_GET_STATUS = _IO(VFIO_TYPE, VFIO_BASE + 3)
VFIO_GROUP_SET_CONTAINER = _IO(VFIO_TYPE, VFIO_BASE + 4)
VFIO_GROUP_UNSET_CONTAINER = _IO(VFIO_TYPE, VFIO_BASE + 5)
VFIO_GROUP_GET_DEVICE_FD = _IO(VFIO_TYPE, VFIO_BASE + 6)
# ioctls on a device fd
VFIO_DEVICE_GET_INFO = _IO(VFIO_TYPE, VFIO_BASE + 7)
VFIO_DEVICE_GET_REGION_INFO = _IO(VFIO_TYPE, VFIO_BASE + 8)
VFIO_DEVICE_GET_IRQ_INFO = _IO(VFIO_TYPE, VFIO_BASE + 9)
VFIO_DEVICE_SET_IRQS = _IO(VFIO_TYPE, VFIO_BASE + 10)
VFIO_DEVICE_RESET = _IO(VFIO_TYPE, VFIO_BASE + 11)
# type1 IOMMU ioctls, on the container once an IOMMU type is set
VFIO_IOMMU_GET_INFO = _IO(VFIO_TYPE, VFIO_BASE + 12)
VFIO_IOMMU_MAP_DMA = _IO(VFIO_TYPE, VFIO_BASE + 13)
VFIO_IOMMU_UNMAP_DMA = _IO(VFIO_TYPE, VFIO_BASE + 14)

# struct vfio_group_status.flags
VFIO_GROUP_FLAGS_VIABLE = 1 << 0
VFIO_GROUP_FLAGS_CONTAINER_SET = 1 << 1

# struct vfio_device_info.flags
VFIO_DEVICE_FLAGS_RESET = 1 << 0
VFIO_DEVICE_FLAGS_PCI = 1 << 1
VFIO_DEVICE_FLAGS_CAPS = 1 << 7

# struct vfio_region_info.flags and capability ids
VFIO_REGION_INFO_FLAG_READ = 1 << 0
VFIO_REGION_INFO_FLAG_WRITE = 1 << 1
VFIO_REGION_INFO_FLAG_MMAP = 1 << 2
VFIO_REGION_INFO_FLAG_CAPS = 1 << 3
VFIO_REGION_INFO_CAP_SPARSE_MMAP = 1
VFIO_REGION_INFO_CAP_TYPE = 2
VFIO_REGION_INFO_CAP_MSIX_MAPPABLE = 3

# struct vfio_irq_info.flags
VFIO_IRQ_INFO_EVENTFD = 1 << 0
VFIO_IRQ_INFO_MASKABLE = 1 << 1
VFIO_IRQ_INFO_AUTOMASKED = 1 << 2
VFIO_IRQ_INFO_NORESIZE = 1 << 3

# struct vfio_irq_set.flags
VFIO_IRQ_SET_DATA_NONE = 1 << 0
VFIO_IRQ_SET_DATA_BOOL = 1 << 1
VFIO_IRQ_SET_DATA_EVENTFD = 1 << 2
VFIO_IRQ_SET_ACTION_MASK = 1 << 3
VFIO_IRQ_SET_ACTION_UNMASK = 1 << 4
VFIO_IRQ_SET_ACTION_TRIGGER = 1 << 5

# struct vfio_iommu_type1_info.flags and capability ids
VFIO_IOMMU_INFO_PGSIZES = 1 << 0
VFIO_IOMMU_INFO_CAPS = 1 << 1
VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE = 1
VFIO_IOMMU_TYPE1_INFO_DMA_AVAIL = 3

# struct vfio_iommu_type1_dma_map / dma_unmap .flags
VFIO_DMA_MAP_FLAG_READ = 1 << 0
VFIO_DMA_MAP_FLAG_WRITE = 1 << 1
VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP = 1 << 0
VFIO_DMA_UNMAP_FLAG_ALL = 1 << 1

# vfio-pci's fixed region and IRQ indexes
VFIO_PCI_BAR0_REGION_INDEX = 0
VFIO_PCI_BAR1_REGION_INDEX = 1
VFIO_PCI_BAR2_REGION_INDEX = 2
VFIO_PCI_BAR3_REGION_INDEX = 3
VFIO_PCI_BAR4_REGION_INDEX = 4
VFIO_PCI_BAR5_REGION_INDEX = 5
VFIO_PCI_ROM_REGION_INDEX = 6
VFIO_PCI_CONFIG_REGION_INDEX = 7
VFIO_PCI_VGA_REGION_INDEX = 8
VFIO_PCI_NUM_REGIONS = 9

VFIO_PCI_INTX_IRQ_INDEX = 0
VFIO_PCI_MSI_IRQ_INDEX = 1
VFIO_PCI_MSIX_IRQ_INDEX = 2
VFIO_PCI_ERR_IRQ_INDEX = 3
VFIO_PCI_REQ_IRQ_INDEX = 4
VFIO_PCI_NUM_IRQS = 5

#: Every kernel constant above by name, for the layout test.
CONSTANTS = {name: value for name, value in globals().items() if name.startswith("VFIO_")}


class Layout(struct.Struct):
    """A kernel struct (or its fixed-size head) as a little-endian ``struct.Struct``,
    with the kernel's field names, so the layout test can compare offsets."""

    def __init__(self, c_name: str, fmt: str, fields: tuple[str, ...]):
        super().__init__(fmt)
        self.c_name, self.fields = c_name, fields

    def offsets(self) -> dict[str, int]:
        out, pos = {}, 0
        codes = re.findall(r"\d*[a-zA-Z?]", self.format.lstrip("<="))  # "8x" is one field
        for name, code in zip(self.fields, codes, strict=True):
            out[name] = pos
            pos += struct.calcsize("<" + code)
        return out


# the structs vfio-user reuses on the wire (fixed-size heads; arrays follow)
VFIO_INFO_CAP_HEADER = Layout("struct vfio_info_cap_header", "<HHI", ("id", "version", "next"))
VFIO_DEVICE_INFO_HEAD = Layout("struct vfio_device_info", "<IIII",
                               ("argsz", "flags", "num_regions", "num_irqs"))
VFIO_REGION_INFO = Layout("struct vfio_region_info", "<IIIIQQ",
                          ("argsz", "flags", "index", "cap_offset", "size", "offset"))
VFIO_REGION_SPARSE_MMAP_AREA = Layout("struct vfio_region_sparse_mmap_area", "<QQ",
                                      ("offset", "size"))
VFIO_REGION_INFO_CAP_SPARSE_MMAP_HEAD = Layout(
    "struct vfio_region_info_cap_sparse_mmap", "<8xII", ("header", "nr_areas", "reserved"))
VFIO_IRQ_INFO = Layout("struct vfio_irq_info", "<IIII", ("argsz", "flags", "index", "count"))
VFIO_IRQ_SET_HEAD = Layout("struct vfio_irq_set", "<IIIII",
                           ("argsz", "flags", "index", "start", "count"))
VFIO_IOMMU_TYPE1_DMA_UNMAP_HEAD = Layout("struct vfio_iommu_type1_dma_unmap", "<IIQQ",
                                         ("argsz", "flags", "iova", "size"))

LAYOUTS = (VFIO_INFO_CAP_HEADER, VFIO_DEVICE_INFO_HEAD, VFIO_REGION_INFO,
           VFIO_REGION_SPARSE_MMAP_AREA, VFIO_REGION_INFO_CAP_SPARSE_MMAP_HEAD, VFIO_IRQ_INFO,
           VFIO_IRQ_SET_HEAD, VFIO_IOMMU_TYPE1_DMA_UNMAP_HEAD)
