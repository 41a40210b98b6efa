#!/bin/busybox sh
# The job loop of a shared guest (vm/guest.py), sourced by vm/init.sh as
# PID 1 when GF_SERVE=1, after every mount of a one-job guest. The host
# writes /gfjob/jobs/N.sh, then "N" on the serial console; the loop runs
# the job between its markers and cleans up after it, so that the next
# job finds the guest as booted.

R=/mnt/root
GF_BOUND=""

# A share (mounted at /gfshare/I at boot) or part of it, at the host's path.
gf_bind_rw() {
	mkdir -p "$R$2" 2>/dev/null
	mount --bind "$1" "$R$2" || return 1
	GF_BOUND="$R$2 $GF_BOUND"
}

# Whether a process other than PID 1 and kernel threads is left (a kernel
# thread has no exe link; neither has a zombie).
gf_others() {
	for p in /proc/[0-9]*; do
		[ "$p" = /proc/1 ] && continue
		[ -e "$p/exe" ] && return 0
	done
	return 1
}

gf_cleanup() {
	# Everything the job left running (kill -1 spares PID 1), then wait
	# for it to be gone, with a deadline: a process stuck in the kernel
	# must not hold the next job forever.
	kill -9 -1 2>/dev/null
	i=0
	while gf_others && [ $i -lt 100 ]; do
		sleep 0.05
		i=$((i + 1))
	done
	gf_others && echo "processes still alive after SIGKILL" >>"$1"
	T=$R/sys/kernel/tracing
	if [ -d "$T/events" ]; then
		echo 0 >"$T/events/enable" 2>/dev/null
		: >"$T/trace" 2>/dev/null
		: >"$T/uprobe_events" 2>/dev/null
		: >"$T/kprobe_events" 2>/dev/null
		for d in "$T"/instances/*; do
			[ -d "$d" ] && rmdir "$d" 2>/dev/null
		done
	fi
	# /proc/modules lists the newest first: dependents go before what they
	# use. Read whole before the first rmmod changes it.
	now=""
	while read -r m _; do now="$now $m"; done </proc/modules
	for m in $now; do
		case " $2 " in
		*" $m "*) ;;
		*) if rmmod "$m" 2>/dev/null; then
			echo "module $m" >>"$1"
		else
			echo "module $m (rmmod failed)" >>"$1"
		fi ;;
		esac
	done
	for d in $GF_BOUND; do
		umount -l "$d"
	done
	GF_BOUND=""
	for d in dev/shm tmp run sys/fs/bpf; do
		umount -l "$R/$d"
	done
	# The host root is mounted cache=loose (init.sh): files the host changed
	# since (a rebuilt module, an edited source) are read afresh by the next
	# job, not from this one's page cache.
	sync
	echo 3 >/proc/sys/vm/drop_caches
}

gf_serve() {
	# The host's "N" lines are not echoed into the jobs' output.
	stty -echo 2>/dev/null
	dmesg >/gfjob/boot.dmesg
	sync
	echo "===GF-$GF_NONCE-READY==="
	while read -r n; do
		case "$n" in
		'' | *[!0-9]*) continue ;;
		esac
		[ -f "/gfjob/jobs/$n.sh" ] || continue
		. "/gfjob/jobs/$n.sh"
		for d in dev/shm tmp run; do
			mount -t tmpfs tmpfs "$R/$d"
		done
		mount -t bpf bpf "$R/sys/fs/bpf"
		left=/gfjob/jobs/$n.left
		: >"$left"
		mods=""
		while read -r m _; do mods="$mods $m"; done </proc/modules
		dmesg -c >/dev/null
		echo "===GF-$GF_NONCE-START==="
		if gf_rw_mounts; then
			(gf_run) </dev/null 2>&1
			rc=$?
		else
			echo "vm: a read-write share of the job could not be mounted"
			rc=125
		fi
		echo "===GF-$GF_NONCE-END==="
		gf_cleanup "$left" "$mods"
		dmesg >"/gfjob/jobs/$n.dmesg"
		echo "$rc" >"/gfjob/jobs/$n.rc"
		sync
		echo "===GF-$GF_NONCE-EXIT=$rc==="
	done
}
