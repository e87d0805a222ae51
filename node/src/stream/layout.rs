//! The per-sample layout of a dataset, for batch mode: every shard holds the same tensors
//! (name, dtype, shape after the first axis, ragged or not), each with as many rows as the
//! shard has samples; sample `row` of a tensor is one row of it (`assemble::row_range`). A
//! batch is one slab holding each tensor as a contiguous `[batch_size, ...]` array (a ragged
//! one as values and offsets), each starting at a 64-byte boundary (DLPack consumers such as
//! JAX import such buffers without a copy).

use shardwire_protocol::DType;
use shardwire_protocol::trainer::ErrorCode;
use shardwire_protocol::{Manifest, ShardEntry, TensorEntry};

use super::error::OpenError;

/// Alignment of each tensor in a batch slab.
pub const TENSOR_ALIGN: u64 = 64;

/// One tensor of every sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorLayout {
    /// Name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape of one sample's row.
    pub row_shape: Vec<u64>,
    /// Bytes of one row (a ragged tensor: of its longest row).
    pub row_bytes: u64,
    /// Rows of varying length: delivered as values and `.offsets`.
    pub ragged: bool,
}

/// The layout of a dataset's samples and of its batches.
#[derive(Debug, Clone)]
pub struct Layout {
    /// The tensors, in the manifest's order.
    pub tensors: Vec<TensorLayout>,
    /// Samples per shard.
    pub shard_rows: Vec<u64>,
}

/// A batch-mode refusal of the dataset.
fn bad(msg: String) -> OpenError {
    OpenError::new(ErrorCode::BadRequest, format!("batch mode: {msg}"))
}

/// Checks tensor `t` of shard `i` (`s`) against its layout `l` as the `template` shard holds
/// it, and its row count against the shard's `rows` (those of its first tensor, `name`);
/// widens a ragged tensor's row size to this shard's longest row.
fn check_tensor(
    (i, s): (usize, &ShardEntry),
    t: &TensorEntry,
    l: &mut TensorLayout,
    (rows, name): (u64, &str),
    template: &str,
) -> Result<(), OpenError> {
    let r = t.row_count();
    let rest = match t.ragged {
        true => &[][..],
        false => t.shape.get(1..).unwrap_or_default(),
    };
    if t.ragged != l.ragged {
        let kind = |ragged: bool| if ragged { "ragged" } else { "fixed-shape" };
        return Err(bad(format!(
            "shard {i} ({}): tensor `{}` is {} here and {} in {template}",
            s.file,
            t.name,
            kind(t.ragged),
            kind(l.ragged),
        )));
    }
    if t.ragged {
        let longest = t.rows.iter().flatten().map(|&[_, len]| len).max();
        l.row_bytes = l.row_bytes.max(longest.unwrap_or(0));
    }
    if t.dtype != l.dtype || rest != l.row_shape.as_slice() {
        return Err(bad(format!(
            "shard {i} ({}): tensor `{}` is {} {:?} per row; {template} has {} {:?}",
            s.file, t.name, t.dtype, rest, l.dtype, l.row_shape
        )));
    }
    if r != rows || (!t.ragged && t.length != r * l.row_bytes) {
        return Err(bad(format!(
            "shard {i} ({}): tensor `{}` has {r} rows ({} bytes) but `{name}` has {rows}; a sample is one row of every tensor",
            s.file, t.name, t.length
        )));
    }
    Ok(())
}

impl TensorLayout {
    /// The per-row layout of tensor `t` as one shard holds it (a ragged tensor's row size is
    /// the longest row's, found over all shards).
    fn of(t: &TensorEntry) -> Self {
        Self {
            name: t.name.clone(),
            dtype: t.dtype,
            row_shape: match t.ragged {
                true => vec![],
                false => t.shape.get(1..).unwrap_or_default().to_vec(),
            },
            row_bytes: match t.ragged {
                true => 0,
                false => t.length / t.row_count().max(1),
            },
            ragged: t.ragged,
        }
    }
}

impl Layout {
    /// The layout of `m`, or why its shards cannot be batched together.
    pub fn of(m: &Manifest) -> Result<Self, OpenError> {
        // The row sizes come from the first shard that has rows: an empty shard 0 (a
        // Parquet file of no rows, say) gave 0 bytes per row, and refused every other shard.
        let at = m
            .shards
            .iter()
            .position(|s| s.tensors.first().is_some_and(|t| t.row_count() > 0))
            .unwrap_or(0);
        let first = m
            .shards
            .get(at)
            .ok_or_else(|| bad("the dataset has no shards".into()))?;
        // Named in every refusal: the shards are compared with it, not with shard 0.
        let template = format!("shard {at} ({})", first.file);
        let mut tensors: Vec<TensorLayout> = first.tensors.iter().map(TensorLayout::of).collect();
        let want: Vec<String> = tensors.iter().map(|t| t.name.clone()).collect();
        let mut shard_rows = Vec::with_capacity(m.shards.len());
        for (i, s) in m.shards.iter().enumerate() {
            let names: Vec<&str> = s.tensors.iter().map(|t| t.name.as_str()).collect();
            if names != want {
                return Err(bad(format!(
                    "shard {i} ({}) has tensors {names:?}, {template} has {want:?}; every shard must hold the same tensors",
                    s.file
                )));
            }
            let rows = s.tensors.first().map_or(0, |t| t.row_count());
            for (t, l) in s.tensors.iter().zip(tensors.iter_mut()) {
                check_tensor((i, s), t, l, (rows, want[0].as_str()), &template)?;
            }
            shard_rows.push(rows);
        }
        if shard_rows.iter().all(|&r| r == 0) {
            return Err(bad(
                "the dataset has no samples (every shard has 0 rows)".into()
            ));
        }
        Ok(Self {
            tensors,
            shard_rows,
        })
    }

