// SPDX-License-Identifier: GPL-2.0-only
/*
 * dm-qcow2: refcounts and cluster allocation.
 *
 * This file owns: where a host offset may point (the header, the L1 and
 * refcount tables, known L2 tables and refcount blocks are never data),
 * refcount changes, the deferred frees (applied once the writeback made
 * the table change durable and a grace period of the bios in flight has
 * passed), taking free clusters (adding refcount blocks and growing the
 * refcount table as needed), and the L1/L2 entry changes of allocating
 * writes. Every change is made in memory; dm-qcow2-writeback.c writes it
 * back in crash-safe order.
 */
#include <linux/sched/mm.h>
#include <linux/slab.h>
#include <linux/vmalloc.h>

#include "dm-qcow2-meta.h"
#include "dm-qcow2-trace.h"

/* Records of frees kept in reserve (qcow2_defer_free()) */
#define QCOW2_FREE_RESERVE	256

struct qcow2_free {
	struct list_head list;
	u64 host;			/* first cluster */
	u64 count;			/* clusters */
};

/* ---- Host offset checks ---- */

static bool ranges_overlap(u64 a, u64 alen, u64 b, u64 blen)
{
	return a < b + blen && b < a + alen;
}

/* Does the cluster at @off overlap the header, L1 or refcount table? */
static bool overlaps_metadata(struct qcow2 *q, u64 off, u64 len)
{
	const struct qcow2_header *h = &q->hdr;

	return off < h->cluster_size ||
	       ranges_overlap(off, len, h->l1_table_offset,
			      (u64)h->l1_size * sizeof(u64)) ||
	       ranges_overlap(off, len, h->refcount_table_offset,
			      (u64)h->refcount_table_clusters << h->cluster_bits);
}

/*
 * Where a table or data at @off may not start: in the header, past the
 * end of the image, or over the L1 or refcount table. Returns NULL when
 * it is fine.
 */
static const char *host_check(struct qcow2 *q, u64 off, u64 len)
{
	const struct qcow2_header *h = &q->hdr;
	u64 size = READ_ONCE(q->io.size);

	if (off < h->cluster_size)
		return "overlaps the header";
	if (off >= QCOW2_MAX_HOST_OFFSET)
		return "offset beyond 2^56";
	if (off >= size)
		return "offset past the end of the image";
	if (ranges_overlap(off, len, h->l1_table_offset,
			   (u64)h->l1_size * sizeof(u64)))
		return "overlaps the L1 table";
	if (ranges_overlap(off, len, h->refcount_table_offset,
			   (u64)h->refcount_table_clusters << h->cluster_bits))
		return "overlaps the refcount table";
	return NULL;
}

/* An L2 table or refcount block: a whole cluster inside the image. */
const char *qcow2_host_cluster_check(struct qcow2 *q, u64 off)
{
	u64 len = q->hdr.cluster_size, size = READ_ONCE(q->io.size);
	const char *err = host_check(q, off, len);

	if (!err && len > size - off)
		return "offset past the end of the image";
	return err;
}

/*
 * Marks made while writing (a new L2 table or refcount block) are made
 * under memory pressure too, with the allocation lock held: dip into the
 * atomic reserves, never loop in reclaim. A mark that still cannot be
 * stored only weakens the check of data clusters against that one table.
 */
#define QCOW2_GFP_MARK	(GFP_NOIO | __GFP_HIGH | __GFP_NORETRY | __GFP_NOWARN)

/*
 * Remember that the cluster at @off holds metadata of @kind. -EEXIST when
 * it is already known as something else (or as a refcount block twice).
 * The load and the store are not one step: callers are the table load
 * (nothing else runs) and changes made under alloc_lock.
 */
int qcow2_meta_mark(struct qcow2 *q, u64 off, unsigned long kind, gfp_t gfp)
{
	unsigned long idx = off >> q->hdr.cluster_bits;
	void *old = xa_load(&q->meta, idx);

	if (old && (xa_to_value(old) != kind || kind == QCOW2_META_REFBLOCK))
		return -EEXIST;
	return xa_err(xa_store(&q->meta, idx, xa_mk_value(kind), gfp));
}

