// SPDX-License-Identifier: GPL-2.0-only
/*
 * dm-qcow2: the image's metadata: opening and validating it, refcounts,
 * cluster allocation, L1/L2 table changes, and writing it all back in an
 * order that keeps the image consistent across a crash.
 *
 * Crash ordering (never weaker than QEMU's, see FORMAT.md):
 *  - A cluster's refcount is raised in the cache before any table entry
 *    points at it; qcow2_sync() writes refcount slices, flushes, then
 *    writes L2 slices and flushes, so no L2 entry reaches the disk before
 *    the refcount it depends on, nor before the data written to the
 *    cluster (all data writes had completed before the entry was set).
 *  - qcow2_sync() holds meta_sem exclusively while it writes, so the L2
 *    and refcount slices it writes are one consistent state.
 *  - Refcount decreases wait on the frees list until a qcow2_sync() has
 *    made the L2 change that dropped the reference durable, then for a
 *    grace period of the bios in flight (frees_after_grace()): a cluster
 *    is allocated again only once no bio mapped to it before is.
 *  - A new L2 table is written before its L1 entry is set in memory; the
 *    entry is written by the next qcow2_sync() with the L2 slices, after
 *    the flush that made the table and its refcount durable. A table it
 *    replaces (a snapshot's) loses our reference as a deferred free, once
 *    the new entry is on disk.
 *  - A new refcount block is written before its refcount table entry is
 *    set in memory; qcow2_sync() writes that entry after the refcount
 *    flush and flushes it before writing any L1 or L2 entry. A grown
 *    refcount table is written and flushed before the header points at
 *    it.
 * A crash can therefore leak clusters, never leave a reference to a
 * cluster whose refcount is zero.
 */
#include <linux/sched/mm.h>
#include <linux/slab.h>
#include <linux/vmalloc.h>

#include "dm-qcow2.h"

#define QCOW2_MAX_SLICE_SIZE	4096U
#define QCOW2_DEFAULT_CACHE	(4ULL << 20)

/* Records of frees kept in reserve (qcow2_defer_free()) */
#define QCOW2_FREE_RESERVE	256

struct qcow2_free {
	struct list_head list;
	u64 host;			/* first cluster */
	u64 count;			/* clusters */
};

/* ---- Errors ---- */

static const char *devname(struct qcow2 *q)
{
	return dm_table_device_name(q->ti->table);
}

static int write_header(struct qcow2 *q);

/*
 * Runs in process context (system workqueue, never behind our own sync
 * work) for dm_table_event(); marks a writable image corrupt on disk so
 * that QEMU will not trust it either.
 */
static void qcow2_event_work(struct work_struct *work)
{
	struct qcow2 *q = container_of(work, struct qcow2, event_work);

	if (q->writable && test_bit(QCOW2_F_CORRUPT, &q->flags) &&
	    !(q->hdr.incompatible_features & QCOW2_INCOMPAT_CORRUPT)) {
		mutex_lock(&q->alloc_lock);
		q->hdr.incompatible_features |= QCOW2_INCOMPAT_CORRUPT;
		if (write_header(q))
			DMERR("%s: cannot mark the image corrupt", devname(q));
		mutex_unlock(&q->alloc_lock);
	}
	dm_table_event(q->ti->table);
}

/*
 * The target only moves towards safety: rw -> ro -> fail, never back
 * while the table lives. True if this call moved it.
 */
static bool raise_mode(struct qcow2 *q, enum qcow2_mode mode)
{
	enum qcow2_mode old = READ_ONCE(q->mode), prev;

	while (old < mode) {
		prev = cmpxchg(&q->mode, old, mode);
		if (prev == old)
			return true;
		old = prev;
	}
	return false;
}

/*
 * Bad metadata met at run time: fail the I/O, say what was wrong, stop
 * writing, and raise a dm event so that monitoring notices. Reads that do
 * not meet the bad entry carry on.
 */
int qcow2_corrupt(struct qcow2 *q, u64 voff, const char *what)
{
	atomic64_inc(&q->corruptions);
	DMERR_LIMIT("%s: corrupt image: %s (guest offset %llu)",
		    devname(q), what, voff);
	if (!test_and_set_bit(QCOW2_F_CORRUPT, &q->flags)) {
		if (q->writable)
			raise_mode(q, QCOW2_MODE_RO);
		schedule_work(&q->event_work);
	}
	return -EUCLEAN;
}

/*
 * A metadata write or a flush failed: what the image holds is unknown,
 * and a later flush that succeeds would not make it known (a file
 * reports a writeback error to one fsync only). Fail mode until the table
 * is reloaded: the I/O layer writes no metadata and passes no flush any
 * more (qcow2_io_write_meta()), so no L1 or L2 entry reaches the disk
 * after a refcount write or flush that failed; ->map() fails every write
 * and flush; reads go on. One dm event.
 */
static bool enter_fail_mode(struct qcow2 *q)
{
	if (test_and_set_bit(QCOW2_F_META_ERROR, &q->flags))
		return false;
	qcow2_io_fail(&q->io);
	raise_mode(q, QCOW2_MODE_FAIL);
	/* Reads must not wait for slices that cannot be written any more */
	qcow2_cache_set_stuck(&q->cache);
	schedule_work(&q->event_work);
	return true;
}

void qcow2_meta_error(struct qcow2 *q, int err)
{
	if (enter_fail_mode(q))
		DMERR("%s: metadata write or flush failed (%d): writes, flushes fail",
		      devname(q), err);
}

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

#define QCOW2_META_L2		1UL
#define QCOW2_META_REFBLOCK	2UL

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
static int meta_mark(struct qcow2 *q, u64 off, unsigned long kind, gfp_t gfp)
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

/* ---- In-place writes of the header and of L1/refcount table entries ---- */

/* Write back the fields we change, then make them durable. */
static int write_header(struct qcow2 *q)
{
	const struct qcow2_header *h = &q->hdr;
	u8 *b = q->hdr_block;
	int r;

	if (!b)
		return -EIO;	/* a reload failed: see qcow2_reload_image() */
	qcow2_put_be64(b + QCOW2_HDR_SIZE_OFF, h->size);
	qcow2_put_be32(b + QCOW2_HDR_L1_SIZE_OFF, h->l1_size);
	qcow2_put_be64(b + QCOW2_HDR_L1_OFFSET_OFF, h->l1_table_offset);
	qcow2_put_be64(b + QCOW2_HDR_REFTABLE_OFF, h->refcount_table_offset);
	qcow2_put_be32(b + QCOW2_HDR_REFTABLE_CLUSTERS_OFF,
		       h->refcount_table_clusters);
	if (h->version >= 3) {
		qcow2_put_be64(b + QCOW2_HDR_INCOMPAT_OFF,
			       h->incompatible_features);
		qcow2_put_be64(b + QCOW2_HDR_AUTOCLEAR_OFF,
			       h->autoclear_features);
	}
	r = qcow2_io_write_meta(&q->io, b, q->meta_block, 0);
	if (!r)
		r = qcow2_io_flush(&q->io);
	return r;
}

/*
 * Write the block of an in-memory table (CPU byte order, padded to whole
 * blocks) that holds entry @idx, with that entry set to @val, at
 * @table_off in the image. The caller updates memory once it is durable.
 */
