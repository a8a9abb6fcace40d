// SPDX-License-Identifier: GPL-2.0-only
/*
 * dm-qcow2: compressed clusters (deflate and zstd).
 *
 * QEMU writes a compressed cluster as one raw deflate stream or one zstd
 * frame, starting at any byte of the image and rounded up to whole
 * 512-byte sectors; the L2 entry gives the start and an upper bound of the
 * length. We read that range (aligned to the device's logical block),
 * decompress it into a cluster buffer and copy out what the bio asked for.
 * The last cluster decompressed stays in the buffer, so that reading a
 * compressed cluster in small pieces decompresses it once.
 *
 * All of it runs in the metadata workers, one at a time (zip->lock): the
 * buffers and the decompressor's state are per image and made with the
 * table (qcow2_zip_setup()), so that a write into a compressed cluster
 * needs no allocation while memory is short: three clusters (two of
 * compressed input, one of output) and the decompressor's workspace
 * (deflate's, or the zstd state for a cluster-sized window), for each
 * qcow2 image of the chain.
 */
#include <linux/bio.h>
#include <linux/sched/mm.h>
#include <linux/slab.h>
#include <linux/vmalloc.h>
#include <linux/zlib.h>
#include <linux/zstd.h>

#include "dm-qcow2.h"

/* Bytes of compressed data a descriptor may cover: 2^(cluster_bits-8) sectors. */
static size_t zip_in_max(struct qcow2 *q)
{
	return ((size_t)512 << (q->hdr.cluster_bits - 8)) + 2 * q->io.lbs;
}

void qcow2_zip_init(struct qcow2_zip *zip)
{
	memset(zip, 0, sizeof(*zip));
	mutex_init(&zip->lock);
}

void qcow2_zip_exit(struct qcow2_zip *zip)
{
	kvfree(zip->ws);
	kvfree(zip->in);
	kvfree(zip->out);
	zip->ws = NULL;
	zip->in = NULL;
	zip->out = NULL;
	zip->out_key = 0;
}

/* The image may have changed under a suspended device. */
void qcow2_zip_invalidate(struct qcow2_zip *zip)
{
	mutex_lock(&zip->lock);
	zip->out_key = 0;
	mutex_unlock(&zip->lock);
}

/*
 * Host bytes [@off, @off + @len) were freed: the cluster decompressed
 * last may not be served from memory if its data lay there.
 */
void qcow2_zip_forget(struct qcow2_zip *zip, u64 off, u64 len)
{
	if (!READ_ONCE(zip->out_key))
		return;
	mutex_lock(&zip->lock);
	if (zip->out_key > off && zip->out_key - 1 < off + len)
		zip->out_key = 0;
	mutex_unlock(&zip->lock);
}

/*
 * The buffers and the decompressor's state, made with the table (the
 * image's cluster size and compression type are known by then).
 */
int qcow2_zip_setup(struct qcow2 *q)
{
	struct qcow2_zip *zip = &q->zip;
	size_t ws_size;

	if (zip->ws)
		return 0;
	ws_size = zlib_inflate_workspacesize();
	if (q->hdr.compression_type == QCOW2_COMPRESSION_ZSTD)
		ws_size = zstd_dstream_workspace_bound(q->hdr.cluster_size);
	zip->in = kvmalloc(zip_in_max(q), GFP_KERNEL);
	zip->out = kvmalloc(q->hdr.cluster_size, GFP_KERNEL);
	zip->ws = kvmalloc(ws_size, GFP_KERNEL);
	if (zip->in && zip->out && zip->ws) {
		zip->ws_size = ws_size;
		return 0;
	}
	qcow2_zip_exit(zip);
	return -ENOMEM;
}

/*
 * One raw deflate stream (no zlib header), which must end (it may end
 * before the input does: the length is rounded up to sectors) with the
 * cluster whole.
 */
static int zip_inflate(struct qcow2_zip *zip, size_t in_len, u32 out_len)
{
	struct z_stream_s strm = {
		.workspace = zip->ws,
		.next_in = zip->in + zip->in_off,
		.avail_in = in_len,
		.next_out = zip->out,
		.avail_out = out_len,
	};
	int r;

	if (zlib_inflateInit2(&strm, -MAX_WBITS) != Z_OK)
		return -EIO;
	r = zlib_inflate(&strm, Z_FINISH);
	zlib_inflateEnd(&strm);
	return r == Z_STREAM_END && !strm.avail_out ? 0 : -EIO;
}