static bool meta_in(struct qcow2 *q, u64 first, u64 last)
{
	for (; first <= last; first++)
		if (xa_load(&q->meta, first))
			return true;
	return false;
}

/*
 * A data cluster: also not any known L2 table or refcount block. Runs for
 * every bio (an RCU lookup): a pointer into metadata must never be used.
 */
const char *qcow2_data_cluster_check(struct qcow2 *q, u64 off)
{
	u64 c = off >> q->hdr.cluster_bits;
	const char *err;

	/*
	 * The last data cluster of a file may end past the end of the file:
	 * QEMU writes only the subclusters it allocates, and neither QEMU nor
	 * we zero the rest of a new cluster at the end (see
	 * qcow2_io_zero_range()). A device holds whole clusters.
	 */
	if (q->hdr.extended_l2 || q->io.file)
		err = host_check(q, off, q->hdr.cluster_size);
	else
		err = qcow2_host_cluster_check(q, off);

	if (!err && meta_in(q, c, c))
		return "overlaps an L2 table or a refcount block";
	return err;
}

/*
 * Compressed data: any byte range (at most a few clusters), which may
 * end past the end of the image (it is clamped there when read). Its
 * clusters' refcounts drop when it is rewritten, so it must not touch
 * metadata either.
 */
const char *qcow2_data_range_check(struct qcow2 *q, u64 off, u64 len)
{
	const char *err = host_check(q, off, len);

	if (!err && len &&
	    meta_in(q, off >> q->hdr.cluster_bits,
		    (off + len - 1) >> q->hdr.cluster_bits))
		return "overlaps an L2 table or a refcount block";
	return err;
}

/* ---- Refcounts ---- */

struct refcount_change {
	u32 index;		/* entry within the slice */
	u32 order;
	int delta;
	u64 result;
};

static int refcount_apply(void *data, void *arg)
{
	struct refcount_change *rc = arg;
	u64 val = qcow2_refcount_get(data, rc->index, rc->order);

	if (rc->delta < 0 && !val)
		return -EUCLEAN;
	if (rc->delta > 0 && val == qcow2_refcount_max(rc->order))
		return -EOVERFLOW;
	rc->result = val + rc->delta;
	qcow2_refcount_set(data, rc->index, rc->order, rc->result);
	return 0;
}

/*
 * Where the refcount of host cluster @cluster lives: the slice offset and
 * the entry within it. Returns 0 with *slice_off == 0 when the refcount
 * table has no block for it.
 */
static int refcount_locate(struct qcow2 *q, u64 cluster, u64 *slice_off,
			   u32 *index)
{
	const struct qcow2_header *h = &q->hdr;
	u32 rb_bits = qcow2_refblock_bits(h);
	u32 per_slice = (q->cache.slice_size * 8) >> h->refcount_order;
	u64 rt = cluster >> rb_bits, in_block, block;
	const char *err;

	*slice_off = 0;
	if (rt >= q->rt_entries)
		return 0;
	if (qcow2_reftable_decode(h, q->reftable[rt], &block, &err))
		return qcow2_corrupt(q, 0, err);
	if (!block)
		return 0;
	if (qcow2_host_cluster_check(q, block))
		return qcow2_corrupt(q, 0, "refcount block outside the image");
	in_block = cluster & ((1ULL << rb_bits) - 1);
	*slice_off = block + (in_block / per_slice) * q->cache.slice_size;
	*index = in_block % per_slice;
	return 0;
}

/*
 * A refcount dropped to zero: nothing on disk points at the cluster any
 * more (decreases wait for the L2 change that dropped the reference, see
 * qcow2_defer_free()), so its space goes back below us and the allocator
 * may take it again. alloc_lock keeps allocation away meanwhile.
 */
