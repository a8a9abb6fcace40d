// SPDX-License-Identifier: GPL-2.0-only
/*
 * Host unit tests for drivers/md/dm-qcow2-format.c.
 *
 * Every rule of the format code has a test here: headers are built in a
 * buffer from a struct of fields (defaults make a valid image, each test
 * overrides what it needs), and every rejection is checked against the exact
 * error string the target shows to the user.
 *
 * Output: "PASS name" or "FAIL name: file:line: detail" per test, then
 * "N passed, N failed". The exit status is non-zero if any test failed.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "dm-qcow2-format.h"

/* ------------------------------------------------------------------ */
/* A tiny test framework                                                */
/* ------------------------------------------------------------------ */

static int checks_failed;		/* in the current test */
static char first_failure[512];

static void fail_at(const char *file, int line, const char *fmt, ...)
{
	va_list ap;
	int n;

	if (checks_failed++)
		return;
	n = snprintf(first_failure, sizeof(first_failure), "%s:%d: ", file,
		     line);
	va_start(ap, fmt);
	vsnprintf(first_failure + n, sizeof(first_failure) - n, fmt, ap);
	va_end(ap);
}

static bool check_eq(const char *file, int line, const char *a,
		     const char *b, u64 va, u64 vb)
{
	if (va == vb)
		return true;
	fail_at(file, line, "%s == %s: 0x%llx != 0x%llx", a, b,
		(unsigned long long)va, (unsigned long long)vb);
	return false;
}

static bool check_str(const char *file, int line, const char *a,
		      const char *va, const char *vb)
{
	if (va && vb && !strcmp(va, vb))
		return true;
	fail_at(file, line, "%s: \"%s\" != \"%s\"", a, va ? va : "(null)",
		vb ? vb : "(null)");
	return false;
}

#define CHECK(c) do { \
	if (!(c)) \
		fail_at(__FILE__, __LINE__, "CHECK(%s)", #c); \
} while (0)
#define CHECK_EQ(a, b) check_eq(__FILE__, __LINE__, #a, #b, (u64)(a), (u64)(b))
#define CHECK_STR(a, b) check_str(__FILE__, __LINE__, #a, (a), (b))

struct test {
	const char *name;
	void (*fn)(void);
};

/* ------------------------------------------------------------------ */
/* Header builder                                                       */
/* ------------------------------------------------------------------ */

#define KiB (1ULL << 10)
#define MiB (1ULL << 20)
#define GiB (1ULL << 30)
#define C64K (64 * KiB)

/* Every header field, in CPU order; build() writes them big-endian. */
struct spec {
	u32 magic;
	u32 version;
	u64 backing_off;
	u32 backing_size;
	u32 cluster_bits;
	u64 size;
	u32 crypt;
	u32 l1_size;
	u64 l1_off;
	u64 rt_off;
	u32 rt_clusters;
	u32 nb_snap;
	u64 snap_off;
	u64 incompat;
	u64 compat;
	u64 autoclear;
	u32 refcount_order;
	u32 header_length;
	u8 compression_type;	/* written only when header_length > 104 */
};

/* Big enough for a 2 MiB cluster plus room to test reads past it */
static u8 img[(2 * MiB) + 4096];
static u32 ext_cursor;		/* where ext_add() writes the next one */

/* A valid v3 image: 64 KiB clusters, 1 GiB, header as qemu-img writes it. */
static struct spec v3(void)
{
	struct spec s = {
		.magic = QCOW2_MAGIC, .version = 3, .cluster_bits = 16,
		.size = GiB, .l1_size = 2, .l1_off = 3 * C64K,
		.rt_off = C64K, .rt_clusters = 1, .refcount_order = 4,
		.header_length = 112,
	};
	return s;
}

static struct spec v2(void)
{
	struct spec s = v3();

	s.version = 2;
	s.header_length = 0;	/* not written */
	s.refcount_order = 0;	/* not written */
	return s;
}

/*
 * Write @s into img (zeroing one cluster first, so the extension area
 * holds an end marker) and return the length to parse: one cluster.
 */
static size_t build(const struct spec *s)
{
	bool bits_ok = s->cluster_bits >= 9 && s->cluster_bits <= 21;
	size_t len = bits_ok ? (size_t)1 << s->cluster_bits : C64K;

	memset(img, 0, len + 4096);
	qcow2_put_be32(img + 0, s->magic);
	qcow2_put_be32(img + 4, s->version);
	qcow2_put_be64(img + 8, s->backing_off);
	qcow2_put_be32(img + 16, s->backing_size);
	qcow2_put_be32(img + 20, s->cluster_bits);
	qcow2_put_be64(img + 24, s->size);
	qcow2_put_be32(img + 32, s->crypt);
	qcow2_put_be32(img + 36, s->l1_size);
	qcow2_put_be64(img + 40, s->l1_off);
	qcow2_put_be64(img + 48, s->rt_off);
	qcow2_put_be32(img + 56, s->rt_clusters);
	qcow2_put_be32(img + 60, s->nb_snap);
	qcow2_put_be64(img + 64, s->snap_off);
	ext_cursor = QCOW2_V2_HEADER_LEN;
	if (s->version == 2)
		return len;
	qcow2_put_be64(img + 72, s->incompat);
	qcow2_put_be64(img + 80, s->compat);
	qcow2_put_be64(img + 88, s->autoclear);
	qcow2_put_be32(img + 96, s->refcount_order);
	qcow2_put_be32(img + 100, s->header_length);
	if (s->header_length > 104)
		img[104] = s->compression_type;
	ext_cursor = s->header_length;
	return len;
}

/* Append a header extension at ext_cursor; @data may be NULL (zeros). */
static void ext_add(u32 type, const void *data, u32 len)
{
	qcow2_put_be32(img + ext_cursor, type);
	qcow2_put_be32(img + ext_cursor + 4, len);
	if (data)
		memcpy(img + ext_cursor + 8, data, len);
	ext_cursor += 8 + ((len + 7) & ~7U);
}

/* Parse the first @len bytes of img from an exact-size heap copy, so that
 * AddressSanitizer catches any read past @len. */
static int parse_img(size_t len, struct qcow2_header *h, const char **err)
{
	u8 *copy = malloc(len ? len : 1);
	int ret;

	memcpy(copy, img, len);
	*err = NULL;
	ret = qcow2_header_parse(copy, len, h, err);
	free(copy);
	return ret;
}

static void expect_err(const char *file, int line, size_t len,
		       const char *msg)
{
	struct qcow2_header h;
	const char *err;
	int ret = parse_img(len, &h, &err);

	if (check_eq(file, line, "parse ret", "-EINVAL", (u64)ret,
		     (u64)-EINVAL))
		check_str(file, line, "parse error", err, msg);
}

static bool expect_ok(const char *file, int line, size_t len,
		      struct qcow2_header *h)
{
	const char *err;
	int ret = parse_img(len, h, &err);

	if (!ret)
		return true;
	fail_at(file, line, "parse refused a valid header: %d \"%s\"", ret,
		err ? err : "(null)");
	return false;
}

/* Parse img[0..len) and expect the error @msg. */
#define PARSE_ERR(len, msg) expect_err(__FILE__, __LINE__, (len), (msg))
/* Parse img[0..len) and expect success; evaluates to true on success. */
#define PARSE_OK(len, h) expect_ok(__FILE__, __LINE__, (len), (h))
/* Build @s, parse one cluster, expect @msg. */
#define REJECT(s, msg) do { \
	struct spec s_ = (s); \
	PARSE_ERR(build(&s_), (msg)); \
} while (0)
/* Build @s, parse one cluster, expect success. */
#define ACCEPT(s) do { \
	struct spec s_ = (s); \
	struct qcow2_header h_; \
	PARSE_OK(build(&s_), &h_); \
} while (0)

/* Error strings of dm-qcow2-format.c, spelled out once */
#define E_SMALL		"Image too small for a qcow2 header"
#define E_MAGIC		"Not a qcow2 image (bad magic)"
#define E_VERSION	"Unsupported qcow2 version (not 2 or 3)"
#define E_CBITS		"Cluster size out of range (cluster_bits not 9..21)"
#define E_HLEN_SMALL	"Header length too small for version 3"
#define E_HLEN_BIG	"Header length larger than one cluster"
#define E_HLEN_PAST	"Header runs past the end of the image"
#define E_BACK_OFF	"Backing file name offset outside the first cluster"
#define E_BACK_LONG	"Backing file name too long (max 1023 bytes)"
#define E_BACK_PAST	"Backing file name runs past the first cluster"
#define E_INCOMPAT	"Unknown incompatible feature bits set"
#define E_RC_ORDER	"Refcount width too large (refcount_order > 6)"
#define E_CRYPT		"Unknown encryption method"
#define E_COMP_TYPE	"Unknown compression type"
#define E_COMP_NOBIT	"Compression type set but incompatible bit 3 clear"
#define E_COMP_DEFL	"Incompatible bit 3 set but compression type is deflate"
#define E_EXTL2		"Extended L2 needs clusters of 16 KiB or more"
#define E_RT_NONE	"Image has no refcount table"
#define E_RT_BIG	"Refcount table too large (max 8 MiB)"
#define E_RT_ALIGN	"Refcount table offset not cluster aligned"
#define E_RT_OFF	"Refcount table offset too large"
#define E_SN_MANY	"Too many snapshots (max 65536)"
#define E_SN_ALIGN	"Snapshot table offset not cluster aligned"
#define E_SN_OFF	"Snapshot table offset too large"
#define E_L1_BIG	"L1 table too large (max 32 MiB)"
#define E_L1_ALIGN	"L1 table offset not cluster aligned"
#define E_L1_OFF	"L1 table offset too large"
#define E_L1_SMALL	"L1 table too small for the virtual size"
#define E_EXT_PAST	"Header extension runs past its area"
#define E_BFMT_LONG	"Backing format extension too long"
#define E_CRYPTO_NOLUKS	"Encryption header extension without LUKS encryption"
#define E_CRYPTO_LEN	"Encryption header extension has a bad length"
#define E_LUKS_NOEXT	"LUKS encryption without its header extension"
#define E_BITMAPS_LEN	"Bitmaps extension has a bad length"
#define E_LAY_RT_HDR	"Refcount table overlaps the header"
#define E_LAY_RT_END	"Refcount table runs past the end of the image"
#define E_LAY_L1_HDR	"L1 table overlaps the header"
#define E_LAY_L1_RT	"L1 table overlaps the refcount table"
#define E_LAY_L1_END	"L1 table runs past the end of the image"
#define E_L1E_RSVD	"L1 entry has reserved bits set"
#define E_L1E_ALIGN	"L2 table offset not cluster aligned"
#define E_L2E_RSVD	"L2 entry has reserved bits set"
#define E_L2E_ALIGN	"Data cluster offset not cluster aligned"
#define E_L2E_ZERO_V2	"Zero cluster flag in a version 2 image"
#define E_L2E_ZERO_EXT	"Zero cluster flag with extended L2"
#define E_L2E_COMP_COP	"Compressed cluster with the COPIED flag"
#define E_L2E_COMP_BMP	"Compressed cluster with a subcluster bitmap"
#define E_L2E_COMP_0	"Compressed cluster at offset 0"
#define E_SC_BOTH	"Subcluster both allocated and zero"
#define E_SC_UNALLOC	"Allocated subclusters without a host cluster"
#define E_RTE_RSVD	"Refcount table entry has reserved bits set"
#define E_RTE_ALIGN	"Refcount block offset not cluster aligned"
#define E_RTE_BIG	"Refcount block offset beyond 2^56"

