// SPDX-License-Identifier: GPL-2.0-only
/*
 * dm-qcow2: a device-mapper target that serves a qcow2 image.
 *
 * Table: <start> <length> qcow2 <image_path> [<#feature_args> <arg>*]
 *
 * <image_path> is a block device or a regular file holding the image.
 * Feature arguments:
 *   cache_size <bytes>	memory bound of the L2 slice cache (suffixes
 *			k, m, g accepted; default 4 MiB)
 *   backing <path>	the next image of the backing chain, nearest first
 *   snapshot <id>	serve this internal snapshot (read-only tables)
 *   grow		a <length> beyond the virtual size grows the image
 *
 * A writable table serves the image read-write; a read-only one
 * (dmsetup create --readonly) never writes to it.
 *
 * This file is the device-mapper glue only: table parsing, construction
 * and destruction, ->map(), status and queue limits. The qcow2 logic lives
 * in dm-qcow2-map.c and below. See
 * Documentation/admin-guide/device-mapper/dm-qcow2.rst.
 */
#include <linux/module.h>
#include <linux/sizes.h>
#include <linux/slab.h>
#include <linux/string.h>

#include "dm-qcow2.h"

#define CREATE_TRACE_POINTS
#include "dm-qcow2-trace.h"

#define QCOW2_MAX_CACHE_BYTES	SZ_4G

/*
 * Test hooks: the test_hold and test_release messages, which hold a data
 * bio unsubmitted so that a test can change the image underneath it, and
 * test_pin_cache and test_unpin_cache_dirty, which hold the slice cache
 * full (tests/vm/t-race.sh). Off unless set; never needed in production.
 */
static bool test_hooks;
module_param(test_hooks, bool, 0644);
MODULE_PARM_DESC(test_hooks, "Accept the test_* messages (tests only)");

static const char *mode_name(enum qcow2_mode mode)
{
	switch (mode) {
	case QCOW2_MODE_RW:
		return "rw";
	case QCOW2_MODE_RO:
		return "ro";
	default:
		return "fail";
	}
}

/* A cache size: bytes with an optional K/M/G suffix, 1 to 4G. */
static int cache_size_arg(const char *arg, u64 *bytes)
{
	char *end;

	*bytes = memparse(arg, &end);
	if (*end || !*bytes || *bytes > QCOW2_MAX_CACHE_BYTES)
		return -EINVAL;
	return 0;
}

static int parse_cache_size(struct qcow2 *q, struct dm_arg_set *as,
			    char **error)
{
	const char *arg = dm_shift_arg(as);

	if (!arg) {
		*error = "cache_size needs a value";
		return -EINVAL;
	}
	if (cache_size_arg(arg, &q->cache_bytes)) {
		*error = "Invalid cache_size (bytes, 1 to 4G)";
		return -EINVAL;
	}
	return 0;
}

/* backing <path>: the next image of the chain, nearest first */
static int parse_backing(struct qcow2 *q, struct dm_arg_set *as,
			 char **error)
{
	if (q->nr_backing == QCOW2_MAX_CHAIN) {
		*error = "Too many backing images";
		return -EINVAL;
	}
	q->backing_paths[q->nr_backing++] = dm_shift_arg(as);
	return 0;
}

static int parse_features(struct qcow2 *q, struct dm_arg_set *as,
			  char **error)
{
	static const struct dm_arg _args[] = {
		/* backing <path> each, cache_size, snapshot, grow */
		{0, 2 * QCOW2_MAX_CHAIN + 5,
		 "Invalid number of feature arguments"},
	};
	unsigned int argc;
	const char *arg;
	int r;

	if (!as->argc)
		return 0;
	r = dm_read_arg_group(_args, as, &argc, error);
	if (r)
		return r;
	while (argc) {
		arg = dm_shift_arg(as);
		argc--;
		if (!strcasecmp(arg, "cache_size") && argc) {
			r = parse_cache_size(q, as, error);
			argc--;
		} else if (!strcasecmp(arg, "backing") && argc) {
			r = parse_backing(q, as, error);
			argc--;
		} else if (!strcasecmp(arg, "backing")) {
			*error = "backing needs a path";
			r = -EINVAL;
		} else if (!strcasecmp(arg, "snapshot") && argc &&
			   !q->snapshot) {
			q->snapshot = kstrdup(dm_shift_arg(as), GFP_KERNEL);
			r = q->snapshot ? 0 : -ENOMEM;
			argc--;
		} else if (!strcasecmp(arg, "snapshot")) {
			*error = "snapshot needs one id or name";
			r = -EINVAL;
		} else if (!strcasecmp(arg, "grow")) {
			q->grow = true;
			r = 0;
		} else if (!strcasecmp(arg, "cache_size")) {
			*error = "cache_size needs a value";
			r = -EINVAL;
		} else {
			*error = "Unknown feature argument";
			r = -EINVAL;
		}
		if (r)
			return r;
	}
	if (as->argc) {
		*error = "Too many arguments";
		return -EINVAL;
	}
	return 0;
}

