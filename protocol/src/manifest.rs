//! The dataset manifest (`DIR/shardwire.manifest.json`), written by `shardwire index`.
//!
//! A *shard* is one contiguous byte range of one file (an Arrow record batch body, a `.npy`
//! data section, a whole `.bin` file, a WebDataset tar, an MDS shard); it is the unit of
//! fetching, checksumming and delivery. A shard holds one or more named *tensors* whose
//! first axis is the shard's rows (samples). A *dense* tensor is one byte range inside the
//! shard. A tensor with [`TensorEntry::rows`] has its rows stored apart (a WebDataset member
//! per sample, an MDS field) or of varying length ([`TensorEntry::ragged`]: an Arrow list or
//! string column); the node assembles such rows into contiguous arrays, and a ragged
//! tensor `c` arrives as `c` (the flat values) and `c.offsets` (int64, rows + 1, from 0).
//! The dataset digest is SHA-256 over the canonical JSON of the shard list, so two nodes
//! that hold the same manifest plan the same order. A manifest of a dataset in object storage
//! also lists each object the shards read, with its size and ETag ([`ObjectEntry`]); the
//! digest then covers that list too, so a dataset whose objects changed has a new digest.
//! Manifests without it (local directories) keep the digest they always had.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// File name of the manifest inside a dataset directory.
pub const MANIFEST_FILE: &str = "shardwire.manifest.json";
/// Manifest format version written by this build.
pub const FORMAT: u32 = 1;
/// Hard limits a manifest must respect (it comes from the network).
pub const MAX_SHARDS: usize = 10_000_000;
/// Largest manifest file: it travels to nodes in one `Manifest` frame.
pub const MAX_MANIFEST_BYTES: usize = crate::wire::MAX_FRAME - 512;
/// At most this many tensors per shard.
pub const MAX_TENSORS_PER_SHARD: usize = 4096;
/// Most bytes one shard's payload may have: it is received whole into one slab of a
/// stream's memory, which no host or GPU has this much of; the bound keeps every size
/// computed from shard lengths far from overflowing.
pub const MAX_SHARD_LENGTH: u64 = 1 << 40;
/// At most this many dimensions per tensor.
pub const MAX_DIMS: usize = 32;
/// Suffix of the offsets tensor delivered with a ragged tensor.
pub const OFFSETS_SUFFIX: &str = ".offsets";

/// Element types shardwire can describe (numpy names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// signed 8-bit
    Int8,
    /// signed 16-bit
    Int16,
    /// signed 32-bit
    Int32,
    /// signed 64-bit
    Int64,
    /// unsigned 8-bit
    Uint8,
    /// unsigned 16-bit
    Uint16,
    /// unsigned 32-bit
    Uint32,
    /// unsigned 64-bit
    Uint64,
    /// IEEE half
    Float16,
    /// IEEE single
    Float32,
    /// IEEE double
    Float64,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            Self::Int8 | Self::Uint8 => 1,
            Self::Int16 | Self::Uint16 | Self::Float16 => 2,
            Self::Int32 | Self::Uint32 | Self::Float32 => 4,
            Self::Int64 | Self::Uint64 | Self::Float64 => 8,
        }
    }
    /// Every dtype.
    pub const ALL: [Self; 11] = [
        Self::Int8,
        Self::Int16,
        Self::Int32,
        Self::Int64,
        Self::Uint8,
        Self::Uint16,
        Self::Uint32,
        Self::Uint64,
        Self::Float16,
        Self::Float32,
        Self::Float64,
    ];

    /// The dtype of a numpy name (`"float32"`), or None.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|d| d.name() == name)
    }

    /// The numpy name, e.g. `"float32"`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Int8 => "int8",
            Self::Int16 => "int16",
            Self::Int32 => "int32",
            Self::Int64 => "int64",
            Self::Uint8 => "uint8",
            Self::Uint16 => "uint16",
            Self::Uint32 => "uint32",
            Self::Uint64 => "uint64",
            Self::Float16 => "float16",
            Self::Float32 => "float32",
            Self::Float64 => "float64",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One tensor inside a shard.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorEntry {
    /// Name (Arrow column name, the file stem for `.npy`/`.bin`, a WebDataset field).
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape, C order: `[rows, ...]`; for a ragged tensor `[total elements]` of all rows.
    pub shape: Vec<u64>,
    /// Byte offset in the file (of the first row when [`Self::rows`] is set).
    pub offset: u64,
    /// Byte length (= product(shape) * dtype size): the bytes delivered.
    pub length: u64,
    /// Per row, its byte range `[offset, length]` relative to the shard's offset, when rows
    /// are not one dense range. Every row has `length / rows` bytes unless `ragged`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows: Option<Vec<[u64; 2]>>,
    /// Rows of varying length (a whole number of elements each); needs `rows`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ragged: bool,
}

