// SPDX-License-Identifier: GPL-2.0-only
/*
 * dm-qcow2: the image below the target, a block device or a regular file.
 *
 * This is the only file that knows which of the two it is. A block device
 * is claimed with dm_get_device() and data bios are remapped straight to
 * it. A regular file is opened by the kernel; data goes through
 * asynchronous direct-I/O kiocbs on the file, the way the loop driver does
 * it, so every request passes through the file system when it is issued
 * (no extent pre-mapping). Metadata is read synchronously, from workers.
 */
#include <linux/bio.h>
#include <linux/blkdev.h>
#include <linux/completion.h>
#include <linux/falloc.h>
#include <linux/file.h>
#include <linux/mount.h>
#include <linux/namei.h>
#include <linux/pagemap.h>
#include <linux/sched/mm.h>
#include <linux/uio.h>
#include <linux/vmalloc.h>

#include "dm-qcow2.h"
#include "dm-qcow2-trace.h"

/* ---- Opening the image ---- */

/*
 * The device node the table names, opened (not exclusively) only to hold
 * QEMU's image locks on it (dm-qcow2-lock.c): QEMU locks the node it
 * opens, and locks belong to the node's inode. Kept only if it is the
 * device dm opened; a table naming major:minor has no node. The node is
 * opened through a private clone of its mount, not the mount it was found
 * on: an open file there would keep /dev (and an initramfs's /dev, with
 * the root file system on this table) from being unmounted.
 */
static void io_open_node(struct qcow2_io *io, const char *path)
{
	struct path node, priv;
	struct vfsmount *mnt;
	struct inode *inode;
	struct file *f;

	if (path[0] != '/' || kern_path(path, LOOKUP_FOLLOW, &node))
		return;
	inode = d_inode(node.dentry);
	if (!S_ISBLK(inode->i_mode) || inode->i_rdev != io->dev->bdev->bd_dev)
		goto out;
	mnt = clone_private_mount(&node);
	f = ERR_CAST(mnt);
	if (!IS_ERR(mnt)) {
		priv.mnt = mnt;
		priv.dentry = mnt->mnt_root;
		f = dentry_open(&priv, O_RDONLY | O_NONBLOCK | O_LARGEFILE,
				current_cred());
		if (IS_ERR(f))
			kern_unmount(mnt);
	}
	if (IS_ERR(f))
		DMWARN("%s: node not locked for QEMU (%ld)", path,
		       PTR_ERR(f));
	else
		io->node = f;
out:
	path_put(&node);
}

static void io_close_node(struct qcow2_io *io)
{
	/* the private mount: the file's, and the reference cloning gave us */
	struct vfsmount *mnt;

	if (!io->node)
		return;
	mnt = io->node->f_path.mnt;
	fput(io->node);
	kern_unmount(mnt);
	io->node = NULL;
}

static int io_open_bdev(struct dm_target *ti, struct qcow2_io *io,
			const char *path, bool writable)
{
	int r;

	/* Backing images are opened read-only whatever the table's mode */
	r = dm_get_device(ti, path, writable ? dm_table_get_mode(ti->table) :
			  QCOW2_MODE_READ, &io->dev);
	if (r) {
		ti->error = "Cannot open image block device";
		return r;
	}
	io->size = bdev_nr_bytes(io->dev->bdev);
	io->lbs = bdev_logical_block_size(io->dev->bdev);
	io_open_node(io, path);
	/* Metadata and worker-written data: see io_bdev_add() */
	r = bioset_init(&io->bs, BIO_POOL_SIZE, 0, BIOSET_NEED_BVECS);
	if (r) {
		dm_put_device(ti, io->dev);
		io->dev = NULL;
		ti->error = "Cannot allocate memory";
	}
	return r;
}

static bool file_can_dio(struct file *file)
{
#ifdef FMODE_CAN_ODIRECT
	return file->f_mode & FMODE_CAN_ODIRECT;
#else
	return file->f_mapping->a_ops && file->f_mapping->a_ops->direct_IO;
#endif
}

static void io_queue_work(struct work_struct *work);

static int io_open_file(struct dm_target *ti, struct qcow2_io *io,
			const char *path, bool writable)
{
	int flags = O_LARGEFILE | (writable ? O_RDWR : O_RDONLY);
	struct file *file;
	struct inode *inode;

	file = filp_open(path, flags, 0);
	if (IS_ERR(file)) {
		ti->error = "Cannot open image file";
		return PTR_ERR(file);
	}
	inode = file_inode(file);
	if (!S_ISREG(inode->i_mode)) {
		fput(file);
		ti->error = "Image is neither a block device nor a regular file";
		return -EINVAL;
	}
	io->file = file;
	io->size = i_size_read(inode);
	io->written = io->size;
	mutex_init(&io->grow_lock);
	io->lbs = inode->i_sb->s_bdev ?
		  bdev_logical_block_size(inode->i_sb->s_bdev) : SECTOR_SIZE;
	/*
	 * Data uses direct I/O when the file system supports it; otherwise
	 * (tmpfs, some network file systems) it goes through the page cache.
	 */
	io->dio = file_can_dio(file);
	spin_lock_init(&io->queue_lock);
	bio_list_init(&io->queue);
	INIT_LIST_HEAD(&io->waited);
	INIT_WORK(&io->queue_work, io_queue_work);
	return 0;
}

/*
 * A path names a block device if lookup_bdev() resolves it ("major:minor"
 * is also accepted by dm_get_device()); anything else must be a regular
 * file.
 */