/* Keep the arguments as given, so that "dmsetup table" shows them back */
static char *join_args(unsigned int argc, char **argv)
{
	size_t len = 1;
	unsigned int i;
	char *s;

	for (i = 0; i < argc; i++)
		len += strlen(argv[i]) + 1;
	s = kzalloc(len, GFP_KERNEL);
	if (!s)
		return NULL;
	for (i = 0; i < argc; i++) {
		if (i)
			strcat(s, " ");
		strcat(s, argv[i]);
	}
	return s;
}

static int check_table(struct dm_target *ti, struct qcow2 *q)
{
	if (ti->begin) {
		ti->error = "Target must start at sector 0";
		return -EINVAL;
	}
	q->writable = dm_table_get_mode(ti->table) & QCOW2_MODE_WRITE;
	if (q->snapshot && q->writable) {
		ti->error = "A snapshot can only be activated read-only";
		return -EROFS;
	}
	return 0;
}

/*
 * A length beyond the virtual size grows the image at resume, only when
 * asked (the grow feature argument: a mistyped length must not change the
 * image for good), and only for a writable table of the active image (see
 * qcow2_grow_check()).
 */
static int check_length(struct dm_target *ti, struct qcow2 *q)
{
	const char *err;
	int r;

	if (ti->len <= q->hdr.size >> SECTOR_SHIFT)
		return 0;
	if (!q->writable || q->snapshot) {
		ti->error = "Device length exceeds the image's virtual size";
		return -EINVAL;
	}
	if (!q->grow) {
		ti->error = "Device length exceeds the virtual size (needs the grow argument)";
		return -EINVAL;
	}
	/* Device mapper refuses lengths past LLONG_MAX bytes: no wrap */
	r = qcow2_grow_check(q, (u64)ti->len << SECTOR_SHIFT, &err);
	if (r) {
		ti->error = (char *)err;
		return r;
	}
	q->grow_to = (u64)ti->len << SECTOR_SHIFT;
	return 0;
}

static void qcow2_free(struct qcow2 *q)
{
	kfree(q->snapshot);
	kfree(q->table_args);
	kfree(q);
}

/*
 * Construct a mapping:
 *   <image_path> [<#feature_args> <arg>*]
 */
static int qcow2_ctr(struct dm_target *ti, unsigned int argc, char **argv)
{
	struct dm_arg_set as = { .argc = argc, .argv = argv };
	const char *err = NULL;
	struct qcow2 *q;
	int r;

	if (argc < 1) {
		ti->error = "Missing image path";
		return -EINVAL;
	}
	q = kzalloc(sizeof(*q), GFP_KERNEL);
	if (!q) {
		ti->error = "Cannot allocate memory";
		return -ENOMEM;
	}
	q->ti = ti;
	q->table_args = join_args(argc, argv);
	if (!q->table_args) {
		ti->error = "Cannot allocate memory";
		r = -ENOMEM;
		goto bad_alloc;
	}
	dm_shift_arg(&as);
	r = parse_features(q, &as, &ti->error);
	if (!r)
		r = check_table(ti, q);
	if (r)
		goto bad_alloc;

	r = qcow2_io_open(ti, &q->io, argv[0], q->writable);
	if (r)
		goto bad_alloc;
	r = qcow2_open_image(q, &err);
	if (!r)
		r = qcow2_open_chain(q, &err);
	if (r) {
		ti->error = (char *)err;
		goto bad_image;
	}
	r = qcow2_map_init(q);
	if (r) {
		ti->error = "Cannot allocate memory";
		goto bad_image;
	}
	r = check_length(ti, q);
	if (r)
		goto bad_image;

	/*
	 * No max_io_len: ->map() takes bios over several clusters when they
	 * are contiguous in the image and cuts the rest (map_extend()).
	 */
	/*
	 * Flushes carry our metadata writeback, so they must reach map()
	 * even when the backend (a file, or a disk without a volatile
	 * cache) would not make dm advertise a write cache by itself.
	 */
	ti->flush_supported = true;
	ti->num_flush_bios = 1;
	/* Discards free clusters; handled here, whatever is below */
	if (q->writable) {
		ti->num_discard_bios = 1;
		ti->discards_supported = true;
		ti->num_write_zeroes_bios = 1;
	}
	ti->per_io_data_size = sizeof(struct qcow2_bio);
	ti->private = q;
	return 0;

bad_image:
	qcow2_close_image(q);
	qcow2_map_exit(q);
	qcow2_io_close(ti, &q->io);
bad_alloc:
	qcow2_free(q);
	return r;
}