impl TensorEntry {
    /// A dense tensor: `length` bytes at `offset`, row `i` at `offset + i * length / rows`.
    pub fn dense(name: String, dtype: DType, shape: Vec<u64>, offset: u64, length: u64) -> Self {
        Self {
            name,
            dtype,
            shape,
            offset,
            length,
            rows: None,
            ragged: false,
        }
    }

    /// Rows (samples) of the tensor.
    pub fn row_count(&self) -> u64 {
        match &self.rows {
            Some(r) => r.len() as u64,
            None => self.shape.first().copied().unwrap_or(1),
        }
    }

    /// Whether the node must assemble the tensor's rows before delivery.
    pub fn needs_assembly(&self) -> bool {
        self.rows.is_some()
    }
}

/// One shard: a byte range of a file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardEntry {
    /// Path relative to the dataset directory.
    pub file: String,
    /// Byte offset of the payload in the file.
    pub offset: u64,
    /// Payload size in bytes.
    pub length: u64,
    /// CRC-32C of the payload.
    pub crc32c: u32,
    /// Tensors inside the payload.
    pub tensors: Vec<TensorEntry>,
}

impl ShardEntry {
    /// Offset of `t`, a dense tensor of this shard (one without a row table, which
    /// [`Manifest::validate`] checks lies inside the shard), relative to the start of the
    /// shard's payload; 0 for one that starts before it.
    pub fn relative_offset(&self, t: &TensorEntry) -> u64 {
        t.offset.saturating_sub(self.offset)
    }
}

/// One object (file) the shards read, as the object store listed it when indexed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ObjectEntry {
    /// Path relative to the dataset prefix (as in [`ShardEntry::file`]).
    pub file: String,
    /// Size in bytes.
    pub size: u64,
    /// The ETag the store reported (S3 keeps its double quotes); sent as `If-Match`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etag: Option<String>,
}

/// The whole manifest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Format version ([`FORMAT`]).
    pub format: u32,
    /// Hex SHA-256 over the canonical shard list ([`Manifest::compute_digest`]).
    pub digest: String,
    /// Total payload bytes over all shards.
    pub total_bytes: u64,
    /// The shards, in index order.
    pub shards: Vec<ShardEntry>,
    /// For a dataset in object storage: every object the shards read, sorted by file, with
    /// its size and ETag (absent, and not in the digest, for a local directory).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub objects: Vec<ObjectEntry>,
}

/// Why a manifest is not acceptable.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// Not valid JSON for the manifest schema. serde_json's message quotes the source's keys
    /// with their JSON escapes decoded; they are shown escaped again (`json_error_text`).
    #[error("manifest is not valid: {}", crate::wire::json_error_text(.0))]
    Json(#[from] serde_json::Error),
    /// Unknown format version.
    #[error("manifest format {0} is not supported (this build reads format {FORMAT})")]
    Format(u32),
    /// The digest does not match the content. The source's strings here and in `Shard` and
    /// `Objects` may hold a `\n` (JSON-decoded); they are shown escaped (`wire::printable`), so
    /// a node log line quoting them cannot go on as a forged line.
    #[error(
        "manifest digest {} does not match its content ({computed})",
        crate::wire::printable(.stated)
    )]
    Digest {
        /// What the manifest says.
        stated: String,
        /// What the content hashes to.
        computed: String,
    },
    /// A shard or tensor is inconsistent.
    #[error(
        "shard {shard} ({}): {}",
        crate::wire::printable(.file),
        crate::wire::printable(.reason)
    )]
    Shard {
        /// Shard index.
        shard: usize,
        /// Its file.
        file: String,
        /// What is wrong.
        reason: String,
    },
    /// The manifest is too large.
    #[error("manifest has {0} shards, more than the limit {MAX_SHARDS}")]
    TooManyShards(usize),
    /// No shards at all.
    #[error("manifest has no shards")]
    Empty,
    /// The manifest file is larger than a node can be sent.
    #[error(
        "manifest is {len} bytes; at most {MAX_MANIFEST_BYTES} can be sent to nodes (split the \
         dataset into several, or use larger shards)"
    )]
    TooLarge {
        /// The file's length in bytes.
        len: u64,
    },
    /// The object list is inconsistent.
    #[error("manifest objects: {}", crate::wire::printable(.0))]
    Objects(String),
}

