/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * dm-qcow2: internal interfaces between the layers of the target.
 *
 * Layering: calls only go downwards, and every file may use the pure
 * format code (dm-qcow2-format.[ch], which uses nothing else):
 *   dm-qcow2-target.c     device-mapper glue: table, ctr/dtr, map, status,
 *                         messages, suspend/resume
 *   dm-qcow2-map.c        guest-to-host mapping and the write pipeline
 *   metadata (dm-qcow2-meta.h inside the layer):
 *     dm-qcow2-open.c     opening, validating, reloading, closing images
 *     dm-qcow2-snap.c     internal snapshots, online grow
 *     dm-qcow2-alloc.c    refcounts, allocation, L1/L2 entry changes
 *     dm-qcow2-writeback.c  crash-safe writeback order, safe modes
 *   dm-qcow2-cache.c      L2 and refcount slices: LRU, memory bound
 *   dm-qcow2-zip.c        compressed clusters
 *   dm-qcow2-io.c         the image below: block device or regular file
 *   dm-qcow2-lock.c       who else may use an image: QEMU's locks, tables
 *   dm-qcow2-mem.c        reserves and allocation fault injection
 * The cache calls up only through its kick_writeback callback.
 */
#ifndef DM_QCOW2_H
#define DM_QCOW2_H

#include <linux/blkdev.h>
#include <linux/device-mapper.h>
#include <linux/fs.h>
#include <linux/list.h>
#include <linux/mempool.h>
#include <linux/mutex.h>
#include <linux/rwsem.h>
#include <linux/shrinker.h>
#include <linux/spinlock.h>
#include <linux/srcu.h>
#include <linux/wait.h>
#include <linux/workqueue.h>
#include <linux/xarray.h>

#include "dm-qcow2-format.h"

#define DM_MSG_PREFIX "qcow2"

/* Block layer and VFS interfaces that changed after 6.1 */
#ifdef BLK_OPEN_WRITE		/* 6.5: blk_mode_t */
#define QCOW2_MODE_WRITE	BLK_OPEN_WRITE
#define QCOW2_MODE_READ		BLK_OPEN_READ
#else
#define QCOW2_MODE_WRITE	FMODE_WRITE
#define QCOW2_MODE_READ		FMODE_READ
#endif

/*
 * File locks: 6.3 gave them a header of their own, 6.9 moved the fields
 * they share with leases into struct file_lock_core.
 */
#ifdef QCOW2_HAVE_FILELOCK_H	/* set by Kbuild */
#include <linux/filelock.h>
#endif
#ifdef for_each_file_lock
#define QCOW2_FL(fl, field)	((fl)->c.flc_##field)
#else
#define QCOW2_FL(fl, field)	((fl)->fl_##field)
#endif

/*
 * The bytes of the current bvec already done: bi_bvec_done until the 7.x
 * trees, which call it bi_offset.
 */
#ifdef QCOW2_HAVE_BVEC_DONE	/* set by Kbuild */
#define QCOW2_BVEC_DONE(iter)	((iter).bi_bvec_done)
#else
#define QCOW2_BVEC_DONE(iter)	((iter).bi_offset)
#endif

/*
 * 6.17: a queue may say that its write-zeroes bios unmap; the block layer
 * refuses limits where that bound is set and differs from
 * max_write_zeroes_sectors, and stacking starts it at UINT_MAX. The target
 * sets its own write-zeroes bound, and does not promise that zeroing
 * unmaps: none.
 */
#ifdef QCOW2_HAVE_WZEROES_UNMAP	/* set by Kbuild */
static inline void qcow2_no_wzeroes_unmap(struct queue_limits *limits)
{
	limits->max_hw_wzeroes_unmap_sectors = 0;
}
#else
static inline void qcow2_no_wzeroes_unmap(struct queue_limits *limits)
{
}
#endif

