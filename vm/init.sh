#!/bin/busybox sh
# PID 1 of the test VM (busybox, in the initramfs that vmrun.py builds).
# Loads the 9p modules, mounts the host's root read-only with the usual
# pseudo file systems, mounts the --rw shares, runs the job in a chroot,
# writes the kernel log and the exit status to the job share (a 9p export
# of the runner's temporary directory; the console is slow under TCG),
# prints the status on the console too, and powers off whatever happens.
/bin/busybox mkdir -p /bin /proc /sys /dev /mnt/root
/bin/busybox --install -s /bin
export PATH=/bin
trap 'poweroff -f' EXIT

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

# /job.sh (a second cpio appended per run) defines GF_NONCE, gf_rw_mounts
# and gf_run.
. /job.sh

gf_die() {
	echo "===GF-$GF_NONCE-INIT-FAILED: $*==="
	exit 1
}

for m in $(cat /modules/order); do
	insmod "/modules/$m" || gf_die "insmod $m"
done

mkdir -p /gfjob
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 gfjob /gfjob ||
	gf_die "mount the job share over 9p"

R=/mnt/root
# cache=loose: the share is read-only and nothing on it changes under a
# test, so caching metadata and pages halves Python's start-up under TCG.
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=512000 hostroot $R ||
	gf_die "mount hostroot over 9p"
mount -t proc proc $R/proc
mount -t sysfs sysfs $R/sys
mount -t devtmpfs devtmpfs $R/dev
mkdir -p $R/dev/pts $R/dev/shm
mount -t devpts devpts $R/dev/pts
mount -t tmpfs tmpfs $R/dev/shm
mount -t tmpfs tmpfs $R/tmp
mount -t tmpfs tmpfs $R/run
# GF_BARE=1 (vmrun --bare): a new machine's state, nothing but proc, sys
# and dev (and the tmpfs a read-only root needs to be writable at all).
if [ "$GF_BARE" != 1 ]; then
	mount -t tracefs tracefs $R/sys/kernel/tracing
	mount -t debugfs debugfs $R/sys/kernel/debug
	mount -t bpf bpf $R/sys/fs/bpf
	mount -t cgroup2 cgroup2 $R/sys/fs/cgroup
fi
ip link set lo up

# A read-write share at the same path as on the host. Under /tmp the path
# has to be created first in the guest's tmpfs.
gf_mount_rw() {
	mkdir -p "$R$2" 2>/dev/null
	mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 "$1" "$R$2" ||
		gf_die "mount $2 read-write over 9p"
}
gf_rw_mounts

# GF_SERVE=1 (vm/guest.py): a guest shared by several jobs. The shares
# were mounted under /gfshare by gf_rw_mounts; each job is
# /gfjob/jobs/N.sh (its GF_NONCE, gf_rw_mounts binding what it needs of
# the shares, gf_run), started by "N" on the console, run with fresh /tmp,
# /run, /dev/shm and bpffs, and followed by a clean-up that kills what it
# left running, removes its trace events and the modules it loaded (named
# in N.left), and unmounts its mounts; its kernel log goes to N.dmesg.
if [ "$GF_SERVE" = 1 ]; then
	. /serve.sh
	gf_serve
	exit 0
fi

echo "===GF-$GF_NONCE-START==="
(gf_run) </dev/null 2>&1
rc=$?
echo "===GF-$GF_NONCE-END==="
sync
dmesg >/gfjob/dmesg
echo "$rc" >/gfjob/rc
# poweroff -f does not wait for the 9p writes above: flush them first.
sync
echo "===GF-$GF_NONCE-EXIT=$rc==="
