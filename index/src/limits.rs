//! The manifest's limits on one shard ([`MAX_SHARD_LENGTH`], [`MAX_TENSORS_PER_SHARD`],
//! [`MAX_DIMS`]), checked on each file's shards as soon as they are planned, before the file
//! is read for their checksums: `Manifest::validate` checks them too, but only once every
//! file of the dataset has been read (hours, or every GET paid, for a large one), and with
//! advice that does not fit every format.

use shardwire_protocol::manifest::{MAX_DIMS, MAX_SHARD_LENGTH, MAX_TENSORS_PER_SHARD, ShardEntry};

use crate::error::IndexError;
use crate::source::Source;
use crate::walk::Kind;

/// How the shards of a file were made, for the advice when one is too large.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Made {
    /// A whole raw `.bin` file (not `--tokens`, not a Megatron pair).
    RawBin,
    /// Another format: its [`Kind`].
    Of(Kind),
}

/// Refuses a shard of `src` over one of the per-shard limits, naming the value and what to
/// do for files made as `made`. A length names the file read (its value is an offset in
/// it); the tensors, about the data, name [`Source::data_file`] (a converted Parquet file).
pub(crate) fn check(src: &Source, shards: &[ShardEntry], made: Made) -> Result<(), IndexError> {
    for s in shards {
        if s.length > MAX_SHARD_LENGTH {
            return Err(src.unsupported(
                format!(
                    "a shard is at most {MAX_SHARD_LENGTH} bytes (1 TiB); {}",
                    too_long(made)
                ),
                format!("a shard of {} bytes at offset {}", s.length, s.offset),
            ));
        }
        if s.tensors.len() > MAX_TENSORS_PER_SHARD {
            let names: Vec<&str> = s.tensors.iter().take(5).map(|t| t.name.as_str()).collect();
            return Err(src.unsupported_data(
                format!(
                    "a shard holds at most {MAX_TENSORS_PER_SHARD} tensors; {}",
                    too_many(made)
                ),
                format!("{} tensors: {}, ...", s.tensors.len(), names.join(", ")),
            ));
        }
        if let Some(t) = s.tensors.iter().find(|t| t.shape.len() > MAX_DIMS) {
            return Err(src.unsupported_data(
                format!(
                    "tensor `{}` has more than the {MAX_DIMS} dimensions a tensor may have; \
                     reshape it to fewer",
                    t.name
                ),
                format!("shape {:?}", t.shape),
            ));
        }
    }
    Ok(())
}

/// What to do about a shard over 1 TiB.
fn too_long(made: Made) -> &'static str {
    match made {
        Made::RawBin => {
            "a raw .bin file is one shard: if it holds tokens, index it with --tokens DTYPE \
             (it is then cut into shards of 64 MiB), else split it into files under 1 TiB"
        }
        Made::Of(Kind::Npy) => "an .npy file is one shard: split the array into several files",
        Made::Of(Kind::Tar) => {
            "a WebDataset tar is one shard: write smaller shards (webdataset.ShardWriter \
             maxsize)"
        }
        Made::Of(Kind::Mds) => {
            "an MDS file is one shard: write smaller shards (MDSWriter size_limit)"
        }
        Made::Of(Kind::Arrow | Kind::Parquet) => {
            "a record batch (a Parquet row group) is one shard: write smaller ones"
        }
        Made::Of(_) => "write the data in smaller files",
    }
}

/// What to do about a shard of more than [`MAX_TENSORS_PER_SHARD`] tensors.
fn too_many(made: Made) -> &'static str {
    match made {
        Made::Of(Kind::Tar) => {
            "each field of a WebDataset sample is a tensor: write samples with fewer fields \
             (pack several into one, e.g. a .json or .npy member)"
        }
        Made::Of(Kind::Arrow | Kind::Parquet) => {
            "each column is a tensor: serve fewer columns (--columns a,b) or pack several \
             into one (a fixed-size list)"
        }
        _ => "write the data with fewer columns or fields",
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::blob::Blob;

    /// A file of `len` zero bytes that is never checksummed.
    struct Zeros;

    impl Blob for Zeros {
        fn read_at(&mut self, _offset: u64, buf: &mut [u8]) -> Result<(), IndexError> {
            buf.fill(0);
            Ok(())
        }

        fn crc32c(&mut self, _ranges: &[(u64, u64)]) -> Result<Vec<u32>, IndexError> {
            panic!("checksummed before the limits were checked")
        }
    }

    #[test]
    fn a_raw_bin_over_one_tib_is_refused_pointing_at_tokens() {
        // Before, it was read and checksummed whole, then refused by the manifest with
        // "index the dataset with smaller shards", which a .bin cannot be.
        let len = MAX_SHARD_LENGTH + 2;
        let mut src = Source::new(
            PathBuf::from("/d/corpus.bin"),
            "corpus.bin",
            len,
            Box::new(Zeros),
        );
        let shards = crate::bin::index(&mut src).unwrap();
        let e = check(&src, &shards, Made::RawBin).unwrap_err();
        assert!(matches!(e, IndexError::Unsupported { .. }), "{e:?}");
        let text = e.to_string();
        for want in ["/d/corpus.bin", "--tokens DTYPE", &format!("{len} bytes")] {
            assert!(text.contains(want), "{want}: {text}");
        }
        // At the limit it passes.
        let mut src = Source::new(
            PathBuf::from("/d/c.bin"),
            "c.bin",
            MAX_SHARD_LENGTH,
            Box::new(Zeros),
        );
        let shards = crate::bin::index(&mut src).unwrap();
        check(&src, &shards, Made::RawBin).unwrap();
    }
}