/* 6.7: shrinkers are allocated by the shrinker core */
#ifdef SHRINKER_ALLOCATED
#define QCOW2_SHRINKER_ALLOC
#endif

/* Backing images a table may name */
#define QCOW2_MAX_CHAIN		8

/* ---- Memory for the I/O paths (dm-qcow2-mem.c) ---- */

/* Optional memory: the caller has a slower way when it fails */
#define QCOW2_GFP_TRY	(GFP_NOIO | __GFP_NORETRY | __GFP_NOWARN)

struct qcow2_pool {
	mempool_t pool;
	size_t size;			/* bytes of an element */
};

int qcow2_mem_init(void);
void qcow2_mem_exit(void);
bool qcow2_alloc_fails(size_t size, gfp_t gfp);
void *qcow2_kvmalloc(size_t size, gfp_t gfp);
void *qcow2_kmalloc_array(size_t n, size_t size, gfp_t gfp);
int qcow2_pool_init(struct qcow2_pool *p, unsigned int min_nr, size_t size);
void qcow2_pool_exit(struct qcow2_pool *p);
void *qcow2_pool_get(struct qcow2_pool *p);
void *qcow2_pool_try(struct qcow2_pool *p);
void qcow2_pool_put(struct qcow2_pool *p, void *element);

/* ---- I/O backend (dm-qcow2-io.c) ---- */

struct qcow2_io {
	struct dm_dev *dev;		/* block device backend, or NULL */
	struct file *file;		/* regular file backend, or NULL */
	struct file *node;		/* a device's node, for locks (own mount) */
	u64 size;			/* bytes (a file: as it grows) */
	unsigned int lbs;		/* logical block size below us */
	bool dio;			/* file data uses direct I/O */
	/*
	 * A file: nothing was ever written at or past @written. @size is
	 * larger only when qcow2_io_reserve() grew the file.
	 */
	u64 written;
	struct mutex grow_lock;		/* a file: changes of its size */
	struct bio_set bs;		/* a block device: our own bios */

	/*
	 * Metadata writes completed, and how many of them the last
	 * completed flush covers: see qcow2_io_meta_flushed().
	 */
	atomic64_t meta_writes;
	u64 meta_flushed;
	/*
	 * A metadata write or flush failed: none is tried again, every one
	 * fails (qcow2_io_fail()), until the table is reloaded.
	 */
	atomic_t failed;

	/* A file: data submission, see qcow2_io_file_queue() */
	struct workqueue_struct *wq;
	spinlock_t queue_lock;		/* protects @queue, @waited */
	struct bio_list queue;		/* direct I/O bios from ->map() */
	struct list_head waited;	/* direct I/O that workers wait for */
	atomic_t waiting;		/* such I/O under way */
	struct work_struct queue_work;

	/* Users of the image, see dm-qcow2-lock.c */
	struct list_head user;		/* on the list of open images */
	const void *key;		/* qcow2_io_key(), NULL: not listed */
	struct mapped_device *md;	/* whose table opened it */
	bool writable;
};

int qcow2_io_open(struct dm_target *ti, struct qcow2_io *io,
		  const char *path, bool writable);
void qcow2_io_close(struct dm_target *ti, struct qcow2_io *io);
int qcow2_io_claim(struct dm_target *ti, struct qcow2_io *io, bool writable);
void qcow2_io_unclaim(struct qcow2_io *io);
void qcow2_io_for_each_sharer(struct qcow2_io *io,
			      void (*fn)(struct qcow2_io *o, void *arg),
			      void *arg);
int qcow2_io_read_meta(struct qcow2_io *io, void *buf, size_t len, u64 off);
int qcow2_io_read_data(struct qcow2_io *io, void *buf, size_t len, u64 off);
int qcow2_io_write_meta(struct qcow2_io *io, void *buf, size_t len, u64 off);
int qcow2_io_write_data(struct qcow2_io *io, const struct bio_vec *bv,
			unsigned int nr, size_t len, u64 off);
