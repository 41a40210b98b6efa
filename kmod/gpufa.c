// SPDX-License-Identifier: GPL-2.0
/*
 * gpufa: GPU fault anchors.
 *
 * Records what happens to watched PCI devices below the user-space
 * libraries: function reset begin and end, the device falling off the bus,
 * AER errors, a cooperating driver's gpufa_fire() and a manual fire. Each
 * anchor is one fixed-size record (uapi/gpufa.h) with a PCI config space
 * snapshot, the AER registers and a list of BAR0 registers, read through
 * /dev/gpufa and traced as gpufa:anchor.
 *
 * usage: insmod gpufa.ko [devices=0000:01:00.0,...] [bar0=0x0,0x4,...]
 *			  [watchdog_ms=1000] [fifo_records=64] [allow_reset=1]
 *
 * With no devices= every NVIDIA display/3D class device is watched.
 */

#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/atomic.h>
#include <linux/device.h>
#include <linux/fs.h>
#include <linux/io.h>
#include <linux/kfifo.h>
#include <linux/kprobes.h>
#include <linux/miscdevice.h>
#include <linux/module.h>
#include <linux/mutex.h>
#include <linux/pci.h>
#include <linux/poll.h>
#include <linux/sched.h>
#include <linux/sizes.h>
#include <linux/slab.h>
#include <linux/spinlock.h>
#include <linux/string.h>
#include <linux/timekeeping.h>
#include <linux/tracepoint.h>
#include <linux/uaccess.h>
#include <linux/wait.h>
#include <linux/workqueue.h>

#include "uapi/gpufa.h"
#include "gpufa.h"

#define CREATE_TRACE_POINTS
#include "gpufa_trace.h"

#define GPUFA_MAX_DEVS 16
#define NV_VENDOR 0x10de
#define NV_BOOT_0 0x0
#define NV_BOOT_42 0xa00

static char *devices;
module_param(devices, charp, 0444);
MODULE_PARM_DESC(devices,
		 "PCI devices to watch, comma-separated [dddd:]bb:dd.f (default: every NVIDIA display/3D device)");

static char *bar0 = "0x0,0x4,0xa00,0x200,0x9400,0x9410";
module_param(bar0, charp, 0444);
MODULE_PARM_DESC(bar0,
		 "BAR0 offsets to read per record, comma-separated, 4-byte aligned, at most 16 (default: NVIDIA PMC_BOOT_0/1/42, PMC_ENABLE, PTIMER)");

static unsigned int watchdog_ms = 1000;
module_param(watchdog_ms, uint, 0444);
MODULE_PARM_DESC(watchdog_ms,
		 "Period of the device-gone check in ms, 0 = off, else 10..3600000 (default 1000)");

static unsigned int fifo_records = 64;
module_param(fifo_records, uint, 0444);
MODULE_PARM_DESC(fifo_records,
		 "Records the fifo holds, 2..4096, rounded up to a power of two (default 64)");

static bool allow_reset;
module_param(allow_reset, bool, 0444);
MODULE_PARM_DESC(allow_reset,
		 "Allow GPUFA_IOC_RESET to run a real function reset (default off)");

/* One watched device; the list is fixed at load time. */
struct gpufa_dev {
	struct pci_dev *pdev;	/* a reference held until unload */
	void __iomem *bar0;	/* NULL: BAR0 not mapped */
	resource_size_t bar0_len;
	u16 vendor;
	u16 device;
	u16 aer_pos;
	u16 pcie_pos;
	unsigned int ones;	/* watchdog: all-ones checks in a row */
	bool gone;		/* the watchdog found it gone; report once */
};

struct gpufa {
	struct miscdevice misc;
	spinlock_t lock;	/* fifo producers, ctx, counters */
	struct mutex read_lock;	/* the fifo's single consumer */
	wait_queue_head_t wq;
	DECLARE_KFIFO_PTR(fifo, struct gpufa_record);
	u64 records;
	u64 overflow;
	u64 nomem;
	atomic64_t own_seq;	/* fault IDs the module makes (run_id 0) */
	struct gpufa_ctx ctx;	/* active fault context, fault_seq 0 = none */
	struct file *ctx_owner;	/* cleared when this file is closed */
	struct delayed_work watchdog;
	struct gpufa_dev devs[GPUFA_MAX_DEVS];
	unsigned int ndevs;
	u32 bar0_off[GPUFA_MAX_BAR0];
	unsigned int bar0_nr;
	unsigned int nkprobes;
	bool aer_hooked;
};

