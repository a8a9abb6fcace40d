// SPDX-License-Identifier: GPL-2.0-only
/*
 * dm-qcow2: who else may use an image while a table serves it.
 *
 * Two guards, taken when an image (the top one or a backing one) is
 * opened and kept until it is closed:
 *
 * - Between tables of this target: a table that may write an image is
 *   refused while a table of another mapped device uses it, and a table
 *   that only reads one is refused while a table of another mapped device
 *   may write it. Tables of one mapped device (a reload: the new table is
 *   made while the old one is live) do not refuse each other.
 *
 * - Against QEMU and its tools, on image files and on the node the table
 *   names for an image on a block device (QEMU locks the node it opens):
 *   the byte-range locks QEMU's file driver (block/file-posix.c) takes.
 *   Each opener describes itself with shared open-file-description locks on
 *   one byte per permission: byte 100 + i while it holds permission i,
 *   byte 200 + i while it does not let others hold it. An opener that wants
 *   permission i must find no lock on byte 200 + i; one that does not share
 *   i must find none on byte 100 + i. As QEMU does, the locks are taken
 *   first and the others' checked after, so that of two openers racing,
 *   neither misses the other. A table that may write an image holds what a
 *   QEMU writer holds and shares what it shares; a read-only table and the
 *   backing images are locked as a QEMU reader locks them. The locks go
 *   with the file when the table closes it. Where the file system has no
 *   such locks the image is served unlocked, with a warning, as QEMU's
 *   "locking=auto" does.
 *
 * A reload of the same image does not check the QEMU locks again: the
 * live table's own locks would be taken for a stranger's. They were
 * checked when that table was loaded, and have kept out writers since.
 */

#include <linux/fs.h>
#include <linux/list.h>
#include <linux/mutex.h>
#include <linux/sched.h>

#include "dm-qcow2.h"

/* QEMU's permissions (BLK_PERM_*) and where their lock bytes are */
#define PERM_READ		BIT(0)	/* consistent read */
#define PERM_WRITE		BIT(1)
#define PERM_WRITE_UNCHANGED	BIT(2)
#define PERM_RESIZE		BIT(3)
#define PERM_BITS		4
#define LOCK_PERM_BASE		100
#define LOCK_SHARED_BASE	200

/* A QEMU writer of a qcow2 file, and a reader (its backing files too) */
#define WRITER_PERM	(PERM_READ | PERM_WRITE | PERM_WRITE_UNCHANGED | \
			 PERM_RESIZE)
#define READER_PERM	PERM_READ
#define SHARED_PERM	(PERM_READ | PERM_WRITE_UNCHANGED)

/* ti->error of a conflict: whose lock byte was found, for each bit */
static const char *const lock_held_by_other[PERM_BITS] = {
	"Image is locked by another user: cannot get the \"consistent read\" lock (is QEMU using the image?)",
	"Image is locked by another user: cannot get the \"write\" lock (is QEMU using the image?)",
	"Image is locked by another user: cannot get the \"write unchanged\" lock (is QEMU using the image?)",
	"Image is locked by another user: cannot get the \"resize\" lock (is QEMU using the image?)",
};

static const char *const lock_not_shared[PERM_BITS] = {
	"Image is locked by another user: cannot get the shared \"consistent read\" lock (is QEMU using the image?)",
	"Image is locked by another user: cannot get the shared \"write\" lock (is QEMU using the image?)",
	"Image is locked by another user: cannot get the shared \"write unchanged\" lock (is QEMU using the image?)",
	"Image is locked by another user: cannot get the shared \"resize\" lock (is QEMU using the image?)",
};

static const char in_use_written[] =
	"Image is in use: another dm-qcow2 device writes it";
static const char in_use_read[] =
	"Image is in use: another dm-qcow2 device reads it (or a chain above it)";

/*
 * Every open image of every table. io_users_lock protects the list and
 * the user, key, md and writable fields of the ios on it: a claim's check
 * and its list_add are one step, so of two tables loaded at once for one
 * image the second sees the first.
 */
static LIST_HEAD(io_users);
static DEFINE_MUTEX(io_users_lock);

/* An open-file-description lock on one byte, owned by @file */
static void lock_byte_init(struct file_lock *fl, struct file *file, loff_t off,
			   unsigned char type)
{
	locks_init_lock(fl);
	QCOW2_FL(fl, flags) = FL_POSIX | FL_OFDLCK;
	QCOW2_FL(fl, owner) = file;
	QCOW2_FL(fl, pid) = current->tgid;
	QCOW2_FL(fl, file) = file;
	QCOW2_FL(fl, type) = type;
	fl->fl_start = off;
	fl->fl_end = off;
}

