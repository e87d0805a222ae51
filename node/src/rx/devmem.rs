//! The devmem path: a data connection whose payload lands in the RX binding's dma-buf as
//! frags (`recvmsg(MSG_SOCK_DEVMEM)`, or the emulator's equivalent over ordinary TCP).
//!
//! [`DevmemReader`] reads payload bytes through the binding: one `recvmsg` per call, the
//! frags gathered into the shard's slab, and the tokens returned right after the gather, so
//! the binding's pool refills as fast as the receiver runs. Host memory: a memcpy out of the
//! host dma-buf ([`DevmemReader::read_some`], placed by [`super::recv::Host`] or, for CUDA
//! slabs without GPU gather, [`super::staged::Staged`]). CUDA memory with a GPU binding
//! ([`GpuDirect`]): the gather kernel copies each `recvmsg`'s frags from the dma-buf into the
//! slab on the GPU, the tokens go back once the launch's event says the frags were read, and
//! the CRC-32C is computed at the end by the CRC kernel of the slab's GPU. A full pool makes
//! the emulated NIC wait: backpressure, not loss. Bytes that arrive outside the dma-buf
//! (LINEAR frags, ordinary TCP) are still placed correctly but counted and reported as a
//! header-split or steering problem. Every frag must name this connection's lane's binding:
//! a frag of another binding (its flow landed on another lane's queue: a steering error) is
//! counted in the binding's `steering_errors`, its tokens go back as always, and the payload
//! fails, so it is fetched again and never delivered.

use std::io;
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use shardwire_devmem::gather::{GatherError, GatherPlan, gather, plan};
use shardwire_devmem::{DevmemRecv, TokenBatcher};
use shardwire_gpu::cuda::{CudaMemory, DeviceRange, VmmRegion};
use shardwire_gpu::kernels::Frag;

use super::error::RxError;
use super::shared::{CHUNK, Gpus, Pace, PayloadRead, Place, Tally, read_failed};
use crate::binding::{FlowRule, RxRegion};
use crate::fetch::InFlight;

/// Payload reader of one data connection on the devmem path.
pub struct DevmemReader {
    sock: Box<dyn DevmemRecv + Send>,
    region: Arc<RxRegion>,
    tokens: TokenBatcher,
    /// Scratch of the GPU gather (reused per call).
    plan: GatherPlan,
    frags: Vec<Frag>,
    warned: bool,
    /// This connection's steering rule (emulated or on the NIC), deleted when it closes.
    _rule: FlowRule,
}

impl std::fmt::Debug for DevmemReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevmemReader")
            .field("binding", &self.region.id())
            .finish_non_exhaustive()
    }
}