static struct gpufa gpufa;

static struct gpufa *to_gpufa(struct file *file)
{
	return container_of(file->private_data, struct gpufa, misc);
}

static struct gpufa_dev *find_dev(struct gpufa *g, const struct pci_dev *pdev)
{
	unsigned int i;

	for (i = 0; i < g->ndevs; i++)
		if (g->devs[i].pdev == pdev)
			return &g->devs[i];
	return NULL;
}

static struct gpufa_dev *find_bdf(struct gpufa *g, u32 domain, u8 bus,
				  u8 devfn)
{
	unsigned int i;

	for (i = 0; i < g->ndevs; i++) {
		struct pci_dev *p = g->devs[i].pdev;

		if (pci_domain_nr(p->bus) == domain && p->bus->number == bus &&
		    p->devfn == devfn)
			return &g->devs[i];
	}
	return NULL;
}

/* The fault ID for a new anchor: the active context's, else our own. */
static void take_fault_id(struct gpufa *g, struct gpufa_record *rec)
{
	unsigned long flags;

	spin_lock_irqsave(&g->lock, flags);
	if (g->ctx.fault_seq) {
		rec->fault_seq = g->ctx.fault_seq;
		rec->run_id = g->ctx.run_id;
		rec->ctx_pid = g->ctx.pid;
		rec->flags |= GPUFA_REC_CTX;
	}
	spin_unlock_irqrestore(&g->lock, flags);
	if (!rec->fault_seq)
		rec->fault_seq = atomic64_inc_return(&g->own_seq);
}

/*
 * Fill the snapshot part of a record. Callable from atomic context: config
 * reads take only the PCI config raw spinlock and MMIO reads do not sleep.
 */
static void snapshot(struct gpufa *g, struct gpufa_dev *d,
		     struct gpufa_record *rec)
{
	struct pci_dev *pdev = d->pdev;
	u32 *cfg = (u32 *)rec->config;
	bool cfg_ok, mem_on;
	unsigned int i;

	rec->domain = pci_domain_nr(pdev->bus);
	rec->bus = pdev->bus->number;
	rec->devfn = pdev->devfn;
	rec->vendor = d->vendor;
	rec->device = d->device;

	for (i = 0; i < GPUFA_CFG_SIZE / 4; i++)
		if (pci_read_config_dword(pdev, i * 4, &cfg[i]))
			cfg[i] = ~0U;
	/* A device that stopped answering reads all ones, vendor ID first. */
	cfg_ok = cfg[0] != ~0U && !d->gone;
	if (cfg_ok)
		rec->flags |= GPUFA_REC_CFG_OK;

	if (cfg_ok && d->pcie_pos) {
		pci_read_config_word(pdev, d->pcie_pos + PCI_EXP_DEVSTA,
				     &rec->devsta);
		rec->flags |= GPUFA_REC_PCIE;
	}
	if (cfg_ok && d->aer_pos) {
		rec->aer_pos = d->aer_pos;
		for (i = 0; i < GPUFA_AER_REGS; i++)
			pci_read_config_dword(pdev, d->aer_pos + 4 + i * 4,
					      &rec->aer[i]);
		rec->flags |= GPUFA_REC_AER_CAP;
	}

	/*
	 * Read BAR0 only while the device answers config cycles with memory
	 * decoding on: after a removal the range may belong to another device.
	 */
	mem_on = cfg_ok && (cfg[PCI_COMMAND / 4] & PCI_COMMAND_MEMORY);
	rec->bar0_nr = g->bar0_nr;
	for (i = 0; i < g->bar0_nr; i++) {
		rec->bar0_off[i] = g->bar0_off[i];
		rec->bar0_val[i] = GPUFA_BAR0_UNREAD;
		if (!mem_on || !d->bar0 || g->bar0_off[i] + 4 > d->bar0_len)
			continue;
		rec->bar0_val[i] = ioread32(d->bar0 + g->bar0_off[i]);
		rec->bar0_ok |= 1U << i;
	}
}