int qcow2_io_flush(struct qcow2_io *io);
void qcow2_io_fail(struct qcow2_io *io);
bool qcow2_io_meta_flushed(struct qcow2_io *io);
void qcow2_io_discard(struct qcow2_io *io, u64 off, u64 len);
u64 qcow2_io_written(struct qcow2_io *io);
int qcow2_io_zero_range(struct qcow2_io *io, u64 off, u64 len, u64 mark);
void qcow2_io_reserve(struct qcow2_io *io, u64 end);
void qcow2_io_trim(struct qcow2_io *io);
void qcow2_io_resync(struct qcow2_io *io);
const void *qcow2_io_key(struct qcow2_io *io);
unsigned int qcow2_buf_to_bvec(struct bio_vec *bv, unsigned int max,
			       void *buf, size_t len);
void qcow2_bio_copy_from_buf(struct bio *bio, const void *src);
void qcow2_bio_copy_range(struct bio *bio, u32 skip, const void *src,
			  u32 len);
void qcow2_io_file_queue(struct qcow2_io *io, struct bio *bio, u64 pos,
			 bool in_worker);
void qcow2_io_bdev_remap(struct qcow2_io *io, struct bio *bio, u64 pos);

/* ---- Metadata cache (dm-qcow2-cache.c) ---- */

struct qcow2_slice;

enum qcow2_slice_kind {
	QCOW2_SLICE_L2 = 0,
	QCOW2_SLICE_REFCOUNT = 1,
};

struct qcow2_cache_stats {
	u64 hits;
	u64 misses;
	u64 evictions;
	unsigned long slices;
	unsigned long max_slices;
	unsigned long dirty;
	unsigned int slice_size;
};

struct qcow2_cache {
	spinlock_t lock;		/* protects everything below */
	struct hlist_head *hash;
	unsigned int hash_bits;
	struct list_head lru;		/* clean unpinned slices, oldest first */
	struct list_head dirty;		/* dirty slices, pinned or not */
	wait_queue_head_t wait;		/* loads finishing, slices unpinned */
	unsigned long nr_slices;
	unsigned long max_slices;
	unsigned long nr_dirty;
	bool stuck;			/* writeback failed: never wait for it */
	/*
	 * Slices for loads when the allocator has none: QCOW2_CACHE_SPARE
	 * made with the cache, refilled first by every slice freed.
	 */
	struct list_head spare;
	unsigned int nr_spare;
	struct shrinker *shrinker;	/* gives clean slices back */
	struct list_head test_pinned;	/* qcow2_cache_test_pin() */
#ifndef QCOW2_SHRINKER_ALLOC
	struct shrinker shrinker_s;
#endif
	unsigned int slice_size;
	u64 hits, misses, evictions;
	struct qcow2_io *io;
	void (*kick_writeback)(void *owner);	/* cache full of dirt */
	void *owner;
};

#define QCOW2_CACHE_MIN_SLICES	64
#define QCOW2_CACHE_SPARE	16

int qcow2_cache_init(struct qcow2_cache *c, struct qcow2_io *io,
		     unsigned int slice_size, u64 bytes);
void qcow2_cache_exit(struct qcow2_cache *c);
int qcow2_cache_read(struct qcow2_cache *c, enum qcow2_slice_kind kind,
		     u64 slice_off, u32 off, void *buf, u32 len, bool can_block);
struct qcow2_slice *qcow2_cache_pin(struct qcow2_cache *c,
				    enum qcow2_slice_kind kind, u64 slice_off);
void qcow2_cache_unpin(struct qcow2_cache *c, struct qcow2_slice *s);
int qcow2_cache_modify(struct qcow2_cache *c, struct qcow2_slice *s,
		       int (*fn)(void *data, void *arg), void *arg);