int qcow2_io_open(struct dm_target *ti, struct qcow2_io *io,
		  const char *path, bool writable)
{
	unsigned int major, minor;
	dev_t devt;
	char dummy;
	int r;

	memset(io, 0, sizeof(*io));
	/* What wrote the image before us may not be durable yet */
	atomic64_set(&io->meta_writes, 1);
	if (!lookup_bdev(path, &devt) ||
	    sscanf(path, "%u:%u%c", &major, &minor, &dummy) == 2)
		r = io_open_bdev(ti, io, path, writable);
	else
		r = io_open_file(ti, io, path, writable);
	if (r)
		return r;
	r = qcow2_io_claim(ti, io, writable);
	if (r)
		qcow2_io_close(ti, io);	/* nothing open, nothing listed */
	return r;
}

/* What two tables on the same image have alike: its inode, or its device */
const void *qcow2_io_key(struct qcow2_io *io)
{
	return io->file ? (const void *)file_inode(io->file) :
			  (const void *)io->dev->bdev;
}

void qcow2_io_close(struct dm_target *ti, struct qcow2_io *io)
{
	qcow2_io_unclaim(io);
	io_close_node(io);
	if (io->dev) {
		bioset_exit(&io->bs);
		dm_put_device(ti, io->dev);
	}
	if (io->file)
		fput(io->file);
	io->dev = NULL;
	io->file = NULL;
}

/* ---- Metadata: synchronous, from process context ---- */

static struct page *buf_page(void *addr);

/*
 * Describe a kmalloc or vmalloc buffer as page segments; returns how many
 * of @max entries were used.
 */
unsigned int qcow2_buf_to_bvec(struct bio_vec *bv, unsigned int max,
			       void *buf, size_t len)
{
	unsigned int n = 0, chunk;

	while (len && n < max) {
		chunk = min_t(size_t, len, PAGE_SIZE - offset_in_page(buf));
		bv[n].bv_page = buf_page(buf);
		bv[n].bv_len = chunk;
		bv[n].bv_offset = offset_in_page(buf);
		n++;
		buf += chunk;
		len -= chunk;
	}
	return n;
}

/* Fill bytes [@skip, @skip + @len) of @bio's data from @src. */
void qcow2_bio_copy_range(struct bio *bio, u32 skip, const void *src,
			  u32 len)
{
	struct bvec_iter start = bio->bi_iter, iter;
	struct bio_vec bv;

	bio_advance_iter(bio, &start, skip);
	start.bi_size = len;
	__bio_for_each_segment(bv, bio, iter, start) {
		memcpy_to_bvec(&bv, src);
		src += bv.bv_len;
	}
}

/* Fill the data of @bio from @src (as many bytes as the bio holds). */
void qcow2_bio_copy_from_buf(struct bio *bio, const void *src)
{
	qcow2_bio_copy_range(bio, 0, src, bio->bi_iter.bi_size);
}

/*
 * Synchronous I/O to the block device, page by page (io_bdev_add()):
 * bios of up to BIO_MAX_VECS segments from the image's own bio_set, all
 * in flight together and waited for once. Each bio is submitted before
 * the next is allocated, so the bio_set's reserve always comes back: no
 * bio is held unsubmitted while another is waited for.
 */
struct io_bdev_batch {
	struct qcow2_io *io;
	blk_opf_t opf;
	u64 off;			/* where the next page goes */
	unsigned int left;		/* pages still to come, at most */
	struct bio *bio;		/* being filled, not yet submitted */
	atomic_t pending;		/* bios in flight, +1 while adding */
	blk_status_t status;		/* an error of one of them */
	struct completion done;
};

static void io_bdev_end(struct bio *bio)
{
	struct io_bdev_batch *b = bio->bi_private;

	if (bio->bi_status)
		WRITE_ONCE(b->status, bio->bi_status);
	bio_put(bio);
	if (atomic_dec_and_test(&b->pending))
		complete(&b->done);
}

static void io_bdev_start(struct io_bdev_batch *b, struct qcow2_io *io,
			  blk_opf_t opf, u64 off, unsigned int pages)
{
	b->io = io;
	b->opf = opf;
	b->off = off;
	b->left = pages;
	b->bio = NULL;
	atomic_set(&b->pending, 1);
	b->status = BLK_STS_OK;
	init_completion(&b->done);
}

static void io_bdev_submit(struct io_bdev_batch *b)
{
	if (!b->bio)
		return;
	atomic_inc(&b->pending);
	submit_bio(b->bio);
	b->bio = NULL;
}

static void io_bdev_add(struct io_bdev_batch *b, struct page *page,
			unsigned int len, unsigned int offset)
{
	struct bio *bio = b->bio;

	if (!bio || bio_add_page(bio, page, len, offset) != len) {
		io_bdev_submit(b);
		/* From the bio_set's reserve when memory is short: never fails */
		bio = bio_alloc_bioset(b->io->dev->bdev,
				       clamp_t(unsigned int, b->left, 1,
					       BIO_MAX_VECS),
				       b->opf, GFP_NOIO, &b->io->bs);
		bio->bi_iter.bi_sector = b->off >> SECTOR_SHIFT;
		bio->bi_end_io = io_bdev_end;
		bio->bi_private = b;
		__bio_add_page(bio, page, len, offset);
		b->bio = bio;
	}
	b->off += len;
	if (b->left)
		b->left--;
}

static int io_bdev_finish(struct io_bdev_batch *b)
{
	io_bdev_submit(b);
	if (!atomic_dec_and_test(&b->pending))
		wait_for_completion_io(&b->done);
	return blk_status_to_errno(READ_ONCE(b->status));
}

static int io_bdev_rw(struct qcow2_io *io, blk_opf_t opf,
		      const struct bio_vec *bv, unsigned int nr, u64 off)
{
	struct io_bdev_batch b;
	unsigned int i;

	io_bdev_start(&b, io, opf, off, nr);
	for (i = 0; i < nr; i++)
		io_bdev_add(&b, bv[i].bv_page, bv[i].bv_len, bv[i].bv_offset);
	return io_bdev_finish(&b);
}

