"""The iommufd user API (include/uapi/linux/iommufd.h) and VFIO's device cdev ioctls.

The second VFIO backend: a device opened through its cdev
(/dev/vfio/devices/vfioN) is bound to an iommufd (/dev/iommu) and attached
to an IO address space (IOAS) there, instead of going through a group and a
type1 container.  ``tests/fast/test_vfio_uapi_layout.py`` checks every struct
and constant here against the guest kernel's own headers, as for ``uapi``.

Standard library, cffi and ``vfio_abi`` (the ioctl encoding, VFIO's type and base) only;
names are the kernel's.
"""

from __future__ import annotations

import re

from ...vfio_abi import VFIO_BASE, VFIO_TYPE, ioctl_number  # noqa: F401 (VFIO_TYPE, VFIO_BASE: this module's names too)
from .cdefs import ffi_for

CDEF = (
    """
    struct iommu_destroy {
        uint32_t size;
        uint32_t id;
    };

    struct iommu_ioas_alloc {
        uint32_t size;
        uint32_t flags;
        uint32_t out_ioas_id;
    };

    struct iommu_iova_range {
        uint64_t start;
        uint64_t last;
    };

    struct iommu_ioas_iova_ranges {
        uint32_t size;
        uint32_t ioas_id;
        uint32_t num_iovas;
        uint32_t __reserved;
        uint64_t allowed_iovas;
        uint64_t out_iova_alignment;
    };

    struct iommu_ioas_map {
        uint32_t size;
        uint32_t flags;
        uint32_t ioas_id;
        uint32_t __reserved;
        uint64_t user_va;
        uint64_t length;
        uint64_t iova;
    };

    struct iommu_ioas_unmap {
        uint32_t size;
        uint32_t ioas_id;
        uint64_t iova;
        uint64_t length;
    };

    struct vfio_device_bind_iommufd {
        uint32_t argsz;
        uint32_t flags;
        int32_t iommufd;
        uint32_t out_devid;
    };

    struct vfio_device_attach_iommufd_pt {
        uint32_t argsz;
        uint32_t flags;
        uint32_t pt_id;
    };

    struct vfio_device_detach_iommufd_pt {
        uint32_t argsz;
        uint32_t flags;
    };
    """
)

#: Every struct declared above, for the layout test against the guest's (6.12) headers.
STRUCTS = tuple(sorted(f"struct {name}" for name in re.findall(r"struct (\w+) \{", CDEF)))

# Newer than the guest's 6.12 headers (the lab kernel, 7.3, has them): peer-to-peer
# DMA on iommufd.  IOMMU_IOAS_MAP pins pages, which a BAR mmap (VM_PFNMAP) has none
# of; the BAR goes in as a VFIO dma-buf instead (VFIO_DEVICE_FEATURE_DMA_BUF) and
# that fd is mapped with IOMMU_IOAS_MAP_FILE.  ``tests/fast/test_vfio_uapi_newer.py``
# checks these against the lab kernel's source headers.
CDEF_NEWER = (
    """
    struct iommu_ioas_map_file {
        uint32_t size;
        uint32_t flags;
        uint32_t ioas_id;
        int32_t fd;
        uint64_t start;
        uint64_t length;
        uint64_t iova;
    };

    struct vfio_device_feature {
        uint32_t argsz;
        uint32_t flags;
        uint8_t data[];
    };

    struct vfio_region_dma_range {
        uint64_t offset;
        uint64_t length;
    };

    struct vfio_device_feature_dma_buf {
        uint32_t region_index;
        uint32_t open_flags;
        uint32_t flags;
        uint32_t nr_ranges;
        struct vfio_region_dma_range dma_ranges[];
    };
    """
)
ffi = ffi_for("iommufd", CDEF, CDEF_NEWER)   # parsed once per guest, not at every start (cdefs.py)

#: The structs above that the guest's 6.12 headers do not have yet.
NEWER_STRUCTS = tuple(f"struct {name}" for name in ffi.list_types()[1] if f"struct {name}" not in STRUCTS)


IOMMUFD_TYPE = ord(";")
IOMMUFD_CMD_BASE = 0x80
IOMMU_DESTROY = ioctl_number(IOMMUFD_TYPE, IOMMUFD_CMD_BASE + 0)
IOMMU_IOAS_ALLOC = ioctl_number(IOMMUFD_TYPE, IOMMUFD_CMD_BASE + 1)
IOMMU_IOAS_IOVA_RANGES = ioctl_number(IOMMUFD_TYPE, IOMMUFD_CMD_BASE + 4)
IOMMU_IOAS_MAP = ioctl_number(IOMMUFD_TYPE, IOMMUFD_CMD_BASE + 5)
IOMMU_IOAS_UNMAP = ioctl_number(IOMMUFD_TYPE, IOMMUFD_CMD_BASE + 6)

# struct iommu_ioas_map.flags
IOMMU_IOAS_MAP_FIXED_IOVA = 1 << 0
IOMMU_IOAS_MAP_WRITEABLE = 1 << 1
IOMMU_IOAS_MAP_READABLE = 1 << 2

# ioctls on a VFIO device cdev (same type and base as the rest of VFIO: vfio_abi's)
VFIO_DEVICE_BIND_IOMMUFD = ioctl_number(VFIO_TYPE, VFIO_BASE + 18)
VFIO_DEVICE_ATTACH_IOMMUFD_PT = ioctl_number(VFIO_TYPE, VFIO_BASE + 19)
VFIO_DEVICE_DETACH_IOMMUFD_PT = ioctl_number(VFIO_TYPE, VFIO_BASE + 20)

#: The kernel constants above by name, for the layout test (the enum
#: IOMMUFD_CMD_* values are compared through the ioctl numbers built from them).
CONSTANTS = {name: value for name, value in globals().items()
             if name.startswith(("IOMMU_", "VFIO_DEVICE_")) or name == "IOMMUFD_TYPE"}

# -- newer than 6.12 (see NEWER_STRUCTS) --
IOMMU_IOAS_MAP_FILE = ioctl_number(IOMMUFD_TYPE, IOMMUFD_CMD_BASE + 0xF)
VFIO_DEVICE_FEATURE = ioctl_number(VFIO_TYPE, VFIO_BASE + 17)
VFIO_DEVICE_FEATURE_MASK = 0xFFFF
VFIO_DEVICE_FEATURE_GET = 1 << 16
VFIO_DEVICE_FEATURE_SET = 1 << 17
VFIO_DEVICE_FEATURE_PROBE = 1 << 18
VFIO_DEVICE_FEATURE_DMA_BUF = 11

NEWER_CONSTANTS = {name: value for name, value in globals().items()
                   if name.startswith(("IOMMU_", "VFIO_DEVICE_")) and name not in CONSTANTS}
