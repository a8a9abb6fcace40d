// SPDX-License-Identifier: GPL-2.0-only
/*
 * dm-qcow2: the qcow2 on-disk format as pure functions.
 *
 * Every value decoded here comes from an image we did not write, so each
 * one is range-checked before it is returned. Errors come back as a
 * negative errno plus a fixed, human-readable string: the target shows the
 * string as ti->error at table load, or in the kernel log at run time.
 *
 * -EINVAL means "this header is not acceptable", -EUCLEAN means "this
 * table entry is corrupt" (the caller fails the I/O and marks the image).
 */
#include "dm-qcow2-format.h"

u32 qcow2_get_be32(const void *p)
{
	const u8 *b = p;

	return (u32)b[0] << 24 | (u32)b[1] << 16 | (u32)b[2] << 8 | b[3];
}

u64 qcow2_get_be64(const void *p)
{
	const u8 *b = p;

	return (u64)qcow2_get_be32(b) << 32 | qcow2_get_be32(b + 4);
}

void qcow2_put_be32(void *p, u32 v)
{
	u8 *b = p;

	b[0] = v >> 24;
	b[1] = v >> 16;
	b[2] = v >> 8;
	b[3] = v;
}

void qcow2_put_be64(void *p, u64 v)
{
	qcow2_put_be32(p, v >> 32);
	qcow2_put_be32((u8 *)p + 4, (u32)v);
}

static int fail(const char **err, const char *msg, int ret)
{
	*err = msg;
	return ret;
}

/*
 * Only the fields needed to know how much of the image to read: the
 * caller reads QCOW2_HEADER_PROBE_LEN bytes, then the whole first cluster.
 */
int qcow2_header_probe(const void *buf, size_t len, u32 *cluster_size,
		       const char **err)
{
	const u8 *b = buf;
	u32 version, bits;

	if (len < QCOW2_HEADER_PROBE_LEN)
		return fail(err, "Image too small for a qcow2 header", -EINVAL);
	if (qcow2_get_be32(b) != QCOW2_MAGIC)
		return fail(err, "Not a qcow2 image (bad magic)", -EINVAL);
	version = qcow2_get_be32(b + 4);
	if (version != 2 && version != 3)
		return fail(err, "Unsupported qcow2 version (not 2 or 3)",
			    -EINVAL);
	bits = qcow2_get_be32(b + 20);
	if (bits < QCOW2_MIN_CLUSTER_BITS || bits > QCOW2_MAX_CLUSTER_BITS)
		return fail(err, "Cluster size out of range (cluster_bits not 9..21)",
			    -EINVAL);
	*cluster_size = 1U << bits;
	return 0;
}

static void header_decode(const u8 *b, struct qcow2_header *h)
{
	memset(h, 0, sizeof(*h));
	h->version = qcow2_get_be32(b + 4);
	h->backing_file_offset = qcow2_get_be64(b + 8);
	h->backing_file_size = qcow2_get_be32(b + 16);
	h->cluster_bits = qcow2_get_be32(b + 20);
	h->size = qcow2_get_be64(b + 24);
	h->crypt_method = qcow2_get_be32(b + 32);
	h->l1_size = qcow2_get_be32(b + 36);
	h->l1_table_offset = qcow2_get_be64(b + 40);
	h->refcount_table_offset = qcow2_get_be64(b + 48);
	h->refcount_table_clusters = qcow2_get_be32(b + 56);
	h->nb_snapshots = qcow2_get_be32(b + 60);
	h->snapshots_offset = qcow2_get_be64(b + 64);
	h->cluster_size = 1U << h->cluster_bits;

	if (h->version == 2) {
		/* Version 2 has no fields past offset 72 */
		h->refcount_order = 4;
		h->header_length = QCOW2_V2_HEADER_LEN;
		return;
	}
	h->incompatible_features = qcow2_get_be64(b + 72);
	h->compatible_features = qcow2_get_be64(b + 80);
	h->autoclear_features = qcow2_get_be64(b + 88);
	h->refcount_order = qcow2_get_be32(b + 96);
	h->header_length = qcow2_get_be32(b + 100);
}

