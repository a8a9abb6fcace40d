// SPDX-License-Identifier: GPL-2.0-only
/*
 * dm-qcow2: the metadata cache.
 *
 * L2 tables are cached in fixed-size slices (a slice is the smaller of one
 * cluster and 4 KiB), keyed by their byte offset in the image. The number
 * of slices is bounded by the cache size given in the table; when the bound
 * is reached the least recently used unpinned slice is reused.
 *
 * Refcount blocks are cached the same way; a slice's key is its offset
 * with the kind (L2 or refcount) in the low bit, so that two kinds of
 * metadata claiming the same place in a corrupt image never share a slice.
 *
 * A slice is pinned (ref > 0) while it is being loaded, read or modified.
 * A modified slice is dirty until qcow2_cache_write_dirty() has written it;
 * dirty slices sit on the dirty list and are never evicted. Only clean,
 * unpinned slices sit on the LRU list, so everything on it may be evicted.
 * When room is needed and only dirty slices could give it, the owner's
 * writeback is kicked and the caller waits.
 *
 * Memory for a load comes from the allocator without waiting on reclaim,
 * else from a spare list made with the cache (QCOW2_CACHE_SPARE slices,
 * refilled first by every slice freed), else from a slice evicted as if
 * the cache were full. The spare list and the slices it went to are never
 * fewer than QCOW2_CACHE_SPARE: a load that finds neither memory nor a
 * spare waits for one of those to be unpinned, or written back, as when
 * the cache is full. A shrinker gives clean unpinned slices back to the
 * system.
 *
 * One spinlock protects the hash, the lists, reference counts, flags,
 * slice contents and statistics; it is never held across I/O or
 * allocation.
 */
#include <linux/hash.h>
#include <linux/log2.h>
#include <linux/slab.h>

#include "dm-qcow2.h"

enum {
	SLICE_UPTODATE,		/* data is valid */
	SLICE_ERROR,		/* load failed; unhashed, freed on last put */
	SLICE_DIRTY,		/* modified since last written */
};

struct qcow2_slice {
	struct hlist_node hash;
	struct list_head lru;		/* LRU, dirty or writeback list */
	u64 key;			/* offset | kind */
	unsigned int ref;
	unsigned long flags;
	void *data;
};

static u64 slice_key(enum qcow2_slice_kind kind, u64 off)
{
	return off | kind;
}

static u64 slice_off(struct qcow2_slice *s)
{
	return s->key & ~1ULL;
}

static struct hlist_head *cache_bucket(struct qcow2_cache *c, u64 key)
{
	return &c->hash[hash_64(key, c->hash_bits)];
}

static struct qcow2_slice *cache_find(struct qcow2_cache *c, u64 key)
{
	struct qcow2_slice *s;

	hlist_for_each_entry(s, cache_bucket(c, key), hash)
		if (s->key == key)
			return s;
	return NULL;
}

/* Caller holds c->lock. A dirty slice stays on the dirty list. */
static void slice_pin(struct qcow2_slice *s)
{
	if (!s->ref++ && !test_bit(SLICE_DIRTY, &s->flags))
		list_del_init(&s->lru);
}

static void slice_release(struct qcow2_slice *s)
{
	kfree(s->data);
	kfree(s);
}

/* A slice leaves the cache: it refills the spare list first. */
static void slice_free(struct qcow2_cache *c, struct qcow2_slice *s)
{
	bool spare;

	spin_lock(&c->lock);
	spare = c->nr_spare < QCOW2_CACHE_SPARE;
	if (spare) {
		list_add(&s->lru, &c->spare);
		c->nr_spare++;
	}
	spin_unlock(&c->lock);
	if (!spare)
		slice_release(s);
	else if (wq_has_sleeper(&c->wait))
		wake_up_all(&c->wait);
}

