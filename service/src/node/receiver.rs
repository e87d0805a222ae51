//! Receiver threads: one per data connection. Each takes the next announced payload,
//! receives it straight into the shard's slab (host mode: `recv` into the slab, no
//! intermediate buffer; devmem: frags gathered out of the RX binding, see
//! [`super::devmem_rx`]), computes CRC-32C chunk by chunk while the bytes are still in cache,
//! and reports the outcome.

use std::io::Read;
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;

use shardwire_protocol::crc::Crc32c;

use super::Node;
use super::link::{FetchFailure, FetchOutcome, PendingFetch, SourceLink};

/// Largest single `recv`: large enough to amortise the syscall, small enough that the bytes
/// are still in L2 when they are checksummed.
const CHUNK: usize = 1 << 20;

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
    while let Ok(mut p) = rx.recv() {
        if let Some(reason) = &broken {
            p.fail(FetchFailure::Source(reason.clone()));
            continue;
        }
        // One span per fetch: the receive and the verification happen inside it.
        let span = tracing::debug_span!("fetch", req = p.req, shard = p.shard, source = %link.addr);
        let _entered = span.enter();
        match recv_payload(
            &mut sock,
            p.slab.as_mut_slice(),
            flow,
            &node.counters.assembly_ns,
        ) {
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
