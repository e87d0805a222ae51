//! Memory regions that slabs live in and trainers share: [`Region`] is host memory (an
//! anonymous memfd, sized once (grow/shrink sealed), mapped shared; trainers map the fd
//! read-only, and only the node's own mapping may write it: future writes sealed) or, with the `cuda` feature, a CUDA VMM region (trainers import its POSIX fd).

use std::ffi::CString;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use crate::error::GpuError;
use std::ptr::NonNull;

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

/// Why a region could not be made.
#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    /// A syscall failed.
    #[error("{call} failed for a {len}-byte region: {source}")]
    Syscall {
        /// Which call.
        call: &'static str,
        /// Region size asked for.
        len: usize,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Zero-sized regions are meaningless.
    #[error("a region must not be empty")]
    Empty,
    /// A read outside a slab.
    #[error("bytes {start}..{start}+{len} lie outside a {slab}-byte slab")]
    OutOfSlab {
        /// Start, relative to the slab.
        start: usize,
        /// Length asked for.
        len: usize,
        /// The slab's length.
        slab: usize,
    },
    /// The kernel refused to place the region on a NUMA node.
    #[error("mbind of a {len}-byte region to NUMA node {node} failed: {source}")]
    Numa {
        /// The node asked for.
        node: u32,
        /// Region size.
        len: usize,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A CUDA call on a device region failed.
    #[error(transparent)]
    Gpu(#[from] GpuError),
}

/// The memory a stream's slabs live in.
#[derive(Debug)]
pub enum Region {
    /// A memfd mapped here.
    Host(HostRegion),
    /// A CUDA VMM allocation.
    Cuda(crate::cuda::VmmRegion),
}

impl From<HostRegion> for Region {
    fn from(r: HostRegion) -> Self {
        Self::Host(r)
    }
}

impl From<crate::cuda::VmmRegion> for Region {
    fn from(r: crate::cuda::VmmRegion) -> Self {
        Self::Cuda(r)
    }
}

impl Region {
    /// Size in bytes.
    pub fn len(&self) -> usize {
        match self {
            Self::Host(r) => r.len(),
            Self::Cuda(r) => r.len(),
        }
    }

    /// Never true: regions are not empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The memory kind trainers are told.
    pub fn memory(&self) -> shardwire_protocol::trainer::MemoryKind {
        use shardwire_protocol::trainer::MemoryKind;
        match self {
            Self::Host(_) => MemoryKind::Host,
            Self::Cuda(_) => MemoryKind::Cuda,
        }
    }

    /// A new fd that shares the region with a trainer: a duplicate of the memfd, or a
    /// POSIX fd exported from the CUDA allocation.
    pub fn share_fd(&self) -> Result<OwnedFd, RegionError> {
        match self {
            Self::Host(r) => r
                .fd()
                .try_clone_to_owned()
                .map_err(|source| RegionError::Syscall {
                    call: "dup",
                    len: r.len(),
                    source,
                }),
            Self::Cuda(r) => Ok(r.export_fd()?),
        }
    }

    /// The host region, if this is one.
    pub fn host(&self) -> Option<&HostRegion> {
        match self {
            Self::Host(r) => Some(r),
            Self::Cuda(_) => None,
        }
    }

    /// The CUDA region, if this is one.
    pub fn cuda(&self) -> Option<&crate::cuda::VmmRegion> {
        match self {
            Self::Cuda(r) => Some(r),
            Self::Host(_) => None,
        }
    }
}

/// A memfd-backed region mapped read-write into this process.
pub struct HostRegion {
    fd: OwnedFd,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory owned by this value; it is valid from any
// thread, and access to its bytes goes through slabs that are disjoint by construction.
unsafe impl Send for HostRegion {}
// SAFETY: as above; &HostRegion only hands out the raw base pointer and the fd.
unsafe impl Sync for HostRegion {}

impl std::fmt::Debug for HostRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRegion")
            .field("len", &self.len)
            .finish()
    }
}

/// Where the kernel says whether shared memory (a memfd region) gets 2 MiB pages: the
/// top-level setting, and (kernels with per-size settings) the 2 MiB size's own, which may
/// `inherit` the top-level one.
const SHMEM_ENABLED: &str = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";
const SHMEM_ENABLED_2M: &str = "/sys/kernel/mm/transparent_hugepage/hugepages-2048kB/shmem_enabled";

/// Whether host regions get 2 MiB pages on this host, and the kernel's setting that says so
/// (the selected value; "unknown" where the file is absent): `always`, `within_size`,
/// `advise` (the node asks for them) and `force` give them; `never` and `deny` do not. A 2 MiB
/// setting other than `inherit` decides for that size.
pub fn region_huge_pages() -> (bool, String) {
    let read = |path| std::fs::read_to_string(path).unwrap_or_default();
    let (top, size) = (read(SHMEM_ENABLED), read(SHMEM_ENABLED_2M));
    let (mode, which) = match selected(&size) {
        Some(m) if m != "inherit" => (m, " (2 MiB size)"),
        _ => (selected(&top).unwrap_or("unknown"), ""),
    };
    let huge = matches!(mode, "always" | "within_size" | "advise" | "force");
    (huge, format!("{mode}{which}"))
}

/// The selected value of a sysfs choice list (`a [b] c` -> `b`).
fn selected(text: &str) -> Option<&str> {
    let start = text.find('[')? + 1;
    let end = start + text[start..].find(']')?;
    Some(&text[start..end])
}

/// Seals a host region's memfd: size fixed, future writes refused. A kernel older than 5.1
/// (or a sandbox) without `F_SEAL_FUTURE_WRITE` answers EINVAL: the size is still sealed,
/// and a warning says once that trainers could write the memory.
fn add_seals(fd: &OwnedFd) -> Result<(), rustix::io::Errno> {
    static WARNED: std::sync::Once = std::sync::Once::new();
    let size = SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL;
    match rustix::fs::fcntl_add_seals(fd, size | SealFlags::FUTURE_WRITE) {
        Err(rustix::io::Errno::INVAL) => {
            WARNED.call_once(|| {
                tracing::warn!("this kernel cannot seal future writes of a memfd (F_SEAL_FUTURE_WRITE, Linux 5.1): trainers are handed host regions they could map writable");
            });
            rustix::fs::fcntl_add_seals(fd, size)
        }
        other => other,
    }
}

impl HostRegion {
    /// Creates a `len`-byte region named `name` (visible in /proc/PID/fd as `memfd:NAME`).
    pub fn new(name: &str, len: usize) -> Result<Self, RegionError> {
        if len == 0 {
            return Err(RegionError::Empty);
        }
        let sys = |call| {
            move |e: rustix::io::Errno| RegionError::Syscall {
                call,
                len,
                source: e.into(),
            }
        };
        let cname = CString::new(name.replace('\0', "_")).expect("no NUL after replace");
        let fd = rustix::fs::memfd_create(&cname, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .map_err(sys("memfd_create"))?;
        rustix::fs::ftruncate(&fd, len as u64).map_err(sys("ftruncate"))?;
        // SAFETY: a fresh shared mapping of `len` bytes of our own memfd; no existing memory
        // is aliased, and the mapping lives until Drop unmaps it.
        let raw = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            )
        }
        .map_err(sys("mmap"))?;
        let ptr = NonNull::new(raw.cast::<u8>()).expect("mmap never returns NULL on success");
        // Trainers map this fd: its size must never change under them, and only this
        // mapping (made above) may write it: a trainer's shared mapping or `write` of the fd
        // it was handed is refused (EPERM), so no trainer can change bytes the node is
        // still checking or assembling. A failure here drops `fd`; the mapping is unmapped.
        if let Err(e) = add_seals(&fd) {
            // SAFETY: exactly the mapping made above, not yet shared with anything.
            let _ = unsafe { rustix::mm::munmap(raw, len) };
            return Err(sys("fcntl(F_ADD_SEALS)")(e));
        }
        // 2 MiB pages where the host allows them for shared memory on request
        // (`shmem_enabled` = advise; `always` gives them anyway, `never` ignores this): a batch
        // gather reads rows scattered over tens of MiB, a TLB miss per row with 4 KiB pages
        // (docs/OPERATIONS.md, "Sizing memory"). A hint: its failure changes nothing.
        // SAFETY: advice over exactly the mapping just made; it changes no contents.
        let _ = unsafe { rustix::mm::madvise(raw, len, rustix::mm::Advice::LinuxHugepage) };
        Ok(Self { fd, ptr, len })
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true: regions are not empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The memfd, for passing to trainers.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Base of the mapping. Writing through it is only sound inside a slab one owns.
    pub fn base(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Asks the kernel to place the region's pages on NUMA node `node` (`mbind` with
    /// `MPOL_PREFERRED` over the whole mapping: the memfd's shared policy, so it holds for
    /// every page touched later, here or by a trainer; when the node is out of memory pages
    /// come from another one rather than failing). Call it before the pages are touched.
    /// An error names the node and the kernel's reason (`EINVAL`: no such node; `ENOSYS`: a
    /// kernel without NUMA).
    pub fn prefer_numa_node(&self, node: u32) -> Result<(), RegionError> {
        const NODE_BITS: usize = 1024;
        let err = |source| RegionError::Numa {
            node,
            len: self.len,
            source,
        };
        let index = usize::try_from(node).unwrap_or(usize::MAX);
        if index >= NODE_BITS {
            return Err(err(std::io::Error::from_raw_os_error(libc::EINVAL)));
        }
        let mut mask = [0 as libc::c_ulong; NODE_BITS / 64];
        mask[index / 64] |= 1 << (index % 64);
        // SAFETY: mbind only changes the memory policy of [ptr, ptr + len), our own live
        // mapping; the mask is a live local of NODE_BITS bits, and maxnode (bits + 1, the
        // kernel's convention) makes the kernel read no more than it.
        let r = unsafe {
            libc::syscall(
                libc::SYS_mbind,
                self.ptr.as_ptr(),
                self.len,
                libc::MPOL_PREFERRED,
                mask.as_ptr(),
                NODE_BITS + 1,
                0u32,
            )
        };
        if r != 0 {
            return Err(err(std::io::Error::last_os_error()));
        }
        Ok(())
    }

    /// Resident bytes of the mapping (pages touched so far), via mincore.
    pub fn resident_bytes(&self) -> usize {
        let page = rustix::param::page_size();
        let mut vec = vec![0u8; self.len.div_ceil(page)];
        // SAFETY: ptr/len describe our own live mapping and `vec` has one byte per page.
        let ok = unsafe { libc_mincore(self.ptr.as_ptr().cast(), self.len, vec.as_mut_ptr()) };
        if ok != 0 {
            return 0;
        }
        vec.iter().filter(|b| *b & 1 == 1).count() * page
    }
}

unsafe extern "C" {
    #[link_name = "mincore"]
    fn libc_mincore(addr: *mut std::ffi::c_void, len: usize, vec: *mut u8) -> i32;
}

impl Drop for HostRegion {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping created in `new`; no slab outlives the
        // region because slabs hold an Arc to their pool, which owns the region.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_selected_shmem_mode_is_read() {
        assert_eq!(
            selected("always within_size advise [never] deny force\n"),
            Some("never")
        );
        assert_eq!(selected("[advise] never"), Some("advise"));
        assert_eq!(selected(""), None);
    }

    #[test]
    fn map_write_and_seals() {
        let r = HostRegion::new("t", 1 << 20).unwrap();
        // SAFETY: inside our own mapping, no other user in this test.
        unsafe { r.base().add(4096).write(7) };
        // The fd sees the same bytes.
        let mut b = [0u8; 1];
        rustix::io::pread(r.fd(), &mut b, 4096).unwrap();
        assert_eq!(b[0], 7);
        // Size is sealed.
        assert!(rustix::fs::ftruncate(r.fd(), 10).is_err());
        // Only the node's own mapping writes: a trainer's writable shared mapping of the fd
        // it is handed, or a write to it, is refused; a read-only mapping is not.
        let shared = Region::Host(HostRegion::new("t2", 1 << 20).unwrap());
        let fd = shared.share_fd().unwrap();
        let map = |prot| {
            // SAFETY: a fresh mapping of the fd, unmapped below before anything uses it.
            unsafe { rustix::mm::mmap(std::ptr::null_mut(), 4096, prot, MapFlags::SHARED, &fd, 0) }
        };
        assert_eq!(
            map(ProtFlags::READ | ProtFlags::WRITE).unwrap_err(),
            rustix::io::Errno::PERM
        );
        let ro = map(ProtFlags::READ).unwrap();
        // SAFETY: the read-only mapping just made, used by nothing else.
        unsafe { rustix::mm::munmap(ro, 4096).unwrap() };
        assert_eq!(
            rustix::io::pwrite(&fd, b"x", 0).unwrap_err(),
            rustix::io::Errno::PERM
        );
        // SAFETY: inside the node's own mapping, no other user in this test.
        unsafe { shared.host().unwrap().base().write(9) };
        rustix::io::pread(&fd, &mut b, 0).unwrap();
        assert_eq!(b[0], 9);
        assert!(r.resident_bytes() >= 4096);
        assert!(matches!(HostRegion::new("t", 0), Err(RegionError::Empty)));
    }

    /// The policy the kernel keeps for the page at `addr` (get_mempolicy with MPOL_F_ADDR).
    fn policy_at(addr: *mut u8) -> (i32, u64) {
        let (mut mode, mut mask) = (0 as libc::c_int, [0 as libc::c_ulong; 16]);
        // SAFETY: out-pointers to live locals; maxnode matches the mask's bits + 1; `addr`
        // lies in a live mapping of the caller.
        let r = unsafe {
            libc::syscall(
                libc::SYS_get_mempolicy,
                &mut mode,
                mask.as_mut_ptr(),
                1025usize,
                addr,
                2u64, // MPOL_F_ADDR (include/uapi/linux/mempolicy.h; not in libc)
            )
        };
        assert_eq!(r, 0, "get_mempolicy: {}", std::io::Error::last_os_error());
        (mode, mask[0])
    }

    #[test]
    fn a_region_prefers_the_numa_node_it_is_given() {
        let r = HostRegion::new("numa", 4 << 20).unwrap();
        match r.prefer_numa_node(0) {
            Ok(()) => {
                let (mode, mask) = policy_at(r.base());
                assert_eq!((mode, mask), (libc::MPOL_PREFERRED, 1));
                // Pages touched later are placed by that policy: writing still works.
                // SAFETY: inside our own mapping.
                unsafe { r.base().add(1 << 20).write(1) };
            }
            // A kernel built without NUMA has no mbind: the node says so and goes on.
            Err(RegionError::Numa { source, .. })
                if source.raw_os_error() == Some(libc::ENOSYS) => {}
            Err(e) => panic!("{e}"),
        }
        let e = r.prefer_numa_node(4000).unwrap_err();
        assert!(e.to_string().contains("NUMA node 4000"), "{e}");
        // A node this machine lacks (the fake sysfs trees name nodes up to 1).
        let missing = std::fs::read_dir("/sys/devices/system/node")
            .map(|d| d.count())
            .unwrap_or(0)
            + 64;
        assert!(r.prefer_numa_node(missing as u32).is_err());
    }
}