static void cluster_freed(struct qcow2 *q, u64 cluster)
{
	u64 off = cluster << q->hdr.cluster_bits;

	lockdep_assert_held(&q->alloc_lock);
	trace_qcow2_free(q, off, 1);
	atomic64_dec(&q->allocated);
	/*
	 * A freed L2 table or old refcount block: its slices describe
	 * nothing, and no writeback may write them there any more.
	 */
	if (xa_erase(&q->meta, cluster)) {
		down_read(&q->meta_sem);
		qcow2_cache_forget(&q->cache, off, q->hdr.cluster_size);
		up_read(&q->meta_sem);
	} else {
		qcow2_zip_forget(&q->zip, off, q->hdr.cluster_size);
	}
	if (cluster < q->free_cursor)
		q->free_cursor = cluster;
	qcow2_io_discard(&q->io, off, q->hdr.cluster_size);
}

/*
 * Change a refcount by @delta; may sleep to load the refcount block.
 * alloc_lock keeps the refcount table still meanwhile.
 */
int qcow2_refcount_update_locked(struct qcow2 *q, u64 host, int delta)
{
	struct refcount_change rc = { .order = q->hdr.refcount_order,
				      .delta = delta };
	u64 cluster = host >> q->hdr.cluster_bits, slice_off;
	int r;

	lockdep_assert_held(&q->alloc_lock);
	r = refcount_locate(q, cluster, &slice_off, &rc.index);
	if (r)
		return r;
	if (!slice_off)
		return qcow2_corrupt(q, 0, "refcount of a cluster without a refcount block");
	r = qcow2_modify_slice(q, QCOW2_SLICE_REFCOUNT, slice_off,
			       refcount_apply, &rc);
	if (r == -EUCLEAN)
		return qcow2_corrupt(q, 0, "refcount would drop below zero");
	if (r)
		return r;
	if (delta > 0 && rc.result == 1)
		atomic64_inc(&q->allocated);
	else if (delta < 0 && !rc.result)
		cluster_freed(q, cluster);
	return 0;
}

int qcow2_refcount_update(struct qcow2 *q, u64 host, int delta)
{
	int r;

	mutex_lock(&q->alloc_lock);
	r = qcow2_refcount_update_locked(q, host, delta);
	mutex_unlock(&q->alloc_lock);
	return r;
}

/*
 * Queue a refcount decrease until the next qcow2_sync() has written the
 * L2 change that dropped the reference.
 */

void qcow2_defer_free(struct qcow2 *q, u64 host, u64 len)
{
	struct qcow2_free *f = NULL;
	u64 mask = q->hdr.cluster_size - 1;

	/*
	 * From the allocator without waiting, else the reserve (the next
	 * writeback gives records back), else the cluster leaks: allowed,
	 * never unsafe, and never waited for (a guest that does not flush
	 * would keep the records until it does).
	 */
	f = qcow2_pool_try(&q->free_pool);
	/* Running low: a writeback (and its grace period) gives some back */
	if (READ_ONCE(q->free_pool.pool.curr_nr) < QCOW2_FREE_RESERVE / 2)
		qcow2_kick_writeback(q);
	if (!f) {
		DMERR_LIMIT("%s: no memory to free the cluster at %llu: leaked",
			    qcow2_name(q), host);
		return;
	}
	f->host = host & ~mask;
	f->count = ((host & mask) + len + mask) >> q->hdr.cluster_bits;
	spin_lock(&q->lock);
	list_add_tail(&f->list, &q->frees);
	spin_unlock(&q->lock);
}

void qcow2_apply_frees(struct qcow2 *q, struct list_head *frees)
{
	struct qcow2_free *f, *tmp;
	u64 i;

	lockdep_assert_held(&q->alloc_lock);
	list_for_each_entry_safe(f, tmp, frees, list) {
		for (i = 0; i < f->count; i++) {
			u64 host = f->host + (i << q->hdr.cluster_bits);

			if (qcow2_refcount_update_locked(q, host, -1))
				DMERR_LIMIT("%s: cannot free cluster at %llu",
					    qcow2_name(q), host);
		}
		list_del(&f->list);
		qcow2_pool_put(&q->free_pool, f);
	}
}

