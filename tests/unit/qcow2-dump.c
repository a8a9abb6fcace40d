// SPDX-License-Identifier: GPL-2.0-only
/*
 * qcow2-dump: parse a qcow2 image's header with the dm-qcow2 format code
 * and print what it found as key=value lines, one per line.
 *
 *   qcow2-dump [-t] IMAGE
 *
 * The header is read the way the target reads it: a probe of
 * QCOW2_HEADER_PROBE_LEN bytes, then the first cluster (or the whole image
 * when it is shorter), then the layout check against the image size.
 * With -t the non-zero entries of the L1 and refcount tables are decoded too.
 *
 * Exit status: 0 parsed, 1 the format code refused the image (the line
 * "error=<message>" tells why, exactly as the target would show it),
 * 2 usage or I/O error.
 */
#define _FILE_OFFSET_BITS 64
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "dm-qcow2-format.h"

static int read_at(FILE *f, u64 off, void *buf, size_t len)
{
	if (fseeko(f, (off_t)off, SEEK_SET))
		return -1;
	return fread(buf, 1, len, f) == len ? 0 : -1;
}

static int refuse(const char *stage, const char *err)
{
	printf("stage=%s\nerror=%s\n", stage, err);
	return 1;
}

/* Print a string stored in cluster 0, escaping anything unprintable. */
static void print_name(const char *key, const u8 *p, u32 len)
{
	u32 i;

	printf("%s=", key);
	for (i = 0; i < len; i++) {
		if (p[i] >= 0x20 && p[i] < 0x7f && p[i] != '\\')
			putchar(p[i]);
		else
			printf("\\x%02x", p[i]);
	}
	putchar('\n');
}

/*
 * u64 is __u64 or uint64_t depending on the compat header, so every number
 * goes out through unsigned long long.
 */
static void kv(const char *key, unsigned long long v)
{
	printf("%s=%llu\n", key, v);
}

static void kv_hex(const char *key, unsigned long long v)
{
	printf("%s=0x%llx\n", key, v);
}

static void print_header(const struct qcow2_header *h, const u8 *buf,
			 size_t len)
{
	kv("version", h->version);
	printf("compat=%s\n", h->version == 2 ? "0.10" : "1.1");
	kv("backing_file_offset", h->backing_file_offset);
	kv("backing_file_size", h->backing_file_size);
	/*
	 * The parser checks the name against the first cluster, not against
	 * @len: an image shorter than one cluster can point past its end.
	 */
	if (h->backing_file_offset &&
	    h->backing_file_offset + h->backing_file_size > len)
		printf("backing_file=<past the end of the image>\n");
	else if (h->backing_file_offset)
		print_name("backing_file", buf + h->backing_file_offset,
			   h->backing_file_size);
	kv("cluster_bits", h->cluster_bits);
	kv("cluster_size", h->cluster_size);
	kv("size", h->size);
	kv("crypt_method", h->crypt_method);
	kv("l1_size", h->l1_size);
	kv("l1_table_offset", h->l1_table_offset);
	kv("refcount_table_offset", h->refcount_table_offset);
	kv("refcount_table_clusters", h->refcount_table_clusters);
	kv("nb_snapshots", h->nb_snapshots);
	kv("snapshots_offset", h->snapshots_offset);
	kv_hex("incompatible_features", h->incompatible_features);
	kv_hex("compatible_features", h->compatible_features);
	kv_hex("autoclear_features", h->autoclear_features);
	kv("refcount_order", h->refcount_order);
	kv("refcount_bits", 1ULL << h->refcount_order);
	kv("header_length", h->header_length);
	kv("compression_type", h->compression_type);
	kv_hex("extensions", h->extensions);
	if (h->extensions & QCOW2_HAS_BACKING_FORMAT)
		print_name("backing_format", buf + h->backing_format_offset,
			   h->backing_format_len);
	kv("l2_bits", h->l2_bits);
	kv("l2_entry_size", h->l2_entry_size);
	kv("extended_l2", h->extended_l2);
	kv("dirty", !!(h->incompatible_features & QCOW2_INCOMPAT_DIRTY));
	kv("corrupt", !!(h->incompatible_features & QCOW2_INCOMPAT_CORRUPT));
	kv("lazy_refcounts",
	   !!(h->compatible_features & QCOW2_COMPAT_LAZY_REFCOUNTS));
}

/* -t: decode every non-zero entry of a table of big-endian u64s. */
static int dump_table(FILE *f, const struct qcow2_header *h, const char *name,
		      u64 off, u64 count, bool is_l1)
{
	const char *err;
	u64 i, entry, dec;
	u8 raw[8];
	int ret;

	for (i = 0; i < count; i++) {
		if (read_at(f, off + i * 8, raw, 8))
			return -1;
		entry = qcow2_get_be64(raw);
		if (!entry)
			continue;
		ret = is_l1 ? qcow2_l1_decode(h, entry, &dec, &err) :
			      qcow2_reftable_decode(h, entry, &dec, &err);
		printf("%s[%llu]=0x%016llx ", name, (unsigned long long)i,
		       (unsigned long long)entry);
		if (ret)
			printf("error=%s\n", err);
		else
			printf("offset=%llu\n", (unsigned long long)dec);
	}
	return 0;
}

static int dump(FILE *f, u64 file_size, bool tables)
{
	struct qcow2_header h;
	u8 probe[QCOW2_HEADER_PROBE_LEN];
	size_t len = file_size < sizeof(probe) ? file_size : sizeof(probe);
	const char *err;
	u32 cluster_size;
	u8 *buf;
	int ret;

	if (read_at(f, 0, probe, len))
		return 2;
	if (qcow2_header_probe(probe, len, &cluster_size, &err))
		return refuse("probe", err);

	len = file_size < cluster_size ? file_size : cluster_size;
	buf = malloc(len);
	if (!buf || read_at(f, 0, buf, len)) {
		free(buf);
		return 2;
	}
	ret = qcow2_header_parse(buf, len, &h, &err);
	if (ret) {
		free(buf);
		return refuse("parse", err);
	}
	print_header(&h, buf, len);
	free(buf);
	if (qcow2_header_check_layout(&h, file_size, &err))
		return refuse("layout", err);
	if (tables &&
	    (dump_table(f, &h, "l1", h.l1_table_offset, h.l1_size, true) ||
	     dump_table(f, &h, "reftable", h.refcount_table_offset,
			((u64)h.refcount_table_clusters << h.cluster_bits) / 8,
			false)))
		return 2;
	return 0;
}

int main(int argc, char **argv)
{
	bool tables = argc == 3 && !strcmp(argv[1], "-t");
	const char *path = argv[argc - 1];
	struct stat st;
	FILE *f;
	int ret;

	if (argc != 2 && !tables) {
		fprintf(stderr, "usage: %s [-t] IMAGE\n", argv[0]);
		return 2;
	}
	f = fopen(path, "rb");
	if (!f || fstat(fileno(f), &st)) {
		perror(path);
		return 2;
	}
	ret = dump(f, (u64)st.st_size, tables);
	if (ret == 2)
		fprintf(stderr, "%s: read error\n", path);
	fclose(f);
	return ret;
}