/* Queue a finished record, wake readers, emit the tracepoint. */
static void emit(struct gpufa *g, struct gpufa_record *rec)
{
	unsigned long flags;

	rec->version = GPUFA_ABI_VERSION;
	rec->size = sizeof(*rec);
	rec->mono_ns = ktime_get_ns();
	rec->wall_ns = ktime_get_real_ns();
	rec->pid = task_tgid_nr(current);
	/* No task_lock: gpufa_fire() may run in hard interrupt context. */
	strscpy_pad(rec->comm, current->comm, sizeof(rec->comm));

	spin_lock_irqsave(&g->lock, flags);
	rec->rec_seq = ++g->records;
	/* Drop the newest when full: readers keep a gap-free prefix. */
	if (!kfifo_in(&g->fifo, rec, 1))
		g->overflow++;
	spin_unlock_irqrestore(&g->lock, flags);

	trace_anchor(rec);
	wake_up_interruptible(&g->wq);
}

static struct gpufa_record *new_record(struct gpufa *g, u32 kind, gfp_t gfp)
{
	struct gpufa_record *rec = kzalloc(sizeof(*rec), gfp);
	unsigned long flags;

	if (!rec) {
		spin_lock_irqsave(&g->lock, flags);
		g->records++;
		g->nomem++;
		spin_unlock_irqrestore(&g->lock, flags);
		return NULL;
	}
	rec->kind = kind;
	return rec;
}

/* Make one record for a watched device; the fault ID is given or taken. */
static int anchor(struct gpufa *g, struct gpufa_dev *d, u32 kind, s32 code,
		  const struct gpufa_record *id, gfp_t gfp)
{
	struct gpufa_record *rec = new_record(g, kind, gfp);

	if (!rec)
		return -ENOMEM;
	if (id) {
		rec->fault_seq = id->fault_seq;
		rec->run_id = id->run_id;
		rec->ctx_pid = id->ctx_pid;
		rec->flags = id->flags & GPUFA_REC_CTX;
	} else {
		take_fault_id(g, rec);
	}
	rec->code = code;
	snapshot(g, d, rec);
	emit(g, rec);
	kfree(rec);
	return 0;
}

/**
 * gpufa_fire() - record an anchor for a watched device from a driver
 * @pdev: the device
 * @code: a driver-defined code kept in the record (an Xid, for example)
 *
 * Any context; does not sleep.
 *
 * Return: 0, -ENODEV if @pdev is not watched, -ENOMEM.
 */
int gpufa_fire(struct pci_dev *pdev, s32 code)
{
	struct gpufa_dev *d = find_dev(&gpufa, pdev);

	if (!d)
		return -ENODEV;
	return anchor(&gpufa, d, GPUFA_ANCHOR_DRIVER, code, NULL, GFP_ATOMIC);
}
EXPORT_SYMBOL_GPL(gpufa_fire);

/* ---- function reset: kretprobes on the kernel's reset entry points ---- */

#ifdef CONFIG_KRETPROBES
struct reset_data {
	struct gpufa_dev *dev;	/* NULL: not a watched device */
	struct gpufa_record id;	/* only the fault ID fields are used */
};

static int reset_entry(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	struct reset_data *rd = (struct reset_data *)ri->data;
	struct pci_dev *pdev;
	struct gpufa_record *rec;

	pdev = (struct pci_dev *)regs_get_kernel_argument(regs, 0);
	rd->dev = find_dev(&gpufa, pdev);
	if (!rd->dev)
		return 1;	/* not ours: no return handler */

	memset(&rd->id, 0, sizeof(rd->id));
	rec = new_record(&gpufa, GPUFA_ANCHOR_RESET_BEGIN, GFP_ATOMIC);
	if (!rec) {
		/* Still give the end record an ID of its own. */
		take_fault_id(&gpufa, &rd->id);
		return 0;
	}
	take_fault_id(&gpufa, rec);
	rd->id.fault_seq = rec->fault_seq;
	rd->id.run_id = rec->run_id;
	rd->id.ctx_pid = rec->ctx_pid;
	rd->id.flags = rec->flags;
	snapshot(&gpufa, rd->dev, rec);
	emit(&gpufa, rec);
	kfree(rec);
	return 0;
}