/*
 * A range without data (REQ_OP_WRITE_ZEROES, REQ_OP_DISCARD) to the block
 * device, in bios of at most @max sectors from the image's own bio_set,
 * submitted as io_bdev_add() submits its own. Not blkdev_issue_zeroout()
 * or blkdev_issue_discard(): they take their bios from fs_bio_set and
 * hold one unsubmitted while they allocate the next, and the swap-out
 * writes queued behind this worker hold fs_bio_set's reserve. Under
 * memory pressure the worker then waited for them, and they for it.
 */
static int io_bdev_range(struct qcow2_io *io, blk_opf_t opf, u64 off,
			 u64 len, unsigned int max)
{
	u64 sector = off >> SECTOR_SHIFT, left = len >> SECTOR_SHIFT;
	struct io_bdev_batch b;
	struct bio *bio;
	unsigned int n;

	io_bdev_start(&b, io, opf, off, 0);
	while (left) {
		n = min_t(u64, left, max);
		bio = bio_alloc_bioset(io->dev->bdev, 0, opf, GFP_NOIO, &io->bs);
		bio->bi_iter.bi_sector = sector;
		bio->bi_iter.bi_size = n << SECTOR_SHIFT;
		bio->bi_end_io = io_bdev_end;
		bio->bi_private = &b;
		b.bio = bio;
		io_bdev_submit(&b);
		sector += n;
		left -= n;
	}
	return io_bdev_finish(&b);
}

/* Bios of a range: whole granules, each small enough for bi_size */
static unsigned int io_range_max(unsigned int max, unsigned int granule)
{
	max = min_t(unsigned int, max, UINT_MAX >> SECTOR_SHIFT);
	granule = max_t(unsigned int, granule >> SECTOR_SHIFT, 1);
	return rounddown(max, granule);
}

static struct page *buf_page(void *addr)
{
	return is_vmalloc_addr(addr) ? vmalloc_to_page(addr) :
				       virt_to_page(addr);
}

/* A kmalloc or vmalloc buffer, the same way */
static int io_bdev_rw_buf(struct qcow2_io *io, blk_opf_t opf, void *buf,
			  size_t len, u64 off)
{
	struct io_bdev_batch b;
	unsigned int chunk;

	io_bdev_start(&b, io, opf, off,
		      DIV_ROUND_UP(offset_in_page(buf) + len, PAGE_SIZE));
	for (; len; buf += chunk, len -= chunk) {
		chunk = min_t(size_t, len, PAGE_SIZE - offset_in_page(buf));
		io_bdev_add(&b, buf_page(buf), chunk, offset_in_page(buf));
	}
	return io_bdev_finish(&b);
}

/* A direct I/O issued asynchronously and waited for: io_file_rw_bytes() */
struct io_waited {
	struct kiocb iocb;
	struct iov_iter iter;
	bool write;
	struct list_head node;		/* on io->waited until submitted */
	struct completion done;
	long ret;
};

static void io_waited_complete(struct kiocb *iocb, long ret)
{
	struct io_waited *w = container_of(iocb, struct io_waited, iocb);

	w->ret = ret;
	complete(&w->done);
}

/*
 * Issue a waited I/O. Its waiter may return as soon as it completes, so
 * @w is not touched after an asynchronous submission.
 */
static void io_waited_submit(struct io_waited *w)
{
	struct file *file = w->iocb.ki_filp;
	unsigned int noio = memalloc_noio_save();
	ssize_t r;

	if (w->write) {
		file_start_write(file);
		r = file->f_op->write_iter(&w->iocb, &w->iter);
		file_end_write(file);
	} else {
		r = file->f_op->read_iter(&w->iocb, &w->iter);
	}
	memalloc_noio_restore(noio);
	if (r != -EIOCBQUEUED)
		io_waited_complete(&w->iocb, r);
}

static void io_queue_waited(struct qcow2_io *io, struct io_waited *w);

/*
 * Synchronous I/O of a segment array to the file. Data (@direct) uses
 * direct I/O when the file allows it, metadata the page cache, so that
 * any alignment works. Returns the bytes done (short past the end of the
 * file) or an error.
 *
 * Direct I/O goes out as an asynchronous kiocb that we wait for: with a
 * synchronous one, ext4 keeps the inode locked until a write into a hole
 * completes, so concurrent allocating writes would run one at a time.
 * While another such I/O is under way, it is submitted by the worker that
 * submits the bios (io_queue_work()), as the loop driver submits
 * everything from one worker: mapping workers each writing into a hole
 * themselves contend for the inode lock that ext4 holds across such a
 * submission, and under four concurrent allocating writers each
 * submission took several times as long. Alone, the caller submits it
 * itself, which spares a wake-up of that worker.
 */
static ssize_t io_file_rw_bytes(struct qcow2_io *io, bool write, bool direct,
				const struct bio_vec *bv, unsigned int nr,
				size_t len, u64 off)
{
	struct file *file = io->file;
	struct io_waited w;
	ssize_t r;

	iov_iter_bvec(&w.iter, write ? ITER_SOURCE : ITER_DEST, bv, nr, len);
	init_sync_kiocb(&w.iocb, file);
	w.iocb.ki_pos = off;
	w.write = write;
	if (direct && io->dio) {
		w.iocb.ki_flags = IOCB_DIRECT;
		w.iocb.ki_complete = io_waited_complete;
		init_completion(&w.done);
		if (atomic_inc_return(&io->waiting) == 1)
			io_waited_submit(&w);
		else
			io_queue_waited(io, &w);
		wait_for_completion_io(&w.done);
		atomic_dec(&io->waiting);
		return w.ret;
	}
	w.iocb.ki_flags = 0;
	if (write) {
		file_start_write(file);
		r = file->f_op->write_iter(&w.iocb, &w.iter);
		file_end_write(file);
	} else {
		r = file->f_op->read_iter(&w.iocb, &w.iter);
	}
	return r;
}