static void cache_put(struct qcow2_cache *c, struct qcow2_slice *s)
{
	bool release = false, kick = false;

	spin_lock(&c->lock);
	if (!--s->ref) {
		if (test_bit(SLICE_ERROR, &s->flags)) {
			/* Forgotten while pinned, and changed meanwhile */
			if (test_and_clear_bit(SLICE_DIRTY, &s->flags)) {
				list_del_init(&s->lru);
				c->nr_dirty--;
			}
			c->nr_slices--;
			release = true;
		} else if (test_bit(SLICE_DIRTY, &s->flags)) {
			/*
			 * Stays on the dirty list. A loader that began to wait
			 * while every slice was pinned, none dirty, did not
			 * kick writeback: only writeback makes room now.
			 */
			kick = list_empty(&c->lru) &&
			       c->nr_slices >= c->max_slices;
		} else if (c->nr_slices > c->max_slices) {
			/* The bound was lowered (qcow2_cache_resize()) */
			hlist_del_init(&s->hash);
			c->nr_slices--;
			release = true;
		} else {
			list_add_tail(&s->lru, &c->lru);
		}
	}
	spin_unlock(&c->lock);
	if (release)
		slice_free(c, s);
	/* A loader may be waiting for a slice to become evictable */
	if (wq_has_sleeper(&c->wait)) {
		if (kick && c->kick_writeback)
			c->kick_writeback(c->owner);
		wake_up_all(&c->wait);
	}
}

/*
 * Find memory for one more slice: reuse the least recently
 * used unpinned slice, or reserve room for a new one below the bound
 * (unless @no_mem: the allocator and the spare list had none). Returns
 * the reused slice, NULL with *reserved set, or NULL when the caller must
 * wait for a slice to be unpinned.
 */
static struct qcow2_slice *cache_reclaim(struct qcow2_cache *c, bool no_mem,
					 bool *reserved)
{
	struct qcow2_slice *s;

	lockdep_assert_held(&c->lock);
	*reserved = false;
	/*
	 * Writeback failed for good: dirty slices will never leave, so go
	 * over the bound rather than wait forever; the extra slices are
	 * freed as soon as they are released (cache_put()).
	 */
	if (!no_mem && (c->nr_slices < c->max_slices ||
			(c->stuck && list_empty(&c->lru)))) {
		c->nr_slices++;
		*reserved = true;
		return NULL;
	}
	s = list_first_entry_or_null(&c->lru, struct qcow2_slice, lru);
	if (s) {
		list_del_init(&s->lru);
		hlist_del_init(&s->hash);
		c->evictions++;
	}
	return s;
}

static bool cache_can_reclaim(struct qcow2_cache *c, bool no_mem)
{
	bool ok;

	spin_lock(&c->lock);
	ok = !list_empty(&c->lru) || c->stuck ||
	     (no_mem ? c->nr_spare : c->nr_slices < c->max_slices);
	spin_unlock(&c->lock);
	return ok;
}

/* A new slice from the allocator, @gfp, or NULL */
static struct qcow2_slice *slice_new(struct qcow2_cache *c, gfp_t gfp)
{
	struct qcow2_slice *s;

	if (qcow2_alloc_fails(c->slice_size, gfp))
		return NULL;
	s = kzalloc(sizeof(*s), gfp);
	if (!s)
		return NULL;
	s->data = kmalloc(c->slice_size, gfp);
	if (!s->data) {
		kfree(s);
		return NULL;
	}
	return s;
}

/*
 * Memory for a slice to load: from the allocator without waiting for
 * much reclaim (the cache can do with fewer slices), else a spare.
 */
static struct qcow2_slice *slice_alloc(struct qcow2_cache *c)
{
	struct qcow2_slice *s = slice_new(c, QCOW2_GFP_TRY);

	if (!s) {
		spin_lock(&c->lock);
		s = list_first_entry_or_null(&c->spare, struct qcow2_slice,
					     lru);
		if (s) {
			list_del(&s->lru);
			c->nr_spare--;
		}
		spin_unlock(&c->lock);
	}
	if (s) {
		INIT_LIST_HEAD(&s->lru);
		INIT_HLIST_NODE(&s->hash);
	}
	return s;
}

/* Give back a slice that was obtained for a load that turned out needless */
static void cache_unreserve(struct qcow2_cache *c, struct qcow2_slice *s)
{
	spin_lock(&c->lock);
	c->nr_slices--;
	spin_unlock(&c->lock);
	slice_free(c, s);
	wake_up_all(&c->wait);
}