static int write_table_block(struct qcow2 *q, const u64 *table, u64 idx,
			     u64 val, u64 table_off)
{
	unsigned int per_block = q->meta_block / sizeof(u64), i;
	u64 first = round_down(idx, per_block);
	__be64 *buf = q->table_buf;
	int r;

	mutex_lock(&q->table_buf_lock);
	for (i = 0; i < per_block; i++)
		buf[i] = cpu_to_be64(first + i == idx ? val : table[first + i]);
	r = qcow2_io_write_meta(&q->io, buf, q->meta_block,
				table_off + first * sizeof(u64));
	mutex_unlock(&q->table_buf_lock);
	return r;
}

/* ---- Changes to cached slices ---- */

/*
 * Change a slice through @fn. The slice is pinned first (loading it may
 * wait for writeback), and meta_sem is held shared only around the change
 * itself, never across I/O, so qcow2_sync() sees either all or none of it.
 */
static int modify_slice(struct qcow2 *q, enum qcow2_slice_kind kind,
			u64 slice_off, int (*fn)(void *data, void *arg),
			void *arg)
{
	struct qcow2_slice *s;
	int r;

	s = qcow2_cache_pin(&q->cache, kind, slice_off);
	if (IS_ERR(s))
		return PTR_ERR(s);
	down_read(&q->meta_sem);
	r = qcow2_cache_modify(&q->cache, s, fn, arg);
	up_read(&q->meta_sem);
	qcow2_cache_unpin(&q->cache, s);
	return r;
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
 * may take it again. Called with alloc_lock held, which keeps allocation
 * away meanwhile.
 */
static void cluster_freed(struct qcow2 *q, u64 cluster)
{
	u64 off = cluster << q->hdr.cluster_bits;

	lockdep_assert_held(&q->alloc_lock);
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
static int refcount_update_locked(struct qcow2 *q, u64 host, int delta)
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
	r = modify_slice(q, QCOW2_SLICE_REFCOUNT, slice_off, refcount_apply,
			 &rc);
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
	r = refcount_update_locked(q, host, delta);
	mutex_unlock(&q->alloc_lock);
	return r;
}

/*
 * Queue a refcount decrease until the next qcow2_sync() has written the
 * L2 change that dropped the reference.
 */
static void kick_writeback(void *owner);

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
		kick_writeback(q);
	if (!f) {
		DMERR_LIMIT("%s: no memory to free the cluster at %llu: leaked",
			    devname(q), host);
		return;
	}
	f->host = host & ~mask;
	f->count = ((host & mask) + len + mask) >> q->hdr.cluster_bits;
	spin_lock(&q->lock);
	list_add_tail(&f->list, &q->frees);
	spin_unlock(&q->lock);
}

static void apply_frees(struct qcow2 *q, struct list_head *frees)
{
	struct qcow2_free *f, *tmp;
	u64 i;

	lockdep_assert_held(&q->alloc_lock);
	list_for_each_entry_safe(f, tmp, frees, list) {
		for (i = 0; i < f->count; i++) {
			u64 host = f->host + (i << q->hdr.cluster_bits);

			if (refcount_update_locked(q, host, -1))
				DMERR_LIMIT("%s: cannot free cluster at %llu",
					    devname(q), host);
		}
		list_del(&f->list);
		qcow2_pool_put(&q->free_pool, f);
	}
}

/* ---- Writeback ---- */

static bool dirty_any(struct qcow2_dirty *d)
{
	return READ_ONCE(d->first) <= READ_ONCE(d->last);
}

static void dirty_clear(struct qcow2 *q, struct qcow2_dirty *d)
{
	spin_lock(&q->lock);
	d->first = U64_MAX;
	d->last = 0;
	spin_unlock(&q->lock);
}

/*
 * Write the blocks of an in-memory @table (at @table_off in the image)
 * from the first to the last entry set since the last writeback (blocks
 * in between are rewritten as they are on disk). Called by sync_locked()
 * with meta_sem held for writing: no entry is set, and the table does
 * not move, meanwhile (see set_table_entry(), grow_reftable()).
 */
static int write_dirty_blocks(struct qcow2 *q, struct qcow2_dirty *d,
			      const u64 *table, u64 table_off)
{
	unsigned int per_block = q->meta_block / sizeof(u64);
	u64 first, last, i;
	int r = 0;

	spin_lock(&q->lock);
	first = d->first;
	last = d->last;
	spin_unlock(&q->lock);
	if (first > last)
		return 0;
	for (i = round_down(first, per_block); !r && i <= last; i += per_block)
		r = write_table_block(q, table, i, table[i], table_off);
	if (r)
		return r;
	/* Clean only once the writes are counted: see qcow2_meta_durable() */
	dirty_clear(q, d);
	return 0;
}

/*
 * New refcount blocks are durable (the caller flushed): write the
 * refcount table entries that point at them, and flush them before any
 * L1 or L2 entry that maps a cluster they count can reach the disk.
 */
static int write_reftable_dirty(struct qcow2 *q)
{
	int r;

	if (!dirty_any(&q->rt_dirty))
		return 0;
	r = write_dirty_blocks(q, &q->rt_dirty, q->reftable,
			       q->hdr.refcount_table_offset);
	return r ? r : qcow2_io_flush(&q->io);
}

/*
 * Make every write completed so far, and the metadata it needs, durable:
 * refcounts first, a flush, new refcount table entries and a flush if
 * any, then L1 entries and L2 tables, a flush. Then
 * apply the refcount decreases whose table changes are now on disk; they
 * are written by the next sync.
 */
static int sync_locked(struct qcow2 *q, struct list_head *frees, u64 ticket)
{
	int r;

	mutex_lock(&q->sync_lock);
	/* One that began after the caller took @ticket covers its writes */
	if (q->sync_done > ticket) {
		r = q->sync_result;
		mutex_unlock(&q->sync_lock);
		return r;
	}
	down_write(&q->meta_sem);
	/*
	 * Numbered with meta_sem held for writing: a slice change either
	 * came before this number (and this write-back covers it) or waits
	 * until the write-back is done (and its caller's ticket is this one).
	 */
	WRITE_ONCE(q->sync_started, q->sync_started + 1);
	r = qcow2_cache_write_dirty(&q->cache, QCOW2_SLICE_REFCOUNT);
	if (!r)
		r = qcow2_io_flush(&q->io);
	if (!r)
		r = write_reftable_dirty(q);
	if (!r && (qcow2_cache_nr_dirty(&q->cache) || dirty_any(&q->l1_dirty))) {
		r = write_dirty_blocks(q, &q->l1_dirty, q->l1,
				       q->hdr.l1_table_offset);
		if (!r)
			r = qcow2_cache_write_dirty(&q->cache, QCOW2_SLICE_L2);
		if (!r)
			r = qcow2_io_flush(&q->io);
	}
	if (!r) {
		spin_lock(&q->lock);
		list_splice_tail_init(&q->frees, frees);
		spin_unlock(&q->lock);
	}
	q->sync_done = q->sync_started;
	q->sync_result = r;
	up_write(&q->meta_sem);
	mutex_unlock(&q->sync_lock);
	if (r)
		qcow2_meta_error(q, r);
	return r;
}

/* ---- Frees after a grace period ---- */

static void grace_done(struct rcu_head *head);

/* Start a grace period for the frees ready, if none runs. Under q->lock. */
static void grace_start_locked(struct qcow2 *q)
{
	lockdep_assert_held(&q->lock);
	if (q->grace_pending || list_empty(&q->frees_ready))
		return;
	list_splice_tail_init(&q->frees_ready, &q->frees_grace);
	q->grace_pending = true;
	call_srcu(&q->io_srcu, &q->grace_rcu, grace_done);
}

