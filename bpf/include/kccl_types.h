/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * kccl_types.h: what the layout headers in this directory (the structures
 * that cross the kernel/user boundary) use from the kernel: the fixed-width
 * types (__u8 .. __u64) and struct bpf_spin_lock.  A BPF program has them
 * from vmlinux.h, which it includes first; any other C (the header checks
 * of crates/kccl/tests/bpf_headers.rs) from <linux/types.h>, <linux/bpf.h>.
 */
#ifndef KCCL_TYPES_H
#define KCCL_TYPES_H

#ifndef __VMLINUX_H__
#include <linux/types.h>
#include <linux/bpf.h>	/* struct bpf_spin_lock of the slot layouts */
#endif

#endif /* KCCL_TYPES_H */
