//! A CPU mapping of an RX dma-buf: where devmem frags are read from when the binding's
//! memory is host memory (a udmabuf, a dma-heap buffer, or the emulator's memfd), and the
//! creation of a udmabuf.
//!
//! Frag bytes are copied out with [`DmabufMem::copy_out`] while their token is held (the
//! kernel does not reuse a net_iov before its token comes back), so no Rust reference into
//! device-written memory ever outlives a copy. Nothing in this type can check that rule, so
//! `copy_out` is `unsafe`: the emulator writes the pages of its memory from other threads,
//! and a copy of one of them then is a data race. [`crate::gather::gather`] is the safe way
//! to read a received batch's frags. For a real dma-buf the copy is bracketed with
//! `DMA_BUF_IOCTL_SYNC` (include/uapi/linux/dma-buf.h) so the exporter can make CPU reads
//! coherent; a memfd has no such ioctl and needs none.
//!
//! The emulator ([`crate::emu`]) writes net_iov pages through [`DmabufMem::page_mut`], an
//! `unsafe` accessor whose contract is the kernel's: a page is written only while it is off
//! the freelist and not yet handed out as a frag.
#![allow(unsafe_code)] // one mmap, one munmap, one ioctl and the copies: each has a SAFETY note

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

/// `DMA_BUF_IOCTL_SYNC` = `_IOW('b', 0, struct dma_buf_sync)` (a single u64 flags field).
const DMA_BUF_IOCTL_SYNC: libc::c_ulong = 0x4008_6200;
const DMA_BUF_SYNC_READ: u64 = 1;
const DMA_BUF_SYNC_WRITE: u64 = 2;
const DMA_BUF_SYNC_START: u64 = 0;
const DMA_BUF_SYNC_END: u64 = 4;

#[cfg(test)]
thread_local! {
    /// The `DMA_BUF_IOCTL_SYNC` flags this thread asked for, memfds' (no ioctl) included: how
    /// a test sees that a CPU access was bracketed.
    static SYNCS: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The sync flags asked for on this thread since the last call, oldest first (tests).
#[cfg(test)]
pub(crate) fn take_syncs() -> Vec<u64> {
    SYNCS.with(|s| std::mem::take(&mut *s.borrow_mut()))
}

/// `DMA_BUF_SYNC_START | DMA_BUF_SYNC_WRITE` and `_END | _WRITE`, for tests.
#[cfg(test)]
pub(crate) const SYNC_WRITE: [u64; 2] = [
    DMA_BUF_SYNC_START | DMA_BUF_SYNC_WRITE,
    DMA_BUF_SYNC_END | DMA_BUF_SYNC_WRITE,
];

/// A frag that does not lie inside the mapped dma-buf (a kernel/ABI mismatch or a frag of
/// another binding): never read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("frag at offset {offset} with {len} bytes lies outside the {size}-byte dma-buf")]
pub struct OutOfRange {
    /// The frag's offset.
    pub offset: u64,
    /// Its length.
    pub len: usize,
    /// The dma-buf size.
    pub size: usize,
}

/// What the fd behind a [`DmabufMem`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A memfd (the emulator's stand-in): plain shared memory.
    Memfd,
    /// A real dma-buf: CPU access is bracketed with `DMA_BUF_IOCTL_SYNC`.
    Dmabuf,
}

/// A shared mapping of a dma-buf (or a memfd standing in for one).
#[derive(Debug)]
pub struct DmabufMem {
    fd: OwnedFd,
    base: NonNull<u8>,
    len: usize,
    kind: Kind,
    writable: bool,
}

// SAFETY: the mapping is plain shared memory owned by this value; all access goes through
// the `unsafe` `copy_out` (whose contract rules out a concurrent writer of the bytes read)
// or the `unsafe` `page_mut`, whose contract makes writers exclusive per page.
unsafe impl Send for DmabufMem {}
// SAFETY: see `Send`; `&self` methods never hand out references that outlive a copy.
unsafe impl Sync for DmabufMem {}