/*
 * The grace period is over: no bio that began before it started is in
 * flight, so none may still reach the clusters of @frees_grace, whose
 * last mapping had gone before. Runs in softirq context: the refcount
 * changes sleep, so a worker applies them. Not on sync_wq: the work waits
 * for alloc_lock, whose holder may wait for room in the cache, that is
 * for the writeback sync_wq runs.
 */
static void grace_done(struct rcu_head *head)
{
	struct qcow2 *q = container_of(head, struct qcow2, grace_rcu);

	queue_work(q->meta_wq, &q->grace_work);
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
	apply_frees(q, &frees);
	mutex_unlock(&q->alloc_lock);
	memalloc_noio_restore(noio);
	spin_lock(&q->lock);
	q->grace_pending = false;
	grace_start_locked(q);
	spin_unlock(&q->lock);
}

/*
 * Hand refcount decreases whose table changes are durable to the grace
 * period machinery. Never waited for here: the caller may itself be
 * serving a bio (a FUA write), a reader of the grace period.
 */
static void frees_after_grace(struct qcow2 *q, struct list_head *frees)
{
	if (list_empty(frees))
		return;
	spin_lock(&q->lock);
	list_splice_tail_init(frees, &q->frees_ready);
	grace_start_locked(q);
	spin_unlock(&q->lock);
}

static bool grace_idle(struct qcow2 *q)
{
	bool idle;

	spin_lock(&q->lock);
	idle = !q->grace_pending;
	spin_unlock(&q->lock);
	return idle;
}

/*
 * Wait until every free handed over has been applied: for deactivation
 * (no bio in flight, so the grace periods are short) and teardown.
 */
void qcow2_frees_wait(struct qcow2 *q)
{
	if (!q->io_srcu_ready)
		return;
	while (!grace_idle(q)) {
		srcu_barrier(&q->io_srcu);
		flush_work(&q->grace_work);
	}
}

/*
 * Concurrent callers (a burst of FUA writes or flushes) share writebacks:
 * each waits for one that began after it came, rather than queueing one
 * of its own behind the rest. The refcount decreases it made durable are
 * applied after a grace period (frees_after_grace()).
 */
int qcow2_sync(struct qcow2 *q)
{
	LIST_HEAD(frees);
	u64 ticket;
	int r;

	/* The caller's writes are done before we read which sync is current */
	smp_mb();
	ticket = READ_ONCE(q->sync_started);
	r = sync_locked(q, &frees, ticket);
	frees_after_grace(q, &frees);
	return r;
}

/*
 * Is every mapping we made durable already? Then a FUA write to a cluster
 * we own needs no write-back before it, only its own data made durable.
 * Slices, and the dirty L1 and refcount table ranges, are marked clean
 * only after their write is counted (see qcow2_io_write_meta()), so none
 * dirty and every counted write flushed means the tables on disk say
 * what memory says.
 */
bool qcow2_meta_durable(struct qcow2 *q)
{
	return !qcow2_cache_nr_dirty(&q->cache) &&
	       !dirty_any(&q->l1_dirty) && !dirty_any(&q->rt_dirty) &&
	       qcow2_io_meta_flushed(&q->io);
}

static void sync_work_fn(struct work_struct *work)
{
	unsigned int noio = memalloc_noio_save();

	qcow2_sync(container_of(work, struct qcow2, sync_work));
	memalloc_noio_restore(noio);
}

static void kick_writeback(void *owner)
{
	struct qcow2 *q = owner;

	queue_work(q->sync_wq, &q->sync_work);
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
	r = write_header(q);
	if (r)
		return r;
	q->dirty_bit_set = true;
	return 0;
}

static u64 clusters_per_block(struct qcow2 *q)
{
	return 1ULL << qcow2_refblock_bits(&q->hdr);
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
	u64 c, per = clusters_per_block(q);
	void *buf = alloc_buf_zeroed(q);

	for (c = start; c < start + count; c++)
		if (c >= first && c < first + per)
			qcow2_refcount_set(buf, c - first,
					   q->hdr.refcount_order, 1);
	return buf;
}

/*
 * Put a new L1 or refcount table entry in memory, to be written by the
 * next writeback after the flush of the refcounts it depends on (see
 * sync_locked()). meta_sem keeps a writeback from starting in between:
 * one already begun writes neither the entry nor its range, one that
 * begins after writes both. Called with alloc_lock held.
 */
static void set_table_entry(struct qcow2 *q, struct qcow2_dirty *d,
			    u64 *table, u64 idx, u64 entry)
{
	lockdep_assert_held(&q->alloc_lock);
	down_read(&q->meta_sem);
	spin_lock(&q->lock);
	d->first = min(d->first, idx);
	d->last = max(d->last, idx);
	spin_unlock(&q->lock);
	/* Dirty before a bio can use the entry: see qcow2_meta_durable() */
	smp_wmb();
	WRITE_ONCE(table[idx], entry);
	up_read(&q->meta_sem);
}

/*
 * The refcount table has no block for the clusters around @cluster, which
 * is free: put the new block there, describing itself, and write it. Its
 * table entry is set in memory and reaches the disk with the next
 * writeback, after a flush that makes the block durable and before any
 * table entry that maps a cluster it counts. A crash before then leaves
 * the block unreferenced, and every cluster it counts unreferenced too.
 * No flush is waited for with alloc_lock held. Called with alloc_lock.
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
	set_table_entry(q, &q->rt_dirty, q->reftable, rt, off);
	atomic64_inc(&q->allocated);
	meta_mark(q, off, QCOW2_META_REFBLOCK, QCOW2_GFP_MARK);
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
 * write, then the old table's clusters are freed. Called with alloc_lock.
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
	r = write_header(q);
	if (r) {
		h->refcount_table_offset = old_off;
		h->refcount_table_clusters = old_clusters;
		up_read(&q->meta_sem);
		goto out_free;
	}
	swap(q->reftable, table);
	q->rt_entries = tc * per_cluster;
	dirty_clear(q, &q->rt_dirty);
	up_read(&q->meta_sem);
	for (i = 0; i < nb; i++)
		meta_mark(q, (start + i) << h->cluster_bits,
			  QCOW2_META_REFBLOCK, QCOW2_GFP_MARK);
	q->free_cursor = start + nb + tc;
	atomic64_add(nb + tc, &q->allocated);

	/* The header no longer points at the old table: free it */
	for (i = 0; i < old_clusters; i++)
		refcount_update_locked(q, old_off + (i << h->cluster_bits), -1);
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

	r = modify_slice(q, QCOW2_SLICE_REFCOUNT, slice_off,
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
		refcount_update_locked(q, off, -1);	/* give it back */
		return -ENOSPC;
	}
	if (overlaps_metadata(q, off, q->hdr.cluster_size) ||
	    xa_load(&q->meta, cluster))
		return qcow2_corrupt(q, 0, "metadata cluster has refcount zero");
	return 0;
}

static int alloc_locked(struct qcow2 *q, u64 *host)
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
		r = alloc_locked(q, &host[i]);
		if (r)
			break;
		end = max(end, host[i] + q->hdr.cluster_size);
	}
	while (r && i--)
		refcount_update_locked(q, host[i], -1);
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
 * next writeback, after the table and its refcount (set_table_entry()), so
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
	r = alloc_locked(q, &new_l2);
	if (r)
		goto out_meta;
	r = write_new_l2(q, old_l2, new_l2);
	if (r) {
		refcount_update_locked(q, new_l2, -1);
		goto out_meta;
	}
	set_table_entry(q, &q->l1_dirty, q->l1, idx,
			new_l2 | QCOW2_OFLAG_COPIED);
	meta_mark(q, new_l2, QCOW2_META_L2, QCOW2_GFP_MARK);
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

	return modify_slice(q, QCOW2_SLICE_L2, l2_off + round_down(byte, slice),
			    l2_apply, &lc);
}

