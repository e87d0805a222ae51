//! CRC-32C speed of this CPU by working-set size: the same [`Crc32c`] the node uses, over a
//! buffer of each size read again and again (hot when it fits the caches), and over a buffer
//! far larger than the last-level cache (read from memory), plus `memcpy` of the same sizes
//! for reference. Prints GB/s per size; `cargo run --release -p shardwire-protocol --example
//! crc_speed`.

use std::time::Instant;

use shardwire_protocol::crc::Crc32c;

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

fn main() {
    let big = 1usize << 30;
    let buf: Vec<u8> = (0..big)
        .map(|i| ((i * 2_654_435_761usize) >> 13) as u8)
        .collect();
    let mut dst = vec![0u8; big];
    println!("size        crc GB/s   memcpy GB/s");
    for size in [
        16 << 10,
        64 << 10,
        256 << 10,
        1 << 20,
        4 << 20,
        16 << 20,
        256 << 20,
        1 << 30,
    ] {
        let total = (4usize << 30).max(size);
        let passes = total / size;
        // Walk through the 1 GiB buffer in `size` windows when a window is far larger than the
        // caches (cold); re-read one window otherwise (hot).
        let cold = size >= 256 << 20;
        let t = Instant::now();
        let mut x = 0u32;
        for p in 0..passes {
            let at = if cold {
                (p * size) % (big - size + 1)
            } else {
                0
            };
            let mut c = Crc32c::new();
            c.update(&buf[at..at + size]);
            x ^= c.finish();
        }
        let crc = gbps(passes * size, t.elapsed().as_secs_f64());
        let t = Instant::now();
        for p in 0..passes {
            let at = if cold {
                (p * size) % (big - size + 1)
            } else {
                0
            };
            dst[at..at + size].copy_from_slice(&buf[at..at + size]);
        }
        let cp = gbps(passes * size, t.elapsed().as_secs_f64());
        println!("{:>8} KiB {crc:9.1} {cp:12.1}   ({x:08x})", size >> 10);
        std::hint::black_box(&dst);
    }
    after_copy(&buf, &mut dst);
}

/// `rep movsb` of `src` into `dst` (as the kernel's `copy_to_user` on FSRM CPUs).
fn rep_movsb(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len());
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `rep movsb` copies rcx bytes from rsi to rdi; both ranges are the slices'
    // (equal lengths), which do not overlap (`&mut` and `&`).
    unsafe {
        std::arch::asm!(
            "rep movsb",
            inout("rcx") src.len() => _,
            inout("rsi") src.as_ptr() => _,
            inout("rdi") dst.as_mut_ptr() => _,
            options(nostack, preserves_flags)
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// The CRC of bytes right after they were copied into memory that was cold (a window moving
/// through 1 GiB), as a receive leaves them: timed apart from the copy. Hot CRC speed means
/// the copy left the bytes in cache; memory speed means it did not.
fn after_copy(src: &[u8], dst: &mut [u8]) {
    for (name, movsb) in [("memcpy", false), ("rep movsb", true)] {
        println!("{name}: piece       CRC after copy GB/s   (copy GB/s)");
        for piece in [64 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20] {
            let passes = (4usize << 30) / piece;
            let (mut crc_t, mut copy_t, mut x) = (0f64, 0f64, 0u32);
            for p in 0..passes {
                let at = (p * piece) % (dst.len() - piece + 1);
                let t = Instant::now();
                if movsb {
                    rep_movsb(&mut dst[at..at + piece], &src[..piece]);
                } else {
                    dst[at..at + piece].copy_from_slice(&src[..piece]);
                }
                let t1 = Instant::now();
                let mut c = Crc32c::new();
                c.update(&dst[at..at + piece]);
                x ^= c.finish();
                crc_t += t1.elapsed().as_secs_f64();
                copy_t += (t1 - t).as_secs_f64();
            }
            let bytes = passes * piece;
            println!(
                "{:>6} KiB {:12.1} {:18.1}   ({x:08x})",
                piece >> 10,
                gbps(bytes, crc_t),
                gbps(bytes, copy_t)
            );
        }
    }
}