impl DmabufMem {
    /// A fresh zero-filled memfd of `len` bytes (rounded up to 4 KiB), mapped read-write:
    /// the emulator's "dma-buf".
    pub fn memfd(name: &str, len: usize) -> io::Result<Self> {
        let len = len.div_ceil(4096).max(1) * 4096;
        let cname = std::ffi::CString::new(name)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in memfd name"))?;
        // SAFETY: `cname` is a valid NUL-terminated string that outlives the call.
        let raw = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: memfd_create returned a fresh fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: `fd` is a live memfd; ftruncate only sets its size.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Self::map_fd(fd, len, libc::PROT_READ | libc::PROT_WRITE, Kind::Memfd)
    }

    /// A host-memory dma-buf of `len` bytes (rounded up to 4 KiB) from the udmabuf driver
    /// (`/dev/udmabuf`, `UDMABUF_CREATE` over a sealed memfd), mapped read-only: the RX
    /// binding's memory for `receive = devmem` with `memory = host`.
    pub fn udmabuf(len: usize) -> io::Result<Self> {
        Self::udmabuf_with(len, libc::PROT_READ)
    }

    /// [`DmabufMem::udmabuf`] mapped read-write: a TX buffer the sender fills.
    pub fn udmabuf_rw(len: usize) -> io::Result<Self> {
        Self::udmabuf_with(len, libc::PROT_READ | libc::PROT_WRITE)
    }

