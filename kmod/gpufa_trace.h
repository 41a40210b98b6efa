/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The gpufa:anchor tracepoint: one event per anchor record, so BPF
 * programs and perf see anchors without reading /dev/gpufa.
 */
#undef TRACE_SYSTEM
#define TRACE_SYSTEM gpufa

#if !defined(_GPUFA_TRACE_H) || defined(TRACE_HEADER_MULTI_READ)
#define _GPUFA_TRACE_H

#include <linux/tracepoint.h>
#include "uapi/gpufa.h"

TRACE_EVENT(anchor,

	TP_PROTO(const struct gpufa_record *rec),

	TP_ARGS(rec),

	TP_STRUCT__entry(
		__field(u64, fault_seq)
		__field(u64, rec_seq)
		__field(u32, run_id)
		__field(u32, kind)
		__field(u32, domain)
		__field(u8, bus)
		__field(u8, devfn)
		__field(u16, vendor)
		__field(u16, device)
		__field(s32, code)
		__field(u32, pid)
	),

	TP_fast_assign(
		__entry->fault_seq = rec->fault_seq;
		__entry->rec_seq = rec->rec_seq;
		__entry->run_id = rec->run_id;
		__entry->kind = rec->kind;
		__entry->domain = rec->domain;
		__entry->bus = rec->bus;
		__entry->devfn = rec->devfn;
		__entry->vendor = rec->vendor;
		__entry->device = rec->device;
		__entry->code = rec->code;
		__entry->pid = rec->pid;
	),

	TP_printk("fault=%08x-%llu kind=%s dev=%04x:%02x:%02x.%u id=%04x:%04x code=%d pid=%u rec=%llu",
		  __entry->run_id, __entry->fault_seq,
		  __print_symbolic(__entry->kind,
				   { GPUFA_ANCHOR_RESET_BEGIN, "reset_begin" },
				   { GPUFA_ANCHOR_RESET_END, "reset_end" },
				   { GPUFA_ANCHOR_GONE, "gone" },
				   { GPUFA_ANCHOR_AER, "aer" },
				   { GPUFA_ANCHOR_DRIVER, "driver" },
				   { GPUFA_ANCHOR_MANUAL, "manual" }),
		  __entry->domain, __entry->bus, __entry->devfn >> 3,
		  __entry->devfn & 7, __entry->vendor, __entry->device,
		  __entry->code, __entry->pid, __entry->rec_seq)
);

#endif /* _GPUFA_TRACE_H */

#undef TRACE_INCLUDE_PATH
#define TRACE_INCLUDE_PATH .
#define TRACE_INCLUDE_FILE gpufa_trace
#include <trace/define_trace.h>