impl Manifest {
    /// Builds a manifest from shards, computing totals and the digest.
    pub fn new(shards: Vec<ShardEntry>) -> Self {
        Self::with_objects(shards, Vec::new())
    }

    /// Builds a manifest of a dataset in object storage: shards and the objects they read
    /// (sorted here by file), the digest covering both.
    pub fn with_objects(shards: Vec<ShardEntry>, mut objects: Vec<ObjectEntry>) -> Self {
        objects.sort_by(|a, b| a.file.cmp(&b.file));
        // Saturating: a sum past 2^64 fails `validate`, not this.
        let total_bytes = shards.iter().fold(0u64, |a, s| a.saturating_add(s.length));
        let digest = Self::compute_digest_of(&shards, &objects);
        Self {
            format: FORMAT,
            digest,
            total_bytes,
            shards,
            objects,
        }
    }

    /// Hex SHA-256 over the canonical JSON of `shards` (the digest of a manifest without
    /// objects).
    pub fn compute_digest(shards: &[ShardEntry]) -> String {
        Self::compute_digest_of(shards, &[])
    }

    /// Hex SHA-256 over the canonical JSON of `shards`, then, when there are objects, the
    /// bytes `"\nobjects:"` and the canonical JSON of `objects`.
    pub fn compute_digest_of(shards: &[ShardEntry], objects: &[ObjectEntry]) -> String {
        let mut h = Sha256::new();
        h.update(serde_json::to_vec(shards).expect("shard list serialises"));
        if !objects.is_empty() {
            h.update(b"\nobjects:");
            h.update(serde_json::to_vec(objects).expect("object list serialises"));
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The object entry of `file`, when the manifest lists objects.
    pub fn object(&self, file: &str) -> Option<&ObjectEntry> {
        let i = self
            .objects
            .binary_search_by(|o| o.file.as_str().cmp(file))
            .ok()?;
        self.objects.get(i)
    }

    /// The manifest of a mixture: every part's shards in order (part `k`'s shards after
    /// those of parts `< k`, their files prefixed `NAME/`), under a digest of the parts' names
    /// and digests. It is never served; a mixture stream fetches each shard from its part.
    pub fn mixture(parts: &[(&str, &Manifest)]) -> Manifest {
        let mut h = Sha256::new();
        h.update(b"shardwire-mixture-v1");
        let mut shards = Vec::new();
        let mut objects = Vec::new();
        for (name, m) in parts {
            h.update((name.len() as u64).to_le_bytes());
            h.update(name.as_bytes());
            h.update(m.digest.as_bytes());
            shards.extend(m.shards.iter().map(|s| ShardEntry {
                file: format!("{name}/{}", s.file),
                ..s.clone()
            }));
            objects.extend(m.objects.iter().map(|o| ObjectEntry {
                file: format!("{name}/{}", o.file),
                ..o.clone()
            }));
        }
        objects.sort_by(|a, b| a.file.cmp(&b.file));
        Manifest {
            format: FORMAT,
            digest: h.finalize().iter().map(|b| format!("{b:02x}")).collect(),
            total_bytes: parts
                .iter()
                .fold(0u64, |a, (_, m)| a.saturating_add(m.total_bytes)),
            shards,
            objects,
        }
    }

    /// The digest as 32 bytes.
    pub fn digest_bytes(&self) -> [u8; 32] {
        let mut out = [0u8; 32];
        for (i, o) in out.iter_mut().enumerate() {
            *o = u8::from_str_radix(self.digest.get(2 * i..2 * i + 2).unwrap_or("00"), 16)
                .unwrap_or(0);
        }
        out
    }

    /// Parses and fully validates manifest JSON (it may come from the network).
    pub fn from_json(bytes: &[u8]) -> Result<Self, ManifestError> {
        Self::check_size(bytes.len() as u64)?;
        let m: Manifest = serde_json::from_slice(bytes)?;
        m.validate()?;
        Ok(m)
    }

    /// A manifest file of `len` bytes can be sent to nodes (checked before it is read).
    pub fn check_size(len: u64) -> Result<(), ManifestError> {
        if len > MAX_MANIFEST_BYTES as u64 {
            return Err(ManifestError::TooLarge { len });
        }
        Ok(())
    }

    /// JSON for the manifest file: compact (one line), since row tables would make a
    /// pretty-printed manifest several times larger (and manifests travel in one frame of
    /// at most 64 MiB); `python -m json.tool` shows it indented.
    pub fn to_json(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec(self).expect("manifest serialises");
        v.push(b'\n');
        v
    }

    /// Checks format, digest, limits and that every tensor lies inside its shard.
    pub fn validate(&self) -> Result<(), ManifestError> {
        if self.format != FORMAT {
            return Err(ManifestError::Format(self.format));
        }
        if self.shards.is_empty() {
            return Err(ManifestError::Empty);
        }
        if self.shards.len() > MAX_SHARDS {
            return Err(ManifestError::TooManyShards(self.shards.len()));
        }
        for (i, s) in self.shards.iter().enumerate() {
            let bad = |reason: String| ManifestError::Shard {
                shard: i,
                file: s.file.clone(),
                reason,
            };
            if s.file.is_empty() || s.file.starts_with('/') || s.file.split('/').any(|c| c == "..")
            {
                return Err(bad("file must be a relative path inside the dataset".into()));
            }
            if s.length == 0 {
                return Err(bad("payload length is 0".into()));
            }
            if s.length > MAX_SHARD_LENGTH {
                return Err(bad(format!(
                    "payload length {} is over the limit of {MAX_SHARD_LENGTH} bytes (1 TiB): \
                     index the dataset with smaller shards",
                    s.length
                )));
            }
            // Checked here, so `check_tensor` may add them.
            s.offset
                .checked_add(s.length)
                .ok_or_else(|| bad("offset + length overflows".into()))?;
            if s.tensors.is_empty() || s.tensors.len() > MAX_TENSORS_PER_SHARD {
                return Err(bad(format!(
                    "has {} tensors (allowed 1..={MAX_TENSORS_PER_SHARD})",
                    s.tensors.len()
                )));
            }
            check_names(&s.tensors).map_err(&bad)?;
            for t in &s.tensors {
                check_tensor(t, s).map_err(&bad)?;
            }
        }
        check_objects(&self.objects, &self.shards)?;
        let computed = Self::compute_digest_of(&self.shards, &self.objects);
        if computed != self.digest {
            return Err(ManifestError::Digest {
                stated: self.digest.clone(),
                computed,
            });
        }
        // Checked: a peer's lengths can sum past 2^64 (a panic in debug builds, a wrapped
        // total that might match in release).
        let total = self
            .shards
            .iter()
            .try_fold(0u64, |a, s| a.checked_add(s.length));
        if total != Some(self.total_bytes) {
            let sum = total.map_or("more than 2^64".into(), |t| t.to_string());
            return Err(ManifestError::Shard {
                shard: 0,
                file: String::new(),
                reason: format!(
                    "total_bytes {} != sum of shard lengths {sum}",
                    self.total_bytes
                ),
            });
        }
        Ok(())
    }
}

/// When objects are listed: sorted by file without repeats, and every shard's file among them
/// with the shard inside its size.
fn check_objects(objects: &[ObjectEntry], shards: &[ShardEntry]) -> Result<(), ManifestError> {
    if objects.is_empty() {
        return Ok(());
    }
    if let Some(w) = objects.windows(2).find(|w| w[0].file >= w[1].file) {
        return Err(ManifestError::Objects(format!(
            "objects must be sorted by file, each once: `{}` then `{}`",
            w[0].file, w[1].file
        )));
    }
    for (i, s) in shards.iter().enumerate() {
        let bad = |reason: String| ManifestError::Shard {
            shard: i,
            file: s.file.clone(),
            reason,
        };
        let Ok(k) = objects.binary_search_by(|o| o.file.as_str().cmp(&s.file)) else {
            return Err(bad("its file is not among the manifest's objects".into()));
        };
        let size = objects[k].size;
        if s.offset + s.length > size {
            return Err(bad(format!(
                "range {}+{} lies beyond the object's {size} bytes",
                s.offset, s.length
            )));
        }
    }
    Ok(())
}

/// The elements of `shape` as numpy counts them (what the Python SDK views a tensor with):
/// `None` where numpy refuses the shape: a dimension, or the product of the non-zero ones,
/// past 2^63 - 1; else that product, or 0 when a dimension is 0.
pub fn shape_elements(shape: &[u64]) -> Option<u64> {
    let nonzero = shape
        .iter()
        .filter(|&&d| d != 0)
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .filter(|&p| i64::try_from(p).is_ok())?;
    if shape.iter().any(|&d| i64::try_from(d).is_err()) {
        return None;
    }
    Some(if shape.contains(&0) { 0 } else { nonzero })
}

/// Checks one tensor of shard `s`: its row table, dims, length against shape x dtype, and a
/// dense tensor's range inside the shard.
fn check_tensor(t: &TensorEntry, s: &ShardEntry) -> Result<(), String> {
    check_rows(t, s.length)?;
    if t.shape.len() > MAX_DIMS {
        return Err(format!(
            "tensor `{}` has {} dims (max {MAX_DIMS})",
            t.name,
            t.shape.len()
        ));
    }
    if let Some(d) = t.shape.iter().find(|&&d| i64::try_from(d).is_err()) {
        return Err(format!(
            "tensor `{}`: dimension {d} of shape {:?} is past 2^63 - 1, which no array library takes",
            t.name, t.shape
        ));
    }
    let expect = shape_elements(&t.shape).and_then(|e| e.checked_mul(t.dtype.size()));
    if expect != Some(t.length) {
        return Err(format!(
            "tensor `{}`: length {} != shape {:?} x {} bytes",
            t.name,
            t.length,
            t.shape,
            t.dtype.size()
        ));
    }
    let (t_end, end) = (t.offset.checked_add(t.length), s.offset + s.length);
    if t.rows.is_none() && (t.offset < s.offset || t_end.is_none_or(|e| e > end)) {
        return Err(format!(
            "tensor `{}` range {}+{} lies outside the shard {}+{}",
            t.name, t.offset, t.length, s.offset, s.length
        ));
    }
    Ok(())
}

/// Tensor names are unique in a shard, also counting the `c.offsets` a ragged `c` brings;
/// the error says which name clashes and what to do.
pub fn check_names(tensors: &[TensorEntry]) -> Result<(), String> {
    let mut seen = std::collections::HashSet::new();
    let offsets = tensors
        .iter()
        .filter(|t| t.ragged)
        .map(|t| format!("{}{OFFSETS_SUFFIX}", t.name));
    for name in tensors.iter().map(|t| t.name.clone()).chain(offsets) {
        if !seen.insert(name.clone()) {
            return Err(format!(
                "two tensors are named `{name}` (a ragged tensor `c` also delivers `c{OFFSETS_SUFFIX}`); rename one"
            ));
        }
    }
    Ok(())
}

/// Checks a tensor's row table: present when ragged, rows inside the shard (of `shard_len`
/// bytes), a whole number of elements each, all of one size unless ragged, and summing to
/// the tensor's length.
fn check_rows(t: &TensorEntry, shard_len: u64) -> Result<(), String> {
    let Some(rows) = &t.rows else {
        return match t.ragged {
            true => Err(format!("tensor `{}` is ragged but has no rows", t.name)),
            false => Ok(()),
        };
    };
    if t.ragged && t.shape.len() != 1 {
        return Err(format!(
            "ragged tensor `{}` has shape {:?}; a ragged tensor's shape is [total elements]",
            t.name, t.shape
        ));
    }
    let size = t.dtype.size();
    let row_bytes = match t.ragged {
        true => None,
        false => Some(t.length / (rows.len() as u64).max(1)),
    };
    let mut total = 0u64;
    for (i, &[off, len]) in rows.iter().enumerate() {
        if off.checked_add(len).is_none_or(|e| e > shard_len) {
            return Err(format!(
                "tensor `{}` row {i} at {off}+{len} lies outside the shard's {shard_len} bytes",
                t.name
            ));
        }
        if len % size != 0 || row_bytes.is_some_and(|b| b != len) {
            return Err(format!(
                "tensor `{}` row {i} has {len} bytes; rows are {} of {size}-byte elements",
                t.name,
                match row_bytes {
                    Some(b) => format!("{b} bytes"),
                    None => "a whole number".into(),
                }
            ));
        }
        total += len;
    }
    if total != t.length || (!t.ragged && t.shape.first() != Some(&(rows.len() as u64))) {
        return Err(format!(
            "tensor `{}`: {} rows of {total} bytes in all disagree with shape {:?} and length {}",
            t.name,
            rows.len(),
            t.shape,
            t.length
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manifest_too_large_for_its_frame_is_refused_naming_its_size() {
        assert!(Manifest::check_size(MAX_MANIFEST_BYTES as u64).is_ok());
        let e = Manifest::check_size(MAX_MANIFEST_BYTES as u64 + 1).unwrap_err();
        assert!(
            matches!(e, ManifestError::TooLarge { len } if len == MAX_MANIFEST_BYTES as u64 + 1)
        );
        assert!(
            e.to_string()
                .contains(&format!("{} bytes", MAX_MANIFEST_BYTES + 1)),
            "{e}"
        );
        // The largest manifest file still fits in a Manifest frame.
        let msg = crate::wire::Message::Manifest {
            req: 1,
            dataset: "d".repeat(crate::wire::MAX_DATASET_NAME),
            json: vec![b' '; MAX_MANIFEST_BYTES],
        };
        let mut frame = Vec::new();
        crate::wire::encode(&msg, &mut frame).expect("the largest manifest is sendable");
        assert!(frame.len() - 4 <= crate::wire::MAX_FRAME);
    }

    #[test]
    fn a_line_break_in_a_sources_key_is_escaped_in_the_error() {
        // Before, serde_json's message quoted the key with its `\n` decoded, and the node's
        // log line showing it went on as a forged line.
        let body = br#"{"format":1,"x\nINFO shardwire_node: forged\r":1}"#;
        let e = Manifest::from_json(body).unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, ManifestError::Json(_)), "{text}");
        assert!(!text.contains(|c: char| c.is_control()), "{text:?}");
        assert!(text.contains(r"x\nINFO shardwire_node: forged\r"), "{text}");
    }

    /// `m`'s error from `from_json`, asserted to be on one printable line that shows
    /// `FORGED`'s line break escaped.
    fn forged_line_error(m: &Manifest) -> ManifestError {
        let e = Manifest::from_json(&m.to_json()).unwrap_err();
        let text = e.to_string();
        assert!(!text.contains(|c: char| c.is_control()), "{text:?}");
        assert!(text.contains(r"x\nINFO shardwire_node: forged"), "{text}");
        e
    }

    const FORGED: &str = "x\nINFO shardwire_node: forged";

    #[test]
    fn a_line_break_in_a_sources_strings_is_escaped_in_the_error() {
        // Before, the digest, a shard's file, a tensor's name and an object's file were shown
        // as decoded, and a `\n` in them started a forged line in the node's log.
        let mut m = sample();
        m.digest = FORGED.into();
        assert!(matches!(
            forged_line_error(&m),
            ManifestError::Digest { .. }
        ));

        let mut m = sample();
        (m.shards[0].file, m.shards[0].length) = (FORGED.into(), 0);
        assert!(matches!(forged_line_error(&m), ManifestError::Shard { .. }));

        let mut m = sample();
        m.shards[0].tensors[0].name = FORGED.into();
        m.shards[0].tensors[0].length = 8;
        assert!(matches!(forged_line_error(&m), ManifestError::Shard { .. }));

        let mut m = sample();
        m.objects = vec![object(FORGED, 200, "e"), object(FORGED, 200, "e")];
        assert!(matches!(forged_line_error(&m), ManifestError::Objects(_)));
    }

    fn sample() -> Manifest {
        Manifest::new(vec![ShardEntry {
            file: "a.npy".into(),
            offset: 128,
            length: 24,
            crc32c: 1,
            tensors: vec![TensorEntry::dense(
                "a".into(),
                DType::Float32,
                vec![2, 3],
                128,
                24,
            )],
        }])
    }

    fn with_rows(rows: Vec<[u64; 2]>, ragged: bool, shape: Vec<u64>, length: u64) -> Manifest {
        let mut m = sample();
        let t = &mut m.shards[0].tensors[0];
        (t.rows, t.ragged, t.shape, t.length) = (Some(rows), ragged, shape, length);
        t.dtype = DType::Uint16;
        Manifest::new(m.shards)
    }

    #[test]
    fn row_tables_are_checked() {
        // Two scattered rows of 3 uint16, and ragged rows of 1 and 5 elements.
        let ok = with_rows(vec![[0, 6], [12, 6]], false, vec![2, 3], 12);
        ok.validate().unwrap();
        assert!(ok.shards[0].tensors[0].needs_assembly());
        assert_eq!(ok.shards[0].tensors[0].row_count(), 2);
        let back = Manifest::from_json(&ok.to_json()).unwrap();
        assert_eq!(back, ok);
        with_rows(vec![[0, 2], [4, 10]], true, vec![6], 12)
            .validate()
            .unwrap();
        let err = |m: Manifest| m.validate().unwrap_err().to_string();
        assert!(
            err(with_rows(vec![[20, 6]], false, vec![1, 3], 6))
                .contains("row 0 at 20+6 lies outside")
        );
        assert!(
            err(with_rows(vec![[0, 6], [8, 4]], false, vec![2, 3], 12))
                .contains("row 1 has 4 bytes")
        );
        assert!(err(with_rows(vec![[0, 3]], true, vec![1], 3)).contains("row 0 has 3 bytes"));
        assert!(err(with_rows(vec![[0, 2]], true, vec![2], 4)).contains("disagree"));
        assert!(
            err(with_rows(vec![[0, 2]], true, vec![1, 1], 2)).contains("shape is [total elements]")
        );
        let mut m = sample();
        m.shards[0].tensors[0].ragged = true;
        assert!(err(Manifest::new(m.shards)).contains("ragged but has no rows"));
        // A ragged `a` delivers `a.offsets`: a tensor of that name clashes, as does a twin.
        let mut m = with_rows(vec![[0, 2], [4, 10]], true, vec![6], 12);
        let mut clash = m.shards[0].tensors[0].clone();
        (
            clash.name,
            clash.rows,
            clash.ragged,
            clash.shape,
            clash.length,
        ) = ("a.offsets".into(), None, false, vec![1], 2);
        m.shards[0].tensors.push(clash);
        assert!(err(Manifest::new(m.shards.clone())).contains("two tensors are named `a.offsets`"));
        m.shards[0].tensors[1].name = "a".into();
        assert!(err(Manifest::new(m.shards)).contains("two tensors are named `a`"));
    }

    #[test]
    fn shapes_are_read_as_the_sdks_read_them() {
        // Before, [0, 2^63] was accepted (both SDKs refuse every batch carrying it) and
        // [2^40, 4, 0] taken as numpy takes it only by the order of its dimensions.
        let shaped = |shape: Vec<u64>, length: u64| {
            let mut m = sample();
            let t = &mut m.shards[0].tensors[0];
            (t.shape, t.length) = (shape, length);
            Manifest::new(m.shards).validate()
        };
        let e = shaped(vec![0, 1 << 63], 0).unwrap_err().to_string();
        assert!(e.contains("past 2^63 - 1"), "{e}");
        // numpy's rule: zeros make no elements, but the others' product must fit an intp.
        shaped(vec![1 << 40, 4, 0], 0).unwrap();
        assert!(shaped(vec![1 << 62, 4, 0], 0).is_err(), "numpy refuses it");
        assert_eq!(shape_elements(&[]), Some(1), "a scalar");
        assert_eq!(shape_elements(&[3, 0, 1 << 60]), Some(0));
        assert_eq!(shape_elements(&[1 << 32, 1 << 31]), None);
    }

    #[test]
    fn round_trip_and_validate() {
        let m = sample();
        let back = Manifest::from_json(&m.to_json()).unwrap();
        assert_eq!(back, m);
        assert_eq!(m.digest.len(), 64);
    }

    #[test]
    fn digest_mismatch_is_detected() {
        let mut m = sample();
        m.shards[0].crc32c = 2;
        assert!(matches!(m.validate(), Err(ManifestError::Digest { .. })));
    }

    #[test]
    fn tensor_outside_shard_is_rejected() {
        let mut m = sample();
        m.shards[0].tensors[0].offset = 200;
        m.digest = Manifest::compute_digest(&m.shards);
        let err = m.validate().unwrap_err().to_string();
        assert!(err.contains("outside the shard"), "{err}");
    }

    #[test]
    fn escaping_paths_and_unknown_keys_are_rejected() {
        let mut m = sample();
        m.shards[0].file = "../etc/passwd".into();
        m.digest = Manifest::compute_digest(&m.shards);
        assert!(
            m.validate()
                .unwrap_err()
                .to_string()
                .contains("relative path")
        );
        let json = String::from_utf8(sample().to_json()).unwrap().replacen(
            "\"format\"",
            "\"bogus\": 1, \"format\"",
            1,
        );
        assert!(
            Manifest::from_json(json.as_bytes())
                .unwrap_err()
                .to_string()
                .contains("bogus")
        );
    }

    #[test]
    fn manifests_without_objects_keep_their_digest_and_json() {
        // The digest `shardwire index` always wrote for this shard list (SHA-256 of its
        // canonical JSON), and no `objects` key.
        let m = sample();
        assert_eq!(
            m.digest,
            "b845ccacc6f498c248cb4ba6936a445a05bab6c9fa26f26d9a9379ae5a790855"
        );
        let json = String::from_utf8(m.to_json()).unwrap();
        assert!(!json.contains("objects"), "{json}");
        assert_eq!(Manifest::from_json(json.as_bytes()).unwrap(), m);
    }

    fn object(file: &str, size: u64, etag: &str) -> ObjectEntry {
        ObjectEntry {
            file: file.into(),
            size,
            etag: Some(etag.into()),
        }
    }

    #[test]
    fn objects_are_listed_sorted_and_in_the_digest() {
        let shards = sample().shards;
        let m = Manifest::with_objects(
            shards.clone(),
            vec![object("z.bin", 1, "\"z\""), object("a.npy", 152, "\"e1\"")],
        );
        assert_eq!(m.objects[0].file, "a.npy", "sorted by file");
        assert_eq!(m.object("a.npy").unwrap().etag.as_deref(), Some("\"e1\""));
        assert!(m.object("b.npy").is_none());
        assert_ne!(m.digest, sample().digest);
        let back = Manifest::from_json(&m.to_json()).unwrap();
        assert_eq!(back, m);
        // Another ETag: another digest.
        let changed = Manifest::with_objects(
            shards.clone(),
            vec![object("a.npy", 152, "\"e2\""), object("z.bin", 1, "\"z\"")],
        );
        assert_ne!(changed.digest, m.digest);
        // A stated digest that ignores the objects is refused.
        let mut forged = m.clone();
        forged.digest = sample().digest;
        assert!(matches!(
            forged.validate(),
            Err(ManifestError::Digest { .. })
        ));
    }

    #[test]
    fn objects_must_cover_the_shards() {
        let shards = sample().shards;
        let err = |objects: Vec<ObjectEntry>| {
            let mut m = Manifest::with_objects(shards.clone(), Vec::new());
            m.objects = objects;
            m.digest = Manifest::compute_digest_of(&m.shards, &m.objects);
            m.validate().unwrap_err().to_string()
        };
        assert!(err(vec![object("b.npy", 200, "e")]).contains("not among the manifest's objects"));
        assert!(err(vec![object("a.npy", 100, "e")]).contains("beyond the object's 100 bytes"));
        let e = err(vec![object("b", 1, "e"), object("a.npy", 200, "e")]);
        assert!(e.contains("sorted by file"), "{e}");
    }

    #[test]
    fn mixtures_prefix_the_objects() {
        let m = Manifest::with_objects(sample().shards, vec![object("a.npy", 152, "e")]);
        let mix = Manifest::mixture(&[("one", &m), ("two", &sample())]);
        assert_eq!(mix.objects, [object("one/a.npy", 152, "e")]);
    }

    #[test]
    fn huge_shard_lengths_are_refused() {
        // Before, a length of 2^63 passed (a slab class that wrapped to 4 KiB in release)
        // and the sum overflowed: a panic in debug builds, a wrapped total in release.
        let huge = |file: &str| ShardEntry {
            file: file.into(),
            offset: 0,
            length: 1 << 63,
            crc32c: 1,
            tensors: vec![TensorEntry::dense(
                "a".into(),
                DType::Uint8,
                vec![1 << 63],
                0,
                1 << 63,
            )],
        };
        let mut m = Manifest::new(vec![huge("a"), huge("b")]);
        assert_eq!(m.total_bytes, u64::MAX);
        let e = m.validate().unwrap_err().to_string();
        assert!(e.contains("over the limit of 1099511627776 bytes"), "{e}");
        m.total_bytes = 0; // what a wrapped sum gave
        assert!(m.validate().is_err());
    }

    #[test]
    fn wrong_length_is_rejected() {
        let mut m = sample();
        m.shards[0].tensors[0].shape = vec![7];
        m.digest = Manifest::compute_digest(&m.shards);
        assert!(m.validate().unwrap_err().to_string().contains("length 24"));
    }
}
