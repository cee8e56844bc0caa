// SPDX-License-Identifier: GPL-2.0-only
/*
 * A VFIO selftests driver for the vfio-cxl GPU (PCI 0601:1991), in the shape
 * of the drivers in tools/testing/selftests/vfio/lib/drivers/: the
 * selftests' vfio_pci_driver_test drives the GPU's DMA engine through it.
 *
 * memcpy goes through the descriptor ring and doorbell of docs/gpu-device.md
 * with HOST_TO_HOST descriptors (IOVA to IOVA); send_msi() retires one NOP
 * descriptor with INTERRUPT set, which raises the DMA_DONE vector.  A
 * failing descriptor halts the ring and raises the ERROR vector, never the
 * DMA_DONE one, so the tests' "no MSI" checks hold on the error paths.
 */
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#include <linux/errno.h>
#include <linux/io.h>
#include <linux/pci_regs.h>
#include <linux/sizes.h>

#include <libvfio.h>

#include "registers.h"

/* Ring entries; at most GPU_RING_ENTRIES - 1 descriptors are outstanding. */
#define GPU_RING_ENTRIES	256
#define GPU_MAX_MEMCPY_SIZE	SZ_1M
#define GPU_MAX_MEMCPY_COUNT	64
#define GPU_WAIT_SECONDS	30

/* Lives in device->driver.region: the device reaches it by DMA. */
struct gpu_state {
	struct gpu_desc ring[GPU_RING_ENTRIES];
	struct gpu_compl compl[GPU_RING_ENTRIES];
	u32 tail;		/* next free ring slot (the doorbell value) */
};

static const char *const gpu_status_names[] = {
	"OK", "BAD_OPCODE", "BAD_FLAGS", "VRAM_RANGE", "DMA_UNMAPPED",
	"DMA_PERMISSION", "DMA_REFUSED", "DMA_TIMEOUT", "DMA_ABORTED",
	"RING_FETCH", "COMPLETION_WRITE", "BAD_TAIL", "BAD_RING_CONFIG",
	"DMA_IO_ERROR",
	[16] = "QUEUE_TIMEOUT", "BAD_QUEUE",	/* interface 1.2 (NVME_IO) */
	/* interface 1.1: far memory and compute */
	[24] = "BAD_KERNEL", "FAR_RANGE", "FAULT_TIMEOUT", "FAULT_CANCELLED", "BAD_MODE",
};

static inline struct gpu_state *to_gpu_state(struct vfio_pci_device *device)
{
	return device->driver.region.vaddr;
}

static inline void *gpu_regs(struct vfio_pci_device *device)
{
	return device->bars[0].vaddr;
}

static int gpu_probe(struct vfio_pci_device *device)
{
	u32 caps;

	if (!vfio_pci_device_match(device, GPU_PCI_VENDOR_ID, GPU_PCI_DEVICE_ID))
		return -EINVAL;

	VFIO_ASSERT_NOT_NULL(gpu_regs(device), "BAR0 of the GPU is not mapped\n");

	if (readl(gpu_regs(device) + GPU_REG_ID) != GPU_ID_MAGIC) {
		dev_err(device, "gpu: BAR0 ID is not \"GPU1\"\n");
		return -EINVAL;
	}
	if (GPU_VERSION_MAJOR(readl(gpu_regs(device) + GPU_REG_VERSION)) != 1) {
		dev_err(device, "gpu: unsupported device interface version\n");
		return -EINVAL;
	}
	caps = readl(gpu_regs(device) + GPU_REG_CAPS);
	if (!(caps & (1U << GPU_OP_HOST_TO_HOST))) {
		dev_err(device, "gpu: no HOST_TO_HOST op (CAPS 0x%x)\n", caps);
		return -EINVAL;
	}
	return 0;
}

/* Reset the engine: IDLE, every BAR0 register at its reset value. */
static void gpu_reset(struct vfio_pci_device *device)
{
	void *regs = gpu_regs(device);

	writel(GPU_CONTROL_RESET, regs + GPU_REG_CONTROL);
	/* BAR writes are posted: a read returns once the reset took effect. */
	VFIO_ASSERT_EQ(readl(regs + GPU_REG_STATUS), 0);
	to_gpu_state(device)->tail = 0;
}

/* Program the ring and completion area and start the engine. */
static void gpu_start_ring(struct vfio_pci_device *device)
{
	struct gpu_state *gpu = to_gpu_state(device);
	void *regs = gpu_regs(device);
	iova_t ring = to_iova(device, gpu->ring);
	iova_t compl = to_iova(device, gpu->compl);

	memset(gpu->ring, 0, sizeof(gpu->ring));
	memset(gpu->compl, 0, sizeof(gpu->compl));

	writel((u32)(ring), regs + GPU_REG_RING_BASE_LO);
	writel((u32)((ring) >> 32), regs + GPU_REG_RING_BASE_HI);
	writel(GPU_RING_ENTRIES, regs + GPU_REG_RING_SIZE);
	writel((u32)(compl), regs + GPU_REG_COMPL_BASE_LO);
	writel((u32)((compl) >> 32), regs + GPU_REG_COMPL_BASE_HI);
	writel(GPU_CONTROL_ENABLE, regs + GPU_REG_CONTROL);

	VFIO_ASSERT_EQ(readl(regs + GPU_REG_STATUS), GPU_STATUS_ENABLED,
		       "gpu: ring did not start (ERR_STATUS %u)\n",
		       readl(regs + GPU_REG_ERR_STATUS));
}

