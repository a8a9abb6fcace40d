// SPDX-License-Identifier: GPL-2.0-only
/*
 * dm-qcow2: mapping bios from guest offsets to the image, and the write
 * pipeline.
 *
 * Every read, write and write-zeroes bio is a reader of q->io_srcu from
 * ->map() until it ends (qcow2_map_bio(), qcow2_bio_end()), whichever path
 * serves it: a cluster freed meanwhile is not handed out again before the
 * bio has ended, so no bio lands in what its cluster became. Every L1 and
 * L2 entry is decoded by dm-qcow2-format, and every host offset checked
 * against the image size and the metadata we know of, before any I/O goes
 * through it; a bad one fails the bio and marks the image corrupt.
 *
 * A write goes through these stages, in order; each exists because the
 * one before it could not do the job alone.
 *
 *  1. ->map(), no lock, no sleep (map_rw()). The L1 table is in memory and
 *     the L2 entry comes from the slice cache. A write to clusters the
 *     image owns (COPIED in L1 and L2) is remapped at once: to the block
 *     device, or onto the file backend's queue. map_extend() keeps the bio
 *     whole while its clusters continue one run in the image, and cuts it
 *     where the run ends (dm sends the rest as a new bio). Rewriting
 *     allocated data, what a guest does most, never waits for a worker.
 *  2. Everything else goes to a worker whole, within one group of 64
 *     clusters (one L2 table, one in-flight bucket): allocating writes
 *     (unallocated, zero, compressed or snapshot-shared clusters), writes
 *     whose slice is not cached, FUA writes whose mappings are not yet
 *     durable. defer_write() takes the in-flight slots of its clusters
 *     there: two bios racing for one cluster make one allocation.
 *  3. Parking: a write meeting a slot holder parks on it, without a
 *     worker (inflight_begin_or_park()). A page cache writing an empty
 *     image sends sixteen 4 KiB bios per new 64 KiB cluster at once;
 *     fifteen would otherwise hold a worker each, asleep.
 *  4. Holding: a write that needs no slice read is held until the
 *     submitter's plug ends or a write that does not follow it comes
 *     (plug_hold(), qcow2_unplug()); held writes into clusters that follow
 *     each other form one batch of up to QCOW2_BATCH_BYTES. By the time
 *     the holder's worker runs, the writes into its cluster have parked
 *     on it.
 *  5. The worker (write_work()) writes new clusters whole, data first.
 *     Clusters with nothing to copy into them (unallocated without a
 *     backing file, zero clusters), one, a span or a batch, get one
 *     allocation and one data write, which also takes the writes parked
 *     on them and zeros between (write_fresh_held(), write_fresh()).
 *     Other clusters go one at a time (write_each(), write_allocating()):
 *     the L2 table made or copied (qcow2_l2_for_write()), a cluster
 *     allocated (its refcount raised in the cache), and the bio's data
 *     with the old data around it (of a shared, compressed or backing
 *     cluster) written as one. With subclusters only the subclusters
 *     written are (write_subclusters()).
 *  6. Only then is the L2 entry set, in the cached slice
 *     (qcow2_set_l2_entry()); the bios end, and the writes still parked
 *     go back to a worker (inflight_end()). An old cluster's reference
 *     is dropped once that change is durable (qcow2_defer_free()).
 *  7. The I/O backend (dm-qcow2-io.c): bios to a block device go down as
 *     they are; file bios join one queue that one work item drains,
 *     merging those that continue each other into one kiocb.
 *  8. The metadata stays in the cache until a flush, a FUA write or a
 *     full cache writes it back (qcow2_sync(), dm-qcow2-writeback.c):
 *     refcounts, a flush, L1 and L2 entries, a flush. Concurrent flushes
 *     share one writeback.
 *
 * Reads take stage 1 the same way; a miss goes to a worker with up to a
 * group and 4 MiB of the bio (read_miss_unit()), which loads the slice
 * and serves the bio in one piece when its clusters continue each other,
 * else through a buffer. Compressed clusters are decompressed
 * (dm-qcow2-zip.c); clusters the image does not have are read from the
 * backing chain, and copied from it on partial writes.
 *
 * Discard and write-zeroes run on their own workqueue, as they sleep for
 * in-flight slots: discards drop whole clusters (discard_cluster());
 * write-zeroes makes whole clusters zero clusters (v3) and writes zeros
 * elsewhere, where the data does not read as zeros already.
 */
#include <linux/bio.h>
#include <linux/blkdev.h>
#include <linux/hash.h>
#include <linux/sched/mm.h>
#include <linux/slab.h>
#include <linux/sort.h>
#include <linux/vmalloc.h>

#include "dm-qcow2.h"
#include "dm-qcow2-trace.h"

/* What the tables say about one guest cluster. */
struct qcow2_lookup {
	struct qcow2_l2_map m;
	u64 l2_off;		/* 0: no L2 table */
	bool l2_copied;		/* the L2 table is ours alone */
};

static u64 bio_voff(struct bio *bio)
{
	return (u64)bio->bi_iter.bi_sector << SECTOR_SHIFT;
}

/* ---- Lookup ---- */

static int l2_offset_lookup(struct qcow2 *q, u64 voff,
			    struct qcow2_lookup *lk)
{
	u64 idx = qcow2_l1_index(&q->hdr, voff), entry;
	const char *err;
	int r;

	if (idx >= q->l1_entries)
		return qcow2_corrupt(q, voff, "guest offset beyond the L1 table");
	entry = READ_ONCE(q->l1[idx]);
	r = qcow2_l1_decode(&q->hdr, entry, &lk->l2_off, &err);
	if (r)
		return qcow2_corrupt(q, voff, err);
	lk->l2_copied = entry & QCOW2_OFLAG_COPIED;
	if (!lk->l2_off)
		return 0;
	err = qcow2_host_cluster_check(q, lk->l2_off);
	if (err)
		return qcow2_corrupt(q, voff, err);
	return 0;
}

/*
 * Resolve the cluster holding guest byte @voff. Without @can_block only
 * cached slices are used and -EAGAIN means the caller must retry from a
 * worker.
 */
static int map_lookup(struct qcow2 *q, u64 voff, bool can_block,
		      struct qcow2_lookup *lk)
{
	const struct qcow2_header *h = &q->hdr;
	unsigned int slice = q->cache.slice_size;
	struct qcow2_l2_map *m = &lk->m;
	__be64 ent[2] = { 0, 0 };
	const char *err;
	u64 byte;
	int r;

	r = l2_offset_lookup(q, voff, lk);
	if (r)
		return r;
	if (!lk->l2_off) {
		memset(m, 0, sizeof(*m));
		m->type = QCOW2_CLUSTER_UNALLOCATED;
		return 0;
	}

	byte = (u64)qcow2_l2_index(h, voff) * h->l2_entry_size;
	r = qcow2_cache_read(&q->cache, QCOW2_SLICE_L2,
			     lk->l2_off + round_down(byte, slice),
			     byte & (slice - 1), ent, h->l2_entry_size,
			     can_block);
	if (r == -EAGAIN)
		return r;
	if (r) {
		DMERR_LIMIT("%s: cannot read L2 table at %llu: %d",
			    qcow2_name(q), lk->l2_off, r);
		return r;
	}

	r = qcow2_l2_decode(h, be64_to_cpu(ent[0]), be64_to_cpu(ent[1]), m,
			    &err);
	if (r)
		return qcow2_corrupt(q, voff, err);
	if (m->type == QCOW2_CLUSTER_NORMAL ||
	    m->type == QCOW2_CLUSTER_ZERO_ALLOC)
		err = qcow2_data_cluster_check(q, m->host_offset);
	else if (m->type == QCOW2_CLUSTER_COMPRESSED)
		err = qcow2_data_range_check(q, m->host_offset, m->comp_len);
	if (err)
		return qcow2_corrupt(q, voff, err);
	return 0;
}

static int chain_read(struct qcow2 *b, u64 voff, u8 *buf, u32 len);

/* ---- Subclusters (extended L2 entries) ---- */

/*
 * With extended L2 entries each cluster has 32 subclusters, each
 * allocated (data at its place in the host cluster), reading as zeros,
 * or unallocated (from the backing chain, or zeros). ->map() cuts a bio
 * at the first change of state (dm_accept_partial_bio()) so that the
 * paths above serve it as one state; workers also meet bios that cross
 * states (FUA writes, cache misses, a bitmap that changed meanwhile) and
 * read those through a buffer (sc_view()).
 */
static u32 sc_bits(const struct qcow2_header *h)
{
	return h->cluster_bits - ilog2(QCOW2_SUBCLUSTERS);
}

static u32 sc_index(const struct qcow2_header *h, u64 voff)
{
	return qcow2_cluster_offset(h, voff) >> sc_bits(h);
}

/* The subclusters that guest bytes [@voff, @voff + @len) touch. */
static u32 sc_mask(const struct qcow2_header *h, u64 voff, u32 len)
{
	return GENMASK(sc_index(h, voff + len - 1), sc_index(h, voff));
}

static enum qcow2_cluster_type sc_type(const struct qcow2_l2_map *m, u32 i)
{
	if (m->sc_alloc & BIT(i))
		return QCOW2_CLUSTER_NORMAL;
	if (m->sc_zero & BIT(i))
		return QCOW2_CLUSTER_ZERO_PLAIN;
	return QCOW2_CLUSTER_UNALLOCATED;
}

/* Bytes from @voff (at most @len) whose subclusters share one state. */
static u32 sc_run(const struct qcow2_header *h, const struct qcow2_l2_map *m,
		  u64 voff, u32 len)
{
	u32 i = sc_index(h, voff), last = sc_index(h, voff + len - 1);
	enum qcow2_cluster_type t = sc_type(m, i);

	while (i < last && sc_type(m, i + 1) == t)
		i++;
	return min_t(u64, len, ((u64)(i + 1) << sc_bits(h)) -
			       qcow2_cluster_offset(h, voff));
}

static bool sc_split(const struct qcow2_header *h,
		     const struct qcow2_l2_map *m)
{
	return h->extended_l2 && m->type != QCOW2_CLUSTER_COMPRESSED;
}

/*
 * Guest data of layer @q at [@voff, @voff + @len), within one cluster, as
 * its subclusters say. Unallocated subclusters outside @exact are only
 * zero-filled: their content will not be read back (the caller writes
 * them to a new cluster where they stay unallocated).
 */
static int sc_view(struct qcow2 *q, const struct qcow2_l2_map *m, u64 voff,
		   u8 *buf, u32 len, u32 exact)
{
	const struct qcow2_header *h = &q->hdr;
	u32 n;
	int r = 0;

	for (; !r && len; voff += n, buf += n, len -= n) {
		n = sc_run(h, m, voff, len);
		switch (sc_type(m, sc_index(h, voff))) {
		case QCOW2_CLUSTER_NORMAL:
			r = qcow2_io_read_data(&q->io, buf, n, m->host_offset +
					       qcow2_cluster_offset(h, voff));
			break;
		case QCOW2_CLUSTER_UNALLOCATED:
			if (q->backing && (exact & BIT(sc_index(h, voff)))) {
				r = chain_read(q->backing, voff, buf, n);
				break;
			}
			fallthrough;
		default:
			memset(buf, 0, n);
			break;
		}
	}
	return r;
}

/* ---- The backing chain ---- */

/* The zip layer reports compressed data past the image's end: corrupt. */
static int zip_result(struct qcow2 *q, u64 voff, int r)
{
	if (r == -EUCLEAN)
		return qcow2_corrupt(q, voff, "compressed cluster past the end of the image");
	return r;
}