static int reset_return(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	struct reset_data *rd = (struct reset_data *)ri->data;

	/* The code is the reset's return value: 0 or a negative errno. */
	anchor(&gpufa, rd->dev, GPUFA_ANCHOR_RESET_END,
	       (s32)regs_return_value(regs), &rd->id, GFP_ATOMIC);
	return 0;
}

#define RESET_PROBE(fn) {					\
	.kp.symbol_name = fn,					\
	.entry_handler = reset_entry,				\
	.handler = reset_return,				\
	.data_size = sizeof(struct reset_data),			\
	.maxactive = 8,						\
}

/* Separate entry points: none of them calls another. */
static struct kretprobe reset_probes[] = {
	RESET_PROBE("pci_reset_function"),
	RESET_PROBE("pci_reset_function_locked"),
	RESET_PROBE("pci_try_reset_function"),
};

static void reset_probes_register(struct gpufa *g)
{
	unsigned int i;
	int ret;

	for (i = 0; i < ARRAY_SIZE(reset_probes); i++) {
		ret = register_kretprobe(&reset_probes[i]);
		if (ret) {
			pr_warn("no reset anchor on %s: %d\n",
				reset_probes[i].kp.symbol_name, ret);
			reset_probes[i].kp.addr = NULL;
			continue;
		}
		g->nkprobes++;
	}
}

static void reset_probes_unregister(struct gpufa *g)
{
	unsigned int i;

	for (i = 0; i < ARRAY_SIZE(reset_probes); i++)
		if (reset_probes[i].kp.addr)
			unregister_kretprobe(&reset_probes[i]);
	g->nkprobes = 0;
}

static u64 reset_probes_missed(void)
{
	u64 n = 0;
	unsigned int i;

	for (i = 0; i < ARRAY_SIZE(reset_probes); i++)
		if (reset_probes[i].kp.addr)
			n += reset_probes[i].nmissed;
	return n;
}
#else
static void reset_probes_register(struct gpufa *g)
{
	pr_info("kernel has no kretprobes: no reset anchors\n");
}

static void reset_probes_unregister(struct gpufa *g)
{
}

static u64 reset_probes_missed(void)
{
	return 0;
}
#endif /* CONFIG_KRETPROBES */

/* ---- AER: a probe on the kernel's aer_event tracepoint ---- */

static struct tracepoint *aer_tp;

/*
 * aer_event as of 5.15..6.x; 7.x appends a bus_type argument, which is
 * ignored here (the calling convention allows it; clang kCFI would not).
 */
static void aer_probe(void *data, const char *dev_name, const u32 status,
		      const u8 severity, const u8 tlp_header_valid,
		      const void *tlp)
{
	struct gpufa *g = data;
	unsigned int i;

	for (i = 0; i < g->ndevs; i++)
		if (!strcmp(pci_name(g->devs[i].pdev), dev_name))
			anchor(g, &g->devs[i], GPUFA_ANCHOR_AER,
			       (s32)status, NULL, GFP_ATOMIC);
}

static void find_aer_tp(struct tracepoint *tp, void *priv)
{
	if (!strcmp(tp->name, "aer_event"))
		*(struct tracepoint **)priv = tp;
}

static void aer_hook(struct gpufa *g)
{
	for_each_kernel_tracepoint(find_aer_tp, &aer_tp);
	if (!aer_tp) {
		pr_info("kernel has no aer_event tracepoint: no AER anchors\n");
		return;
	}
	if (tracepoint_probe_register(aer_tp, aer_probe, g)) {
		pr_warn("cannot hook aer_event: no AER anchors\n");
		aer_tp = NULL;
		return;
	}
	g->aer_hooked = true;
}