/* ------------------------------------------------------------------ */
/* Header: valid images and derived fields                              */
/* ------------------------------------------------------------------ */

static void test_v3_valid(void)
{
	struct spec s = v3();
	struct qcow2_header h;

	s.compat = QCOW2_COMPAT_LAZY_REFCOUNTS;
	s.autoclear = QCOW2_AUTOCLEAR_DATA_FILE_RAW;
	s.nb_snap = 2;
	s.snap_off = 5 * C64K;
	if (!PARSE_OK(build(&s), &h))
		return;
	CHECK_EQ(h.version, 3);
	CHECK_EQ(h.backing_file_offset, 0);
	CHECK_EQ(h.cluster_bits, 16);
	CHECK_EQ(h.size, GiB);
	CHECK_EQ(h.crypt_method, 0);
	CHECK_EQ(h.l1_size, 2);
	CHECK_EQ(h.l1_table_offset, 3 * C64K);
	CHECK_EQ(h.refcount_table_offset, C64K);
	CHECK_EQ(h.refcount_table_clusters, 1);
	CHECK_EQ(h.nb_snapshots, 2);
	CHECK_EQ(h.snapshots_offset, 5 * C64K);
	CHECK_EQ(h.incompatible_features, 0);
	CHECK_EQ(h.compatible_features, QCOW2_COMPAT_LAZY_REFCOUNTS);
	CHECK_EQ(h.autoclear_features, QCOW2_AUTOCLEAR_DATA_FILE_RAW);
	CHECK_EQ(h.refcount_order, 4);
	CHECK_EQ(h.header_length, 112);
	CHECK_EQ(h.compression_type, 0);
	CHECK_EQ(h.extensions, 0);
	CHECK_EQ(h.cluster_size, C64K);
	CHECK_EQ(h.l2_bits, 13);
	CHECK_EQ(h.l2_entry_size, 8);
	CHECK(!h.extended_l2);
}

static void test_v2_valid(void)
{
	struct spec s = v2();
	struct qcow2_header h;

	if (!PARSE_OK(build(&s), &h))
		return;
	CHECK_EQ(h.version, 2);
	CHECK_EQ(h.refcount_order, 4);
	CHECK_EQ(h.header_length, QCOW2_V2_HEADER_LEN);
	CHECK_EQ(h.incompatible_features, 0);
	CHECK_EQ(h.compression_type, 0);
	CHECK_EQ(h.l2_bits, 13);
	CHECK_EQ(h.l2_entry_size, 8);
	CHECK_EQ(h.cluster_size, C64K);
	CHECK_EQ(h.l1_size, 2);
}

/* Version 2 has no fields past byte 72: whatever follows the end marker
 * there must not be read as feature bits, refcount order or length. */
static void test_v2_ignores_v3_fields(void)
{
	struct spec s = v2();
	struct qcow2_header h;
	size_t len = build(&s);

	memset(img + 80, 0xff, 32);	/* bytes 72..79 stay an end marker */
	if (!PARSE_OK(len, &h))
		return;
	CHECK_EQ(h.incompatible_features, 0);
	CHECK_EQ(h.autoclear_features, 0);
	CHECK_EQ(h.refcount_order, 4);
	CHECK_EQ(h.header_length, 72);
	CHECK_EQ(h.compression_type, 0);
}

/* Version 2 extensions start right after the 72-byte header. */
static void test_v2_extensions(void)
{
	struct spec s = v2();
	struct qcow2_header h;
	size_t len = build(&s);

	ext_add(QCOW2_EXT_BACKING_FORMAT, "raw", 3);
	if (!PARSE_OK(len, &h))
		return;
	CHECK_EQ(h.extensions, QCOW2_HAS_BACKING_FORMAT);
	CHECK_EQ(h.backing_format_offset, 80);
	CHECK_EQ(h.backing_format_len, 3);
}

static void test_probe(void)
{
	struct spec s = v3();
	const char *err = NULL;
	u32 cs = 0;

	build(&s);
	CHECK_EQ(qcow2_header_probe(img, QCOW2_HEADER_PROBE_LEN, &cs, &err), 0);
	CHECK_EQ(cs, C64K);
	s.cluster_bits = 9;
	build(&s);
	CHECK_EQ(qcow2_header_probe(img, QCOW2_HEADER_PROBE_LEN, &cs, &err), 0);
	CHECK_EQ(cs, 512);
	s.cluster_bits = 21;
	build(&s);
	CHECK_EQ(qcow2_header_probe(img, QCOW2_HEADER_PROBE_LEN, &cs, &err), 0);
	CHECK_EQ(cs, 2 * MiB);
	CHECK_EQ(qcow2_header_probe(img, QCOW2_HEADER_PROBE_LEN - 1, &cs, &err),
		 -EINVAL);
	CHECK_STR(err, E_SMALL);
	s.magic = 0;
	build(&s);
	CHECK_EQ(qcow2_header_probe(img, QCOW2_HEADER_PROBE_LEN, &cs, &err),
		 -EINVAL);
	CHECK_STR(err, E_MAGIC);
}

/* Each cluster size from 512 bytes to 2 MiB, with and without extended L2 */
static void test_derived_geometry(void)
{
	struct qcow2_header h;
	struct spec s = v3();
	u32 bits;

	s.size = 0;
	s.l1_size = 0;
	for (bits = 9; bits <= 21; bits++) {
		s.cluster_bits = bits;
		s.incompat = 0;
		s.l1_off = s.rt_off = 1ULL << bits;
		if (!PARSE_OK(build(&s), &h))
			return;
		CHECK_EQ(h.cluster_size, 1U << bits);
		CHECK_EQ(h.l2_bits, bits - 3);
		CHECK_EQ(h.l2_entry_size, 8);
		CHECK(!h.extended_l2);
		if (bits < 14)
			continue;
		s.incompat = QCOW2_INCOMPAT_EXTL2;
		if (!PARSE_OK(build(&s), &h))
			return;
		CHECK_EQ(h.l2_bits, bits - 4);
		CHECK_EQ(h.l2_entry_size, 16);
		CHECK(h.extended_l2);
	}
}

/* compression_type exists only when header_length > 104 */
static void test_compression_type_field(void)
{
	struct spec s = v3();
	struct qcow2_header h;
	size_t len;

	s.incompat = QCOW2_INCOMPAT_COMPRESSION;
	s.compression_type = QCOW2_COMPRESSION_ZSTD;
	if (PARSE_OK(build(&s), &h))
		CHECK_EQ(h.compression_type, QCOW2_COMPRESSION_ZSTD);

	/* header_length 104: byte 104 starts the extension area instead */
	s = v3();
	s.header_length = 104;
	len = build(&s);
	ext_add(0x01020304, NULL, 0);
	if (PARSE_OK(len, &h)) {
		CHECK_EQ(h.compression_type, 0);
		CHECK_EQ(h.header_length, 104);
		CHECK_EQ(h.extensions, 0);
	}
}

static void test_header_length_bounds(void)
{
	struct spec s = v3();
	struct qcow2_header h;

	s.header_length = 100;
	REJECT(s, E_HLEN_SMALL);
	s.header_length = 0;
	REJECT(s, E_HLEN_SMALL);
	s.header_length = C64K + 8;
	REJECT(s, E_HLEN_BIG);
	s.header_length = 0xffffffff;
	REJECT(s, E_HLEN_BIG);
	s.cluster_bits = 9;
	s.l1_off = s.rt_off = 512;
	s.size = 0;
	s.header_length = 520;
	REJECT(s, E_HLEN_BIG);
	/* A header filling the whole cluster leaves no extension area */
	s.header_length = 512;
	if (PARSE_OK(build(&s), &h))
		CHECK_EQ(h.header_length, 512);
	s = v3();
	s.header_length = C64K;
	ACCEPT(s);
}

