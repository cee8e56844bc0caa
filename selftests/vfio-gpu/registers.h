/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * The vfio-cxl GPU's registers, descriptors and completion records, as C.
 *
 * docs/gpu-device.md is the contract and vfio_cxl/devices/gpu/regs.py writes
 * the same numbers down as Python; these are copied from there by hand (a
 * fast test compares the two).
 */
#ifndef SELFTESTS_VFIO_CXL_GPU_REGISTERS_H
#define SELFTESTS_VFIO_CXL_GPU_REGISTERS_H

#include <linux/types.h>

#define GPU_PCI_VENDOR_ID	0x0601
#define GPU_PCI_DEVICE_ID	0x1991

/* BAR0 registers: all 32 bits, little-endian */
#define GPU_REG_ID		0x000
#define GPU_REG_VERSION		0x004
#define GPU_REG_CAPS		0x010
#define GPU_REG_RING_MAX	0x014
#define GPU_REG_CONTROL		0x020
#define GPU_REG_STATUS		0x024
#define GPU_REG_INTR_STATUS	0x028
#define GPU_REG_RING_BASE_LO	0x040
#define GPU_REG_RING_BASE_HI	0x044
#define GPU_REG_RING_SIZE	0x048
#define GPU_REG_RING_HEAD	0x04c
#define GPU_REG_RING_TAIL	0x050
#define GPU_REG_COMPL_BASE_LO	0x058
#define GPU_REG_COMPL_BASE_HI	0x05c
#define GPU_REG_COMPLETED	0x060
#define GPU_REG_ERR_STATUS	0x080
#define GPU_REG_ERR_DESC_INDEX	0x084
#define GPU_REG_ERR_ADDR_LO	0x088
#define GPU_REG_ERR_ADDR_HI	0x08c
#define GPU_REG_ERR_ERRNO	0x090

#define GPU_ID_MAGIC		0x31555047	/* "GPU1" */
#define GPU_VERSION_MAJOR(v)	((v) >> 16)

#define GPU_CONTROL_ENABLE	(1U << 0)
#define GPU_CONTROL_RESET	(1U << 1)

#define GPU_STATUS_ENABLED	(1U << 0)
#define GPU_STATUS_BUSY		(1U << 1)
#define GPU_STATUS_HALTED	(1U << 2)

#define GPU_INTR_DMA_DONE	(1U << 0)
#define GPU_INTR_ERROR		(1U << 1)

/* Interrupt vectors (MSI-X, or MSI with --irq-mode msi) */
#define GPU_VEC_DMA_DONE	0
#define GPU_VEC_ERROR		1
#define GPU_VECTORS		4

/* Descriptor ops; CAPS bit n set = op n supported */
#define GPU_OP_NOP		0
#define GPU_OP_VRAM_TO_HOST	1
#define GPU_OP_HOST_TO_VRAM	2
#define GPU_OP_FILL_PATTERN	3
#define GPU_OP_FILL_PRNG	4
#define GPU_OP_HOST_TO_HOST	5
#define GPU_OP_NVME_IO		16	/* interface 1.2: the selftests do not use it */
/* interface 1.1 (docs/gpu-device.md, "Far memory and compute"); this driver does not use them */
#define GPU_OP_COMPUTE		6
#define GPU_OP_FLUSH		7

#define GPU_DESC_FLAG_INTERRUPT	(1U << 0)

#define GPU_RING_SIZE_MIN	2

struct gpu_desc {
	u64 src;
	u64 dst;
	u32 length;
	u8 op;
	u8 flags;
	u16 reserved;
	u64 cookie;
} __attribute__((packed, aligned(32)));

struct gpu_compl {
	u64 cookie;
	u32 status;
	u32 bytes_done;
	u32 index;
	u32 seq;
	u64 duration_ns;
} __attribute__((packed, aligned(32)));

_Static_assert(sizeof(struct gpu_desc) == 32, "descriptor is 32 bytes");
_Static_assert(sizeof(struct gpu_compl) == 32, "completion record is 32 bytes");

#endif /* SELFTESTS_VFIO_CXL_GPU_REGISTERS_H */