static int io_file_rw(struct qcow2_io *io, bool write, bool direct,
		      const struct bio_vec *bv, unsigned int nr, size_t len,
		      u64 off)
{
	ssize_t r = io_file_rw_bytes(io, write, direct, bv, nr, len, off);

	if (r < 0)
		return r;
	return r == len ? 0 : -EIO;	/* short: past EOF, or no space */
}

/* Segments of a file's buffered I/O on the stack: io_rw_buf() */
#define QCOW2_BUF_VECS		16

/*
 * Synchronous I/O of a buffer. A short file read fails, or with
 * @zero_tail reads zeros past the end of the file. A file's goes through
 * the page cache in pieces of QCOW2_BUF_VECS pages: nothing to allocate.
 */
static int io_rw_buf(struct qcow2_io *io, bool write, void *buf, size_t len,
		     u64 off, bool zero_tail)
{
	blk_opf_t opf = (write ? REQ_OP_WRITE : REQ_OP_READ) | REQ_META |
			REQ_SYNC;
	struct bio_vec bv[QCOW2_BUF_VECS];
	size_t done = 0, piece;
	unsigned int nr, noio;
	ssize_t r = 0;

	noio = memalloc_noio_save();
	if (io->dev)
		r = io_bdev_rw_buf(io, opf, buf, len, off);
	while (!io->dev && done < len) {
		piece = min_t(size_t, len - done, QCOW2_BUF_VECS * PAGE_SIZE -
			      offset_in_page(buf + done));
		nr = qcow2_buf_to_bvec(bv, QCOW2_BUF_VECS, buf + done, piece);
		r = io_file_rw_bytes(io, write, false, bv, nr, piece,
				     off + done);
		if (r < 0)
			break;
		done += r;
		if (r < piece)
			break;
	}
	memalloc_noio_restore(noio);
	if (io->dev || r < 0)
		return r;
	if (done < len && !write && zero_tail)
		memset(buf + done, 0, len - done);
	else if (done < len)
		return -EIO;	/* short: past EOF, or no space */
	return 0;
}

/*
 * A block device reads whole logical blocks only (device-mapper even
 * completes a bio shorter than a sector without any I/O): read the
 * blocks around [@off, @off + @len) and copy the part asked for.
 */
static int io_read_unaligned(struct qcow2_io *io, void *buf, size_t len,
			     u64 off)
{
	u64 start = round_down(off, io->lbs);
	u64 end = round_up(off + len, io->lbs);
	void *bounce;
	int r;

	if (end > io->size)
		return -EIO;
	bounce = kvmalloc(end - start, GFP_NOIO);
	if (!bounce)
		return -ENOMEM;
	r = io_rw_buf(io, false, bounce, end - start, start, false);
	if (!r)
		memcpy(buf, bounce + (off - start), len);
	kvfree(bounce);
	return r;
}

/*
 * Metadata reads may run while memory is short and our own device is
 * being written back: keep the allocations below us from recursing into
 * I/O.
 */
int qcow2_io_read_meta(struct qcow2_io *io, void *buf, size_t len, u64 off)
{
	u64 size = READ_ONCE(io->size);

	if (off > size || len > size - off)
		return -EIO;
	if (io->dev && ((off | len) & (io->lbs - 1)))
		return io_read_unaligned(io, buf, len, off);
	return io_rw_buf(io, false, buf, len, off, false);
}

/* Move @*val up to @end; writers race. */
static void io_raise(u64 *val, u64 end)
{
	u64 old = READ_ONCE(*val), prev;

	while (end > old) {
		prev = cmpxchg64(val, old, end);
		if (prev == old)
			break;
		old = prev;
	}
}

/*
 * A file grows as clusters past its end are written. Every write moves
 * io->written, a failed one too (part of it may have landed): past that
 * mark the file is known to hold nothing (qcow2_io_zero_range()). Data
 * writes move it once done: that is soon enough, since a write lands in
 * its own cluster only, and a cluster's zeroing is decided when it is
 * allocated, before anything is written to it.
 */
static void io_extend(struct qcow2_io *io, u64 end)
{
	io_raise(&io->written, end);
	io_raise(&io->size, end);
}

/*
 * No metadata write or flush is tried any more: one failed, and what the
 * image holds is unknown. A file's page cache may hold metadata that never
 * reached the disk (a failed writeback leaves the pages clean, and reports
 * the error to one fsync only): drop what can be dropped, so that whoever
 * reads the image next (a new table, qemu-img) reads the disk.
 */
void qcow2_io_fail(struct qcow2_io *io)
{
	if (atomic_xchg(&io->failed, 1))
		return;
	if (io->file)
		invalidate_mapping_pages(io->file->f_mapping, 0, -1);
}

/*
 * Metadata writes: the caller orders them with qcow2_io_flush(). One that
 * fails, but for a lack of room (nothing was written), fails every later
 * one too.
 */
