// SPDX-License-Identifier: GPL-2.0-only
/*
 * dm-qcow2: opening an image, and mapping guest offsets to the image.
 *
 * A bio never crosses a cluster boundary (the target's max_io_len is the
 * cluster size), so each bio needs exactly one L1 and one L2 entry. The L1
 * table is held in memory; L2 entries come from the slice cache. When the
 * slice is cached, ->map() resolves the bio on the spot: a block device
 * bio is remapped, a file bio is handed to the I/O workqueue, a zero or
 * unallocated cluster is completed with zeros. On a cache miss the bio
 * goes to the metadata workqueue, which loads the slice and does the same.
 * Each bio carries its own work item, so misses on different slices load
 * concurrently.
 *
 * Every entry is decoded by dm-qcow2-format and every host offset is
 * checked against the image size and the metadata we know of before any
 * I/O is issued through it.
 */
#include <linux/bio.h>
#include <linux/slab.h>

#include "dm-qcow2.h"

#define QCOW2_MAX_SLICE_SIZE	4096U
#define QCOW2_DEFAULT_CACHE	(4ULL << 20)

/* ---- Corruption ---- */

static void qcow2_event_work(struct work_struct *work)
{
	struct qcow2 *q = container_of(work, struct qcow2, event_work);

	dm_table_event(q->ti->table);
}

/*
 * Bad metadata met at run time: fail the I/O, say what was wrong, and raise
 * one dm event so that monitoring notices. Reads that do not meet the bad
 * entry carry on.
 */
static int qcow2_corrupt(struct qcow2 *q, u64 voff, const char *what)
{
	atomic64_inc(&q->corruptions);
	DMERR_LIMIT("%s: corrupt image: %s (guest offset %llu)",
		    dm_table_device_name(q->ti->table), what, voff);
	if (!test_and_set_bit(QCOW2_F_CORRUPT, &q->flags))
		schedule_work(&q->event_work);
	return -EUCLEAN;
}

/* ---- Host offset checks ---- */

static bool ranges_overlap(u64 a, u64 alen, u64 b, u64 blen)
{
	return a < b + blen && b < a + alen;
}

/*
 * Where a cluster at @off may not be: in the header, past the end of the
 * image, or over the L1 or refcount table. Returns NULL when it is fine.
 */
static const char *host_cluster_check(struct qcow2 *q, u64 off)
{
	const struct qcow2_header *h = &q->hdr;
	u64 len = h->cluster_size;

	if (off < len)
		return "overlaps the header";
	if (off >= QCOW2_MAX_HOST_OFFSET)
		return "offset beyond 2^56";
	if (off > q->io.size || len > q->io.size - off)
		return "offset past the end of the image";
	if (ranges_overlap(off, len, h->l1_table_offset,
			   (u64)h->l1_size * sizeof(u64)))
		return "overlaps the L1 table";
	if (ranges_overlap(off, len, h->refcount_table_offset,
			   (u64)h->refcount_table_clusters << h->cluster_bits))
		return "overlaps the refcount table";
	return NULL;
}

/* ---- Lookup ---- */

static int l2_offset_lookup(struct qcow2 *q, u64 voff, u64 *l2_off)
{
	const char *err;
	u64 idx = qcow2_l1_index(&q->hdr, voff);
	int r;

	if (idx >= q->l1_entries)
		return qcow2_corrupt(q, voff, "guest offset beyond the L1 table");
	r = qcow2_l1_decode(&q->hdr, q->l1[idx], l2_off, &err);
	if (r)
		return qcow2_corrupt(q, voff, err);
	if (!*l2_off)
		return 0;
	err = host_cluster_check(q, *l2_off);
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
		      struct qcow2_l2_map *m)
{
	const struct qcow2_header *h = &q->hdr;
	unsigned int slice = q->cache.slice_size;
	__be64 ent[2] = { 0, 0 };
	const char *err;
	u64 l2_off, byte;
	int r;

	r = l2_offset_lookup(q, voff, &l2_off);
	if (r)
		return r;
	if (!l2_off) {
		memset(m, 0, sizeof(*m));
		m->type = QCOW2_CLUSTER_UNALLOCATED;
		return 0;
	}

	byte = (u64)qcow2_l2_index(h, voff) * h->l2_entry_size;
	r = qcow2_cache_read(&q->cache, l2_off + round_down(byte, slice),
			     byte & (slice - 1), ent, h->l2_entry_size,
			     can_block);
	if (r == -EAGAIN)
		return r;
	if (r) {
		DMERR_LIMIT("%s: cannot read L2 table at %llu: %d",
			    dm_table_device_name(q->ti->table), l2_off, r);
		return r;
	}

