/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * dm-qcow2 trace events: what happened to one bio or cluster, for
 * debugging a host or the target (/sys/kernel/tracing/events/dm_qcow2/,
 * trace-cmd, perf trace). The counters an operator reads stay in the
 * status line. Each event names the mapped device (major:minor); offsets
 * are bytes, "voff" in the guest's view, "host" in the image.
 *
 * Defined once, in dm-qcow2-target.c (CREATE_TRACE_POINTS); every other
 * file includes this header as it is.
 */
#undef TRACE_SYSTEM
#define TRACE_SYSTEM dm_qcow2

#if !defined(_DM_QCOW2_TRACE_H) || defined(TRACE_HEADER_MULTI_READ)
#define _DM_QCOW2_TRACE_H

#include <linux/tracepoint.h>

#include "dm-qcow2.h"

#define QCOW2_TRACE_WHAT	64

TRACE_DEFINE_ENUM(QCOW2_CLUSTER_UNALLOCATED);
TRACE_DEFINE_ENUM(QCOW2_CLUSTER_ZERO_PLAIN);
TRACE_DEFINE_ENUM(QCOW2_CLUSTER_ZERO_ALLOC);
TRACE_DEFINE_ENUM(QCOW2_CLUSTER_NORMAL);
TRACE_DEFINE_ENUM(QCOW2_CLUSTER_COMPRESSED);
TRACE_DEFINE_ENUM(QCOW2_MODE_RW);
TRACE_DEFINE_ENUM(QCOW2_MODE_RO);
TRACE_DEFINE_ENUM(QCOW2_MODE_FAIL);

#define show_qcow2_cluster(type)					\
	__print_symbolic(type,						\
			 { QCOW2_CLUSTER_UNALLOCATED, "unallocated" },	\
			 { QCOW2_CLUSTER_ZERO_PLAIN, "zero" },		\
			 { QCOW2_CLUSTER_ZERO_ALLOC, "zero-alloc" },	\
			 { QCOW2_CLUSTER_NORMAL, "data" },		\
			 { QCOW2_CLUSTER_COMPRESSED, "compressed" })

#define show_qcow2_mode(mode)						\
	__print_symbolic(mode,						\
			 { QCOW2_MODE_RW, "rw" },			\
			 { QCOW2_MODE_RO, "ro" },			\
			 { QCOW2_MODE_FAIL, "fail" })

/* Host clusters taken by the allocator, or given back (refcount zero) */
DECLARE_EVENT_CLASS(qcow2_clusters,
	TP_PROTO(struct qcow2 *q, u64 host, u64 count),
	TP_ARGS(q, host, count),
	TP_STRUCT__entry(
		__field(dev_t, dev)
		__field(u64, host)
		__field(u64, count)
	),
	TP_fast_assign(
		__entry->dev = qcow2_devt(q);
		__entry->host = host;
		__entry->count = count;
	),
	TP_printk("dev %d:%d host %llu clusters %llu",
		  MAJOR(__entry->dev), MINOR(__entry->dev),
		  __entry->host, __entry->count)
);

DEFINE_EVENT(qcow2_clusters, qcow2_alloc,
	TP_PROTO(struct qcow2 *q, u64 host, u64 count),
	TP_ARGS(q, host, count)
);

DEFINE_EVENT(qcow2_clusters, qcow2_free,
	TP_PROTO(struct qcow2 *q, u64 host, u64 count),
	TP_ARGS(q, host, count)
);

/*
 * A write served cluster by cluster got its new cluster: what the guest
 * cluster was (the fill copied from it, unless the write covers it),
 * where it was and where it goes. Runs of clusters with nothing to copy
 * (write_fresh()) show as qcow2_alloc only.
 */
TRACE_EVENT(qcow2_write_alloc,
	TP_PROTO(struct qcow2 *q, u64 voff, int type, u64 old, u64 host),
	TP_ARGS(q, voff, type, old, host),
	TP_STRUCT__entry(
		__field(dev_t, dev)
		__field(u64, voff)
		__field(int, type)
		__field(u64, old)
		__field(u64, host)
	),
	TP_fast_assign(
		__entry->dev = qcow2_devt(q);
		__entry->voff = voff;
		__entry->type = type;
		__entry->old = old;
		__entry->host = host;
	),
	TP_printk("dev %d:%d voff %llu was %s old %llu host %llu",
		  MAJOR(__entry->dev), MINOR(__entry->dev), __entry->voff,
		  show_qcow2_cluster(__entry->type), __entry->old,
		  __entry->host)
);

/* A write parked on the allocating write holding its cluster */
TRACE_EVENT(qcow2_park,
	TP_PROTO(struct qcow2 *q, u64 voff, u64 holder),
	TP_ARGS(q, voff, holder),
	TP_STRUCT__entry(
		__field(dev_t, dev)
		__field(u64, voff)
		__field(u64, holder)
	),
	TP_fast_assign(
		__entry->dev = qcow2_devt(q);
		__entry->voff = voff;
		__entry->holder = holder;
	),
	TP_printk("dev %d:%d voff %llu holder %llu",
		  MAJOR(__entry->dev), MINOR(__entry->dev), __entry->voff,
		  __entry->holder)
);