static struct qcow2_slice *cache_wait_loaded(struct qcow2_cache *c,
					     struct qcow2_slice *s)
{
	wait_event(c->wait, s->flags & (BIT(SLICE_UPTODATE) | BIT(SLICE_ERROR)));
	if (test_bit(SLICE_ERROR, &s->flags)) {
		cache_put(c, s);
		return ERR_PTR(-EIO);
	}
	return s;
}

static struct qcow2_slice *cache_load(struct qcow2_cache *c,
				      struct qcow2_slice *s)
{
	int r;

	r = qcow2_io_read_meta(c->io, s->data, c->slice_size, slice_off(s));
	spin_lock(&c->lock);
	if (r) {
		set_bit(SLICE_ERROR, &s->flags);
		hlist_del_init(&s->hash);	/* the next lookup retries */
	} else {
		set_bit(SLICE_UPTODATE, &s->flags);
	}
	spin_unlock(&c->lock);
	wake_up_all(&c->wait);
	if (r) {
		cache_put(c, s);
		return ERR_PTR(r);
	}
	return s;
}

/*
 * Return the slice at @off pinned and up to date, reading it if needed.
 * May sleep: only called from workers.
 */
static struct qcow2_slice *cache_get(struct qcow2_cache *c, u64 key)
{
	struct qcow2_slice *s, *fresh = NULL;
	bool reserved, kick, stuck, no_mem = false;

	for (;;) {
		spin_lock(&c->lock);
		s = cache_find(c, key);
		if (s) {
			slice_pin(s);
			if (test_bit(SLICE_UPTODATE, &s->flags))
				c->hits++;
			spin_unlock(&c->lock);
			if (fresh)
				cache_unreserve(c, fresh);
			return cache_wait_loaded(c, s);
		}
		if (fresh)
			break;
		fresh = cache_reclaim(c, no_mem, &reserved);
		kick = !fresh && !reserved && c->nr_dirty;
		spin_unlock(&c->lock);
		if (reserved) {
			fresh = slice_alloc(c);
			if (!fresh) {
				/* No memory: as if full, until a spare comes */
				spin_lock(&c->lock);
				c->nr_slices--;
				stuck = c->stuck;
				spin_unlock(&c->lock);
				/* Writeback failed for good: nothing comes back */
				if (stuck)
					return ERR_PTR(-ENOMEM);
				no_mem = true;
			}
		} else if (!fresh) {
			/* Full of pinned and dirty slices: writeback frees some */
			if (kick && c->kick_writeback)
				c->kick_writeback(c->owner);
			/* Memory may come back without a wake-up: look again */
			wait_event_timeout(c->wait,
					   cache_can_reclaim(c, no_mem), HZ);
			no_mem = false;
		}
	}
	/* Still under c->lock, and nobody else has this slice */
	fresh->key = key;
	fresh->flags = 0;
	fresh->ref = 1;
	hlist_add_head(&fresh->hash, cache_bucket(c, key));
	c->misses++;
	spin_unlock(&c->lock);
	return cache_load(c, fresh);
}

/*
 * Copy @len bytes at @off within the slice at @slice_off into @buf. Without
 * @can_block only a cached slice is used and -EAGAIN means a miss.
 */
int qcow2_cache_read(struct qcow2_cache *c, enum qcow2_slice_kind kind,
		     u64 slice_off, u32 off, void *buf, u32 len, bool can_block)
{
	u64 key = slice_key(kind, slice_off);
	struct qcow2_slice *s;

	spin_lock(&c->lock);
	s = cache_find(c, key);
	if (s && test_bit(SLICE_UPTODATE, &s->flags)) {
		memcpy(buf, s->data + off, len);
		if (!s->ref && !test_bit(SLICE_DIRTY, &s->flags))
			list_move_tail(&s->lru, &c->lru);
		c->hits++;
		spin_unlock(&c->lock);
		return 0;
	}
	spin_unlock(&c->lock);
	if (!can_block)
		return -EAGAIN;

	s = cache_get(c, key);
	if (IS_ERR(s))
		return PTR_ERR(s);
	spin_lock(&c->lock);
	memcpy(buf, s->data + off, len);
	spin_unlock(&c->lock);
	cache_put(c, s);
	return 0;
}

