//! WebDataset shards (uncompressed `.tar`): the whole tar file is one shard, and every
//! field of its samples one tensor with a row table (one row per sample).
//!
//! Members are grouped as `webdataset.tariterators` does: only regular files count;
//! metadata members (`__*__`) and names without a key/field split are skipped; a sample is
//! the run of consecutive members with the same key; the name splits at the first dot of
//! its basename (`a/b/000123.img.npy` -> key `a/b/000123`, field `img.npy`) and the field is
//! lowercased. Every sample must have the same fields. A `.npy` field whose members all
//! hold arrays of one dtype and shape becomes a typed `[rows, ...]` tensor over their data
//! sections; every other field is a ragged `uint8` tensor of the members' raw bytes.
//! Compressed tars (gzip, xz, bzip2, zstd, ...) are refused: a compressed stream cannot be
//! fetched by byte range.
//!
//! What webdataset skips is not skipped unseen ([`SkippedMembers`], a note per tar): links
//! (symbolic or hard: neither is followed, a hard link's data is another member's) and
//! regular files whose name has no key/field split. A field that only links hold, or a
//! sample that lacks a field its link member would give, is refused rather than served
//! without it ([`refuse_links`]): a tar of a staging folder of symbolic links
//! (`tar cf s.tar -C st .` without `-h`) would lose a whole modality.

use shardwire_protocol::manifest::{DType, ShardEntry, TensorEntry, shape_elements};

use crate::error::IndexError;
use crate::npy;
use crate::source::Source;

/// One field of one sample: the member's data `[offset, length]` in the tar.
type Row = [u64; 2];

/// A sample: consecutive regular-file members sharing a key, as `(field, row)`.
struct Sample {
    key: String,
    members: Vec<(String, Row)>,
}

/// The members' raw rows of a typed `.npy` tensor, kept for [`harmonize`].
pub(crate) struct RawRows {
    /// Index of the shard in the dataset's shard list.
    shard: usize,
    /// The field (tensor name).
    field: String,
    /// Each member's whole bytes.
    rows: Vec<Row>,
}

impl RawRows {
    /// The same rows, for the shard at index `shard` of the dataset.
    pub(crate) fn in_shard(self, shard: usize) -> Self {
        Self { shard, ..self }
    }
}

/// The members of one tar that are not read, though webdataset skips them too: named in a
/// note ([`crate::IndexReport::notes`]), as nothing is left out unseen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SkippedMembers {
    /// The tar, relative to the dataset.
    pub file: String,
    /// Link members (symbolic or hard) whose name splits into key and field.
    pub links: u64,
    /// Regular members whose name has no key/field split (`README`, `a.b/noext`).
    pub unsplit: u64,
    /// The first few of them (`000123.jpg -> /img/123.jpg`, `README`).
    pub examples: Vec<String>,
}

/// How many members [`SkippedMembers::examples`] keeps.
const EXAMPLES: usize = 3;

impl std::fmt::Display for SkippedMembers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut what = Vec::new();
        if self.links > 0 {
            let links = if self.links == 1 { "link" } else { "links" };
            what.push(format!("{} {links}, not followed", self.links));
        }
        if self.unsplit > 0 {
            what.push(format!("{} without a key.field name", self.unsplit));
        }
        let more = self.links + self.unsplit - self.examples.len() as u64;
        let mut names = self.examples.join(", ");
        if more > 0 {
            names.push_str(&format!(", and {more} more"));
        }
        write!(f, "{} ({}: {names})", self.file, what.join("; "))
    }
}

/// What one tar yields.
pub(crate) struct Tar {
    /// Its shard (none when it holds no samples).
    pub shards: Vec<ShardEntry>,
    /// The raw rows of its typed tensors (for shard 0: see [`RawRows::in_shard`]).
    pub raw: Vec<RawRows>,
    /// The members not read, when there are any.
    pub skipped: Option<SkippedMembers>,
}