/* The buffer may be shorter than a cluster when the image is. */
static void test_short_buffer(void)
{
	struct spec s = v3();
	struct qcow2_header h;

	build(&s);
	PARSE_ERR(0, E_SMALL);
	PARSE_ERR(50, E_SMALL);
	PARSE_ERR(QCOW2_V2_HEADER_LEN - 1, E_SMALL);
	PARSE_ERR(QCOW2_V3_HEADER_LEN - 1, E_SMALL);
	PARSE_ERR(111, E_HLEN_PAST);		/* header_length 112 */
	PARSE_OK(112, &h);
	s.header_length = 4096;
	build(&s);
	PARSE_ERR(2048, E_HLEN_PAST);
	PARSE_OK(4096, &h);
	/* A v2 header needs only its 72 bytes */
	s = v2();
	build(&s);
	PARSE_OK(QCOW2_V2_HEADER_LEN, &h);
}

/* ------------------------------------------------------------------ */
/* Header: rejections                                                   */
/* ------------------------------------------------------------------ */

static void test_bad_magic(void)
{
	struct spec s = v3();

	s.magic = 0x514649fa;
	REJECT(s, E_MAGIC);
	s.magic = 0xfb494651;	/* little-endian magic */
	REJECT(s, E_MAGIC);
}

static void test_bad_version(void)
{
	static const u32 bad[] = { 0, 1, 4, 0x03000000, 0xffffffff };
	struct spec s = v3();
	size_t i;

	for (i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		s.version = bad[i];
		REJECT(s, E_VERSION);
	}
}

static void test_bad_cluster_bits(void)
{
	static const u32 bad[] = { 0, 8, 22, 31, 32, 63, 64, 0xffffffff };
	struct spec s = v3();
	size_t i;

	for (i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		s.cluster_bits = bad[i];
		REJECT(s, E_CBITS);
	}
	s = v2();
	s.cluster_bits = 8;
	REJECT(s, E_CBITS);
}

static void test_backing_name(void)
{
	struct spec s = v3();
	struct qcow2_header h;
	size_t len;

	s.backing_off = C64K + 1;
	s.backing_size = 1;
	REJECT(s, E_BACK_OFF);
	s.backing_off = 1ULL << 63;
	REJECT(s, E_BACK_OFF);
	s.backing_off = 512;
	s.backing_size = 1024;
	REJECT(s, E_BACK_LONG);
	s.backing_size = 0xffffffff;
	REJECT(s, E_BACK_LONG);
	s.backing_size = 1023;
	ACCEPT(s);
	s.backing_off = C64K - 10;
	s.backing_size = 11;
	REJECT(s, E_BACK_PAST);
	s.backing_off = C64K;
	s.backing_size = 1;
	REJECT(s, E_BACK_PAST);
	/* A name that ends exactly at the end of the cluster */
	s.backing_off = C64K - 1023;
	s.backing_size = 1023;
	ACCEPT(s);
	/* With 512-byte clusters the 1023-byte limit is not the binding one */
	s = v3();
	s.cluster_bits = 9;
	s.size = 0;
	s.l1_off = s.rt_off = 512;
	s.backing_off = 400;
	s.backing_size = 113;
	REJECT(s, E_BACK_PAST);
	s.backing_size = 112;
	len = build(&s);
	memcpy(img + 400, "base.img", 8);
	if (PARSE_OK(len, &h)) {
		CHECK_EQ(h.backing_file_offset, 400);
		CHECK_EQ(h.backing_file_size, 112);
	}
	/* No backing file: the size field is ignored */
	s.backing_off = 0;
	s.backing_size = 0xffffffff;
	ACCEPT(s);
}

static void test_incompat_bits(void)
{
	struct spec s = v3();
	struct qcow2_header h;
	u32 bit;

	for (bit = 5; bit < 64; bit++) {
		s.incompat = 1ULL << bit;
		REJECT(s, E_INCOMPAT);
	}
	/* Known bits pass the parser (the target decides what it supports) */
	s.incompat = QCOW2_INCOMPAT_DIRTY | QCOW2_INCOMPAT_CORRUPT |
		     QCOW2_INCOMPAT_DATA_FILE;
	if (PARSE_OK(build(&s), &h))
		CHECK_EQ(h.incompatible_features, s.incompat);
	/* Compatible and autoclear bits are never a reason to refuse */
	s = v3();
	s.compat = ~0ULL;
	s.autoclear = ~0ULL & ~QCOW2_AUTOCLEAR_BITMAPS;
	ACCEPT(s);
}

static void test_refcount_order(void)
{
	struct spec s = v3();
	struct qcow2_header h;
	u32 order;

	for (order = 0; order <= 6; order++) {
		s.refcount_order = order;
		if (PARSE_OK(build(&s), &h))
			CHECK_EQ(h.refcount_order, order);
	}
	s.refcount_order = 7;
	REJECT(s, E_RC_ORDER);
	s.refcount_order = 0xffffffff;
	REJECT(s, E_RC_ORDER);
}

static void test_crypt_method(void)
{
	struct spec s = v3();
	struct qcow2_header h;
	size_t len;

	s.crypt = 3;
	REJECT(s, E_CRYPT);
	s.crypt = 0xffffffff;
	REJECT(s, E_CRYPT);
	s.crypt = QCOW2_CRYPT_AES;
	if (PARSE_OK(build(&s), &h))
		CHECK_EQ(h.crypt_method, QCOW2_CRYPT_AES);
	s.crypt = QCOW2_CRYPT_LUKS;
	len = build(&s);
	ext_add(QCOW2_EXT_CRYPTO, NULL, 16);
	if (PARSE_OK(len, &h)) {
		CHECK_EQ(h.crypt_method, QCOW2_CRYPT_LUKS);
		CHECK_EQ(h.extensions, QCOW2_HAS_CRYPTO);
	}
}

static void test_compression_type_rules(void)
{
	struct spec s = v3();

	s.compression_type = 2;
	REJECT(s, E_COMP_TYPE);
	s.incompat = QCOW2_INCOMPAT_COMPRESSION;
	REJECT(s, E_COMP_TYPE);
	s.compression_type = 0xff;
	REJECT(s, E_COMP_TYPE);

	s = v3();
	s.compression_type = QCOW2_COMPRESSION_ZSTD;
	REJECT(s, E_COMP_NOBIT);

	s = v3();
	s.incompat = QCOW2_INCOMPAT_COMPRESSION;
	REJECT(s, E_COMP_DEFL);
	/* Bit 3 with no compression_type field at all */
	s.header_length = 104;
	REJECT(s, E_COMP_DEFL);
}

static void test_extended_l2_cluster_size(void)
{
	struct spec s = v3();

	s.incompat = QCOW2_INCOMPAT_EXTL2;
	s.size = 0;
	s.cluster_bits = 13;
	s.l1_off = s.rt_off = 8 * KiB;
	REJECT(s, E_EXTL2);
	s.cluster_bits = 9;
	s.l1_off = s.rt_off = 512;
	REJECT(s, E_EXTL2);
	s.cluster_bits = 14;
	s.l1_off = s.rt_off = 16 * KiB;
	ACCEPT(s);
}

static void test_refcount_table_rules(void)
{
	struct spec s = v3();

	s.rt_clusters = 0;
	REJECT(s, E_RT_NONE);
	/* 8 MiB / 64 KiB = 128 clusters */
	s.rt_clusters = 128;
	ACCEPT(s);
	s.rt_clusters = 129;
	REJECT(s, E_RT_BIG);
	s.rt_clusters = 0xffffffff;
	REJECT(s, E_RT_BIG);
	/* 2 MiB clusters: 4 */
	s.cluster_bits = 21;
	s.rt_off = s.l1_off = 2 * MiB;
	s.l1_size = 1;
	s.rt_clusters = 4;
	ACCEPT(s);
	s.rt_clusters = 5;
	REJECT(s, E_RT_BIG);
	/* 512-byte clusters: 16384 */
	s = v3();
	s.cluster_bits = 9;
	s.size = 0;
	s.rt_off = s.l1_off = 512;
	s.rt_clusters = 16384;
	ACCEPT(s);
	s.rt_clusters = 16385;
	REJECT(s, E_RT_BIG);

	s = v3();
	s.rt_off = C64K + 512;
	REJECT(s, E_RT_ALIGN);
	s.rt_off = 1;
	REJECT(s, E_RT_ALIGN);
	/* The table must end at or below INT64_MAX */
	s.rt_off = (1ULL << 63) - C64K;
	REJECT(s, E_RT_OFF);
	s.rt_off = (1ULL << 63) - 2 * C64K;
	ACCEPT(s);
	s.rt_clusters = 2;
	REJECT(s, E_RT_OFF);
	s.rt_off = ~0ULL << 16;
	REJECT(s, E_RT_OFF);
}

static void test_snapshot_table_rules(void)
{
	struct spec s = v3();

	s.snap_off = 4 * C64K;
	s.nb_snap = 65536;
	ACCEPT(s);
	s.nb_snap = 65537;
	REJECT(s, E_SN_MANY);
	s.nb_snap = 0xffffffff;
	REJECT(s, E_SN_MANY);
	s.nb_snap = 1;
	s.snap_off = 4 * C64K + 8;
	REJECT(s, E_SN_ALIGN);
	/* Alignment is checked even with no snapshots, as QEMU does */
	s.nb_snap = 0;
	REJECT(s, E_SN_ALIGN);
	s.nb_snap = 65536;
	s.snap_off = (1ULL << 63) - C64K;
	REJECT(s, E_SN_OFF);
	s.nb_snap = 1;
	ACCEPT(s);
	s.snap_off = 1ULL << 63;
	REJECT(s, E_SN_OFF);
}

