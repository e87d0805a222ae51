//! Synthetic datasets for `demo` and `bench`: Arrow IPC files (written with arrow-rs),
//! `.npy` files and raw `.bin` shards, with deterministic pseudo-random contents.

use std::path::Path;
use std::sync::Arc;

use arrow_array::types::Float32Type;
use arrow_array::{ArrayRef, FixedSizeListArray, Int64Array, RecordBatch};
use arrow_schema::{DataType, Field, Schema};

use crate::out::outln;

/// Deterministic bytes (xorshift), so files differ but runs repeat.
pub fn fill(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
}

/// Writes a C-order little-endian float32 `.npy` (format 1.0).
pub fn write_npy_f32(path: &Path, shape: &[usize], seed: u64) -> std::io::Result<()> {
    let n: usize = shape.iter().product();
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_txt = if shape.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_txt}, }}");
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + n * 4);
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    let start = out.len();
    out.resize(start + n * 4, 0);
    // Finite floats: fill then clamp exponent bits by building from integers.
    for (i, c) in out[start..].chunks_mut(4).enumerate() {
        let v = ((i as u64).wrapping_mul(seed | 1) % 10_000) as f32 / 100.0;
        c.copy_from_slice(&v.to_le_bytes());
    }
    std::fs::write(path, out)
}

/// Writes an Arrow IPC file with `batches` record batches of `rows` rows: an int64 `label`
/// column and a FixedSizeList<float32, `width`> column `x`.
pub fn write_arrow(
    path: &Path,
    batches: usize,
    rows: usize,
    width: i32,
    seed: u64,
) -> anyhow::Result<()> {
    let item = Arc::new(Field::new("item", DataType::Float32, false));
    let schema = Arc::new(Schema::new(vec![
        Field::new("label", DataType::Int64, false),
        Field::new(
            "x",
            DataType::FixedSizeList(Arc::clone(&item), width),
            false,
        ),
    ]));
    let file = std::fs::File::create(path)?;
    let mut w = arrow_ipc::writer::FileWriter::try_new(file, &schema)?;
    for b in 0..batches {
        let base = seed * 1_000_000 + (b * rows) as u64;
        let labels: ArrayRef = Arc::new(Int64Array::from_iter_values(
            (0..rows).map(|i| (base + i as u64) as i64 % 1000),
        ));
        let values = (0..rows).map(|r| {
            Some(
                (0..width).map(move |c| Some(((base as usize + r) * 31 + c as usize) as f32 * 0.5)),
            )
        });
        let x: ArrayRef =
            Arc::new(FixedSizeListArray::from_iter_primitive::<Float32Type, _, _>(values, width));
        // from_iter_primitive makes a nullable child; rebuild the list with our schema's field.
        let x = x
            .as_any()
            .downcast_ref::<FixedSizeListArray>()
            .expect("fixed size list")
            .clone();
        let (_, size, child, nulls) = x.into_parts();
        let x: ArrayRef = Arc::new(FixedSizeListArray::try_new(
            Arc::clone(&item),
            size,
            child,
            nulls,
        )?);
        w.write(&RecordBatch::try_new(Arc::clone(&schema), vec![labels, x])?)?;
    }
    w.finish()?;
    Ok(())
}

/// Writes a raw shard of `len` pseudo-random bytes.
pub fn write_bin(path: &Path, len: usize, seed: u64) -> std::io::Result<()> {
    let mut buf = vec![0u8; len];
    fill(&mut buf, seed);
    std::fs::write(path, buf)
}

/// A scratch directory under the system temp dir, removed when this is dropped, however the
/// command that made it ends (an early error or a panic included), unless it is kept. A
/// signal that kills the process (Ctrl-C, SIGTERM) drops nothing: the directory stays.
pub struct Scratch {
    /// The directory.
    pub dir: std::path::PathBuf,
    keep: bool,
}

impl Scratch {
    /// A fresh scratch directory named after `tag`; with `keep`, left in place at the end (and
    /// its path printed).
    pub fn new(tag: &str, keep: bool) -> std::io::Result<Self> {
        Ok(Self {
            dir: scratch_dir(tag)?,
            keep,
        })
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        match self.keep {
            true => outln!("kept {}", self.dir.display()),
            false => {
                let _ = std::fs::remove_dir_all(&self.dir);
            }
        }
    }
}

/// A fresh scratch directory under the system temp dir.
fn scratch_dir(tag: &str) -> std::io::Result<std::path::PathBuf> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let d = std::env::temp_dir().join(format!("shardwire-{tag}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scratch_dir_goes_when_dropped_unless_kept() {
        let s = Scratch::new("synth-test", false).unwrap();
        let dir = s.dir.clone();
        write_bin(&dir.join("a.bin"), 4096, 1).unwrap();
        drop(s);
        assert!(!dir.exists(), "{} is left", dir.display());
        let kept = Scratch::new("synth-test-kept", true).unwrap();
        let dir = kept.dir.clone();
        drop(kept);
        assert!(dir.is_dir());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
