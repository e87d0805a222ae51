//! GPU benchmark for `scripts/gpu-check.sh` (needs a CUDA GPU): the gather kernel against
//! `cuMemcpyDtoD` of the same bytes, the CRC-32C kernel, and the H2D staging path, each as
//! GB/s measured in the same run. Prints one JSON object.
//!
//! `cargo run --release -p shardwire-gpu --example gpu_bench [-- MIB]` (default 256 MiB).

use std::sync::Arc;
use std::time::Instant;

use shardwire_gpu::cuda::{Device, Engines, Event, H2dStager, VmmRegion};
use shardwire_gpu::kernels::{Frag, Span};
use shardwire_gpu::{MemoryChoice, choose_memory, probe_gpus};

const ROUNDS: usize = 20;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> Res<()> {
    let mib: usize = std::env::args().nth(1).map_or(Ok(256), |s| s.parse())?;
    let len = mib << 20;
    let probe = probe_gpus();
    let decision = choose_memory(MemoryChoice::Cuda, &probe)?;
    let info = decision.device.expect("cuda decision names its device");
    let dev = Device::open(info.ordinal)?;
    let engines = Engines::new(&dev)?;
    let src = VmmRegion::new(&dev, len)?;
    let dst = VmmRegion::new(&dev, len)?;
    let data: Vec<u8> = (0..len)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    src.write(0, &data)?;

    let c = copies(&dev, &engines, (&src, &dst), len)?;
    let shards: Vec<Span> = (0..8)
        .map(|i| Span {
            off: (i * len / 8) as u64,
            len: (len / 8) as u64,
        })
        .collect();
    let t = Instant::now();
    for _ in 0..ROUNDS {
        engines.crc32c(&src, &shards)?;
    }
    let crc_s = t.elapsed().as_secs_f64();

    let mut stager = H2dStager::new(&dev, 1 << 20, 4)?;
    let h2d_s = staged(&mut stager, &data, &dst)?;
    let bytes = (len * ROUNDS) as f64;
    let h2d_bytes = (len * (ROUNDS / 4)) as f64;
    let gbps = |b: f64, s: f64| b / s / 1e9;
    println!(
        "{}",
        serde_json::json!({
            "device": format!("{} ({})", info.name, info.pci_bus_id),
            "buffer_mib": mib,
            "rounds": ROUNDS,
            "gather_gbps": gbps(bytes, c.gather_s),
            "memcpy_dtod_gbps": gbps(bytes, c.copy_s),
            "gather_vs_dtod": c.copy_s / c.gather_s,
            "gather_frags": len / 4096,
            "gather_cpu_us_per_launch": c.gather_cpu_s / ROUNDS as f64 * 1e6,
            "gather_64k_frags_gbps": gbps(bytes, c.big_s),
            "crc32c_gbps": gbps(bytes, crc_s),
            "h2d_staged_gbps": gbps(h2d_bytes, h2d_s),
            "h2d_stalls": stager.stalls(),
        })
    );
    Ok(())
}

/// `len` bytes in frags of `frag` bytes, read from the source in a scattered order (as a
/// devmem receive's pages land) and written in order.
fn scattered(len: usize, frag: u64) -> Vec<Frag> {
    let n = len as u64 / frag;
    (0..n)
        .map(|i| Frag {
            src_off: (i * 7919 % n) * frag,
            dst_off: i * frag,
            len: frag,
        })
        .collect()
}

/// GPU seconds (events) and CPU seconds spent enqueueing, over [`ROUNDS`] calls of `f` after
/// two warm-up ones (both argument slots get their buffers).
fn timed(dev: &Arc<Device>, engines: &Engines, f: &mut dyn FnMut() -> Res<()>) -> Res<(f64, f64)> {
    f()?;
    f()?;
    engines.stream().synchronize()?;
    let start = Event::new(dev, true)?;
    let end = Event::new(dev, true)?;
    start.record(engines.stream())?;
    let cpu = Instant::now();
    for _ in 0..ROUNDS {
        f()?;
    }
    let cpu = cpu.elapsed().as_secs_f64();
    end.record(engines.stream())?;
    end.wait()?;
    Ok((f64::from(end.elapsed_ms(&start)?) / 1e3, cpu))
}

/// The device-side copies of `len` bytes, each timed over [`ROUNDS`] launches.
struct Timings {
    /// Gather of 4 KiB frags: GPU seconds, and CPU seconds spent enqueueing.
    gather_s: f64,
    gather_cpu_s: f64,
    /// The same bytes in 64 KiB frags (16 times fewer: what each frag costs).
    big_s: f64,
    /// `cuMemcpyDtoD` of the same bytes, the yardstick.
    copy_s: f64,
}

fn copies(
    dev: &Arc<Device>,
    engines: &Engines,
    (src, dst): (&VmmRegion, &VmmRegion),
    len: usize,
) -> Res<Timings> {
    // The launches are kept (not waited for one by one) until the timing is over.
    let mut launched = Vec::new();
    let mut gather = |frags: &[Frag]| {
        let t = timed(dev, engines, &mut || {
            launched.push(engines.gather(src, dst, frags)?);
            Ok(())
        });
        launched.clear();
        t
    };
    let (gather_s, gather_cpu_s) = gather(&scattered(len, 4096))?;
    let (big_s, _) = gather(&scattered(len, 65536))?;
    let (copy_s, _) = timed(dev, engines, &mut || {
        launched.push(engines.copy(src, 0, dst, 0, len)?);
        Ok(())
    })?;
    Ok(Timings {
        gather_s,
        gather_cpu_s,
        big_s,
        copy_s,
    })
}

/// Seconds to stage `data` into `dst` through `stager` `ROUNDS / 4` times.
fn staged(stager: &mut H2dStager, data: &[u8], dst: &VmmRegion) -> Res<f64> {
    let t = Instant::now();
    for _ in 0..ROUNDS / 4 {
        let mut at = 0;
        stager.copy_from(
            &mut |buf: &mut [u8]| {
                let n = buf.len().min(data.len() - at);
                buf[..n].copy_from_slice(&data[at..at + n]);
                at += n;
                Ok(n)
            },
            &mut |_| {},
            dst,
            0,
            data.len(),
        )?;
    }
    Ok(t.elapsed().as_secs_f64())
}