	r = qcow2_l2_decode(h, be64_to_cpu(ent[0]), be64_to_cpu(ent[1]), m,
			    &err);
	if (r)
		return qcow2_corrupt(q, voff, err);
	if (m->type == QCOW2_CLUSTER_NORMAL) {
		err = host_cluster_check(q, m->host_offset);
		if (err)
			return qcow2_corrupt(q, voff, err);
	}
	return 0;
}

/* ---- Dispatch ---- */

static void file_io_work(struct work_struct *work)
{
	struct qcow2_bio *pb = container_of(work, struct qcow2_bio, work);
	struct bio *bio = dm_bio_from_per_bio_data(pb, sizeof(*pb));

	qcow2_io_file_submit(&pb->q->io, bio, pb->pos);
}

static int map_data(struct qcow2 *q, struct bio *bio, u64 pos,
		    bool in_worker)
{
	struct qcow2_bio *pb = dm_per_bio_data(bio, sizeof(*pb));

	if (q->io.dev) {
		qcow2_io_bdev_remap(&q->io, bio, pos);
		if (!in_worker)
			return DM_MAPIO_REMAPPED;
		dm_submit_bio_remap(bio, NULL);
		return DM_MAPIO_SUBMITTED;
	}
	if (in_worker) {
		qcow2_io_file_submit(&q->io, bio, pos);
		return DM_MAPIO_SUBMITTED;
	}
	/* Not from ->map(): see qcow2_io_file_submit() */
	pb->pos = pos;
	INIT_WORK(&pb->work, file_io_work);
	queue_work(q->io_wq, &pb->work);
	return DM_MAPIO_SUBMITTED;
}

static int map_complete(struct bio *bio, blk_status_t status)
{
	bio->bi_status = status;
	bio_endio(bio);
	return DM_MAPIO_SUBMITTED;
}

static int map_resolved(struct qcow2 *q, struct bio *bio,
			struct qcow2_l2_map *m, bool in_worker)
{
	u64 voff = (u64)bio->bi_iter.bi_sector << SECTOR_SHIFT;

	switch (m->type) {
	case QCOW2_CLUSTER_UNALLOCATED:
	case QCOW2_CLUSTER_ZERO_PLAIN:
	case QCOW2_CLUSTER_ZERO_ALLOC:
		zero_fill_bio(bio);
		return map_complete(bio, BLK_STS_OK);
	case QCOW2_CLUSTER_NORMAL:
		return map_data(q, bio, m->host_offset +
				qcow2_cluster_offset(&q->hdr, voff), in_worker);
	case QCOW2_CLUSTER_COMPRESSED:
		DMERR_LIMIT("%s: compressed clusters are not supported yet (guest offset %llu)",
			    dm_table_device_name(q->ti->table), voff);
		return map_complete(bio, BLK_STS_NOTSUPP);
	}
	return map_complete(bio, BLK_STS_IOERR);
}

static void map_work(struct work_struct *work)
{
	struct qcow2_bio *pb = container_of(work, struct qcow2_bio, work);
	struct bio *bio = dm_bio_from_per_bio_data(pb, sizeof(*pb));
	struct qcow2_l2_map m;
	int r;

	r = map_lookup(pb->q, (u64)bio->bi_iter.bi_sector << SECTOR_SHIFT,
		       true, &m);
	if (r)
		map_complete(bio, errno_to_blk_status(r == -EUCLEAN ? -EIO : r));
	else
		map_resolved(pb->q, bio, &m, true);
}

int qcow2_map_bio(struct qcow2 *q, struct bio *bio)
{
	struct qcow2_bio *pb = dm_per_bio_data(bio, sizeof(*pb));
	struct qcow2_l2_map m;
	int r;

	pb->q = q;
	/* Read-only for now: nothing of ours can be dirty */
	if (bio->bi_opf & REQ_PREFLUSH && !bio_sectors(bio))
		return map_complete(bio, BLK_STS_OK);
	if (bio_op(bio) != REQ_OP_READ)
		return DM_MAPIO_KILL;

	r = map_lookup(q, (u64)bio->bi_iter.bi_sector << SECTOR_SHIFT,
		       false, &m);
	if (r == -EAGAIN) {
		INIT_WORK(&pb->work, map_work);
		queue_work(q->meta_wq, &pb->work);
		return DM_MAPIO_SUBMITTED;
	}
	if (r)
		return DM_MAPIO_KILL;
	return map_resolved(q, bio, &m, false);
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
	kvfree(buf);
	return r;
}