/* Parked writes written in one with the allocating write at @voff */
TRACE_EVENT(qcow2_gather,
	TP_PROTO(struct qcow2 *q, u64 voff, unsigned int nr),
	TP_ARGS(q, voff, nr),
	TP_STRUCT__entry(
		__field(dev_t, dev)
		__field(u64, voff)
		__field(unsigned int, nr)
	),
	TP_fast_assign(
		__entry->dev = qcow2_devt(q);
		__entry->voff = voff;
		__entry->nr = nr;
	),
	TP_printk("dev %d:%d voff %llu gathered %u",
		  MAJOR(__entry->dev), MINOR(__entry->dev), __entry->voff,
		  __entry->nr)
);

/*
 * A batch of held writes (@held of them, with @nr bios in all counting
 * those parked on them) allocated and written as one over @clusters
 */
TRACE_EVENT(qcow2_batch,
	TP_PROTO(struct qcow2 *q, u64 voff, unsigned int held,
		 unsigned int nr, u32 clusters),
	TP_ARGS(q, voff, held, nr, clusters),
	TP_STRUCT__entry(
		__field(dev_t, dev)
		__field(u64, voff)
		__field(unsigned int, held)
		__field(unsigned int, nr)
		__field(u32, clusters)
	),
	TP_fast_assign(
		__entry->dev = qcow2_devt(q);
		__entry->voff = voff;
		__entry->held = held;
		__entry->nr = nr;
		__entry->clusters = clusters;
	),
	TP_printk("dev %d:%d voff %llu held %u bios %u clusters %u",
		  MAJOR(__entry->dev), MINOR(__entry->dev), __entry->voff,
		  __entry->held, __entry->nr, __entry->clusters)
);

/* A metadata writeback done: its number, slices dirty before, result */
TRACE_EVENT(qcow2_writeback,
	TP_PROTO(struct qcow2 *q, u64 seq, unsigned long dirty, int err),
	TP_ARGS(q, seq, dirty, err),
	TP_STRUCT__entry(
		__field(dev_t, dev)
		__field(u64, seq)
		__field(unsigned long, dirty)
		__field(int, err)
	),
	TP_fast_assign(
		__entry->dev = qcow2_devt(q);
		__entry->seq = seq;
		__entry->dirty = dirty;
		__entry->err = err;
	),
	TP_printk("dev %d:%d seq %llu dirty %lu err %d",
		  MAJOR(__entry->dev), MINOR(__entry->dev), __entry->seq,
		  __entry->dirty, __entry->err)
);

/* Bad metadata met at run time */
TRACE_EVENT(qcow2_corrupt,
	TP_PROTO(struct qcow2 *q, u64 voff, const char *what),
	TP_ARGS(q, voff, what),
	TP_STRUCT__entry(
		__field(dev_t, dev)
		__field(u64, voff)
		__array(char, what, QCOW2_TRACE_WHAT)
	),
	TP_fast_assign(
		__entry->dev = qcow2_devt(q);
		__entry->voff = voff;
		strscpy(__entry->what, what, QCOW2_TRACE_WHAT);
	),
	TP_printk("dev %d:%d voff %llu %s",
		  MAJOR(__entry->dev), MINOR(__entry->dev), __entry->voff,
		  __entry->what)
);

/* The target's mode moved towards safety */
TRACE_EVENT(qcow2_mode,
	TP_PROTO(struct qcow2 *q, int mode),
	TP_ARGS(q, mode),
	TP_STRUCT__entry(
		__field(dev_t, dev)
		__field(int, mode)
	),
	TP_fast_assign(
		__entry->dev = qcow2_devt(q);
		__entry->mode = mode;
	),
	TP_printk("dev %d:%d mode %s",
		  MAJOR(__entry->dev), MINOR(__entry->dev),
		  show_qcow2_mode(__entry->mode))
);

/* File backend: @nr bios that continue each other sent as one kiocb */
TRACE_EVENT(qcow2_file_merge,
	TP_PROTO(struct qcow2_io *io, u64 pos, unsigned int nr, size_t len),
	TP_ARGS(io, pos, nr, len),
	TP_STRUCT__entry(
		__field(dev_t, dev)
		__field(u64, pos)
		__field(unsigned int, nr)
		__field(size_t, len)
	),
	TP_fast_assign(
		__entry->dev = disk_devt(dm_disk(io->md));
		__entry->pos = pos;
		__entry->nr = nr;
		__entry->len = len;
	),
	TP_printk("dev %d:%d host %llu bios %u bytes %zu",
		  MAJOR(__entry->dev), MINOR(__entry->dev), __entry->pos,
		  __entry->nr, __entry->len)
);

#endif /* _DM_QCOW2_TRACE_H */

#undef TRACE_INCLUDE_PATH
#define TRACE_INCLUDE_PATH .
#undef TRACE_INCLUDE_FILE
#define TRACE_INCLUDE_FILE dm-qcow2-trace
#include <trace/define_trace.h>
