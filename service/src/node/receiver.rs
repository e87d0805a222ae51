//! Receiver threads: one per data connection. Each takes the next announced payload,
//! receives it straight into the shard's slab (host mode: `recv` into the slab, no
//! intermediate buffer; devmem: frags gathered out of the RX binding, see
//! [`super::devmem_rx`]; CUDA memory: `recv` into pinned buffers whose asynchronous H2D
//! copies overlap the next `recv`s, see `shardwire_gpu::cuda::H2dStager`), computes CRC-32C
//! chunk by chunk while the bytes are still in cache, and reports the outcome.

use std::io::Read;
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;

use shardwire_gpu::Slab;
use shardwire_gpu::cuda::H2dStager;
use shardwire_protocol::crc::Crc32c;

use super::Node;
use super::link::{FetchFailure, FetchOutcome, PendingFetch, SourceLink};

/// Largest single `recv`: large enough to amortise the syscall, small enough that the bytes
/// are still in L2 when they are checksummed.
const CHUNK: usize = 1 << 20;

/// Pinned buffers per receiver in CUDA memory mode: while one is copied to the GPU the
/// socket fills the next; four absorb a copy that runs late without stalling `recv`.
const STAGING_BUFFERS: usize = 4;

/// A payload that stops arriving for this long (a source that is alive on its control
/// connection but stalls a data connection) fails the fetch and resets the link.
pub const DATA_STALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// Per-flow counters (for `shardwire bench`).
#[derive(Debug, Default)]
pub struct FlowStats {
    /// Bytes received on this flow.
    pub bytes: std::sync::atomic::AtomicU64,
}

/// Where a receiver reads payload bytes from: the socket itself (host mode) or the devmem
/// path (frags gathered out of the RX binding).
#[derive(Debug)]
enum PayloadReader {
    Plain(TcpStream),
    Devmem(super::devmem_rx::DevmemReader),
}

impl PayloadReader {
    fn read_some(&mut self, dst: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Self::Plain(s) => s.read(dst),
            Self::Devmem(r) => r.read_some(dst),
        }
    }
}

/// Starts the receiver thread for one identified data connection.
pub fn spawn(
    node: Arc<Node>,
    link: Arc<SourceLink>,
    conn: u16,
    sock: TcpStream,
    rx: Receiver<PendingFetch>,
) {
    if let Err(e) = sock.set_read_timeout(Some(DATA_STALL_TIMEOUT)) {
        tracing::error!(source = %link.addr, conn, error = %e, "cannot set a read timeout on a data connection; dropping it");
        link.kick();
        return;
    }
    let sock = match node.devmem() {
        None => PayloadReader::Plain(sock),
        Some(region) => match region.reader(sock) {
            Ok(r) => PayloadReader::Devmem(r),
            Err(e) => {
                tracing::error!(source = %link.addr, conn, error = %e, "cannot read this data connection through the devmem path; dropping it");
                link.kick();
                return;
            }
        },
    };
    let flow = Arc::new(FlowStats::default());
    node.flows
        .lock()
        .expect("poisoned")
        .push((link.addr.clone(), conn, Arc::clone(&flow)));
    std::thread::Builder::new()
        .name(format!("sw-recv-{}-{conn}", link.index))
        .spawn(move || run(&node, &link, sock, &rx, &flow))
        .expect("spawn receiver thread");
}

fn run(
    node: &Node,
    link: &SourceLink,
    mut sock: PayloadReader,
    rx: &Receiver<PendingFetch>,
    flow: &FlowStats,
) {
    let mut broken: Option<String> = None;
    let mut gpu = GpuScratch::default();
    while let Ok(mut p) = rx.recv() {
        if let Some(reason) = &broken {
            p.fail(FetchFailure::Source(reason.clone()));
            continue;
        }
        // One span per fetch: the receive and the verification happen inside it.
        let span = tracing::debug_span!("fetch", req = p.req, shard = p.shard, source = %link.addr);
        let _entered = span.enter();
        let received = match p.slab.host_slice_mut() {
            Some(dst) => recv_payload(&mut sock, dst, flow, &node.counters.assembly_ns)
                .map_err(|e| e.to_string()),
            None => recv_payload_gpu(node, &mut gpu, &mut sock, &p.slab, flow),
        };
        match received {
            Ok(got) => {
                let result = if got == p.crc32c {
                    node.counters
                        .bytes_received
                        .fetch_add(p.length, Ordering::Relaxed);
                    node.counters
                        .shards_received
                        .fetch_add(1, Ordering::Relaxed);
                    link.bytes.fetch_add(p.length, Ordering::Relaxed);
                    Ok(())
                } else {
                    node.counters.crc_failures.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(source = %link.addr, shard = p.shard, got = format!("{got:08x}"), want = format!("{:08x}", p.crc32c),
                        "CRC-32C mismatch: the shard will be fetched again");
                    Err(FetchFailure::Crc {
                        got,
                        want: p.crc32c,
                    })
                };
                let _ = p.done.send(FetchOutcome {
                    pos: p.pos,
                    shard: p.shard,
                    slab: p.slab,
                    source: p.source,
                    result,
                    issued: p.issued,
                });
            }
            Err(e) => {
                let reason = format!("data connection from {} failed mid-shard: {e}", link.addr);
                p.fail(FetchFailure::Source(reason.clone()));
                broken = Some(reason);
                link.kick();
            }
        }
    }
}