/* One zstd frame, window at most a cluster (QEMU's frames are smaller). */
static int zip_unzstd(struct qcow2 *q, size_t in_len, u32 out_len)
{
	struct qcow2_zip *zip = &q->zip;
	zstd_in_buffer in = { zip->in + zip->in_off, in_len, 0 };
	zstd_out_buffer out = { zip->out, out_len, 0 };
	zstd_dstream *ds;
	size_t r;

	ds = zstd_init_dstream(q->hdr.cluster_size, zip->ws, zip->ws_size);
	if (!ds)
		return -EIO;
	while (out.pos < out.size) {
		r = zstd_decompress_stream(ds, &out, &in);
		if (zstd_is_error(r))
			return -EIO;
		/* A finished frame, or no progress possible: stop */
		if (!r || in.pos == in.size)
			break;
	}
	return out.pos == out.size ? 0 : -EIO;
}

/*
 * Read the compressed bytes of @m: the range is clamped to the end of the
 * image (QEMU's last compressed cluster may end there) and widened to the
 * logical block for direct block device reads. -EUCLEAN when it starts
 * past the end: the caller reports the corruption.
 */
static int zip_read(struct qcow2 *q, const struct qcow2_l2_map *m,
		    size_t *len)
{
	struct qcow2_zip *zip = &q->zip;
	u64 size = READ_ONCE(q->io.size), start, end;
	unsigned int lbs = q->io.lbs;

	if (m->host_offset >= size)
		return -EUCLEAN;
	end = min(m->host_offset + m->comp_len, size);
	*len = end - m->host_offset;
	start = round_down(m->host_offset, lbs);
	end = min(round_up(end, lbs), size);
	zip->in_off = m->host_offset - start;
	return qcow2_io_read_meta(&q->io, zip->in, end - start, start);
}

/* Make zip->out hold the cluster of @m. */
static int zip_load(struct qcow2 *q, const struct qcow2_l2_map *m, u64 voff)
{
	struct qcow2_zip *zip = &q->zip;
	size_t len;
	int r;

	lockdep_assert_held(&zip->lock);
	if (zip->out_key == m->host_offset + 1)
		return 0;
	if (WARN_ON_ONCE(!zip->ws))
		return -ENOMEM;
	zip->out_key = 0;
	r = zip_read(q, m, &len);
	if (r)
		return r;
	if (q->hdr.compression_type == QCOW2_COMPRESSION_ZSTD)
		r = zip_unzstd(q, len, q->hdr.cluster_size);
	else
		r = zip_inflate(zip, len, q->hdr.cluster_size);
	if (r) {
		DMERR_LIMIT("%s: corrupt compressed data at %llu (guest offset %llu)",
			    qcow2_name(q), m->host_offset,
			    voff);
		return r;
	}
	/* +1: offset 0 is never a compressed cluster, but keep 0 = none */
	zip->out_key = m->host_offset + 1;
	return 0;
}

/* Fill @bio (within one cluster) from the compressed cluster @m. */
int qcow2_zip_read_bio(struct qcow2 *q, const struct qcow2_l2_map *m,
		       struct bio *bio)
{
	struct qcow2_zip *zip = &q->zip;
	u64 voff = (u64)bio->bi_iter.bi_sector << SECTOR_SHIFT;
	int r;

	mutex_lock(&zip->lock);
	r = zip_load(q, m, voff);
	if (!r)
		qcow2_bio_copy_from_buf(bio, zip->out +
					qcow2_cluster_offset(&q->hdr, voff));
	mutex_unlock(&zip->lock);
	return r;
}

/* @len bytes from guest offset @voff (inside the cluster @m) to @dst. */
int qcow2_zip_read_buf(struct qcow2 *q, const struct qcow2_l2_map *m,
		       u64 voff, void *dst, u32 len)
{
	struct qcow2_zip *zip = &q->zip;
	int r;

	mutex_lock(&zip->lock);
	r = zip_load(q, m, voff);
	if (!r)
		memcpy(dst, zip->out + qcow2_cluster_offset(&q->hdr, voff),
		       len);
	mutex_unlock(&zip->lock);
	return r;
}