/* Part of one cluster of a qcow2 backing layer. */
static int chain_read_cluster(struct qcow2 *b, u64 voff, u8 *buf, u32 len)
{
	struct qcow2_lookup lk;
	int r;

	r = map_lookup(b, voff, true, &lk);
	if (r)
		return r;
	if (sc_split(&b->hdr, &lk.m))
		return sc_view(b, &lk.m, voff, buf, len, U32_MAX);
	switch (lk.m.type) {
	case QCOW2_CLUSTER_UNALLOCATED:
		if (b->backing)
			return chain_read(b->backing, voff, buf, len);
		fallthrough;
	case QCOW2_CLUSTER_ZERO_PLAIN:
	case QCOW2_CLUSTER_ZERO_ALLOC:
		memset(buf, 0, len);
		return 0;
	case QCOW2_CLUSTER_NORMAL:
		return qcow2_io_read_data(&b->io, buf, len, lk.m.host_offset +
					  qcow2_cluster_offset(&b->hdr, voff));
	case QCOW2_CLUSTER_COMPRESSED:
		return zip_result(b, voff,
				  qcow2_zip_read_buf(b, &lk.m, voff, buf, len));
	}
	return -EIO;
}

/*
 * Read guest data of a layer, synchronously (workers only): a backing
 * layer, or the image itself for read_work(). Zeros past its end (it may
 * be shorter than the image above it), raw layers read as they are,
 * qcow2 layers cluster by cluster, down the chain where they have
 * nothing. The depth is bounded by QCOW2_MAX_CHAIN.
 */
static int chain_read(struct qcow2 *b, u64 voff, u8 *buf, u32 len)
{
	u32 n;
	int r;

	while (len) {
		if (voff >= b->hdr.size) {
			memset(buf, 0, len);
			return 0;
		}
		n = min_t(u64, len, b->hdr.size - voff);
		if (b->raw) {
			r = qcow2_io_read_meta(&b->io, buf, n, voff);
		} else {
			n = min(n, b->hdr.cluster_size -
				   qcow2_cluster_offset(&b->hdr, voff));
			r = chain_read_cluster(b, voff, buf, n);
		}
		if (r)
			return r;
		voff += n;
		buf += n;
		len -= n;
	}
	return 0;
}

/*
 * Reads served through a buffer: given @m, bios that cross subcluster
 * states; else guest data of @layer: the chain below for clusters the
 * image does not have, or the image itself for a read a worker got whole
 * over clusters that do not continue each other (read_work()).
 */
static int read_buffered(struct qcow2 *q, struct bio *bio,
			 struct qcow2 *layer, const struct qcow2_l2_map *m)
{
	u32 len = bio->bi_iter.bi_size, cs = q->hdr.cluster_size, off, n;
	u64 voff = bio_voff(bio);
	u8 *buf = NULL;
	int r = 0;

	/*
	 * More than a cluster (a read that missed, up to 4 MiB): in one
	 * buffer when memory allows, else a cluster at a time through the
	 * reserve (@m: the bio is within one cluster).
	 */
	if (len > cs)
		buf = qcow2_kvmalloc(len, QCOW2_GFP_TRY);
	if (buf) {
		r = chain_read(layer, voff, buf, len);
		if (!r)
			qcow2_bio_copy_from_buf(bio, buf);
		kvfree(buf);
		goto out;
	}
	buf = qcow2_pool_get(&q->buf_pool);
	for (off = 0; !r && off < len; off += n) {
		n = min(len - off, cs - qcow2_cluster_offset(&q->hdr, voff + off));
		if (m)
			r = sc_view(q, m, voff + off, buf, n, U32_MAX);
		else
			r = chain_read(layer, voff + off, buf, n);
		if (!r)
			qcow2_bio_copy_range(bio, off, buf, n);
	}
	qcow2_pool_put(&q->buf_pool, buf);
out:
	if (r && r != -EUCLEAN)
		DMERR_LIMIT("%s: read at guest offset %llu failed: %d",
			    qcow2_name(q), voff, r);
	return r;
}

/* May a write of [@voff, @voff + @len) go straight to where it maps? */
static bool writable_in_place(struct qcow2 *q, const struct qcow2_lookup *lk,
			      u64 voff, u32 len)
{
	u32 mask;

	if (lk->m.type != QCOW2_CLUSTER_NORMAL || !lk->m.copied ||
	    !lk->l2_copied)
		return false;
	if (!q->hdr.extended_l2)
		return true;
	mask = sc_mask(&q->hdr, voff, len);
	return (lk->m.sc_alloc & mask) == mask;
}

/*
 * Does the cluster at @voff, looked up in @n, continue a run of data
 * clusters at host offset @host (and may a @write go there in place)?
 * One bio serves such a run as one piece of the image.
 */
static bool run_continues(struct qcow2 *q, const struct qcow2_lookup *n,
			  u64 voff, u64 host, bool write)
{
	return n->m.type == QCOW2_CLUSTER_NORMAL && n->m.host_offset == host &&
	       (!write || writable_in_place(q, n, voff, q->hdr.cluster_size));
}

/* ---- Dispatch ---- */

/*
 * Extended L2: serve @bio as the state of its first subcluster, cutting
 * it where the state changes when that is allowed (in ->map() only; dm
 * sends the rest as a new bio). False if it crosses states uncut.
 */
static bool sc_narrow(struct qcow2 *q, struct bio *bio,
		      struct qcow2_lookup *lk, bool can_cut)
{
	const struct qcow2_header *h = &q->hdr;
	u32 len = bio->bi_iter.bi_size, run;

	if (!sc_split(h, &lk->m))
		return true;
	run = sc_run(h, &lk->m, bio_voff(bio), len);
	if (run < len) {
		if (!can_cut)
			return false;
		dm_accept_partial_bio(bio, run >> SECTOR_SHIFT);
	}
	lk->m.type = sc_type(&lk->m, sc_index(h, bio_voff(bio)));
	return true;
}

static bool test_hold(struct qcow2 *q, struct bio *bio, u64 pos);

static int map_data(struct qcow2 *q, struct bio *bio, u64 pos,
		    bool in_worker)
{
	if (unlikely(READ_ONCE(q->test_hold_sector) != (sector_t)-1) &&
	    test_hold(q, bio, pos))
		return DM_MAPIO_SUBMITTED;
	if (q->io.dev) {
		qcow2_io_bdev_remap(&q->io, bio, pos);
		if (!in_worker)
			return DM_MAPIO_REMAPPED;
		dm_submit_bio_remap(bio, NULL);
		return DM_MAPIO_SUBMITTED;
	}
	/*
	 * From a worker too through the queue, where bios that continue each
	 * other merge: the parked writes of a cluster just mapped come back
	 * together.
	 */
	qcow2_io_file_queue(&q->io, bio, pos, in_worker);
	return DM_MAPIO_SUBMITTED;
}

static int map_complete(struct bio *bio, int err)
{
	if (err == -EUCLEAN)
		err = -EIO;
	bio->bi_status = errno_to_blk_status(err);
	bio_endio(bio);
	return DM_MAPIO_SUBMITTED;
}

static int map_resolved(struct qcow2 *q, struct bio *bio,
			struct qcow2_lookup *lk, bool in_worker)
{
	u64 voff = bio_voff(bio);

	switch (lk->m.type) {
	case QCOW2_CLUSTER_UNALLOCATED:
		/* Only from a worker: qcow2_map_bio() defers these */
		if (q->backing)
			return map_complete(bio, read_buffered(q, bio, q->backing,
							       NULL));
		fallthrough;
	case QCOW2_CLUSTER_ZERO_PLAIN:
	case QCOW2_CLUSTER_ZERO_ALLOC:
		zero_fill_bio(bio);
		return map_complete(bio, 0);
	case QCOW2_CLUSTER_NORMAL:
		return map_data(q, bio, lk->m.host_offset +
				qcow2_cluster_offset(&q->hdr, voff), in_worker);
	case QCOW2_CLUSTER_COMPRESSED:
		/* Only from a worker: qcow2_map_bio() defers these */
		return map_complete(bio, zip_result(q, voff,
					qcow2_zip_read_bio(q, &lk->m, bio)));
	}
	return map_complete(bio, -EIO);
}

/* ---- Allocating writes ---- */

/*
 * A write the workers serve whole (allocating clusters, or FUA) stays
 * within one aligned group of 64 clusters: they are in one L2 table (a
 * table has at least 64 entries, and no extended ones in such a write)
 * and their in-flight slots in one bucket.
 */
#define QCOW2_GROUP_BITS	6

static struct hlist_head *inflight_bucket(struct qcow2 *q, u64 vcluster)
{
	return &q->inflight[hash_64(vcluster >> QCOW2_GROUP_BITS,
				    ilog2(ARRAY_SIZE(q->inflight)))];
}

/* The slot holder overlapping clusters [@first, @first + @n) */
static struct qcow2_bio *inflight_holder_locked(struct qcow2 *q, u64 first,
						u32 n)
{
	struct qcow2_bio *pb;

	lockdep_assert_held(&q->lock);
	hlist_for_each_entry(pb, inflight_bucket(q, first), inflight)
		if (pb->vcluster < first + n && first < pb->vcluster + pb->vcount)
			return pb;
	return NULL;
}

static bool inflight_busy_locked(struct qcow2 *q, u64 first, u32 n)
{
	return !!inflight_holder_locked(q, first, n);
}

static bool inflight_busy(struct qcow2 *q, u64 first, u32 n)
{
	bool busy;

	spin_lock(&q->lock);
	busy = inflight_busy_locked(q, first, n);
	spin_unlock(&q->lock);
	return busy;
}

/*
 * Take the in-flight slots of guest clusters [@first, @first + @n), all in
 * one group, waiting for their holders.
 */
static void inflight_begin(struct qcow2 *q, struct qcow2_bio *pb, u64 first,
			   u32 n)
{
	bool busy;

	pb->vcluster = first;
	pb->vcount = n;
	for (;;) {
		spin_lock(&q->lock);
		busy = inflight_busy_locked(q, first, n);
		if (!busy)
			hlist_add_head(&pb->inflight, inflight_bucket(q, first));
		spin_unlock(&q->lock);
		if (!busy)
			return;
		wait_event(q->inflight_wait, !inflight_busy(q, first, n));
	}
}

/*
 * A write's slots, or no wait at all: when a holder overlaps them, the bio
 * is parked on that holder, which gives it back to a worker as it lets go
 * (inflight_end()), and false is returned: the bio is no longer the
 * caller's. An empty image written through the page cache sends sixteen
 * 4 KiB bios for each new 64 KiB cluster at once; fifteen of them would
 * otherwise hold a worker each, asleep, until the first had mapped it.
 */
static bool inflight_begin_or_park(struct qcow2 *q, struct qcow2_bio *pb,
				   u64 first, u32 n)
{
	struct bio *bio = dm_bio_from_per_bio_data(pb, sizeof(*pb));
	struct qcow2_bio *holder;

	pb->vcluster = first;
	pb->vcount = n;
	/*
	 * One q->lock hold for the lookup and the parking: a holder found
	 * here has not reached inflight_end(), which unhashes it and takes
	 * its waiters under the same lock, so no parked bio is missed.
	 */
	spin_lock(&q->lock);
	holder = inflight_holder_locked(q, first, n);
	if (holder) {
		/*
		 * Traced under the lock: once it is dropped the holder may
		 * end, and take this bio with it.
		 */
		trace_qcow2_park(q, bio_voff(bio),
				 holder->vcluster << q->hdr.cluster_bits);
		bio_list_add(&holder->waiters, bio);
	} else {
		hlist_add_head(&pb->inflight, inflight_bucket(q, first));
	}
	spin_unlock(&q->lock);
	return !holder;
}

