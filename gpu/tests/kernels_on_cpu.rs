//! The real kernel source on the CPU: compiles `gpu/kernels/shardwire.cu` as C (through
//! `gpu/kernels/host_harness.c`, which runs every thread of a grid serially) with the
//! system C compiler, feeds it random buffers, frags and spans, and compares with crc-fast
//! and the Rust reference. This checks the kernels' arithmetic (tables, slice-by-8, the
//! GF(2) combine, the aligned gather paths) on CI, where there is no GPU.
//!
//! Needs `cc` (or `$CC`), which is there wherever Rust links; without one the tests fail
//! and say so. Builds with AddressSanitizer and UBSan when the compiler can, so an
//! out-of-bounds or misaligned access in a kernel fails too.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use shardwire_gpu::kernels::{
    self, CRC_BLOCK, CRC_CHUNK, Frag, GATHER_BLOCK, Span, check_frags, check_spans, reference,
};

/// What the harness leaves in partials no thread wrote.
const UNWRITTEN: u32 = 0xA5A5_A5A5;

fn kernels_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels")
}

fn work_dir() -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "kernels_on_cpu-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).expect("create a test dir");
    dir
}

/// The harness binary, compiled once per test process.
fn harness() -> &'static Path {
    static HARNESS: OnceLock<PathBuf> = OnceLock::new();
    HARNESS.get_or_init(compile_harness)
}

fn compile_harness() -> PathBuf {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_owned());
    let dir = work_dir();
    let bin = dir.join("harness");
    let source = kernels_dir().join("host_harness.c");
    let compile = |extra: &[&str]| {
        let out = Command::new(&cc)
            .args([
                "-x",
                "c",
                "-std=c11",
                "-O2",
                "-Wall",
                "-Wextra",
                "-fno-strict-aliasing",
            ])
            .args(extra)
            .arg("-I")
            .arg(kernels_dir())
            .arg("-o")
            .arg(&bin)
            .arg(&source)
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run the C compiler `{cc}` ({e}). These tests compile \
                     gpu/kernels/shardwire.cu as C to check the kernels on the CPU: install one \
                     (Debian: apt-get install gcc) or point CC at one"
                )
            });
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let sanitized = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"];
    let (ok, log) = compile(&sanitized);
    if ok && smoke(&bin) {
        return bin;
    }
    eprintln!(
        "note: no sanitizer build ({}); building the harness without",
        log.trim()
    );
    let (ok, log) = compile(&[]);
    assert!(ok, "`{cc}` failed on {}:\n{log}", source.display());
    assert!(smoke(&bin), "the harness does not run: {}", bin.display());
    bin
}

/// Whether the binary runs at all (a sanitizer runtime may not start in some sandboxes).
fn smoke(bin: &Path) -> bool {
    let dir = work_dir();
    for name in ["base", "spans"] {
        std::fs::write(dir.join(name), []).expect("write");
    }
    let status = harness_command(bin)
        .arg("crc")
        .args([dir.join("base"), dir.join("spans")])
        .args(["16", "1", "128"])
        .arg(dir.join("out"))
        .status();
    std::fs::remove_dir_all(&dir).ok();
    matches!(status, Ok(s) if s.success())
}

fn harness_command(bin: &Path) -> Command {
    let mut cmd = Command::new(bin);
    // LeakSanitizer needs ptrace, which containers often refuse; leaks do not matter here.
    cmd.env("ASAN_OPTIONS", "detect_leaks=0:abort_on_error=0");
    cmd
}

