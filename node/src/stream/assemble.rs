//! Assembly of delivered tensors from rows of resident shards: a batch of samples (batch
//! mode), or every row of one shard whose tensors have row tables (shard mode: WebDataset
//! members, MDS fields, Arrow list and string columns; see the manifest's `rows`).
//!
//! [`plan`] lays the output slab out: each tensor starts at a [`TENSOR_ALIGN`] boundary; a
//! fixed-shape tensor is `[rows, ...]`; a ragged tensor `c` is `c` (the rows' values back to
//! back) followed by `c.offsets` (int64, rows + 1, from 0, in elements). Its copies are
//! pieces of consecutive bytes (rows adjacent in both the shard and the output merge into
//! one), executed by [`execute`] as memcpys (host memory) or as one gather-kernel launch
//! (CUDA memory); the offsets tensors are written from the host.

use shardwire_gpu::Slab;
use shardwire_gpu::kernels::Frag;
use shardwire_protocol::manifest::{OFFSETS_SUFFIX, ShardEntry, TensorEntry};
use shardwire_protocol::samples::SampleRef;
use shardwire_protocol::trainer::TensorView;
use shardwire_protocol::{DType, Manifest};

use super::error::AssembleError;
use super::layout::TENSOR_ALIGN;
use super::prefetch;

/// Bytes `[src, src + len)` of shard `shard`'s payload go to `[dst, dst + len)` of the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Manifest shard index.
    pub shard: u32,
    /// Offset in the shard's payload.
    pub src: u64,
    /// Offset in the output slab.
    pub dst: u64,
    /// Bytes.
    pub len: u64,
}

/// The layout of an assembled slab and how to fill it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// The delivered tensors, offsets relative to the slab.
    pub views: Vec<TensorView>,
    /// Bytes of the slab (at least 1).
    pub bytes: u64,
    /// Copies from resident shards.
    pub pieces: Vec<Piece>,
    /// Bytes written from the host (the offsets tensors), at slab offsets.
    pub writes: Vec<(u64, Vec<u8>)>,
    /// Pieces hold integers of `from` widened to `to` while copied (a piece's `len` counts
    /// source bytes; it fills `len / from.size() * to.size()` bytes).
    pub widen: Option<Widen>,
}

/// An integer widening applied while copying.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Widen {
    /// Source dtype.
    pub from: DType,
    /// Delivered dtype.
    pub to: DType,
}

impl Plan {
    /// Appends a copy of `len` source bytes from `shard`'s payload at `src` to `dst`, merged
    /// into the last piece when both its source and destination follow on.
    pub fn push(&mut self, shard: u32, src: u64, dst: u64, len: u64) {
        let out = |l: u64| match self.widen {
            Some(w) => l / w.from.size() * w.to.size(),
            None => l,
        };
        if len == 0 {
            return;
        }
        match self.pieces.last() {
            Some(l) if l.shard == shard && l.src + l.len == src && l.dst + out(l.len) == dst => {
                self.pieces.last_mut().expect("a last piece").len += len;
            }
            _ => self.pieces.push(Piece {
                shard,
                src,
                dst,
                len,
            }),
        }
    }
}

/// Writes the integers of `src` (dtype `w.from`) into `dst` as `w.to`, sign- or zero-extended.
pub fn widen_into(w: Widen, src: &[u8], dst: &mut [u8]) {
    let (fs, ts) = (w.from.size() as usize, w.to.size() as usize);
    for (i, o) in src.chunks_exact(fs).zip(dst.chunks_exact_mut(ts)) {
        let v: i64 = match w.from {
            DType::Int8 => i64::from(i[0] as i8),
            DType::Uint8 => i64::from(i[0]),
            DType::Int16 => i64::from(i16::from_le_bytes([i[0], i[1]])),
            DType::Uint16 => i64::from(u16::from_le_bytes([i[0], i[1]])),
            DType::Int32 => i64::from(i32::from_le_bytes([i[0], i[1], i[2], i[3]])),
            DType::Uint32 => i64::from(u32::from_le_bytes([i[0], i[1], i[2], i[3]])),
            _ => i64::from_le_bytes(i.try_into().expect("8 bytes")),
        };
        o.copy_from_slice(&v.to_le_bytes()[..ts]);
    }
}

/// The byte range of row `row` of tensor `t` in shard `s`'s payload: (offset, length).
pub fn row_range(s: &ShardEntry, t: &TensorEntry, row: u64) -> (u64, u64) {
    match &t.rows {
        Some(rows) => {
            let [off, len] = rows[row as usize];
            (off, len)
        }
        None => {
            let rb = t.length / t.shape.first().copied().unwrap_or(1).max(1);
            (s.relative_offset(t) + row * rb, rb)
        }
    }
}