    fn udmabuf_with(len: usize, prot: i32) -> io::Result<Self> {
        let len = len.div_ceil(4096).max(1) * 4096;
        let dev = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/udmabuf")
            .map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!(
                        "/dev/udmabuf: {e} (load the udmabuf module on the host; in a container the device must also be granted to it: a device plugin or a privileged container; or use memory=cuda)"
                    ),
                )
            })?;
        // The failing step, with the errno, names what to look at.
        let failed = |step: &str| {
            let e = io::Error::last_os_error();
            io::Error::new(e.kind(), format!("udmabuf of {len} bytes: {step}: {e}"))
        };
        let name = c"shardwire-rx";
        // SAFETY: `name` is a valid NUL-terminated string.
        let raw = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(failed("memfd_create"));
        }
        // SAFETY: memfd_create returned a fresh fd that nothing else owns.
        let memfd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: `memfd` is live; ftruncate only sets its size.
        if unsafe { libc::ftruncate(memfd.as_raw_fd(), len as libc::off_t) } < 0 {
            return Err(failed("ftruncate"));
        }
        // udmabuf requires F_SEAL_SHRINK (the pages must not go away under the device).
        // SAFETY: fcntl(F_ADD_SEALS) on a live memfd with an int argument.
        if unsafe { libc::fcntl(memfd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } < 0 {
            return Err(failed("fcntl(F_ADD_SEALS)"));
        }
        #[repr(C)]
        struct UdmabufCreate {
            memfd: u32,
            flags: u32,
            offset: u64,
            size: u64,
        }
        const UDMABUF_FLAGS_CLOEXEC: u32 = 0x01;
        // _IOW('u', 0x42, struct udmabuf_create) (include/uapi/linux/udmabuf.h).
        const UDMABUF_CREATE: libc::c_ulong = 0x4018_7542;
        let arg = UdmabufCreate {
            memfd: memfd.as_raw_fd() as u32,
            flags: UDMABUF_FLAGS_CLOEXEC,
            offset: 0,
            size: len as u64,
        };
        // SAFETY: UDMABUF_CREATE reads one `struct udmabuf_create` (repr(C), 24 bytes) from
        // `&arg`, alive across the call; the returned value is a new dma-buf fd.
        let fd = unsafe { libc::ioctl(dev.as_raw_fd(), UDMABUF_CREATE, &arg) };
        if fd < 0 {
            let limit = io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL);
            return Err(failed(if limit {
                "UDMABUF_CREATE (EINVAL: more than the udmabuf module's size_limit_mb, 64 MiB \
                 unless raised: write a larger one to \
                 /sys/module/udmabuf/parameters/size_limit_mb, or lower devmem_memory or \
                 devmem_tx_memory)"
            } else {
                "UDMABUF_CREATE"
            }));
        }
        // SAFETY: the ioctl returned a fresh fd that nothing else owns.
        let dmabuf = unsafe { OwnedFd::from_raw_fd(fd) };
        Self::map_fd(dmabuf, len, prot, Kind::Dmabuf)
    }

    /// Address of the mapping (for zerocopy sends with binding id 0, where the kernel takes
    /// iovec bases as ordinary addresses).
    pub fn addr(&self) -> u64 {
        self.base.as_ptr() as u64
    }

    /// Map `len` bytes of the dma-buf `fd` read-only (the RX binding's memory when it is a
    /// host dma-buf such as a udmabuf).
    pub fn map_dmabuf(fd: OwnedFd, len: usize) -> io::Result<Self> {
        Self::map_fd(fd, len, libc::PROT_READ, Kind::Dmabuf)
    }

    fn map_fd(fd: OwnedFd, len: usize, prot: i32, kind: Kind) -> io::Result<Self> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "cannot map an empty dma-buf",
            ));
        }
        // SAFETY: a fresh shared mapping chosen by the kernel (addr NULL) of a live fd; no
        // existing memory is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = NonNull::new(p.cast::<u8>()).expect("mmap never returns NULL on success");
        Ok(Self {
            fd,
            base,
            len,
            kind,
            writable: prot & libc::PROT_WRITE != 0,
        })
    }

    /// Mapped bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true (a mapping is at least one page).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The fd (the dma-buf handed to `bind-rx`).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    fn check(&self, offset: u64, len: usize) -> Result<usize, OutOfRange> {
        let err = OutOfRange {
            offset,
            len,
            size: self.len,
        };
        let start = usize::try_from(offset).map_err(|_| err)?;
        match start.checked_add(len) {
            Some(end) if end <= self.len => Ok(start),
            _ => Err(err),
        }
    }

    /// Copy `dst.len()` bytes at `offset` into `dst` (an offset past the mapping is
    /// refused, never read).
    ///
    /// # Safety
    /// No thread of this process may write those bytes during the copy: no `page_mut` slice
    /// over them may be alive. For frags this holds while the caller holds the token of the
    /// frag they belong to (neither the NIC nor the emulator writes a net_iov before its
    /// token comes back), for bytes of this binding's own frags only.
    ///
    /// ```compile_fail,E0133
    /// let m = shardwire_devmem::mem::DmabufMem::memfd("t", 4096).unwrap();
    /// let mut b = [0u8; 1];
    /// m.copy_out(0, &mut b).unwrap(); // safe code cannot read racing memory
    /// ```
    pub unsafe fn copy_out(&self, offset: u64, dst: &mut [u8]) -> Result<(), OutOfRange> {
        let start = self.check(offset, dst.len())?;
        // SAFETY: `start..start + dst.len()` lies inside the live mapping (checked above);
        // `dst` is a distinct Rust slice, so the ranges do not overlap; the bytes are not
        // written concurrently (the caller's contract above).
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.base.as_ptr().add(start),
                dst.as_mut_ptr(),
                dst.len(),
            );
        }
        Ok(())
    }

    /// Whether this process writes the mapping (the emulator's memfd, a writable TX
    /// buffer): reading it needs that writer's exclusivity, not only the kernel's.
    pub(crate) fn written_here(&self) -> bool {
        self.kind == Kind::Memfd || self.writable
    }

    /// Start a CPU read of a real dma-buf (no-op for a memfd). Pair with
    /// [`DmabufMem::end_cpu_read`].
    pub fn begin_cpu_read(&self) -> io::Result<()> {
        self.sync(DMA_BUF_SYNC_START | DMA_BUF_SYNC_READ)
    }

    /// End a CPU read started with [`DmabufMem::begin_cpu_read`].
    pub fn end_cpu_read(&self) -> io::Result<()> {
        self.sync(DMA_BUF_SYNC_END | DMA_BUF_SYNC_READ)
    }

    /// Start CPU writes into a real dma-buf (no-op for a memfd), so that on a platform whose
    /// DMA is not cache-coherent the device then reads what the CPU wrote. Pair with
    /// [`DmabufMem::end_cpu_write`] before the device reads (ncdevmem brackets its TX copies
    /// the same way).
    pub fn begin_cpu_write(&self) -> io::Result<()> {
        self.sync(DMA_BUF_SYNC_START | DMA_BUF_SYNC_WRITE)
    }

    /// End CPU writes started with [`DmabufMem::begin_cpu_write`] (the exporter flushes them
    /// for the device).
    pub fn end_cpu_write(&self) -> io::Result<()> {
        self.sync(DMA_BUF_SYNC_END | DMA_BUF_SYNC_WRITE)
    }

    fn sync(&self, flags: u64) -> io::Result<()> {
        #[cfg(test)]
        SYNCS.with(|s| s.borrow_mut().push(flags));
        if self.kind == Kind::Memfd {
            return Ok(());
        }
        let arg = flags;
        // SAFETY: DMA_BUF_IOCTL_SYNC reads one u64 (struct dma_buf_sync) from `&arg`, which
        // lives across the call; the fd is live.
        let r = unsafe { libc::ioctl(self.fd.as_raw_fd(), DMA_BUF_IOCTL_SYNC, &arg) };
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    }

    /// The bytes `offset..offset + len` for writing.
    ///
    /// # Safety
    /// The caller must own that range exclusively for the lifetime of the returned slice:
    /// no other `page_mut` slice and no `copy_out` may touch it meanwhile. The emulator
    /// guarantees this with its freelist (a net_iov is written only between leaving the
    /// freelist and being described in a frag).
    #[allow(clippy::mut_from_ref)] // exclusivity is the caller's contract, documented above
    pub(crate) unsafe fn page_mut(&self, offset: usize, len: usize) -> &mut [u8] {
        assert!(
            offset.checked_add(len).is_some_and(|e| e <= self.len),
            "page_mut {offset}+{len} outside {} bytes",
            self.len
        );
        assert!(
            self.kind == Kind::Memfd || self.writable,
            "page_mut on a read-only dma-buf"
        );
        // SAFETY: in bounds (asserted), the mapping is writable (memfd), and the caller
        // guarantees exclusive access to the range while the slice lives.
        unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr().add(offset), len) }
    }
}