/*
 * Let go of the slots: wake those waiting for them (discard and write
 * zeroes), and queue again the work of the writes parked here, which
 * left their worker when they parked (defer() set their work up).
 */
static void inflight_end(struct qcow2 *q, struct qcow2_bio *pb)
{
	struct bio_list parked;
	struct qcow2_bio *w;
	struct bio *bio;

	spin_lock(&q->lock);
	hlist_del_init(&pb->inflight);
	parked = pb->waiters;
	bio_list_init(&pb->waiters);
	spin_unlock(&q->lock);
	wake_up_all(&q->inflight_wait);
	/*
	 * A parked bio's work may still be returning from the write_work()
	 * that parked it; it touches nothing after that, and meta_wq runs a
	 * requeued item only once the earlier run has ended.
	 */
	while ((bio = bio_list_pop(&parked))) {
		w = dm_per_bio_data(bio, sizeof(*w));
		queue_work(q->meta_wq, &w->work);
	}
}

/* Where the rest of a new cluster comes from. */
struct qcow2_fill {
	u64 src;		/* the old cluster's host offset, or 0 */
	u8 *buf;		/* or the old cluster's contents, or NULL */
};

/*
 * Segment arrays: @max entries, from the reserve when they describe one
 * cluster's write (q->pool_vecs bounds those, see qcow2_map_init()), else
 * from the allocator, NULL when it has none: the caller then goes a
 * cluster at a time.
 */
static struct bio_vec *vec_get(struct qcow2 *q, unsigned int max)
{
	if (max <= q->pool_vecs)
		return qcow2_pool_get(&q->vec_pool);
	return qcow2_kmalloc_array(max, sizeof(struct bio_vec), QCOW2_GFP_TRY);
}

static void vec_put(struct qcow2 *q, struct bio_vec *vec, unsigned int max)
{
	if (max <= q->pool_vecs)
		qcow2_pool_put(&q->vec_pool, vec);
	else
		kfree(vec);
}

/*
 * Segments for @len bytes of fill at @off in the cluster: from the old
 * contents (on disk: read into @scratch, which holds @len bytes), else
 * zeros.
 */
static int fill_segments(struct qcow2 *q, struct bio_vec *bv,
			 unsigned int max, const struct qcow2_fill *fill,
			 u32 off, u32 len, void *scratch, unsigned int *nr)
{
	unsigned int n = 0, chunk;
	u64 src = fill->src ? fill->src + off : 0;
	int r;

	if (!len)
		return 0;
	if (fill->buf) {
		*nr += qcow2_buf_to_bvec(bv + *nr, max - *nr, fill->buf + off,
					 len);
		return 0;
	}
	if (src) {
		r = qcow2_io_read_data(&q->io, scratch, len, src);
		if (r)
			return r;
		*nr += qcow2_buf_to_bvec(bv + *nr, max - *nr, scratch, len);
		return 0;
	}
	while (len && *nr + n < max) {
		chunk = min_t(u32, len, PAGE_SIZE);
		bv[*nr + n].bv_page = ZERO_PAGE(0);
		bv[*nr + n].bv_len = chunk;
		bv[*nr + n].bv_offset = 0;
		len -= chunk;
		n++;
	}
	*nr += n;
	return 0;
}

/*
 * Append the segments of bytes [@skip, @skip + @len) of @bio's data, as
 * many pages to a segment as the bio has them (no more entries than
 * bio_segments() counts): the disk below takes a request of as many
 * segments as it allows, not as many pages, so single pages would cut
 * a large write into requests of 1 MiB or less, where loop's are larger.
 * The offset of each is brought within its first page.
 */
static void bio_range_segments(struct bio *bio, u32 skip, u32 len,
			       struct bio_vec *vec, unsigned int *nr)
{
	struct bvec_iter iter = bio->bi_iter, it;
	struct bio_vec bv;

	bio_advance_iter(bio, &iter, skip);
	iter.bi_size = len;
	__bio_for_each_bvec(bv, bio, it, iter) {
		bv.bv_page += bv.bv_offset >> PAGE_SHIFT;
		bv.bv_offset &= ~PAGE_MASK;
		vec[(*nr)++] = bv;
	}
}

/* Segments of bytes [@skip, @skip + @len) of @bio's data (as above) */
static unsigned int range_segments(struct bio *bio, u32 skip, u32 len)
{
	struct bvec_iter iter = bio->bi_iter, it;
	struct bio_vec bv;
	unsigned int n = 0;

	bio_advance_iter(bio, &iter, skip);
	iter.bi_size = len;
	__bio_for_each_bvec(bv, bio, it, iter)
		n++;
	return n;
}

/*
 * @len bytes of the bio's data (within one cluster), from @skip bytes
 * into it, written at host offset @pos, synchronously.
 */
static int write_bio_range(struct qcow2 *q, struct bio *bio, u32 skip,
			   u32 len, u64 pos)
{
	unsigned int nr = 0, max = range_segments(bio, skip, len);
	struct bio_vec *vec;
	int r;

	vec = vec_get(q, max);
	if (!vec)
		return -ENOMEM;
	bio_range_segments(bio, skip, len, vec, &nr);
	r = qcow2_io_write_data(&q->io, vec, nr, len, pos);
	vec_put(q, vec, max);
	return r;
}

static bool bio_meets(struct bio *bio, u64 start, u64 end)
{
	return bio_voff(bio) < end &&
	       bio_voff(bio) + bio->bi_iter.bi_size > start;
}

/* The part of sorted bios @v[0..@n) within [@start, @end): @*from, @*to */
static bool gathered_extent(struct bio **v, unsigned int n, u64 start,
			    u64 end, u64 *from, u64 *to)
{
	unsigned int i;

	*from = end;
	*to = start;
	for (i = 0; i < n; i++) {
		if (!bio_meets(v[i], start, end))
			continue;
		*from = min(*from, max(bio_voff(v[i]), start));
		*to = max(*to, min(bio_voff(v[i]) + v[i]->bi_iter.bi_size,
				   end));
	}
	return *from < *to;
}

/*
 * Write the bios @v[0..@n) (sorted by guest offset, apart) where they
 * meet guest range [@vstart, @vstart + @len) of new clusters, which is
 * at host offset @host, as one write with zeros between them. Where
 * the first starts after the range does or the last ends before it,
 * the layer below zeroes the range without writing when it can, or has
 * nothing to do past @mark (see qcow2_io_zero_range()), else the zeros
 * are part of the write. Bios may reach out of the range (a write's new
 * clusters need not be contiguous in the image): only their part in it
 * is written here.
 */
static int write_gathered(struct qcow2 *q, struct bio **v, unsigned int n,
			  u64 vstart, u32 len, u64 host, u64 mark)
{
	static const struct qcow2_fill zeros;
	u64 from = vstart, to = vstart + len, at, s, e;
	u32 cs = q->hdr.cluster_size, off;
	unsigned int max, nr = 0, i;
	struct bio_vec *vec;
	int r = 0;

	/* Zeros take a page a segment, plus a partial one per gap */
	max = len / PAGE_SIZE + 2;
	for (i = 0; i < n; i++) {
		if (!bio_meets(v[i], vstart, vstart + len))
			continue;
		s = max(bio_voff(v[i]), vstart);
		e = min(bio_voff(v[i]) + v[i]->bi_iter.bi_size, vstart + len);
		max += range_segments(v[i], s - bio_voff(v[i]), e - s) + 1;
	}
	vec = vec_get(q, max);
	if (!vec && len > cs) {
		/* A batch's run (4 MiB): cluster by cluster, smaller arrays */
		for (off = 0; !r && off < len; off += cs)
			r = write_gathered(q, v, n, vstart + off, cs,
					   host + off, mark);
		return r;
	}
	if (!vec)
		return -ENOMEM;
	if (!gathered_extent(v, n, vstart, vstart + len, &from, &to)) {
		from = vstart;
		to = vstart;
	}
	/*
	 * Gaps at both ends: one zeroing of the whole range (on a file, each
	 * is a journal transaction that waits for the direct I/O in flight).
	 */
	if (from > vstart && to < vstart + len) {
		if (qcow2_io_zero_range(&q->io, host, len, mark)) {
			from = vstart;
			to = vstart + len;
		}
	} else if (from > vstart &&
		   qcow2_io_zero_range(&q->io, host, from - vstart, mark)) {
		from = vstart;
	} else if (to < vstart + len &&
		   qcow2_io_zero_range(&q->io, host + (to - vstart),
				       vstart + len - to, mark)) {
		to = vstart + len;
	}
	for (i = 0, at = from; from < to && !r && i < n; i++) {
		s = max(bio_voff(v[i]), from);
		e = min(bio_voff(v[i]) + v[i]->bi_iter.bi_size, to);
		if (!bio_meets(v[i], from, to))
			continue;
		r = fill_segments(q, vec, max, &zeros, 0, s - at, NULL, &nr);
		bio_range_segments(v[i], s - bio_voff(v[i]), e - s, vec, &nr);
		at = e;
	}
	if (!r && from < to)
		r = fill_segments(q, vec, max, &zeros, 0, to - at, NULL, &nr);
	if (!r && from < to)
		r = qcow2_io_write_data(&q->io, vec, nr, to - from,
					host + (from - vstart));
	vec_put(q, vec, max);
	return r;
}

/*
 * Write a whole new cluster at @host: the bio's data, the rest from
 * @fill (copy-on-write) or zeros (none needed past @mark).
 */
static int write_cluster(struct qcow2 *q, struct bio *bio, u64 host,
			 const struct qcow2_fill *fill, u64 mark)
{
	u32 cs = q->hdr.cluster_size;
	u32 head = qcow2_cluster_offset(&q->hdr, bio_voff(bio));
	u32 tail = cs - head - bio->bi_iter.bi_size;
	unsigned int max, nr = 0;
	struct bvec_iter iter;
	struct bio_vec bv, *vec;
	u8 *scratch = NULL;
	int r;

	if (!fill->src && !fill->buf && (head || tail))
		return write_gathered(q, &bio, 1, bio_voff(bio) - head, cs,
				      host, mark);

	/* The old data around the bio, read into one cluster buffer */
	if (fill->src && (head || tail))
		scratch = qcow2_pool_get(&q->buf_pool);
	/* Each fill takes at most one segment per page, plus one */
	max = 2 * (cs / PAGE_SIZE + 2) + bio_segments(bio);
	vec = vec_get(q, max);
	if (!vec) {
		r = -ENOMEM;
		goto out;
	}
	r = fill_segments(q, vec, max, fill, 0, head, scratch, &nr);
	if (r)
		goto out;
	bio_for_each_segment(bv, bio, iter)
		vec[nr++] = bv;
	r = fill_segments(q, vec, max, fill, cs - tail, tail,
			  scratch ? scratch + head : NULL, &nr);
	if (!r)
		r = qcow2_io_write_data(&q->io, vec, nr, cs, host);
out:
	if (vec)
		vec_put(q, vec, max);
	qcow2_pool_put(&q->buf_pool, scratch);
	return r;
}