/* ---- Opening ---- */

static int read_header(struct qcow2 *q, const char **err)
{
	u32 cluster_size;
	size_t len;
	void *buf;
	int r;

	len = min_t(u64, q->io.size, QCOW2_HEADER_PROBE_LEN);
	buf = kmalloc(QCOW2_HEADER_PROBE_LEN, GFP_KERNEL);
	if (!buf)
		return -ENOMEM;
	r = qcow2_io_read_meta(&q->io, buf, len, 0);
	if (!r)
		r = qcow2_header_probe(buf, len, &cluster_size, err);
	kfree(buf);
	if (r)
		return r;

	/* cluster_size is at most 2 MiB: checked by the probe */
	len = min_t(u64, q->io.size, cluster_size);
	buf = kvmalloc(len, GFP_KERNEL);
	if (!buf)
		return -ENOMEM;
	r = qcow2_io_read_meta(&q->io, buf, len, 0);
	if (!r)
		r = qcow2_header_parse(buf, len, &q->hdr, err);
	if (!r)
		r = qcow2_header_check_layout(&q->hdr, q->io.size, err);
	if (!r && q->hdr.extensions & QCOW2_HAS_BACKING_FORMAT &&
	    q->hdr.backing_format_offset + q->hdr.backing_format_len <= len) {
		memcpy(q->backing_fmt, buf + q->hdr.backing_format_offset,
		       q->hdr.backing_format_len);
		q->backing_fmt[q->hdr.backing_format_len] = 0;
	}
	if (!r && q->writable) {
		/* Header rewrites keep every byte we do not change */
		q->hdr_block = kmemdup(buf, q->meta_block, GFP_KERNEL);
		if (!q->hdr_block)
			r = -ENOMEM;
	}
	kvfree(buf);
	return r;
}

/*
 * The smallest piece of a cluster the paths write on their own: a
 * subcluster with extended L2 entries, else the cluster.
 */
static u32 qcow2_io_unit(const struct qcow2_header *h)
{
	return h->extended_l2 ? h->cluster_size >> ilog2(QCOW2_SUBCLUSTERS) :
				h->cluster_size;
}

/* Features that are valid qcow2 but that this target cannot serve yet. */
static int check_supported(struct qcow2 *q, const char **err)
{
	const struct qcow2_header *h = &q->hdr;

	if (h->crypt_method)
		*err = "Encrypted images are not supported";
	else if (h->incompatible_features & QCOW2_INCOMPAT_DATA_FILE)
		*err = "Images with an external data file are not supported";
	else if (q->io.dev && h->cluster_size < q->io.lbs)
		*err = "Cluster size smaller than the device's logical block size";
	else if (q->io.dev && qcow2_io_unit(h) < q->io.lbs)
		*err = "Subcluster size smaller than the device's logical block size";
	else
		return 0;
	return -EOPNOTSUPP;
}

/*
 * The images that tables serve, so that a table loaded for an image while
 * another table serves it (a reload: dmsetup load, then resume) can tell
 * the lazy-refcounts dirty bit that table set from one a crash left, and
 * so that a table knows whether another may have written its image since
 * it read it (QCOW2_F_STALE).
 */
static LIST_HEAD(live_images);
static DEFINE_MUTEX(live_lock);

/*
 * Join the list. Of two tables of one image, each must read the image
 * again before it resumes if the other one may write it.
 */
static void live_add(struct qcow2 *q)
{
	const void *key = qcow2_io_key(&q->io);
	struct qcow2 *o;

	mutex_lock(&live_lock);
	list_for_each_entry(o, &live_images, live) {
		if (qcow2_io_key(&o->io) != key)
			continue;
		if (q->writable)
			set_bit(QCOW2_F_STALE, &o->flags);
		if (o->writable)
			set_bit(QCOW2_F_STALE, &q->flags);
	}
	list_add(&q->live, &live_images);
	mutex_unlock(&live_lock);
}

static void live_del(struct qcow2 *q)
{
	if (list_empty(&q->live))
		return;
	mutex_lock(&live_lock);
	list_del_init(&q->live);
	mutex_unlock(&live_lock);
}

/* Does a live table of the same image hold the dirty bit it set? */
static bool dirty_bit_is_live(struct qcow2 *q)
{
	const void *key = qcow2_io_key(&q->io);
	struct qcow2 *o;
	bool ours = false;

	mutex_lock(&live_lock);
	list_for_each_entry(o, &live_images, live)
		if (o != q && qcow2_io_key(&o->io) == key &&
		    READ_ONCE(o->dirty_bit_set))
			ours = true;
	mutex_unlock(&live_lock);
	return ours;
}

/*
 * Header bits that forbid writing. A dirty bit is accepted at table load
 * when the live table of the same image set it: that table clears it
 * when it is suspended, before this one resumes and reads the image
 * again (then the bit is refused like any other).
 */
static int check_writable(struct qcow2 *q, const char **err)
{
	u64 bits = q->hdr.incompatible_features;

	if (!q->writable)
		return 0;
	if (bits & QCOW2_INCOMPAT_CORRUPT)
		*err = "Image is marked corrupt: run qemu-img check -r all, or activate read-only";
	else if (bits & QCOW2_INCOMPAT_DIRTY &&
		 (q->resumed || !dirty_bit_is_live(q)))
		*err = "Image is dirty (lazy refcounts): run qemu-img check -r all";
	else
		return 0;
	return -EROFS;
}

/* ---- Internal snapshots ---- */

/* Does the entry at @b (parsed as @s) have @want as its id or its name? */
static bool snapshot_matches(const u8 *b, const struct qcow2_snapshot *s,
			     const char *want)
{
	size_t n = strlen(want);

	return (s->id_len == n && !memcmp(b + s->id_off, want, n)) ||
	       (s->name_len == n && !memcmp(b + s->name_off, want, n));
}

/* Read the entry at @off into a new buffer, parse it into @s. */
static int read_snapshot(struct qcow2 *q, u64 off, u8 **buf, u32 *len,
			 struct qcow2_snapshot *s, const char **err)
{
	u8 fixed[QCOW2_SNAPSHOT_HEADER_LEN];
	int r;

	*buf = NULL;
	r = qcow2_io_read_meta(&q->io, fixed, sizeof(fixed), off);
	if (!r)
		r = qcow2_snapshot_entry_len(fixed, len, err);
	if (r)
		return r;
	*buf = kmalloc(*len, GFP_KERNEL);
	if (!*buf)
		return -ENOMEM;
	r = qcow2_io_read_meta(&q->io, *buf, *len, off);
	if (!r)
		r = qcow2_snapshot_parse(&q->hdr, *buf, *len, s, err);
	return r;
}

/*
 * Serve the snapshot the table names (read-only tables only): find it by
 * id or name, then use its L1 table and virtual size. The walk is bounded
 * by the header's snapshot count and by QCOW2_MAX_SNAPSHOT_TABLE bytes.
 */
