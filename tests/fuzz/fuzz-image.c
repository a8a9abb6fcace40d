// SPDX-License-Identifier: GPL-2.0-only
/*
 * libFuzzer harness for the dm-qcow2 format code (dm-qcow2-format.c).
 *
 * The input is an image, or the start of one: the harness does what the
 * target's open path does with the format code before any data I/O
 * (probe, parse, layout check against the input's length as the image
 * size), then decodes every L1 entry, every L2 entry of every L2 table
 * that lies inside the input, every refcount table entry, and every
 * refcount of every refcount block inside the input, for the image's own
 * refcount width and for all the others. Each decoded value is checked
 * against what the format code promises, so a wrong answer aborts like a
 * memory error does.
 *
 * Buffers handed to the format code are exactly as long as the bytes
 * they hold, so that AddressSanitizer sees any overread.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "dm-qcow2-format.h"

#define CHECK(cond)							\
	do {								\
		if (!(cond)) {						\
			fprintf(stderr, "%s:%d: check failed: %s\n",	\
				__FILE__, __LINE__, #cond);		\
			abort();					\
		}							\
	} while (0)

/* A refused header or entry must say why. */
static void check_err(int r, const char *err, int expect)
{
	CHECK(r == expect);
	CHECK(err && err[0]);
}

/* The rules qcow2_header_parse() promises for an accepted header. */
static void check_header(const struct qcow2_header *h, size_t len)
{
	u64 span;

	CHECK(h->version == 2 || h->version == 3);
	CHECK(h->cluster_bits >= QCOW2_MIN_CLUSTER_BITS &&
	      h->cluster_bits <= QCOW2_MAX_CLUSTER_BITS);
	CHECK(h->cluster_size == 1U << h->cluster_bits);
	CHECK(h->refcount_order <= QCOW2_MAX_REFCOUNT_ORDER);
	CHECK(!(h->incompatible_features & ~QCOW2_INCOMPAT_KNOWN));
	CHECK(h->l2_entry_size == (h->extended_l2 ? 16U : 8U));
	CHECK(h->l2_bits + (h->extended_l2 ? 4 : 3) == h->cluster_bits);
	CHECK(!h->extended_l2 ||
	      h->cluster_bits >= QCOW2_MIN_EXT_L2_CLUSTER_BITS);
	CHECK(h->header_length <= h->cluster_size);
	CHECK(h->header_length <= len);
	CHECK(h->refcount_table_clusters > 0);
	CHECK(((u64)h->refcount_table_clusters << h->cluster_bits) <=
	      QCOW2_MAX_REFTABLE_BYTES);
	CHECK((u64)h->l1_size * 8 <= QCOW2_MAX_L1_BYTES);
	CHECK(h->nb_snapshots <= QCOW2_MAX_SNAPSHOTS);
	CHECK(!(h->refcount_table_offset & (h->cluster_size - 1)));
	CHECK(!(h->l1_table_offset & (h->cluster_size - 1)));
	CHECK(!(h->snapshots_offset & (h->cluster_size - 1)));
	CHECK(h->l1_table_offset < (u64)S64_MAX);
	CHECK(h->refcount_table_offset < (u64)S64_MAX);
	span = qcow2_l2_coverage(h);
	CHECK(span >= h->cluster_size);
	CHECK(h->size / span <= h->l1_size);
	if (h->backing_file_offset) {
		CHECK(h->backing_file_size <= QCOW2_MAX_BACKING_NAME);
		CHECK(h->backing_file_offset + h->backing_file_size <=
		      h->cluster_size);
	}
	if (h->extensions & QCOW2_HAS_BACKING_FORMAT) {
		CHECK(h->backing_format_len <= QCOW2_MAX_BACKING_FMT);
		CHECK((u64)h->backing_format_offset + h->backing_format_len <=
		      len);
	}
}

/* The target's own check of a host cluster (dm-qcow2-meta.c), restated. */
static bool cluster_inside(const struct qcow2_header *h, u64 off, u64 size)
{
	u64 len = h->cluster_size;

	return off >= len && off < QCOW2_MAX_HOST_OFFSET && off <= size &&
	       len <= size - off;
}

static void check_compressed(u32 bits, u64 entry)
{
	u64 off;
	u32 max_len;

	qcow2_compressed_decode(bits, entry, &off, &max_len);
	/* Bits 0 to x-1 of the entry, x = 62 - (cluster_bits - 8) */
	CHECK(off < 1ULL << (70 - bits));
	CHECK(max_len >= 1);
	/* At most 2^(bits-8) sectors, less the offset within the first */
	CHECK(max_len <= (1U << (bits + 1)));
}