static void aer_unhook(struct gpufa *g)
{
	if (!aer_tp)
		return;
	tracepoint_probe_unregister(aer_tp, aer_probe, g);
	/* No probe may still run when the module text goes away. */
	tracepoint_synchronize_unregister();
	aer_tp = NULL;
	g->aer_hooked = false;
}

/* ---- watchdog: the "fallen off the bus" check ---- */

/* All ones from config space, or from NVIDIA's BOOT_0 and BOOT_42. */
static bool reads_ones(struct gpufa_dev *d)
{
	u32 id, boot0, boot42;

	if (pci_read_config_dword(d->pdev, PCI_VENDOR_ID, &id) || id == ~0U)
		return true;
	if (d->vendor != NV_VENDOR || !d->bar0 || d->bar0_len <= NV_BOOT_42)
		return false;
	boot0 = ioread32(d->bar0 + NV_BOOT_0);
	boot42 = ioread32(d->bar0 + NV_BOOT_42);
	return boot0 == ~0U && boot42 == ~0U;
}

/*
 * A device in the middle of a reset also reads all ones for a while; every
 * reset path holds the device lock, so look only when it is free, and call
 * the device gone after two all-ones checks in a row.
 */
static bool dev_gone(struct gpufa_dev *d)
{
	bool ones;

	if (!device_trylock(&d->pdev->dev))
		return false;
	ones = reads_ones(d);
	device_unlock(&d->pdev->dev);
	d->ones = ones ? d->ones + 1 : 0;
	return d->ones >= 2;
}

static void watchdog_fn(struct work_struct *work)
{
	struct gpufa *g = container_of(to_delayed_work(work), struct gpufa,
				       watchdog);
	unsigned int i;

	for (i = 0; i < g->ndevs; i++) {
		struct gpufa_dev *d = &g->devs[i];

		if (READ_ONCE(d->gone) || !dev_gone(d))
			continue;
		pr_warn("%s: device gone (config space or BOOT_0/42 all ones)\n",
			pci_name(d->pdev));
		WRITE_ONCE(d->gone, true);
		anchor(g, d, GPUFA_ANCHOR_GONE, 0, NULL, GFP_KERNEL);
	}
	schedule_delayed_work(&g->watchdog, msecs_to_jiffies(watchdog_ms));
}

/* ---- /dev/gpufa ---- */

static int gpufa_open(struct inode *inode, struct file *file)
{
	return stream_open(inode, file);
}

static int gpufa_release(struct inode *inode, struct file *file)
{
	struct gpufa *g = to_gpufa(file);
	unsigned long flags;

	/* A controller that dies leaves no stale fault context behind. */
	spin_lock_irqsave(&g->lock, flags);
	if (g->ctx_owner == file) {
		memset(&g->ctx, 0, sizeof(g->ctx));
		g->ctx_owner = NULL;
	}
	spin_unlock_irqrestore(&g->lock, flags);
	return 0;
}

static ssize_t gpufa_read(struct file *file, char __user *buf, size_t count,
			  loff_t *ppos)
{
	struct gpufa *g = to_gpufa(file);
	unsigned int copied;
	int ret;

	if (count < sizeof(struct gpufa_record))
		return -EINVAL;
	count -= count % sizeof(struct gpufa_record);

	for (;;) {
		if (mutex_lock_interruptible(&g->read_lock))
			return -ERESTARTSYS;
		if (!kfifo_is_empty(&g->fifo))
			break;
		mutex_unlock(&g->read_lock);
		if (file->f_flags & O_NONBLOCK)
			return -EAGAIN;
		if (wait_event_interruptible(g->wq, !kfifo_is_empty(&g->fifo)))
			return -ERESTARTSYS;
	}
	/* One consumer at a time; producers only kfifo_in under g->lock. */
	ret = kfifo_to_user(&g->fifo, buf, count, &copied);
	mutex_unlock(&g->read_lock);
	return ret ? ret : copied;
}

static __poll_t gpufa_poll(struct file *file, poll_table *wait)
{
	struct gpufa *g = to_gpufa(file);

	poll_wait(file, &g->wq, wait);
	return kfifo_is_empty(&g->fifo) ? 0 : EPOLLIN | EPOLLRDNORM;
}

