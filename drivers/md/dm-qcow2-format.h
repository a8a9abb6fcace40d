/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * dm-qcow2: the qcow2 on-disk format as pure functions.
 *
 * Everything here decodes or encodes bytes that came from an untrusted
 * image. Nothing does I/O, takes a lock or allocates memory, so the same
 * code is built into the module and into the host unit tests and fuzzers
 * (see dm-qcow2-compat.h).
 */
#ifndef DM_QCOW2_FORMAT_H
#define DM_QCOW2_FORMAT_H

#include "dm-qcow2-compat.h"

#define QCOW2_MAGIC			0x514649fbU	/* "QFI\xfb" */
#define QCOW2_MIN_CLUSTER_BITS		9
#define QCOW2_MAX_CLUSTER_BITS		21
#define QCOW2_MIN_EXT_L2_CLUSTER_BITS	14
#define QCOW2_V2_HEADER_LEN		72
#define QCOW2_V3_HEADER_LEN		104
#define QCOW2_HEADER_PROBE_LEN		QCOW2_V2_HEADER_LEN
#define QCOW2_MAX_BACKING_NAME		1023
#define QCOW2_MAX_BACKING_FMT		15
#define QCOW2_MAX_REFCOUNT_ORDER	6
#define QCOW2_MAX_L1_BYTES		(32U << 20)
#define QCOW2_MAX_REFTABLE_BYTES	(8U << 20)
#define QCOW2_MAX_SNAPSHOTS		65536U
#define QCOW2_SNAPSHOT_HEADER_LEN	40U
#define QCOW2_MAX_HOST_OFFSET		BIT_ULL(56)
#define QCOW2_SUBCLUSTERS		32

/* Incompatible feature bits */
#define QCOW2_INCOMPAT_DIRTY		BIT_ULL(0)
#define QCOW2_INCOMPAT_CORRUPT		BIT_ULL(1)
#define QCOW2_INCOMPAT_DATA_FILE	BIT_ULL(2)
#define QCOW2_INCOMPAT_COMPRESSION	BIT_ULL(3)
#define QCOW2_INCOMPAT_EXTL2		BIT_ULL(4)
#define QCOW2_INCOMPAT_KNOWN		0x1fULL

/* Compatible and autoclear feature bits */
#define QCOW2_COMPAT_LAZY_REFCOUNTS	BIT_ULL(0)
#define QCOW2_AUTOCLEAR_BITMAPS		BIT_ULL(0)
#define QCOW2_AUTOCLEAR_DATA_FILE_RAW	BIT_ULL(1)

#define QCOW2_CRYPT_NONE		0
#define QCOW2_CRYPT_AES			1
#define QCOW2_CRYPT_LUKS		2

#define QCOW2_COMPRESSION_DEFLATE	0
#define QCOW2_COMPRESSION_ZSTD		1

/* Byte offsets of header fields that the target rewrites in place */
#define QCOW2_HDR_SIZE_OFF		24
#define QCOW2_HDR_L1_SIZE_OFF		36
#define QCOW2_HDR_L1_OFFSET_OFF		40
#define QCOW2_HDR_REFTABLE_OFF		48
#define QCOW2_HDR_REFTABLE_CLUSTERS_OFF	56
#define QCOW2_HDR_INCOMPAT_OFF		72
#define QCOW2_HDR_AUTOCLEAR_OFF		88

/* Header extension types */
#define QCOW2_EXT_END			0x00000000U
#define QCOW2_EXT_BACKING_FORMAT	0xe2792acaU
#define QCOW2_EXT_FEATURE_TABLE		0x6803f857U
#define QCOW2_EXT_BITMAPS		0x23852875U
#define QCOW2_EXT_CRYPTO		0x0537be77U
#define QCOW2_EXT_DATA_FILE		0x44415441U

/* Bits of struct qcow2_header.extensions: extensions found and used */
#define QCOW2_HAS_BACKING_FORMAT	BIT(0)
#define QCOW2_HAS_CRYPTO		BIT(1)

/* Table entry bits */
#define QCOW2_OFFSET_MASK		0x00fffffffffffe00ULL
#define QCOW2_OFLAG_COPIED		BIT_ULL(63)
#define QCOW2_OFLAG_COMPRESSED		BIT_ULL(62)
#define QCOW2_OFLAG_ZERO		BIT_ULL(0)
#define QCOW2_L1_RESERVED		0x7f000000000001ffULL
#define QCOW2_L2_RESERVED		0x3f000000000001feULL
#define QCOW2_REFT_RESERVED		0x1ffULL