static void decode_l2_entry(const struct qcow2_header *h, u64 e, u64 bm)
{
	struct qcow2_l2_map m;
	const char *err = NULL;
	int r;

	r = qcow2_l2_decode(h, e, bm, &m, &err);
	if (r) {
		check_err(r, err, -EUCLEAN);
		return;
	}
	switch (m.type) {
	case QCOW2_CLUSTER_UNALLOCATED:
	case QCOW2_CLUSTER_ZERO_PLAIN:
		CHECK(!m.host_offset);
		break;
	case QCOW2_CLUSTER_ZERO_ALLOC:
		CHECK(h->version >= 3 && !h->extended_l2);
		/* fall through */
	case QCOW2_CLUSTER_NORMAL:
		CHECK(m.host_offset);
		CHECK(!(m.host_offset & (h->cluster_size - 1)));
		CHECK(m.host_offset < QCOW2_MAX_HOST_OFFSET);
		break;
	case QCOW2_CLUSTER_COMPRESSED:
		CHECK(!m.copied);
		CHECK(m.host_offset && m.host_offset < QCOW2_MAX_HOST_OFFSET);
		CHECK(m.comp_len >= 1);
		check_compressed(h->cluster_bits, e);
		break;
	default:
		CHECK(0);
	}
	if (h->extended_l2)
		CHECK(!(m.sc_alloc & m.sc_zero));
	if (!m.host_offset)
		CHECK(!m.copied);
}

/* Every entry of the L2 table at @off, as map_lookup() would see it. */
static void decode_l2_table(const struct qcow2_header *h, const u8 *img,
			    u64 off)
{
	u32 n = 1U << h->l2_bits, i;
	const u8 *t = img + off;

	for (i = 0; i < n; i++) {
		const u8 *p = t + (u64)i * h->l2_entry_size;

		decode_l2_entry(h, qcow2_get_be64(p),
				h->extended_l2 ? qcow2_get_be64(p + 8) : 0);
	}
}

/* L1 entries mapping the virtual size, as load_l1() keeps them. */
static void decode_l1(const struct qcow2_header *h, const u8 *img, u64 size)
{
	u64 span = qcow2_l2_coverage(h), n, i, l2;
	const char *err;
	u32 tables = 0;
	int r;

	n = h->size / span + !!(h->size % span);
	CHECK(n <= h->l1_size);
	for (i = 0; i < n; i++) {
		err = NULL;
		r = qcow2_l1_decode(h, qcow2_get_be64(img + h->l1_table_offset +
						       i * 8), &l2, &err);
		if (r) {
			check_err(r, err, -EUCLEAN);
			continue;
		}
		CHECK(!(l2 & (h->cluster_size - 1)));
		CHECK(l2 < QCOW2_MAX_HOST_OFFSET);
		/* A few tables are enough; each is a full cluster to decode */
		if (l2 && cluster_inside(h, l2, size) && tables++ < 8)
			decode_l2_table(h, img, l2);
	}
}

/* Every refcount of @block for refcount width 2^@order; no overread. */
static void read_refblock(const u8 *block, u32 cluster_bits, u32 order,
			  u64 limit, u64 *sum)
{
	u64 n = (8ULL << cluster_bits) >> order, i, v, max;

	/* The last entries are the ones that could overrun the block */
	if (n > limit)
		block += ((n - limit) << order) / 8;
	if (n > limit)
		n = limit;

	max = qcow2_refcount_max(order);
	for (i = 0; i < n; i++) {
		v = qcow2_refcount_get(block, i, order);
		CHECK(v <= max);
		*sum += v;
	}
}

/*
 * Set and read back refcounts at a few indexes picked by the image bytes,
 * for every width, in a copy of the block: the value must come back
 * masked to the width and the neighbours must not change.
 */
static void refcount_roundtrip(const u8 *block, u32 cluster_bits,
			       const u8 *seed, size_t seed_len)
{
	size_t bytes = (size_t)1 << cluster_bits, k;
	u8 *copy = malloc(bytes);
	u32 order;

	CHECK(copy);
	for (order = 0; order <= QCOW2_MAX_REFCOUNT_ORDER; order++) {
		u64 n = (8ULL << cluster_bits) >> order;
		u64 max = qcow2_refcount_max(order);

		memcpy(copy, block, bytes);
		for (k = 0; k + 16 <= seed_len && k < 64; k += 16) {
			u64 idx = qcow2_get_be64(seed + k) % n;
			u64 val = qcow2_get_be64(seed + k + 8), before, after;

			before = idx ? qcow2_refcount_get(copy, idx - 1, order) : 0;
			after = idx + 1 < n ?
				qcow2_refcount_get(copy, idx + 1, order) : 0;
			qcow2_refcount_set(copy, idx, order, val);
			CHECK(qcow2_refcount_get(copy, idx, order) == (val & max));
			if (idx)
				CHECK(qcow2_refcount_get(copy, idx - 1, order) ==
				      before);
			if (idx + 1 < n)
				CHECK(qcow2_refcount_get(copy, idx + 1, order) ==
				      after);
		}
	}
	free(copy);
}