/* Zeros written in place, by the layer below when it can. */
static int zero_in_place(struct qcow2 *q, u64 host, u32 len)
{
	static const struct qcow2_fill zeros;
	unsigned int max = DIV_ROUND_UP(len, PAGE_SIZE), nr = 0;
	struct bio_vec *vec;
	int r;

	if (!qcow2_io_zero_range(&q->io, host, len, qcow2_io_written(&q->io)))
		return 0;
	vec = vec_get(q, max);
	if (!vec)
		return -ENOMEM;
	r = fill_segments(q, vec, max, &zeros, 0, len, NULL, &nr);
	if (!r)
		r = qcow2_io_write_data(&q->io, vec, nr, len, host);
	vec_put(q, vec, max);
	return r;
}

/* Where an allocating write goes, and what it replaces. */
struct qcow2_wtarget {
	u64 host;		/* the cluster written */
	struct qcow2_fill fill;	/* the rest of it */
	u64 old;		/* host data whose reference goes, or 0 */
	u32 old_len;		/* its length */
	bool allocated;		/* @host is new: give it back on failure */
	u64 mark;		/* nothing was written at @host if past this */
};

/* The old contents of the cluster as a buffer, unless the bio covers it. */
static int fill_from_buf(struct qcow2 *q, struct qcow2_lookup *lk, u64 voff,
			 bool whole, struct qcow2_wtarget *t)
{
	u64 start = round_down(voff, q->hdr.cluster_size);

	if (whole)
		return 0;
	/* Given back by write_allocating() */
	t->fill.buf = qcow2_pool_get(&q->buf_pool);
	if (lk->m.type == QCOW2_CLUSTER_COMPRESSED)
		return zip_result(q, start,
				  qcow2_zip_read_buf(q, &lk->m, start,
						     t->fill.buf,
						     q->hdr.cluster_size));
	return chain_read(q->backing, start, t->fill.buf, q->hdr.cluster_size);
}

/*
 * A zero-alloc cluster we own is written in place; anything else gets a
 * new cluster, filled from the old data when there is some (shared with
 * a snapshot, compressed, or in the backing chain), else with zeros.
 */
static int choose_target(struct qcow2 *q, struct qcow2_lookup *lk,
			 struct bio *bio, struct qcow2_wtarget *t)
{
	struct qcow2_l2_map *m = &lk->m;
	bool whole = bio->bi_iter.bi_size == q->hdr.cluster_size;
	int r;

	memset(t, 0, sizeof(*t));
	t->old_len = q->hdr.cluster_size;
	switch (m->type) {
	case QCOW2_CLUSTER_ZERO_ALLOC:
		if (m->copied) {
			/* Only this write (it holds the slot) writes there */
			t->host = m->host_offset;
			t->mark = qcow2_io_written(&q->io);
			return 0;
		}
		t->old = m->host_offset;
		break;
	case QCOW2_CLUSTER_NORMAL:
		t->fill.src = m->host_offset;
		t->old = m->host_offset;
		break;
	case QCOW2_CLUSTER_COMPRESSED:
		r = fill_from_buf(q, lk, bio_voff(bio), whole, t);
		if (r)
			return r;
		t->old = m->host_offset;
		t->old_len = m->comp_len;
		break;
	case QCOW2_CLUSTER_UNALLOCATED:
		if (q->backing) {
			r = fill_from_buf(q, lk, bio_voff(bio), whole, t);
			if (r)
				return r;
		}
		break;
	default:
		break;
	}
	r = qcow2_alloc_clusters(q, 1, &t->host, &t->mark);
	t->allocated = !r;
	if (!r)
		trace_qcow2_write_alloc(q, bio_voff(bio), m->type,
					m->host_offset, t->host);
	return r;
}

/* Where a write to subclusters goes: [@ws, @we) of the cluster at @host. */
struct qcow2_sc_write {
	u64 host;
	u32 ws, we;
	u64 old;		/* a shared cluster copied away, or 0 */
	bool allocated;
};

/*
 * Bytes of the write range around the bio, as the subclusters read now,
 * and the bio's data between them, written at @w->host + @w->ws.
 */
static int write_sc_range(struct qcow2 *q, struct bio *bio,
			  const struct qcow2_l2_map *m,
			  const struct qcow2_sc_write *w, u32 exact)
{
	u64 voff = bio_voff(bio), cstart = round_down(voff, q->hdr.cluster_size);
	u32 off = voff - cstart, end = off + bio->bi_iter.bi_size;
	u32 head = off - w->ws, tail = w->we - end;
	unsigned int max, nr = 0;
	u8 *hbuf = NULL, *tbuf = NULL;
	struct bvec_iter iter;
	struct bio_vec bv, *vec;
	int r = -ENOMEM;

	/* Head and tail in one cluster buffer, then the segments */
	if (head || tail) {
		hbuf = qcow2_pool_get(&q->buf_pool);
		tbuf = hbuf + head;
	}
	max = (head + tail) / PAGE_SIZE + 4 + bio_segments(bio);
	vec = vec_get(q, max);
	if (!vec)
		goto out;
	r = sc_view(q, m, cstart + w->ws, hbuf, head, exact);
	if (!r)
		r = sc_view(q, m, cstart + end, tbuf, tail, exact);
	if (r)
		goto out;
	nr = qcow2_buf_to_bvec(vec, max, hbuf, head);
	bio_for_each_segment(bv, bio, iter)
		vec[nr++] = bv;
	nr += qcow2_buf_to_bvec(vec + nr, max - nr, tbuf, tail);
	r = qcow2_io_write_data(&q->io, vec, nr, w->we - w->ws,
				w->host + w->ws);
out:
	if (vec)
		vec_put(q, vec, max);
	qcow2_pool_put(&q->buf_pool, hbuf);
	return r;
}

/*
 * Choose where a write to subclusters goes. A cluster we own is written
 * in place, only the subclusters the bio touches; an allocated one at
 * either edge is left out of the range (its data is live and may be
 * written from ->map() meanwhile). An unallocated cluster gets a new one
 * of which only those subclusters are written; a shared one is copied
 * whole to a new one (its allocated subclusters; the rest stays zero).
 */
static int sc_target(struct qcow2 *q, struct bio *bio,
		     const struct qcow2_l2_map *m, struct qcow2_sc_write *w)
{
	const struct qcow2_header *h = &q->hdr;
	u32 scs = 1U << sc_bits(h), len = bio->bi_iter.bi_size;
	u64 voff = bio_voff(bio);
	u32 off = qcow2_cluster_offset(h, voff);
	int r;

	memset(w, 0, sizeof(*w));
	w->ws = round_down(off, scs);
	w->we = round_up(off + len, scs);
	if (m->type == QCOW2_CLUSTER_NORMAL && m->copied) {
		w->host = m->host_offset;
		if (m->sc_alloc & BIT(sc_index(h, voff)))
			w->ws = off;
		if (m->sc_alloc & BIT(sc_index(h, voff + len - 1)))
			w->we = off + len;
		return 0;
	}
	if (m->type == QCOW2_CLUSTER_NORMAL) {
		w->old = m->host_offset;
		w->ws = 0;
		w->we = h->cluster_size;
	}
	r = qcow2_alloc_cluster(q, &w->host);
	if (r)
		return r;
	/*
	 * The rest of a new cluster is never read: its subclusters stay
	 * unallocated (and the cluster may end past the end of a file).
	 */
	w->allocated = true;
	return 0;
}

/*
 * A write to subclusters that are not all allocated in a cluster we own
 * (extended L2 entries, not compressed): data first, then the entry with
 * the bio's subclusters allocated and no longer zero.
 */
static int write_subclusters(struct qcow2 *q, struct bio *bio,
			     struct qcow2_lookup *lk)
{
	const struct qcow2_l2_map *m = &lk->m;
	u64 voff = bio_voff(bio);
	u32 mask = sc_mask(&q->hdr, voff, bio->bi_iter.bi_size);
	struct qcow2_sc_write w;
	u64 bitmap;
	int r;

	r = sc_target(q, bio, m, &w);
	if (r)
		return r;
	r = write_sc_range(q, bio, m, &w, mask);
	bitmap = (u64)(m->sc_zero & ~mask) << 32 | (m->sc_alloc | mask);
	if (!r)
		r = qcow2_set_l2_entry(q, lk->l2_off, voff,
				       w.host | QCOW2_OFLAG_COPIED, bitmap);
	if (r) {
		if (w.allocated)
			qcow2_refcount_update(q, w.host, -1);
		return r;
	}
	if (w.old)
		qcow2_defer_free(q, w.old, q->hdr.cluster_size);
	return 0;
}

/* ---- Parked writes joining an allocating one ---- */

static bool bio_within(struct bio *bio, u64 start, u64 len)
{
	return bio_voff(bio) >= start &&
	       bio_voff(bio) + bio->bi_iter.bi_size <= start + len;
}

static bool bios_overlap(struct bio *a, struct bio *b)
{
	return bio_voff(a) < bio_voff(b) + b->bi_iter.bi_size &&
	       bio_voff(b) < bio_voff(a) + a->bi_iter.bi_size;
}

/* A write without FUA or a flush: one that may be gathered or batched */
static bool plain_write(struct bio *bio)
{
	return bio_op(bio) == REQ_OP_WRITE &&
	       !(bio->bi_opf & (REQ_FUA | REQ_PREFLUSH));
}

/*
 * Could parked bio @b be written together with @bio, into the new
 * clusters of @holder's slots (@bio's)?
 */
static bool gatherable(struct qcow2 *q, const struct qcow2_bio *holder,
		       struct bio *bio, struct bio *b)
{
	u32 bits = q->hdr.cluster_bits;

	return plain_write(b) && b->bi_iter.bi_size &&
	       bio_within(b, holder->vcluster << bits,
			  (u64)holder->vcount << bits) &&
	       !bios_overlap(bio, b);
}

static int cmp_bio_voff(const void *a, const void *b)
{
	u64 va = bio_voff(*(struct bio * const *)a);
	u64 vb = bio_voff(*(struct bio * const *)b);

	return va < vb ? -1 : va > vb;
}

/*
 * Move to @cand those of @holder's parked writes that may join @bio's
 * write into its new clusters (gatherable()); the others stay parked.
 * Returns how many. Only the holder takes its waiters: it holds the
 * slots.
 */
static unsigned int take_gatherable(struct qcow2 *q, struct qcow2_bio *holder,
				    struct bio *bio, struct bio_list *cand)
{
	struct bio_list keep;
	unsigned int n = 0;
	struct bio *b;

	bio_list_init(&keep);
	spin_lock(&q->lock);
	while ((b = bio_list_pop(&holder->waiters))) {
		if (gatherable(q, holder, bio, b)) {
			bio_list_add(cand, b);
			n++;
		} else {
			bio_list_add(&keep, b);
		}
	}
	holder->waiters = keep;
	spin_unlock(&q->lock);
	return n;
}

/* Park @bios on @holder again: it queues them when it lets go. */
static void park_again(struct qcow2 *q, struct qcow2_bio *holder,
		       struct bio_list *bios)
{
	if (bio_list_empty(bios))
		return;
	spin_lock(&q->lock);
	bio_list_merge(&holder->waiters, bios);
	spin_unlock(&q->lock);
	bio_list_init(bios);
}

/*
 * Sort the @n bios of @v by guest offset and keep the first of any that
 * overlap: the others are parked on @holder again. The slot holders'
 * own bios overlap nothing (gatherable()), so they all stay. Returns
 * how many are left in @v.
 */
static unsigned int gather_sort(struct qcow2 *q, struct qcow2_bio *holder,
				struct bio **v, unsigned int n)
{
	struct bio_list dropped;
	unsigned int i, k;

