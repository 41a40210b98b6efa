"""The names Python uses for the maps, programs and load-time variables of
the BPF objects in pyctl/data/, written once.

tests/test_bpf_names.py checks every name here against the built object's
symbol table (make build), and every string that pyctl passes to
map_fd/program/attach/set_autoload/set_max_entries/set_rodata against this
module, so a renamed map or program fails a test instead of a run.
(bpf/aggregate.bpf.c is its owner's: pyctl/bpf/aggregate_abi.py.)
"""

from __future__ import annotations


class Main:
    """pyctl/data/gpufault.bpf.o, from bpf/gpufault.bpf.c: the engine."""

    OBJECT = "gpufault.bpf.o"
    # maps
    SPECS = "specs"  # array: struct gf_spec per spec index
    COUNTERS = "counters"  # array: struct gf_counters per spec index
    STATS = "stats"  # array: enum gf_stat counters
    INFLIGHT = "inflight"  # hash (tid, func) -> struct gf_inflight
    PENDING = "pending"  # hash tid -> struct gf_pending, for the copilot
    FOLLOW = "follow"  # hash tid -> fault_seq whose next failing return is linked
    WATCHED = "watched"  # hash tgid -> 1: processes whose signals and exit are reported
    TASKS = "tasks"  # task storage: per-thread scratch
    EVENTS = "events"  # ringbuf: struct gf_call_event
    FIRES = "fires"  # ringbuf: struct gf_fire_event, struct gf_proc_event
    USTACKS = "ustacks"  # ringbuf: struct gf_ustack_event + the stack copy
    MAPS = (
        SPECS, COUNTERS, STATS, INFLIGHT, PENDING, FOLLOW, WATCHED, TASKS, EVENTS, FIRES, USTACKS,
    )  # fmt: skip
    # programs: one entry and one return program is loaded per run
    # (pyctl/engine/mechanism.py: Plan.programs), the two tracepoints always.
    ENTRY = "gf_entry"
    ENTRY_REGS = "gf_entry_regs"
    RETURN = "gf_return"
    RETURN_WU = "gf_return_wu"
    RETURN_REGS = "gf_return_regs"
    RETURN_REGS_WU = "gf_return_regs_wu"
    UPROBE_PROGRAMS = (ENTRY, ENTRY_REGS, RETURN, RETURN_WU, RETURN_REGS, RETURN_REGS_WU)
    SIGNAL_DELIVER = "gf_signal_deliver"
    PROCESS_EXIT = "gf_process_exit"
    PROGRAMS = (*UPROBE_PROGRAMS, SIGNAL_DELIVER, PROCESS_EXIT)
    # const volatile globals set before load
    COPILOT_SIGNO = "copilot_signo"
    HELPER_SIGNO = "helper_signo"
    EVENTS_WAKE_BYTES = "events_wake_bytes"
    USTACK_PAGES = "ustack_pages"
    RODATA = (COPILOT_SIGNO, HELPER_SIGNO, EVENTS_WAKE_BYTES, USTACK_PAGES)


class Xid:
    """pyctl/data/xid.bpf.o, from bpf/xid.bpf.c: NVIDIA Xid events."""

    OBJECT = "xid.bpf.o"
    XIDS = "xids"  # ringbuf: struct xid_event
    XID_LOST = "xid_lost"  # array: records lost to a full ring
    MAPS = (XIDS, XID_LOST)
    CLASSIC = "gf_xid"  # tracepoint nvidia:nvidia_dev_xid (needs tracefs)
    RAW = "gf_xid_raw"  # raw tracepoint (no tracefs)
    PROGRAMS = (CLASSIC, RAW)
    # The tracepoint's field layout, read from its format file.
    RODATA = ("off_dev", "dev_loc", "off_code", "size_code", "off_msg", "msg_loc", "has_msg")


class RegsProbe:
    """pyctl/data/regs_probe.bpf.o, from bpf/regs_probe.bpf.c: trial loads."""

    OBJECT = "regs_probe.bpf.o"
    MULTI_HITS = "multi_hits"  # array: hits of the uprobe_multi trial
    MAPS = (MULTI_HITS,)
    REGS = "gf_regs_probe"  # may a uprobe program write pt_regs?
    WRITE = "gf_write_probe"  # bpf_probe_write_user allowed?
    MULTI = "gf_multi_probe"  # uprobe_multi links?
    PROGRAMS = (REGS, WRITE, MULTI)
    RODATA: tuple[str, ...] = ()


class NetChaos:
    """pyctl/data/netchaos.bpf.o, from bpf/netchaos.bpf.c: netchaos's tc
    drop filter (loss, partitions) with its kernel-side deadline."""

    OBJECT = "netchaos.bpf.o"
    STATE = "netchaos_state"  # array[1]: threshold, drops, seen, deadline_ns
    MAPS = (STATE,)
    DROP = "netchaos_drop"  # tc classifier, clsact egress, direct action
    PROGRAMS = (DROP,)
    RODATA: tuple[str, ...] = ()


OBJECTS: tuple[type, ...] = (Main, Xid, RegsProbe, NetChaos)