/* Refcount table entries, and the blocks they point to inside the input. */
static void decode_refcounts(const struct qcow2_header *h, const u8 *img,
			     u64 size)
{
	u64 n = ((u64)h->refcount_table_clusters << h->cluster_bits) / 8;
	u64 i, block, sum = 0;
	const char *err;
	u32 blocks = 0, order;
	int r;

	for (i = 0; i < n; i++) {
		err = NULL;
		r = qcow2_reftable_decode(h, qcow2_get_be64(img +
				h->refcount_table_offset + i * 8), &block, &err);
		if (r) {
			check_err(r, err, -EUCLEAN);
			continue;
		}
		CHECK(!(block & (h->cluster_size - 1)));
		CHECK(block < QCOW2_MAX_HOST_OFFSET);
		if (!block || !cluster_inside(h, block, size) || blocks++ >= 4)
			continue;
		/* The image's own width in full, the others in part */
		read_refblock(img + block, h->cluster_bits, h->refcount_order,
			      blocks == 1 ? ~0ULL : 4096, &sum);
		if (blocks == 1) {
			for (order = 0; order <= QCOW2_MAX_REFCOUNT_ORDER; order++)
				read_refblock(img + block, h->cluster_bits, order,
					      4096, &sum);
			refcount_roundtrip(img + block, h->cluster_bits,
					   img + h->l1_table_offset,
					   size - h->l1_table_offset);
		}
	}
}

/* Every 8-byte word of the input as an L2 entry of a few geometries. */
static void decode_words(const u8 *data, size_t len)
{
	struct qcow2_header h;
	size_t i;
	u32 bits;

	for (i = 0; i + 16 <= len && i < 4096; i += 8) {
		u64 e = qcow2_get_be64(data + i);

		bits = 9 + (data[i + 8] % 13);
		memset(&h, 0, sizeof(h));
		h.version = 2 + (data[i + 9] & 1);
		h.cluster_bits = bits;
		h.cluster_size = 1U << bits;
		h.extended_l2 = bits >= 14 && (data[i + 9] & 2);
		h.l2_entry_size = h.extended_l2 ? 16 : 8;
		h.l2_bits = bits - (h.extended_l2 ? 4 : 3);
		decode_l2_entry(&h, e, qcow2_get_be64(data + i + 8));
		check_compressed(bits, e);
	}
}

/*
 * Walk the snapshot table the way the target does (entry by entry, each
 * length from its fixed part), checking what the parser promises.
 */
static void decode_snapshots(const struct qcow2_header *h, const u8 *data,
			     size_t size)
{
	u64 off = h->snapshots_offset;
	struct qcow2_snapshot s;
	const char *err;
	u32 i, len;

	for (i = 0; i < h->nb_snapshots; i++) {
		if (off > size || size - off < QCOW2_SNAPSHOT_HEADER_LEN)
			return;
		err = NULL;
		if (qcow2_snapshot_entry_len(data + off, &len, &err)) {
			check_err(-EINVAL, err, -EINVAL);
			return;
		}
		CHECK(len >= QCOW2_SNAPSHOT_HEADER_LEN && !(len & 7));
		if (size - off < len)
			return;
		err = NULL;
		if (!qcow2_snapshot_parse(h, data + off, len, &s, &err)) {
			CHECK(s.name_off + s.name_len <= len);
			CHECK(s.id_off + s.id_len <= len);
			CHECK(!(s.l1_table_offset & (h->cluster_size - 1)));
		} else {
			check_err(-EINVAL, err, -EINVAL);
		}
		off += len;
	}
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct qcow2_header h;
	const char *err = NULL;
	u32 cluster_size;
	size_t len;
	u8 *probe, *first;
	int r;

	decode_words(data, size);

	/* The probe reads QCOW2_HEADER_PROBE_LEN bytes, or the whole image */
	len = size < QCOW2_HEADER_PROBE_LEN ? size : QCOW2_HEADER_PROBE_LEN;
	probe = malloc(len ? len : 1);
	CHECK(probe);
	memcpy(probe, data, len);
	r = qcow2_header_probe(probe, len, &cluster_size, &err);
	free(probe);
	if (r) {
		check_err(r, err, -EINVAL);
		return 0;
	}
	CHECK(cluster_size >= 512 && cluster_size <= (2U << 20));

	/* Then the first cluster, or the whole image when shorter */
	len = size < cluster_size ? size : cluster_size;
	first = malloc(len);
	CHECK(first);
	memcpy(first, data, len);
	err = NULL;
	r = qcow2_header_parse(first, len, &h, &err);
	free(first);
	if (r) {
		check_err(r, err, -EINVAL);
		return 0;
	}
	CHECK(h.cluster_size == cluster_size);
	check_header(&h, len);

	err = NULL;
	r = qcow2_header_check_layout(&h, size, &err);
	if (r) {
		check_err(r, err, -EINVAL);
		return 0;
	}
	CHECK(h.refcount_table_offset >= h.cluster_size);
	CHECK(h.refcount_table_offset +
	      ((u64)h.refcount_table_clusters << h.cluster_bits) <= size);
	CHECK(h.l1_table_offset + (u64)h.l1_size * 8 <= size);

	decode_l1(&h, data, size);
	decode_refcounts(&h, data, size);
	decode_snapshots(&h, data, size);
	return 0;
}