static int header_check_length(const u8 *b, size_t len,
			       struct qcow2_header *h, const char **err)
{
	if (h->version == 2)
		return 0;
	if (h->header_length < QCOW2_V3_HEADER_LEN)
		return fail(err, "Header length too small for version 3",
			    -EINVAL);
	if (h->header_length > h->cluster_size)
		return fail(err, "Header length larger than one cluster",
			    -EINVAL);
	if (h->header_length > len)
		return fail(err, "Header runs past the end of the image",
			    -EINVAL);
	if (h->header_length > QCOW2_V3_HEADER_LEN)
		h->compression_type = b[QCOW2_V3_HEADER_LEN];
	return 0;
}

static int header_check_backing(const struct qcow2_header *h,
				const char **err)
{
	if (!h->backing_file_offset)
		return 0;
	if (h->backing_file_offset > h->cluster_size)
		return fail(err, "Backing file name offset outside the first cluster",
			    -EINVAL);
	if (h->backing_file_size > QCOW2_MAX_BACKING_NAME)
		return fail(err, "Backing file name too long (max 1023 bytes)",
			    -EINVAL);
	if (h->backing_file_size > h->cluster_size - h->backing_file_offset)
		return fail(err, "Backing file name runs past the first cluster",
			    -EINVAL);
	return 0;
}

static int header_check_features(const struct qcow2_header *h,
				 const char **err)
{
	bool comp_bit = h->incompatible_features & QCOW2_INCOMPAT_COMPRESSION;

	if (h->incompatible_features & ~QCOW2_INCOMPAT_KNOWN)
		return fail(err, "Unknown incompatible feature bits set",
			    -EINVAL);
	if (h->refcount_order > QCOW2_MAX_REFCOUNT_ORDER)
		return fail(err, "Refcount width too large (refcount_order > 6)",
			    -EINVAL);
	if (h->crypt_method > QCOW2_CRYPT_LUKS)
		return fail(err, "Unknown encryption method", -EINVAL);
	if (h->compression_type > QCOW2_COMPRESSION_ZSTD)
		return fail(err, "Unknown compression type", -EINVAL);
	if (h->compression_type != QCOW2_COMPRESSION_DEFLATE && !comp_bit)
		return fail(err, "Compression type set but incompatible bit 3 clear",
			    -EINVAL);
	if (h->compression_type == QCOW2_COMPRESSION_DEFLATE && comp_bit)
		return fail(err, "Incompatible bit 3 set but compression type is deflate",
			    -EINVAL);
	if ((h->incompatible_features & QCOW2_INCOMPAT_EXTL2) &&
	    h->cluster_bits < QCOW2_MIN_EXT_L2_CLUSTER_BITS)
		return fail(err, "Extended L2 needs clusters of 16 KiB or more",
			    -EINVAL);
	return 0;
}

/*
 * A table at @offset of @bytes must be cluster aligned and must end below
 * INT64_MAX, so that no later offset arithmetic can overflow.
 */
static bool table_offset_ok(const struct qcow2_header *h, u64 offset,
			    u64 bytes)
{
	if (offset & (h->cluster_size - 1))
		return false;
	return offset <= (u64)S64_MAX - bytes;
}