/// Indexes an uncompressed WebDataset tar.
pub(crate) fn index(src: &mut Source) -> Result<Tar, IndexError> {
    let (samples, skipped) = read_samples(src)?;
    refuse_links(src, &samples, &skipped.links)?;
    let skipped = skipped.into_note(&src.rel);
    if samples.is_empty() {
        return Ok(Tar {
            shards: Vec::new(),
            raw: Vec::new(),
            skipped,
        });
    }
    let columns = columns(src, &samples)?;
    let mut tensors = Vec::with_capacity(columns.len());
    let mut raw = Vec::new();
    for (field, rows) in columns {
        let typed = if field == "npy" || field.ends_with(".npy") {
            npy_tensor(src, &field, &rows)?
        } else {
            None
        };
        match typed {
            Some(t) => {
                let field = field.clone();
                raw.push(RawRows {
                    shard: 0,
                    field,
                    rows,
                });
                tensors.push(t);
            }
            None => tensors.push(ragged(field, rows)),
        }
    }
    let len = src.len;
    Ok(Tar {
        shards: vec![src.shard(0, len, tensors)?],
        raw,
        skipped,
    })
}

/// A link member whose name splits into key and field.
struct Link {
    key: String,
    field: String,
    /// `name -> target`.
    shown: String,
}

/// The members [`read_samples`] does not read.
#[derive(Default)]
struct Skipped {
    links: Vec<Link>,
    unsplit: Vec<String>,
}

impl Skipped {
    /// The note for the tar `rel`, when anything was skipped.
    fn into_note(self, rel: &str) -> Option<SkippedMembers> {
        if self.links.is_empty() && self.unsplit.is_empty() {
            return None;
        }
        let links = self.links.iter().map(|l| l.shown.clone());
        Some(SkippedMembers {
            file: rel.to_owned(),
            links: self.links.len() as u64,
            unsplit: self.unsplit.len() as u64,
            examples: links.chain(self.unsplit).take(EXAMPLES).collect(),
        })
    }
}

/// Refuses the tar when a link member's field is held by links only (the field would
/// vanish: a tar of symbolic links made without `tar -h`), or when the sample of a link
/// member lacks the field it would give (the sample would be served without it, or vanish,
/// or be refused for its fields with no word of the link).
fn refuse_links(src: &Source, samples: &[Sample], links: &[Link]) -> Result<(), IndexError> {
    const FIX: &str = "webdataset skips links (symbolic or hard) as shardwire does, so the \
                       field would be lost: write the tar with the files themselves (`tar -h` \
                       dereferences symbolic links, `--hard-dereference` hard links)";
    for l in links {
        let held = samples.iter().any(|s| has(&s.members, &l.field));
        if !held {
            let reason = format!("every `{}` member is a link, not a file: {FIX}", l.field);
            let n = links.iter().filter(|o| o.field == l.field).count();
            return Err(src.unsupported(reason, format!("{n} links, the first {}", l.shown)));
        }
        let sample = samples.iter().find(|s| s.key == l.key);
        if sample.is_none_or(|s| !has(&s.members, &l.field)) {
            let reason = format!("has its `{}` member as a link, not a file: {FIX}", l.field);
            return Err(sample_err(src, &l.key, &reason, &l.shown));
        }
    }
    Ok(())
}

/// Makes a `.npy` field ragged raw bytes in every tar shard unless all of them have it as
/// a typed tensor of one dtype and row shape, so that a field has one form over the
/// dataset (batch mode needs that).
pub(crate) fn harmonize(shards: &mut [ShardEntry], raw: Vec<RawRows>) {
    let mut names: Vec<String> = raw.iter().map(|r| r.field.clone()).collect();
    names.sort();
    names.dedup();
    for name in names {
        let mut forms = shards
            .iter()
            .filter(|s| s.file.to_ascii_lowercase().ends_with(".tar"))
            .flat_map(|s| &s.tensors)
            .filter(|t| t.name == name)
            .map(|t| (t.ragged, t.dtype, t.shape.get(1..).map(<[u64]>::to_vec)));
        let first = forms.next();
        if first
            .as_ref()
            .is_none_or(|f| !f.0 && forms.all(|g| &g == f))
        {
            continue;
        }
        for r in raw.iter().filter(|r| r.field == name) {
            let Some(s) = shards.get_mut(r.shard) else {
                continue;
            };
            if let Some(t) = s.tensors.iter_mut().find(|t| t.name == name) {
                *t = ragged(name.clone(), r.rows.clone());
            }
        }
    }
}

/// The error for a compressed tar (`.tar.gz`, `.tgz`, `.tar.xz`, `.tar.bz2`, `.tar.zst`,
/// ...: [`crate::walk::Kind::CompressedTar`]).
pub(crate) fn refuse_compressed(src: &Source) -> IndexError {
    let name = src.rel.rsplit('/').next().unwrap_or(&src.rel);
    let (codec, unpack, long) = compression(name);
    let short = match long {
        Some(long) => format!(" (a .{}: rename to .tar.{long} first)", short_ext(name)),
        None => String::new(),
    };
    src.unsupported(
        format!(
            "{codec}-compressed tars cannot be served: {codec} is not byte-addressable, so \
             shards cannot be fetched by byte range; unpack it with `{unpack}`{short} or \
             re-write the shards uncompressed"
        ),
        name,
    )
}

