/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * dm-qcow2: internal interfaces between the target glue, the mapping code,
 * the metadata cache and the I/O backend.
 *
 * Layering (calls only go downwards; all may use dm-qcow2-format):
 *   dm-qcow2-target.c  table parsing, ctr/dtr, map, status
 *   dm-qcow2-map.c     virtual-to-host mapping, workers
 *   dm-qcow2-cache.c   L2 slices: lookup, LRU, memory bound
 *   dm-qcow2-io.c      the image: block device or regular file
 */
#ifndef DM_QCOW2_H
#define DM_QCOW2_H

#include <linux/device-mapper.h>
#include <linux/fs.h>
#include <linux/list.h>
#include <linux/spinlock.h>
#include <linux/wait.h>
#include <linux/workqueue.h>

#include "dm-qcow2-format.h"

#define DM_MSG_PREFIX "qcow2"

/* Block layer and VFS interfaces that changed after 6.1 */
#ifdef BLK_OPEN_WRITE		/* 6.5: blk_mode_t */
#define QCOW2_MODE_WRITE	BLK_OPEN_WRITE
#else
#define QCOW2_MODE_WRITE	FMODE_WRITE
#endif

/* ---- I/O backend (dm-qcow2-io.c) ---- */

struct qcow2_io {
	struct dm_dev *dev;		/* block device backend, or NULL */
	struct file *file;		/* regular file backend, or NULL */
	u64 size;			/* bytes, as found at open */
	unsigned int lbs;		/* logical block size below us */
	bool dio;			/* file data uses direct I/O */
};

int qcow2_io_open(struct dm_target *ti, struct qcow2_io *io,
		  const char *path, bool writable);
void qcow2_io_close(struct dm_target *ti, struct qcow2_io *io);
int qcow2_io_read_meta(struct qcow2_io *io, void *buf, size_t len, u64 off);
void qcow2_io_file_submit(struct qcow2_io *io, struct bio *bio, u64 pos);
void qcow2_io_bdev_remap(struct qcow2_io *io, struct bio *bio, u64 pos);

/* ---- Metadata cache (dm-qcow2-cache.c) ---- */

struct qcow2_slice;

struct qcow2_cache_stats {
	u64 hits;
	u64 misses;
	u64 evictions;
	unsigned long slices;
	unsigned long max_slices;
	unsigned int slice_size;
};

struct qcow2_cache {
	spinlock_t lock;		/* protects everything below */
	struct hlist_head *hash;
	unsigned int hash_bits;
	struct list_head lru;		/* unpinned slices, oldest first */
	wait_queue_head_t wait;		/* loads finishing, slices unpinned */
	unsigned long nr_slices;
	unsigned long max_slices;
	unsigned int slice_size;
	u64 hits, misses, evictions;
	struct qcow2_io *io;
};

#define QCOW2_CACHE_MIN_SLICES	64

int qcow2_cache_init(struct qcow2_cache *c, struct qcow2_io *io,
		     unsigned int slice_size, u64 bytes);
void qcow2_cache_exit(struct qcow2_cache *c);
int qcow2_cache_read(struct qcow2_cache *c, u64 slice_off, u32 off,
		     void *buf, u32 len, bool can_block);
void qcow2_cache_get_stats(struct qcow2_cache *c,
			   struct qcow2_cache_stats *st);

/* ---- Mapping (dm-qcow2-map.c) ---- */

enum qcow2_mode {
	QCOW2_MODE_RW,
	QCOW2_MODE_RO,
	QCOW2_MODE_FAIL,
};

struct qcow2 {
	struct dm_target *ti;
	struct qcow2_header hdr;
	struct qcow2_io io;
	struct qcow2_cache cache;

	u64 *l1;			/* active L1 table, CPU byte order */
	u32 l1_entries;			/* entries loaded (cover the size) */

	struct workqueue_struct *meta_wq;	/* cache misses */
	struct workqueue_struct *io_wq;		/* file data submission */

	enum qcow2_mode mode;
	unsigned long flags;		/* QCOW2_F_* */
	atomic64_t corruptions;		/* bad metadata met at run time */

	struct work_struct event_work;	/* dm_table_event() may sleep */

	/* The table as given, for STATUSTYPE_TABLE */
	char *table_args;
	u64 cache_bytes;
};

#define QCOW2_F_CORRUPT		0	/* corruption seen, event raised */

/* Per-bio data */
struct qcow2_bio {
	struct qcow2 *q;
	struct work_struct work;
	struct kiocb iocb;
	atomic_t ref;			/* file I/O: submitter + completion */
	long ret;			/* file I/O: result of the kiocb */
	u64 pos;			/* file I/O: byte offset in the image */
};

int qcow2_open_image(struct qcow2 *q, const char **err);
void qcow2_close_image(struct qcow2 *q);
int qcow2_map_bio(struct qcow2 *q, struct bio *bio);

#endif /* DM_QCOW2_H */