/// Plans the slab holding `samples` (in order) of every tensor. The tensors are those of the
/// first sample's shard; every shard named must hold the same tensors in the same order
/// (batch mode checks that when the stream opens, see `Layout`; shard mode names one shard).
pub fn plan(m: &Manifest, samples: &[SampleRef]) -> Plan {
    let template = &m.shards[samples.first().map_or(0, |x| x.shard as usize)].tensors;
    let mut p = Plan::default();
    for (ti, t) in template.iter().enumerate() {
        lay_tensor(&mut p, m, ti, t, samples);
    }
    p.bytes = p.bytes.max(1);
    p
}

/// The slab of shard `shard` when some of its tensors have row tables (None: it is
/// delivered as received). The payload stays at the slab's head and its dense tensors are
/// viewed there; the row-table tensors are assembled behind it, from [`behind`] on.
pub fn plan_shard(m: &Manifest, shard: u32) -> Option<Plan> {
    let s = &m.shards[shard as usize];
    if !s.tensors.iter().any(TensorEntry::needs_assembly) {
        return None;
    }
    let mut p = Plan {
        bytes: behind(s.length),
        ..Plan::default()
    };
    for (ti, t) in s.tensors.iter().enumerate() {
        if t.needs_assembly() {
            let rows: Vec<SampleRef> = (0..t.row_count())
                .map(|row| SampleRef { shard, row })
                .collect();
            lay_tensor(&mut p, m, ti, t, &rows);
        } else {
            let (offset, length) = (s.relative_offset(t), t.length);
            p.views
                .push(view(&t.name, t.dtype, t.shape.clone(), offset, length));
        }
    }
    Some(p)
}

/// Where an assembly behind a payload of `len` bytes starts.
pub fn behind(len: u64) -> u64 {
    len.next_multiple_of(TENSOR_ALIGN)
}

/// Lays tensor `ti` (described by `t`) of `samples` out at the end of `p`.
fn lay_tensor(p: &mut Plan, m: &Manifest, ti: usize, t: &TensorEntry, samples: &[SampleRef]) {
    let n = samples.len() as u64;
    let base = p.bytes;
    let mut at = base;
    let mut offsets = Vec::with_capacity(if t.ragged { samples.len() + 1 } else { 0 });
    for x in samples {
        let s = &m.shards[x.shard as usize];
        let (src, len) = row_range(s, &s.tensors[ti], x.row);
        if t.ragged {
            offsets.push((at - base) / t.dtype.size());
        }
        p.push(x.shard, src, at, len);
        at += len;
    }
    let shape = match t.ragged {
        true => vec![(at - base) / t.dtype.size()],
        false => [vec![n], t.shape.get(1..).unwrap_or_default().to_vec()].concat(),
    };
    p.views.push(view(&t.name, t.dtype, shape, base, at - base));
    p.bytes = at.next_multiple_of(TENSOR_ALIGN);
    if t.ragged {
        offsets.push((at - base) / t.dtype.size());
        let bytes: Vec<u8> = offsets.iter().flat_map(|o| o.to_le_bytes()).collect();
        let name = format!("{}{OFFSETS_SUFFIX}", t.name);
        let len = bytes.len() as u64;
        p.views
            .push(view(&name, DType::Int64, vec![n + 1], p.bytes, len));
        p.writes.push((p.bytes, bytes));
        p.bytes = (p.bytes + len).next_multiple_of(TENSOR_ALIGN);
    }
}

pub(super) fn view(
    name: &str,
    dtype: DType,
    shape: Vec<u64>,
    offset: u64,
    length: u64,
) -> TensorView {
    TensorView {
        name: name.to_owned(),
        dtype,
        shape,
        offset,
        length,
    }
}

/// How the slab was filled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filled {
    /// By memcpy (host memory).
    Memcpy,
    /// By one gather-kernel launch (CUDA memory).
    Gather,
}