/// The compressor of a compressed tar named `name`: its name, the command that unpacks it,
/// and, for a short extension (`.tgz`), the long one to rename it to (`gz`).
fn compression(name: &str) -> (&'static str, &'static str, Option<&'static str>) {
    let ext = short_ext(name);
    let short = !name.to_ascii_lowercase().contains(".tar.");
    let (codec, unpack, long) = match ext.as_str() {
        "xz" | "txz" => ("xz", "unxz", "xz"),
        "bz2" | "tbz2" | "tbz" => ("bzip2", "bunzip2", "bz2"),
        "zst" | "zstd" | "tzst" => ("zstd", "unzstd", "zst"),
        "lz4" => ("lz4", "unlz4", "lz4"),
        "lzma" | "tlz" => ("lzma", "unlzma", "lzma"),
        _ => ("gzip", "gunzip", "gz"),
    };
    (codec, unpack, short.then_some(long))
}

/// The lower-cased last extension of `name` (`tgz`, `gz`).
fn short_ext(name: &str) -> String {
    name.rsplit_once('.')
        .map_or("", |(_, e)| e)
        .to_ascii_lowercase()
}

/// One member header of the tar.
struct Member {
    /// The name's raw bytes.
    name: Vec<u8>,
    /// A regular (or contiguous) file.
    file: bool,
    /// A symbolic or hard link: its target (lossy UTF-8).
    link: Option<String>,
    /// A GNU sparse member.
    sparse: bool,
    /// The data's `[offset, length]` in the tar.
    row: Row,
}

/// Reads every member header (the data is skipped by seeking, so an object costs a request
/// per stretch of headers, not per member).
fn read_members(src: &mut Source) -> Result<Vec<Member>, IndexError> {
    let path = src.path.clone();
    let bad = |e: std::io::Error| IndexError::Malformed {
        file: path.clone(),
        reason: "not a readable tar archive".into(),
        value: e.to_string(),
    };
    let mut reader = src.reader();
    let mut out = Vec::new();
    let result: Result<(), IndexError> = (|| {
        let mut archive = tar::Archive::new(&mut reader);
        for entry in archive.entries_with_seek().map_err(bad)? {
            let mut entry = entry.map_err(bad)?;
            let kind = entry.header().entry_type();
            let sparse = kind.is_gnu_sparse() || pax_sparse(&mut entry).map_err(bad)?;
            let link = (kind.is_symlink() || kind.is_hard_link()).then(|| {
                let target = entry.link_name_bytes().unwrap_or_default();
                String::from_utf8_lossy(&target).into_owned()
            });
            out.push(Member {
                name: entry.path_bytes().into_owned(),
                file: kind.is_file() || kind.is_contiguous(),
                link,
                sparse,
                row: [entry.raw_file_position(), entry.size()],
            });
        }
        Ok(())
    })();
    // A failed read of the file itself (a store error) is reported as it is.
    match (result, reader.error()) {
        (Err(_), Some(e)) => return Err(e),
        (r, _) => r?,
    }
    check_end(src, &out)?;
    Ok(out)
}