	bio_list_init(&dropped);
	sort(v, n, sizeof(*v), cmp_bio_voff, NULL);
	for (i = 1, k = 1; i < n; i++) {
		if (bios_overlap(v[k - 1], v[i]))
			bio_list_add(&dropped, v[i]);
		else
			v[k++] = v[i];
	}
	park_again(q, holder, &dropped);
	return k;
}

/*
 * Write a bio to a cluster that needs a new host cluster or a zero flag
 * cleared. Data first, then the L2 entry; the old data's refcount is
 * dropped only after that L2 change is durable (qcow2_defer_free()).
 */
static int write_allocating(struct qcow2 *q, struct bio *bio,
			    struct qcow2_lookup *lk)
{
	u64 voff = bio_voff(bio);
	struct qcow2_wtarget t;
	int r;

	r = qcow2_l2_for_write(q, voff, &lk->l2_off);
	if (!r)
		r = map_lookup(q, voff, true, lk);	/* the table may be new */
	if (r)
		return r;
	if (sc_split(&q->hdr, &lk->m))
		return write_subclusters(q, bio, lk);
	r = choose_target(q, lk, bio, &t);
	if (!r)
		r = write_cluster(q, bio, t.host, &t.fill, t.mark);
	/* A whole new cluster: every subcluster allocated */
	if (!r)
		r = qcow2_set_l2_entry(q, lk->l2_off, voff,
				       t.host | QCOW2_OFLAG_COPIED, U32_MAX);
	qcow2_pool_put(&q->buf_pool, t.fill.buf);
	if (r && t.allocated)
		qcow2_refcount_update(q, t.host, -1);
	if (!r && t.old && t.old != t.host)
		qcow2_defer_free(q, t.old, t.old_len);
	return r;
}

/* ---- Writes that span clusters ---- */

/*
 * Would a write need a new cluster with nothing to copy into it (zeros
 * around its data)? Extended L2 entries have their own path.
 */
static bool fresh_cluster(struct qcow2 *q, const struct qcow2_lookup *lk)
{
	if (q->hdr.extended_l2)
		return false;
	return lk->m.type == QCOW2_CLUSTER_ZERO_PLAIN ||
	       (lk->m.type == QCOW2_CLUSTER_UNALLOCATED && !q->backing);
}

/* Guest clusters that @bio touches */
static u32 bio_clusters(struct qcow2 *q, struct bio *bio)
{
	u64 voff = bio_voff(bio);

	return ((voff + bio->bi_iter.bi_size - 1) >> q->hdr.cluster_bits) -
	       (voff >> q->hdr.cluster_bits) + 1;
}

enum qcow2_span {
	SPAN_IN_PLACE,		/* one host run, every cluster ours */
	SPAN_FRESH,		/* every cluster needs a new one, zero-filled */
	SPAN_MIXED,		/* anything else: cluster by cluster */
};

/*
 * How a write may be served, looking up each of its clusters (@lk gets
 * the first one's mapping). The caller holds their in-flight slots, so no
 * allocating write, discard or write-zeroes changes them meanwhile.
 */
static int span_kind(struct qcow2 *q, struct bio *bio, struct qcow2_lookup *lk)
{
	u64 cs = q->hdr.cluster_size, voff = bio_voff(bio);
	u64 next = round_down(voff, cs) + cs, end = voff + bio->bi_iter.bi_size;
	bool in_place, fresh;
	u64 host;
	struct qcow2_lookup n;
	int r;

	r = map_lookup(q, voff, true, lk);
	if (r)
		return r;
	in_place = writable_in_place(q, lk, voff, min(end, next) - voff);
	fresh = fresh_cluster(q, lk);
	for (host = lk->m.host_offset + cs; next < end; next += cs, host += cs) {
		r = map_lookup(q, next, true, &n);
		if (r)
			return r;
		in_place = in_place && n.m.host_offset == host &&
			   writable_in_place(q, &n, next, min(end - next, cs));
		fresh = fresh && fresh_cluster(q, &n);
	}
	if (in_place)
		return SPAN_IN_PLACE;
	return fresh ? SPAN_FRESH : SPAN_MIXED;
}

/*
 * The data of bios @v[0..@n) (sorted by guest offset, apart) into the
 * new clusters at @host[] of @nr guest clusters from @start: one write
 * per run of contiguous host clusters (write_gathered(); @mark from
 * their allocation).
 */
static int write_fresh_data(struct qcow2 *q, struct bio **v, unsigned int n,
			    u64 start, const u64 *host, u32 nr, u64 mark)
{
	u32 cs = q->hdr.cluster_size, i, j;
	int r = 0;

	for (i = 0; !r && i < nr; i = j) {
		for (j = i + 1; j < nr && host[j] == host[j - 1] + cs; j++)
			;
		r = write_gathered(q, v, n, start + (u64)i * cs, (j - i) * cs,
				   host[i], mark);
	}
	return r;
}

/*
 * Writes over @nr guest clusters from @first (one group) that all need
 * new ones with nothing to copy (an empty image written sequentially):
 * the bios @v[0..@n), sorted and apart, that cover them. The clusters
 * are allocated together, the data goes out in as few writes as they
 * allow, and then the L2 entries point at them, as write_allocating()
 * does for one cluster.
 */
static int write_fresh(struct qcow2 *q, struct bio **v, unsigned int n,
		       u64 first, u32 nr)
{
	u64 cs = q->hdr.cluster_size, start = first << q->hdr.cluster_bits;
	u64 l2_off, mark, *host;
	u32 done = 0;
	int r;

	/* One L2 table: the clusters are within one group (QCOW2_GROUP_BITS) */
	r = qcow2_l2_for_write(q, start, &l2_off);
	if (r)
		return r;
	host = qcow2_pool_get(&q->host_pool);
	r = qcow2_alloc_clusters(q, nr, host, &mark);
	if (r)
		goto out;
	r = write_fresh_data(q, v, n, start, host, nr, mark);
	while (!r && done < nr) {
		r = qcow2_set_l2_entry(q, l2_off, start + done * cs,
				       host[done] | QCOW2_OFLAG_COPIED, U32_MAX);
		if (!r)
			done++;
	}
	/* Entries already set keep their clusters (and the data there) */
	for (; r && done < nr; done++)
		qcow2_refcount_update(q, host[done], -1);
out:
	qcow2_pool_put(&q->host_pool, host);
	return r;
}

/* The part of a write within one cluster, as its mapping says. */
static int write_one(struct qcow2 *q, struct bio *bio)
{
	u64 voff = bio_voff(bio);
	struct qcow2_lookup lk;
	int r;

	r = map_lookup(q, voff, true, &lk);
	if (r)
		return r;
	if (writable_in_place(q, &lk, voff, bio->bi_iter.bi_size))
		return write_bio_range(q, bio, 0, bio->bi_iter.bi_size,
				       lk.m.host_offset +
				       qcow2_cluster_offset(&q->hdr, voff));
	return write_allocating(q, bio, &lk);
}

/*
 * How many of guest clusters [@first, @first + @nr), from the first on,
 * need new ones with nothing to copy, or an error.
 */
static int fresh_count(struct qcow2 *q, u64 first, u32 nr)
{
	struct qcow2_lookup lk;
	u32 i;
	int r;

	for (i = 0; i < nr; i++) {
		r = map_lookup(q, (first + i) << q->hdr.cluster_bits, true,
			       &lk);
		if (r)
			return r;
		if (!fresh_cluster(q, &lk))
			break;
	}
	return i;
}

/* Do they all? 1 if so, 0 if not, or an error. */
static int fresh_range(struct qcow2 *q, u64 first, u32 nr)
{
	int r = fresh_count(q, first, nr);

	return r < 0 ? r : (u32)r == nr;
}

/*
 * Bytes of a write at @voff (@len of it left) that a run of at least two
 * clusters needing new ones covers, within the group (one L2 table), or 0
 * when there is no such run at @voff (or a lookup failed: the caller's
 * next lookup reports it).
 */
static u32 fresh_run(struct qcow2 *q, u64 voff, u32 len)
{
	u64 group = (u64)q->hdr.cluster_size << QCOW2_GROUP_BITS;
	u64 end = min(voff + len, round_down(voff, group) + group);
	u64 first = voff >> q->hdr.cluster_bits;
	int n = fresh_count(q, first,
			    ((end - 1) >> q->hdr.cluster_bits) - first + 1);

	if (n < 2)
		return 0;
	return min((first + n) << q->hdr.cluster_bits, end) - voff;
}

/*
 * A write over clusters of different kinds: each part is served through
 * a view of the bio narrowed to it, and the bio is given back whole. A
 * run of clusters that all need new ones is allocated and written in one
 * go (write_fresh()); every other part one cluster at a time. What
 * fresh_run() saw holds until the run is mapped: the bio holds the
 * in-flight slots of all its clusters. A write parked behind the one
 * allocating its first cluster (a bio that began mid-cluster) comes back
 * here with that cluster ours and the rest of its group fresh; cluster
 * by cluster, that group would take one synchronous write per cluster.
 */
static int write_each(struct qcow2 *q, struct bio *bio)
{
	struct bvec_iter whole = bio->bi_iter, cur = whole;
	u64 cs = q->hdr.cluster_size, voff;
	int r = 0;
	u32 n, run;

	while (!r && cur.bi_size) {
		voff = (u64)cur.bi_sector << SECTOR_SHIFT;
		run = fresh_run(q, voff, cur.bi_size);
		n = run ?: min_t(u64, cur.bi_size,
				 round_down(voff, cs) + cs - voff);
		bio->bi_iter = cur;
		bio->bi_iter.bi_size = n;
		if (run)
			r = write_fresh(q, &bio, 1, voff >> q->hdr.cluster_bits,
					bio_clusters(q, bio));
		else
			r = write_one(q, bio);
		bio_advance_iter(bio, &cur, n);
	}
	bio->bi_iter = whole;
	return r;
}

/* ---- Batches of held writes ---- */

/*
 * The bios of a batch (@held: the slot holders) and the writes parked on
 * them that may join, sorted, in a new array (@*n of them), or NULL when
 * there is no memory for it: then nothing was taken. A single holder
 * that nothing joins is returned in @one, without an allocation.
 */
static struct bio **batch_bios(struct qcow2 *q, struct bio_list *held,
			       unsigned int nr_held, unsigned int *n,
			       struct bio **one)
{
	struct qcow2_bio *head = dm_per_bio_data(held->head, sizeof(*head));
	struct bio_list cand;
	struct qcow2_bio *h;
	struct bio **v, *b;
	unsigned int i = 0;

	bio_list_init(&cand);
	*n = nr_held;
	bio_list_for_each(b, held) {
		h = dm_per_bio_data(b, sizeof(*h));
		*n += take_gatherable(q, h, b, &cand);
	}
	if (*n == 1) {
		*one = held->head;
		return one;
	}
	v = qcow2_kmalloc_array(*n, sizeof(*v), QCOW2_GFP_TRY);
	if (!v) {
		/* Any holder of the batch will do: they all let go at once */
		park_again(q, head, &cand);
		return NULL;
	}
	bio_list_for_each(b, held)
		v[i++] = b;
	while ((b = bio_list_pop(&cand)))
		v[i++] = b;
	/* Overlapping ones park on the head, for the same reason */
	*n = gather_sort(q, head, v, i);
	return v;
}

/*
 * The end of the writes a worker served: let go of the slots of @held
 * (slot holders: a batch, or one write), make the data durable if one of
 * them is a FUA write, and end them, and the writes that joined them
 * (@v[0..@n), where they are too, unless @v is NULL), with @r.
 */
static void end_held(struct qcow2 *q, struct bio_list *held,
		     struct bio **v, unsigned int n, int r)
{
	struct bio *b, *head = held->head;
	bool fua = false;
	unsigned int i;