int qcow2_cache_write_dirty(struct qcow2_cache *c, enum qcow2_slice_kind kind);
unsigned long qcow2_cache_nr_dirty(struct qcow2_cache *c);
void qcow2_cache_invalidate(struct qcow2_cache *c);
void qcow2_cache_resize(struct qcow2_cache *c, u64 bytes);
void qcow2_cache_set_stuck(struct qcow2_cache *c);
void qcow2_cache_forget(struct qcow2_cache *c, u64 off, u64 len);
void qcow2_cache_get_stats(struct qcow2_cache *c,
			   struct qcow2_cache_stats *st);
unsigned int qcow2_cache_test_pin(struct qcow2_cache *c);
void qcow2_cache_test_unpin_dirty(struct qcow2_cache *c);

/* ---- Compressed clusters (dm-qcow2-zip.c) ---- */

struct qcow2_zip {
	struct mutex lock;		/* everything below */
	void *ws;			/* decompressor workspace */
	size_t ws_size;
	u8 *in;				/* compressed bytes as read */
	size_t in_off;			/* where the stream starts in @in */
	u8 *out;			/* the last cluster decompressed */
	u64 out_key;			/* its host offset + 1, 0: none */
};

/* ---- The image (metadata layer) and mapping (dm-qcow2-map.c) ---- */

enum qcow2_mode {
	QCOW2_MODE_RW,
	QCOW2_MODE_RO,
	QCOW2_MODE_FAIL,
};

/*
 * Entries of an in-memory table (L1, refcount table) set since the last
 * writeback, first > last when none: under qcow2.lock, cleared by
 * qcow2_sync() once their blocks are written.
 */
struct qcow2_dirty {
	u64 first;
	u64 last;
};

struct qcow2 {
	struct dm_target *ti;
	struct qcow2_header hdr;
	struct qcow2_io io;
	struct qcow2_cache cache;
	struct qcow2_zip zip;
	bool writable;			/* the table is read-write */

	/*
	 * The backing chain, named by the table (never by the image): each
	 * layer is read-only, a qcow2 image or a raw one (@raw: only @io
	 * and hdr.size are used).
	 */
	struct qcow2 *backing;
	bool raw;
	char backing_fmt[QCOW2_MAX_BACKING_FMT + 1];	/* from the header */
	const char *backing_paths[QCOW2_MAX_CHAIN];	/* during ctr only */
	unsigned int nr_backing;
	char *snapshot;			/* read-only: serve this snapshot */
	bool grow;			/* the table may grow the image */
	u64 grow_to;			/* virtual size to grow to at resume */

	u64 *l1;			/* active L1 table, CPU byte order */
	u32 l1_entries;			/* entries that map the virtual size */
	u32 l1_loaded;			/* entries in memory (whole blocks) */
	struct qcow2_dirty l1_dirty;	/* L1 entries not yet written */
	u64 *reftable;			/* writable only, CPU byte order */
	u32 rt_entries;
	struct qcow2_dirty rt_dirty;	/* refcount table entries, same */
	u8 *hdr_block;			/* first meta_block bytes of the image */
	/*
	 * Clusters holding L2 tables (from the L1 table) and refcount
	 * blocks (writable), by cluster index: data may never land there.
	 */
	struct xarray meta;
	unsigned int meta_block;	/* unit of in-place table writes */

	/*
	 * Lock order: alloc_lock, then sync_lock, then meta_sem.
	 * alloc_lock serialises cluster allocation and L1/refcount-table
	 * changes. meta_sem is taken shared around every change to a cached
	 * L2 or refcount slice, and exclusively by qcow2_sync() while it
	 * writes them, so that what it writes is one consistent state.
	 */
	struct mutex alloc_lock;
	struct mutex sync_lock;		/* one writeback at a time */
	u64 sync_started;		/* writebacks begun (under meta_sem) */
	u64 sync_done;			/* the last one finished, and its */
	int sync_result;		/* result (both under sync_lock) */
	struct rw_semaphore meta_sem;
	u64 free_cursor;		/* first cluster that may be free */
	u64 end_cluster;		/* past the last cluster seen in use */
	atomic64_t allocated;		/* clusters with a non-zero refcount */
	bool refcounts_partial;		/* @allocated: not every block read */
	bool dirty_bit_set;		/* lazy refcounts: we set the dirty bit */
	bool resumed;			/* a resume has reloaded the image */