static void qcow2_dtr(struct dm_target *ti)
{
	struct qcow2 *q = ti->private;

	if (qcow2_deactivate(q))
		DMERR("%s: metadata could not be written back",
		      dm_table_device_name(ti->table));
	qcow2_close_image(q);
	qcow2_map_exit(q);
	qcow2_io_close(ti, &q->io);
	qcow2_free(q);
}

static int qcow2_map(struct dm_target *ti, struct bio *bio)
{
	return qcow2_map_bio(ti->private, bio);
}

static int qcow2_end_io(struct dm_target *ti, struct bio *bio,
			blk_status_t *error)
{
	qcow2_bio_end(ti->private, bio);
	return DM_ENDIO_DONE;
}

/* A suspend waits for every bio: none may stay held by the test hook. */
static void qcow2_presuspend(struct dm_target *ti)
{
	qcow2_test_release(ti->private);
}

/*
 * Another table on the same image may have written it since this one was
 * loaded (a table reload): read the metadata again.
 */
static int qcow2_preresume(struct dm_target *ti)
{
	return qcow2_reload_image(ti->private);
}

/* Suspended: every bio has completed; make the image consistent on disk. */
static void qcow2_postsuspend(struct dm_target *ti)
{
	struct qcow2 *q = ti->private;

	if (qcow2_deactivate(q))
		DMERR("%s: metadata could not be written back on suspend",
		      dm_table_device_name(ti->table));
}

/*
 * Status (INFO):
 *   <mode> <virtual_sectors> <cluster_bytes> <cache_bytes>/<cache_max_bytes>
 *   <cache_hits> <cache_misses> <cache_evictions> <health>
 *   <allocated_clusters> <dirty_slices>
 */
static void qcow2_status(struct dm_target *ti, status_type_t type,
			 unsigned int status_flags, char *result,
			 unsigned int maxlen)
{
	struct qcow2 *q = ti->private;
	struct qcow2_cache_stats st;
	unsigned int sz = 0;

	switch (type) {
	case STATUSTYPE_INFO:
		qcow2_cache_get_stats(&q->cache, &st);
		DMEMIT("%s %llu %u %llu/%llu %llu %llu %llu %s ",
		       mode_name(READ_ONCE(q->mode)),
		       q->hdr.size >> SECTOR_SHIFT, q->hdr.cluster_size,
		       (u64)st.slices * st.slice_size,
		       (u64)st.max_slices * st.slice_size,
		       st.hits, st.misses, st.evictions,
		       test_bit(QCOW2_F_CORRUPT, &q->flags) ? "corrupt" : "ok");
		/*
		 * Read-only tables do not read the refcounts; a large or
		 * hostile image may not have had all of them read at load
		 */
		if (q->writable && !READ_ONCE(q->refcounts_partial))
			DMEMIT("%lld %lu", (s64)atomic64_read(&q->allocated),
			       st.dirty);
		else
			DMEMIT("- %lu", st.dirty);
		break;
	case STATUSTYPE_TABLE:
		DMEMIT("%s", q->table_args);
		break;
	case STATUSTYPE_IMA:
		DMEMIT_TARGET_NAME_VERSION(ti->type);
		DMEMIT(",cluster_size=%u;", q->hdr.cluster_size);
		break;
	}
}

/*
 * The "stats" message: bad metadata met since activation (each failed an
 * I/O; the status line's health says whether there was any). What the
 * write path did with each bio is in the trace events
 * (dm-qcow2-trace.h).
 */
static void qcow2_stats(struct qcow2 *q, char *result, unsigned int maxlen)
{
	unsigned int sz = 0;

	DMEMIT("corruptions %lld", (s64)atomic64_read(&q->corruptions));
}

/*
 * Messages:
 *   flush              write back all dirty metadata and flush the image
 *   cache_size <bytes> change the metadata cache bound (until the next
 *                      table load, which applies the table's value)
 *   stats              counters since activation, as "name value" pairs
 */