	/*
	 * The slots go first: the L2 entries are set in the cache (or, on
	 * an error, nothing changed), so the writes parked on them may go
	 * on without waiting for a FUA write's sync.
	 */
	bio_list_for_each(b, held) {
		inflight_end(q, dm_per_bio_data(b, sizeof(struct qcow2_bio)));
		fua = fua || b->bi_opf & REQ_FUA;
	}
	if (!r && fua)
		r = qcow2_sync(q);
	if (r && r != -EUCLEAN && r != -EOPNOTSUPP)
		DMERR_LIMIT("%s: write at guest offset %llu failed: %d",
			    qcow2_name(q), bio_voff(head), r);
	if (!v) {
		while ((b = bio_list_pop(held)))
			map_complete(b, r);
		return;
	}
	/* @held's bios are in @v: the list goes before they end */
	bio_list_init(held);
	for (i = 0; i < n; i++)
		map_complete(v[i], r);
}

/*
 * Write @held, slot holders over the @nr guest clusters from @first that
 * all need new ones with nothing to copy (@nr_held of them: a batch, or
 * one write), together with the writes parked on them that fall in those
 * clusters (batch_bios()), and end them all. The page cache writing an
 * empty image sends a 4 KiB bio per page: the first of a cluster takes
 * its slot, the others park on it and go down in the same write, zeros
 * between them, rather than each through a worker after it. False, with
 * nothing taken, without the memory for it.
 */
static bool write_fresh_held(struct qcow2 *q, struct bio_list *held,
			     unsigned int nr_held, u64 first, u32 nr)
{
	u64 voff = bio_voff(held->head);
	struct bio **v, *one;
	unsigned int n;

	v = batch_bios(q, held, nr_held, &n, &one);
	if (!v)
		return false;
	if (nr_held > 1)
		trace_qcow2_batch(q, voff, nr_held, n, nr);
	if (n > nr_held)
		trace_qcow2_gather(q, voff, n - nr_held);
	end_held(q, held, v, n, write_fresh(q, v, n, first, nr));
	if (v != &one)
		kfree(v);
	return true;
}

/*
 * A batch of held writes into clusters that follow each other, @bio
 * first (qcow2_unplug()). When they all need new clusters with nothing
 * to copy, they are written as one (write_fresh_held()): an empty image
 * written back through the page cache gets one allocation and one data
 * write for up to QCOW2_BATCH_BYTES, rather than one for each cluster,
 * each in a worker of its own. Otherwise, or without the memory for it,
 * every write of the batch goes its own way: false, and the caller
 * serves @bio.
 */
static bool write_batch(struct qcow2 *q, struct bio *bio)
{
	struct qcow2_bio *pb = dm_per_bio_data(bio, sizeof(*pb)), *h;
	struct bio_list held = pb->batch;
	unsigned int nr_held = 1;
	u32 nr = pb->vcount;
	struct bio *b;
	int r;

	bio_list_init(&pb->batch);
	bio_list_for_each(b, &held) {
		h = dm_per_bio_data(b, sizeof(*h));
		nr += h->vcount;
		nr_held++;
	}
	bio_list_add_head(&held, bio);
	r = fresh_range(q, pb->vcluster, nr);
	if (r < 0) {
		end_held(q, &held, NULL, 0, r);
		return true;
	}
	if (r > 0 && write_fresh_held(q, &held, nr_held, pb->vcluster, nr))
		return true;
	bio_list_pop(&held);
	while ((b = bio_list_pop(&held))) {
		h = dm_per_bio_data(b, sizeof(*h));
		queue_work(q->meta_wq, &h->work);
	}
	return false;
}

/*
 * Writes that ->map() could not serve: allocating ones, FUA ones, and
 * those whose slices were not cached. A write spanning clusters (one
 * group at most) is served whole when it can be.
 */
static void write_work(struct qcow2 *q, struct bio *bio)
{
	struct qcow2_bio *pb = dm_per_bio_data(bio, sizeof(*pb));
	struct qcow2_lookup lk;
	struct bio_list held;
	int r;

	/*
	 * Slots taken in ->map() (defer_write()), or none yet for a parked
	 * bio queued again. Read without q->lock: only this bio's own
	 * paths add or remove its node, never concurrently.
	 */
	if (hlist_unhashed(&pb->inflight) &&
	    !inflight_begin_or_park(q, pb, bio_voff(bio) >> q->hdr.cluster_bits,
				    bio_clusters(q, bio)))
		return;		/* the holder queues it again */
	/* Set by qcow2_unplug() before it queued this work: no lock needed */
	if (!bio_list_empty(&pb->batch) && write_batch(q, bio))
		return;
	r = span_kind(q, bio, &lk);
	if (r == SPAN_IN_PLACE) {
		inflight_end(q, pb);
		/* FUA: what maps these clusters must be durable too */
		r = bio->bi_opf & REQ_FUA && !qcow2_meta_durable(q) ?
		    qcow2_sync(q) : 0;
		if (r)
			map_complete(bio, r);
		else
			map_resolved(q, bio, &lk, true);
		return;
	}
	bio_list_init(&held);
	bio_list_add(&held, bio);
	if (r == SPAN_FRESH &&
	    write_fresh_held(q, &held, 1, pb->vcluster, pb->vcount))
		return;
	if (r == SPAN_FRESH)
		r = write_fresh(q, &bio, 1, pb->vcluster, pb->vcount);
	else if (r == SPAN_MIXED && bio_clusters(q, bio) > 1)
		r = write_each(q, bio);
	else if (r == SPAN_MIXED)
		r = write_allocating(q, bio, &lk);
	end_held(q, &held, NULL, 0, r);
}

/* ---- Discard ---- */

/*
 * Drop one whole guest cluster: its L2 entry becomes unallocated, or a
 * zero cluster where the backing chain would show through (v3 only; a
 * v2 image keeps the data: discard is advisory). The in-flight slot
 * orders this against allocating writes of the cluster. The host data's
 * reference goes once the L2 change is durable, like any free, and the
 * cluster is handed out again only after a grace period of q->io_srcu:
 * a write mapped to it in place before the change (a guest may write,
 * discard and flush without waiting for the write) lands before then.
 */
static int discard_cluster(struct qcow2 *q, u64 voff)
{
	struct qcow2_lookup lk;
	u64 entry = 0, bitmap = 0, old = 0;
	u32 old_len = q->hdr.cluster_size;
	int r;

	r = map_lookup(q, voff, true, &lk);
	if (r || !lk.l2_off)
		return r;
	switch (lk.m.type) {
	case QCOW2_CLUSTER_UNALLOCATED:
		if (!q->backing)
			return 0;
		break;
	case QCOW2_CLUSTER_ZERO_PLAIN:
		return 0;
	case QCOW2_CLUSTER_COMPRESSED:
		old_len = lk.m.comp_len;
		fallthrough;
	case QCOW2_CLUSTER_ZERO_ALLOC:
	case QCOW2_CLUSTER_NORMAL:
		old = lk.m.host_offset;
		break;
	}
	if (q->backing) {
		if (q->hdr.version < 3)
			return 0;
		/* Extended L2: every subcluster reads as zeros */
		if (q->hdr.extended_l2)
			bitmap = (u64)U32_MAX << 32;
		else
			entry = QCOW2_OFLAG_ZERO;
	}
	/* The L2 table may be shared with a snapshot: get our own */
	r = qcow2_l2_for_write(q, voff, &lk.l2_off);
	if (!r)
		r = qcow2_set_l2_entry(q, lk.l2_off, voff, entry, bitmap);
	if (!r && old)
		qcow2_defer_free(q, old, old_len);
	return r;
}

/*
 * The end of a request that changed mappings (@r: its result, @voff:
 * where it stopped): with FUA the changes are made durable first.
 */
static void mapping_done(struct qcow2 *q, struct bio *bio, int r,
			 const char *what, u64 voff)
{
	if (!r && bio->bi_opf & REQ_FUA)
		r = qcow2_sync(q);
	if (r && r != -EUCLEAN)
		DMERR_LIMIT("%s: %s at guest offset %llu failed: %d",
			    qcow2_name(q), what, voff, r);
	map_complete(bio, r);
}

/* Whole clusters only; the partial ones at either end are left alone. */
static void discard_work(struct qcow2 *q, struct bio *bio)
{
	struct qcow2_bio *pb = dm_per_bio_data(bio, sizeof(*pb));
	u64 cs = q->hdr.cluster_size, voff = bio_voff(bio);
	u64 start = round_up(voff, cs);
	u64 end = round_down(voff + bio->bi_iter.bi_size, cs);
	int r = 0;

	for (; !r && start < end; start += cs) {
		inflight_begin(q, pb, start >> q->hdr.cluster_bits, 1);
		r = discard_cluster(q, start);
		inflight_end(q, pb);
	}
	mapping_done(q, bio, r, "discard", start);
}

/* ---- Write zeroes ---- */

/* Does [@voff, @voff + @len) of one cluster read as zeros already? */
static bool reads_zero(struct qcow2 *q, const struct qcow2_lookup *lk,
		       u64 voff, u32 len)
{
	const struct qcow2_l2_map *m = &lk->m;
	u32 mask;

	if (sc_split(&q->hdr, m)) {
		mask = sc_mask(&q->hdr, voff, len);
		if (q->backing)
			return (m->sc_zero & mask) == mask;
		return !(m->sc_alloc & mask);
	}
	return m->type == QCOW2_CLUSTER_ZERO_PLAIN ||
	       m->type == QCOW2_CLUSTER_ZERO_ALLOC ||
	       (m->type == QCOW2_CLUSTER_UNALLOCATED && !q->backing);
}

/*
 * A whole cluster becomes a zero cluster (v3): with @unmap its data's
 * reference goes (like a discard's); without, a cluster we own keeps its
 * host cluster (zero flag, or every subcluster zero, over it).
 */
static int zero_cluster(struct qcow2 *q, u64 voff, bool unmap)
{
	bool ext = q->hdr.extended_l2;
	u64 entry = ext ? 0 : QCOW2_OFLAG_ZERO;
	u64 bitmap = ext ? (u64)U32_MAX << 32 : 0, old = 0;
	u32 old_len = q->hdr.cluster_size;
	struct qcow2_lookup lk;
	int r;

	r = map_lookup(q, voff, true, &lk);
	if (r)
		return r;
	switch (lk.m.type) {
	case QCOW2_CLUSTER_UNALLOCATED:
	case QCOW2_CLUSTER_ZERO_PLAIN:
		if (reads_zero(q, &lk, voff, q->hdr.cluster_size))
			return 0;
		break;
	case QCOW2_CLUSTER_COMPRESSED:
		old_len = lk.m.comp_len;
		fallthrough;
	case QCOW2_CLUSTER_ZERO_ALLOC:
	case QCOW2_CLUSTER_NORMAL:
		if (!unmap && lk.m.copied && lk.l2_copied)
			entry |= lk.m.host_offset | QCOW2_OFLAG_COPIED;
		else
			old = lk.m.host_offset;
		break;
	}
	r = qcow2_l2_for_write(q, voff, &lk.l2_off);
	if (!r)
		r = qcow2_set_l2_entry(q, lk.l2_off, voff, entry, bitmap);
	if (!r && old)
		qcow2_defer_free(q, old, old_len);
	return r;
}

/*
 * @bio: @len bytes (within a cluster) of zeros at @voff, for the
 * allocating write path, over the shared segments of q->zero_vecs (the
 * bio is only read from, never submitted).
 */
