// SPDX-License-Identifier: GPL-2.0-only
/*
 * dm-qcow2: memory for the I/O paths.
 *
 * A write must complete while memory is short, and while the memory it
 * would free can only be freed by writes through this very device (swap
 * on it, or a file system's writeback). So what one write needs comes
 * from reserves made when the table is loaded, never from a wait on
 * reclaim alone:
 *  - per-bio state: dm's per-bio data (the target's per_io_data_size);
 *  - bios to the image: a bio_set per image device, each bio submitted
 *    before the next is allocated (dm-qcow2-io.c);
 *  - buffers, segment arrays and the like: pools (struct qcow2_pool, a
 *    mempool of fixed-size elements), sized for one cluster. The
 *    allocator is tried first; an element of the reserve is taken when it
 *    fails, and a caller that finds the reserve empty waits for an
 *    element to come back, which the holder of that element gives back
 *    without waiting for anything but I/O. Larger buffers (batches, reads
 *    through a buffer of up to 4 MiB) are optional: when the allocator
 *    fails, the caller serves the request a cluster at a time;
 *  - metadata slices: a spare list in the slice cache (dm-qcow2-cache.c);
 *  - compressed clusters: buffers made with the table (dm-qcow2-zip.c).
 *
 * Fault injection: with CONFIG_FAULT_INJECTION_DEBUG_FS, the directory
 * fail_dm_qcow2 in debugfs is a fault_attr (probability, interval, times,
 * space, verbose: see Documentation/fault-injection/) that fails the
 * target's own allocations in its I/O paths (those through this file and
 * the slice cache's, made without __GFP_IO), the way failslab fails
 * kmalloc: a test shows that the reserves keep every write going.
 */
#include <linux/debugfs.h>
#include <linux/gfp.h>
#include <linux/mempool.h>
#include <linux/slab.h>
/* Not self-contained in 6.1: after the types it uses */
#include <linux/fault-inject.h>

#include "dm-qcow2.h"

#ifdef CONFIG_FAULT_INJECTION
static DECLARE_FAULT_ATTR(fail_alloc);
static struct dentry *fail_dir;

/*
 * Must an allocation of @size bytes fail (a test asks)? Only those of the
 * I/O paths, which never allow I/O (@gfp without __GFP_IO): not the
 * table's construction (GFP_KERNEL).
 */
bool qcow2_alloc_fails(size_t size, gfp_t gfp)
{
	return !(gfp & __GFP_IO) && should_fail(&fail_alloc, size);
}

int qcow2_mem_init(void)
{
#ifdef CONFIG_FAULT_INJECTION_DEBUG_FS
	fail_dir = fault_create_debugfs_attr("fail_dm_qcow2", NULL, &fail_alloc);
	if (IS_ERR(fail_dir))
		fail_dir = NULL;	/* no debugfs: nothing to inject */
#endif
	return 0;
}

void qcow2_mem_exit(void)
{
	debugfs_remove_recursive(fail_dir);
}
#else
bool qcow2_alloc_fails(size_t size, gfp_t gfp)
{
	return false;
}

int qcow2_mem_init(void)
{
	return 0;
}

void qcow2_mem_exit(void)
{
}
#endif

/*
 * kvmalloc() for the I/O paths. With QCOW2_GFP_TRY the caller has a
 * slower way when it fails.
 */
void *qcow2_kvmalloc(size_t size, gfp_t gfp)
{
	if (qcow2_alloc_fails(size, gfp))
		return NULL;
	return kvmalloc(size, gfp);
}

void *qcow2_kmalloc_array(size_t n, size_t size, gfp_t gfp)
{
	if (qcow2_alloc_fails(n * size, gfp))
		return NULL;
	return kmalloc_array(n, size, gfp);
}

static void *pool_alloc(gfp_t gfp, void *data)
{
	struct qcow2_pool *p = data;

	return qcow2_kvmalloc(p->size, gfp);
}

static void pool_free(void *element, void *data)
{
	kvfree(element);
}

/*
 * A pool of @min_nr elements of @size bytes kept in reserve. A caller
 * holds at most one element of each pool at a time, takes them in the
 * order the pools' owner documents, and gives each back without waiting
 * for anything but I/O: then a reserve of one element is enough for
 * every caller to make progress in turn.
 */
int qcow2_pool_init(struct qcow2_pool *p, unsigned int min_nr, size_t size)
{
	p->size = size;
	return mempool_init(&p->pool, min_nr, pool_alloc, pool_free, p);
}

void qcow2_pool_exit(struct qcow2_pool *p)
{
	mempool_exit(&p->pool);
}

/*
 * An element: from the allocator (without reclaim first), else from the
 * reserve, else from the allocator with reclaim (GFP_NOIO), else when one
 * comes back. Never fails; may sleep.
 */
void *qcow2_pool_get(struct qcow2_pool *p)
{
	return mempool_alloc(&p->pool, GFP_NOIO);
}

/* The same without waiting: NULL when the reserve is empty too */
void *qcow2_pool_try(struct qcow2_pool *p)
{
	return mempool_alloc(&p->pool, GFP_NOWAIT | __GFP_NOWARN);
}

void qcow2_pool_put(struct qcow2_pool *p, void *element)
{
	if (element)
		mempool_free(element, &p->pool);
}