static int qcow2_message(struct dm_target *ti, unsigned int argc,
			 char **argv, char *result, unsigned int maxlen)
{
	struct qcow2 *q = ti->private, *layer;
	u64 bytes;

	if (argc == 1 && !strcasecmp(argv[0], "flush"))
		return q->writable ? qcow2_sync(q) : 0;
	if (argc == 1 && !strcasecmp(argv[0], "stats")) {
		qcow2_stats(q, result, maxlen);
		return 1;	/* the result is the answer */
	}
	if (argc && !strncasecmp(argv[0], "test_", 5) && READ_ONCE(test_hooks))
		return qcow2_test_message(q, argc, argv);
	if (argc == 2 && !strcasecmp(argv[0], "cache_size")) {
		if (cache_size_arg(argv[1], &bytes)) {
			DMERR("%s: invalid cache_size %s (bytes, 1 to 4G)",
			      qcow2_name(q), argv[1]);
			return -EINVAL;
		}
		/* Every qcow2 layer has a cache of this size, as at table load */
		for (layer = q; layer; layer = layer->backing) {
			if (layer->raw)
				continue;
			layer->cache_bytes = bytes;
			qcow2_cache_resize(&layer->cache, bytes);
		}
		return 0;
	}
	DMERR("%s: unrecognised message%s%s", qcow2_name(q), argc ? " " : "",
	      argc ? argv[0] : "");
	return -EINVAL;
}

static int qcow2_iterate_devices(struct dm_target *ti,
				 iterate_devices_callout_fn fn, void *data)
{
	struct qcow2 *q = ti->private;

	/* The file backend has no device below it to stack limits from */
	if (!q->io.dev)
		return 0;
	return fn(ti, q->io.dev, 0, q->io.size >> SECTOR_SHIFT, data);
}

static void qcow2_io_hints(struct dm_target *ti, struct queue_limits *limits)
{
	struct qcow2 *q = ti->private;

	/* Direct I/O to the file must be aligned to its block size */
	if (q->io.file && q->io.dio) {
		limits->logical_block_size = max(limits->logical_block_size,
						 q->io.lbs);
		limits->physical_block_size = max(limits->physical_block_size,
						  q->io.lbs);
	}
	limits->io_opt = q->hdr.cluster_size;
	qcow2_no_wzeroes_unmap(limits);
	if (q->writable) {
		/* Only whole clusters are dropped; keep each bio bounded */
		limits->discard_granularity = q->hdr.cluster_size;
		/*
		 * Since 6.10 the block layer derives max_discard_sectors from
		 * max_hw_discard_sectors (and the user's bound) when the
		 * limits are applied: the hardware value is what counts, and
		 * nothing below a file image sets it. Before, it was copied.
		 */
		limits->max_hw_discard_sectors =
			min_t(u64, UINT_MAX >> SECTOR_SHIFT,
			      (u64)q->hdr.cluster_size << (10 - SECTOR_SHIFT));
		limits->max_discard_sectors = limits->max_hw_discard_sectors;
		limits->max_write_zeroes_sectors =
			limits->max_hw_discard_sectors;
	}
}

static struct target_type qcow2_target = {
	.name = "qcow2",
	.version = {DM_QCOW2_V_MAJOR, DM_QCOW2_V_MINOR, DM_QCOW2_V_PATCH},
	.module = THIS_MODULE,
	.ctr = qcow2_ctr,
	.dtr = qcow2_dtr,
	.map = qcow2_map,
	.end_io = qcow2_end_io,
	.presuspend = qcow2_presuspend,
	.postsuspend = qcow2_postsuspend,
	.preresume = qcow2_preresume,
	.status = qcow2_status,
	.message = qcow2_message,
	.iterate_devices = qcow2_iterate_devices,
	.io_hints = qcow2_io_hints,
};

static int __init dm_qcow2_init(void)
{
	int r = qcow2_mem_init();

	if (r)
		return r;
	r = dm_register_target(&qcow2_target);
	if (r < 0) {
		DMERR("register failed %d", r);
		qcow2_mem_exit();
	}
	return r;
}

static void __exit dm_qcow2_exit(void)
{
	dm_unregister_target(&qcow2_target);
	qcow2_mem_exit();
}

module_init(dm_qcow2_init);
module_exit(dm_qcow2_exit);

MODULE_DESCRIPTION(DM_NAME " target serving qcow2 images");
MODULE_LICENSE("GPL");
MODULE_VERSION(DM_QCOW2_VERSION);
