// SPDX-License-Identifier: GPL-2.0-only
/*
 * dm-qcow2: internal snapshots and online grow.
 *
 * This file owns: finding the snapshot a read-only table serves (by id or
 * name, bounded walk of the snapshot table) and switching the image's view
 * to its L1 table and size; and growing the virtual size at resume, in
 * place when the L1 table's clusters have room, else by moving the table,
 * with the header switched by one sector write.
 */
#include <linux/slab.h>
#include <linux/vmalloc.h>

#include "dm-qcow2-meta.h"

/* ---- Internal snapshots ---- */

enum snapshot_match {
	SNAP_NONE,
	SNAP_NAME,
	SNAP_ID,
};

/* Does the entry at @b (parsed as @s) have @want as its id or its name? */
static enum snapshot_match snapshot_match(const u8 *b,
					  const struct qcow2_snapshot *s,
					  const char *want)
{
	size_t n = strlen(want);

	if (s->id_len == n && !memcmp(b + s->id_off, want, n))
		return SNAP_ID;
	if (s->name_len == n && !memcmp(b + s->name_off, want, n))
		return SNAP_NAME;
	return SNAP_NONE;
}

/*
 * Read the entry at @off into a new buffer, parse it into @s; *@len gets
 * its length with padding, the step to the next entry. The padding of
 * the table's last entry may lie past the end of the image: what is there
 * is read.
 */
static int read_snapshot(struct qcow2 *q, u64 off, u8 **buf, u32 *len,
			 struct qcow2_snapshot *s, const char **err)
{
	u8 fixed[QCOW2_SNAPSHOT_HEADER_LEN];
	u64 size = READ_ONCE(q->io.size);
	u32 avail;
	int r;

	*buf = NULL;
	r = qcow2_io_read_meta(&q->io, fixed, sizeof(fixed), off);
	if (!r)
		r = qcow2_snapshot_entry_len(fixed, len, err);
	if (r)
		return r;
	*buf = kzalloc(*len, GFP_KERNEL);
	if (!*buf)
		return -ENOMEM;
	avail = off < size ? min_t(u64, *len, size - off) : 0;
	r = qcow2_io_read_meta(&q->io, *buf, avail, off);
	if (!r)
		r = qcow2_snapshot_parse(&q->hdr, *buf, avail, s, err);
	return r;
}

/*
 * Serve the snapshot the table names (read-only tables only): the entry
 * with that id, else the first with that name, as QEMU looks a snapshot
 * up; then use its L1 table and virtual size. The walk is bounded by the
 * header's snapshot count and by QCOW2_MAX_SNAPSHOT_TABLE bytes.
 */
int qcow2_load_snapshot(struct qcow2 *q, const char **err)
{
	struct qcow2_header *h = &q->hdr;
	u64 off = h->snapshots_offset, span;
	enum snapshot_match m, best = SNAP_NONE;
	struct qcow2_snapshot s, found;
	u32 i, len;
	u8 *buf;
	int r = 0;

	for (i = 0; i < h->nb_snapshots && best != SNAP_ID && !r; i++) {
		if (off - h->snapshots_offset > QCOW2_MAX_SNAPSHOT_TABLE) {
			*err = "Snapshot table too large (max 64 MiB)";
			return -EINVAL;
		}
		r = read_snapshot(q, off, &buf, &len, &s, err);
		if (r == -EIO)
			*err = "Cannot read the snapshot table";
		m = r ? SNAP_NONE : snapshot_match(buf, &s, q->snapshot);
		if (m > best) {
			best = m;
			found = s;
		}
		kfree(buf);
		off += len;
	}
	if (r)
		return r;
	if (best == SNAP_NONE) {
		*err = "No snapshot with that id or name";
		return -ENOENT;
	}
	s = found;
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
		r = qcow2_alloc_locked(q, &host);
		if (r)
			break;
		if (got && host != *start + ((u64)got << bits)) {
			if (nr_spare == QCOW2_MAX_RESTARTS) {
				qcow2_refcount_update_locked(q, host, -1);
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
			qcow2_refcount_update_locked(q, spare[i][0] +
					       ((u64)got << bits), -1);
	q->free_cursor = min(q->free_cursor, cursor);
	return r;
}

/*
 * Grow to @size with an L1 table of @need entries in new clusters: the
 * table (old entries, the rest zeros) and its refcounts are written and
 * flushed, then the header takes the new size, L1 offset and L1 size in
 * one sector write, then the old table's clusters are freed. A crash
 * before the header write leaves the old image and a leak. The device is
 * suspended: no bio reads q->l1 meanwhile.
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

	lockdep_assert_held(&q->alloc_lock);
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
		r = qcow2_writeback(q, &frees, U64_MAX);
	qcow2_apply_frees(q, &frees);
	if (r)
		goto undo;
	h->size = size;
	h->l1_table_offset = start;
	h->l1_size = need;
	r = qcow2_write_header(q);
	if (r) {
		*h = saved;
		goto undo;
	}
	for (i = 0; old_off && i < old_n; i++)
		qcow2_refcount_update_locked(q, old_off +
					     ((u64)i << h->cluster_bits), -1);
	return 0;
undo:
	for (i = 0; i < n; i++)
		qcow2_refcount_update_locked(q, start +
					     ((u64)i << h->cluster_bits), -1);
	return r;
}

/*
 * Grow the virtual size at resume, the device suspended. Within the L1
 * table's clusters, new L1 entries are written as zeros first (the rest
 * of the cluster may hold anything) and flushed; then the header takes
 * the new size and L1 size in one sector write. A crash in between
 * leaves the old size. A larger table moves (grow_l1_moved()).
 */
int qcow2_grow(struct qcow2 *q, u64 size)
{
	struct qcow2_header *h = &q->hdr;
	u32 per_block = q->meta_block / sizeof(u64);
	u32 need, old = h->l1_size, i;
	u64 room = round_up((u64)old * sizeof(u64), h->cluster_size);
	u64 old_size = h->size, *l1;
	const char *err;
	int r;

	lockdep_assert_held(&q->alloc_lock);
	r = qcow2_grow_check(q, size, &err);
	if (r)
		return r;
	need = l1_needed(h, size);	/* fits: checked */
	l1 = qcow2_load_table(q, h->l1_table_offset, old,
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
		r = qcow2_write_table_block(q, l1, i, l1[i], h->l1_table_offset);
	if (!r)
		r = qcow2_io_flush(&q->io);
	if (r)
		goto out;
	h->size = size;
	h->l1_size = max(need, old);
	r = qcow2_write_header(q);
	if (r) {
		h->size = old_size;
		h->l1_size = old;
		goto out;
	}
done:
	swap(q->l1, l1);
	q->l1_entries = need;
	q->l1_loaded = h->l1_size;
	DMINFO("%s: virtual size grown to %llu bytes", qcow2_name(q), size);
out:
	kvfree(l1);
	return r;
}