	spinlock_t lock;		/* inflight, frees, dirty ranges */
	struct hlist_head inflight[64];	/* clusters being allocated */
	wait_queue_head_t inflight_wait;
	struct list_head frees;		/* refcount decreases waiting for L2 */
	struct qcow2_pool free_pool;	/* their records (writable) */
	void *alloc_buf;		/* a cluster: new tables, alloc_lock */
	void *table_buf;		/* a meta_block: qcow2_write_table_block() */
	struct mutex table_buf_lock;

	/*
	 * Reserves of the workers (dm-qcow2-map.c, qcow2_map_init()). One
	 * caller holds at most one element of each, taken in this order:
	 * host_pool, buf_pool, vec_pool.
	 */
	struct qcow2_pool host_pool;	/* host offsets of a group's clusters */
	struct qcow2_pool buf_pool;	/* a cluster of data */
	struct qcow2_pool vec_pool;	/* segments of a cluster's write */
	unsigned int pool_vecs;		/* entries of a vec_pool element */
	struct bio_vec *zero_vecs;	/* a cluster of ZERO_PAGE, read-only */

	/*
	 * Every read, write and write-zeroes bio is a reader of @io_srcu
	 * from ->map() until it ends (qcow2_map_bio(), qcow2_bio_end()),
	 * whatever path serves it. A refcount decrease whose table change
	 * is durable waits on @frees_ready, then @frees_grace, for a grace
	 * period that began after that change: by then no I/O mapped to the
	 * cluster before the change is in flight, and the allocator may
	 * hand it out again (qcow2_sync(), grace_work_fn()). Under q->lock.
	 */
	struct srcu_struct io_srcu;
	bool io_srcu_ready;		/* init_srcu_struct() done */
	struct list_head frees_ready;	/* waiting for the next grace period */
	struct list_head frees_grace;	/* waiting for the current one */
	bool grace_pending;		/* @grace_rcu queued or being served */
	struct rcu_head grace_rcu;
	struct work_struct grace_work;	/* applies @frees_grace */

	struct workqueue_struct *meta_wq;	/* cache misses, allocation */
	/*
	 * Discard and write-zeroes: they sleep for in-flight slots, which
	 * writes may take in ->map() while their work is still queued on
	 * meta_wq (see defer_write()); sleepers there could hold every
	 * worker meta_wq may run.
	 */
	struct workqueue_struct *zero_wq;
	struct workqueue_struct *sync_wq;	/* writeback, events */
	struct work_struct sync_work;	/* cache full of dirty slices */
	struct work_struct event_work;	/* dm_table_event() may sleep */

	enum qcow2_mode mode;
	unsigned long flags;		/* QCOW2_F_* */
	atomic64_t corruptions;		/* bad metadata met at run time */
	/*
	 * Test hook (module parameter test_hooks): the next data bio
	 * mapped at guest sector @test_hold_sector is held on @test_held,
	 * unsubmitted, until the test_release message (under q->lock).
	 */
	sector_t test_hold_sector;
	struct bio_list test_held;

	/* The table as given, for STATUSTYPE_TABLE */
	char *table_args;
	u64 cache_bytes;
};

#define QCOW2_F_CORRUPT		0	/* corruption seen, event raised */
#define QCOW2_F_META_ERROR	1	/* a metadata write failed */
#define QCOW2_F_STALE		2	/* another table may write the image */