static int header_check_tables(const struct qcow2_header *h,
			       const char **err)
{
	u64 bytes, l2_span, l1_needed;

	if (!h->refcount_table_clusters)
		return fail(err, "Image has no refcount table", -EINVAL);
	if (h->refcount_table_clusters >
	    QCOW2_MAX_REFTABLE_BYTES >> h->cluster_bits)
		return fail(err, "Refcount table too large (max 8 MiB)",
			    -EINVAL);
	bytes = (u64)h->refcount_table_clusters << h->cluster_bits;
	if (h->refcount_table_offset & (h->cluster_size - 1))
		return fail(err, "Refcount table offset not cluster aligned",
			    -EINVAL);
	if (!table_offset_ok(h, h->refcount_table_offset, bytes))
		return fail(err, "Refcount table offset too large", -EINVAL);

	if (h->nb_snapshots > QCOW2_MAX_SNAPSHOTS)
		return fail(err, "Too many snapshots (max 65536)", -EINVAL);
	bytes = (u64)h->nb_snapshots * QCOW2_SNAPSHOT_HEADER_LEN;
	if (h->snapshots_offset & (h->cluster_size - 1))
		return fail(err, "Snapshot table offset not cluster aligned",
			    -EINVAL);
	if (!table_offset_ok(h, h->snapshots_offset, bytes))
		return fail(err, "Snapshot table offset too large", -EINVAL);

	if (h->l1_size > QCOW2_MAX_L1_BYTES / sizeof(u64))
		return fail(err, "L1 table too large (max 32 MiB)", -EINVAL);
	bytes = (u64)h->l1_size * sizeof(u64);
	if (h->l1_table_offset & (h->cluster_size - 1))
		return fail(err, "L1 table offset not cluster aligned", -EINVAL);
	if (!table_offset_ok(h, h->l1_table_offset, bytes))
		return fail(err, "L1 table offset too large", -EINVAL);

	/* Written as a division so that a huge size cannot overflow */
	l2_span = qcow2_l2_coverage(h);
	l1_needed = h->size / l2_span + !!(h->size % l2_span);
	if (l1_needed > h->l1_size)
		return fail(err, "L1 table too small for the virtual size",
			    -EINVAL);
	return 0;
}

static int ext_backing_format(struct qcow2_header *h, u32 off, u32 len,
			      const char **err)
{
	if (len > QCOW2_MAX_BACKING_FMT)
		return fail(err, "Backing format extension too long", -EINVAL);
	h->backing_format_offset = off;
	h->backing_format_len = len;
	h->extensions |= QCOW2_HAS_BACKING_FORMAT;
	return 0;
}

static int ext_crypto(struct qcow2_header *h, u32 len, const char **err)
{
	if (h->crypt_method != QCOW2_CRYPT_LUKS)
		return fail(err, "Encryption header extension without LUKS encryption",
			    -EINVAL);
	if (len != 16)
		return fail(err, "Encryption header extension has a bad length",
			    -EINVAL);
	h->extensions |= QCOW2_HAS_CRYPTO;
	return 0;
}

static int ext_bitmaps(struct qcow2_header *h, u32 len, const char **err)
{
	/* Without the autoclear bit the extension is stale and ignored */
	if (!(h->autoclear_features & QCOW2_AUTOCLEAR_BITMAPS))
		return 0;
	if (len != 24)
		return fail(err, "Bitmaps extension has a bad length", -EINVAL);
	return 0;
}

static int ext_one(struct qcow2_header *h, u32 type, u32 off, u32 len,
		   const char **err)
{
	switch (type) {
	case QCOW2_EXT_BACKING_FORMAT:
		return ext_backing_format(h, off, len, err);
	case QCOW2_EXT_CRYPTO:
		return ext_crypto(h, len, err);
	case QCOW2_EXT_BITMAPS:
		return ext_bitmaps(h, len, err);
	default:
		/*
		 * The feature name table, the external data file name (such
		 * images are refused by their incompatible bit) and unknown
		 * extensions: preserved, never interpreted.
		 */
		return 0;
	}
}

/*
 * Header extensions sit between the end of the header and the backing file
 * name (or the end of the first cluster); each is 8 bytes of type and length
 * followed by data padded to 8 bytes. The loop ends at the end marker or
 * the end of the area, and advances at least 8 bytes each time.
 */
static int header_parse_extensions(const u8 *b, size_t len,
				   struct qcow2_header *h, const char **err)
{
	u64 end = h->backing_file_offset ? h->backing_file_offset :
					   h->cluster_size;
	u64 off = h->header_length;
	u32 type, ext_len;
	int ret;

