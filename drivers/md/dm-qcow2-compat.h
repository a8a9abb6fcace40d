/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * The few definitions dm-qcow2-format.c needs, so that the same source
 * builds into the kernel module and into host unit tests and fuzzers.
 */
#ifndef DM_QCOW2_COMPAT_H
#define DM_QCOW2_COMPAT_H

#ifdef __KERNEL__

#include <linux/bits.h>
#include <linux/errno.h>
#include <linux/limits.h>
#include <linux/string.h>
#include <linux/types.h>

#else /* host build: the kernel's UAPI types plus libc */

#include <errno.h>
#include <linux/types.h>
#include <stdbool.h>
#include <stddef.h>
#include <string.h>

typedef __u8 u8;
typedef __u16 u16;
typedef __u32 u32;
typedef __u64 u64;

#define U64_MAX		(~0ULL)
#define S64_MAX		((long long)(U64_MAX >> 1))
#define BIT(n)		(1UL << (n))
#define BIT_ULL(n)	(1ULL << (n))

#endif /* __KERNEL__ */

#endif /* DM_QCOW2_COMPAT_H */