/// Fills `out` as `plan` says, reading the shards' slabs from `shard_slab`. Host memory:
/// memcpy per piece, the rows [`prefetch::AHEAD`] pieces on asked for meanwhile; CUDA
/// memory: the pieces as frags of one gather launch on `gpu` (the shards and `out` lie in one
/// region), then the offsets written from the host.
pub fn execute<'a>(
    plan: &Plan,
    shard_slab: impl Fn(u32) -> &'a Slab,
    out: &mut Slab,
    gpu: Option<&shardwire_gpu::cuda::CudaMemory>,
) -> Result<Filled, AssembleError> {
    if let Some(to) = out.host_slice_mut() {
        for (i, p) in plan.pieces.iter().enumerate() {
            if let Some(ahead) = plan.pieces.get(i + prefetch::AHEAD) {
                let rows = shard_slab(ahead.shard).host_slice().and_then(|from| {
                    from.get(ahead.src as usize..(ahead.src + ahead.len) as usize)
                });
                prefetch::prefetch(rows.unwrap_or_default());
            }
            let from = shard_slab(p.shard)
                .host_slice()
                .ok_or(AssembleError::MixedMemory)?;
            let (s, d, l) = (p.src as usize, p.dst as usize, p.len as usize);
            match plan.widen {
                None => to[d..d + l].copy_from_slice(&from[s..s + l]),
                Some(w) => {
                    let out = l / w.from.size() as usize * w.to.size() as usize;
                    widen_into(w, &from[s..s + l], &mut to[d..d + out]);
                }
            }
        }
        for (at, bytes) in &plan.writes {
            to[*at as usize..*at as usize + bytes.len()].copy_from_slice(bytes);
        }
        return Ok(Filled::Memcpy);
    }
    gather(plan, |shard| shard_slab(shard).offset() as u64, out, gpu)
}

/// Fills the tail of `slab` as [`plan_shard`]'s `plan` says, from the payload at its head
/// (host: `copy_within`; CUDA: one gather launch inside the slab), after growing it to the
/// plan's size (the fetcher allocated a block that holds it).
pub fn execute_in_place(
    plan: &Plan,
    slab: &mut Slab,
    gpu: Option<&shardwire_gpu::cuda::CudaMemory>,
) -> Result<Filled, AssembleError> {
    if !slab.set_len(plan.bytes as usize) {
        return Err(AssembleError::BlockTooSmall {
            block: slab.capacity() as u64,
            need: plan.bytes,
        });
    }
    if let Some(buf) = slab.host_slice_mut() {
        for p in &plan.pieces {
            let (s, d, l) = (p.src as usize, p.dst as usize, p.len as usize);
            buf.copy_within(s..s + l, d);
        }
        for (at, bytes) in &plan.writes {
            buf[*at as usize..*at as usize + bytes.len()].copy_from_slice(bytes);
        }
        return Ok(Filled::Memcpy);
    }
    let base = slab.offset() as u64;
    gather(plan, |_| base, slab, gpu)
}

/// Zero extension as copies, for the gather kernel: the destination span is zeroed from the
/// host, then each element of a piece is one frag into the low bytes of its wider cell
/// (little-endian). Signed sources would need sign extension: refused when the stream opens.
fn widening_frags(
    plan: &Plan,
    w: Widen,
    src_base: &impl Fn(u32) -> u64,
    base: u64,
    region: &shardwire_gpu::cuda::VmmRegion,
) -> Result<Vec<Frag>, AssembleError> {
    if !matches!(w.from, DType::Uint8 | DType::Uint16 | DType::Uint32) {
        return Err(AssembleError::SignedWidening { dtype: w.from });
    }
    let (fs, ts) = (w.from.size(), w.to.size());
    let span = |p: &Piece| (p.dst, p.dst + p.len / fs * ts);
    let lo = plan.pieces.iter().map(|p| span(p).0).min().unwrap_or(0);
    let hi = plan.pieces.iter().map(|p| span(p).1).max().unwrap_or(0);
    region
        .write(base as usize + lo as usize, &vec![0u8; (hi - lo) as usize])
        .map_err(|e| AssembleError::gpu("zeroing the widened tokens", e))?;
    Ok(plan
        .pieces
        .iter()
        .flat_map(|p| {
            (0..p.len / fs).map(move |k| Frag {
                src_off: src_base(p.shard) + p.src + k * fs,
                dst_off: base + p.dst + k * ts,
                len: fs,
            })
        })
        .collect())
}

/// The CUDA half of [`execute`]: the pieces as frags of one gather launch (sources at
/// `src_base(shard)` in the region), then the offsets written from the host.
fn gather(
    plan: &Plan,
    src_base: impl Fn(u32) -> u64,
    out: &Slab,
    gpu: Option<&shardwire_gpu::cuda::CudaMemory>,
) -> Result<Filled, AssembleError> {
    let gpu = gpu.ok_or(AssembleError::NoGpu)?;
    let region = out.region().cuda().ok_or(AssembleError::MixedMemory)?;
    let base = out.offset() as u64;
    let frags: Vec<Frag> = match plan.widen {
        None => plan
            .pieces
            .iter()
            .map(|p| Frag {
                src_off: src_base(p.shard) + p.src,
                dst_off: base + p.dst,
                len: p.len,
            })
            .collect(),
        Some(w) => widening_frags(plan, w, &src_base, base, region)?,
    };
    gpu.engines
        .gather(region, region, &frags)
        .and_then(|ev| ev.wait())
        .map_err(|e| AssembleError::gpu("the gather kernel", e))?;
    for (at, bytes) in &plan.writes {
        region
            .write(out.offset() + *at as usize, bytes)
            .map_err(|e| AssembleError::gpu("writing the offsets", e))?;
    }
    Ok(Filled::Gather)
}