/* Features that are valid qcow2 but that this target cannot serve yet. */
static int check_supported(struct qcow2 *q, const char **err)
{
	const struct qcow2_header *h = &q->hdr;

	if (h->crypt_method)
		*err = "Encrypted images are not supported";
	else if (h->incompatible_features & QCOW2_INCOMPAT_DATA_FILE)
		*err = "Images with an external data file are not supported";
	else if (h->backing_file_offset && h->backing_file_size)
		*err = "Images with a backing file are not supported yet";
	else if (h->extended_l2)
		*err = "Extended L2 entries (subclusters) are not supported yet";
	else if (h->compression_type != QCOW2_COMPRESSION_DEFLATE)
		*err = "The zstd compression type is not supported yet";
	else if (q->io.dev && h->cluster_size < q->io.lbs)
		*err = "Cluster size smaller than the device's logical block size";
	else
		return 0;
	return -EOPNOTSUPP;
}

static int load_l1(struct qcow2 *q)
{
	const struct qcow2_header *h = &q->hdr;
	u64 span = qcow2_l2_coverage(h);
	u32 i;
	int r;

	/* Only the entries that map the virtual size are ever used */
	q->l1_entries = div64_u64(h->size, span) + !!(h->size % span);
	if (!q->l1_entries)
		return 0;
	q->l1 = kvmalloc_array(q->l1_entries, sizeof(u64), GFP_KERNEL);
	if (!q->l1)
		return -ENOMEM;
	r = qcow2_io_read_meta(&q->io, q->l1, q->l1_entries * sizeof(u64),
			       h->l1_table_offset);
	if (r)
		return r;
	for (i = 0; i < q->l1_entries; i++)
		q->l1[i] = be64_to_cpu((__force __be64)q->l1[i]);
	return 0;
}

static int alloc_workqueues(struct qcow2 *q)
{
	q->meta_wq = alloc_workqueue("kqcow2m", WQ_MEM_RECLAIM | WQ_UNBOUND,
				     0);
	if (!q->meta_wq)
		return -ENOMEM;
	if (!q->io.file)
		return 0;
	q->io_wq = alloc_workqueue("kqcow2io", WQ_MEM_RECLAIM | WQ_HIGHPRI, 0);
	return q->io_wq ? 0 : -ENOMEM;
}

/*
 * Read and validate everything needed to serve the image. On failure
 * *err says why, for ti->error; the caller unwinds with
 * qcow2_close_image().
 */
int qcow2_open_image(struct qcow2 *q, const char **err)
{
	unsigned int slice;
	int r;

	INIT_WORK(&q->event_work, qcow2_event_work);
	r = read_header(q, err);
	if (r) {
		if (r != -EINVAL)
			*err = "Cannot read the image header";
		return r;
	}
	r = check_supported(q, err);
	if (r)
		return r;
	if (q->hdr.incompatible_features & QCOW2_INCOMPAT_CORRUPT)
		DMWARN("%s: image is marked corrupt; serving it read-only",
		       dm_table_device_name(q->ti->table));

	/* Direct I/O below the cluster granularity cannot be aligned */
	if (q->io.file && q->hdr.cluster_size < q->io.lbs)
		q->io.dio = false;

	r = load_l1(q);
	if (r) {
		*err = "Cannot read the L1 table";
		return r;
	}

	if (!q->cache_bytes)
		q->cache_bytes = QCOW2_DEFAULT_CACHE;
	/* Block device reads must be whole logical blocks (<= cluster size) */
	slice = min(q->hdr.cluster_size, QCOW2_MAX_SLICE_SIZE);
	if (q->io.dev)
		slice = max(slice, q->io.lbs);
	r = qcow2_cache_init(&q->cache, &q->io, slice, q->cache_bytes);
	if (!r)
		r = alloc_workqueues(q);
	if (r)
		*err = "Cannot allocate memory";
	return r;
}

void qcow2_close_image(struct qcow2 *q)
{
	if (q->io_wq)
		destroy_workqueue(q->io_wq);
	if (q->meta_wq)
		destroy_workqueue(q->meta_wq);
	flush_work(&q->event_work);
	if (q->cache.hash)
		qcow2_cache_exit(&q->cache);
	kvfree(q->l1);
	q->l1 = NULL;
}