static void gpu_init(struct vfio_pci_device *device)
{
	struct gpu_state *gpu = to_gpu_state(device);
	void *regs = gpu_regs(device);

	VFIO_ASSERT_GE(device->driver.region.size, sizeof(*gpu));
	VFIO_ASSERT_GE(readl(regs + GPU_REG_RING_MAX), GPU_RING_ENTRIES);

	vfio_pci_config_writew(device, PCI_COMMAND,
			       PCI_COMMAND_MEMORY |
			       PCI_COMMAND_MASTER |
			       PCI_COMMAND_INTX_DISABLE);

	gpu_reset(device);
	gpu_start_ring(device);

	/* One eventfd per vector, so ERROR never lands on DMA_DONE's. */
	if (device->msix_info.count >= GPU_VECTORS)
		vfio_pci_msix_enable(device, 0, GPU_VECTORS);
	else
		vfio_pci_msi_enable(device, 0, GPU_VECTORS);

	device->driver.msi = GPU_VEC_DMA_DONE;
	device->driver.max_memcpy_size = GPU_MAX_MEMCPY_SIZE;
	device->driver.max_memcpy_count = GPU_MAX_MEMCPY_COUNT;
}

static void gpu_remove(struct vfio_pci_device *device)
{
	gpu_reset(device);

	if (device->msix_info.count >= GPU_VECTORS)
		vfio_pci_msix_disable(device);
	else
		vfio_pci_msi_disable(device);
}

/* Queue @count descriptors and ring the doorbell once. */
static void gpu_submit(struct vfio_pci_device *device, const struct gpu_desc *desc,
		       u64 count)
{
	struct gpu_state *gpu = to_gpu_state(device);
	u64 i;

	VFIO_ASSERT_LT(count, GPU_RING_ENTRIES);

	for (i = 0; i < count; i++) {
		gpu->ring[gpu->tail] = *desc;
		gpu->ring[gpu->tail].cookie = i;
		gpu->tail = (gpu->tail + 1) % GPU_RING_ENTRIES;
	}

	/* Descriptors in memory before the doorbell. */
	__sync_synchronize();
	writel(gpu->tail, gpu_regs(device) + GPU_REG_RING_TAIL);
}

static void gpu_handle_error(struct vfio_pci_device *device)
{
	void *regs = gpu_regs(device);
	u32 status = readl(regs + GPU_REG_ERR_STATUS);

	dev_err(device, "gpu: ring halted: %s (%u) at descriptor %u, address 0x%x%08x, errno %u\n",
		status < ARRAY_SIZE(gpu_status_names) && gpu_status_names[status] ?
			gpu_status_names[status] : "?",
		status, readl(regs + GPU_REG_ERR_DESC_INDEX),
		readl(regs + GPU_REG_ERR_ADDR_HI), readl(regs + GPU_REG_ERR_ADDR_LO),
		readl(regs + GPU_REG_ERR_ERRNO));

	/* Only a reset leaves HALTED; it raises no vector. */
	gpu_reset(device);
	gpu_start_ring(device);
}

static int gpu_memcpy_wait(struct vfio_pci_device *device)
{
	struct gpu_state *gpu = to_gpu_state(device);
	void *regs = gpu_regs(device);
	struct timespec start, now;

	clock_gettime(CLOCK_MONOTONIC, &start);

	/* HEAD reaches TAIL once every queued descriptor has retired. */
	for (;;) {
		if (readl(regs + GPU_REG_RING_HEAD) == gpu->tail)
			return 0;

		if (readl(regs + GPU_REG_STATUS) & GPU_STATUS_HALTED) {
			gpu_handle_error(device);
			return -1;
		}

		clock_gettime(CLOCK_MONOTONIC, &now);
		VFIO_ASSERT_LT(now.tv_sec - start.tv_sec, GPU_WAIT_SECONDS,
			       "gpu: ring stuck at HEAD %u (TAIL %u)\n",
			       readl(regs + GPU_REG_RING_HEAD), gpu->tail);
		usleep(20);
	}
}

static void gpu_memcpy_start(struct vfio_pci_device *device,
			     iova_t src, iova_t dst, u64 size, u64 count)
{
	struct gpu_desc desc = {
		.src = src,
		.dst = dst,
		.length = size,
		.op = GPU_OP_HOST_TO_HOST,
	};

	VFIO_ASSERT_LE(size, GPU_MAX_MEMCPY_SIZE);
	gpu_submit(device, &desc, count);
}

static void gpu_send_msi(struct vfio_pci_device *device)
{
	struct gpu_desc desc = {
		.op = GPU_OP_NOP,
		.flags = GPU_DESC_FLAG_INTERRUPT,
	};

	gpu_submit(device, &desc, 1);
	VFIO_ASSERT_EQ(gpu_memcpy_wait(device), 0);
}

const struct vfio_pci_driver_ops vfio_cxl_gpu_ops = {
	.name = "vfio_cxl_gpu",
	.probe = gpu_probe,
	.init = gpu_init,
	.remove = gpu_remove,
	.memcpy_start = gpu_memcpy_start,
	.memcpy_wait = gpu_memcpy_wait,
	.send_msi = gpu_send_msi,
};