/* Pin a slice for modification; may sleep. */
struct qcow2_slice *qcow2_cache_pin(struct qcow2_cache *c,
				    enum qcow2_slice_kind kind, u64 slice_off)
{
	return cache_get(c, slice_key(kind, slice_off));
}

void qcow2_cache_unpin(struct qcow2_cache *c, struct qcow2_slice *s)
{
	cache_put(c, s);
}

/*
 * Give @fn the contents of a pinned slice to change, under the cache lock
 * (so that readers never see a torn entry), and mark the slice dirty.
 */
int qcow2_cache_modify(struct qcow2_cache *c, struct qcow2_slice *s,
		       int (*fn)(void *data, void *arg), void *arg)
{
	int r;

	spin_lock(&c->lock);
	r = fn(s->data, arg);
	if (!r && !test_and_set_bit(SLICE_DIRTY, &s->flags)) {
		/* Pinned and clean: on no list until now */
		list_add_tail(&s->lru, &c->dirty);
		c->nr_dirty++;
	}
	spin_unlock(&c->lock);
	return r;
}

/*
 * Write every dirty slice of @kind. The caller makes sure nothing modifies
 * slices meanwhile, and orders this against other writes with flushes.
 * On error the slices that were not written stay dirty.
 */
int qcow2_cache_write_dirty(struct qcow2_cache *c, enum qcow2_slice_kind kind)
{
	struct qcow2_slice *s, *tmp;
	LIST_HEAD(wb);
	int r = 0;

	spin_lock(&c->lock);
	list_for_each_entry_safe(s, tmp, &c->dirty, lru) {
		if ((s->key & 1) != kind || test_bit(SLICE_ERROR, &s->flags))
			continue;
		s->ref++;
		list_move_tail(&s->lru, &wb);
	}
	spin_unlock(&c->lock);

	list_for_each_entry_safe(s, tmp, &wb, lru) {
		if (!r)
			r = qcow2_io_write_meta(c->io, s->data, c->slice_size,
						slice_off(s));
		spin_lock(&c->lock);
		if (r) {
			list_move_tail(&s->lru, &c->dirty);
		} else {
			list_del_init(&s->lru);
			clear_bit(SLICE_DIRTY, &s->flags);
			c->nr_dirty--;
		}
		spin_unlock(&c->lock);
		cache_put(c, s);
	}
	return r;
}

/* Drop every clean, unpinned slice: the image may have changed. */
void qcow2_cache_invalidate(struct qcow2_cache *c)
{
	struct qcow2_slice *s, *tmp;
	LIST_HEAD(drop);

	spin_lock(&c->lock);
	list_for_each_entry_safe(s, tmp, &c->lru, lru) {
		hlist_del_init(&s->hash);
		list_move(&s->lru, &drop);
		c->nr_slices--;
	}
	spin_unlock(&c->lock);
	list_for_each_entry_safe(s, tmp, &drop, lru)
		slice_free(c, s);
}

/*
 * The cluster at [@off, @off + @len) was freed: its slices, of either
 * kind, describe nothing any more, and the cluster may be reused, as a
 * table or as data. They go now, dirty or not (never written back); one
 * pinned is unhashed and goes with its last user. The caller keeps
 * writeback away meanwhile (it holds meta_sem shared).
 */
void qcow2_cache_forget(struct qcow2_cache *c, u64 off, u64 len)
{
	struct qcow2_slice *s;
	LIST_HEAD(drop);
	u64 at;
	int kind;

	spin_lock(&c->lock);
	for (kind = QCOW2_SLICE_L2; kind <= QCOW2_SLICE_REFCOUNT; kind++) {
		for (at = off; at < off + len; at += c->slice_size) {
			s = cache_find(c, slice_key(kind, at));
			if (!s)
				continue;
			hlist_del_init(&s->hash);
			if (s->ref) {
				set_bit(SLICE_ERROR, &s->flags);
				continue;
			}
			if (test_and_clear_bit(SLICE_DIRTY, &s->flags))
				c->nr_dirty--;
			list_move(&s->lru, &drop);
			c->nr_slices--;
		}
	}
	spin_unlock(&c->lock);
	while ((s = list_first_entry_or_null(&drop, struct qcow2_slice, lru))) {
		list_del(&s->lru);
		slice_free(c, s);
	}
	wake_up_all(&c->wait);
}