static void grace_work_fn(struct work_struct *work)
{
	struct qcow2 *q = container_of(work, struct qcow2, grace_work);
	unsigned int noio;
	LIST_HEAD(frees);

	spin_lock(&q->lock);
	list_splice_init(&q->frees_grace, &frees);
	spin_unlock(&q->lock);
	/* Refcount slices may load: see map_work() */
	noio = memalloc_noio_save();
	mutex_lock(&q->alloc_lock);
	qcow2_apply_frees(q, &frees);
	mutex_unlock(&q->alloc_lock);
	memalloc_noio_restore(noio);
	spin_lock(&q->lock);
	q->grace_pending = false;
	qcow2_grace_start_locked(q);
	spin_unlock(&q->lock);
}

/* ---- Allocation ---- */

/* The lazy-refcounts dirty bit goes to disk before the first change. */
static int mark_dirty_once(struct qcow2 *q)
{
	struct qcow2_header *h = &q->hdr;
	int r;

	if (q->dirty_bit_set ||
	    !(h->compatible_features & QCOW2_COMPAT_LAZY_REFCOUNTS))
		return 0;
	h->incompatible_features |= QCOW2_INCOMPAT_DIRTY;
	r = qcow2_write_header(q);
	if (r)
		return r;
	q->dirty_bit_set = true;
	return 0;
}

/* A block device has a fixed size; a file grows. */
static bool cluster_fits(struct qcow2 *q, u64 cluster, u64 count)
{
	u64 end = (cluster + count) << q->hdr.cluster_bits;

	if (end > QCOW2_MAX_HOST_OFFSET)
		return false;
	return !q->io.dev || end <= q->io.size;
}

/*
 * The cluster buffer of allocations (q->alloc_buf, made with the table),
 * zeroed: for one new table at a time, under alloc_lock.
 */
static void *alloc_buf_zeroed(struct qcow2 *q)
{
	lockdep_assert_held(&q->alloc_lock);
	memset(q->alloc_buf, 0, q->hdr.cluster_size);
	return q->alloc_buf;
}

/*
 * A zeroed cluster buffer with the refcounts of the block at @first set
 * to one for clusters [@start, @start + @count): alloc_buf_zeroed().
 */
static void *new_refblock(struct qcow2 *q, u64 first, u64 start, u64 count)
{
	u64 c, per = qcow2_clusters_per_block(q);
	void *buf = alloc_buf_zeroed(q);

	for (c = start; c < start + count; c++)
		if (c >= first && c < first + per)
			qcow2_refcount_set(buf, c - first,
					   q->hdr.refcount_order, 1);
	return buf;
}

/*
 * The refcount table has no block for the clusters around @cluster, which
 * is free: put the new block there, describing itself, and write it. Its
 * table entry is set in memory and reaches the disk with the next
 * writeback, after a flush that makes the block durable and before any
 * table entry that maps a cluster it counts. A crash before then leaves
 * the block unreferenced, and every cluster it counts unreferenced too.
 * No flush is waited for with alloc_lock held.
 */
static int add_refblock(struct qcow2 *q, u64 cluster)
{
	u64 rt = cluster >> qcow2_refblock_bits(&q->hdr);
	u64 first = rt << qcow2_refblock_bits(&q->hdr);
	u64 off = cluster << q->hdr.cluster_bits;
	void *buf;
	int r;

	lockdep_assert_held(&q->alloc_lock);
	if (!cluster_fits(q, cluster, 1))
		return -ENOSPC;
	if (overlaps_metadata(q, off, q->hdr.cluster_size))
		return qcow2_corrupt(q, 0, "metadata cluster has no refcount block");
	buf = new_refblock(q, first, cluster, 1);
	r = qcow2_io_write_meta(&q->io, buf, q->hdr.cluster_size, off);
	if (r)
		return r;
	qcow2_set_table_entry(q, &q->rt_dirty, q->reftable, rt, off);
	trace_qcow2_alloc(q, off, 1);
	atomic64_inc(&q->allocated);
	qcow2_meta_mark(q, off, QCOW2_META_REFBLOCK, QCOW2_GFP_MARK);
	return 0;
}