static int load_snapshot(struct qcow2 *q, const char **err)
{
	struct qcow2_header *h = &q->hdr;
	u64 off = h->snapshots_offset, span;
	struct qcow2_snapshot s;
	u32 i, len;
	bool found = false;
	u8 *buf;
	int r = 0;

	for (i = 0; i < h->nb_snapshots && !found && !r; i++) {
		if (off - h->snapshots_offset > QCOW2_MAX_SNAPSHOT_TABLE) {
			*err = "Snapshot table too large (max 64 MiB)";
			return -EINVAL;
		}
		r = read_snapshot(q, off, &buf, &len, &s, err);
		if (r == -EIO)
			*err = "Cannot read the snapshot table";
		found = !r && snapshot_matches(buf, &s, q->snapshot);
		kfree(buf);
		off += len;
	}
	if (r)
		return r;
	if (!found) {
		*err = "No snapshot with that id or name";
		return -ENOENT;
	}
	h->l1_table_offset = s.l1_table_offset;
	h->l1_size = s.l1_size;
	if (s.disk_size)
		h->size = s.disk_size;
	span = qcow2_l2_coverage(h);
	if (div64_u64(h->size, span) + !!(h->size % span) > h->l1_size ||
	    h->l1_table_offset < h->cluster_size ||
	    h->l1_table_offset + (u64)h->l1_size * sizeof(u64) > q->io.size) {
		*err = "Snapshot L1 table too small, over the header or past the end";
		return -EINVAL;
	}
	return 0;
}

/*
 * Remember where the L2 tables are. Entries that do not decode are left
 * to the lookups, which fail the I/O that meets them.
 */
static void mark_l2_tables(struct qcow2 *q)
{
	const char *err;
	u64 l2;
	u32 i;

	xa_destroy(&q->meta);
	for (i = 0; i < q->l1_loaded; i++)
		if (!qcow2_l1_decode(&q->hdr, q->l1[i], &l2, &err) && l2)
			meta_mark(q, l2, QCOW2_META_L2, GFP_KERNEL);
}

static u64 *load_table(struct qcow2 *q, u64 off, u32 entries, u32 padded);

/*
 * A read-only table does not keep the refcounts, but it still must not
 * serve a refcount block as data: remember where the blocks are.
 */
static void mark_refblocks_ro(struct qcow2 *q)
{
	const struct qcow2_header *h = &q->hdr;
	u32 n = ((u64)h->refcount_table_clusters << h->cluster_bits) /
		sizeof(u64), i;
	const char *err;
	u64 *rt, block;

	rt = load_table(q, h->refcount_table_offset, n, n);
	if (!rt)
		return;		/* the lookups still check everything else */
	for (i = 0; i < n; i++)
		if (!qcow2_reftable_decode(h, rt[i], &block, &err) && block)
			meta_mark(q, block, QCOW2_META_REFBLOCK, GFP_KERNEL);
	kvfree(rt);
}

/* Load a table of @entries (CPU byte order), padded to whole blocks. */
static u64 *load_table(struct qcow2 *q, u64 off, u32 entries, u32 padded)
{
	u64 *t = kvcalloc(padded, sizeof(u64), GFP_KERNEL);
	u32 i;

	if (!t)
		return NULL;
	if (entries &&
	    qcow2_io_read_meta(&q->io, t, entries * sizeof(u64), off)) {
		kvfree(t);
		return NULL;
	}
	for (i = 0; i < entries; i++)
		t[i] = be64_to_cpu((__force __be64)t[i]);
	return t;
}

/*
 * The L1 entries that map the virtual size, rounded up to whole blocks
 * (never past the table) so that in-place writes rewrite only real
 * entries.
 */
static int load_l1(struct qcow2 *q)
{
	const struct qcow2_header *h = &q->hdr;
	u64 span = qcow2_l2_coverage(h);
	u32 per_block = q->meta_block / sizeof(u64);

	q->l1_entries = div64_u64(h->size, span) + !!(h->size % span);
	q->l1_loaded = min(h->l1_size, round_up(q->l1_entries, per_block));
	q->l1 = load_table(q, h->l1_table_offset, q->l1_loaded,
			   round_up(max(q->l1_loaded, 1U), per_block));
	/* What is in memory is what is on disk (a reload follows a sync) */
	dirty_clear(q, &q->l1_dirty);
	return q->l1 ? 0 : -EIO;
}

/*
 * At most this much of the refcount blocks, and this many blocks, are
 * read at table load and at each resume (a whole image of 2 TiB at
 * 64 KiB clusters, 64 GiB at 4 KiB, with 16-bit refcounts): a hostile
 * image whose refcount table names a million blocks must not make
 * dmsetup create read terabytes, or make a million reads.
 */
#define QCOW2_SCAN_MAX_BYTES	SZ_64M
#define QCOW2_SCAN_MAX_BLOCKS	8192

/* Count the in-use entries of one refcount block, and where they end. */
static void scan_block(struct qcow2 *q, const void *buf, u64 first,
		       u64 *n, u64 *end, u64 *first_free)
{
	u64 per = clusters_per_block(q), i;

	for (i = 0; i < per; i++) {
		if (qcow2_refcount_get(buf, i, q->hdr.refcount_order)) {
			(*n)++;
			*end = first + i + 1;
		} else if (*first_free == ~0ULL && first + i) {
			*first_free = first + i;
		}
	}
}

/*
 * Check and remember every refcount block, count the allocated clusters
 * and find the first free one, reading each block once. Only writable
 * tables need it. Blocks that describe only clusters past the end of the
 * image are not read (nothing can lie there yet), nor any past the
 * QCOW2_SCAN_MAX_* bounds: then the count is partial (the status shows "-")
 * and the allocator reads the rest as it needs it, through the cache.
 */
static int scan_refcounts(struct qcow2 *q, const char **err)
{
	const struct qcow2_header *h = &q->hdr;
	u64 per = clusters_per_block(q), block, n = 0, first_free = ~0ULL;
	u64 end = 0, read = 0;
	u64 clusters = DIV_ROUND_UP(q->io.size, h->cluster_size);
	void *buf;
	u32 rt;
	int r = 0;

	buf = kvmalloc(h->cluster_size, GFP_KERNEL);
	if (!buf)
		return -ENOMEM;
	q->refcounts_partial = false;
	for (rt = 0; rt < q->rt_entries && !r; rt++) {
		r = qcow2_reftable_decode(h, q->reftable[rt], &block, err);
		if (r || !block) {
			if (!r && first_free == ~0ULL)
				first_free = max_t(u64, (u64)rt * per, 1);
			continue;
		}
		if (qcow2_host_cluster_check(q, block)) {
			*err = "Refcount block outside the image or over metadata";
			r = -EINVAL;
			break;
		}
		if (meta_mark(q, block, QCOW2_META_REFBLOCK, GFP_KERNEL)) {
			*err = "Refcount block used twice, or at an L2 table";
			r = -EINVAL;
			break;
		}
		if ((u64)rt * per >= clusters ||
		    read + h->cluster_size > QCOW2_SCAN_MAX_BYTES ||
		    read >= (u64)QCOW2_SCAN_MAX_BLOCKS * h->cluster_size) {
			/* Not read: the allocator looks there itself */
			if (first_free == ~0ULL)
				first_free = (u64)rt * per;
			if ((u64)rt * per < clusters)
				q->refcounts_partial = true;
			continue;
		}
		read += h->cluster_size;
		r = qcow2_io_read_meta(&q->io, buf, h->cluster_size, block);
		if (!r)
			scan_block(q, buf, (u64)rt * per, &n, &end, &first_free);
	}
	kvfree(buf);
	if (r == -EUCLEAN)
		r = -EINVAL;
	atomic64_set(&q->allocated, n);
	/* Past what was read, anything below the image's end may be in use */
	q->end_cluster = q->refcounts_partial ? max(end, clusters) : end;
	q->free_cursor = first_free == ~0ULL ? (u64)q->rt_entries * per :
					       first_free;
	return r;
}

