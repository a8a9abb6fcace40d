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
#include <linux/file.h>
#include <linux/namei.h>
#include <linux/sched/mm.h>
#include <linux/uio.h>
#include <linux/vmalloc.h>

#include "dm-qcow2.h"

/* ---- Opening the image ---- */

static int io_open_bdev(struct dm_target *ti, struct qcow2_io *io,
			const char *path)
{
	int r;

	r = dm_get_device(ti, path, dm_table_get_mode(ti->table), &io->dev);
	if (r) {
		ti->error = "Cannot open image block device";
		return r;
	}
	io->size = bdev_nr_bytes(io->dev->bdev);
	io->lbs = bdev_logical_block_size(io->dev->bdev);
	return 0;
}

static bool file_can_dio(struct file *file)
{
#ifdef FMODE_CAN_ODIRECT
	return file->f_mode & FMODE_CAN_ODIRECT;
#else
	return file->f_mapping->a_ops && file->f_mapping->a_ops->direct_IO;
#endif
}

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
	io->lbs = inode->i_sb->s_bdev ?
		  bdev_logical_block_size(inode->i_sb->s_bdev) : SECTOR_SIZE;
	/*
	 * Data uses direct I/O when the file system supports it; otherwise
	 * (tmpfs, some network file systems) it goes through the page cache.
	 */
	io->dio = file_can_dio(file);
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

	memset(io, 0, sizeof(*io));
	if (!lookup_bdev(path, &devt) ||
	    sscanf(path, "%u:%u%c", &major, &minor, &dummy) == 2)
		return io_open_bdev(ti, io, path);
	return io_open_file(ti, io, path, writable);
}

void qcow2_io_close(struct dm_target *ti, struct qcow2_io *io)
{
	if (io->dev)
		dm_put_device(ti, io->dev);
	if (io->file)
		fput(io->file);
	io->dev = NULL;
	io->file = NULL;
}

/* ---- Metadata: synchronous, from process context ---- */

static struct page *buf_page(void *addr)
{
	return is_vmalloc_addr(addr) ? vmalloc_to_page(addr) :
				       virt_to_page(addr);
}

/* Read @len bytes at @off into a kmalloc or vmalloc buffer. */
static int io_bdev_read(struct qcow2_io *io, void *buf, size_t len, u64 off)
{
	struct block_device *bdev = io->dev->bdev;
	unsigned int nr, chunk, in_page;
	struct bio *bio;
	int r;

	while (len) {
		nr = min_t(size_t, BIO_MAX_VECS,
			   DIV_ROUND_UP(len + offset_in_page(buf), PAGE_SIZE));
		bio = bio_alloc(bdev, nr, REQ_OP_READ | REQ_META | REQ_SYNC,
				GFP_NOIO);
		bio->bi_iter.bi_sector = off >> SECTOR_SHIFT;
		while (len) {
			in_page = offset_in_page(buf);
			chunk = min_t(size_t, len, PAGE_SIZE - in_page);
			if (bio_add_page(bio, buf_page(buf), chunk, in_page) !=
			    chunk)
				break;
			buf += chunk;
			off += chunk;
			len -= chunk;
		}
		r = submit_bio_wait(bio);
		bio_put(bio);
		if (r)
			return r;
	}
	return 0;
}

static int io_file_read(struct qcow2_io *io, void *buf, size_t len, u64 off)
{
	loff_t pos = off;
	ssize_t r;

	/* Buffered: any alignment works, and the page cache stays coherent */
	while (len) {
		r = kernel_read(io->file, buf, len, &pos);
		if (r < 0)
			return r;
		if (!r)
			return -EIO;	/* past EOF: callers checked bounds */
		buf += r;
		len -= r;
	}
	return 0;
}

/*
 * Metadata reads may run while memory is short and our own device is
 * being written back: keep the allocations below us from recursing into
 * I/O.
 */
int qcow2_io_read_meta(struct qcow2_io *io, void *buf, size_t len, u64 off)
{
	unsigned int noio = memalloc_noio_save();
	int r;

	if (off > io->size || len > io->size - off)
		r = -EIO;
	else if (io->dev)
		r = io_bdev_read(io, buf, len, off);
	else
		r = io_file_read(io, buf, len, off);
	memalloc_noio_restore(noio);
	return r;
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

static void file_rw_done(struct qcow2_bio *pb)
{
	struct bio *bio = dm_bio_from_per_bio_data(pb, sizeof(*pb));
	long ret;

	if (!atomic_dec_and_test(&pb->ref))
		return;
	ret = pb->ret;
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

static void file_rw_complete(struct kiocb *iocb, long ret)
{
	struct qcow2_bio *pb = container_of(iocb, struct qcow2_bio, iocb);

	pb->ret = ret;
	file_rw_done(pb);
}

/*
 * Issue the bio's data at byte @pos of the file. This must run in a worker,
 * never in ->map(): the file system may wait for its own bios, which would
 * sit on current->bio_list until ->map() returned.
 *
 * Two references keep the bio alive until both the submission has returned
 * and the I/O has completed, whichever comes last (as in the loop driver).
 */
void qcow2_io_file_submit(struct qcow2_io *io, struct bio *bio, u64 pos)
{
	struct qcow2_bio *pb = dm_per_bio_data(bio, sizeof(*pb));
	struct file *file = io->file;
	unsigned int noio, nr_bvec = 0;
	struct bvec_iter iter;
	struct iov_iter ii;
	struct bio_vec bv;
	bool write = op_is_write(bio_op(bio));
	ssize_t ret;

	bio_for_each_bvec(bv, bio, iter)
		nr_bvec++;
	iov_iter_bvec(&ii, write ? ITER_SOURCE : ITER_DEST,
		      __bvec_iter_bvec(bio->bi_io_vec, bio->bi_iter), nr_bvec,
		      bio->bi_iter.bi_size);
	ii.iov_offset = bio->bi_iter.bi_bvec_done;

	atomic_set(&pb->ref, 2);
	memset(&pb->iocb, 0, sizeof(pb->iocb));
	pb->iocb.ki_pos = pos;
	pb->iocb.ki_filp = file;
	pb->iocb.ki_complete = file_rw_complete;
	pb->iocb.ki_flags = io->dio ? IOCB_DIRECT : 0;
	pb->iocb.ki_ioprio = bio_prio(bio);

	noio = memalloc_noio_save();
	if (write)
		ret = file->f_op->write_iter(&pb->iocb, &ii);
	else
		ret = file->f_op->read_iter(&pb->iocb, &ii);
	memalloc_noio_restore(noio);

	file_rw_done(pb);
	if (ret != -EIOCBQUEUED)
		file_rw_complete(&pb->iocb, ret);
}