/* Dirty slices can no longer be written (the device went read-only). */
void qcow2_cache_set_stuck(struct qcow2_cache *c)
{
	spin_lock(&c->lock);
	c->stuck = true;
	spin_unlock(&c->lock);
	wake_up_all(&c->wait);
}

/*
 * Change the memory bound. Clean unpinned slices above a lower bound go
 * now; pinned and dirty ones when they are released clean.
 */
void qcow2_cache_resize(struct qcow2_cache *c, u64 bytes)
{
	struct qcow2_slice *s, *tmp;
	LIST_HEAD(drop);

	spin_lock(&c->lock);
	c->max_slices = max_t(u64, div64_u64(bytes, c->slice_size),
			      QCOW2_CACHE_MIN_SLICES);
	list_for_each_entry_safe(s, tmp, &c->lru, lru) {
		if (c->nr_slices <= c->max_slices)
			break;
		hlist_del_init(&s->hash);
		list_move(&s->lru, &drop);
		c->nr_slices--;
		c->evictions++;
	}
	spin_unlock(&c->lock);
	list_for_each_entry_safe(s, tmp, &drop, lru)
		slice_free(c, s);
	/* Loaders waiting for room may go on with a higher bound */
	wake_up_all(&c->wait);
}

unsigned long qcow2_cache_nr_dirty(struct qcow2_cache *c)
{
	return READ_ONCE(c->nr_dirty);
}

/* ---- Test hooks ---- */

/*
 * Pin every clean, unpinned slice, as loads and changes in flight would:
 * a load that needs room waits (tests/vm/t-race.sh cache_waiter_dirty).
 * Returns how many.
 */
unsigned int qcow2_cache_test_pin(struct qcow2_cache *c)
{
	struct qcow2_slice *s, *tmp;
	unsigned int n = 0;

	spin_lock(&c->lock);
	list_for_each_entry_safe(s, tmp, &c->lru, lru) {
		s->ref++;
		list_move_tail(&s->lru, &c->test_pinned);
		n++;
	}
	spin_unlock(&c->lock);
	return n;
}

/*
 * Let them go changed (dirty, their contents as they were), as changes
 * that end while a load waits for room. The caller keeps writeback away
 * meanwhile (meta_sem shared), as for any change.
 */
void qcow2_cache_test_unpin_dirty(struct qcow2_cache *c)
{
	struct qcow2_slice *s;
	LIST_HEAD(pinned);

	spin_lock(&c->lock);
	list_splice_init(&c->test_pinned, &pinned);
	spin_unlock(&c->lock);
	while ((s = list_first_entry_or_null(&pinned, struct qcow2_slice,
					     lru))) {
		spin_lock(&c->lock);
		list_del_init(&s->lru);
		if (!test_and_set_bit(SLICE_DIRTY, &s->flags)) {
			list_add_tail(&s->lru, &c->dirty);
			c->nr_dirty++;
		}
		spin_unlock(&c->lock);
		cache_put(c, s);
	}
}

/* ---- Shrinker ---- */

static struct qcow2_cache *shrinker_cache(struct shrinker *sh)
{
#ifdef QCOW2_SHRINKER_ALLOC
	return sh->private_data;
#else
	return container_of(sh, struct qcow2_cache, shrinker_s);
#endif
}

/* Clean slices, roughly: pinned ones are counted too */
static unsigned long cache_shrink_count(struct shrinker *sh,
					struct shrink_control *sc)
{
	struct qcow2_cache *c = shrinker_cache(sh);
	unsigned long n = READ_ONCE(c->nr_slices), d = READ_ONCE(c->nr_dirty);

	return n > d ? n - d : 0;
}

/* Free the least recently used clean, unpinned slices */
static unsigned long cache_shrink_scan(struct shrinker *sh,
				       struct shrink_control *sc)
{
	struct qcow2_cache *c = shrinker_cache(sh);
	struct qcow2_slice *s, *tmp;
	unsigned long freed = 0;
	LIST_HEAD(drop);