static int load_refcounts(struct qcow2 *q, const char **err)
{
	const struct qcow2_header *h = &q->hdr;

	q->rt_entries = ((u64)h->refcount_table_clusters << h->cluster_bits) /
			sizeof(u64);
	q->reftable = load_table(q, h->refcount_table_offset, q->rt_entries,
				 q->rt_entries);
	if (!q->reftable) {
		*err = "Cannot read the refcount table";
		return -EIO;
	}
	dirty_clear(q, &q->rt_dirty);
	return scan_refcounts(q, err);
}

static int alloc_workqueues(struct qcow2 *q)
{
	q->meta_wq = alloc_workqueue("kqcow2m", WQ_MEM_RECLAIM | WQ_UNBOUND,
				     0);
	q->zero_wq = alloc_workqueue("kqcow2z", WQ_MEM_RECLAIM | WQ_UNBOUND,
				     0);
	q->sync_wq = alloc_workqueue("kqcow2s", WQ_MEM_RECLAIM, 1);
	if (!q->meta_wq || !q->zero_wq || !q->sync_wq)
		return -ENOMEM;
	if (init_srcu_struct(&q->io_srcu))
		return -ENOMEM;
	q->io_srcu_ready = true;
	if (!q->io.file)
		return 0;
	/*
	 * Unbound, as the loop driver's: a bound worker runs on the CPU that
	 * queued the bio, behind the submitter, while other CPUs idle.
	 */
	q->io.wq = alloc_workqueue("kqcow2io", WQ_MEM_RECLAIM | WQ_UNBOUND, 0);
	return q->io.wq ? 0 : -ENOMEM;
}

static void init_state(struct qcow2 *q)
{
	unsigned int i;

	mutex_init(&q->alloc_lock);
	mutex_init(&q->sync_lock);
	mutex_init(&q->table_buf_lock);
	init_rwsem(&q->meta_sem);
	spin_lock_init(&q->lock);
	for (i = 0; i < ARRAY_SIZE(q->inflight); i++)
		INIT_HLIST_HEAD(&q->inflight[i]);
	init_waitqueue_head(&q->inflight_wait);
	INIT_LIST_HEAD(&q->frees);
	INIT_LIST_HEAD(&q->live);
	INIT_LIST_HEAD(&q->frees_ready);
	INIT_LIST_HEAD(&q->frees_grace);
	INIT_WORK(&q->grace_work, grace_work_fn);
	INIT_WORK(&q->event_work, qcow2_event_work);
	INIT_WORK(&q->sync_work, sync_work_fn);
	qcow2_zip_init(&q->zip);
	xa_init(&q->meta);
	q->test_hold_sector = (sector_t)-1;
	bio_list_init(&q->test_held);
	q->mode = q->writable ? QCOW2_MODE_RW : QCOW2_MODE_RO;
	/* Block devices need whole logical blocks; files take 512 bytes */
	q->meta_block = q->io.dev ? max_t(unsigned int, q->io.lbs, 512) : 512;
}

static int init_cache(struct qcow2 *q)
{
	unsigned int slice;
	int r;

	if (!q->cache_bytes)
		q->cache_bytes = QCOW2_DEFAULT_CACHE;
	/* Block device reads must be whole logical blocks (<= cluster size) */
	slice = min(q->hdr.cluster_size, QCOW2_MAX_SLICE_SIZE);
	if (q->io.dev)
		slice = max(slice, q->io.lbs);
	r = qcow2_cache_init(&q->cache, &q->io, slice, q->cache_bytes);
	q->cache.kick_writeback = kick_writeback;
	q->cache.owner = q;
	return r;
}

/*
 * Read and validate the header, L1 table and (writable) refcounts. Used at
 * table load, and again before each resume: a table loaded while another
 * table on the same image was live must not trust what it read then.
 */
static int load_metadata(struct qcow2 *q, const char **err)
{
	int r;

	kvfree(q->l1);
	kvfree(q->reftable);
	kfree(q->hdr_block);
	q->l1 = NULL;
	q->reftable = NULL;
	q->hdr_block = NULL;

	r = read_header(q, err);
	if (r) {
		if (r != -EINVAL)
			*err = "Cannot read the image header";
		return r;
	}
	r = check_supported(q, err);
	if (!r)
		r = check_writable(q, err);
	if (r)
		return r;
	if (q->hdr.incompatible_features & QCOW2_INCOMPAT_CORRUPT)
		DMWARN("%s: image is marked corrupt; serving it read-only",
		       devname(q));
	if (q->snapshot) {
		r = load_snapshot(q, err);
		if (r)
			return r;
	}

	/* Direct I/O below the (sub)cluster granularity cannot be aligned */
	if (q->io.file && qcow2_io_unit(&q->hdr) < q->io.lbs)
		q->io.dio = false;

	r = load_l1(q);
	if (r) {
		*err = "Cannot read the L1 table";
		return r;
	}
	mark_l2_tables(q);
	if (!q->writable)
		mark_refblocks_ro(q);
	if (q->writable)
		r = load_refcounts(q, err);
	return r;
}

/* A writer must clear the autoclear bits it does not maintain (bitmaps). */
static int clear_autoclear(struct qcow2 *q)
{
	if (!q->writable || !q->hdr.autoclear_features)
		return 0;
	q->hdr.autoclear_features = 0;
	return write_header(q);
}

/* ---- Online grow ---- */

/* 64 bits: a huge @size must not wrap into a small table */
static u64 l1_needed(const struct qcow2_header *h, u64 size)
{
	u64 span = qcow2_l2_coverage(h);

	return div64_u64(size, span) + !!(size % span);
}

/*
 * Can the image grow to @size bytes? Up to the largest L1 table we load
 * (QCOW2_MAX_L1_BYTES: 256 PiB at 64 KiB clusters); beyond the clusters
 * the L1 table occupies now, it moves (grow_l1_moved()).
 */
int qcow2_grow_check(struct qcow2 *q, u64 size, const char **err)
{
	if (l1_needed(&q->hdr, size) > QCOW2_MAX_L1_BYTES / sizeof(u64)) {
		*err = "Growing this much needs an L1 table over 32 MiB";
		return -EOPNOTSUPP;
	}
	return 0;
}

/*
 * Take @n contiguous clusters for a table. The allocator hands out the
 * lowest free cluster, so start past the last cluster in use, where the
 * run is free unless a new refcount block lands in it: then start again
 * after it, keeping the clusters taken so far (@spare) to give back at
 * the end (giving them back now would move the cursor back onto them).
 * Called with alloc_lock.
 */
#define QCOW2_MAX_RESTARTS	8