    /// The most bytes a batch of `batch` samples takes (exact without ragged tensors; with
    /// them, as if every row were the longest, plus the offsets); `u64::MAX` where that overflows (no region holds it).
    pub fn max_batch_bytes(&self, batch: u32) -> u64 {
        let b = u64::from(batch);
        let aligned = |x: Option<u64>| x?.checked_next_multiple_of(TENSOR_ALIGN);
        let bytes = self.tensors.iter().try_fold(0u64, |off, t| {
            let values = aligned(t.row_bytes.checked_mul(b)?.checked_add(off))?;
            match t.ragged {
                true => aligned(values.checked_add((b + 1) * 8)),
                false => Some(values),
            }
        });
        bytes.map_or(u64::MAX, |n| n.max(1))
    }

    /// Bytes of one sample (all tensors).
    pub fn sample_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.row_bytes).sum()
    }
}

#[cfg(test)]
mod tests {
    use shardwire_protocol::manifest::{ShardEntry, TensorEntry};

    use super::*;

    fn shard(rows: u64, file: &str) -> ShardEntry {
        let t = |name: &str, off: u64, dtype: DType, k: u64, esize: u64| {
            TensorEntry::dense(name.into(), dtype, vec![rows, k], off, rows * k * esize)
        };
        ShardEntry {
            file: file.into(),
            offset: 100,
            length: rows * 8 + rows * 12,
            crc32c: 0,
            tensors: vec![
                t("id", 100, DType::Int64, 1, 8),
                t("x", 100 + rows * 8, DType::Float32, 3, 4),
            ],
        }
    }

    #[test]
    fn rows_offsets_and_batch_slabs() {
        let m = Manifest::new(vec![shard(10, "a"), shard(4, "b")]);
        let l = Layout::of(&m).unwrap();
        assert_eq!(l.shard_rows, vec![10, 4]);
        assert_eq!((l.tensors[1].row_bytes, l.sample_bytes()), (12, 20));
        assert_eq!(l.max_batch_bytes(5), 128);
        let mut wide = l.clone();
        wide.tensors[1].row_bytes = u64::MAX / 2;
        assert_eq!(
            wide.max_batch_bytes(4),
            u64::MAX,
            "overflow: as large as can be"
        );
    }

    #[test]
    fn an_empty_first_shard_takes_its_row_sizes_from_the_next() {
        let m = Manifest::new(vec![shard(0, "empty"), shard(10, "a"), shard(4, "b")]);
        let l = Layout::of(&m).unwrap();
        assert_eq!(l.shard_rows, vec![0, 10, 4]);
        assert_eq!((l.tensors[1].row_bytes, l.sample_bytes()), (12, 20));
    }

    #[test]
    fn a_mismatch_names_the_shard_the_others_are_compared_with() {
        let mut b = shard(4, "b");
        b.tensors[1].shape = vec![4, 2];
        b.tensors[1].length = 4 * 2 * 4;
        let m = Manifest::new(vec![shard(0, "empty"), shard(10, "a"), b]);
        let e = Layout::of(&m).unwrap_err();
        // Before: "shard 0 has float32 [3]", shard 0 being the empty one.
        assert!(e.message.contains("; shard 1 (a) has float32 [3]"), "{e}");
        let mut c = shard(4, "c");
        c.tensors.pop();
        let e = Layout::of(&Manifest::new(vec![shard(0, "empty"), shard(10, "a"), c])).unwrap_err();
        assert!(
            e.message.contains(", shard 1 (a) has [\"id\", \"x\"]"),
            "{e}"
        );
    }

    #[test]
    fn mismatched_shards_are_refused_by_name() {
        let mut b = shard(4, "b.arrow");
        b.tensors[1].shape = vec![4, 2];
        b.tensors[1].length = 4 * 2 * 4;
        let e = Layout::of(&Manifest::new(vec![shard(10, "a"), b])).unwrap_err();
        assert!(
            e.message
                .contains("shard 1 (b.arrow): tensor `x` is float32 [2]"),
            "{e}"
        );
        let mut c = shard(4, "c");
        c.tensors.pop();
        let e = Layout::of(&Manifest::new(vec![shard(10, "a"), c])).unwrap_err();
        assert!(
            e.message.contains("every shard must hold the same tensors"),
            "{e}"
        );
    }
}