int qcow2_io_write_meta(struct qcow2_io *io, void *buf, size_t len, u64 off)
{
	bool grow = io->file && off + len > READ_ONCE(io->size);
	int r;

	if (atomic_read(&io->failed))
		return -EIO;
	if (io->dev && (off > io->size || len > io->size - off))
		return -ENOSPC;
	/*
	 * A write past the file's size (a new L2 table or refcount block:
	 * no qcow2_io_reserve() covers those) extends it under grow_lock,
	 * with io->size moved before the lock is dropped: a reserve that
	 * read io->size before it would otherwise truncate the file back
	 * below what it wrote.
	 */
	if (grow)
		mutex_lock(&io->grow_lock);
	r = io_rw_buf(io, true, buf, len, off, false);
	if (!r && io->file)
		io_extend(io, off + len);
	if (grow)
		mutex_unlock(&io->grow_lock);
	if (r && r != -ENOSPC)
		qcow2_io_fail(io);
	if (r)
		return r;
	atomic64_inc(&io->meta_writes);
	/* Counted once done, before the caller marks anything clean */
	smp_mb__after_atomic();
	return 0;
}

/* Write whole clusters of data from a segment array, synchronously. */
int qcow2_io_write_data(struct qcow2_io *io, const struct bio_vec *bv,
			unsigned int nr, size_t len, u64 off)
{
	unsigned int noio;
	int r;

	if (io->dev && (off > io->size || len > io->size - off))
		return -ENOSPC;
	noio = memalloc_noio_save();
	if (io->dev)
		r = io_bdev_rw(io, REQ_OP_WRITE | REQ_SYNC, bv, nr, off);
	else
		r = io_file_rw(io, true, true, bv, nr, len, off);
	memalloc_noio_restore(noio);
	if (io->file)
		io_extend(io, off + len);
	return r;
}

/*
 * Guest data into a buffer (a copy-on-write source, a backing layer). A
 * file may end inside its last data cluster: a tail never written past
 * the end (QEMU and dm-qcow2 both leave one) reads as zeros, as it would
 * through the loop driver.
 */
int qcow2_io_read_data(struct qcow2_io *io, void *buf, size_t len, u64 off)
{
	if (io->dev)
		return qcow2_io_read_meta(io, buf, len, off);
	return io_rw_buf(io, false, buf, len, off, true);
}

/*
 * Make every completed write durable. Once a flush failed, none passes
 * again: a file reports a writeback error to one fsync only, and the
 * next would succeed with the lost writes still lost.
 */
int qcow2_io_flush(struct qcow2_io *io)
{
	u64 done = atomic64_read(&io->meta_writes);
	unsigned int noio;
	int r;

	if (atomic_read(&io->failed))
		return -EIO;
	/* The file system's allocations must not wait for our own writes */
	noio = memalloc_noio_save();
	if (io->dev)
		r = blkdev_issue_flush(io->dev->bdev);
	else
		r = vfs_fsync(io->file, 1);
	memalloc_noio_restore(noio);
	if (r) {
		qcow2_io_fail(io);
		return r;
	}
	/* Every metadata write counted in @done had completed: now durable */
	io_raise(&io->meta_flushed, done);
	return 0;
}

/*
 * Is every metadata write completed so far durable? A caller that has
 * seen a slice clean (written back) and then asks this learns whether
 * that write-back reached stable storage too.
 */
bool qcow2_io_meta_flushed(struct qcow2_io *io)
{
	/* After the caller's look at the cache: see qcow2_io_write_meta() */
	smp_rmb();
	return READ_ONCE(io->meta_flushed) >= atomic64_read(&io->meta_writes);
}

/*
 * Give a freed cluster's space back below us: a hole in a file, a
 * discard on a device that supports it. Best effort: the cluster is free
 * whatever happens here.
 */
void qcow2_io_discard(struct qcow2_io *io, u64 off, u64 len)
{
	unsigned int noio, max;

	if (io->dev) {
		max = io_range_max(bdev_max_discard_sectors(io->dev->bdev),
				   bdev_discard_granularity(io->dev->bdev));
		if (max)
			io_bdev_range(io, REQ_OP_DISCARD, off, len, max);
		return;
	}
	noio = memalloc_noio_save();
	vfs_fallocate(io->file, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
		      off, len);
	memalloc_noio_restore(noio);
}

/*
 * Nothing was ever written in a file at or past the value returned (a
 * device: nothing is known unwritten). Taken once a cluster is allocated,
 * it tells whether the cluster needs zeroing; taken later, writes that
 * completed meanwhile in clusters past it would move it past the cluster
 * too, and the cluster would be zeroed for nothing (a fallocate that waits
 * for every direct I/O in flight).
 */
u64 qcow2_io_written(struct qcow2_io *io)
{
	return io->file ? READ_ONCE(io->written) : U64_MAX;
}

/*
 * Make [@off, @off + @len) read as zeros without writing them: an
 * unwritten extent in a file (which grows as needed), a write-zeroes
 * command to a device that has one. Fails (-EOPNOTSUPP, or whatever went
 * wrong) when the caller must write the zeros itself.
 *
 * A range of a file where nothing was ever written (at or past @mark, a
 * value of qcow2_io_written() taken once the range was allocated: past
 * the file's end, or in the hole qcow2_io_reserve() made) reads as zeros
 * already: nothing is done. This keeps allocating writes to a file fast:
 * a zero-range fallocate is a journal transaction that first waits for
 * every direct I/O in flight on the file.
 */
int qcow2_io_zero_range(struct qcow2_io *io, u64 off, u64 len, u64 mark)
{
	unsigned int noio;
	int r;

	if (io->file && off >= mark)
		return 0;
	if (io->dev && (off > io->size || len > io->size - off))
		return -ENOSPC;
	if (io->dev && !bdev_write_zeroes_sectors(io->dev->bdev))
		return -EOPNOTSUPP;
	if (io->file && !io->dio)
		return -EOPNOTSUPP;	/* page cache: keep it simple */
	if (io->dev) {
		r = io_bdev_range(io, REQ_OP_WRITE_ZEROES, off, len,
				  io_range_max(bdev_write_zeroes_sectors(io->dev->bdev),
					       SECTOR_SIZE));
		/* A device that failed the command has dropped it */
		if (r && !bdev_write_zeroes_sectors(io->dev->bdev))
			r = -EOPNOTSUPP;
		return r;
	}
	noio = memalloc_noio_save();
	r = vfs_fallocate(io->file, FALLOC_FL_ZERO_RANGE, off, len);
	memalloc_noio_restore(noio);
	if (!r)
		io_extend(io, off + len);
	return r;
}