static void test_l1_table_rules(void)
{
	struct spec s = v3();

	s.l1_size = 4 * MiB;	/* entries: 32 MiB */
	ACCEPT(s);
	s.l1_size = 4 * MiB + 1;
	REJECT(s, E_L1_BIG);
	s.l1_size = 0xffffffff;
	REJECT(s, E_L1_BIG);
	s = v3();
	s.l1_off = 3 * C64K + 512;
	REJECT(s, E_L1_ALIGN);
	/* The table must end at or below INT64_MAX */
	s.l1_off = 1ULL << 63;
	REJECT(s, E_L1_OFF);
	s.l1_off = ~0ULL << 16;
	REJECT(s, E_L1_OFF);
	s.l1_size = C64K / 8;		/* exactly one cluster */
	s.l1_off = (1ULL << 63) - C64K;
	REJECT(s, E_L1_OFF);
	s.l1_off = (1ULL << 63) - 2 * C64K;
	ACCEPT(s);
}

/* One L1 entry covers cluster_size * l2 entries of guest space. */
static void test_l1_size_vs_virtual_size(void)
{
	struct spec s = v3();

	/* 64 KiB clusters: 512 MiB per L1 entry */
	s.size = GiB;
	s.l1_size = 2;
	ACCEPT(s);
	s.l1_size = 1;
	REJECT(s, E_L1_SMALL);
	s.size = GiB + 1;
	s.l1_size = 2;
	REJECT(s, E_L1_SMALL);
	s.l1_size = 3;
	ACCEPT(s);
	s.size = 1;
	s.l1_size = 1;
	ACCEPT(s);
	s.l1_size = 0;
	REJECT(s, E_L1_SMALL);
	s.size = 0;
	ACCEPT(s);

	/* Extended L2 halves the coverage: 256 MiB per entry */
	s = v3();
	s.incompat = QCOW2_INCOMPAT_EXTL2;
	s.size = GiB;
	s.l1_size = 4;
	ACCEPT(s);
	s.l1_size = 3;
	REJECT(s, E_L1_SMALL);

	/* 512-byte clusters: 32 KiB per entry */
	s = v3();
	s.cluster_bits = 9;
	s.l1_off = s.rt_off = 512;
	s.size = 64 * KiB;
	s.l1_size = 2;
	ACCEPT(s);
	s.l1_size = 1;
	REJECT(s, E_L1_SMALL);

	/* 2 MiB clusters, largest L1: 4 Mi entries of 2^39 bytes = 2^61 */
	s = v3();
	s.cluster_bits = 21;
	s.l1_off = s.rt_off = 2 * MiB;
	s.l1_size = 4 * MiB;
	s.size = 1ULL << 61;
	ACCEPT(s);
	s.size = (1ULL << 61) + 1;
	REJECT(s, E_L1_SMALL);
}

/* Sizes at and above 2^63 must fail the L1 check, not wrap around. */
static void test_huge_virtual_size(void)
{
	static const u64 sizes[] = { 1ULL << 63, (1ULL << 63) + 1, ~0ULL,
				     ~0ULL - 511 };
	struct spec s = v3();
	size_t i;

	s.l1_size = 4 * MiB;
	for (i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
		s.size = sizes[i];
		REJECT(s, E_L1_SMALL);
	}
	s.cluster_bits = 21;
	s.l1_off = s.rt_off = 2 * MiB;
	s.size = ~0ULL;
	REJECT(s, E_L1_SMALL);
}

/* ------------------------------------------------------------------ */
/* Header extensions                                                    */
/* ------------------------------------------------------------------ */

static void test_ext_past_area(void)
{
	struct spec s = v3();
	struct qcow2_header h;
	size_t len;

	/* Oversized length */
	len = build(&s);
	ext_add(0x12345678, NULL, 0);
	qcow2_put_be32(img + 112 + 4, C64K);
	PARSE_ERR(len, E_EXT_PAST);
	/* Exactly filling the rest of the cluster is fine */
	qcow2_put_be32(img + 112 + 4, C64K - 120);
	PARSE_OK(len, &h);
	qcow2_put_be32(img + 112 + 4, C64K - 119);
	PARSE_ERR(len, E_EXT_PAST);
	qcow2_put_be32(img + 112 + 4, 0xffffffff);
	PARSE_ERR(len, E_EXT_PAST);

	/* Truncated 8-byte header: 4 bytes left before the backing name */
	s.backing_off = 116;
	s.backing_size = 4;
	len = build(&s);
	memset(img + 112, 0xee, 4);	/* not an end marker */
	PARSE_ERR(len, E_EXT_PAST);

	/* ... or before the end of a short image */
	s = v3();
	len = build(&s);
	memset(img + 112, 0xee, 8);
	PARSE_ERR(116, E_EXT_PAST);
	PARSE_OK(112, &h);

	/* The backing file name bounds the area */
	s.backing_off = 128;
	s.backing_size = 8;
	len = build(&s);
	ext_add(0x12345678, NULL, 8);
	if (PARSE_OK(len, &h))
		CHECK_EQ(h.extensions, 0);
	qcow2_put_be32(img + 116, 9);
	PARSE_ERR(len, E_EXT_PAST);
}

static void test_ext_backing_format(void)
{
	struct spec s = v3();
	struct qcow2_header h;
	size_t len;

	len = build(&s);
	ext_add(QCOW2_EXT_BACKING_FORMAT, "0123456789abcdef", 16);
	PARSE_ERR(len, E_BFMT_LONG);
	len = build(&s);
	ext_add(QCOW2_EXT_BACKING_FORMAT, "0123456789abcde", 15);
	if (PARSE_OK(len, &h)) {
		CHECK_EQ(h.extensions, QCOW2_HAS_BACKING_FORMAT);
		CHECK_EQ(h.backing_format_offset, 120);
		CHECK_EQ(h.backing_format_len, 15);
	}
}

static void test_ext_crypto(void)
{
	struct spec s = v3();
	size_t len;

	len = build(&s);
	ext_add(QCOW2_EXT_CRYPTO, NULL, 16);
	PARSE_ERR(len, E_CRYPTO_NOLUKS);
	s.crypt = QCOW2_CRYPT_AES;
	len = build(&s);
	ext_add(QCOW2_EXT_CRYPTO, NULL, 16);
	PARSE_ERR(len, E_CRYPTO_NOLUKS);
	s.crypt = QCOW2_CRYPT_LUKS;
	len = build(&s);
	ext_add(QCOW2_EXT_CRYPTO, NULL, 8);
	PARSE_ERR(len, E_CRYPTO_LEN);
	len = build(&s);
	ext_add(QCOW2_EXT_CRYPTO, NULL, 24);
	PARSE_ERR(len, E_CRYPTO_LEN);
	/* LUKS without the extension */
	len = build(&s);
	PARSE_ERR(len, E_LUKS_NOEXT);
	/* ... or with it hidden behind the end marker */
	ext_add(QCOW2_EXT_END, NULL, 0);
	ext_add(QCOW2_EXT_CRYPTO, NULL, 16);
	PARSE_ERR(len, E_LUKS_NOEXT);
}

static void test_ext_bitmaps(void)
{
	struct spec s = v3();
	struct qcow2_header h;
	size_t len;

	s.autoclear = QCOW2_AUTOCLEAR_BITMAPS;
	len = build(&s);
	ext_add(QCOW2_EXT_BITMAPS, NULL, 16);
	PARSE_ERR(len, E_BITMAPS_LEN);
	len = build(&s);
	ext_add(QCOW2_EXT_BITMAPS, NULL, 24);
	if (PARSE_OK(len, &h))
		CHECK_EQ(h.extensions, 0);
	/* Without the autoclear bit the extension is stale: ignored whole */
	s.autoclear = 0;
	len = build(&s);
	ext_add(QCOW2_EXT_BITMAPS, NULL, 24);
	if (PARSE_OK(len, &h))
		CHECK_EQ(h.extensions, 0);
	len = build(&s);
	ext_add(QCOW2_EXT_BITMAPS, NULL, 16);
	if (PARSE_OK(len, &h))
		CHECK_EQ(h.extensions, 0);
}

static void test_ext_known_and_unknown(void)
{
	struct spec s = v3();
	struct qcow2_header h;
	size_t len;

	len = build(&s);
	ext_add(QCOW2_EXT_BACKING_FORMAT, "raw", 3);	/* padded to 8 */
	ext_add(QCOW2_EXT_FEATURE_TABLE, NULL, 48 * 3);
	ext_add(QCOW2_EXT_DATA_FILE, "data.raw", 8);
	ext_add(0xdeadbeef, NULL, 5);
	ext_add(0x00000001, NULL, 0);
	if (PARSE_OK(len, &h)) {
		CHECK_EQ(h.extensions, QCOW2_HAS_BACKING_FORMAT);
		CHECK_EQ(h.backing_format_offset, 120);
		CHECK_EQ(h.backing_format_len, 3);
	}
	len = build(&s);
	ext_add(0xdeadbeef, NULL, 0);
	if (PARSE_OK(len, &h))
		CHECK_EQ(h.extensions, 0);
}

/* Nothing after the end marker is looked at, however bad it is. */
static void test_ext_end_marker(void)
{
	struct spec s = v3();
	struct qcow2_header h;
	size_t len;

	len = build(&s);
	ext_add(QCOW2_EXT_FEATURE_TABLE, NULL, 48);
	ext_add(QCOW2_EXT_END, NULL, 0);
	ext_add(QCOW2_EXT_BACKING_FORMAT, "0123456789abcdefgh", 18);
	ext_add(QCOW2_EXT_CRYPTO, NULL, 3);
	ext_add(0x12345678, NULL, 0);
	qcow2_put_be32(img + ext_cursor - 4, 0xffffffff);	/* its length */
	if (PARSE_OK(len, &h))
		CHECK_EQ(h.extensions, 0);
}