static int ioc_set_ctx(struct gpufa *g, struct file *file, void __user *arg)
{
	struct gpufa_ctx ctx;
	unsigned long flags;

	if (copy_from_user(&ctx, arg, sizeof(ctx)))
		return -EFAULT;
	if (!ctx.fault_seq || !ctx.run_id)
		return -EINVAL;
	if (!ctx.pid)
		ctx.pid = task_tgid_nr(current);
	spin_lock_irqsave(&g->lock, flags);
	g->ctx = ctx;
	g->ctx_owner = file;
	spin_unlock_irqrestore(&g->lock, flags);
	return 0;
}

static void ioc_clear_ctx(struct gpufa *g)
{
	unsigned long flags;

	spin_lock_irqsave(&g->lock, flags);
	memset(&g->ctx, 0, sizeof(g->ctx));
	g->ctx_owner = NULL;
	spin_unlock_irqrestore(&g->lock, flags);
}

static int ioc_target(struct gpufa *g, void __user *arg,
		      struct gpufa_fire *f, struct gpufa_dev **d)
{
	if (copy_from_user(f, arg, sizeof(*f)))
		return -EFAULT;
	if (f->pad || (f->flags & ~GPUFA_FIRE_ANY))
		return -EINVAL;
	if (f->flags & GPUFA_FIRE_ANY)
		*d = g->ndevs ? &g->devs[0] : NULL;
	else
		*d = find_bdf(g, f->domain, f->bus, f->devfn);
	return *d ? 0 : -ENODEV;
}

static int ioc_fire(struct gpufa *g, void __user *arg)
{
	struct gpufa_fire f;
	struct gpufa_dev *d;
	int ret = ioc_target(g, arg, &f, &d);

	if (ret)
		return ret;
	return anchor(g, d, GPUFA_ANCHOR_MANUAL, f.code, NULL, GFP_KERNEL);
}

static int ioc_reset(struct gpufa *g, void __user *arg)
{
	struct gpufa_fire f;
	struct gpufa_dev *d;
	int ret;

	if (!allow_reset)
		return -EPERM;
	ret = ioc_target(g, arg, &f, &d);
	if (ret)
		return ret;
	if (READ_ONCE(d->gone))
		return -ENODEV;
	/* Goes through pci_reset_function, so the reset anchors fire. */
	return pci_reset_function(d->pdev);
}

static int ioc_stats(struct gpufa *g, void __user *arg)
{
	struct gpufa_stats st = {};
	unsigned long flags;
	unsigned int i;

	spin_lock_irqsave(&g->lock, flags);
	st.records = g->records;
	st.overflow = g->overflow;
	st.nomem = g->nomem;
	spin_unlock_irqrestore(&g->lock, flags);
	st.rp_missed = reset_probes_missed();
	st.queued = kfifo_len(&g->fifo);
	st.capacity = kfifo_size(&g->fifo);
	st.devices = g->ndevs;
	for (i = 0; i < g->ndevs; i++)
		st.gone += READ_ONCE(g->devs[i].gone);
	st.kprobes = g->nkprobes;
	st.aer_hooked = g->aer_hooked;
	return copy_to_user(arg, &st, sizeof(st)) ? -EFAULT : 0;
}

static long gpufa_ioctl(struct file *file, unsigned int cmd,
			unsigned long arg)
{
	struct gpufa *g = to_gpufa(file);
	void __user *uarg = (void __user *)arg;

	switch (cmd) {
	case GPUFA_IOC_SET_CTX:
		return ioc_set_ctx(g, file, uarg);
	case GPUFA_IOC_CLEAR_CTX:
		ioc_clear_ctx(g);
		return 0;
	case GPUFA_IOC_FIRE:
		return ioc_fire(g, uarg);
	case GPUFA_IOC_STATS:
		return ioc_stats(g, uarg);
	case GPUFA_IOC_RESET:
		return ioc_reset(g, uarg);
	default:
		return -ENOTTY;
	}
}

