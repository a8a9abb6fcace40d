/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * dm-qcow2: interfaces inside the metadata layer, which four files make
 * up, each calling only those below it:
 *   dm-qcow2-open.c       opening, validating, reloading, closing
 *   dm-qcow2-snap.c       internal snapshots, online grow
 *   dm-qcow2-alloc.c      refcounts, allocation, L1/L2 entry changes
 *   dm-qcow2-writeback.c  writeback order, slice changes, safe modes
 * The layers above (dm-qcow2-map.c, dm-qcow2-target.c) use dm-qcow2.h
 * only.
 */
#ifndef DM_QCOW2_META_H
#define DM_QCOW2_META_H

#include "dm-qcow2.h"

/* What a cluster holds, in q->meta (qcow2_meta_mark()) */
#define QCOW2_META_L2		1UL
#define QCOW2_META_REFBLOCK	2UL

static inline u64 qcow2_clusters_per_block(struct qcow2 *q)
{
	return 1ULL << qcow2_refblock_bits(&q->hdr);
}

/* dm-qcow2-snap.c */
int qcow2_load_snapshot(struct qcow2 *q, const char **err);
int qcow2_grow(struct qcow2 *q, u64 size);

/* dm-qcow2-alloc.c */
void qcow2_alloc_init(struct qcow2 *q);
int qcow2_alloc_reserves(struct qcow2 *q);
void qcow2_alloc_exit(struct qcow2 *q);
int qcow2_meta_mark(struct qcow2 *q, u64 off, unsigned long kind, gfp_t gfp);
int qcow2_refcount_update_locked(struct qcow2 *q, u64 host, int delta);
void qcow2_apply_frees(struct qcow2 *q, struct list_head *frees);
int qcow2_alloc_locked(struct qcow2 *q, u64 *host);

/* dm-qcow2-writeback.c */
void qcow2_writeback_init(struct qcow2 *q);
bool qcow2_enter_fail_mode(struct qcow2 *q);
int qcow2_write_header(struct qcow2 *q);
int qcow2_write_table_block(struct qcow2 *q, const u64 *table, u64 idx,
			    u64 val, u64 table_off);
u64 *qcow2_load_table(struct qcow2 *q, u64 off, u32 entries, u32 padded);
int qcow2_modify_slice(struct qcow2 *q, enum qcow2_slice_kind kind,
		       u64 slice_off, int (*fn)(void *data, void *arg),
		       void *arg);
void qcow2_set_table_entry(struct qcow2 *q, struct qcow2_dirty *d,
			   u64 *table, u64 idx, u64 entry);
void qcow2_dirty_clear(struct qcow2 *q, struct qcow2_dirty *d);
int qcow2_writeback(struct qcow2 *q, struct list_head *frees, u64 ticket);
void qcow2_grace_start_locked(struct qcow2 *q);
void qcow2_kick_writeback(void *owner);

#endif /* DM_QCOW2_META_H */