/* ------------------------------------------------------------------ */
/* Layout against the image size                                        */
/* ------------------------------------------------------------------ */

#define LAYOUT_OK(h, size) do { \
	const char *e_ = NULL; \
	CHECK_EQ(qcow2_header_check_layout((h), (size), &e_), 0); \
} while (0)
#define LAYOUT_ERR(h, size, msg) do { \
	const char *e_ = NULL; \
	if (CHECK_EQ(qcow2_header_check_layout((h), (size), &e_), -EINVAL)) \
		CHECK_STR(e_, (msg)); \
} while (0)

static void test_layout(void)
{
	struct spec s = v3();
	struct qcow2_header h;
	u64 l1_end = 3 * C64K + 16;

	/* Reftable at cluster 1, L1 (2 entries) at cluster 3 */
	if (!PARSE_OK(build(&s), &h))
		return;
	LAYOUT_OK(&h, l1_end);
	LAYOUT_OK(&h, 1ULL << 40);
	LAYOUT_ERR(&h, l1_end - 1, E_LAY_L1_END);
	LAYOUT_ERR(&h, 3 * C64K, E_LAY_L1_END);
	LAYOUT_ERR(&h, 2 * C64K, E_LAY_L1_END);
	LAYOUT_ERR(&h, 2 * C64K - 1, E_LAY_RT_END);
	LAYOUT_ERR(&h, 0, E_LAY_RT_END);

	/* Reftable last: exactly at the end is fine */
	s.rt_off = 4 * C64K;
	s.rt_clusters = 2;
	if (!PARSE_OK(build(&s), &h))
		return;
	LAYOUT_OK(&h, 6 * C64K);
	LAYOUT_ERR(&h, 6 * C64K - 1, E_LAY_RT_END);
	LAYOUT_ERR(&h, 4 * C64K, E_LAY_RT_END);

	/* Overlapping cluster 0 */
	s = v3();
	s.rt_off = 0;
	if (PARSE_OK(build(&s), &h))
		LAYOUT_ERR(&h, 1ULL << 30, E_LAY_RT_HDR);
	s = v3();
	s.l1_off = 0;
	if (PARSE_OK(build(&s), &h))
		LAYOUT_ERR(&h, 1ULL << 30, E_LAY_L1_HDR);
	/* An empty L1 table may sit anywhere */
	s.size = 0;
	s.l1_size = 0;
	if (PARSE_OK(build(&s), &h))
		LAYOUT_OK(&h, 2 * C64K);

	/* Offsets near INT64_MAX must not wrap the end computation */
	s = v3();
	s.rt_off = (1ULL << 63) - 2 * C64K;
	if (PARSE_OK(build(&s), &h)) {
		LAYOUT_ERR(&h, 1ULL << 30, E_LAY_RT_END);
		LAYOUT_OK(&h, ~0ULL);
	}
	s = v3();
	s.l1_off = (1ULL << 63) - 2 * C64K;
	if (PARSE_OK(build(&s), &h))
		LAYOUT_ERR(&h, 1ULL << 30, E_LAY_L1_END);

	/* The L1 and refcount tables must not share a byte */
	s = v3();
	s.l1_off = C64K;		/* the refcount table's cluster */
	if (PARSE_OK(build(&s), &h))
		LAYOUT_ERR(&h, 1ULL << 30, E_LAY_L1_RT);
	s = v3();
	s.rt_off = 2 * C64K;		/* two clusters, over the L1 table */
	s.rt_clusters = 2;
	if (PARSE_OK(build(&s), &h))
		LAYOUT_ERR(&h, 1ULL << 30, E_LAY_L1_RT);
	s = v3();
	s.rt_off = C64K;		/* two clusters, ending where L1 starts */
	s.rt_clusters = 2;
	if (PARSE_OK(build(&s), &h))
		LAYOUT_OK(&h, 1ULL << 30);
}

/* ------------------------------------------------------------------ */
/* Table entries                                                        */
/* ------------------------------------------------------------------ */

/* A parsed header with the given geometry, for the decode tests */
static struct qcow2_header geometry(u32 version, u32 cluster_bits, bool ext)
{
	struct qcow2_header h;
	struct spec s = v3();

	s.version = version;
	s.cluster_bits = cluster_bits;
	s.incompat = ext ? QCOW2_INCOMPAT_EXTL2 : 0;
	s.size = 0;
	s.l1_size = 0;
	s.l1_off = s.rt_off = 1ULL << cluster_bits;
	memset(&h, 0, sizeof(h));
	PARSE_OK(build(&s), &h);
	return h;
}

#define L1_OK(h, e, want) do { \
	const char *e_ = NULL; \
	u64 off_ = 0xbad; \
	CHECK_EQ(qcow2_l1_decode((h), (e), &off_, &e_), 0); \
	CHECK_EQ(off_, (want)); \
} while (0)
#define L1_ERR(h, e, msg) do { \
	const char *e_ = NULL; \
	u64 off_ = 0; \
	if (CHECK_EQ(qcow2_l1_decode((h), (e), &off_, &e_), -EUCLEAN)) \
		CHECK_STR(e_, (msg)); \
} while (0)

static void test_l1_decode(void)
{
	struct qcow2_header h = geometry(3, 16, false);
	struct qcow2_header h9 = geometry(3, 9, false);
	u32 bit;

	L1_OK(&h, 0, 0);
	L1_OK(&h, 0x50000, 0x50000);
	L1_OK(&h, QCOW2_OFLAG_COPIED | 0x50000, 0x50000);
	L1_OK(&h, QCOW2_OFLAG_COPIED, 0);
	L1_OK(&h, 0x00ffffffffff0000ULL, 0x00ffffffffff0000ULL);
	for (bit = 0; bit < 64; bit++) {
		if (!(QCOW2_L1_RESERVED & (1ULL << bit)))
			continue;
		L1_ERR(&h, 1ULL << bit, E_L1E_RSVD);
		L1_ERR(&h, QCOW2_OFLAG_COPIED | 0x50000 | 1ULL << bit,
		       E_L1E_RSVD);
	}
	L1_ERR(&h, 0x50200, E_L1E_ALIGN);
	L1_ERR(&h, 0x58000, E_L1E_ALIGN);
	/* With 512-byte clusters every offset is aligned */
	L1_OK(&h9, 0x50200, 0x50200);
	L1_ERR(&h9, 0x50100, E_L1E_RSVD);
}

#define L2_OK(h, e, bmp, m) do { \
	const char *e_ = NULL; \
	CHECK_EQ(qcow2_l2_decode((h), (e), (bmp), (m), &e_), 0); \
} while (0)
#define L2_ERR(h, e, bmp, msg) do { \
	const char *e_ = NULL; \
	struct qcow2_l2_map m_; \
	if (CHECK_EQ(qcow2_l2_decode((h), (e), (bmp), &m_, &e_), -EUCLEAN)) \
		CHECK_STR(e_, (msg)); \
} while (0)

static void test_l2_decode_standard(void)
{
	struct qcow2_header h = geometry(3, 16, false);
	struct qcow2_header h2 = geometry(2, 16, false);
	struct qcow2_l2_map m;
	u32 bit;

	L2_OK(&h, 0, 0, &m);
	CHECK_EQ(m.type, QCOW2_CLUSTER_UNALLOCATED);
	CHECK_EQ(m.host_offset, 0);
	CHECK(!m.copied);
	/* COPIED without an offset means nothing without a data file */
	L2_OK(&h, QCOW2_OFLAG_COPIED, 0, &m);
	CHECK_EQ(m.type, QCOW2_CLUSTER_UNALLOCATED);
	CHECK(!m.copied);

	L2_OK(&h, 0x70000, 0, &m);
	CHECK_EQ(m.type, QCOW2_CLUSTER_NORMAL);
	CHECK_EQ(m.host_offset, 0x70000);
	CHECK(!m.copied);
	L2_OK(&h, QCOW2_OFLAG_COPIED | 0x70000, 0, &m);
	CHECK_EQ(m.type, QCOW2_CLUSTER_NORMAL);
	CHECK(m.copied);
	L2_OK(&h, QCOW2_OFLAG_COPIED | 0x00ffffffffff0000ULL, 0, &m);
	CHECK_EQ(m.host_offset, 0x00ffffffffff0000ULL);
	/* Without extended L2 the bitmap argument is ignored */
	L2_OK(&h, 0x70000, ~0ULL, &m);
	CHECK_EQ(m.sc_alloc, 0);
	CHECK_EQ(m.sc_zero, 0);

	L2_OK(&h, QCOW2_OFLAG_ZERO, 0, &m);
	CHECK_EQ(m.type, QCOW2_CLUSTER_ZERO_PLAIN);
	CHECK_EQ(m.host_offset, 0);
	L2_OK(&h, QCOW2_OFLAG_ZERO | 0x70000, 0, &m);
	CHECK_EQ(m.type, QCOW2_CLUSTER_ZERO_ALLOC);
	CHECK_EQ(m.host_offset, 0x70000);
	CHECK(!m.copied);
	L2_OK(&h, QCOW2_OFLAG_COPIED | QCOW2_OFLAG_ZERO | 0x70000, 0, &m);
	CHECK_EQ(m.type, QCOW2_CLUSTER_ZERO_ALLOC);
	CHECK(m.copied);

	L2_ERR(&h2, QCOW2_OFLAG_ZERO, 0, E_L2E_ZERO_V2);
	L2_ERR(&h2, QCOW2_OFLAG_ZERO | 0x70000, 0, E_L2E_ZERO_V2);
	L2_OK(&h2, QCOW2_OFLAG_COPIED | 0x70000, 0, &m);
	CHECK_EQ(m.type, QCOW2_CLUSTER_NORMAL);

	for (bit = 0; bit < 64; bit++) {
		if (!(QCOW2_L2_RESERVED & (1ULL << bit)))
			continue;
		L2_ERR(&h, 1ULL << bit, 0, E_L2E_RSVD);
		L2_ERR(&h, QCOW2_OFLAG_COPIED | 0x70000 | 1ULL << bit, 0,
		       E_L2E_RSVD);
	}
	L2_ERR(&h, 0x70200, 0, E_L2E_ALIGN);
	L2_ERR(&h, QCOW2_OFLAG_ZERO | 0x78000, 0, E_L2E_ALIGN);
}