static const struct file_operations gpufa_fops = {
	.owner = THIS_MODULE,
	.open = gpufa_open,
	.release = gpufa_release,
	.read = gpufa_read,
	.poll = gpufa_poll,
	.unlocked_ioctl = gpufa_ioctl,
	.compat_ioctl = compat_ptr_ioctl,
};

/* ---- parameters and devices ---- */

static int parse_bar0(struct gpufa *g)
{
	char *buf, *cur, *tok;
	int ret = 0;
	u32 off;

	if (!bar0 || !*bar0)
		return 0;
	buf = kstrdup(bar0, GFP_KERNEL);
	if (!buf)
		return -ENOMEM;
	cur = buf;
	while ((tok = strsep(&cur, ",")) != NULL) {
		tok = strim(tok);
		if (!*tok)
			continue;
		if (kstrtou32(tok, 0, &off) || off % 4 || off >= SZ_16M) {
			pr_err("bar0=%s: '%s' is not a 4-byte aligned offset below 16M\n",
			       bar0, tok);
			ret = -EINVAL;
			break;
		}
		if (g->bar0_nr == GPUFA_MAX_BAR0) {
			pr_err("bar0=%s: at most %d offsets\n", bar0,
			       GPUFA_MAX_BAR0);
			ret = -EINVAL;
			break;
		}
		g->bar0_off[g->bar0_nr++] = off;
	}
	kfree(buf);
	return ret;
}

static int watch(struct gpufa *g, struct pci_dev *pdev)
{
	struct gpufa_dev *d;
	resource_size_t maxlen = 4;
	unsigned int i;

	if (find_dev(g, pdev)) {
		pci_dev_put(pdev);
		return 0;	/* listed twice */
	}
	if (g->ndevs == GPUFA_MAX_DEVS) {
		pr_err("at most %d devices\n", GPUFA_MAX_DEVS);
		pci_dev_put(pdev);
		return -E2BIG;
	}
	d = &g->devs[g->ndevs++];
	d->pdev = pdev;
	d->vendor = pdev->vendor;
	d->device = pdev->device;
	d->pcie_pos = pci_pcie_cap(pdev);
	d->aer_pos = pci_find_ext_capability(pdev, PCI_EXT_CAP_ID_ERR);

	/* Map only as much of BAR0 as the offsets need. */
	for (i = 0; i < g->bar0_nr; i++)
		maxlen = max_t(resource_size_t, maxlen, g->bar0_off[i] + 4);
	d->bar0_len = pci_resource_len(pdev, 0);
	if (g->bar0_nr && (pci_resource_flags(pdev, 0) & IORESOURCE_MEM) &&
	    d->bar0_len) {
		d->bar0_len = min(d->bar0_len, maxlen);
		d->bar0 = pci_iomap(pdev, 0, d->bar0_len);
	}
	if (!d->bar0)
		d->bar0_len = 0;
	pr_info("watching %s [%04x:%04x]%s%s\n", pci_name(pdev), d->vendor,
		d->device, d->bar0 ? "" : " (BAR0 not mapped)",
		d->aer_pos ? " AER" : "");
	return 0;
}

static int watch_listed(struct gpufa *g)
{
	char *buf, *cur, *tok;
	unsigned int dom, bus, slot, fn;
	struct pci_dev *pdev;
	int ret = 0;
	char c;

	buf = kstrdup(devices, GFP_KERNEL);
	if (!buf)
		return -ENOMEM;
	cur = buf;
	while ((tok = strsep(&cur, ",")) != NULL) {
		tok = strim(tok);
		if (!*tok)
			continue;
		if (sscanf(tok, "%x:%x:%x.%x%c", &dom, &bus, &slot, &fn, &c) != 4) {
			dom = 0;
			if (sscanf(tok, "%x:%x.%x%c", &bus, &slot, &fn, &c) != 3) {
				pr_err("devices=%s: '%s' is not [dddd:]bb:dd.f\n",
				       devices, tok);
				ret = -EINVAL;
				break;
			}
		}
		if (dom > 0xffff || bus > 0xff || slot > 0x1f || fn > 7) {
			pr_err("devices=%s: '%s' is out of range\n", devices, tok);
			ret = -EINVAL;
			break;
		}
		pdev = pci_get_domain_bus_and_slot(dom, bus, PCI_DEVFN(slot, fn));
		if (!pdev) {
			pr_err("devices=%s: no PCI device %s\n", devices, tok);
			ret = -ENODEV;
			break;
		}
		ret = watch(g, pdev);
		if (ret)
			break;
	}
	kfree(buf);
	return ret;
}