	if (end > len)
		end = len;
	while (off < end) {
		if (end - off < 8)
			return fail(err, "Header extension runs past its area",
				    -EINVAL);
		type = qcow2_get_be32(b + off);
		ext_len = qcow2_get_be32(b + off + 4);
		off += 8;
		if (ext_len > end - off)
			return fail(err, "Header extension runs past its area",
				    -EINVAL);
		if (type == QCOW2_EXT_END)
			break;
		ret = ext_one(h, type, (u32)off, ext_len, err);
		if (ret)
			return ret;
		off += ((u64)ext_len + 7) & ~7ULL;
	}
	if ((h->extensions & QCOW2_HAS_CRYPTO) == 0 &&
	    h->crypt_method == QCOW2_CRYPT_LUKS)
		return fail(err, "LUKS encryption without its header extension",
			    -EINVAL);
	return 0;
}

/*
 * Parse and validate the header in @buf, which holds the first cluster of
 * the image, or the whole image when that is shorter.
 */
int qcow2_header_parse(const void *buf, size_t len, struct qcow2_header *h,
		       const char **err)
{
	u32 cluster_size;
	int ret;

	ret = qcow2_header_probe(buf, len, &cluster_size, err);
	if (ret)
		return ret;
	if (qcow2_get_be32((const u8 *)buf + 4) == 3 &&
	    len < QCOW2_V3_HEADER_LEN)
		return fail(err, "Image too small for a qcow2 header", -EINVAL);

	header_decode(buf, h);
	ret = header_check_length(buf, len, h, err);
	if (!ret)
		ret = header_check_features(h, err);
	if (!ret)
		ret = header_check_backing(h, err);
	if (ret)
		return ret;

	/* The L1 size check below needs the L2 geometry */
	h->extended_l2 = h->incompatible_features & QCOW2_INCOMPAT_EXTL2;
	h->l2_entry_size = h->extended_l2 ? 16 : 8;
	h->l2_bits = h->cluster_bits - (h->extended_l2 ? 4 : 3);
	ret = header_check_tables(h, err);
	if (ret)
		return ret;
	return header_parse_extensions(buf, len, h, err);
}

/* The tables the target reads at open must lie inside the image. */
int qcow2_header_check_layout(const struct qcow2_header *h, u64 image_size,
			      const char **err)
{
	u64 rt_bytes = (u64)h->refcount_table_clusters << h->cluster_bits;
	u64 bytes = rt_bytes;

	if (h->refcount_table_offset < h->cluster_size)
		return fail(err, "Refcount table overlaps the header", -EINVAL);
	if (h->refcount_table_offset > image_size ||
	    bytes > image_size - h->refcount_table_offset)
		return fail(err, "Refcount table runs past the end of the image",
			    -EINVAL);
	bytes = (u64)h->l1_size * sizeof(u64);
	if (bytes && h->l1_table_offset < h->cluster_size)
		return fail(err, "L1 table overlaps the header", -EINVAL);
	if (h->l1_table_offset > image_size ||
	    bytes > image_size - h->l1_table_offset)
		return fail(err, "L1 table runs past the end of the image",
			    -EINVAL);
	/*
	 * Both are written in place, entry by entry: one would overwrite the
	 * other. Both ranges lie inside the image here: no overflow.
	 */
	if (bytes && h->l1_table_offset < h->refcount_table_offset + rt_bytes &&
	    h->refcount_table_offset < h->l1_table_offset + bytes)
		return fail(err, "L1 table overlaps the refcount table",
			    -EINVAL);
	return 0;
}

/* Decode an L1 entry: the L2 table's offset, 0 when unallocated. */
/*
 * The length of the snapshot table entry whose fixed part
 * (QCOW2_SNAPSHOT_HEADER_LEN bytes) is at @buf: the fixed part, extra
 * data, id and name, padded to 8 bytes.
 */
int qcow2_snapshot_entry_len(const void *buf, u32 *len, const char **err)
{
	const u8 *b = buf;
	u32 id_len = (u32)b[12] << 8 | b[13];
	u32 name_len = (u32)b[14] << 8 | b[15];
	u32 extra = qcow2_get_be32(b + 36);

	if (extra > QCOW2_MAX_SNAPSHOT_EXTRA)
		return fail(err, "Snapshot extra data too large (max 1024 bytes)",
			    -EINVAL);
	*len = QCOW2_SNAPSHOT_HEADER_LEN + extra + id_len + name_len;
	*len = (*len + 7) & ~7U;
	return 0;
}

