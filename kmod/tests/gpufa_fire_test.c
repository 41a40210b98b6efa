// SPDX-License-Identifier: GPL-2.0
/*
 * gpufa_fire_test: a test double of a cooperating driver. On load it calls
 * gpufa_fire() once for the given device, as a GPU driver would on an Xid,
 * and stays loaded doing nothing else.
 *
 * usage: insmod gpufa_fire_test.ko devices=0000:01:01.0 code=79
 */

#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/module.h>
#include <linux/pci.h>

#include "gpufa.h"

static char *devices;
module_param(devices, charp, 0444);
MODULE_PARM_DESC(devices, "The device to fire for, dddd:bb:dd.f");

static int code;
module_param(code, int, 0444);
MODULE_PARM_DESC(code, "The code passed to gpufa_fire()");

static int __init fire_test_init(void)
{
	unsigned int dom, bus, slot, fn;
	struct pci_dev *pdev;
	int ret;

	if (!devices || sscanf(devices, "%x:%x:%x.%x", &dom, &bus, &slot, &fn) != 4)
		return -EINVAL;
	pdev = pci_get_domain_bus_and_slot(dom, bus, PCI_DEVFN(slot, fn));
	if (!pdev)
		return -ENODEV;
	ret = gpufa_fire(pdev, code);
	pci_dev_put(pdev);
	pr_info("gpufa_fire(%s, %d) = %d\n", devices, code, ret);
	return ret;
}

static void __exit fire_test_exit(void)
{
}

module_init(fire_test_init);
module_exit(fire_test_exit);

MODULE_DESCRIPTION("Test double of a driver that calls gpufa_fire()");
MODULE_LICENSE("GPL");