static int watch_nvidia(struct gpufa *g)
{
	struct pci_dev *pdev = NULL;
	int ret;

	while ((pdev = pci_get_device(NV_VENDOR, PCI_ANY_ID, pdev)) != NULL) {
		if ((pdev->class >> 16) != PCI_BASE_CLASS_DISPLAY)
			continue;
		/* watch() keeps this reference; pci_get_device drops the old. */
		ret = watch(g, pci_dev_get(pdev));
		if (ret) {
			pci_dev_put(pdev);
			return ret;
		}
	}
	if (!g->ndevs)
		pr_info("no NVIDIA display device: watching nothing\n");
	return 0;
}

static void unwatch_all(struct gpufa *g)
{
	while (g->ndevs) {
		struct gpufa_dev *d = &g->devs[--g->ndevs];

		if (d->bar0)
			pci_iounmap(d->pdev, d->bar0);
		pci_dev_put(d->pdev);
		memset(d, 0, sizeof(*d));
	}
}

static int check_params(void)
{
	if (watchdog_ms && (watchdog_ms < 10 || watchdog_ms > 3600000)) {
		pr_err("watchdog_ms=%u: use 0 (off) or 10..3600000\n",
		       watchdog_ms);
		return -EINVAL;
	}
	if (fifo_records < 2 || fifo_records > 4096) {
		pr_err("fifo_records=%u: use 2..4096\n", fifo_records);
		return -EINVAL;
	}
	return 0;
}

static int __init gpufa_init(void)
{
	struct gpufa *g = &gpufa;
	int ret;

	ret = check_params();
	if (ret)
		return ret;

	spin_lock_init(&g->lock);
	mutex_init(&g->read_lock);
	init_waitqueue_head(&g->wq);
	atomic64_set(&g->own_seq, 0);
	INIT_DELAYED_WORK(&g->watchdog, watchdog_fn);

	ret = parse_bar0(g);
	if (ret)
		return ret;
	ret = devices && *devices ? watch_listed(g) : watch_nvidia(g);
	if (ret)
		goto err_unwatch;

	ret = kfifo_alloc(&g->fifo, fifo_records, GFP_KERNEL);
	if (ret)
		goto err_unwatch;

	g->misc.minor = MISC_DYNAMIC_MINOR;
	g->misc.name = "gpufa";
	g->misc.fops = &gpufa_fops;
	g->misc.mode = 0600;
	ret = misc_register(&g->misc);
	if (ret)
		goto err_free_fifo;

	reset_probes_register(g);
	aer_hook(g);
	if (watchdog_ms)
		schedule_delayed_work(&g->watchdog, msecs_to_jiffies(watchdog_ms));

	pr_info("%u device(s), %u reset probe(s), AER %s, %u-record fifo, record %zu bytes\n",
		g->ndevs, g->nkprobes, g->aer_hooked ? "on" : "off",
		kfifo_size(&g->fifo), sizeof(struct gpufa_record));
	return 0;

err_free_fifo:
	kfifo_free(&g->fifo);
err_unwatch:
	unwatch_all(g);
	return ret;
}

static void __exit gpufa_exit(void)
{
	struct gpufa *g = &gpufa;

	/* No file is open (fops.owner pins the module); stop new ones. */
	misc_deregister(&g->misc);
	/* Then every producer, before what they write into goes away. */
	reset_probes_unregister(g);
	aer_unhook(g);
	cancel_delayed_work_sync(&g->watchdog);
	kfifo_free(&g->fifo);
	unwatch_all(g);
}

module_init(gpufa_init);
module_exit(gpufa_exit);

MODULE_DESCRIPTION("GPU fault anchors: PCI reset, device-gone, AER and driver records");
MODULE_AUTHOR("gpufault");
MODULE_LICENSE("GPL");
