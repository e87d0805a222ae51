//! Linux devmem TCP: the kernel ABI shardwire builds on.
//!
//! This crate will hold the netdev netlink client, NIC setup, devmem sockets and the
//! kernel-faithful emulator (DESIGN §3, §8.4). In this version it pins the socket-level UAPI
//! (constants and struct layouts, checked at compile time against the `libc` crate and the
//! kernel headers) so the service can report precisely why it runs in host mode.
//! Source: include/uapi/asm-generic/socket.h and include/uapi/linux/uio.h (Linux 6.12+).
#![forbid(unsafe_code)]

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

/// Why devmem receive is not in use, as reported at startup and on `/v1/status`.
pub fn host_mode_reason() -> &'static str {
    "devmem receive is not built into this version; shards are received with plain TCP into host memory"
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