/* A parsed and validated header, in CPU byte order. */
struct qcow2_header {
	u32 version;
	u64 backing_file_offset;
	u32 backing_file_size;
	u32 cluster_bits;
	u64 size;
	u32 crypt_method;
	u32 l1_size;
	u64 l1_table_offset;
	u64 refcount_table_offset;
	u32 refcount_table_clusters;
	u32 nb_snapshots;
	u64 snapshots_offset;
	u64 incompatible_features;
	u64 compatible_features;
	u64 autoclear_features;
	u32 refcount_order;
	u32 header_length;
	u8 compression_type;

	/* From the header extensions */
	u32 extensions;			/* QCOW2_HAS_* */
	u32 backing_format_offset;	/* byte offset of the name in cluster 0 */
	u32 backing_format_len;

	/* Derived */
	u32 cluster_size;
	u32 l2_bits;			/* log2 of entries per L2 table */
	u32 l2_entry_size;		/* 8, or 16 with extended L2 */
	bool extended_l2;
};

/* What an L2 entry says about one guest cluster. */
enum qcow2_cluster_type {
	QCOW2_CLUSTER_UNALLOCATED,	/* reads from backing file, or zeros */
	QCOW2_CLUSTER_ZERO_PLAIN,	/* reads zeros, no host cluster */
	QCOW2_CLUSTER_ZERO_ALLOC,	/* reads zeros, host cluster reserved */
	QCOW2_CLUSTER_NORMAL,		/* data at host_offset */
	QCOW2_CLUSTER_COMPRESSED,	/* compressed data at host_offset */
};

struct qcow2_l2_map {
	enum qcow2_cluster_type type;
	bool copied;		/* refcount is exactly one: may write in place */
	u64 host_offset;	/* cluster offset, or byte offset if compressed */
	u32 comp_len;		/* compressed: upper bound of the data length */
	u32 sc_alloc;		/* extended L2: subclusters allocated */
	u32 sc_zero;		/* extended L2: subclusters reading as zero */
};

int qcow2_header_probe(const void *buf, size_t len, u32 *cluster_size,
		       const char **err);
int qcow2_header_parse(const void *buf, size_t len, struct qcow2_header *h,
		       const char **err);
int qcow2_header_check_layout(const struct qcow2_header *h, u64 image_size,
			      const char **err);

/* One entry of the snapshot table. */
struct qcow2_snapshot {
	u64 l1_table_offset;
	u32 l1_size;
	u64 disk_size;		/* virtual size when taken; 0: not recorded */
	u32 id_off, id_len;	/* the id string, within the entry */
	u32 name_off, name_len;	/* the name, within the entry */
};

#define QCOW2_MAX_SNAPSHOT_EXTRA	1024U
#define QCOW2_MAX_SNAPSHOT_TABLE	(64U << 20)

int qcow2_snapshot_entry_len(const void *buf, u32 *len, const char **err);
int qcow2_snapshot_parse(const struct qcow2_header *h, const void *buf,
			 u32 len, struct qcow2_snapshot *s, const char **err);

int qcow2_l1_decode(const struct qcow2_header *h, u64 entry, u64 *l2_offset,
		    const char **err);
int qcow2_l2_decode(const struct qcow2_header *h, u64 entry, u64 bitmap,
		    struct qcow2_l2_map *map, const char **err);
void qcow2_compressed_decode(u32 cluster_bits, u64 entry, u64 *offset,
			     u32 *max_len);
int qcow2_reftable_decode(const struct qcow2_header *h, u64 entry,
			  u64 *block_offset, const char **err);

u64 qcow2_refcount_max(u32 refcount_order);
u64 qcow2_refcount_get(const void *block, u64 index, u32 refcount_order);
void qcow2_refcount_set(void *block, u64 index, u32 refcount_order, u64 val);

u64 qcow2_get_be64(const void *p);
u32 qcow2_get_be32(const void *p);
void qcow2_put_be64(void *p, u64 v);
void qcow2_put_be32(void *p, u32 v);

/* Geometry */
static inline u64 qcow2_l1_index(const struct qcow2_header *h, u64 voff)
{
	return voff >> (h->cluster_bits + h->l2_bits);
}

static inline u32 qcow2_l2_index(const struct qcow2_header *h, u64 voff)
{
	return (u32)(voff >> h->cluster_bits) & ((1U << h->l2_bits) - 1);
}

static inline u64 qcow2_cluster_offset(const struct qcow2_header *h, u64 off)
{
	return off & ((u64)h->cluster_size - 1);
}

/* Refcount entries held by one refcount block */
static inline u32 qcow2_refblock_bits(const struct qcow2_header *h)
{
	return h->cluster_bits + 3 - h->refcount_order;
}

/* Guest bytes mapped by one L1 entry (one full L2 table) */
static inline u64 qcow2_l2_coverage(const struct qcow2_header *h)
{
	return 1ULL << (h->cluster_bits + h->l2_bits);
}

#endif /* DM_QCOW2_FORMAT_H */