/*
 * A snapshot table entry of @len bytes: at least up to the end of its
 * name, as QEMU writes the last entry of a table (its padding to 8 bytes,
 * which qcow2_snapshot_entry_len() counts, may lie past the end of the
 * image).
 */
int qcow2_snapshot_parse(const struct qcow2_header *h, const void *buf,
			 u32 len, struct qcow2_snapshot *s, const char **err)
{
	const u8 *b = buf;
	u32 need, extra;
	int r;

	r = qcow2_snapshot_entry_len(buf, &need, err);
	if (r)
		return r;
	extra = qcow2_get_be32(b + 36);
	need = QCOW2_SNAPSHOT_HEADER_LEN + extra + ((u32)b[12] << 8 | b[13]) +
	       ((u32)b[14] << 8 | b[15]);
	if (len < need)
		return fail(err, "Snapshot table entry truncated", -EINVAL);
	s->l1_table_offset = qcow2_get_be64(b);
	s->l1_size = qcow2_get_be32(b + 8);
	s->id_len = (u32)b[12] << 8 | b[13];
	s->name_len = (u32)b[14] << 8 | b[15];
	s->id_off = QCOW2_SNAPSHOT_HEADER_LEN + extra;
	s->name_off = s->id_off + s->id_len;
	s->disk_size = extra >= 16 ? qcow2_get_be64(b + 48) : 0;
	if (s->l1_size > QCOW2_MAX_L1_BYTES / sizeof(u64))
		return fail(err, "Snapshot L1 table too large (max 32 MiB)",
			    -EINVAL);
	if (!table_offset_ok(h, s->l1_table_offset,
			     (u64)s->l1_size * sizeof(u64)))
		return fail(err, "Snapshot L1 table offset not aligned or too large",
			    -EINVAL);
	if (s->disk_size > (u64)S64_MAX)
		return fail(err, "Snapshot virtual size too large", -EINVAL);
	return 0;
}

int qcow2_l1_decode(const struct qcow2_header *h, u64 entry, u64 *l2_offset,
		    const char **err)
{
	u64 off = entry & QCOW2_OFFSET_MASK;

	if (entry & QCOW2_L1_RESERVED)
		return fail(err, "L1 entry has reserved bits set", -EUCLEAN);
	if (off & (h->cluster_size - 1))
		return fail(err, "L2 table offset not cluster aligned",
			    -EUCLEAN);
	*l2_offset = off;
	return 0;
}

void qcow2_compressed_decode(u32 cluster_bits, u64 entry, u64 *offset,
			     u32 *max_len)
{
	u32 x = 62 - (cluster_bits - 8);
	u64 sectors = ((entry >> x) & ((1ULL << (cluster_bits - 8)) - 1)) + 1;

	*offset = entry & ((1ULL << x) - 1);
	*max_len = (u32)(sectors * 512 - (*offset & 511));
}

static int l2_decode_compressed(const struct qcow2_header *h, u64 entry,
				u64 bitmap, struct qcow2_l2_map *map,
				const char **err)
{
	if (entry & QCOW2_OFLAG_COPIED)
		return fail(err, "Compressed cluster with the COPIED flag",
			    -EUCLEAN);
	if (h->extended_l2 && bitmap)
		return fail(err, "Compressed cluster with a subcluster bitmap",
			    -EUCLEAN);
	map->type = QCOW2_CLUSTER_COMPRESSED;
	qcow2_compressed_decode(h->cluster_bits, entry, &map->host_offset,
				&map->comp_len);
	if (!map->host_offset)
		return fail(err, "Compressed cluster at offset 0", -EUCLEAN);
	if (map->host_offset >= QCOW2_MAX_HOST_OFFSET)
		return fail(err, "Compressed cluster offset beyond 2^56",
			    -EUCLEAN);
	return 0;
}

static int l2_decode_bitmap(struct qcow2_l2_map *map, u64 bitmap,
			    const char **err)
{
	map->sc_alloc = (u32)bitmap;
	map->sc_zero = (u32)(bitmap >> 32);
	if (map->sc_alloc & map->sc_zero)
		return fail(err, "Subcluster both allocated and zero", -EUCLEAN);
	if (map->type == QCOW2_CLUSTER_UNALLOCATED && map->sc_alloc)
		return fail(err, "Allocated subclusters without a host cluster",
			    -EUCLEAN);
	return 0;
}