fn run(args: &[&dyn AsRef<std::ffi::OsStr>]) {
    let out = harness_command(harness())
        .args(args.iter().map(|a| a.as_ref()))
        .output()
        .expect("run the harness");
    assert!(
        out.status.success(),
        "harness failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

fn frag_bytes(frags: &[Frag]) -> Vec<u8> {
    frags
        .iter()
        .flat_map(|f| [f.src_off, f.dst_off, f.len])
        .flat_map(u64::to_le_bytes)
        .collect()
}

fn span_bytes(spans: &[Span]) -> Vec<u8> {
    spans
        .iter()
        .flat_map(|s| [s.off, s.len])
        .flat_map(u64::to_le_bytes)
        .collect()
}

/// `sw_gather` on the CPU with `grid` blocks of `block` threads; returns the new `dst`.
fn gather_on_cpu(src: &[u8], dst: &[u8], frags: &[Frag], grid: u32, block: u32) -> Vec<u8> {
    let dir = work_dir();
    let [s, d, f, o] = ["src", "dst", "frags", "out"].map(|n| dir.join(n));
    std::fs::write(&s, src).expect("write");
    std::fs::write(&d, dst).expect("write");
    std::fs::write(&f, frag_bytes(frags)).expect("write");
    let (grid, block) = (grid.to_string(), block.to_string());
    run(&[&"gather", &s, &d, &f, &grid, &block, &o]);
    let out = std::fs::read(&o).expect("read the harness output");
    std::fs::remove_dir_all(&dir).ok();
    out
}

/// Both CRC kernels on the CPU with the contract's geometry; returns (CRCs, partials).
fn crc_on_cpu(base: &[u8], spans: &[Span], chunk: u32, max_chunks: u32) -> (Vec<u32>, Vec<u32>) {
    let dir = work_dir();
    let [b, s, o] = ["base", "spans", "out"].map(|n| dir.join(n));
    std::fs::write(&b, base).expect("write");
    std::fs::write(&s, span_bytes(spans)).expect("write");
    let (chunk, max_chunks, block) = (
        chunk.to_string(),
        max_chunks.to_string(),
        CRC_BLOCK.to_string(),
    );
    run(&[&"crc", &b, &s, &chunk, &max_chunks, &block, &o]);
    let words: Vec<u32> = std::fs::read(&o)
        .expect("read the harness output")
        .chunks_exact(4)
        .map(|w| u32::from_le_bytes(w.try_into().expect("4 bytes")))
        .collect();
    std::fs::remove_dir_all(&dir).ok();
    let (crcs, partials) = words.split_at(spans.len());
    (crcs.to_vec(), partials.to_vec())
}

/// Small deterministic generator (splitmix64), so a failure reproduces.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next() as u8).collect()
    }
}

fn crc_fast(bytes: &[u8]) -> u32 {
    crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, bytes) as u32
}

/// Runs the CRC kernels and checks CRCs, every partial, and that nothing else was written.
fn check_crc(base: &[u8], spans: &[Span], chunk: u32) {
    check_spans(spans, base.len() as u64).expect("valid spans");
    let max_chunks = kernels::crc_max_chunks(spans, chunk);
    let (crcs, partials) = crc_on_cpu(base, spans, chunk, max_chunks);
    for (i, (span, &got)) in spans.iter().zip(&crcs).enumerate() {
        let bytes = &base[span.off as usize..(span.off + span.len) as usize];
        assert_eq!(
            got,
            crc_fast(bytes),
            "span {i} {span:?}, chunk {chunk}: CRC"
        );
        let row = &partials[i * max_chunks as usize..][..max_chunks as usize];
        let want = reference::chunk_crcs(base, *span, chunk);
        assert_eq!(
            &row[..want.len()],
            &want[..],
            "span {i} {span:?}, chunk {chunk}: partials"
        );
        assert!(
            row[want.len()..].iter().all(|&w| w == UNWRITTEN),
            "span {i}: a thread wrote past its span's chunks"
        );
    }
    assert_eq!(crcs, reference::crc32c_spans(base, spans, chunk));
}

#[test]
fn crc_at_chunk_edges_and_unaligned_offsets() {
    let mut rng = Rng(1);
    let base = rng.bytes(70_000);
    // 100 is not a multiple of 8, so chunks of one span start at every alignment.
    for chunk in [8, 64, 100, 4096, CRC_CHUNK] {
        let c = u64::from(chunk);
        let mut spans = Vec::new();
        for len in [
            0,
            1,
            7,
            8,
            9,
            15,
            16,
            17,
            c - 1,
            c,
            c + 1,
            2 * c,
            3 * c - 1,
            3 * c + 1,
        ] {
            for off in [0, 1, 3, 4, 8, 13] {
                if off + len <= base.len() as u64 {
                    spans.push(Span { off, len });
                }
            }
        }
        check_crc(&base, &spans, chunk);
    }
}