/*
 * Lay out, at cluster @start, @nb new refcount blocks followed by a new
 * refcount table of @tc clusters, the blocks covering themselves and the
 * table. Returns the number of blocks needed, which may exceed @nb.
 */
static u64 reftable_layout_blocks(struct qcow2 *q, u64 start, u64 nb, u64 tc)
{
	u32 bits = qcow2_refblock_bits(&q->hdr);

	return ((start + nb + tc - 1) >> bits) - (start >> bits) + 1;
}

static int write_refblocks(struct qcow2 *q, u64 start, u64 nb, u64 total)
{
	u32 bits = qcow2_refblock_bits(&q->hdr);
	u64 i, first;
	void *buf;
	int r = 0;

	for (i = 0; i < nb && !r; i++) {
		first = ((start >> bits) + i) << bits;
		buf = new_refblock(q, first, start, total);
		r = qcow2_io_write_meta(&q->io, buf, q->hdr.cluster_size,
					(start + i) << q->hdr.cluster_bits);
	}
	return r;
}

static int write_reftable(struct qcow2 *q, const u64 *table, u64 clusters,
			  u64 off)
{
	size_t len = clusters << q->hdr.cluster_bits, i;
	__be64 *buf = kvmalloc(len, GFP_NOIO);
	int r;

	if (!buf)
		return -ENOMEM;
	for (i = 0; i < len / sizeof(u64); i++)
		buf[i] = cpu_to_be64(table[i]);
	r = qcow2_io_write_meta(&q->io, buf, len, off);
	kvfree(buf);
	return r;
}

/*
 * Grow the refcount table so that it has entry @need_rt. The new blocks
 * and table go at the free cursor, past everything the old table covers;
 * they are written and flushed, then the header is switched with one
 * write, then the old table's clusters are freed.
 */
static int grow_reftable(struct qcow2 *q, u64 need_rt)
{
	struct qcow2_header *h = &q->hdr;
	u64 per_cluster = h->cluster_size / sizeof(u64);
	u64 start = q->free_cursor, entries, tc, nb = 1, i;
	u64 old_off = h->refcount_table_offset;
	u32 old_clusters = h->refcount_table_clusters, bits;
	u64 *table;
	int r;

	lockdep_assert_held(&q->alloc_lock);
	bits = qcow2_refblock_bits(h);
	entries = max_t(u64, (u64)q->rt_entries * 2, need_rt + 1);
	/* Both only grow, so this settles */
	for (;;) {
		u64 want, last_rt;

		tc = DIV_ROUND_UP(entries, per_cluster);
		want = reftable_layout_blocks(q, start, nb, tc);
		last_rt = (start + want + tc - 1) >> bits;
		if (want == nb && last_rt < tc * per_cluster)
			break;
		nb = max(nb, want);
		entries = max(entries, last_rt + 1);
	}
	if (tc * h->cluster_size > QCOW2_MAX_REFTABLE_BYTES)
		return -ENOSPC;
	if (!cluster_fits(q, start, nb + tc))
		return -ENOSPC;
	if (overlaps_metadata(q, start << h->cluster_bits,
			      (nb + tc) << h->cluster_bits))
		return qcow2_corrupt(q, 0, "metadata beyond the refcount table");

	table = kvzalloc(tc * h->cluster_size, GFP_NOIO);
	if (!table)
		return -ENOMEM;
	memcpy(table, q->reftable, q->rt_entries * sizeof(u64));
	for (i = 0; i < nb; i++)
		table[(start >> bits) + i] = (start + i) << h->cluster_bits;

	r = write_refblocks(q, start, nb, nb + tc);
	if (!r)
		r = write_reftable(q, table, tc, (start + nb) << h->cluster_bits);
	if (!r)
		r = qcow2_io_flush(&q->io);
	if (r)
		goto out_free;

	/*
	 * No writeback writes the old table while it moves (it would write
	 * into clusters freed below). The new one holds every entry not yet
	 * written, flushed with it above: none is dirty once it is in use.
	 */
	down_read(&q->meta_sem);
	h->refcount_table_offset = (start + nb) << h->cluster_bits;
	h->refcount_table_clusters = tc;
	r = qcow2_write_header(q);
	if (r) {
		h->refcount_table_offset = old_off;
		h->refcount_table_clusters = old_clusters;
		up_read(&q->meta_sem);
		goto out_free;
	}
	swap(q->reftable, table);
	q->rt_entries = tc * per_cluster;
	qcow2_dirty_clear(q, &q->rt_dirty);
	up_read(&q->meta_sem);
	for (i = 0; i < nb; i++)
		qcow2_meta_mark(q, (start + i) << h->cluster_bits,
				QCOW2_META_REFBLOCK, QCOW2_GFP_MARK);
	q->free_cursor = start + nb + tc;
	trace_qcow2_alloc(q, start << h->cluster_bits, nb + tc);
	atomic64_add(nb + tc, &q->allocated);

	/* The header no longer points at the old table: free it */
	for (i = 0; i < old_clusters; i++)
		qcow2_refcount_update_locked(q, old_off + (i << h->cluster_bits), -1);
out_free:
	kvfree(table);
	return r;
}