	spin_lock(&c->lock);
	list_for_each_entry_safe(s, tmp, &c->lru, lru) {
		if (freed >= sc->nr_to_scan)
			break;
		hlist_del_init(&s->hash);
		list_move(&s->lru, &drop);
		c->nr_slices--;
		freed++;
	}
	spin_unlock(&c->lock);
	list_for_each_entry_safe(s, tmp, &drop, lru)
		slice_free(c, s);
	return freed ?: SHRINK_STOP;
}

static int cache_shrinker_add(struct qcow2_cache *c)
{
	struct shrinker *sh;

#ifdef QCOW2_SHRINKER_ALLOC
	sh = shrinker_alloc(0, "dm-qcow2-cache");
	if (!sh)
		return -ENOMEM;
	sh->private_data = c;
#else
	sh = &c->shrinker_s;
#endif
	sh->count_objects = cache_shrink_count;
	sh->scan_objects = cache_shrink_scan;
	sh->seeks = DEFAULT_SEEKS;
#ifdef QCOW2_SHRINKER_ALLOC
	shrinker_register(sh);
#else
	if (register_shrinker(sh, "dm-qcow2-cache"))
		return -ENOMEM;
#endif
	c->shrinker = sh;
	return 0;
}

static void cache_shrinker_del(struct qcow2_cache *c)
{
	if (!c->shrinker)
		return;
#ifdef QCOW2_SHRINKER_ALLOC
	shrinker_free(c->shrinker);
#else
	unregister_shrinker(c->shrinker);
#endif
	c->shrinker = NULL;
}

/* ---- Setup ---- */

int qcow2_cache_init(struct qcow2_cache *c, struct qcow2_io *io,
		     unsigned int slice_size, u64 bytes)
{
	struct qcow2_slice *s;

	memset(c, 0, sizeof(*c));
	spin_lock_init(&c->lock);
	INIT_LIST_HEAD(&c->lru);
	INIT_LIST_HEAD(&c->dirty);
	INIT_LIST_HEAD(&c->spare);
	INIT_LIST_HEAD(&c->test_pinned);
	init_waitqueue_head(&c->wait);
	c->io = io;
	c->slice_size = slice_size;
	c->max_slices = max_t(u64, div64_u64(bytes, slice_size),
			      QCOW2_CACHE_MIN_SLICES);
	/* About one bucket per slice, capped so the table stays small */
	c->hash_bits = min_t(unsigned int, ilog2(c->max_slices), 16);
	c->hash = kvcalloc(1U << c->hash_bits, sizeof(*c->hash), GFP_KERNEL);
	if (!c->hash)
		return -ENOMEM;
	while (c->nr_spare < QCOW2_CACHE_SPARE) {
		s = slice_new(c, GFP_KERNEL);
		if (!s)
			return -ENOMEM;
		list_add(&s->lru, &c->spare);
		c->nr_spare++;
	}
	return cache_shrinker_add(c);
}

/* Also after a failed qcow2_cache_init() */
void qcow2_cache_exit(struct qcow2_cache *c)
{
	struct qcow2_slice *s, *tmp;

	cache_shrinker_del(c);
	/* All I/O has finished: every slice is unpinned, clean or not */
	list_splice_init(&c->dirty, &c->lru);
	list_splice_init(&c->spare, &c->lru);
	list_splice_init(&c->test_pinned, &c->lru);
	list_for_each_entry_safe(s, tmp, &c->lru, lru)
		slice_release(s);
	c->nr_spare = 0;
	kvfree(c->hash);
	c->hash = NULL;
}

void qcow2_cache_get_stats(struct qcow2_cache *c, struct qcow2_cache_stats *st)
{
	spin_lock(&c->lock);
	st->hits = c->hits;
	st->misses = c->misses;
	st->evictions = c->evictions;
	st->slices = c->nr_slices;
	st->max_slices = c->max_slices;
	st->slice_size = c->slice_size;
	st->dirty = c->nr_dirty;
	spin_unlock(&c->lock);
}