#[test]
fn crc_random_spans() {
    let mut rng = Rng(2);
    for case in 0..12 {
        let len = rng.below(200_000) as usize + 1;
        let base = rng.bytes(len);
        let chunk = match case % 4 {
            0 => CRC_CHUNK,
            1 => rng.below(64) as u32 + 1,
            _ => rng.below(9000) as u32 + 1,
        };
        // Up to 300 spans: the combine grid then has more than one block.
        let spans: Vec<Span> = (0..rng.below(300) + 1)
            .map(|_| {
                let off = rng.below(base.len() as u64 + 1);
                let len = match rng.below(4) {
                    0 => 0,
                    1 => rng.below(40),
                    _ => rng.below(base.len() as u64 - off + 1),
                };
                Span { off, len }
            })
            .collect();
        check_crc(&base, &spans, chunk);
    }
}

#[test]
fn crc_no_spans() {
    check_crc(&[], &[], CRC_CHUNK);
    check_crc(&[1, 2, 3], &[Span::default(); 3], CRC_CHUNK);
}

/// Frags tiling random pieces of the destination with gaps, in random order; lengths
/// around the 4- and 16-byte paths; source offsets aligned, co-aligned and skewed.
fn random_frags(rng: &mut Rng, src_len: u64, nfrags: u64) -> (Vec<Frag>, u64) {
    let mut frags = Vec::new();
    let mut at = rng.below(20);
    for _ in 0..nfrags {
        let len = match rng.below(6) {
            0 => [0, 1, 3, 4, 5, 15, 16, 17, 31, 32, 33][rng.below(11) as usize],
            1 => rng.below(64),
            2 => rng.below(5000),
            _ => rng.below(600),
        }
        .min(src_len);
        let mut src_off = rng.below(src_len - len + 1);
        match rng.below(4) {
            // Co-aligned with the destination mod 16, or mod 4 (when it stays in range).
            0 => src_off = (src_off & !15) | (at & 15),
            1 => src_off = (src_off & !3) | (at & 3),
            _ => {}
        }
        if src_off + len > src_len {
            src_off = rng.below(src_len - len + 1);
        }
        frags.push(Frag {
            src_off,
            dst_off: at,
            len,
        });
        at += len + rng.below(3) * rng.below(20);
    }
    for i in (1..frags.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        frags.swap(i, j);
    }
    (frags, at + rng.below(20))
}

fn check_gather(src: &[u8], dst: &[u8], frags: &[Frag], grid: u32, block: u32) {
    check_frags(frags, src.len() as u64, dst.len() as u64).expect("valid frags");
    let got = gather_on_cpu(src, dst, frags, grid, block);
    let mut want = dst.to_vec();
    reference::gather(src, &mut want, frags);
    let mut naive = dst.to_vec();
    for f in frags {
        for i in 0..f.len as usize {
            naive[f.dst_off as usize + i] = src[f.src_off as usize + i];
        }
    }
    assert_eq!(want, naive, "the reference gather is not a plain copy");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!(
            "byte {i} of dst differs (grid {grid}, block {block}, {} frags)",
            frags.len()
        );
    }
}

#[test]
fn gather_random_frags() {
    let mut rng = Rng(3);
    for case in 0..16 {
        let len = rng.below(100_000) as usize + 64;
        let src = rng.bytes(len);
        let nfrags = rng.below(300) + 1;
        let (frags, dst_len) = random_frags(&mut rng, src.len() as u64, nfrags);
        let dst = rng.bytes(dst_len as usize);
        let n = frags.len() as u32;
        // The contract's geometry, then fewer blocks than frags and odd block sizes, so
        // both grid-stride loops run more than once.
        let (grid, block) = match case % 4 {
            0 | 1 => (kernels::gather_grid(n), GATHER_BLOCK),
            2 => (3, 7),
            _ => (rng.below(40) as u32 + 1, rng.below(300) as u32 + 1),
        };
        check_gather(&src, &dst, &frags, grid, block);
    }
}

#[test]
fn gather_each_alignment_path() {
    let mut rng = Rng(4);
    let src = rng.bytes(4096);
    for len in [0, 1, 3, 4, 5, 15, 16, 17, 33, 100, 1000] {
        for (src_off, dst_off) in [(0, 0), (16, 32), (3, 19), (5, 1), (4, 8), (1, 2), (7, 0)] {
            let frags = [Frag {
                src_off,
                dst_off,
                len,
            }];
            let dst = rng.bytes(dst_off as usize + len as usize + 5);
            check_gather(&src, &dst, &frags, 1, GATHER_BLOCK);
            check_gather(&src, &dst, &frags, 1, 5);
        }
    }
    check_gather(&src, &[], &[], kernels::gather_grid(0), GATHER_BLOCK);
}