fn to_io(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

/// A devmem socket's error as an I/O error of the same kind as the syscall's, if it was one:
/// a receive that timed out stays `WouldBlock` ([`read_failed`] names the stall).
fn devmem_io(e: shardwire_devmem::DevmemError) -> io::Error {
    let kind = match &e {
        shardwire_devmem::DevmemError::Syscall { source, .. } => source.kind(),
        _ => io::ErrorKind::Other,
    };
    io::Error::new(kind, e.to_string())
}

impl PayloadRead for DevmemReader {
    fn read_some(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        DevmemReader::read_some(self, dst)
    }
}

impl DevmemReader {
    /// A reader of data connection `sock` through `region`, its flow steered to one of the
    /// binding's queues before its first byte is read.
    pub fn new(region: &Arc<RxRegion>, sock: TcpStream) -> io::Result<Self> {
        let rule = region.steer(&sock)?;
        Ok(Self {
            _rule: rule,
            sock: region.recv_socket(sock)?,
            region: Arc::clone(region),
            tokens: TokenBatcher::new(),
            plan: GatherPlan::default(),
            frags: Vec::new(),
            warned: false,
        })
    }

    /// True when this reader gathers into GPU memory ([`Self::read_into_gpu`]).
    pub fn gpu_gather(&self) -> bool {
        self.region.gpu_gather()
    }

    /// Receive up to `dst.len()` payload bytes into `dst` (in stream order); 0 at EOF.
    /// For a binding whose frags lie in GPU memory this is an error (use
    /// [`Self::read_into_gpu`]).
    pub fn read_some(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        let Some(mem) = self.region.mem() else {
            return Err(io::Error::other(
                "this binding's dma-buf is GPU memory: its frags can only be gathered on the GPU",
            ));
        };
        let c = &self.region.counters;
        let batch = self.sock.recv_frags(dst).map_err(devmem_io)?;
        if batch.is_eof() {
            return Ok(0);
        }
        let gathered = gather(&batch, dst, mem, self.region.id(), &mut self.tokens);
        // Tokens go back right after the gather, even when it failed.
        let returned = self.sock.return_tokens(&mut self.tokens);
        // A refused gather (a frag of another binding) is counted whatever the return did.
        let gathered = gathered.map_err(|e| self.refused(e));
        let freed = returned.map_err(to_io)?;
        c.tokens_returned.fetch_add(freed as u64, Ordering::Relaxed);
        let g = gathered?;
        c.frags.fetch_add(g.dmabuf_frags as u64, Ordering::Relaxed);
        c.dmabuf_bytes.fetch_add(g.dmabuf_bytes, Ordering::Relaxed);
        if g.linear_bytes > 0 || g.plain_bytes > 0 {
            c.linear_bytes.fetch_add(g.linear_bytes, Ordering::Relaxed);
            c.plain_bytes.fetch_add(g.plain_bytes, Ordering::Relaxed);
            if !std::mem::replace(&mut self.warned, true) {
                tracing::warn!(
                    linear_bytes = g.linear_bytes,
                    plain_bytes = g.plain_bytes,
                    "payload arrived in host memory on a devmem connection: check header split (tcp-data-split on, hds-thresh 0) and that the data port is steered to the bound queues; the bytes are still delivered"
                );
            }
        }
        Ok(g.bytes)
    }

    /// A batch the gather refused, as the payload's error; a frag of another binding is
    /// counted as a steering error.
    fn refused(&self, e: GatherError) -> io::Error {
        if let GatherError::ForeignBinding { got, want } = e {
            self.region
                .counters
                .steering_errors
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                frag_binding = got,
                lane_binding = want,
                "a frag of another lane's binding reached this connection (steered to another NIC's queue): tokens returned, the payload is fetched again"
            );
        }
        io::Error::other(e)
    }

    /// Receive up to `host.len()` payload bytes into GPU region `dst` at `dst_off` (in
    /// stream order); 0 at EOF. Dma-buf frags are copied by the gather kernel (one launch);
    /// bytes that arrived in host memory (linear or ordinary TCP, landed in `host`) are
    /// copied up. Tokens go back once the gather's event completes, also after an error.
    pub fn read_into_gpu(
        &mut self,
        dst: &VmmRegion,
        dst_off: usize,
        host: &mut [u8],
    ) -> io::Result<usize> {
        let region = Arc::clone(&self.region);
        let Some((cuda, src)) = region.gpu_source() else {
            return Err(io::Error::other(
                "this binding has no GPU gather (the node runs on host memory)",
            ));
        };
        let batch = self.sock.recv_frags(host).map_err(devmem_io)?;
        if batch.is_eof() {
            return Ok(0);
        }
        self.tokens.push_batch(&batch);
        let planned = plan(&batch, region.id(), host.len(), &mut self.plan);
        let copied = planned
            .map_err(|e| self.refused(e))
            .and_then(|()| self.copy_planned(cuda, src, dst, dst_off, host));
        let freed = self.sock.return_tokens(&mut self.tokens).map_err(to_io)?;
        let c = &region.counters;
        c.tokens_returned.fetch_add(freed as u64, Ordering::Relaxed);
        copied?;
        let p = &self.plan;
        c.frags.fetch_add(p.dmabuf.len() as u64, Ordering::Relaxed);
        c.dmabuf_bytes
            .fetch_add(p.dmabuf_bytes(), Ordering::Relaxed);
        let (linear, plain) = if p.plain {
            (0, p.bytes as u64)
        } else {
            (p.linear_bytes(), 0)
        };
        if linear > 0 || plain > 0 {
            c.linear_bytes.fetch_add(linear, Ordering::Relaxed);
            c.plain_bytes.fetch_add(plain, Ordering::Relaxed);
            if !std::mem::replace(&mut self.warned, true) {
                tracing::warn!(
                    linear_bytes = linear,
                    plain_bytes = plain,
                    "payload arrived in host memory on a devmem connection: check header split and steering; the bytes are still delivered"
                );
            }
        }
        Ok(p.bytes)
    }

    /// Carries out `self.plan`: host pieces copied up, dma-buf frags gathered by the kernel;
    /// returns when the kernel has read every frag.
    fn copy_planned(
        &mut self,
        cuda: &CudaMemory,
        src: &dyn DeviceRange,
        dst: &VmmRegion,
        dst_off: usize,
        host: &[u8],
    ) -> io::Result<()> {
        let p = &self.plan;
        if p.plain {
            return dst.write(dst_off, &host[..p.bytes]).map_err(to_io);
        }
        for &(from, to, len) in &p.linear {
            dst.write(dst_off + to, &host[from..from + len])
                .map_err(to_io)?;
        }
        self.frags.clear();
        self.frags
            .extend(p.dmabuf.iter().map(|&(offset, to, len)| Frag {
                src_off: offset,
                dst_off: (dst_off + to) as u64,
                len: len as u64,
            }));
        if !self.frags.is_empty() {
            cuda.engines
                .gather(src, dst, &self.frags)
                .and_then(|done| done.wait())
                .map_err(to_io)?;
        }
        Ok(())
    }
}

