//! Linux devmem TCP: the kernel ABI shardwire builds on.
//!
//! Modules (DESIGN §3, §8.4; kernel facts in shared/reference/devmem.md):
//!
//! * [`netdev`]: the "netdev" generic-netlink client: dumps (dev, queue, napi, page pool),
//!   `bind-rx` / `bind-tx` with typed, explained errors; a binding owns its netlink socket.
//! * [`socket`]: `recvmsg(MSG_SOCK_DEVMEM)` on a TCP socket with a reusable control buffer,
//!   and [`socket::TokenBatcher`] for `SO_DEVMEM_DONTNEED`.
//! * [`cmsg`]: the pure, fuzzed parser of devmem control messages.
//! * [`probe`]: the per-NIC capability probe behind `shardwire nics` and `/v1/nics`.
//! * [`mem`]: the CPU mapping of an RX dma-buf that frags are copied out of.
//! * [`gather`]: turns one receive's frags into contiguous shard bytes.
//! * [`ifaddr`]: an interface's IPv4 address (a lane's data address), index and name.
//! * [`ingress`]: which NIC a TCP connection came in on (its NAPI id, netdev `napi-get`).
//! * [`emu`]: the kernel-faithful emulator of devmem RX used where no devmem NIC exists.
//! * [`nic`]: NIC setup for devmem (channels, header split) journaled in a state file and
//!   restored on shutdown or at the next start after a crash.
//! * [`txbuf`]: the sender's TX dma-buf, per-connection rings gated by completions.
//! * [`tx`]: devmem TX (`sendmsg` from a TX-bound dma-buf, zerocopy completions).
//! * [`uring`]: io_uring multishot receive into provided buffers (host memory), measured by
//!   `shardwire bench --compare-uring` against `recv`.
//!
//! The socket-level UAPI constants below are checked at compile time against the `libc`
//! crate. Source: include/uapi/asm-generic/socket.h and include/uapi/linux/uio.h (Linux
//! 6.12+).
//!
//! `unsafe` is denied crate-wide and allowed only in the private `sys` module, where each
//! syscall sits behind a small safe function with a `// SAFETY:` comment, in [`mem`] (the
//! mapping and its copies), where the emulator writes a net_iov page or copies a linear one
//! out, where the gather copies a held frag out ([`gather`]), where a TX slot hands out the
//! free bytes it owns ([`txbuf`]), and in [`uring`] (the ring's shared memory and the
//! buffers it lends the kernel).
#![deny(unsafe_code)]

pub mod cmsg;
pub mod emu;
pub mod gather;
pub mod ifaddr;
pub mod ingress;
pub mod mem;
pub mod netdev;
pub mod nic;
mod nl;
pub mod probe;
pub mod socket;
#[allow(unsafe_code)] // the one module with raw syscalls; every block has a SAFETY note
mod sys;
#[allow(unsafe_code)] // ring setup, provided-buffer memory and SQE pushes: each has a SAFETY note
pub mod uring;
pub use sys::set_rcvlowat;
#[cfg(test)]
mod testutil;
pub mod tx;
pub mod txbuf;

pub use netdev::{NetdevClient, NetdevError, RxBinding, TxBinding, bind_rx, bind_tx};
pub use probe::{NicReport, probe_nics};
pub use socket::{DevmemError, DevmemRecv, DevmemSocket, RecvBatch, TokenBatcher};

/// `SO_DEVMEM_LINEAR` / `SCM_DEVMEM_LINEAR` (asm-generic).
pub const SO_DEVMEM_LINEAR: i32 = 78;
/// `SO_DEVMEM_DMABUF` / `SCM_DEVMEM_DMABUF` (asm-generic).
pub const SO_DEVMEM_DMABUF: i32 = 79;
/// `SO_DEVMEM_DONTNEED` (asm-generic).
pub const SO_DEVMEM_DONTNEED: i32 = 80;
/// `MSG_SOCK_DEVMEM` (include/linux/socket.h; not exported by libc).
pub const MSG_SOCK_DEVMEM: i32 = 0x200_0000;
/// At most this many `dmabuf_token`s per SO_DEVMEM_DONTNEED call.
pub const MAX_DONTNEED_TOKENS: usize = 128;
/// At most this many frags freed per SO_DEVMEM_DONTNEED call.
pub const MAX_DONTNEED_FRAGS: usize = 1024;

#[cfg(all(
    target_os = "linux",
    any(
        target_arch = "x86_64",
        target_arch = "aarch64",
        target_arch = "riscv64"
    )
))]
const _: () = {
    assert!(libc::SO_DEVMEM_LINEAR == SO_DEVMEM_LINEAR);
    assert!(libc::SO_DEVMEM_DMABUF == SO_DEVMEM_DMABUF);
    assert!(libc::SO_DEVMEM_DONTNEED == SO_DEVMEM_DONTNEED);
    assert!(std::mem::size_of::<libc::dmabuf_cmsg>() == 24);
    assert!(std::mem::size_of::<libc::dmabuf_token>() == 8);
};

/// Symbolic name of an errno as used in devmem diagnostics, e.g. `"EOPNOTSUPP"`;
/// `"errno N"` for others.
pub fn errno_label(errno: i32) -> String {
    let name = match errno {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::EBADF => "EBADF",
        libc::EAGAIN => "EAGAIN",
        libc::ENOMEM => "ENOMEM",
        libc::EACCES => "EACCES",
        libc::EFAULT => "EFAULT",
        libc::EBUSY => "EBUSY",
        libc::EEXIST => "EEXIST",
        libc::ENODEV => "ENODEV",
        libc::ENOSPC => "ENOSPC",
        libc::EINVAL => "EINVAL",
        libc::ERANGE => "ERANGE",
        libc::ENODATA => "ENODATA",
        libc::ENOPROTOOPT => "ENOPROTOOPT",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        libc::ENOBUFS => "ENOBUFS",
        libc::EMSGSIZE => "EMSGSIZE",
        socket::ETOOSMALL => "ETOOSMALL",
        _ => return format!("errno {errno}"),
    };
    name.to_string()
}

#[cfg(test)]
mod tests {
    #[test]
    fn msg_sock_devmem_does_not_collide_with_libc_flags() {
        for f in [
            libc::MSG_PEEK,
            libc::MSG_DONTWAIT,
            libc::MSG_WAITALL,
            libc::MSG_TRUNC,
            libc::MSG_CMSG_CLOEXEC,
            libc::MSG_ZEROCOPY,
        ] {
            assert_eq!(f & super::MSG_SOCK_DEVMEM, 0, "flag {f:#x}");
        }
    }
}