/*
 * Decode one L2 entry; @bitmap is the second word of an extended entry and
 * is ignored otherwise. Anything the spec calls reserved, or an offset that
 * could not have been written by a correct implementation, is corruption.
 */
int qcow2_l2_decode(const struct qcow2_header *h, u64 entry, u64 bitmap,
		    struct qcow2_l2_map *map, const char **err)
{
	u64 off = entry & QCOW2_OFFSET_MASK;

	memset(map, 0, sizeof(*map));
	if (entry & QCOW2_OFLAG_COMPRESSED)
		return l2_decode_compressed(h, entry, bitmap, map, err);
	if (entry & QCOW2_L2_RESERVED)
		return fail(err, "L2 entry has reserved bits set", -EUCLEAN);
	if (off & (h->cluster_size - 1))
		return fail(err, "Data cluster offset not cluster aligned",
			    -EUCLEAN);
	map->host_offset = off;
	map->copied = off && (entry & QCOW2_OFLAG_COPIED);

	if (entry & QCOW2_OFLAG_ZERO) {
		if (h->version < 3)
			return fail(err, "Zero cluster flag in a version 2 image",
				    -EUCLEAN);
		if (h->extended_l2)
			return fail(err, "Zero cluster flag with extended L2",
				    -EUCLEAN);
		map->type = off ? QCOW2_CLUSTER_ZERO_ALLOC :
				  QCOW2_CLUSTER_ZERO_PLAIN;
		return 0;
	}
	map->type = off ? QCOW2_CLUSTER_NORMAL : QCOW2_CLUSTER_UNALLOCATED;
	if (h->extended_l2)
		return l2_decode_bitmap(map, bitmap, err);
	return 0;
}

/* Decode a refcount table entry: the refcount block offset, 0 if none. */
int qcow2_reftable_decode(const struct qcow2_header *h, u64 entry,
			  u64 *block_offset, const char **err)
{
	u64 off = entry & ~QCOW2_REFT_RESERVED;

	if (entry & QCOW2_REFT_RESERVED)
		return fail(err, "Refcount table entry has reserved bits set",
			    -EUCLEAN);
	if (off & (h->cluster_size - 1))
		return fail(err, "Refcount block offset not cluster aligned",
			    -EUCLEAN);
	if (off >= QCOW2_MAX_HOST_OFFSET)
		return fail(err, "Refcount block offset beyond 2^56", -EUCLEAN);
	*block_offset = off;
	return 0;
}

u64 qcow2_refcount_max(u32 refcount_order)
{
	if (refcount_order >= 6)
		return U64_MAX;
	return (1ULL << (1U << refcount_order)) - 1;
}

/*
 * Refcounts narrower than a byte are packed from the least significant bit
 * of each byte; wider ones are big-endian.
 */
u64 qcow2_refcount_get(const void *block, u64 index, u32 refcount_order)
{
	const u8 *b = block;
	u32 width = 1U << refcount_order;
	u64 bit = index << refcount_order;
	u64 val = 0;
	u32 i;

	if (width < 8)
		return (b[bit / 8] >> (bit % 8)) & ((1U << width) - 1);
	b += bit / 8;
	for (i = 0; i < width / 8; i++)
		val = val << 8 | b[i];
	return val;
}

void qcow2_refcount_set(void *block, u64 index, u32 refcount_order, u64 val)
{
	u8 *b = block;
	u32 width = 1U << refcount_order;
	u64 bit = index << refcount_order;
	u32 i, mask;

	if (width < 8) {
		mask = ((1U << width) - 1) << (bit % 8);
		b[bit / 8] = (b[bit / 8] & ~mask) |
			     ((val << (bit % 8)) & mask);
		return;
	}
	b += bit / 8;
	for (i = width / 8; i > 0; i--) {
		b[i - 1] = (u8)val;
		val >>= 8;
	}
}
