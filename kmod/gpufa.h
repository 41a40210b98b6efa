/* SPDX-License-Identifier: GPL-2.0 */
/*
 * gpufa: the in-kernel interface for cooperating drivers.
 *
 * A driver that sees trouble on a device (an Xid, a timeout) calls
 * gpufa_fire(pdev, code): if gpufa watches the device, one DRIVER record
 * with the device's snapshot and the code is made. Any context but NMI.
 */
#ifndef _GPUFA_H
#define _GPUFA_H

#include <linux/pci.h>

int gpufa_fire(struct pci_dev *pdev, s32 code);

#endif /* _GPUFA_H */
