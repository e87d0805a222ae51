//! Opening a GPU for the service, with a short self-test of every path it will use
//! (region, fd export, H2D staging, the CRC and gather kernels), so a broken driver or a PTX
//! the driver cannot JIT shows at start with its reason, not at the first shard; and the
//! dma-buf check ([`check_dma_buf`]), which reports and is never fatal.

use std::sync::Arc;

use super::{Device, Engines, H2dStager, VmmRegion};
use crate::error::GpuError;
use crate::kernels::{Frag, Span, reference};

/// Runs each path a stream needs once on a 2 MiB region and compares with the CPU
/// reference. The dma-buf export, needed only to bind the GPU's memory to NIC queues, is
/// [`check_dma_buf`]'s.
pub fn self_test(dev: &Arc<Device>, engines: &Engines) -> Result<(), GpuError> {
    let src = VmmRegion::new(dev, 1)?;
    let dst = VmmRegion::new(dev, 1)?;
    drop(src.export_fd()?);
    let pattern = test_pattern(1 << 20);
    check_staging(dev, &src, &pattern)?;
    check_crc(engines, &src, &pattern)?;
    check_gather(engines, &src, &dst)
}

/// What [`check_dma_buf`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DmaBufCheck {
    /// Why a region does not export as a dma-buf, if it does not.
    pub refused: Option<String>,
    /// Why it exports with the driver's default mapping, not the PCIe one, where that may
    /// matter: only on a GPU that is cache-coherent with the CPU (Grace Hopper, Grace
    /// Blackwell: C2C). Elsewhere the default mapping is PCIe and a refused flag is expected
    /// (see [`super::VmmRegion::export_dmabuf_noting`]): `None`.
    pub default_mapping: Option<String>,
}

/// Whether a region of `dev` exports as a dma-buf (what binding GPU memory to NIC receive
/// queues needs), and with which mapping. The device attribute is not enough: a driver in a
/// VM has said "supported" and then refused the export (an H200 under Firecracker:
/// `CUDA_ERROR_NOT_SUPPORTED`, with and without the PCIe mapping flag).
pub fn check_dma_buf(dev: &Arc<Device>, attribute: bool) -> Result<DmaBufCheck, GpuError> {
    if !attribute {
        let why =
            "the driver reports no dma-buf support (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0)";
        return Ok(DmaBufCheck {
            refused: Some(why.into()),
            default_mapping: None,
        });
    }
    let region = VmmRegion::new(dev, 1)?;
    Ok(match region.export_dmabuf_noting() {
        Ok((fd, default_mapping)) => {
            drop(fd);
            DmaBufCheck {
                refused: None,
                default_mapping,
            }
        }
        Err(e) => DmaBufCheck {
            refused: Some(refusal_text(&e)),
            default_mapping: None,
        },
    })
}

/// Why the export failed, for the operator: both refusals where the PCIe mapping type and
/// the default mapping were refused differently, one where alike.
fn refusal_text(e: &GpuError) -> String {
    match e {
        GpuError::DmaBufRefused { pcie, fallback } if pcie.to_string() == fallback.to_string() => {
            format!("the driver refused the dma-buf export: {fallback}")
        }
        e => format!("the driver refused the dma-buf export: {e}"),
    }
}

/// `len` bytes of xorshift noise.
fn test_pattern(len: usize) -> Vec<u8> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// H2D staging of `pattern` into `src` at 4096, in pieces smaller than a slot, as a socket
/// delivers them; the bytes read back must be the pattern.
fn check_staging(dev: &Arc<Device>, src: &VmmRegion, pattern: &[u8]) -> Result<(), GpuError> {
    let len = pattern.len();
    let mut stager = H2dStager::new(dev, 256 << 10, 2)?;
    let mut at = 0;
    stager
        .copy_from(
            &mut |buf: &mut [u8]| {
                let n = buf.len().min(100_000).min(len - at);
                buf[..n].copy_from_slice(&pattern[at..at + n]);
                at += n;
                Ok(n)
            },
            &mut |_| {},
            src,
            4096,
            len,
        )
        .map_err(|e| mismatch(format!("H2D staging: {e}")))?;
    let mut back = vec![0; len];
    src.read(4096, &mut back)?;
    if back != pattern {
        return Err(mismatch("H2D staging: bytes read back differ".into()));
    }
    Ok(())
}

/// CRC-32C on the device over `pattern` (at 4096 in `src`) against the CPU reference.
fn check_crc(engines: &Engines, src: &VmmRegion, pattern: &[u8]) -> Result<(), GpuError> {
    let len = pattern.len();
    let spans = [
        Span {
            off: 4096,
            len: len as u64,
        },
        Span {
            off: 4097,
            len: 12345,
        },
        Span { off: 0, len: 0 },
    ];
    let mut host = vec![0; 4096 + len];
    host[4096..].copy_from_slice(pattern);
    let want = reference::crc32c_spans(&host, &spans, crate::kernels::CRC_CHUNK);
    let got = engines.crc32c(src, &spans)?;
    if got != want {
        return Err(mismatch(format!(
            "CRC kernel gave {got:08x?}, the CPU {want:08x?}"
        )));
    }
    Ok(())
}

/// The gather kernel over unaligned frags of `src` into `dst`, one launch, against the CPU
/// reference.
fn check_gather(engines: &Engines, src: &VmmRegion, dst: &VmmRegion) -> Result<(), GpuError> {
    let frags = [
        Frag {
            src_off: 4096,
            dst_off: 0,
            len: 4096,
        },
        Frag {
            src_off: 4096 + 8191,
            dst_off: 4096,
            len: 1,
        },
        Frag {
            src_off: 4096 + 3,
            dst_off: 4097,
            len: 70_001,
        },
    ];
    engines.gather(src, dst, &frags)?.wait()?;
    let mut want = vec![0u8; 4097 + 70_001];
    let mut host_src = vec![0u8; src.len()];
    src.read(0, &mut host_src)?;
    reference::gather(&host_src, &mut want, &frags);
    let mut got = vec![0u8; want.len()];
    dst.read(0, &mut got)?;
    if got != want {
        return Err(mismatch(
            "gather kernel: bytes differ from the CPU reference".into(),
        ));
    }
    Ok(())
}

fn mismatch(what: String) -> GpuError {
    GpuError::SelfTest { what }
}
