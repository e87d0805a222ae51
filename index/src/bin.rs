//! `.bin` files: the whole file is one shard holding one `uint8` tensor named after the
//! file stem.

use shardwire_protocol::manifest::{DType, ShardEntry, TensorEntry};

use crate::error::IndexError;
use crate::source::Source;

/// Indexes a `.bin` file.
pub(crate) fn index(src: &mut Source) -> Result<Vec<ShardEntry>, IndexError> {
    if src.len == 0 {
        // Named with the other files that hold no rows, as in every format.
        return Ok(Vec::new());
    }
    let tensor = TensorEntry::dense(src.stem(), DType::Uint8, vec![src.len], 0, src.len);
    Ok(vec![src.shard(0, src.len, vec![tensor])?])
}

#[cfg(test)]
mod tests {
    use crate::testutil::{check_manifest, temp_dir};
    use crate::{IndexOptions, index_dir};

    #[test]
    fn bin_is_one_uint8_shard() {
        let dir = temp_dir("bin");
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 31 % 256) as u8).collect();
        std::fs::write(dir.join("blob.bin"), &data).unwrap();
        let m = index_dir(&dir, &IndexOptions::default()).unwrap();
        assert_eq!(m.shards.len(), 1);
        let s = &m.shards[0];
        assert_eq!((s.file.as_str(), s.offset, s.length), ("blob.bin", 0, 1000));
        assert_eq!(s.tensors[0].name, "blob");
        assert_eq!(s.tensors[0].shape, [1000]);
        assert_eq!(s.crc32c, shardwire_protocol::crc::crc32c(&data));
        check_manifest(&dir, &m, &[("blob", data)]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn crc_spans_read_chunks() {
        // Larger than the 1 MiB read chunk, and not a multiple of it.
        let dir = temp_dir("bin-big");
        let data: Vec<u8> = (0..(3u32 << 20) + 5)
            .map(|i| (i ^ (i >> 9)) as u8)
            .collect();
        std::fs::write(dir.join("big.bin"), &data).unwrap();
        let m = index_dir(&dir, &IndexOptions::default()).unwrap();
        assert_eq!(m.shards[0].crc32c, shardwire_protocol::crc::crc32c(&data));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_directory_of_only_an_empty_bin_is_refused() {
        let dir = temp_dir("bin-empty");
        std::fs::write(dir.join("e.bin"), b"").unwrap();
        let err = index_dir(&dir, &IndexOptions::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("found 1 data files but none holds any rows"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