/* decode(cluster_bits, entry) must give @off and @len */
#define COMP(bits, e, off, len) do { \
	u64 o_ = 0; \
	u32 l_ = 0; \
	qcow2_compressed_decode((bits), (e), &o_, &l_); \
	CHECK_EQ(o_, (off)); \
	CHECK_EQ(l_, (len)); \
} while (0)

static void test_compressed_descriptor(void)
{
	const u64 C = QCOW2_OFLAG_COMPRESSED;

	/* cluster_bits 9: x = 61, one sector-count bit (bit 61) */
	COMP(9, C | 0x12345, 0x12345, 512 - 0x145);
	COMP(9, C | 1ULL << 61 | 0x12345, 0x12345, 1024 - 0x145);
	COMP(9, C | 1ULL << 61 | 0x200, 0x200, 1024);
	COMP(9, C | ((1ULL << 61) - 1), (1ULL << 61) - 1, 1);
	/* cluster_bits 16: x = 54, 8 bits of sector count */
	COMP(16, C | 5ULL << 54 | 0x123456789ULL, 0x123456789ULL,
	     6 * 512 - 0x189);
	COMP(16, C | 0xffULL << 54 | 0x40000, 0x40000, 256 * 512);
	COMP(16, C | 0x40000, 0x40000, 512);
	/* cluster_bits 21: x = 49, 13 bits of sector count */
	COMP(21, C | 0x1fffULL << 49 | ((1ULL << 49) - 1), (1ULL << 49) - 1,
	     8192 * 512 - 511);
	COMP(21, C | 3ULL << 49 | 0x200000, 0x200000, 4 * 512);
	/* Bit 63 is not part of the descriptor */
	COMP(16, QCOW2_OFLAG_COPIED | C | 0x40000, 0x40000, 512);
}

static void test_l2_decode_compressed(void)
{
	struct qcow2_header h = geometry(3, 16, false);
	struct qcow2_header h9 = geometry(3, 9, false);
	struct qcow2_header h21 = geometry(3, 21, false);
	const u64 C = QCOW2_OFLAG_COMPRESSED;
	struct qcow2_l2_map m;

	L2_OK(&h, C | 5ULL << 54 | 0x123456789ULL, 0, &m);
	CHECK_EQ(m.type, QCOW2_CLUSTER_COMPRESSED);
	CHECK_EQ(m.host_offset, 0x123456789ULL);
	CHECK_EQ(m.comp_len, 6 * 512 - 0x189);
	CHECK(!m.copied);
	L2_OK(&h9, C | 1ULL << 61 | 0x12345, 0, &m);
	CHECK_EQ(m.type, QCOW2_CLUSTER_COMPRESSED);
	CHECK_EQ(m.host_offset, 0x12345);
	CHECK_EQ(m.comp_len, 1024 - 0x145);
	L2_OK(&h21, C | 0x10ULL << 49 | 0x300001, 0, &m);
	CHECK_EQ(m.host_offset, 0x300001);
	CHECK_EQ(m.comp_len, 17 * 512 - 1);
	/* Compressed data is byte-granular: low bits are not "reserved" */
	L2_OK(&h, C | 0x1ff, 0, &m);
	CHECK_EQ(m.host_offset, 0x1ff);

	L2_ERR(&h, QCOW2_OFLAG_COPIED | C | 0x40000, 0, E_L2E_COMP_COP);
	L2_ERR(&h, C, 0, E_L2E_COMP_0);
	L2_ERR(&h, C | 7ULL << 54, 0, E_L2E_COMP_0);
}

static void test_l2_decode_extended(void)
{
	struct qcow2_header h = geometry(3, 16, true);
	const u64 C = QCOW2_OFLAG_COMPRESSED;
	struct qcow2_l2_map m;
	u32 sc;

	L2_OK(&h, 0, 0, &m);
	CHECK_EQ(m.type, QCOW2_CLUSTER_UNALLOCATED);
	/* Unallocated, every subcluster reads as zero */
	L2_OK(&h, 0, 0xffffffff00000000ULL, &m);
	CHECK_EQ(m.type, QCOW2_CLUSTER_UNALLOCATED);
	CHECK_EQ(m.sc_alloc, 0);
	CHECK_EQ(m.sc_zero, 0xffffffff);
	L2_OK(&h, QCOW2_OFLAG_COPIED | 0x70000, 0xffffffffULL, &m);
	CHECK_EQ(m.type, QCOW2_CLUSTER_NORMAL);
	CHECK(m.copied);
	CHECK_EQ(m.sc_alloc, 0xffffffff);
	CHECK_EQ(m.sc_zero, 0);
	L2_OK(&h, 0x70000, 0xffff00000000ffffULL, &m);
	CHECK_EQ(m.sc_alloc, 0x0000ffff);
	CHECK_EQ(m.sc_zero, 0xffff0000);
	/* Allocated host cluster with no subcluster in use is valid */
	L2_OK(&h, 0x70000, 0, &m);
	CHECK_EQ(m.type, QCOW2_CLUSTER_NORMAL);

	for (sc = 0; sc < QCOW2_SUBCLUSTERS; sc++) {
		u64 both = (1ULL << sc) | (1ULL << (sc + 32));

		L2_ERR(&h, 0x70000, both, E_SC_BOTH);
		L2_ERR(&h, 0, 1ULL << sc, E_SC_UNALLOC);
	}
	L2_ERR(&h, 0, ~0ULL, E_SC_BOTH);
	L2_ERR(&h, C | 0x40000, 1, E_L2E_COMP_BMP);
	L2_ERR(&h, C | 0x40000, 1ULL << 63, E_L2E_COMP_BMP);
	L2_OK(&h, C | 0x40000, 0, &m);
	CHECK_EQ(m.type, QCOW2_CLUSTER_COMPRESSED);
	L2_ERR(&h, QCOW2_OFLAG_ZERO, 0, E_L2E_ZERO_EXT);
	L2_ERR(&h, QCOW2_OFLAG_ZERO | 0x70000, 0, E_L2E_ZERO_EXT);
	L2_ERR(&h, 0x70000 | 1ULL << 56, 0, E_L2E_RSVD);
	L2_ERR(&h, 0x78000, 0, E_L2E_ALIGN);
}

#define RT_OK(h, e, want) do { \
	const char *e_ = NULL; \
	u64 off_ = 0xbad; \
	CHECK_EQ(qcow2_reftable_decode((h), (e), &off_, &e_), 0); \
	CHECK_EQ(off_, (want)); \
} while (0)
#define RT_ERR(h, e, msg) do { \
	const char *e_ = NULL; \
	u64 off_ = 0; \
	if (CHECK_EQ(qcow2_reftable_decode((h), (e), &off_, &e_), -EUCLEAN)) \
		CHECK_STR(e_, (msg)); \
} while (0)

static void test_reftable_decode(void)
{
	struct qcow2_header h = geometry(3, 16, false);
	u32 bit;

	RT_OK(&h, 0, 0);
	RT_OK(&h, 0x20000, 0x20000);
	RT_OK(&h, (1ULL << 56) - C64K, (1ULL << 56) - C64K);
	for (bit = 0; bit < 9; bit++)
		RT_ERR(&h, 0x20000 | 1ULL << bit, E_RTE_RSVD);
	RT_ERR(&h, 0x20200, E_RTE_ALIGN);
	RT_ERR(&h, 0x28000, E_RTE_ALIGN);
	RT_ERR(&h, 1ULL << 56, E_RTE_BIG);
	RT_ERR(&h, 1ULL << 63, E_RTE_BIG);
	RT_ERR(&h, ~0ULL << 16, E_RTE_BIG);
}

/* ------------------------------------------------------------------ */
/* Refcounts                                                            */
/* ------------------------------------------------------------------ */

static void test_refcount_max(void)
{
	CHECK_EQ(qcow2_refcount_max(0), 1);
	CHECK_EQ(qcow2_refcount_max(1), 3);
	CHECK_EQ(qcow2_refcount_max(2), 15);
	CHECK_EQ(qcow2_refcount_max(3), 255);
	CHECK_EQ(qcow2_refcount_max(4), 65535);
	CHECK_EQ(qcow2_refcount_max(5), 0xffffffffULL);
	CHECK_EQ(qcow2_refcount_max(6), ~0ULL);
}

/*
 * For each order and several indices: set a value in a block filled with
 * @fill, read it back, and check that no other bit of the block changed.
 */