/// A receiver thread's buffers for CUDA memory, made on first use and kept for the next
/// payloads.
#[derive(Default)]
struct GpuScratch {
    /// Pinned staging buffers (host receive).
    stager: Option<H2dStager>,
    /// Where linear bytes land on the GPU-direct devmem path.
    host: Vec<u8>,
}

/// Receives a payload into a slab in CUDA memory through this thread's pinned staging
/// buffers, returning the CRC-32C computed while each piece was in host memory. The copies
/// have landed when this returns.
fn recv_payload_gpu(
    node: &Node,
    scratch: &mut GpuScratch,
    sock: &mut PayloadReader,
    slab: &Slab,
    flow: &FlowStats,
) -> Result<u32, String> {
    let (Some(gpu), Some(region)) = (&node.cuda, slab.region().cuda()) else {
        return Err("a CUDA slab on a node without a GPU".to_owned());
    };
    if let PayloadReader::Devmem(r) = sock
        && r.gpu_gather()
    {
        if scratch.host.is_empty() {
            scratch.host = vec![0u8; CHUNK];
        }
        return recv_payload_gpu_direct(
            gpu,
            r,
            region,
            slab,
            flow,
            &node.counters,
            &mut scratch.host,
        );
    }
    let stager = match &mut scratch.stager {
        Some(s) => s,
        None => scratch.stager.insert(
            H2dStager::new(&gpu.device, CHUNK, STAGING_BUFFERS)
                .map_err(|e| format!("pinned staging buffers: {e}"))?,
        ),
    };
    let stalls = stager.stalls();
    let mut verify = std::time::Duration::ZERO;
    let mut crc = Crc32c::new();
    stager
        .copy_from(
            &mut |buf| sock.read_some(buf),
            &mut |piece| {
                let t = std::time::Instant::now();
                crc.update(piece);
                verify += t.elapsed();
                flow.bytes.fetch_add(piece.len() as u64, Ordering::Relaxed);
            },
            region,
            slab.offset(),
            slab.len(),
        )
        .map_err(|e| e.to_string())?;
    let c = &node.counters;
    c.assembly_ns
        .fetch_add(verify.as_nanos() as u64, Ordering::Relaxed);
    c.staging_stalls
        .fetch_add(stager.stalls() - stalls, Ordering::Relaxed);
    Ok(crc.finish())
}

/// Receives a payload on the devmem path into a slab in CUDA memory: each `recvmsg`'s frags
/// are gathered on the GPU (see `DevmemReader::read_into_gpu`), so the bytes never enter
/// host memory, and the CRC-32C is computed on the GPU by the CRC kernel at the end.
fn recv_payload_gpu_direct(
    gpu: &shardwire_gpu::cuda::CudaMemory,
    reader: &mut super::devmem_rx::DevmemReader,
    region: &shardwire_gpu::cuda::VmmRegion,
    slab: &Slab,
    flow: &FlowStats,
    counters: &super::Counters,
    host: &mut [u8], // linear bytes land here
) -> Result<u32, String> {
    let mut off = 0;
    while off < slab.len() {
        let want = (slab.len() - off).min(host.len());
        let n = match reader.read_into_gpu(region, slab.offset() + off, &mut host[..want]) {
            Ok(0) => {
                return Err(format!(
                    "connection closed after {off} of {} payload bytes",
                    slab.len()
                ));
            }
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.to_string()),
        };
        off += n;
        flow.bytes.fetch_add(n as u64, Ordering::Relaxed);
    }
    let t = std::time::Instant::now();
    let span = shardwire_gpu::kernels::Span {
        off: slab.offset() as u64,
        len: slab.len() as u64,
    };
    let crc = gpu
        .engines
        .crc32c(region, &[span])
        .map_err(|e| format!("CRC-32C on the GPU: {e}"))?;
    counters
        .assembly_ns
        .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
    Ok(crc[0])
}

/// Fills `dst` from the socket, returning the CRC-32C of what arrived. Each `recv` takes
/// whatever the socket holds (up to `CHUNK`), and that piece is checksummed right away,
/// while it is still in cache.
fn recv_payload(
    sock: &mut PayloadReader,
    dst: &mut [u8],
    flow: &FlowStats,
    assembly_ns: &std::sync::atomic::AtomicU64,
) -> std::io::Result<u32> {
    let mut verify = std::time::Duration::ZERO;
    let mut crc = Crc32c::new();
    let mut off = 0;
    while off < dst.len() {
        let end = (off + CHUNK).min(dst.len());
        let n = match sock.read_some(&mut dst[off..end]) {
            Ok(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!(
                        "connection closed after {off} of {} payload bytes",
                        dst.len()
                    ),
                ));
            }
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        let t = std::time::Instant::now();
        crc.update(&dst[off..off + n]);
        verify += t.elapsed();
        off += n;
        flow.bytes.fetch_add(n as u64, Ordering::Relaxed);
    }
    assembly_ns.fetch_add(verify.as_nanos() as u64, Ordering::Relaxed);
    Ok(crc.finish())
}