/* Per-bio data */
struct qcow2_bio {
	struct qcow2 *q;
	struct work_struct work;
	struct kiocb iocb;
	atomic_t ref;			/* file I/O: submitter + completion */
	long ret;			/* file I/O: result of the kiocb */
	struct bio_vec *bvec;		/* file I/O: merged bios' segments */
	u64 pos;			/* file I/O: byte offset in the image */
	struct hlist_node inflight;	/* allocating write: its clusters */
	u64 vcluster;			/* the first one */
	u32 vcount;			/* how many */
	struct bio_list waiters;	/* writes parked on those clusters */
	struct bio_list batch;		/* held writes that follow: unplug */
	int srcu_idx;			/* of q->io_srcu, when @in_srcu */
	bool in_srcu;
};

static inline const char *qcow2_name(struct qcow2 *q)
{
	return dm_table_device_name(q->ti->table);
}

/* The mapped device's number, for trace events */
static inline dev_t qcow2_devt(struct qcow2 *q)
{
	return disk_devt(dm_disk(dm_table_get_md(q->ti->table)));
}

/* dm-qcow2-open.c */
int qcow2_open_image(struct qcow2 *q, const char **err);
int qcow2_open_chain(struct qcow2 *q, const char **err);
void qcow2_close_image(struct qcow2 *q);
int qcow2_reload_image(struct qcow2 *q);
int qcow2_deactivate(struct qcow2 *q);

/* dm-qcow2-snap.c */
int qcow2_grow_check(struct qcow2 *q, u64 size, const char **err);

/* dm-qcow2-alloc.c */
const char *qcow2_host_cluster_check(struct qcow2 *q, u64 off);
const char *qcow2_data_cluster_check(struct qcow2 *q, u64 off);
const char *qcow2_data_range_check(struct qcow2 *q, u64 off, u64 len);
int qcow2_alloc_cluster(struct qcow2 *q, u64 *host);
int qcow2_alloc_clusters(struct qcow2 *q, u32 n, u64 *host, u64 *mark);
int qcow2_refcount_update(struct qcow2 *q, u64 host, int delta);
void qcow2_defer_free(struct qcow2 *q, u64 host, u64 len);
int qcow2_l2_for_write(struct qcow2 *q, u64 voff, u64 *l2_off);
int qcow2_set_l2_entry(struct qcow2 *q, u64 l2_off, u64 voff, u64 entry,
		       u64 bitmap);

/* dm-qcow2-writeback.c */
int qcow2_corrupt(struct qcow2 *q, u64 voff, const char *what);
void qcow2_meta_error(struct qcow2 *q, int err);
int qcow2_sync(struct qcow2 *q);
bool qcow2_meta_durable(struct qcow2 *q);
void qcow2_frees_wait(struct qcow2 *q);

/* dm-qcow2-zip.c */
void qcow2_zip_init(struct qcow2_zip *zip);
int qcow2_zip_setup(struct qcow2 *q);
void qcow2_zip_exit(struct qcow2_zip *zip);
void qcow2_zip_invalidate(struct qcow2_zip *zip);
void qcow2_zip_forget(struct qcow2_zip *zip, u64 off, u64 len);
int qcow2_zip_read_bio(struct qcow2 *q, const struct qcow2_l2_map *m,
		       struct bio *bio);
int qcow2_zip_read_buf(struct qcow2 *q, const struct qcow2_l2_map *m,
		       u64 voff, void *dst, u32 len);

/* dm-qcow2-map.c */
int qcow2_map_init(struct qcow2 *q);
void qcow2_map_exit(struct qcow2 *q);
int qcow2_map_bio(struct qcow2 *q, struct bio *bio);
void qcow2_bio_end(struct qcow2 *q, struct bio *bio);
int qcow2_test_message(struct qcow2 *q, unsigned int argc, char **argv);
void qcow2_test_release(struct qcow2 *q);

#endif /* DM_QCOW2_H */