static void zero_bio_init(struct qcow2 *q, struct bio *bio, u64 voff, u32 len)
{
	unsigned short nr = DIV_ROUND_UP(len, PAGE_SIZE);

	bio_init(bio, NULL, q->zero_vecs, nr, REQ_OP_WRITE);
	bio->bi_vcnt = nr;
	bio->bi_iter.bi_sector = voff >> SECTOR_SHIFT;
	bio->bi_iter.bi_size = len;
}

/*
 * Part of a cluster (or any of a v2 image): nothing to do where it reads
 * as zeros already; zeros written in place in a cluster we own; else an
 * allocating write of zeros.
 */
static int zero_partial(struct qcow2 *q, u64 voff, u32 len)
{
	struct qcow2_lookup lk;
	struct bio bio;
	int r;

	r = map_lookup(q, voff, true, &lk);
	if (r || reads_zero(q, &lk, voff, len))
		return r;
	if (writable_in_place(q, &lk, voff, len))
		return zero_in_place(q, lk.m.host_offset +
				     qcow2_cluster_offset(&q->hdr, voff), len);
	zero_bio_init(q, &bio, voff, len);
	r = write_allocating(q, &bio, &lk);
	bio_uninit(&bio);
	return r;
}

/* REQ_OP_WRITE_ZEROES, cluster by cluster, each in its in-flight slot. */
static void zeroes_work(struct qcow2 *q, struct bio *bio)
{
	struct qcow2_bio *pb = dm_per_bio_data(bio, sizeof(*pb));
	u64 cs = q->hdr.cluster_size, voff = bio_voff(bio);
	u64 end = voff + bio->bi_iter.bi_size;
	bool unmap = !(bio->bi_opf & REQ_NOUNMAP);
	u32 n;
	int r = 0;

	for (; !r && voff < end; voff += n) {
		n = min(end, round_down(voff, cs) + cs) - voff;
		inflight_begin(q, pb, voff >> q->hdr.cluster_bits, 1);
		if (n == cs && q->hdr.version >= 3)
			r = zero_cluster(q, voff, unmap);
		else
			r = zero_partial(q, voff, n);
		inflight_end(q, pb);
	}
	mapping_done(q, bio, r, "write zeroes", voff);
}

/*
 * Does read @bio, which may span clusters (a cache miss sends it whole,
 * see read_miss_unit()), map to one piece of the image or one state:
 * within one cluster as its first subcluster says, or over data clusters
 * that continue each other in the image? Its slice is cached by now.
 */
static bool read_one_piece(struct qcow2 *q, struct bio *bio,
			   struct qcow2_lookup *lk)
{
	u64 cs = q->hdr.cluster_size, voff = bio_voff(bio);
	u64 end = voff + bio->bi_iter.bi_size;
	u64 next = round_down(voff, cs) + cs, host = lk->m.host_offset + cs;
	struct qcow2_lookup n;

	if (next >= end)
		return sc_narrow(q, bio, lk, false);
	if (lk->m.type != QCOW2_CLUSTER_NORMAL || sc_split(&q->hdr, &lk->m))
		return false;
	for (; next < end; next += cs, host += cs)
		if (map_lookup(q, next, true, &n) ||
		    !run_continues(q, &n, next, host, false))
			return false;
	return true;
}

/*
 * A read ->map() could not serve: its slice was not cached, its cluster
 * is compressed, or the backing chain has it. Served as one piece when
 * it is one, else through a buffer, cluster by cluster: a worker cannot
 * cut a bio.
 */
static void read_work(struct qcow2 *q, struct bio *bio)
{
	struct qcow2_lookup lk;
	int r;

	r = map_lookup(q, bio_voff(bio), true, &lk);
	if (r)
		map_complete(bio, r);
	else if (read_one_piece(q, bio, &lk))
		map_resolved(q, bio, &lk, true);
	else if (bio_clusters(q, bio) == 1)
		map_complete(bio, read_buffered(q, bio, NULL, &lk.m));
	else
		map_complete(bio, read_buffered(q, bio, q, NULL));
}

static void map_work_one(struct qcow2 *q, struct bio *bio)
{
	if (bio->bi_opf & REQ_PREFLUSH && !bio_sectors(bio)) {
		map_complete(bio, qcow2_sync(q));
		return;
	}
	if (bio_op(bio) == REQ_OP_DISCARD) {
		discard_work(q, bio);
		return;
	}
	if (bio_op(bio) == REQ_OP_WRITE_ZEROES) {
		zeroes_work(q, bio);
		return;
	}
	if (op_is_write(bio_op(bio))) {
		write_work(q, bio);
		return;
	}
	read_work(q, bio);
}

/*
 * A worker serves bios of this device: whatever it allocates, and the
 * file system below it, must not wait for writes to the device (swap on
 * it, a file system's writeback).
 */
static void map_work(struct work_struct *work)
{
	struct qcow2_bio *pb = container_of(work, struct qcow2_bio, work);
	unsigned int noio = memalloc_noio_save();

	map_work_one(pb->q, dm_bio_from_per_bio_data(pb, sizeof(*pb)));
	memalloc_noio_restore(noio);
}

static int defer(struct qcow2 *q, struct bio *bio)
{
	struct qcow2_bio *pb = dm_per_bio_data(bio, sizeof(*pb));
	bool zero = bio_op(bio) == REQ_OP_DISCARD ||
		    bio_op(bio) == REQ_OP_WRITE_ZEROES;

	INIT_WORK(&pb->work, map_work);
	queue_work(zero ? q->zero_wq : q->meta_wq, &pb->work);
	return DM_MAPIO_SUBMITTED;
}

/*
 * Writes held for the submitter's plug (defer_write()): the batch being
 * gathered, @head its holder and the others on head->batch. No lock: a
 * plug is its task's own, and its callback runs in that task; @head is
 * queued only once nothing more joins it.
 */
struct qcow2_plug {
	struct blk_plug_cb cb;
	struct qcow2_bio *head;
};

/*
 * At most this much guest data in one batch of held writes: it is
 * written from one array of segments (write_gathered()).
 */
#define QCOW2_BATCH_BYTES	SZ_4M

/*
 * May held write @pb join the batch from @head to @last? Plain writes
 * whose clusters follow each other, in one group (one L2 table), without
 * extended L2 entries (write_batch() serves fresh clusters only).
 */
static bool batch_follows(struct qcow2 *q, struct qcow2_bio *head,
			  struct qcow2_bio *last, struct qcow2_bio *pb)
{
	struct bio *bio = dm_bio_from_per_bio_data(pb, sizeof(*pb));
	struct bio *hbio = dm_bio_from_per_bio_data(head, sizeof(*head));
	u64 end = pb->vcluster + pb->vcount;

	return !q->hdr.extended_l2 && plain_write(hbio) && plain_write(bio) &&
	       pb->vcluster == last->vcluster + last->vcount &&
	       pb->vcluster >> QCOW2_GROUP_BITS ==
	       head->vcluster >> QCOW2_GROUP_BITS &&
	       (end - head->vcluster) << q->hdr.cluster_bits <= QCOW2_BATCH_BYTES;
}

/*
 * Hold @pb in the batch being gathered if it follows it; otherwise the
 * batch goes to a worker (write_batch()) and @pb starts the next one. A
 * batch is closed by the first write that cannot join it, not at the
 * plug's end: a page cache writing back 100 MB under one plug submits
 * every bio before it sleeps, and the data would reach the image only
 * after the last page was mapped. Sequential write-back has sent every
 * write into the batch's last cluster by then (they parked on its
 * holder), so the batches are whole.
 */
static void plug_hold(struct qcow2 *q, struct qcow2_plug *plug,
		      struct qcow2_bio *pb)
{
	struct qcow2_bio *head = plug->head, *last = head;
	struct bio *bio = dm_bio_from_per_bio_data(pb, sizeof(*pb));

	if (head && head->batch.tail)
		last = dm_per_bio_data(head->batch.tail, sizeof(*last));
	if (head && batch_follows(q, head, last, pb)) {
		bio_list_add(&head->batch, bio);
		return;
	}
	if (head)
		queue_work(q->meta_wq, &head->work);
	plug->head = pb;
}

/* The plug's end (or its task sleeps): the last batch goes to a worker. */
static void qcow2_unplug(struct blk_plug_cb *cb, bool from_schedule)
{
	struct qcow2_plug *plug = container_of(cb, struct qcow2_plug, cb);
	struct qcow2 *q = cb->data;

	if (plug->head)
		queue_work(q->meta_wq, &plug->head->work);
	kfree(plug);
}

/*
 * A write for the workers (its extent final: within one group) takes the
 * in-flight slots of its clusters here, or parks on their holder without
 * a worker. Its work is queued when a write that does not follow it comes
 * under the same plug, or the plug ends (or its task sleeps), as md's
 * raid1 holds its writes: the writes that follow into a cluster being
 * allocated (a page cache's sixteen 4 KiB bios for a new 64 KiB cluster,
 * submitted under one plug) are then parked by the time the holder's
 * worker runs, which takes them into its own write (write_fresh_held()).
 * Without the plug, that worker woken at once would often write the first
 * bio before the next was submitted.
 *
 * A write that must read its slice first (!@hold) goes to its worker at
 * once: held, the slice would be read only when its batch went (at the
 * plug's end if nothing else came), and every write after it under the
 * same plug (a write-back of many megabytes is one plug) would miss it
 * too and take a worker instead of the fast path. Its neighbours still
 * park on it meanwhile.
 */
static int defer_write(struct qcow2 *q, struct bio *bio, bool hold)
{
	struct qcow2_bio *pb = dm_per_bio_data(bio, sizeof(*pb));
	struct blk_plug_cb *cb = NULL;

	INIT_WORK(&pb->work, map_work);
	if (!inflight_begin_or_park(q, pb, bio_voff(bio) >> q->hdr.cluster_bits,
				    bio_clusters(q, bio)))
		return DM_MAPIO_SUBMITTED;
	if (hold)
		cb = blk_check_plugged(qcow2_unplug, q,
				       sizeof(struct qcow2_plug));
	if (!cb) {
		queue_work(q->meta_wq, &pb->work);
		return DM_MAPIO_SUBMITTED;
	}
	plug_hold(q, container_of(cb, struct qcow2_plug, cb), pb);
	return DM_MAPIO_SUBMITTED;
}

/* Keep only the part of @bio in its aligned @unit; dm sends the rest. */
static void cut_to(struct bio *bio, u64 unit)
{
	u64 voff = bio_voff(bio);
	u64 next = round_down(voff, unit) + unit;

	if (voff + bio->bi_iter.bi_size > next)
		dm_accept_partial_bio(bio, (next - voff) >> SECTOR_SHIFT);
}

static void cut_to_cluster(struct qcow2 *q, struct bio *bio)
{
	cut_to(bio, q->hdr.cluster_size);
}

/*
 * A read whose slice is not cached goes to a worker with this much of it
 * at most: a group, within one L2 slice, and 4 MiB, the largest buffer
 * read_work() reads through when the clusters do not continue each other
 * in the image. Cut to a cluster, a large read would reach the workers
 * in pieces of one cluster each: every bio ->map() meets while the slice
 * loads misses too. With subclusters, one cluster as before.
 */
static u64 read_miss_unit(struct qcow2 *q)
{
	u64 cs = q->hdr.cluster_size;

	if (q->hdr.extended_l2)
		return cs;
	return min_t(u64, cs << QCOW2_GROUP_BITS, SZ_4M);
}