#[cfg(test)]
mod tests {
    use shardwire_protocol::manifest::TensorEntry;

    use super::*;

    /// Shard `i`: `id` int64 dense at payload 0, `tok` ragged uint16 rows after it.
    fn shard(rows: &[u64]) -> ShardEntry {
        let n = rows.len() as u64;
        let mut spans = Vec::new();
        let mut at = n * 8;
        for &r in rows {
            spans.push([at, r * 2]);
            at += r * 2;
        }
        let total: u64 = rows.iter().sum();
        let mut tok = TensorEntry::dense(
            "tok".into(),
            DType::Uint16,
            vec![total],
            100 + n * 8,
            total * 2,
        );
        (tok.rows, tok.ragged) = (Some(spans), true);
        ShardEntry {
            file: "a".into(),
            offset: 100,
            length: at,
            crc32c: 0,
            tensors: vec![
                TensorEntry::dense("id".into(), DType::Int64, vec![n], 100, n * 8),
                tok,
            ],
        }
    }

    #[test]
    fn a_batch_of_dense_and_ragged_rows() {
        let m = Manifest::new(vec![shard(&[1, 2, 3]), shard(&[4, 0])]);
        let x = |shard, row| SampleRef { shard, row };
        let p = plan(&m, &[x(0, 1), x(0, 2), x(1, 1), x(1, 0)]);
        let names: Vec<(&str, &[u64], u64, u64)> = p
            .views
            .iter()
            .map(|v| (v.name.as_str(), v.shape.as_slice(), v.offset, v.length))
            .collect();
        assert_eq!(
            names,
            [
                ("id", &[4][..], 0, 32),
                ("tok", &[9][..], 64, 18),
                ("tok.offsets", &[5][..], 128, 40)
            ]
        );
        assert_eq!(p.bytes, 192);
        // id rows 1, 2 of shard 0 merge; shard 1 rows 1 then 0 do not (row 0 comes after).
        assert_eq!(
            p.pieces,
            vec![
                Piece {
                    shard: 0,
                    src: 8,
                    dst: 0,
                    len: 16
                },
                Piece {
                    shard: 1,
                    src: 8,
                    dst: 16,
                    len: 8
                },
                Piece {
                    shard: 1,
                    src: 0,
                    dst: 24,
                    len: 8
                },
                // tok: shard 0 rows 1 (2 tokens) and 2 (3 tokens) are adjacent; shard 1 row 1
                // is empty; row 0 has 4 tokens.
                Piece {
                    shard: 0,
                    src: 24 + 2,
                    dst: 64,
                    len: 10
                },
                Piece {
                    shard: 1,
                    src: 16,
                    dst: 74,
                    len: 8
                },
            ]
        );
        let offs: Vec<u64> = p.writes[0]
            .1
            .chunks(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!((p.writes[0].0, offs), (128, vec![0, 2, 5, 5, 9]));
    }

    #[test]
    fn a_shard_keeps_dense_tensors_in_place_and_assembles_the_rest_behind() {
        let m = Manifest::new(vec![shard(&[1, 2, 3]), shard(&[4, 0])]);
        let dense = ShardEntry {
            tensors: vec![m.shards[0].tensors[0].clone()],
            length: 24,
            ..m.shards[0].clone()
        };
        assert!(
            plan_shard(&Manifest::new(vec![dense]), 0).is_none(),
            "all dense: as received"
        );
        let p = plan_shard(&m, 1).unwrap();
        // Payload: 2 ids (16 bytes) + 4 tokens (8 bytes) = 24 -> assembly from 64.
        let v: Vec<(&str, u64, u64)> = p
            .views
            .iter()
            .map(|v| (v.name.as_str(), v.offset, v.length))
            .collect();
        assert_eq!(v, [("id", 0, 16), ("tok", 64, 8), ("tok.offsets", 128, 24)]);
        assert_eq!(
            p.pieces,
            vec![Piece {
                shard: 1,
                src: 16,
                dst: 64,
                len: 8
            }]
        );
        assert_eq!(p.bytes, 192);
    }
}