static int alloc_run(struct qcow2 *q, u32 n, u64 *start)
{
	u32 bits = q->hdr.cluster_bits, got = 0, nr_spare = 0, i;
	u64 cursor = q->free_cursor, spare[QCOW2_MAX_RESTARTS + 1][2], host;
	int r = 0;

	lockdep_assert_held(&q->alloc_lock);
	q->free_cursor = max(cursor, q->end_cluster);
	while (got < n) {
		r = alloc_locked(q, &host);
		if (r)
			break;
		if (got && host != *start + ((u64)got << bits)) {
			if (nr_spare == QCOW2_MAX_RESTARTS) {
				refcount_update_locked(q, host, -1);
				r = -ENOSPC;
				break;
			}
			spare[nr_spare][0] = *start;
			spare[nr_spare++][1] = got;
			got = 0;
		}
		if (!got)
			*start = host;
		got++;
	}
	if (r && got) {
		spare[nr_spare][0] = *start;	/* room kept for this one */
		spare[nr_spare++][1] = got;
	}
	for (i = 0; i < nr_spare; i++)
		for (got = 0; got < spare[i][1]; got++)
			refcount_update_locked(q, spare[i][0] +
					       ((u64)got << bits), -1);
	q->free_cursor = min(q->free_cursor, cursor);
	return r;
}

/*
 * Grow to @size with an L1 table of @need entries in new clusters: the
 * table (old entries, the rest zeros) and its refcounts are written and
 * flushed, then the header takes the new size, L1 offset and L1 size in
 * one sector write, then the old table's clusters are freed. A crash
 * before the header write leaves the old image and a leak. Called with
 * alloc_lock, the device suspended: no bio reads q->l1 meanwhile.
 */
static int grow_l1_moved(struct qcow2 *q, u64 size, u32 need, u64 **l1)
{
	struct qcow2_header *h = &q->hdr;
	u32 n = DIV_ROUND_UP(need * sizeof(u64), h->cluster_size), i;
	u64 old_off = h->l1_table_offset, start;
	u32 old_n = DIV_ROUND_UP(h->l1_size * sizeof(u64), h->cluster_size);
	struct qcow2_header saved = *h;
	LIST_HEAD(frees);
	__be64 *buf;
	int r;

	r = alloc_run(q, n, &start);
	if (r)
		return r;
	buf = kvzalloc((size_t)n << h->cluster_bits, GFP_KERNEL);
	if (!buf) {
		r = -ENOMEM;
		goto undo;
	}
	for (i = 0; i < h->l1_size; i++)
		buf[i] = cpu_to_be64((*l1)[i]);
	r = qcow2_io_write_meta(&q->io, buf, (size_t)n << h->cluster_bits,
				start);
	kvfree(buf);
	if (!r)
		r = sync_locked(q, &frees, U64_MAX);
	apply_frees(q, &frees);
	if (r)
		goto undo;
	h->size = size;
	h->l1_table_offset = start;
	h->l1_size = need;
	r = write_header(q);
	if (r) {
		*h = saved;
		goto undo;
	}
	for (i = 0; old_off && i < old_n; i++)
		refcount_update_locked(q, old_off + ((u64)i << h->cluster_bits),
				       -1);
	return 0;
undo:
	for (i = 0; i < n; i++)
		refcount_update_locked(q, start + ((u64)i << h->cluster_bits),
				       -1);
	return r;
}

/*
 * Grow the virtual size at resume, the device suspended. Within the L1
 * table's clusters, new L1 entries are written as zeros first (the rest
 * of the cluster may hold anything) and flushed; then the header takes
 * the new size and L1 size in one sector write. A crash in between
 * leaves the old size. A larger table moves (grow_l1_moved()).
 */
static int grow_locked(struct qcow2 *q, u64 size)
{
	struct qcow2_header *h = &q->hdr;
	u32 per_block = q->meta_block / sizeof(u64);
	u32 need, old = h->l1_size, i;
	u64 room = round_up((u64)old * sizeof(u64), h->cluster_size);
	u64 old_size = h->size, *l1;
	const char *err;
	int r;

	r = qcow2_grow_check(q, size, &err);
	if (r)
		return r;
	need = l1_needed(h, size);	/* fits: checked */
	l1 = load_table(q, h->l1_table_offset, old,
			round_up(max(need, old), per_block));
	if (!l1)
		return -EIO;
	if (need > room / sizeof(u64)) {
		r = grow_l1_moved(q, size, need, &l1);
		if (r)
			goto out;
		goto done;
	}
	for (i = round_down(old, per_block); !r && i < need; i += per_block)
		r = write_table_block(q, l1, i, l1[i], h->l1_table_offset);
	if (!r)
		r = qcow2_io_flush(&q->io);
	if (r)
		goto out;
	h->size = size;
	h->l1_size = max(need, old);
	r = write_header(q);
	if (r) {
		h->size = old_size;
		h->l1_size = old;
		goto out;
	}
done:
	swap(q->l1, l1);
	q->l1_entries = need;
	q->l1_loaded = h->l1_size;
	DMINFO("%s: virtual size grown to %llu bytes", devname(q), size);
out:
	kvfree(l1);
	return r;
}

/*
 * Has the header block on disk changed since this table last read or wrote
 * it (a program wrote the image while the device was suspended)? Read
 * into the preallocated table_buf: nothing is allocated. A read-only table
 * never writes: it does not look.
 */
static bool header_changed(struct qcow2 *q)
{
	bool changed = true;

	if (!q->writable || !q->hdr_block)
		return false;
	mutex_lock(&q->table_buf_lock);
	if (!qcow2_io_read_meta(&q->io, q->table_buf, q->meta_block, 0))
		changed = memcmp(q->table_buf, q->hdr_block, q->meta_block);
	mutex_unlock(&q->table_buf_lock);
	return changed;
}

/*
 * Before a resume: see load_metadata(). Our own dirty metadata was written
 * at suspend. When another table of the image may have written it since
 * (QCOW2_F_STALE, see live_add()), or its header block changed, the
 * tables are read again and cached slices go; the geometry must not have
 * changed under us.
 */
int qcow2_reload_image(struct qcow2 *q)
{
	struct qcow2_header old = q->hdr;
	const char *err = NULL;
	unsigned int noio;
	bool stale;
	int r = 0;

	/*
	 * The device is suspended: reclaim that writes to it (swap, a file
	 * system's writeback) would wait for this resume. Every allocation
	 * below is GFP_NOIO, and there are none unless another table may
	 * have written the image since this one read it (a table reload),
	 * or its header changed: a plain resume, or the first one after
	 * dmsetup create, reads the header block and nothing else.
	 */
	noio = memalloc_noio_save();
	mutex_lock(&q->alloc_lock);
	q->resumed = true;
	stale = test_and_clear_bit(QCOW2_F_STALE, &q->flags);
	if (!stale)
		stale = header_changed(q);
	if (stale) {
		qcow2_io_resync(&q->io);
		r = load_metadata(q, &err);
	}
	if (!r && (old.cluster_bits != q->hdr.cluster_bits ||
		   old.size != q->hdr.size ||
		   old.refcount_order != q->hdr.refcount_order)) {
		err = "the image's geometry changed";
		r = -EINVAL;
	}
	if (!r && stale) {
		qcow2_cache_invalidate(&q->cache);
		qcow2_zip_invalidate(&q->zip);
	}
	if (!r) {
		r = clear_autoclear(q);
		err = "cannot write the image header";
	}
	if (!r && q->grow_to > q->hdr.size) {
		r = grow_locked(q, q->grow_to);
		err = "cannot grow the image";
	}
	mutex_unlock(&q->alloc_lock);
	memalloc_noio_restore(noio);
	if (r) {
		DMERR("%s: cannot resume: %s", devname(q),
		      err ? err : "cannot read the image");
		/*
		 * The tables in memory are gone or half loaded: nothing may
		 * be written from them, at teardown either.
		 */
		enter_fail_mode(q);
	}
	return r;
}