static int lock_byte(struct file *file, loff_t off)
{
	struct file_lock fl;
	int r;

	lock_byte_init(&fl, file, off, F_RDLCK);
	r = vfs_lock_file(file, F_SETLK, &fl, NULL);
	locks_release_private(&fl);
	return r;
}

/* Does another open file description hold a lock on byte @off? */
static bool byte_locked(struct file *file, loff_t off)
{
	struct file_lock fl;
	bool held;

	lock_byte_init(&fl, file, off, F_WRLCK);
	/* An error: cannot tell, as when the file system has no locks */
	held = !vfs_test_lock(file, &fl) && QCOW2_FL(&fl, type) != F_UNLCK;
	locks_release_private(&fl);
	return held;
}

/* Take the bytes of @perm, and of what is not shared */
static int lock_apply(struct file *file, unsigned int perm)
{
	unsigned int i;
	int r = 0;

	for (i = 0; i < PERM_BITS && !r; i++) {
		if (perm & BIT(i))
			r = lock_byte(file, LOCK_PERM_BASE + i);
		if (!r && !(SHARED_PERM & BIT(i)))
			r = lock_byte(file, LOCK_SHARED_BASE + i);
	}
	return r;
}

static const char *lock_check(struct file *file, unsigned int perm)
{
	unsigned int i;

	for (i = 0; i < PERM_BITS; i++) {
		if (perm & BIT(i) && byte_locked(file, LOCK_SHARED_BASE + i))
			return lock_held_by_other[i];
		if (!(SHARED_PERM & BIT(i)) &&
		    byte_locked(file, LOCK_PERM_BASE + i))
			return lock_not_shared[i];
	}
	return NULL;
}

/* The image file, or the node of the image's block device */
static int lock_file(struct dm_target *ti, struct file *file, bool writable,
		     bool reload)
{
	unsigned int perm = writable ? WRITER_PERM : READER_PERM;
	const char *err;
	int r;

	r = lock_apply(file, perm);
	if (r == -ENOLCK || r == -EOPNOTSUPP || r == -EINVAL) {
		DMWARN("%s: the file system has no byte-range locks (%d): image served unlocked",
		       dm_table_device_name(ti->table), r);
		return 0;
	}
	if (r) {
		ti->error = "Image is locked by another user: cannot take QEMU's image locks";
		return r;
	}
	err = reload ? NULL : lock_check(file, perm);
	if (err) {
		ti->error = (char *)err;
		return -EBUSY;
	}
	return 0;
}

/*
 * Register @io as used by the table of @ti, and lock it. On failure
 * ti->error says why, and qcow2_io_unclaim() takes it off the list again
 * (qcow2_io_open() closes it).
 */
int qcow2_io_claim(struct dm_target *ti, struct qcow2_io *io, bool writable)
{
	struct mapped_device *md = dm_table_get_md(ti->table);
	const void *key = qcow2_io_key(io);
	bool reload = false;
	struct qcow2_io *o;
	int r = 0;

	mutex_lock(&io_users_lock);
	list_for_each_entry(o, &io_users, user) {
		if (o->key != key)
			continue;
		if (o->md == md) {
			reload = true;
			continue;
		}
		if (writable) {
			ti->error = (char *)(o->writable ? in_use_written :
					     in_use_read);
			r = -EBUSY;
			break;
		}
		if (o->writable) {
			ti->error = (char *)in_use_written;
			r = -EBUSY;
			break;
		}
	}
	if (!r) {
		io->key = key;
		io->md = md;
		io->writable = writable;
		list_add(&io->user, &io_users);
	}
	mutex_unlock(&io_users_lock);
	if (!r && (io->file || io->node))
		r = lock_file(ti, io->file ?: io->node, writable, reload);
	return r;
}

/*
 * Call @fn for each other user of @io's image: tables of the same mapped
 * device, and read-only users beside a read-only one (others are refused,
 * see qcow2_io_claim()). Under the list's mutex, which @fn must not take.
 */
void qcow2_io_for_each_sharer(struct qcow2_io *io,
			      void (*fn)(struct qcow2_io *o, void *arg),
			      void *arg)
{
	struct qcow2_io *o;

	mutex_lock(&io_users_lock);
	list_for_each_entry(o, &io_users, user)
		if (o != io && o->key == io->key)
			fn(o, arg);
	mutex_unlock(&io_users_lock);
}

void qcow2_io_unclaim(struct qcow2_io *io)
{
	if (!io->key)
		return;
	mutex_lock(&io_users_lock);
	list_del(&io->user);
	mutex_unlock(&io_users_lock);
	io->key = NULL;
}