/// Whether `entry` is a sparse file in the PAX format (`tar --sparse --format=posix`): a
/// regular member whose data is the sparse map and the chunks that are not holes, named
/// `GNUSparseFile.N/NAME`, with its real name and size in `GNU.sparse.*` PAX records, which
/// the `tar` reader does not apply.
fn pax_sparse<R: std::io::Read>(entry: &mut tar::Entry<'_, R>) -> std::io::Result<bool> {
    let Some(records) = entry.pax_extensions()? else {
        return Ok(false);
    };
    for r in records {
        if r?.key_bytes().starts_with(b"GNU.sparse.") {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Checks that the tar's end-of-archive block (512 zero bytes) follows its last member: the
/// `tar` reader ends at the end of the file as at that block, so a tar cut short after a
/// member (a partial copy, an interrupted upload) would lose its later samples without it.
/// Only zero bytes may follow that block (the second end block, and the padding to the
/// record size, 10 KiB by default): the reader stops at the first, so the members of a tar
/// concatenated after it (`cat a.tar b.tar`) would be left out without a word.
fn check_end(src: &mut Source, members: &[Member]) -> Result<(), IndexError> {
    const BLOCK: u64 = 512;
    if members.iter().any(|m| m.sparse) {
        return Ok(()); // refused as sparse by the caller; its size is not its bytes in the tar
    }
    let end = match members.last() {
        None => 0,
        Some(m) => m.row[0]
            .checked_add(m.row[1])
            .and_then(|e| e.checked_next_multiple_of(BLOCK))
            .ok_or_else(|| src.malformed("a tar member runs past 2^64 bytes", m.row[1]))?,
    };
    let left = src.len.saturating_sub(end);
    if left < BLOCK {
        return Err(src.malformed(
            "the tar ends without its end-of-archive block: it was cut short (a partial copy or upload?); write or copy it again",
            format!("{left} bytes after the last member's data at {end}"),
        ));
    }
    let block = src.read_at("the end-of-archive block", end, BLOCK)?;
    if block.iter().any(|&b| b != 0) {
        return Err(src.malformed(
            "a tar member header that cannot be read follows the last member (a cut or damaged tar?)",
            format!("the block at {end}"),
        ));
    }
    let what = "the bytes after the end-of-archive block";
    let Some(at) = src.first_nonzero(what, end + BLOCK)? else {
        return Ok(());
    };
    Err(src.malformed(
        "data follows the tar's end-of-archive block, where tar readers stop: the file looks \
         like several tars concatenated (`cat a.tar b.tar`), whose later members would be left \
         out; keep each tar a shard of its own, or join them with `tar --concatenate`, which \
         drops the end blocks between them",
        format!(
            "a non-zero byte at {at}, {} bytes after the end of the last member at {end}",
            at - end
        ),
    ))
}

/// Reads the tar's member headers and groups the members into samples; returns them with
/// the members skipped that are named (links, names without a key/field split).
fn read_samples(src: &mut Source) -> Result<(Vec<Sample>, Skipped), IndexError> {
    let mut samples: Vec<Sample> = Vec::new();
    let mut skipped = Skipped::default();
    for m in read_members(src)? {
        let Ok(name) = std::str::from_utf8(&m.name) else {
            let lossy = String::from_utf8_lossy(&m.name).into_owned();
            return Err(src.unsupported("tar member name is not valid UTF-8", lossy));
        };
        if m.sparse {
            return Err(src.unsupported(
                "sparse tar members are not supported; re-write the tar without --sparse",
                name,
            ));
        }
        if !(m.file || m.link.is_some()) || is_meta(name) {
            continue;
        }
        let Some((key, field)) = split_name(name) else {
            if m.file {
                skipped.unsplit.push(name.to_owned());
            }
            continue;
        };
        if let Some(target) = m.link {
            skipped.links.push(Link {
                key: key.to_owned(),
                field: field.to_lowercase(),
                shown: format!("{name} -> {target}"),
            });
            continue;
        }
        if field.is_empty() {
            let why =
                "has a member whose field (the name after its key's first `.`) is empty; rename it";
            return Err(sample_err(src, key, why, name));
        }
        let row = m.row;
        src.check_range(&format!("tar member `{name}`"), row[0], row[1])?;
        let field = field.to_lowercase();
        match samples.last_mut() {
            Some(s) if s.key == key => {
                if s.members.iter().any(|(f, _)| *f == field) {
                    return Err(sample_err(src, key, "duplicate field in the sample", field));
                }
                s.members.push((field, row));
            }
            _ => samples.push(Sample {
                key: key.to_owned(),
                members: vec![(field, row)],
            }),
        }
    }
    Ok((samples, skipped))
}

/// Whether webdataset skips the member as metadata (`__key__`, `__meta__/x`).
fn is_meta(name: &str) -> bool {
    let first = name.split('/').next().unwrap_or("");
    let plain = !name.contains('/') && name.starts_with("__") && name.ends_with("__");
    plain || (first.len() >= 4 && first.starts_with("__") && first.ends_with("__"))
}

/// webdataset's `base_plus_ext`: `^((?:.*/|)[^.]+)[.]([^/]*)$`, matched in the same
/// (backtracking) order: `(key, field)`, or `None` when the name has no such split.
pub(crate) fn split_name(name: &str) -> Option<(&str, &str)> {
    let slashes = name.rmatch_indices('/').map(|(i, _)| i + 1);
    for start in slashes.chain(std::iter::once(0)) {
        let Some(run) = name[start..].find('.') else {
            continue;
        };
        let dot = start + run;
        if run > 0 && !name[dot + 1..].contains('/') {
            return Some((&name[..dot], &name[dot + 1..]));
        }
    }
    None
}

/// The fields of the first sample, by name, each with its row in every sample;
/// an error names the first sample whose fields differ.
fn columns(src: &Source, samples: &[Sample]) -> Result<Vec<(String, Vec<Row>)>, IndexError> {
    let first = &samples[0];
    let mut cols: Vec<(String, Vec<Row>)> = first
        .members
        .iter()
        .map(|(f, _)| (f.clone(), Vec::with_capacity(samples.len())))
        .collect();
    let names = || cols_names(&first.members);
    for s in samples {
        if let Some((f, _)) = s.members.iter().find(|(f, _)| !has(&first.members, f)) {
            let reason = format!(
                "has field `{f}`, which sample `{}` lacks; every sample of a shard must \
                 have the same fields",
                first.key
            );
            return Err(sample_err(src, &s.key, &reason, names()));
        }
        for (field, rows) in &mut cols {
            let Some((_, row)) = s.members.iter().find(|(f, _)| f == field) else {
                let reason = format!(
                    "lacks field `{field}`, which sample `{}` has; every sample of a shard \
                     must have the same fields",
                    first.key
                );
                return Err(sample_err(src, &s.key, &reason, cols_names(&s.members)));
            };
            rows.push(*row);
        }
    }
    // webdataset samples are dicts: order the tensors by name, as `TarWriter` writes them,
    // so that every shard lists them alike.
    cols.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(cols)
}

fn has(members: &[(String, Row)], field: &str) -> bool {
    members.iter().any(|(f, _)| f == field)
}

/// `fields: a, b, c`.
fn cols_names(members: &[(String, Row)]) -> String {
    let names: Vec<&str> = members.iter().map(|(f, _)| f.as_str()).collect();
    format!("fields: {}", names.join(", "))
}

fn sample_err(src: &Source, key: &str, reason: &str, value: impl ToString) -> IndexError {
    IndexError::Sample {
        file: src.path.clone(),
        key: key.to_owned(),
        reason: reason.to_owned(),
        value: value.to_string(),
    }
}

/// A typed `[rows, ...]` tensor over the members' `.npy` data sections, when every member
/// is a well-formed `.npy` of one dtype and shape; `None` otherwise.
fn npy_tensor(
    src: &mut Source,
    field: &str,
    rows: &[Row],
) -> Result<Option<TensorEntry>, IndexError> {
    let mut table = Vec::with_capacity(rows.len());
    let mut first: Option<(DType, Vec<u64>)> = None;
    for &[pos, size] in rows {
        let h = match npy::read_header_at(src, pos, size) {
            Ok(h) => h,
            // Content that is not a usable `.npy`: the field stays raw bytes. Anything else
            // (a local read or a GET failing) is an error, never a silent change of dtype.
            Err(IndexError::Malformed { .. } | IndexError::Unsupported { .. }) => {
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        let elems = shape_elements(&h.shape);
        let need = elems.and_then(|e| e.checked_mul(h.dtype.size()));
        if need != Some(pos + size - h.data_offset) {
            return Ok(None);
        }
        match &first {
            Some((d, s)) if (*d, s) != (h.dtype, &h.shape) => return Ok(None),
            Some(_) => {}
            None => first = Some((h.dtype, h.shape.clone())),
        }
        table.push([h.data_offset, pos + size - h.data_offset]);
    }
    let Some((dtype, dims)) = first else {
        return Ok(None);
    };
    let mut shape = vec![rows.len() as u64];
    shape.extend(dims);
    Ok(Some(TensorEntry {
        name: field.to_owned(),
        dtype,
        shape,
        offset: table[0][0],
        length: table.iter().map(|r| r[1]).sum(),
        rows: Some(table),
        ragged: false,
    }))
}

/// A ragged `uint8` tensor of the members' raw bytes.
fn ragged(field: String, rows: Vec<Row>) -> TensorEntry {
    let length: u64 = rows.iter().map(|r| r[1]).sum();
    TensorEntry {
        name: field,
        dtype: DType::Uint8,
        shape: vec![length],
        offset: rows.first().map_or(0, |r| r[0]),
        length,
        rows: Some(rows),
        ragged: true,
    }
}

#[cfg(test)]
mod tests;
