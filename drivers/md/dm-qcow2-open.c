// SPDX-License-Identifier: GPL-2.0-only
/*
 * dm-qcow2: opening an image and its backing chain, and closing them.
 *
 * This file owns: reading and validating the header, L1 table and
 * refcounts (nothing is written before every check has passed), refusing
 * what the target does not serve, the per-image state, workqueues, cache
 * and reserves, the backing chain the table names, the reload before each
 * resume (another table may have written the image), clean deactivation
 * and teardown.
 */
#include <linux/sched/mm.h>
#include <linux/slab.h>
#include <linux/vmalloc.h>

#include "dm-qcow2-meta.h"

#define QCOW2_MAX_SLICE_SIZE	4096U
#define QCOW2_DEFAULT_CACHE	(4ULL << 20)

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
 * Other tables of the same image, from the image's users list (a reload,
 * dmsetup load then resume, while the old table is live; other devices
 * only when neither writes, see dm-qcow2-lock.c): a table tells the
 * lazy-refcounts dirty bit another set from one a crash left, and knows
 * whether another may have written its image since it read it
 * (QCOW2_F_STALE). Every user is the io of a struct qcow2.
 */
static struct qcow2 *sharer_image(struct qcow2_io *o)
{
	return container_of(o, struct qcow2, io);
}

/* Of two tables of one image, each reads it again if the other may write */
static void mark_stale(struct qcow2_io *o, void *arg)
{
	struct qcow2 *q = arg;

	if (q->writable)
		set_bit(QCOW2_F_STALE, &sharer_image(o)->flags);
	if (o->writable)
		set_bit(QCOW2_F_STALE, &q->flags);
}

static void find_live_dirty_bit(struct qcow2_io *o, void *arg)
{
	if (READ_ONCE(sharer_image(o)->dirty_bit_set))
		*(bool *)arg = true;
}

/* Does a live table of the same image hold the dirty bit it set? */
static bool dirty_bit_is_live(struct qcow2 *q)
{
	bool ours = false;

	qcow2_io_for_each_sharer(&q->io, find_live_dirty_bit, &ours);
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
			qcow2_meta_mark(q, l2, QCOW2_META_L2, GFP_KERNEL);
}

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

	rt = qcow2_load_table(q, h->refcount_table_offset, n, n);
	if (!rt)
		return;		/* the lookups still check everything else */
	for (i = 0; i < n; i++)
		if (!qcow2_reftable_decode(h, rt[i], &block, &err) && block)
			qcow2_meta_mark(q, block, QCOW2_META_REFBLOCK, GFP_KERNEL);
	kvfree(rt);
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
	q->l1 = qcow2_load_table(q, h->l1_table_offset, q->l1_loaded,
				 round_up(max(q->l1_loaded, 1U), per_block));
	/* What is in memory is what is on disk (a reload follows a sync) */
	qcow2_dirty_clear(q, &q->l1_dirty);
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
	u64 per = qcow2_clusters_per_block(q), i;

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
	u64 per = qcow2_clusters_per_block(q), block, n = 0, first_free = ~0ULL;
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
		if (qcow2_meta_mark(q, block, QCOW2_META_REFBLOCK, GFP_KERNEL)) {
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
	q->reftable = qcow2_load_table(q, h->refcount_table_offset,
				       q->rt_entries, q->rt_entries);
	if (!q->reftable) {
		*err = "Cannot read the refcount table";
		return -EIO;
	}
	qcow2_dirty_clear(q, &q->rt_dirty);
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
	qcow2_alloc_init(q);
	qcow2_writeback_init(q);
	qcow2_zip_init(&q->zip);
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
	q->cache.kick_writeback = qcow2_kick_writeback;
	q->cache.owner = q;
	return r;
}

/* What load_metadata() reads into memory */
static void free_tables(struct qcow2 *q)
{
	kvfree(q->l1);
	kvfree(q->reftable);
	kfree(q->hdr_block);
	q->l1 = NULL;
	q->reftable = NULL;
	q->hdr_block = NULL;
}

/*
 * Read and validate the header, L1 table and (writable) refcounts. Used at
 * table load, and again before each resume: a table loaded while another
 * table on the same image was live must not trust what it read then.
 */
static int load_metadata(struct qcow2 *q, const char **err)
{
	int r;

	free_tables(q);
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
		       qcow2_name(q));
	if (q->snapshot) {
		r = qcow2_load_snapshot(q, err);
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
	return qcow2_write_header(q);
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
 * (QCOW2_F_STALE, see mark_stale()), or its header block changed, the
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
		r = qcow2_grow(q, q->grow_to);
		err = "cannot grow the image";
	}
	mutex_unlock(&q->alloc_lock);
	memalloc_noio_restore(noio);
	if (r) {
		DMERR("%s: cannot resume: %s", qcow2_name(q),
		      err ? err : "cannot read the image");
		/*
		 * The tables in memory are gone or half loaded: nothing may
		 * be written from them, at teardown either.
		 */
		qcow2_enter_fail_mode(q);
	}
	return r;
}

/*
 * What allocating clusters and writing tables back need, made with the
 * table: the allocator's reserves, and a block for in-place table writes
 * (table_buf_lock).
 */
static int init_reserves(struct qcow2 *q)
{
	int r;

	r = qcow2_alloc_reserves(q);
	if (r)
		return r;
	q->table_buf = kmalloc(q->meta_block, GFP_KERNEL);
	return q->table_buf ? 0 : -ENOMEM;
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
	qcow2_io_for_each_sharer(&q->io, mark_stale, q);
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
			DMERR("%s: backing image %u (%s): %s", qcow2_name(q),
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
		r = qcow2_write_header(q);
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
	if (q->backing) {
		qcow2_close_image(q->backing);
		qcow2_io_close(q->ti, &q->backing->io);
		kfree(q->backing);
		q->backing = NULL;
	}

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
	qcow2_alloc_exit(q);
	kfree(q->table_buf);
	q->table_buf = NULL;
	free_tables(q);
}