/*
 * Make a file end past @end, the end of a cluster just allocated, before
 * data is written there. A direct write that extends a file is serialised
 * by the file system (ext4 holds the inode lock until it completes and
 * updates the size in two journal transactions); a write into a hole
 * inside the file is not. So the file grows sparsely ahead of the
 * allocations, by an eighth of its size (1 MiB to 1 GiB) at a time, and
 * qcow2_io_trim() gives back what is left at deactivation. Best effort:
 * when the file cannot grow this way, the data writes extend it.
 */
void qcow2_io_reserve(struct qcow2_io *io, u64 end)
{
	unsigned int noio;
	u64 want;

	if (!io->file || end <= READ_ONCE(io->size))
		return;
	mutex_lock(&io->grow_lock);
	if (end > io->size) {
		want = round_up(end + clamp_t(u64, io->size >> 3, SZ_1M, SZ_1G),
				SZ_1M);
		noio = memalloc_noio_save();
		if (!vfs_truncate(&io->file->f_path, want))
			io_raise(&io->size, want);
		memalloc_noio_restore(noio);
	}
	mutex_unlock(&io->grow_lock);
}

/*
 * At deactivation (nothing in flight): cut the hole qcow2_io_reserve()
 * left past the last byte written. Everything the image refers to was
 * written (a data cluster may end past that point, as without the
 * reserve), and the file never shrinks below its size at open.
 */
void qcow2_io_trim(struct qcow2_io *io)
{
	u64 end = READ_ONCE(io->written);
	unsigned int noio;

	if (!io->file)
		return;
	mutex_lock(&io->grow_lock);
	if (end < io->size) {
		noio = memalloc_noio_save();
		if (!vfs_truncate(&io->file->f_path, end))
			WRITE_ONCE(io->size, end);
		memalloc_noio_restore(noio);
	}
	mutex_unlock(&io->grow_lock);
}

/* Before a resume: another table may have changed the file meanwhile. */
void qcow2_io_resync(struct qcow2_io *io)
{
	if (!io->file)
		return;
	mutex_lock(&io->grow_lock);
	WRITE_ONCE(io->size, i_size_read(file_inode(io->file)));
	WRITE_ONCE(io->written, io->size);
	mutex_unlock(&io->grow_lock);
}

/* ---- Data ---- */

void qcow2_io_bdev_remap(struct qcow2_io *io, struct bio *bio, u64 pos)
{
	bio_set_dev(bio, io->dev->bdev);
	bio->bi_iter.bi_sector = pos >> SECTOR_SHIFT;
}

/* Zero what a short read left untouched (the image ends inside the bio). */
static void zero_fill_tail(struct bio *bio, unsigned int done)
{
	struct bvec_iter iter = bio->bi_iter;
	struct bio_vec bv;

	bio_advance_iter(bio, &iter, done);
	while (iter.bi_size) {
		bv = bio_iter_iovec(bio, iter);
		memzero_bvec(&bv);
		bio_advance_iter_single(bio, &iter, bv.bv_len);
	}
}

/* End @bio, of which the file transferred @ret bytes (or failed). */
static void file_bio_end(struct bio *bio, long ret)
{
	if (ret < 0) {
		bio->bi_status = errno_to_blk_status(ret);
	} else if (ret < bio->bi_iter.bi_size) {
		if (bio_op(bio) == REQ_OP_READ)
			zero_fill_tail(bio, ret);
		else
			bio->bi_status = BLK_STS_IOERR;
	}
	bio_endio(bio);
}

/*
 * The last reference is gone: end the bio, or each bio of a merged
 * submission (chained from the first, in file order), as far as the file
 * transferred them.
 */
static void file_rw_done(struct qcow2_bio *pb)
{
	struct bio *bio = dm_bio_from_per_bio_data(pb, sizeof(*pb)), *next;
	long ret, len;

	if (!atomic_dec_and_test(&pb->ref))
		return;
	ret = pb->ret;
	kfree(pb->bvec);
	for (; bio; bio = next) {
		next = bio->bi_next;
		bio->bi_next = NULL;
		len = bio->bi_iter.bi_size;
		file_bio_end(bio, ret < 0 ? ret : min(ret, len));
		if (ret > 0)
			ret -= min(ret, len);
	}
}

static void file_rw_complete(struct kiocb *iocb, long ret)
{
	struct qcow2_bio *pb = container_of(iocb, struct qcow2_bio, iocb);

	pb->ret = ret;
	file_rw_done(pb);
}

/*
 * Issue @ii at byte @pos of the file for @bio (and the bios chained from
 * it). Two references keep the bios alive until both the submission has
 * returned and the I/O has completed, whichever comes last (as in the
 * loop driver).
 */
static void file_submit_iter(struct qcow2_io *io, struct bio *bio, u64 pos,
			     struct iov_iter *ii)
{
	struct qcow2_bio *pb = dm_per_bio_data(bio, sizeof(*pb));
	struct file *file = io->file;
	bool write = op_is_write(bio_op(bio));
	unsigned int noio;
	ssize_t ret;

	atomic_set(&pb->ref, 2);
	memset(&pb->iocb, 0, sizeof(pb->iocb));
	pb->iocb.ki_pos = pos;
	pb->iocb.ki_filp = file;
	pb->iocb.ki_complete = file_rw_complete;
	pb->iocb.ki_flags = io->dio ? IOCB_DIRECT : 0;
	if (bio->bi_opf & REQ_FUA)
		pb->iocb.ki_flags |= IOCB_DSYNC;
	pb->iocb.ki_ioprio = bio->bi_ioprio;
	if (write)
		io_extend(io, pos + iov_iter_count(ii));