static void refcount_roundtrip(u32 order, u8 fill)
{
	static const u64 idx[] = { 0, 1, 2, 3, 7, 8, 9, 15, 31, 63, 127 };
	u8 block[2048], before[2048];
	u32 width = 1U << order;
	u64 max = qcow2_refcount_max(order);
	u64 bit, val;
	size_t i, b;

	for (i = 0; i < sizeof(idx) / sizeof(idx[0]); i++) {
		memset(block, fill, sizeof(block));
		memcpy(before, block, sizeof(block));
		val = (0x8badf00ddeadbeefULL * (idx[i] + 1)) & max;
		qcow2_refcount_set(block, idx[i], order, val);
		CHECK_EQ(qcow2_refcount_get(block, idx[i], order), val);
		qcow2_refcount_set(block, idx[i], order, max);
		CHECK_EQ(qcow2_refcount_get(block, idx[i], order), max);
		qcow2_refcount_set(block, idx[i], order, 0);
		CHECK_EQ(qcow2_refcount_get(block, idx[i], order), 0);
		qcow2_refcount_set(block, idx[i], order, val);
		/* Neighbours keep the fill pattern */
		if (idx[i])
			CHECK_EQ(qcow2_refcount_get(block, idx[i] - 1, order),
				 qcow2_refcount_get(before, idx[i] - 1, order));
		CHECK_EQ(qcow2_refcount_get(block, idx[i] + 1, order),
			 qcow2_refcount_get(before, idx[i] + 1, order));
		/* No bit outside the entry changed */
		for (b = 0; b < sizeof(block) * 8; b++) {
			bit = (u64)idx[i] * width;
			if (b >= bit && b < bit + width)
				continue;
			if (((block[b / 8] ^ before[b / 8]) >> (b % 8)) & 1) {
				fail_at(__FILE__, __LINE__,
					"order %u index %llu: bit %zu changed",
					order, (unsigned long long)idx[i], b);
				break;
			}
		}
	}
}

static void test_refcount_roundtrip(void)
{
	u32 order;

	for (order = 0; order <= 6; order++) {
		refcount_roundtrip(order, 0x00);
		refcount_roundtrip(order, 0xff);
		refcount_roundtrip(order, 0xa5);
	}
}

static bool bytes_are(const u8 *b, const u8 *want, size_t n)
{
	return !memcmp(b, want, n);
}

/* Narrow refcounts fill each byte from its least significant bit. */
static void test_refcount_narrow_packing(void)
{
	u8 b[4];

	memset(b, 0, sizeof(b));
	qcow2_refcount_set(b, 0, 0, 1);
	qcow2_refcount_set(b, 3, 0, 1);
	qcow2_refcount_set(b, 9, 0, 1);
	qcow2_refcount_set(b, 31, 0, 1);
	CHECK(bytes_are(b, (const u8[]){ 0x09, 0x02, 0x00, 0x80 }, 4));
	CHECK_EQ(qcow2_refcount_get(b, 3, 0), 1);
	CHECK_EQ(qcow2_refcount_get(b, 4, 0), 0);

	memset(b, 0, sizeof(b));
	qcow2_refcount_set(b, 1, 1, 3);
	qcow2_refcount_set(b, 2, 1, 1);
	qcow2_refcount_set(b, 7, 1, 2);
	CHECK(bytes_are(b, (const u8[]){ 0x1c, 0x80, 0x00, 0x00 }, 4));

	memset(b, 0, sizeof(b));
	qcow2_refcount_set(b, 0, 2, 0xa);
	qcow2_refcount_set(b, 1, 2, 0x5);
	qcow2_refcount_set(b, 3, 2, 0xf);
	CHECK(bytes_are(b, (const u8[]){ 0x5a, 0xf0, 0x00, 0x00 }, 4));
	CHECK_EQ(qcow2_refcount_get(b, 0, 2), 0xa);
	CHECK_EQ(qcow2_refcount_get(b, 1, 2), 0x5);

	/* A value wider than the entry must not spill into its neighbour */
	memset(b, 0, sizeof(b));
	qcow2_refcount_set(b, 0, 0, 2);
	CHECK_EQ(b[0], 0);
	qcow2_refcount_set(b, 0, 2, 0x1f);
	CHECK(bytes_are(b, (const u8[]){ 0x0f, 0x00, 0x00, 0x00 }, 4));

	memset(b, 0, sizeof(b));
	qcow2_refcount_set(b, 2, 3, 0x7f);
	CHECK(bytes_are(b, (const u8[]){ 0x00, 0x00, 0x7f, 0x00 }, 4));
}

/* Refcounts of 8 bits and more are big-endian. */
static void test_refcount_wide_byte_order(void)
{
	u8 b[24];

	memset(b, 0, sizeof(b));
	qcow2_refcount_set(b, 1, 4, 0x1234);
	CHECK(bytes_are(b, (const u8[]){ 0, 0, 0x12, 0x34, 0 }, 5));
	memset(b, 0, sizeof(b));
	qcow2_refcount_set(b, 1, 5, 0x12345678);
	CHECK(bytes_are(b, (const u8[]){ 0, 0, 0, 0, 0x12, 0x34, 0x56, 0x78,
					 0 }, 9));
	memset(b, 0, sizeof(b));
	qcow2_refcount_set(b, 1, 6, 0x0102030405060708ULL);
	CHECK(bytes_are(b, (const u8[]){ 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4,
					 5, 6, 7, 8, 0 }, 17));
	CHECK_EQ(qcow2_refcount_get(b, 1, 6), 0x0102030405060708ULL);

	/* Reading raw bytes */
	memcpy(b, (const u8[]){ 0xde, 0xad, 0xbe, 0xef, 0x01, 0x02, 0x03, 0x04 },
	       8);
	CHECK_EQ(qcow2_refcount_get(b, 0, 3), 0xde);
	CHECK_EQ(qcow2_refcount_get(b, 1, 4), 0xbeef);
	CHECK_EQ(qcow2_refcount_get(b, 0, 5), 0xdeadbeef);
	CHECK_EQ(qcow2_refcount_get(b, 0, 6), 0xdeadbeef01020304ULL);
	/* ... and the narrow ones from the same bytes (0xde = 11011110) */
	CHECK_EQ(qcow2_refcount_get(b, 0, 0), 0);
	CHECK_EQ(qcow2_refcount_get(b, 1, 0), 1);
	CHECK_EQ(qcow2_refcount_get(b, 0, 2), 0xe);
	CHECK_EQ(qcow2_refcount_get(b, 1, 2), 0xd);
	CHECK_EQ(qcow2_refcount_get(b, 3, 1), 3);

	/* Too-wide values are truncated to the entry */
	memset(b, 0, sizeof(b));
	qcow2_refcount_set(b, 1, 4, 0xabcdef);
	CHECK(bytes_are(b, (const u8[]){ 0, 0, 0xcd, 0xef, 0 }, 5));
}

/* The last entry of a 64 KiB block, for every width */
static void test_refcount_block_end(void)
{
	static u8 block[C64K];
	u32 order;
	u64 last;

	for (order = 0; order <= 6; order++) {
		memset(block, 0, sizeof(block));
		last = (C64K * 8 >> order) - 1;
		qcow2_refcount_set(block, last, order,
				   qcow2_refcount_max(order));
		CHECK_EQ(qcow2_refcount_get(block, last, order),
			 qcow2_refcount_max(order));
		CHECK_EQ(block[C64K - 1] >> 7, 1);
		CHECK_EQ(qcow2_refcount_get(block, last - 1, order), 0);
	}
}

/* ------------------------------------------------------------------ */
/* Geometry helpers                                                     */
/* ------------------------------------------------------------------ */

static void test_geometry_helpers(void)
{
	struct qcow2_header h = geometry(3, 16, false);
	struct qcow2_header hx = geometry(3, 16, true);
	struct qcow2_header h9 = geometry(3, 9, false);
	struct qcow2_header hx21 = geometry(3, 21, true);
	u64 v;

	/* 64 KiB clusters: 8192 entries per L2, 512 MiB per L1 entry */
	CHECK_EQ(qcow2_l2_coverage(&h), 512 * MiB);
	v = 3 * 512 * MiB + 5 * C64K + 1234;
	CHECK_EQ(qcow2_l1_index(&h, v), 3);
	CHECK_EQ(qcow2_l2_index(&h, v), 5);
	CHECK_EQ(qcow2_cluster_offset(&h, v), 1234);
	CHECK_EQ(qcow2_l1_index(&h, 512 * MiB - 1), 0);
	CHECK_EQ(qcow2_l2_index(&h, 512 * MiB - 1), 8191);
	CHECK_EQ(qcow2_cluster_offset(&h, 512 * MiB - 1), C64K - 1);
	CHECK_EQ(qcow2_l1_index(&h, 512 * MiB), 1);
	CHECK_EQ(qcow2_l2_index(&h, 512 * MiB), 0);
	CHECK_EQ(qcow2_refblock_bits(&h), 15);

	/* Extended L2, 64 KiB: 4096 entries, 256 MiB per L1 entry */
	CHECK_EQ(qcow2_l2_coverage(&hx), 256 * MiB);
	CHECK_EQ(qcow2_l1_index(&hx, v), 6);
	CHECK_EQ(qcow2_l2_index(&hx, v), 5);
	CHECK_EQ(qcow2_l2_index(&hx, 256 * MiB - 1), 4095);
	CHECK_EQ(qcow2_l1_index(&hx, 256 * MiB), 1);
	CHECK_EQ(qcow2_cluster_offset(&hx, v), 1234);

	/* 512-byte clusters: 64 entries, 32 KiB per L1 entry */
	CHECK_EQ(qcow2_l2_coverage(&h9), 32 * KiB);
	v = 7 * 32 * KiB + 63 * 512 + 511;
	CHECK_EQ(qcow2_l1_index(&h9, v), 7);
	CHECK_EQ(qcow2_l2_index(&h9, v), 63);
	CHECK_EQ(qcow2_cluster_offset(&h9, v), 511);
	CHECK_EQ(qcow2_refblock_bits(&h9), 8);

	/* 2 MiB clusters, extended: 131072 entries, 256 GiB per L1 entry */
	CHECK_EQ(qcow2_l2_coverage(&hx21), 256 * GiB);
	v = (1ULL << 61) - 1;
	CHECK_EQ(qcow2_l1_index(&hx21, v), (1ULL << 23) - 1);
	CHECK_EQ(qcow2_l2_index(&hx21, v), 131071);
	CHECK_EQ(qcow2_cluster_offset(&hx21, v), 2 * MiB - 1);

	h.refcount_order = 0;
	CHECK_EQ(qcow2_refblock_bits(&h), 19);
	h.refcount_order = 6;
	CHECK_EQ(qcow2_refblock_bits(&h), 13);
}