impl Drop for DmabufMem {
    fn drop(&mut self) {
        // SAFETY: `base`/`len` are exactly the mapping made in `map_fd`, unmapped once;
        // no slice into it can outlive `self` (copy_out copies; page_mut borrows `self`).
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_out_reads_what_was_written_and_checks_bounds() {
        let m = DmabufMem::memfd("t", 5000).unwrap();
        assert_eq!(m.len(), 8192);
        // SAFETY: single-threaded test; nothing else touches the page.
        unsafe { m.page_mut(4096, 4).copy_from_slice(b"abcd") };
        let mut out = [0u8; 4];
        // SAFETY: single-threaded test; no `page_mut` slice is alive.
        let read = unsafe { m.copy_out(4096, &mut out) };
        read.unwrap();
        assert_eq!(&out, b"abcd");
        // SAFETY: as above.
        let past = unsafe { m.copy_out(8190, &mut out) };
        assert_eq!(
            past,
            Err(OutOfRange {
                offset: 8190,
                len: 4,
                size: 8192
            })
        );
        // SAFETY: as above.
        let wrapped = unsafe { m.copy_out(u64::MAX, &mut out) };
        assert!(wrapped.is_err());
        m.begin_cpu_read().unwrap();
        m.end_cpu_read().unwrap();
    }

    #[test]
    fn udmabuf_is_created_or_its_absence_is_explained() {
        match DmabufMem::udmabuf(1 << 20) {
            Ok(m) => {
                assert_eq!(m.len(), 1 << 20);
                m.begin_cpu_read().unwrap();
                m.end_cpu_read().unwrap();
            }
            // This machine's kernel has no udmabuf (reference devmem.md §10).
            Err(e) => assert!(e.to_string().contains("/dev/udmabuf"), "{e}"),
        }
    }

    #[test]
    fn a_writable_udmabuf_takes_the_write_sync() {
        match DmabufMem::udmabuf_rw(1 << 20) {
            Ok(m) => {
                m.begin_cpu_write().unwrap();
                m.end_cpu_write().unwrap();
            }
            Err(e) => assert!(e.to_string().contains("/dev/udmabuf"), "{e}"),
        }
    }
}