	noio = memalloc_noio_save();
	if (write)
		ret = file->f_op->write_iter(&pb->iocb, ii);
	else
		ret = file->f_op->read_iter(&pb->iocb, ii);
	memalloc_noio_restore(noio);

	file_rw_done(pb);
	if (ret != -EIOCBQUEUED)
		file_rw_complete(&pb->iocb, ret);
}

static unsigned int bio_nr_bvecs(struct bio *bio)
{
	struct bvec_iter iter;
	struct bio_vec bv;
	unsigned int n = 0;

	bio_for_each_bvec(bv, bio, iter)
		n++;
	return n;
}

/*
 * Issue the bio's data at byte @pos of the file. This must run in a worker,
 * never in ->map(): the file system may wait for its own bios, which would
 * sit on current->bio_list until ->map() returned.
 */
static void file_submit_bio(struct qcow2_io *io, struct bio *bio, u64 pos,
			    unsigned int nr_bvec)
{
	struct qcow2_bio *pb = dm_per_bio_data(bio, sizeof(*pb));
	struct iov_iter ii;

	iov_iter_bvec(&ii, op_is_write(bio_op(bio)) ? ITER_SOURCE : ITER_DEST,
		      __bvec_iter_bvec(bio->bi_io_vec, bio->bi_iter), nr_bvec,
		      bio->bi_iter.bi_size);
	ii.iov_offset = QCOW2_BVEC_DONE(bio->bi_iter);
	pb->bvec = NULL;
	bio->bi_next = NULL;
	file_submit_iter(io, bio, pos, &ii);
}

static void file_submit_one(struct qcow2_io *io, struct bio *bio, u64 pos)
{
	file_submit_bio(io, bio, pos, bio_nr_bvecs(bio));
}

/*
 * Issue the @nr bios chained from @bio, @nr_bvec segments in all, which
 * continue each other in the file, as one kiocb. False when the segment
 * array cannot be had: the caller submits them one by one.
 */
static bool file_submit_merged(struct qcow2_io *io, struct bio *bio,
			       unsigned int nr_bvec)
{
	struct qcow2_bio *pb = dm_per_bio_data(bio, sizeof(*pb));
	struct bio_vec *vec, bv;
	struct bvec_iter iter;
	struct iov_iter ii;
	struct bio *b;
	unsigned int i = 0, nr = 0;
	size_t len = 0;

	vec = qcow2_kmalloc_array(nr_bvec, sizeof(*vec), QCOW2_GFP_TRY);
	if (!vec)
		return false;
	for (b = bio; b; b = b->bi_next) {
		bio_for_each_bvec(bv, b, iter)
			vec[i++] = bv;
		len += b->bi_iter.bi_size;
		nr++;
	}
	iov_iter_bvec(&ii, op_is_write(bio_op(bio)) ? ITER_SOURCE : ITER_DEST,
		      vec, nr_bvec, len);
	pb->bvec = vec;
	trace_qcow2_file_merge(io, pb->pos, nr, len);
	file_submit_iter(io, bio, pb->pos, &ii);
	return true;
}

/* Can @b join a submission of @a's kind that ends at byte @end? */
static bool file_can_merge(struct bio *a, u64 end, struct bio *b)
{
	struct qcow2_bio *pb = dm_per_bio_data(b, sizeof(*pb));

	return bio_op(b) == bio_op(a) &&
	       (b->bi_opf & REQ_FUA) == (a->bi_opf & REQ_FUA) &&
	       pb->pos == end;
}

/*
 * Submit the bios chained from @bio (through bi_next), in the order they
 * were queued, merging runs that continue each other in the file (a page
 * cache's 4 KiB write-back bios, which no request queue merges above a
 * bio-based target) into one kiocb of at most BIO_MAX_VECS segments.
 */
static void file_submit_batch(struct qcow2_io *io, struct bio *bio)
{
	struct qcow2_bio *pb;
	struct bio *last, *next, *b;
	unsigned int nr, more;
	u64 end;

	for (; bio; bio = next) {
		pb = dm_per_bio_data(bio, sizeof(*pb));
		end = pb->pos + bio->bi_iter.bi_size;
		nr = bio_nr_bvecs(bio);
		for (last = bio; (b = last->bi_next); last = b) {
			if (!file_can_merge(bio, end, b))
				break;
			more = bio_nr_bvecs(b);
			if (nr + more > BIO_MAX_VECS)
				break;
			nr += more;
			end += b->bi_iter.bi_size;
		}
		next = last->bi_next;
		last->bi_next = NULL;
		if (last == bio) {
			file_submit_bio(io, bio, pb->pos, nr);
			continue;
		}
		if (file_submit_merged(io, bio, nr))
			continue;
		for (b = bio; b; b = last) {
			last = b->bi_next;
			pb = dm_per_bio_data(b, sizeof(*pb));
			file_submit_one(io, b, pb->pos);
		}
	}
}

static void file_submit_work(struct work_struct *work)
{
	struct qcow2_bio *pb = container_of(work, struct qcow2_bio, work);
	struct bio *bio = dm_bio_from_per_bio_data(pb, sizeof(*pb));

	file_submit_one(&pb->q->io, bio, pb->pos);
}

/*
 * Submit what qcow2_io_file_queue() and io_queue_waited() queued, until
 * both queues stay empty: the waited I/O first (a mapping worker sleeps
 * on each).
 */