struct refcount_scan {
	u32 from;		/* first entry to look at */
	u32 count;		/* entries in the slice */
	u32 order;
	u32 found;		/* entry set to one, or count */
};

/* Find a zero refcount in a slice and take it, atomically. */
static int refcount_take_free(void *data, void *arg)
{
	struct refcount_scan *sc = arg;
	u32 i;

	for (i = sc->from; i < sc->count; i++) {
		if (!qcow2_refcount_get(data, i, sc->order)) {
			qcow2_refcount_set(data, i, sc->order, 1);
			sc->found = i;
			return 0;
		}
	}
	sc->found = sc->count;
	return -ENOENT;
}

/* Try to take a free cluster from the slice holding @cluster's refcount */
static int take_from_slice(struct qcow2 *q, u64 cluster, u64 slice_off,
			   u32 index, u64 *taken)
{
	struct refcount_scan sc = {
		.from = index, .order = q->hdr.refcount_order,
		.count = (q->cache.slice_size * 8) >> q->hdr.refcount_order,
	};
	int r;

	r = qcow2_modify_slice(q, QCOW2_SLICE_REFCOUNT, slice_off,
			       refcount_take_free, &sc);
	*taken = cluster + (sc.found - index);
	return r;
}

/* A cluster taken from a corrupt refcount block must not be used. */
static int check_taken(struct qcow2 *q, u64 cluster)
{
	u64 off = cluster << q->hdr.cluster_bits;

	atomic64_inc(&q->allocated);
	q->end_cluster = max(q->end_cluster, cluster + 1);
	if (!cluster_fits(q, cluster, 1)) {
		qcow2_refcount_update_locked(q, off, -1);	/* give it back */
		return -ENOSPC;
	}
	if (overlaps_metadata(q, off, q->hdr.cluster_size) ||
	    xa_load(&q->meta, cluster))
		return qcow2_corrupt(q, 0, "metadata cluster has refcount zero");
	return 0;
}

