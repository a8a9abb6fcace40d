// SPDX-License-Identifier: GPL-2.0-only
/*
 * dm-qcow2: writing the image's metadata back, in an order that keeps the
 * image consistent across a crash, and the target's safe modes.
 *
 * This file owns: the in-memory tables' dirty ranges and in-place block
 * writes, the header write, changes to cached slices (meta_sem), the
 * writeback that makes them durable (qcow2_sync()), the hand-over of
 * refcount decreases to a grace period of the bios in flight, and the
 * modes (rw -> ro -> fail) with the corruption and failure events.
 * Allocation (dm-qcow2-alloc.c) makes the changes; this file decides when
 * they reach the disk.
 *
 * Crash ordering (never weaker than QEMU's):
 *  - A cluster's refcount is raised in the cache before any table entry
 *    points at it; qcow2_writeback() writes refcount slices, flushes, then
 *    writes L2 slices and flushes, so no L2 entry reaches the disk before
 *    the refcount it depends on, nor before the data written to the
 *    cluster (all data writes had completed before the entry was set).
 *  - qcow2_writeback() holds meta_sem exclusively while it writes, so the
 *    L2 and refcount slices it writes are one consistent state.
 *  - Refcount decreases wait on the frees list until a writeback has made
 *    the L2 change that dropped the reference durable, then for a grace
 *    period of the bios in flight (frees_after_grace()): a cluster is
 *    allocated again only once no bio mapped to it before is.
 *  - A new L2 table is written before its L1 entry is set in memory; the
 *    entry is written by the next writeback with the L2 slices, after the
 *    flush that made the table and its refcount durable. A table it
 *    replaces (a snapshot's) loses our reference as a deferred free, once
 *    the new entry is on disk.
 *  - A new refcount block is written before its refcount table entry is
 *    set in memory; the writeback writes that entry after the refcount
 *    flush and flushes it before writing any L1 or L2 entry. A grown
 *    refcount table is written and flushed before the header points at
 *    it.
 * A crash can therefore leak clusters, never leave a reference to a
 * cluster whose refcount is zero.
 */
#include <linux/sched/mm.h>
#include <linux/slab.h>
#include <linux/vmalloc.h>

#include "dm-qcow2-meta.h"
#include "dm-qcow2-trace.h"

/* ---- Modes: the target only moves towards safety ---- */

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
		if (qcow2_write_header(q))
			DMERR("%s: cannot mark the image corrupt", qcow2_name(q));
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
		if (prev == old) {
			trace_qcow2_mode(q, mode);
			return true;
		}
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
	trace_qcow2_corrupt(q, voff, what);
	DMERR_LIMIT("%s: corrupt image: %s (guest offset %llu)",
		    qcow2_name(q), what, voff);
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
bool qcow2_enter_fail_mode(struct qcow2 *q)
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
	if (qcow2_enter_fail_mode(q))
		DMERR("%s: metadata write or flush failed (%d): writes, flushes fail",
		      qcow2_name(q), err);
}

/* ---- In-place writes of the header and of L1/refcount table entries ---- */

/* Write back the fields we change, then make them durable. */
int qcow2_write_header(struct qcow2 *q)
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
int qcow2_write_table_block(struct qcow2 *q, const u64 *table, u64 idx,
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
int qcow2_modify_slice(struct qcow2 *q, enum qcow2_slice_kind kind,
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

/*
 * Put a new L1 or refcount table entry in memory, to be written by the
 * next writeback after the flush of the refcounts it depends on (see
 * qcow2_writeback()). meta_sem keeps a writeback from starting in between:
 * one already begun writes neither the entry nor its range, one that
 * begins after writes both.
 */
void qcow2_set_table_entry(struct qcow2 *q, struct qcow2_dirty *d,
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

/* ---- Writeback ---- */

static bool dirty_any(struct qcow2_dirty *d)
{
	return READ_ONCE(d->first) <= READ_ONCE(d->last);
}

void qcow2_dirty_clear(struct qcow2 *q, struct qcow2_dirty *d)
{
	spin_lock(&q->lock);
	d->first = U64_MAX;
	d->last = 0;
	spin_unlock(&q->lock);
}

/*
 * Write the blocks of an in-memory @table (at @table_off in the image)
 * from the first to the last entry set since the last writeback (blocks
 * in between are rewritten as they are on disk). meta_sem is held for
 * writing (qcow2_writeback()): no entry is set, and the table does not
 * move, meanwhile (see qcow2_set_table_entry(), grow_reftable()).
 */
static int write_dirty_blocks(struct qcow2 *q, struct qcow2_dirty *d,
			      const u64 *table, u64 table_off)
{
	unsigned int per_block = q->meta_block / sizeof(u64);
	u64 first, last, i;
	int r = 0;

	lockdep_assert_held_write(&q->meta_sem);
	spin_lock(&q->lock);
	first = d->first;
	last = d->last;
	spin_unlock(&q->lock);
	if (first > last)
		return 0;
	for (i = round_down(first, per_block); !r && i <= last; i += per_block)
		r = qcow2_write_table_block(q, table, i, table[i], table_off);
	if (r)
		return r;
	/* Clean only once the writes are counted: see qcow2_meta_durable() */
	qcow2_dirty_clear(q, d);
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
int qcow2_writeback(struct qcow2 *q, struct list_head *frees, u64 ticket)
{
	unsigned long dirty;
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
	dirty = qcow2_cache_nr_dirty(&q->cache);
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
	trace_qcow2_writeback(q, q->sync_done, dirty, r);
	up_write(&q->meta_sem);
	mutex_unlock(&q->sync_lock);
	if (r)
		qcow2_meta_error(q, r);
	return r;
}

/* ---- Frees after a grace period ---- */

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

/* Start a grace period for the frees ready, if none runs. */
void qcow2_grace_start_locked(struct qcow2 *q)
{
	lockdep_assert_held(&q->lock);
	if (q->grace_pending || list_empty(&q->frees_ready))
		return;
	list_splice_tail_init(&q->frees_ready, &q->frees_grace);
	q->grace_pending = true;
	call_srcu(&q->io_srcu, &q->grace_rcu, grace_done);
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
	qcow2_grace_start_locked(q);
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
	r = qcow2_writeback(q, &frees, ticket);
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

void qcow2_kick_writeback(void *owner)
{
	struct qcow2 *q = owner;

	queue_work(q->sync_wq, &q->sync_work);
}

/* Load a table of @entries (CPU byte order), padded to whole blocks. */
u64 *qcow2_load_table(struct qcow2 *q, u64 off, u32 entries, u32 padded)
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

void qcow2_writeback_init(struct qcow2 *q)
{
	INIT_WORK(&q->event_work, qcow2_event_work);
	INIT_WORK(&q->sync_work, sync_work_fn);
}