static void test_byte_order_helpers(void)
{
	u8 b[8];

	qcow2_put_be64(b, 0x0102030405060708ULL);
	CHECK(bytes_are(b, (const u8[]){ 1, 2, 3, 4, 5, 6, 7, 8 }, 8));
	CHECK_EQ(qcow2_get_be64(b), 0x0102030405060708ULL);
	CHECK_EQ(qcow2_get_be32(b + 4), 0x05060708);
	qcow2_put_be32(b, 0xfffefdfc);
	CHECK(bytes_are(b, (const u8[]){ 0xff, 0xfe, 0xfd, 0xfc }, 4));
	CHECK_EQ(qcow2_get_be32(b), 0xfffefdfc);
}

/* ------------------------------------------------------------------ */
/* Robustness: random corruption of a valid header                      */
/* ------------------------------------------------------------------ */

static u64 rng_state = 0x9e3779b97f4a7c15ULL;

static u64 rng(void)
{
	/* xorshift64 */
	rng_state ^= rng_state << 13;
	rng_state ^= rng_state >> 7;
	rng_state ^= rng_state << 17;
	return rng_state;
}

/* Whatever bytes it sees, parse must either refuse with -EINVAL and a
 * message, or return a header whose invariants hold. ASan/UBSan watch
 * for out-of-bounds reads, bad shifts and overflow. */
static void test_random_headers(void)
{
	struct spec s = v3();
	struct qcow2_header h;
	const char *err;
	int i, j, ret;
	size_t len;

	for (i = 0; i < 20000; i++) {
		s.cluster_bits = 9 + rng() % 4;	/* 512 .. 4096 */
		s.size = 0;
		len = build(&s);
		ext_add(QCOW2_EXT_BACKING_FORMAT, "qcow2", 5);
		ext_add(QCOW2_EXT_FEATURE_TABLE, NULL, 48);
		for (j = 0; j < 1 + (int)(rng() % 6); j++)
			img[rng() % 160] ^= (u8)(1U << (rng() % 8));
		if (rng() % 4 == 0)
			len = rng() % (len + 1);
		ret = parse_img(len, &h, &err);
		if (ret) {
			CHECK_EQ(ret, -EINVAL);
			CHECK(err != NULL);
			continue;
		}
		CHECK(h.version == 2 || h.version == 3);
		CHECK(h.cluster_bits >= 9 && h.cluster_bits <= 21);
		CHECK(h.header_length <= h.cluster_size);
		CHECK(h.header_length <= len);
		CHECK(h.refcount_order <= 6);
		CHECK(h.l1_size <= 4 * MiB);
		CHECK(!(h.incompatible_features & ~QCOW2_INCOMPAT_KNOWN));
		CHECK(h.backing_format_offset + h.backing_format_len <= len);
		if (checks_failed)
			return;
	}
}

/* ------------------------------------------------------------------ */

#define T(fn) { #fn + 5, fn }	/* name without the "test_" prefix */

/* ------------------------------------------------------------------ */
/* Snapshot table entries                                               */
/* ------------------------------------------------------------------ */

/* An entry: L1 at @l1 with @l1_size entries, @extra bytes, id "1", name "snap". */
static u32 build_snapshot(u8 *b, u64 l1, u32 l1_size, u32 extra, u64 disk)
{
	u32 len;

	memset(b, 0, 256);
	qcow2_put_be64(b, l1);
	qcow2_put_be32(b + 8, l1_size);
	b[13] = 1;
	b[15] = 4;
	qcow2_put_be32(b + 36, extra);
	if (extra >= 16)
		qcow2_put_be64(b + 48, disk);
	memcpy(b + 40 + extra, "1snap", 5);
	len = 40 + extra + 5;
	return (len + 7) & ~7U;
}

static void test_snapshot_entry(void)
{
	struct spec s = v3();
	struct qcow2_header h;
	struct qcow2_snapshot sn;
	const char *err = NULL;
	u8 b[256];
	u32 len, want;

	if (!PARSE_OK(build(&s), &h))
		return;
	want = build_snapshot(b, 7 * C64K, 2, 16, 2 * GiB);
	CHECK_EQ(qcow2_snapshot_entry_len(b, &len, &err), 0);
	CHECK_EQ(len, want);
	CHECK_EQ(len, 64);
	CHECK_EQ(qcow2_snapshot_parse(&h, b, len, &sn, &err), 0);
	CHECK_EQ(sn.l1_table_offset, 7 * C64K);
	CHECK_EQ(sn.l1_size, 2);
	CHECK_EQ(sn.disk_size, 2 * GiB);
	CHECK_EQ(sn.id_len, 1);
	CHECK_EQ(sn.name_len, 4);
	CHECK(!memcmp(b + sn.id_off, "1", 1));
	CHECK(!memcmp(b + sn.name_off, "snap", 4));

	/* The last entry of a table: its padding may be missing */
	CHECK_EQ(qcow2_snapshot_parse(&h, b, 40 + 16 + 5, &sn, &err), 0);
	CHECK_EQ(qcow2_snapshot_parse(&h, b, 40 + 16 + 4, &sn, &err), -EINVAL);
	CHECK_STR(err, "Snapshot table entry truncated");

	/* No disk size recorded in short extra data */
	len = build_snapshot(b, 7 * C64K, 2, 8, 0);
	CHECK_EQ(qcow2_snapshot_parse(&h, b, len, &sn, &err), 0);
	CHECK_EQ(sn.disk_size, 0);
}

static void test_snapshot_entry_bad(void)
{
	struct spec s = v3();
	struct qcow2_header h;
	struct qcow2_snapshot sn;
	const char *err = NULL;
	u8 b[256];
	u32 len;

	if (!PARSE_OK(build(&s), &h))
		return;
	len = build_snapshot(b, 7 * C64K + 512, 2, 16, GiB);
	CHECK_EQ(qcow2_snapshot_parse(&h, b, len, &sn, &err), -EINVAL);
	CHECK_STR(err, "Snapshot L1 table offset not aligned or too large");
	len = build_snapshot(b, 7 * C64K, 0x4000000, 16, GiB);
	CHECK_EQ(qcow2_snapshot_parse(&h, b, len, &sn, &err), -EINVAL);
	CHECK_STR(err, "Snapshot L1 table too large (max 32 MiB)");
	len = build_snapshot(b, 7 * C64K, 2, 16, GiB);
	CHECK_EQ(qcow2_snapshot_parse(&h, b, len - 8, &sn, &err), -EINVAL);
	CHECK_STR(err, "Snapshot table entry truncated");
	qcow2_put_be32(b + 36, 1025);
	CHECK_EQ(qcow2_snapshot_entry_len(b, &len, &err), -EINVAL);
	CHECK_STR(err, "Snapshot extra data too large (max 1024 bytes)");
	len = build_snapshot(b, 7 * C64K, 2, 16, 1ULL << 63);
	CHECK_EQ(qcow2_snapshot_parse(&h, b, len, &sn, &err), -EINVAL);
	CHECK_STR(err, "Snapshot virtual size too large");
}

static const struct test tests[] = {
	T(test_v3_valid),
	T(test_snapshot_entry),
	T(test_snapshot_entry_bad),
	T(test_v2_valid),
	T(test_v2_ignores_v3_fields),
	T(test_v2_extensions),
	T(test_probe),
	T(test_derived_geometry),
	T(test_compression_type_field),
	T(test_header_length_bounds),
	T(test_short_buffer),
	T(test_bad_magic),
	T(test_bad_version),
	T(test_bad_cluster_bits),
	T(test_backing_name),
	T(test_incompat_bits),
	T(test_refcount_order),
	T(test_crypt_method),
	T(test_compression_type_rules),
	T(test_extended_l2_cluster_size),
	T(test_refcount_table_rules),
	T(test_snapshot_table_rules),
	T(test_l1_table_rules),
	T(test_l1_size_vs_virtual_size),
	T(test_huge_virtual_size),
	T(test_ext_past_area),
	T(test_ext_backing_format),
	T(test_ext_crypto),
	T(test_ext_bitmaps),
	T(test_ext_known_and_unknown),
	T(test_ext_end_marker),
	T(test_layout),
	T(test_l1_decode),
	T(test_l2_decode_standard),
	T(test_compressed_descriptor),
	T(test_l2_decode_compressed),
	T(test_l2_decode_extended),
	T(test_reftable_decode),
	T(test_refcount_max),
	T(test_refcount_roundtrip),
	T(test_refcount_narrow_packing),
	T(test_refcount_wide_byte_order),
	T(test_refcount_block_end),
	T(test_geometry_helpers),
	T(test_byte_order_helpers),
	T(test_random_headers),
};

int main(void)
{
	int passed = 0, failed = 0;
	size_t i;

	for (i = 0; i < sizeof(tests) / sizeof(tests[0]); i++) {
		checks_failed = 0;
		tests[i].fn();
		if (!checks_failed) {
			printf("PASS %s\n", tests[i].name);
			passed++;
			continue;
		}
		if (checks_failed > 1)
			printf("FAIL %s: %s (and %d more failed checks)\n",
			       tests[i].name, first_failure, checks_failed - 1);
		else
			printf("FAIL %s: %s\n", tests[i].name, first_failure);
		failed++;
	}
	printf("%d passed, %d failed\n", passed, failed);
	return failed ? 1 : 0;
}