int qcow2_alloc_locked(struct qcow2 *q, u64 *host)
{
	u64 cluster, slice_off, taken;
	u32 index;
	int r;

	lockdep_assert_held(&q->alloc_lock);
	r = mark_dirty_once(q);
	if (r)
		return r;
	for (;;) {
		cluster = q->free_cursor;
		if (cluster >> qcow2_refblock_bits(&q->hdr) >= q->rt_entries) {
			r = grow_reftable(q, cluster >>
					  qcow2_refblock_bits(&q->hdr));
			if (r)
				return r;
			continue;
		}
		r = refcount_locate(q, cluster, &slice_off, &index);
		if (r)
			return r;
		if (!slice_off) {
			r = add_refblock(q, cluster);
			if (r)
				return r;
			continue;	/* @cluster now holds the block */
		}
		r = take_from_slice(q, cluster, slice_off, index, &taken);
		if (r == -ENOENT) {
			q->free_cursor = taken;	/* past this slice */
			continue;
		}
		if (r)
			return r;
		q->free_cursor = taken + 1;
		r = check_taken(q, taken);
		if (r)
			return r;
		*host = taken << q->hdr.cluster_bits;
		trace_qcow2_alloc(q, *host, 1);
		return 0;
	}
}

/*
 * An allocation failed with @r: a write of a new refcount block, table or
 * header may have landed in part, so stop writing (no space, no memory
 * and corruption are handled by the callers). Returns @r.
 */
static int meta_failed(struct qcow2 *q, int r)
{
	if (r && r != -ENOSPC && r != -ENOMEM && r != -EUCLEAN)
		qcow2_meta_error(q, r);
	return r;
}

/*
 * Allocate @n host clusters (not always contiguous), all or none: their
 * refcounts are one in the cache when this returns. The lowest free
 * clusters at or past the cursor are taken; freed clusters move the
 * cursor back (cluster_freed()). @mark (unless NULL) gets
 * qcow2_io_written() as it is once they are allocated.
 */
int qcow2_alloc_clusters(struct qcow2 *q, u32 n, u64 *host, u64 *mark)
{
	u64 end = 0;
	u32 i;
	int r = 0;

	mutex_lock(&q->alloc_lock);
	for (i = 0; i < n; i++) {
		r = qcow2_alloc_locked(q, &host[i]);
		if (r)
			break;
		end = max(end, host[i] + q->hdr.cluster_size);
	}
	while (r && i--)
		qcow2_refcount_update_locked(q, host[i], -1);
	if (mark)
		*mark = qcow2_io_written(&q->io);
	mutex_unlock(&q->alloc_lock);
	if (!r)
		qcow2_io_reserve(&q->io, end);
	return meta_failed(q, r);
}

int qcow2_alloc_cluster(struct qcow2 *q, u64 *host)
{
	return qcow2_alloc_clusters(q, 1, host, NULL);
}

/* ---- L1 and L2 changes ---- */

/*
 * Fill a new L2 table at @new_off: a copy of the shared table at @old_off,
 * or zeros. The next writeback's first flush makes it durable, with its
 * refcount, before the L1 entry is written.
 */
static int write_new_l2(struct qcow2 *q, u64 old_off, u64 new_off)
{
	u32 size = q->hdr.cluster_size;
	void *buf = alloc_buf_zeroed(q);
	int r = 0;

	if (old_off)
		r = qcow2_io_read_meta(&q->io, buf, size, old_off);
	if (!r)
		r = qcow2_io_write_meta(&q->io, buf, size, new_off);
	return r;
}

/*
 * Return a writable L2 table (COPIED in L1) for guest offset @voff,
 * allocating it, or copying a table shared with a snapshot. The table is
 * written before its entry is set; the entry reaches the disk with the
 * next writeback, after the table and its refcount (qcow2_set_table_entry()), so
 * until a flush a crash leaves only the table and what it maps leaked:
 * nothing acknowledged as durable depends on it. No flush is waited for
 * here, with alloc_lock held. Called from workers.
 */
