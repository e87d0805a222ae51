//! Tests that need a CUDA GPU (VMM regions, fd and dma-buf export, the kernels, H2D
//! staging), checked against the CPU. Ignored elsewhere; `scripts/gpu-check.sh` runs them.
//! What runs without a GPU: `kernels_on_cpu.rs` (the kernel source's math on the CPU) and
//! the probe tests in `src/probe.rs`.
#![cfg(feature = "cuda")]

use std::os::fd::AsRawFd;

use shardwire_gpu::cuda::{Device, Engines, H2dStager, VmmRegion, open_for_service};
use shardwire_gpu::kernels::{CRC_CHUNK, Frag, Span, reference};
use shardwire_gpu::{MemoryChoice, Region, SlabPool, choose_memory, probe_gpus};

fn gpu() -> std::sync::Arc<Device> {
    let probe = probe_gpus();
    let d = choose_memory(MemoryChoice::Cuda, &probe).expect("a usable CUDA GPU");
    Device::open(d.device.expect("cuda decision names its device").ordinal).expect("open GPU")
}

fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 24) as u8
        })
        .collect()
}

#[test]
#[ignore = "needs CUDA GPU"]
fn service_open_runs_the_self_test() {
    let probe = probe_gpus();
    let d = choose_memory(MemoryChoice::Auto, &probe).unwrap();
    assert_eq!(
        d.memory,
        shardwire_protocol::trainer::MemoryKind::Cuda,
        "{}",
        d.reason
    );
    let mem = open_for_service(d.device.as_ref().unwrap()).expect("self-test");
    assert_eq!(mem.info.ordinal, mem.device.ordinal());
}

#[test]
#[ignore = "needs CUDA GPU"]
fn vmm_region_exports_fd_and_dmabuf_and_round_trips() {
    let dev = gpu();
    let r = VmmRegion::new(&dev, 3 << 20).unwrap();
    assert_eq!(r.len() % r.granularity(), 0);
    assert_eq!(r.len(), 4 << 20);
    let fd = r.export_fd().unwrap();
    assert!(fd.as_raw_fd() >= 0);
    let dmabuf = r.export_dmabuf().unwrap();
    // A dma-buf fd is an anon inode named "dmabuf". (The fake libcuda of CI,
    // gpu/fakecuda, gives a udmabuf where it can, else its allocation's memfd, "fakecuda".)
    let link = std::fs::read_link(format!("/proc/self/fd/{}", dmabuf.as_raw_fd())).unwrap();
    let fake = probe_gpus().devices[0].name.contains("fake CUDA device");
    let link = link.to_string_lossy();
    assert!(
        link.contains("dmabuf") || (fake && link.contains("fakecuda")),
        "{link:?}"
    );
    let data = noise(1 << 20, 7);
    r.write(12345, &data).unwrap();
    let mut back = vec![0; data.len()];
    r.read(12345, &mut back).unwrap();
    assert_eq!(back, data);
    assert!(r.read(r.len() - 10, &mut [0; 11]).is_err());
}

#[test]
#[ignore = "needs CUDA GPU"]
fn crc_kernel_equals_crc_fast_bit_for_bit() {
    let dev = gpu();
    let engines = Engines::new(&dev).unwrap();
    let data = noise(9 << 20, 11);
    let r = VmmRegion::new(&dev, data.len()).unwrap();
    r.write(0, &data).unwrap();
    let mut spans = vec![
        Span {
            off: 0,
            len: data.len() as u64,
        },
        Span { off: 0, len: 0 },
        Span { off: 1, len: 1 },
        Span {
            off: 3,
            len: u64::from(CRC_CHUNK),
        },
        Span {
            off: 5,
            len: u64::from(CRC_CHUNK) + 1,
        },
    ];
    for i in 0..200u64 {
        spans.push(Span {
            off: i * 4099,
            len: i * 997 + 13,
        });
    }
    let got = engines.crc32c(&r, &spans).unwrap();
    for (s, g) in spans.iter().zip(&got) {
        let bytes = &data[s.off as usize..(s.off + s.len) as usize];
        let want = crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, bytes) as u32;
        assert_eq!(*g, want, "span {s:?}");
    }
}