/// Places payloads of a devmem connection into CUDA slabs with the GPU gather; `host` is where
/// bytes that arrive outside the dma-buf land before they are copied up.
pub struct GpuDirect {
    reader: DevmemReader,
    host: Vec<u8>,
    gpus: Gpus,
}

impl GpuDirect {
    /// A GPU-direct placer over `reader`, checksumming on the GPU of each slab (from `gpus`).
    pub fn new(reader: DevmemReader, gpus: Gpus) -> Self {
        Self {
            reader,
            host: vec![0; CHUNK],
            gpus,
        }
    }
}

impl Place for GpuDirect {
    /// Each `recvmsg`'s frags are gathered on the GPU (see [`DevmemReader::read_into_gpu`]),
    /// so the bytes never enter host memory; the CRC-32C is computed at the end by the CRC
    /// kernel of the slab's GPU.
    fn place(
        &mut self,
        f: &mut InFlight,
        tally: &mut Tally<'_>,
        pace: &mut Pace,
    ) -> Result<u32, RxError> {
        let slab = f.slab();
        let region = slab.region().cuda().ok_or(RxError::WrongMemory {
            path: "GPU-direct",
            found: "host",
        })?;
        let gpu = self.gpus.of(region).ok_or_else(|| {
            RxError::gpu(
                "the CRC kernel",
                format!(
                    "no open GPU holds CUDA device {}",
                    region.device().ordinal()
                ),
            )
        })?;
        let mut off = 0;
        while off < slab.len() {
            let want = (slab.len() - off).min(self.host.len());
            let got =
                self.reader
                    .read_into_gpu(region, slab.offset() + off, &mut self.host[..want]);
            let n = match got {
                Ok(0) => {
                    return Err(RxError::Closed {
                        got: off as u64,
                        want: slab.len() as u64,
                    });
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    let (got, want) = (off as u64, slab.len() as u64);
                    return Err(read_failed("recvmsg(MSG_SOCK_DEVMEM)", &e, got, want));
                }
            };
            off += n;
            tally.unseen(n);
            pace.landed_now(n)?;
        }
        let t = Instant::now();
        let span = shardwire_gpu::kernels::Span {
            off: slab.offset() as u64,
            len: slab.len() as u64,
        };
        let crc = gpu
            .engines
            .crc32c(region, &[span])
            .map_err(|e| RxError::gpu("CRC-32C on the GPU", e))?;
        tally.spent(t.elapsed());
        Ok(crc[0])
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::TcpListener;

    use shardwire_devmem::emu::host::{EmuHost, Flow};

    use super::*;
    use crate::binding::{self, RxRegion};

    const MIB: usize = 1 << 20;

    /// Lane `lane`'s emulator binding on `host`.
    fn lane_binding(host: &Arc<EmuHost>, lane: u32) -> Arc<RxRegion> {
        let (nic, queues) = binding::emulated_nic(lane, None, &[]);
        binding::emulator(host, (&nic, &queues), 4 * MIB, None).unwrap()
    }

    /// An accepted loopback connection on `ip` carrying `payload`.
    fn conn(ip: &str, payload: Vec<u8>) -> (TcpStream, std::thread::JoinHandle<()>) {
        let l = TcpListener::bind((ip, 0)).unwrap();
        let addr = l.local_addr().unwrap();
        let w = std::thread::spawn(move || {
            // A refused connection is closed by the reader: the write may fail then.
            let _ = TcpStream::connect(addr).unwrap().write_all(&payload);
        });
        (l.accept().unwrap().0, w)
    }

    fn read_all(r: &mut DevmemReader, n: usize) -> io::Result<Vec<u8>> {
        let mut out = vec![0u8; n];
        let mut off = 0;
        while off < n {
            let end = (off + CHUNK).min(n);
            match r.read_some(&mut out[off..end])? {
                0 => return Err(io::ErrorKind::UnexpectedEof.into()),
                got => off += got,
            }
        }
        Ok(out)
    }

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(13) ^ seed).collect()
    }

    #[test]
    fn each_lane_reads_through_its_own_binding_only() {
        let host = EmuHost::new();
        let (a, b) = (lane_binding(&host, 0), lane_binding(&host, 1));
        assert_ne!(a.id(), b.id(), "each lane its own dma-buf");
        let (pa, pb) = (pattern(3 * MIB, 1), pattern(2 * MIB, 2));
        let (sa, wa) = conn("127.0.0.1", pa.clone());
        let (sb, wb) = conn("127.0.0.2", pb.clone());
        let mut ra = DevmemReader::new(&a, sa).unwrap();
        let mut rb = DevmemReader::new(&b, sb).unwrap();
        assert_eq!(host.rules(), 2, "one steering rule per connection");
        assert!(read_all(&mut ra, pa.len()).unwrap() == pa);
        assert!(read_all(&mut rb, pb.len()).unwrap() == pb);
        for (r, n) in [(&a, pa.len()), (&b, pb.len())] {
            let c = &r.counters;
            assert_eq!(c.dmabuf_bytes.load(Ordering::Relaxed), n as u64);
            assert_eq!(c.steering_errors.load(Ordering::Relaxed), 0);
            assert_eq!(
                c.tokens_returned.load(Ordering::Relaxed),
                c.frags.load(Ordering::Relaxed)
            );
        }
        drop((ra, rb));
        assert_eq!(host.rules(), 0, "rules go when their connections close");
        wa.join().unwrap();
        wb.join().unwrap();
    }

    /// A connection counts once among its binding's readers, however many references to the
    /// binding it holds, and not at all on another lane's binding.
    #[test]
    fn a_connection_counts_once_as_a_reader_of_its_binding() {
        let host = EmuHost::new();
        let (a, b) = (lane_binding(&host, 0), lane_binding(&host, 1));
        let (s, w) = conn("127.0.0.1", pattern(MIB, 4));
        // The receiver's settings hold the binding and its reader count for the thread's life
        // (`Setup::binding`, `Setup::reading`), taken before the flow is steered.
        let setup = (Arc::clone(&a), a.reading());
        assert_eq!(a.readers(), 1, "counted before it is steered");
        let r = DevmemReader::new(&a, s).unwrap();
        assert!(
            Arc::strong_count(&a) > 2,
            "more references than connections"
        );
        assert_eq!(a.readers(), 1);
        assert_eq!(b.readers(), 0);
        drop(r);
        assert_eq!(a.readers(), 1, "until its receiver thread ends");
        drop(setup);
        assert_eq!(a.readers(), 0, "a closed connection reads no more");
        w.join().unwrap();
    }

    #[test]
    fn a_frag_of_another_lanes_binding_is_refused_counted_and_its_tokens_returned() {
        let host = EmuHost::new();
        let (a, b) = (lane_binding(&host, 0), lane_binding(&host, 1));
        let (s, w) = conn("127.0.0.1", pattern(MIB, 3));
        let flow = Flow::of(&s).unwrap();
        let (nic_b, queues_b) = b.queues();
        host.misplace(flow, nic_b, queues_b[0]);
        let mut r = DevmemReader::new(&a, s).unwrap();
        let mut dst = vec![0u8; CHUNK];
        let e = r.read_some(&mut dst).unwrap_err();
        let gather = e.get_ref().and_then(|e| e.downcast_ref::<GatherError>());
        assert_eq!(
            gather,
            Some(&GatherError::ForeignBinding {
                got: b.id(),
                want: a.id()
            })
        );
        let c = &a.counters;
        assert_eq!(c.steering_errors.load(Ordering::Relaxed), 1);
        assert_eq!(c.frags.load(Ordering::Relaxed), 0, "nothing gathered");
        assert!(c.tokens_returned.load(Ordering::Relaxed) > 0);
        drop(r);
        let (free, total) = b.niovs();
        assert_eq!(
            free,
            Some(total),
            "every net_iov of the other binding came back"
        );
        w.join().unwrap();
    }
}