/*
 * A bio may span clusters. ->map() serves it whole while its clusters
 * continue the first one's host run (data clusters next to each other in
 * the image, each writable in place for a write, slices cached), and
 * cuts it where the run ends. A write whose clusters all need new ones
 * with nothing to copy (fresh_cluster()) goes to a worker whole, as
 * does a FUA write's run (@deferred), within one group of clusters, and
 * a write whose first slice is not cached (qcow2_map_bio()). Everything
 * else is served one cluster at a time. A bad entry met ahead
 * is reported here, as the rest of the bio would report it next.
 */
static void map_extend(struct qcow2 *q, struct bio *bio,
		       struct qcow2_lookup *lk, bool write, bool deferred)
{
	u64 cs = q->hdr.cluster_size, voff = bio_voff(bio);
	u64 end = voff + bio->bi_iter.bi_size, limit = end;
	u64 next = round_down(voff, cs) + cs, host = lk->m.host_offset + cs;
	u64 group = cs << QCOW2_GROUP_BITS;
	bool fresh = write && fresh_cluster(q, lk);
	struct qcow2_lookup n;

	if (next >= end)
		return;
	if (!fresh && (lk->m.type != QCOW2_CLUSTER_NORMAL ||
		       q->hdr.extended_l2 ||
		       (write && !writable_in_place(q, lk, voff, cs)))) {
		cut_to_cluster(q, bio);
		return;
	}
	if (fresh || deferred)
		limit = min(end, round_down(voff, group) + group);
	for (; next < limit; next += cs, host += cs) {
		if (map_lookup(q, next, false, &n))
			break;
		if (fresh ? !fresh_cluster(q, &n) :
		    !run_continues(q, &n, next, host, write))
			break;
	}
	if (next < end)
		dm_accept_partial_bio(bio, (next - voff) >> SECTOR_SHIFT);
}

/* A read or write: served in place from here, or by a worker. */
static int map_rw(struct qcow2 *q, struct bio *bio)
{
	struct qcow2_lookup lk;
	bool write = op_is_write(bio_op(bio));
	int r;

	r = map_lookup(q, bio_voff(bio), false, &lk);
	if (!r && write && bio->bi_opf & REQ_FUA && !qcow2_meta_durable(q)) {
		/*
		 * Workers make the mapping durable before the data. When it
		 * is already, a FUA write in place goes on as any other, the
		 * data written with FUA (a file: O_DSYNC).
		 */
		map_extend(q, bio, &lk, true, true);
		return defer_write(q, bio, true);
	}
	if (r == -EAGAIN && write) {
		/*
		 * A slice to read first: the worker looks the clusters up and
		 * serves the write as a span when it can (write_work()), so
		 * keep all of it in the group. Cut to a cluster, a large write
		 * to a table just allocated (its slices not cached yet) would
		 * become one allocating write per cluster.
		 */
		cut_to(bio, (u64)q->hdr.cluster_size << QCOW2_GROUP_BITS);
		return defer_write(q, bio, false);
	}
	if (r == -EAGAIN) {
		cut_to(bio, read_miss_unit(q));
	} else if (r) {
		cut_to_cluster(q, bio);
	} else {
		map_extend(q, bio, &lk, write, false);
		sc_narrow(q, bio, &lk, true);
	}
	if (r == -EAGAIN ||
	    (!r && write && !writable_in_place(q, &lk, bio_voff(bio),
					       bio->bi_iter.bi_size)) ||
	    (!r && lk.m.type == QCOW2_CLUSTER_COMPRESSED) ||
	    (!r && lk.m.type == QCOW2_CLUSTER_UNALLOCATED && q->backing))
		return write ? defer_write(q, bio, true) : defer(q, bio);
	if (r)
		return DM_MAPIO_KILL;
	return map_resolved(q, bio, &lk, false);
}

/*
 * The read section of a bio, from ->map() to ->end_io(), which may run in
 * another task or in interrupt context: what srcu_down_read() and
 * srcu_up_read() (6.3) do, with the primitives both 6.1 and later export.
 * Sparse sees each half alone: the annotations tell it the section spans
 * the two.
 */
static void io_enter(struct qcow2 *q, struct qcow2_bio *pb)
{
	pb->srcu_idx = __srcu_read_lock(&q->io_srcu);
	__release(&q->io_srcu);
	pb->in_srcu = true;
}

static void io_exit(struct qcow2 *q, struct qcow2_bio *pb)
{
	__acquire(&q->io_srcu);
	__srcu_read_unlock(&q->io_srcu, pb->srcu_idx);
}

/*
 * Every bio that may reach guest data through a mapping (read, write,
 * write-zeroes) is a reader of q->io_srcu from here until it ends
 * (qcow2_bio_end()), whether ->map() remaps it, a worker serves it or it
 * waits parked or held: no cluster freed meanwhile is handed out again
 * before it has ended (see qcow2_grace_start_locked()). Discards and flushes
 * touch no data.
 */
int qcow2_map_bio(struct qcow2 *q, struct bio *bio)
{
	struct qcow2_bio *pb = dm_per_bio_data(bio, sizeof(*pb));
	bool write = op_is_write(bio_op(bio));
	int r;

	pb->q = q;
	pb->in_srcu = false;
	INIT_HLIST_NODE(&pb->inflight);
	bio_list_init(&pb->waiters);
	bio_list_init(&pb->batch);
	if (bio->bi_opf & REQ_PREFLUSH && !bio_sectors(bio)) {
		if (READ_ONCE(q->mode) == QCOW2_MODE_FAIL)
			return map_complete(bio, -EIO);
		return q->writable ? defer(q, bio) : map_complete(bio, 0);
	}
	if (write && READ_ONCE(q->mode) != QCOW2_MODE_RW)
		return DM_MAPIO_KILL;
	if (bio_op(bio) == REQ_OP_DISCARD)
		return defer(q, bio);
	if (bio_op(bio) != REQ_OP_READ && bio_op(bio) != REQ_OP_WRITE &&
	    bio_op(bio) != REQ_OP_WRITE_ZEROES)
		return DM_MAPIO_KILL;

	io_enter(q, pb);
	if (bio_op(bio) == REQ_OP_WRITE_ZEROES)
		return defer(q, bio);
	r = map_rw(q, bio);
	/* dm ends a killed bio without ->end_io() */
	if (r == DM_MAPIO_KILL)
		qcow2_bio_end(q, bio);
	return r;
}

/* ->end_io(): whatever served the bio is done with its clusters. */
void qcow2_bio_end(struct qcow2 *q, struct bio *bio)
{
	struct qcow2_bio *pb = dm_per_bio_data(bio, sizeof(*pb));

	if (pb->in_srcu) {
		pb->in_srcu = false;
		io_exit(q, pb);
	}
}

/* ---- Setup ---- */

/*
 * Segments of one cluster's write, at most: a bio's segments in the
 * cluster (each of 512 bytes or more), zeros a page a segment, and one
 * partial page per gap between bios (write_gathered(), which gathers at
 * most one bio per 512 bytes).
 */
static unsigned int cluster_vecs(u32 cs)
{
	return 2 * (cs >> SECTOR_SHIFT) + (cs >> PAGE_SHIFT) + 8;
}

/*
 * The workers' reserves (see struct qcow2): what one write needs, so that
 * it completes while memory is short (dm-qcow2-mem.c).
 */
int qcow2_map_init(struct qcow2 *q)
{
	u32 cs = q->hdr.cluster_size;
	unsigned int i, n = DIV_ROUND_UP(cs, PAGE_SIZE);
	int r;

	q->pool_vecs = cluster_vecs(cs);
	r = qcow2_pool_init(&q->host_pool, 2, sizeof(u64) << QCOW2_GROUP_BITS);
	if (!r)
		r = qcow2_pool_init(&q->buf_pool, 1, cs);
	if (!r)
		r = qcow2_pool_init(&q->vec_pool, 2,
				    q->pool_vecs * sizeof(struct bio_vec));
	if (r)
		return r;
	q->zero_vecs = kvmalloc_array(n, sizeof(*q->zero_vecs), GFP_KERNEL);
	if (!q->zero_vecs)
		return -ENOMEM;
	for (i = 0; i < n; i++) {
		q->zero_vecs[i].bv_page = ZERO_PAGE(0);
		q->zero_vecs[i].bv_len = PAGE_SIZE;
		q->zero_vecs[i].bv_offset = 0;
	}
	return 0;
}

/* Also after a failed qcow2_map_init(), or none */
void qcow2_map_exit(struct qcow2 *q)
{
	kvfree(q->zero_vecs);
	q->zero_vecs = NULL;
	qcow2_pool_exit(&q->vec_pool);
	qcow2_pool_exit(&q->buf_pool);
	qcow2_pool_exit(&q->host_pool);
}

/* ---- Test hooks ---- */

/*
 * Hold @bio, mapped to @pos, if it is the data bio the test_hold message
 * named (once): a test then frees and reuses its cluster underneath it
 * before test_release sends it on, as a slow device below would.
 */
static bool test_hold(struct qcow2 *q, struct bio *bio, u64 pos)
{
	struct qcow2_bio *pb = dm_per_bio_data(bio, sizeof(*pb));
	bool hold;

	spin_lock(&q->lock);
	hold = bio->bi_iter.bi_sector == q->test_hold_sector;
	if (hold) {
		q->test_hold_sector = (sector_t)-1;
		pb->pos = pos;
		bio_list_add(&q->test_held, bio);
	}
	spin_unlock(&q->lock);
	if (hold)
		DMINFO("%s: test hook: holding %s at sector %llu",
		       qcow2_name(q),
		       op_is_write(bio_op(bio)) ? "write" : "read",
		       (u64)bio->bi_iter.bi_sector);
	return hold;
}

/* Send the held bios on, as a worker would have. */
void qcow2_test_release(struct qcow2 *q)
{
	struct qcow2_bio *pb;
	struct bio_list held;
	struct bio *bio;

	spin_lock(&q->lock);
	held = q->test_held;
	bio_list_init(&q->test_held);
	q->test_hold_sector = (sector_t)-1;
	spin_unlock(&q->lock);
	while ((bio = bio_list_pop(&held))) {
		pb = dm_per_bio_data(bio, sizeof(*pb));
		map_data(q, bio, pb->pos, true);
	}
}

/*
 * test_hold <sector>: hold the next data bio mapped at that guest sector
 * (the kernel log says when it is held); test_release: send held bios
 * on; test_pin_cache: pin every clean slice; test_unpin_cache_dirty:
 * unpin them dirty. Only with the test_hooks module parameter set.
 */
int qcow2_test_message(struct qcow2 *q, unsigned int argc, char **argv)
{
	unsigned long long sector;
	char dummy;

	if (argc == 2 && !strcasecmp(argv[0], "test_hold") &&
	    sscanf(argv[1], "%llu%c", &sector, &dummy) == 1 &&
	    sector != (sector_t)-1) {
		WRITE_ONCE(q->test_hold_sector, sector);
		return 0;
	}
	if (argc == 1 && !strcasecmp(argv[0], "test_release")) {
		qcow2_test_release(q);
		return 0;
	}
	if (argc == 1 && !strcasecmp(argv[0], "test_pin_cache")) {
		DMINFO("%s: test hook: %u slices pinned",
		       qcow2_name(q),
		       qcow2_cache_test_pin(&q->cache));
		return 0;
	}
	if (argc == 1 && !strcasecmp(argv[0], "test_unpin_cache_dirty")) {
		down_read(&q->meta_sem);
		qcow2_cache_test_unpin_dirty(&q->cache);
		up_read(&q->meta_sem);
		return 0;
	}
	return -EINVAL;
}