static void io_queue_work(struct work_struct *work)
{
	struct qcow2_io *io = container_of(work, struct qcow2_io, queue_work);
	struct io_waited *w;
	struct blk_plug plug;
	LIST_HEAD(waited);
	struct bio *bio;

	for (;;) {
		spin_lock(&io->queue_lock);
		bio = bio_list_get(&io->queue);
		list_splice_init(&io->waited, &waited);
		spin_unlock(&io->queue_lock);
		if (!bio && list_empty(&waited))
			return;
		/* One plug per batch: the file system's bios go down together */
		blk_start_plug(&plug);
		while (!list_empty(&waited)) {
			w = list_first_entry(&waited, struct io_waited, node);
			/* Off the list first: @w may be gone once submitted */
			list_del(&w->node);
			io_waited_submit(w);
		}
		file_submit_batch(io, bio);
		blk_finish_plug(&plug);
	}
}

/* Nothing queued: the work item is neither pending nor about to look */
static bool io_queue_idle(struct qcow2_io *io)
{
	return bio_list_empty(&io->queue) && list_empty(&io->waited);
}

/* Append @bl to the submission queue, waking its worker if it was idle. */
static void io_queue_list(struct qcow2_io *io, struct bio_list *bl)
{
	bool first;

	if (bio_list_empty(bl))
		return;
	spin_lock(&io->queue_lock);
	first = io_queue_idle(io);
	bio_list_merge(&io->queue, bl);
	spin_unlock(&io->queue_lock);
	bio_list_init(bl);
	if (first)
		queue_work(io->wq, &io->queue_work);
}

/* Queue a waited I/O for the submission worker: io_file_rw_bytes() */
static void io_queue_waited(struct qcow2_io *io, struct io_waited *w)
{
	bool first;

	spin_lock(&io->queue_lock);
	first = io_queue_idle(io);
	list_add_tail(&w->node, &io->waited);
	spin_unlock(&io->queue_lock);
	if (first)
		queue_work(io->wq, &io->queue_work);
}

/*
 * A run of direct I/O bios, each continuing the one before it in the file,
 * held for the submitter's plug: see qcow2_io_file_queue().
 */
struct qcow2_io_plug {
	struct blk_plug_cb cb;
	struct bio_list run;
	u64 end;			/* file byte after the run */
};

/* At most this much is held: a kiocb of BIO_MAX_VECS pages */
#define QCOW2_PLUG_BYTES	(BIO_MAX_VECS * PAGE_SIZE)

/* Bytes held: the run is contiguous in the file, from its head's place */
static u64 io_plug_bytes(struct qcow2_io_plug *plug)
{
	struct qcow2_bio *pb = dm_per_bio_data(plug->run.head, sizeof(*pb));

	return plug->end - pb->pos;
}

/* The plug ends, or its task is about to sleep: queue the held run. */
static void io_unplug(struct blk_plug_cb *cb, bool from_schedule)
{
	struct qcow2_io_plug *plug = container_of(cb, struct qcow2_io_plug, cb);

	io_queue_list(cb->data, &plug->run);
	kfree(plug);
}

/*
 * Hold @bio in the submitter's plug while it continues the held run, so
 * that the run reaches the queue whole. Returns false without a plug.
 */
static bool io_plug_hold(struct qcow2_io *io, struct bio *bio, u64 pos)
{
	struct qcow2_io_plug *plug;
	struct blk_plug_cb *cb;

	cb = blk_check_plugged(io_unplug, io, sizeof(*plug));
	if (!cb)
		return false;
	plug = container_of(cb, struct qcow2_io_plug, cb);
	if (!bio_list_empty(&plug->run) &&
	    !file_can_merge(plug->run.head, plug->end, bio))
		io_queue_list(io, &plug->run);
	bio_list_add(&plug->run, bio);
	plug->end = pos + bio->bi_iter.bi_size;
	if (io_plug_bytes(plug) >= QCOW2_PLUG_BYTES)
		io_queue_list(io, &plug->run);
	return true;
}

/*
 * Submit a file bio mapped to byte @pos from a worker (see
 * file_submit_bio()), never from ->map() itself. With direct I/O the bios
 * join one queue that a single work item drains, as in the loop driver:
 * a burst of bios costs one worker wake-up, the submissions do not block
 * (the file system only queues its own bios), and bios that continue
 * each other merge, whether ->map() or the mapping workers (@in_worker)
 * queued them. Buffered I/O blocks in the submission: there a mapping
 * worker submits the bio itself, and a bio from ->map() gets a work item
 * of its own, so that they run concurrently.
 *
 * Under a plug, direct I/O bios that continue each other in the file are
 * held in it until the run breaks, 1 MiB has gathered, or the plug ends
 * (its task sleeps): a page cache's 4 KiB write-back bios, which no
 * request queue merges above a bio-based target, then reach the queue as
 * one run and go to the file as one kiocb, as requests merge in loop's
 * queue. A bio that does not continue the run sends the run on and waits
 * in its place, so random I/O is held one bio at a time.
 *
 * The work item is queued when the queue was empty: otherwise it is
 * already pending, or running and will find this bio when it looks again.
 */
void qcow2_io_file_queue(struct qcow2_io *io, struct bio *bio, u64 pos,
			 bool in_worker)
{
	struct qcow2_bio *pb = dm_per_bio_data(bio, sizeof(*pb));
	struct bio_list one;

	pb->pos = pos;
	if (!io->dio && in_worker) {
		file_submit_one(io, bio, pos);
		return;
	}
	if (!io->dio) {
		INIT_WORK(&pb->work, file_submit_work);
		queue_work(io->wq, &pb->work);
		return;
	}
	if (io_plug_hold(io, bio, pos))
		return;
	bio_list_init(&one);
	bio_list_add(&one, bio);
	io_queue_list(io, &one);
}