int qcow2_l2_for_write(struct qcow2 *q, u64 voff, u64 *l2_off)
{
	u64 idx = qcow2_l1_index(&q->hdr, voff), old_l2, new_l2, entry;
	const char *err;
	int r;

	mutex_lock(&q->alloc_lock);
	entry = READ_ONCE(q->l1[idx]);
	r = qcow2_l1_decode(&q->hdr, entry, &old_l2, &err);
	if (r) {
		r = qcow2_corrupt(q, voff, err);
		goto out;
	}
	if (old_l2 && (entry & QCOW2_OFLAG_COPIED)) {
		*l2_off = old_l2;
		goto out;
	}
	r = qcow2_alloc_locked(q, &new_l2);
	if (r)
		goto out_meta;
	r = write_new_l2(q, old_l2, new_l2);
	if (r) {
		qcow2_refcount_update_locked(q, new_l2, -1);
		goto out_meta;
	}
	qcow2_set_table_entry(q, &q->l1_dirty, q->l1, idx,
			      new_l2 | QCOW2_OFLAG_COPIED);
	qcow2_meta_mark(q, new_l2, QCOW2_META_L2, QCOW2_GFP_MARK);
	/*
	 * The old table stays the snapshot's. Our reference goes once the
	 * new entry is on disk: before, the old entry there would point at
	 * a table with refcount one and no COPIED flag, a corruption.
	 */
	if (old_l2)
		qcow2_defer_free(q, old_l2, q->hdr.cluster_size);
	*l2_off = new_l2;
out:
	mutex_unlock(&q->alloc_lock);
	return r;
out_meta:
	mutex_unlock(&q->alloc_lock);
	return meta_failed(q, r);
}

struct l2_change {
	u32 byte;
	u64 entry;
	u64 bitmap;
	bool extended;
};

static int l2_apply(void *data, void *arg)
{
	struct l2_change *lc = arg;
	__be64 *e = data + lc->byte;

	e[0] = cpu_to_be64(lc->entry);
	if (lc->extended)
		e[1] = cpu_to_be64(lc->bitmap);
	return 0;
}

/*
 * Point the L2 entry of @voff in the table at @l2_off to @entry; with
 * extended L2 entries, @bitmap is its subcluster bitmap (ignored
 * otherwise). Both words are in one slice: one change.
 */
int qcow2_set_l2_entry(struct qcow2 *q, u64 l2_off, u64 voff, u64 entry,
		       u64 bitmap)
{
	unsigned int slice = q->cache.slice_size;
	u64 byte = (u64)qcow2_l2_index(&q->hdr, voff) * q->hdr.l2_entry_size;
	struct l2_change lc = {
		.byte = byte & (slice - 1),
		.entry = entry,
		.bitmap = bitmap,
		.extended = q->hdr.extended_l2,
	};

	return qcow2_modify_slice(q, QCOW2_SLICE_L2, l2_off + round_down(byte, slice),
			    l2_apply, &lc);
}

void qcow2_alloc_init(struct qcow2 *q)
{
	INIT_LIST_HEAD(&q->frees);
	INIT_LIST_HEAD(&q->frees_ready);
	INIT_LIST_HEAD(&q->frees_grace);
	INIT_WORK(&q->grace_work, grace_work_fn);
	xa_init(&q->meta);
}

/*
 * Made with a writable table: the records of frees waiting for a
 * writeback (the reserve is what a writeback gives back) and a cluster
 * for new tables (alloc_lock).
 */
int qcow2_alloc_reserves(struct qcow2 *q)
{
	int r;

	r = qcow2_pool_init(&q->free_pool, QCOW2_FREE_RESERVE,
			    sizeof(struct qcow2_free));
	if (r)
		return r;
	q->alloc_buf = kvmalloc(q->hdr.cluster_size, GFP_KERNEL);
	return q->alloc_buf ? 0 : -ENOMEM;
}

/* Frees not applied by now leak: the image stays consistent. */
void qcow2_alloc_exit(struct qcow2 *q)
{
	struct qcow2_free *f, *tmp;

	xa_destroy(&q->meta);
	list_splice_init(&q->frees_ready, &q->frees);
	list_for_each_entry_safe(f, tmp, &q->frees, list)
		qcow2_pool_put(&q->free_pool, f);
	qcow2_pool_exit(&q->free_pool);
	kvfree(q->alloc_buf);
	q->alloc_buf = NULL;
}
