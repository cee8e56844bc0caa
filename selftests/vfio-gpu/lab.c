// SPDX-License-Identifier: GPL-2.0-only
/*
 * Glue that builds the vfio-cxl GPU driver into the kernel's VFIO selftests
 * without changing their sources:
 *
 *  - the selftests' driver table (lib/vfio_pci_driver.c) is static, so the
 *    binaries are linked with -Wl,--wrap=vfio_pci_driver_probe: a device
 *    none of the kernel's drivers claims is offered to the GPU driver;
 *  - tests without per-mode variants use default_iommu_mode (lib/iommu.c,
 *    "iommufd"); $VFIO_SELFTESTS_IOMMU_MODE, when set, replaces it, so they
 *    run on every IOMMU mode, and on kernels without IOMMUFD.
 */
#include <stdlib.h>

#include <libvfio.h>

extern const struct vfio_pci_driver_ops vfio_cxl_gpu_ops;

void __real_vfio_pci_driver_probe(struct vfio_pci_device *device);

void __wrap_vfio_pci_driver_probe(struct vfio_pci_device *device)
{
	__real_vfio_pci_driver_probe(device);

	if (device->driver.ops)
		return;

	if (!vfio_cxl_gpu_ops.probe(device))
		device->driver.ops = &vfio_cxl_gpu_ops;
}

static void __attribute__((constructor)) vfio_cxl_iommu_mode(void)
{
	const char *mode = getenv("VFIO_SELFTESTS_IOMMU_MODE");

	if (mode && *mode)
		default_iommu_mode = mode;
}