#[test]
#[ignore = "needs CUDA GPU"]
fn gather_kernel_equals_the_cpu_reference() {
    let dev = gpu();
    let engines = Engines::new(&dev).unwrap();
    let data = noise(4 << 20, 3);
    let src = VmmRegion::new(&dev, data.len()).unwrap();
    let dst = VmmRegion::new(&dev, data.len()).unwrap();
    src.write(0, &data).unwrap();
    // Devmem-like frags: 4 KiB pieces at scattered offsets, some unaligned and short.
    let (mut frags, mut d) = (Vec::new(), 0u64);
    for i in 0..900u64 {
        let len = if i % 7 == 0 { 1 + i % 4095 } else { 4096 };
        let src_off = (i * 7919 * 4096 + i * 13) % (data.len() as u64 - 4096);
        frags.push(Frag {
            src_off,
            dst_off: d,
            len,
        });
        d += len;
    }
    let done = engines.gather(&src, &dst, &frags).unwrap();
    done.wait().unwrap();
    assert!(done.is_done().unwrap());
    let mut want = vec![0; d as usize];
    reference::gather(&data, &mut want, &frags);
    let mut got = vec![0; d as usize];
    dst.read(0, &mut got).unwrap();
    assert!(got == want, "gathered bytes differ");
    // Overlapping destinations are refused before any launch.
    let bad = [
        Frag {
            src_off: 0,
            dst_off: 0,
            len: 8,
        },
        Frag {
            src_off: 8,
            dst_off: 4,
            len: 8,
        },
    ];
    assert!(engines.gather(&src, &dst, &bad).is_err());
}

#[test]
#[ignore = "needs CUDA GPU"]
fn gather_assembles_a_batch_from_shards_in_the_same_region() {
    // Batch mode: two shards resident in a stream's region, a batch slab in the same region,
    // the batch's rows (runs of consecutive rows from either shard, per tensor) gathered in
    // one launch with src = dst = the region.
    let dev = gpu();
    let engines = Engines::new(&dev).unwrap();
    let region = VmmRegion::new(&dev, 8 << 20).unwrap();
    let shards = noise(3 << 20, 17);
    region.write(0, &shards).unwrap();
    let (row, batch_at) = (36u64, 5u64 << 20);
    let mut frags = Vec::new();
    let mut d = 0;
    for i in 0..257u64 {
        // Runs of 1..5 rows alternating between shard 0 ([0, 1 MiB)) and shard 1 (after it).
        let rows = 1 + i % 5;
        let shard = (i % 2) * (1 << 20);
        let src_off = shard + (i * 7919 % 20_000) * row;
        frags.push(Frag {
            src_off,
            dst_off: batch_at + d,
            len: rows * row,
        });
        d += rows * row;
    }
    engines
        .gather(&region, &region, &frags)
        .unwrap()
        .wait()
        .unwrap();
    let mut whole = vec![0; 8 << 20];
    whole[..shards.len()].copy_from_slice(&shards);
    let mut want = whole.clone();
    reference::gather(&whole, &mut want, &frags);
    let mut got = vec![0; d as usize];
    region.read(batch_at as usize, &mut got).unwrap();
    assert!(
        got == want[batch_at as usize..(batch_at + d) as usize],
        "batch bytes differ"
    );
    // A frag reading bytes the launch writes is refused before any launch.
    let bad = [
        Frag {
            src_off: 0,
            dst_off: 64,
            len: 32,
        },
        Frag {
            src_off: 80,
            dst_off: 4096,
            len: 8,
        },
    ];
    assert!(engines.gather(&region, &region, &bad).is_err());
}

#[test]
#[ignore = "needs CUDA GPU"]
fn h2d_stager_lands_every_byte_and_slabs_read_back() {
    let dev = gpu();
    let data = noise(10 << 20, 5);
    let region = VmmRegion::new(&dev, 16 << 20).unwrap();
    let pool = SlabPool::new(Region::from(region));
    let slab = pool.alloc(data.len()).unwrap();
    let cuda = slab.region().cuda().unwrap();
    let mut stager = H2dStager::new(&dev, 1 << 20, 4).unwrap();
    let (mut at, mut seen) = (0, 0);
    stager
        .copy_from(
            &mut |buf: &mut [u8]| {
                let n = buf.len().min(65_000).min(data.len() - at);
                buf[..n].copy_from_slice(&data[at..at + n]);
                at += n;
                Ok(n)
            },
            &mut |piece| seen += piece.len(),
            cuda,
            slab.offset(),
            data.len(),
        )
        .unwrap();
    assert_eq!(seen, data.len());
    assert_eq!(slab.read(0, data.len()).unwrap(), data);
    assert!(slab.host_slice().is_none());
    println!("stalls: {}", stager.stalls());
}