/*
 * What allocating clusters and writing tables back need, made with the
 * table: the records of frees waiting for a writeback (the reserve is
 * what a writeback gives back), a cluster for new tables (alloc_lock)
 * and a block for in-place table writes (table_buf_lock).
 */
static int init_reserves(struct qcow2 *q)
{
	int r;

	r = qcow2_pool_init(&q->free_pool, QCOW2_FREE_RESERVE,
			    sizeof(struct qcow2_free));
	if (r)
		return r;
	q->alloc_buf = kvmalloc(q->hdr.cluster_size, GFP_KERNEL);
	q->table_buf = kmalloc(q->meta_block, GFP_KERNEL);
	return q->alloc_buf && q->table_buf ? 0 : -ENOMEM;
}

/*
 * Read and validate everything needed to serve the image. On failure
 * *err says why, for ti->error; the caller unwinds with
 * qcow2_close_image(). Nothing is written before every check passed.
 */
int qcow2_open_image(struct qcow2 *q, const char **err)
{
	int r;

	init_state(q);
	r = load_metadata(q, err);
	if (r)
		return r;
	r = init_cache(q);
	if (!r)
		r = alloc_workqueues(q);
	if (!r)
		r = qcow2_zip_setup(q);
	if (!r && q->writable)
		r = init_reserves(q);
	if (r) {
		*err = "Cannot allocate memory";
		return r;
	}
	live_add(q);
	return 0;
}

/* ---- The backing chain ---- */

/* Is the backing image below @cur qcow2? Its header says, or its magic. */
static int backing_is_qcow2(struct qcow2 *cur, struct qcow2 *b, bool *qcow2,
			    const char **err)
{
	__be32 magic;
	int r;

	if (!strcmp(cur->backing_fmt, "qcow2") ||
	    !strcmp(cur->backing_fmt, "raw")) {
		*qcow2 = cur->backing_fmt[0] == 'q';
		return 0;
	}
	if (cur->backing_fmt[0]) {
		*err = "Backing format not supported (raw and qcow2 are)";
		return -EOPNOTSUPP;
	}
	*qcow2 = false;
	if (b->io.size < sizeof(magic))
		return 0;
	r = qcow2_io_read_meta(&b->io, &magic, sizeof(magic), 0);
	if (r) {
		*err = "Cannot read a backing image";
		return r;
	}
	*qcow2 = be32_to_cpu(magic) == QCOW2_MAGIC;
	return 0;
}

static int open_layer(struct qcow2 *cur, struct qcow2 *b, const char *path,
		      const char **err)
{
	bool qcow2;
	int r;

	r = qcow2_io_open(b->ti, &b->io, path, false);
	/* Even on failure: qcow2_close_image() expects the lists and works */
	init_state(b);
	if (r) {
		*err = b->ti->error;
		return r;
	}
	r = backing_is_qcow2(cur, b, &qcow2, err);
	if (r)
		return r;
	if (!qcow2) {
		b->raw = true;
		b->hdr.size = b->io.size;
		return 0;
	}
	r = load_metadata(b, err);
	if (!r && (init_cache(b) || qcow2_zip_setup(b))) {
		*err = "Cannot allocate memory";
		r = -ENOMEM;
	}
	return r;
}

/*
 * Open the backing images the table names. The chain must be exactly
 * what the headers declare: every qcow2 layer with a backing file has
 * the next one named, and none is named beyond the last. The kernel
 * never opens a name found inside an image.
 */
static const char chain_unnamed_top[] =
	"The image has a backing file: name it with the backing feature argument";
static const char chain_unnamed[] =
	"A backing image has a backing file that the table does not name";
static const char chain_too_long[] =
	"The table names more backing images than the chain has";
static const char chain_none[] =
	"The table names a backing image but the image has no backing file";

int qcow2_open_chain(struct qcow2 *q, const char **err)
{
	struct qcow2 *cur = q, *b;
	unsigned int i;
	bool declared;
	int r;

	for (i = 0; ; i++) {
		declared = !cur->raw && cur->hdr.backing_file_offset &&
			   cur->hdr.backing_file_size;
		if (i == q->nr_backing && !declared)
			return 0;
		if (i == q->nr_backing) {
			*err = i ? chain_unnamed : chain_unnamed_top;
			return -EINVAL;
		}
		if (!declared) {
			*err = i ? chain_too_long : chain_none;
			return -EINVAL;
		}
		b = kzalloc(sizeof(*b), GFP_KERNEL);
		if (!b) {
			*err = "Cannot allocate memory";
			return -ENOMEM;
		}
		b->ti = q->ti;
		b->cache_bytes = q->cache_bytes;
		cur->backing = b;	/* freed with the top image */
		r = open_layer(cur, b, q->backing_paths[i], err);
		if (r) {
			DMERR("%s: backing image %u (%s): %s", devname(q),
			      i + 1, q->backing_paths[i], *err);
			return r;
		}
		cur = b;
	}
}

/*
 * Clean deactivation: all metadata written, then the lazy-refcounts dirty
 * bit cleared. Failing, the image is left dirty and says so.
 */
int qcow2_deactivate(struct qcow2 *q)
{
	int r;

	if (!q->writable || test_bit(QCOW2_F_META_ERROR, &q->flags))
		return 0;
	r = qcow2_sync(q);
	/*
	 * The frees that sync made ready are applied after a grace period,
	 * short now that no bio is in flight, and need one more pass to
	 * reach the disk.
	 */
	qcow2_frees_wait(q);
	if (!r && qcow2_cache_nr_dirty(&q->cache))
		r = qcow2_sync(q);
	mutex_lock(&q->alloc_lock);
	if (!r && q->dirty_bit_set) {
		q->hdr.incompatible_features &= ~QCOW2_INCOMPAT_DIRTY;
		r = write_header(q);
		if (!r)
			q->dirty_bit_set = false;
	}
	if (!r)
		qcow2_io_trim(&q->io);
	mutex_unlock(&q->alloc_lock);
	return r;
}

void qcow2_close_image(struct qcow2 *q)
{
	struct qcow2_free *f, *tmp;

	if (q->backing) {
		qcow2_close_image(q->backing);
		qcow2_io_close(q->ti, &q->backing->io);
		kfree(q->backing);
		q->backing = NULL;
	}

	live_del(q);
	/* Frees still waiting for a grace period need meta_wq */
	qcow2_frees_wait(q);
	if (q->io_srcu_ready)
		cleanup_srcu_struct(&q->io_srcu);
	q->io_srcu_ready = false;
	if (q->io.wq)
		destroy_workqueue(q->io.wq);
	if (q->zero_wq)
		destroy_workqueue(q->zero_wq);
	if (q->meta_wq)
		destroy_workqueue(q->meta_wq);
	if (q->sync_wq)
		destroy_workqueue(q->sync_wq);
	flush_work(&q->event_work);
	if (q->cache.hash)
		qcow2_cache_exit(&q->cache);
	qcow2_zip_exit(&q->zip);
	xa_destroy(&q->meta);
	list_splice_init(&q->frees_ready, &q->frees);
	list_for_each_entry_safe(f, tmp, &q->frees, list)
		qcow2_pool_put(&q->free_pool, f);
	qcow2_pool_exit(&q->free_pool);
	kvfree(q->alloc_buf);
	kfree(q->table_buf);
	q->alloc_buf = NULL;
	q->table_buf = NULL;
	kvfree(q->reftable);
	kvfree(q->l1);
	kfree(q->hdr_block);
	q->l1 = NULL;
	q->reftable = NULL;
	q->hdr_block = NULL;
}
