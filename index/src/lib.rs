//! `shardwire index DIR|URL`: builds the dataset manifest ([`Manifest`]) of a directory (or an
//! object-store prefix: `s3://`, `gs://`, `az://`, `file://`, `http(s)://`, see [`Dataset`]) of
//! Arrow IPC (`.arrow`, `.arrows`, `.ipc`, `.feather`; HF `datasets` too), `.npy`, `.bin` and
//! WebDataset `.tar` files, MosaicML Streaming MDS datasets (`index.json` + `.mds`), Megatron-LM
//! indexed datasets (`NAME.bin` + `NAME.idx`), and Parquet
//! (`.parquet`, converted once to Arrow IPC in a hidden cache: [`ParquetNote`]).
//!
//! Each shard is one contiguous byte range of one file (a record batch body, a `.npy` data
//! section, a whole `.tar` or MDS `.mds` file, a whole raw `.bin`, a run of whole sequences
//! of a Megatron `.bin` of at most 64 MiB (or one longer sequence alone), or a run of whole
//! documents of a `--tokens` `.bin` of at most 64 MiB, a longer document being cut into rows
//! of 64 MiB) with its CRC-32C; its tensors are byte ranges inside it, with absolute file
//! offsets. Files are visited in sorted relative-path order, so the same directory always
//! yields the same manifest and digest.
//!
//! Every row of a row table is an `[offset, length]` pair in the manifest, which travels to
//! nodes in one frame: a lower bound of its size is counted as each file is planned
//! (`budget.rs`), so a dataset of too many rows is refused before its data is read, and
//! before a file's row tables are all built. A shard over the manifest's per-shard limits is
//! refused before its file is read too (`limits.rs`).
//!
//! A dataset in object storage is read with ranged GETs only: listing replaces the directory
//! walk (same rules), structure reads (headers, footers, index files) cost a few requests,
//! and each object's shards are checksummed in one pass of planned GETs. Its manifest also
//! lists each object's size and ETag (the shards' objects, and each Parquet object
//! converted), and is written beside the data (or where `--manifest-out` says).
//!
//! Nothing is left out silently: [`index_report`] also lists the files not used (with the
//! reason), the Arrow columns skipped under [`IndexOptions::skip_unsupported`] and the tar
//! members skipped (links, names without a key/field split: [`SkippedMembers`]); hidden
//! files, the empty directory markers of an object store (`dir/`) and the manifest itself
//! are the only files skipped without a word. A `.bin` without its `.idx` beside Megatron
//! pairs is refused rather than served as raw bytes (`megatron::refuse_unpaired`). Options
//! that act on some formats only are named where they leave files as they are, and
//! `--columns` or `--tokens` on a dataset with no file they act on is refused
//! (`options.rs`). Data files named for two or more splits (`train.bin` beside `val.bin`,
//! `train/` beside `test/`) are refused rather than merged into one dataset (`split.rs`).

#![forbid(unsafe_code)]

mod arrow;
mod bin;
mod blob;
mod budget;
mod error;
mod hf;
mod limits;
mod mds;
mod megatron;
mod npy;
mod options;
mod parquet;
mod pylit;
mod remote;
mod root;
mod source;
mod split;
#[cfg(test)]
mod testutil;
mod tokens;
mod unused;
mod walk;
mod webdataset;

use std::collections::HashSet;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

use shardwire_protocol::manifest::{MANIFEST_FILE, Manifest, ObjectEntry, ShardEntry};
pub use shardwire_store::{Described, StoreOptions, StoreUrl};

use crate::budget::{Budget, FileCheck, RowKind};
pub use crate::error::{BatchAt, IndexError};
pub use crate::parquet::ParquetNote;
use crate::remote::Remote;
use crate::root::Root;
pub use crate::tokens::RawTokens;
pub use crate::unused::Unused;
use crate::walk::{Candidate, Kind};
pub use crate::webdataset::SkippedMembers;

/// Options for [`index_dir`].
#[derive(Clone, Debug, Default)]
pub struct IndexOptions {
    /// Show the `indexed 120/4000 files, 3.2 GiB` progress line on stderr. Even when true,
    /// the line is drawn only if stderr is a terminal, so redirected output stays clean.
    pub progress: bool,
    /// Serve only these Arrow columns (`--columns a,b`), in schema order; a name that an
    /// Arrow file lacks is an error naming the file's columns. Files of other formats are
    /// not affected (a note names them); a dataset with no Arrow or Parquet file is refused.
    pub columns: Option<Vec<String>>,
    /// Skip Arrow columns that cannot be served (`--skip-unsupported`) instead of failing;
    /// each is listed in [`IndexReport::skipped`].
    pub skip_unsupported: bool,
    /// Read `.bin` files (not Megatron pairs) as raw token streams (`--tokens`, `--eos`); a
    /// dataset with no such file is refused.
    pub tokens: Option<RawTokens>,
    /// Index files named for different splits (`train.bin` beside `val.bin`) as one dataset
    /// (`--allow-mixed-splits`), where the names mislead; refused by default.
    pub allow_mixed_splits: bool,
}

/// A dataset to index: a local directory, or a prefix in object storage.
pub struct Dataset {
    root: Root,
}

impl Dataset {
    /// A listed object-store prefix (tests: a store over `InMemory`).
    #[cfg(test)]
    pub(crate) fn remote(remote: Remote) -> Dataset {
        Dataset {
            root: Root::Remote(remote),
        }
    }

    /// A local directory.
    pub fn local(dir: &Path) -> Dataset {
        Dataset {
            root: Root::Local(dir.to_path_buf()),
        }
    }

    /// `location`: a URL with a scheme shardwire serves (`s3://bucket/prefix`, `gs://`,
    /// `az://`, `file:///dir`, `http(s)://`) is opened with credentials and endpoint from the
    /// environment and its prefix listed; another `scheme://` is an error naming the schemes
    /// served; anything else is a local directory.
    pub fn open(location: &str, store: StoreOptions) -> Result<Dataset, IndexError> {
        // `s4://x` is a mistyped URL, not a directory: parsing it names the schemes served.
        if !StoreUrl::is_remote(location) && !location.contains("://") {
            return Ok(Self::local(Path::new(location)));
        }
        let url = StoreUrl::parse(location)?;
        Ok(Dataset {
            root: Root::Remote(Remote::open(&url, store)?),
        })
    }

    /// The directory or URL.
    pub fn location(&self) -> PathBuf {
        self.root.path()
    }

    /// For a dataset in object storage: backend, credential source, endpoint, region.
    pub fn described(&self) -> Option<&Described> {
        match &self.root {
            Root::Local(_) => None,
            Root::Remote(r) => Some(r.described()),
        }
    }

    /// Refuses, before anything is read, what [`Dataset::write_manifest`] would refuse at
    /// the end: writing beside the data of a read-only (http(s)) `location` without `out`.
    pub fn check_output(location: &str, out: Option<&Path>) -> Result<(), IndexError> {
        if out.is_some() || !StoreUrl::is_remote(location) {
            return Ok(());
        }
        let url = StoreUrl::parse(location)?;
        if url.scheme().writable() {
            return Ok(());
        }
        Err(IndexError::ReadOnly {
            url: url.to_string(),
            what: "the manifest is written beside the data".into(),
            fix: "give --manifest-out PATH to write it locally".into(),
        })
    }

    /// Indexes every data file: the manifest, the files not used and the columns skipped.
    pub fn index(&mut self, opts: &IndexOptions) -> Result<IndexReport, IndexError> {
        index_root(&mut self.root, opts)
    }

    /// Writes `m` to `out` when given (a local file, atomically), else beside the data
    /// (`DIR/shardwire.manifest.json`, or one PUT of `PREFIX/shardwire.manifest.json`);
    /// returns where it went.
    pub fn write_manifest(&self, m: &Manifest, out: Option<&Path>) -> Result<String, IndexError> {
        Self::check_output(&self.location().to_string_lossy(), out)?;
        if let Some(out) = out {
            write_file(out, &manifest_json(m, &self.location())?)?;
            return Ok(out.display().to_string());
        }
        match &self.root {
            Root::Local(dir) => Ok(write_manifest(dir, m)?.display().to_string()),
            Root::Remote(r) => {
                let json = manifest_json(m, &self.location())?;
                r.store().put(MANIFEST_FILE, bytes::Bytes::from(json))?;
                Ok(r.display(MANIFEST_FILE).display().to_string())
            }
        }
    }
}

/// An Arrow column left out under [`IndexOptions::skip_unsupported`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SkippedColumn {
    /// Column name.
    pub column: String,
    /// Its type, spelt as pyarrow does (`list<item: struct<a: int64>>`).
    pub dtype: String,
    /// Why it cannot be served.
    pub reason: String,
    /// The files where it was skipped.
    pub files: Vec<String>,
}

/// What [`index_report`] found: the manifest, and what was left out.
#[derive(Clone, Debug)]
pub struct IndexReport {
    /// The validated manifest.
    pub manifest: Manifest,
    /// Files not used, sorted by path.
    pub unused: Vec<Unused>,
    /// Columns skipped, one entry per (column, type).
    pub skipped: Vec<SkippedColumn>,
    /// Parquet files, each converted to (or reused from) its cached Arrow IPC file.
    pub parquet: Vec<ParquetNote>,
    /// Options that acted on some of the files only, or on none (`--skip-unsupported`
    /// without an Arrow file), one line each.
    pub options: Vec<String>,
    /// Tar members not read (links, names without a key/field split), one entry per tar.
    pub members: Vec<SkippedMembers>,
}

/// How many names a note lists before `and N more`.
const NOTE_NAMES: usize = 5;

impl IndexReport {
    /// One line each for the files not used, the columns skipped and the options that acted
    /// on some files only (none when nothing was left out), e.g. `not used: 2 files:
    /// notes.txt (unknown extension .txt), ...`.
    pub fn notes(&self) -> Vec<String> {
        let mut out = parquet_notes(&self.parquet);
        out.extend(self.options.iter().cloned());
        if !self.unused.is_empty() {
            let names = self
                .unused
                .iter()
                .map(|u| format!("{} ({})", u.file, u.reason));
            out.push(note("not used", self.unused.len(), "file", names));
        }
        if !self.skipped.is_empty() {
            let names = self.skipped.iter().map(|c| {
                let n = c.files.len();
                let files = if n == 1 { "file" } else { "files" };
                format!("{} ({}, {n} {files})", c.column, c.dtype)
            });
            let what = "skipped unsupported";
            out.push(note(what, self.skipped.len(), "column", names));
        }
        if !self.members.is_empty() {
            let names = self.members.iter().map(|m| m.to_string());
            let what = "tar members skipped";
            out.push(note(what, self.members.len(), "tar", names));
        }
        out
    }
}

/// One line per Parquet file (`parquet: a.parquet -> .shardwire-cache/... (converted, 3
/// row groups)`), the first [`NOTE_NAMES`] of them, then one line for the rest.
fn parquet_notes(list: &[ParquetNote]) -> Vec<String> {
    let mut out: Vec<String> = list
        .iter()
        .take(NOTE_NAMES)
        .map(|p| p.to_string())
        .collect();
    if list.len() > NOTE_NAMES {
        let rest = &list[NOTE_NAMES..];
        let reused = rest.iter().filter(|p| p.reused).count();
        let converted = rest.len() - reused;
        out.push(format!(
            "parquet: and {} more files ({converted} converted, {reused} reused) in {}/",
            rest.len(),
            parquet::CACHE_DIR
        ));
    }
    out
}

/// `label: N things: a, b, c, d, e, and 3 more`.
fn note(label: &str, n: usize, thing: &str, names: impl Iterator<Item = String>) -> String {
    let plural = if n == 1 { "" } else { "s" };
    let mut list: Vec<String> = names.take(NOTE_NAMES).collect();
    if n > NOTE_NAMES {
        list.push(format!("and {} more", n - NOTE_NAMES));
    }
    format!("{label}: {n} {thing}{plural}: {}", list.join(", "))
}

/// Indexes every data file under `dir` into a validated manifest.
pub fn index_dir(dir: &Path, opts: &IndexOptions) -> Result<Manifest, IndexError> {
    index_report(dir, opts).map(|r| r.manifest)
}

/// Indexes every data file under `dir`: the manifest, the files not used and the columns
/// skipped.
pub fn index_report(dir: &Path, opts: &IndexOptions) -> Result<IndexReport, IndexError> {
    Dataset::local(dir).index(opts)
}

/// Indexes every data file of `root`.
fn index_root(root: &mut Root, opts: &IndexOptions) -> Result<IndexReport, IndexError> {
    index_root_within(root, opts, budget::LIMIT)
}

/// Indexes every data file of `root`, refusing a manifest that would be over `limit` bytes
/// before the file that takes it over is read.
fn index_root_within(
    root: &mut Root,
    opts: &IndexOptions,
    limit: u64,
) -> Result<IndexReport, IndexError> {
    let (mut files, mut unused) = root.collect()?;
    hf::plan(root, &mut files, &mut unused)?;
    let mds = mds::plan(root, &mut files, &mut unused)?;
    let megatron = megatron::plan(&mut files, &mut unused);
    if !opts.allow_mixed_splits {
        split::refuse_mixed(&root.path(), &files)?;
    }
    megatron::refuse_unpaired(&root.path(), &files, &megatron, opts.tokens.is_some())?;
    let options = options::check(&root.path(), &files, &megatron, opts)?;
    let mut progress = Progress::new(
        opts.progress && std::io::stderr().is_terminal(),
        files.len(),
    );
    let plans = Plans {
        mds: &mds,
        megatron: &megatron,
    };
    let mut budget = Budget::new(limit);
    let found = index_files(root, &files, plans, opts, &mut progress, &mut budget);
    progress.finish();
    let Found {
        mut shards,
        skipped,
        nested,
        empty,
        parquet,
        wds,
        members,
    } = found?;
    arrow::harmonize(&mut shards, &nested);
    webdataset::harmonize(&mut shards, wds);
    unused.extend(empty.into_iter().map(|file| Unused {
        file,
        reason: "holds no rows".into(),
    }));
    unused.sort_by(|a, b| a.file.cmp(&b.file));
    let objects = root.objects_for(&shards, &parquet);
    let manifest = checked_manifest(&root.path(), shards, objects, files.len(), &unused)?;
    Ok(IndexReport {
        manifest,
        unused,
        skipped,
        parquet,
        options,
        members,
    })
}

/// What the data files yield together.
#[derive(Default)]
struct Found {
    shards: Vec<ShardEntry>,
    skipped: Vec<SkippedColumn>,
    nested: HashSet<String>,
    /// Files with no rows.
    empty: Vec<String>,
    /// Parquet files converted or reused.
    parquet: Vec<ParquetNote>,
    /// Raw member rows of the typed WebDataset tensors.
    wds: Vec<webdataset::RawRows>,
    /// Tar members not read, per tar.
    members: Vec<SkippedMembers>,
}

/// What the files read before the others (indexes) say about them.
#[derive(Clone, Copy)]
struct Plans<'a> {
    mds: &'a mds::Plan,
    megatron: &'a megatron::Plan,
}

/// Indexes `files` in order; each file's shards are counted in `budget` before its data is
/// read (checksummed), and their rows as the format reader plans them (`budget::FileCheck`);
/// the documents of a `--eos` token file, found by reading it, are checked as it is read
/// (`tokens::index`).
fn index_files(
    root: &mut Root,
    files: &[Candidate],
    plans: Plans<'_>,
    opts: &IndexOptions,
    progress: &mut Progress,
    budget: &mut Budget,
) -> Result<Found, IndexError> {
    let dir = root.path();
    let mut out = Found::default();
    for f in files {
        let mut src = match f.kind {
            Kind::Parquet => {
                let (src, note) = root.parquet(&f.rel)?;
                out.parquet.push(note);
                src
            }
            _ => root.open(&f.rel)?,
        };
        let kind = row_kind(f, plans, opts);
        let mut check = FileCheck::new(budget, &dir, kind);
        let read = (&*root, &mut src, &mut check);
        let Some(mut shards) = file_shards(read, f, plans, opts, &mut out)? else {
            continue;
        };
        if shards.is_empty() {
            out.empty.push(f.rel.clone());
        }
        check_names(&src, &shards)?;
        limits::check(&src, &shards, made(f, plans, opts))?;
        budget.add(&shards, kind, &dir, &f.rel)?;
        src.checksum(&mut shards)?;
        out.shards.extend(shards);
        progress.file_done(f.size);
    }
    Ok(out)
}

/// The shards of the data file `f`, read from `src` (of `root`), its rows counted in `check`;
/// `None` for the index files read before the others. What else it yields (Arrow columns
/// skipped, WebDataset raw rows) goes to `out`.
fn file_shards(
    (root, src, check): (&Root, &mut source::Source, &mut FileCheck<'_>),
    f: &Candidate,
    plans: Plans<'_>,
    opts: &IndexOptions,
    out: &mut Found,
) -> Result<Option<Vec<ShardEntry>>, IndexError> {
    let choice = arrow::Choice {
        columns: opts.columns.as_deref(),
        skip_unsupported: opts.skip_unsupported,
    };
    let shards = match f.kind {
        Kind::Arrow | Kind::Parquet => {
            let a = arrow::index(src, choice, check).map_err(|e| match f.kind {
                Kind::Parquet => root.in_row_group(&f.rel, e),
                _ => e,
            })?;
            for (column, dtype, reason) in a.skipped {
                add_skipped(&mut out.skipped, column, dtype, reason, &f.rel);
            }
            out.nested.extend(a.nested);
            a.shards
        }
        Kind::Npy => npy::index(src)?,
        Kind::Bin => match plans.megatron.get(&f.rel) {
            Some(idx) => megatron::index(root, src, idx, check)?,
            None => match opts.tokens {
                Some(t) => tokens::index(src, t, check.budget(), check.dir())?,
                None => bin::index(src)?,
            },
        },
        Kind::Tar => {
            let tar = webdataset::index(src)?;
            let base = out.shards.len();
            out.wds
                .extend(tar.raw.into_iter().map(|r| r.in_shard(base)));
            out.members.extend(tar.skipped);
            tar.shards
        }
        Kind::CompressedTar => return Err(webdataset::refuse_compressed(src)),
        Kind::Mds => mds::index(src, plans.mds.get(&f.rel), check)?,
        // Taken out of `files` by `mds::plan` and `megatron::plan`.
        Kind::MdsIndex | Kind::MegatronIdx => return Ok(None),
    };
    Ok(Some(shards))
}

/// How the shards of the file `f` are made, for the advice when one is over a limit.
fn made(f: &Candidate, plans: Plans<'_>, opts: &IndexOptions) -> limits::Made {
    let megatron = plans.megatron.contains_key(&f.rel);
    if f.kind == Kind::Bin && !megatron && opts.tokens.is_none() {
        limits::Made::RawBin
    } else {
        limits::Made::Of(f.kind)
    }
}

/// Refuses names that clash (fields or columns, with the `.offsets` a ragged one brings):
/// the file's to fix, said here rather than as an invalid manifest.
fn check_names(src: &source::Source, shards: &[ShardEntry]) -> Result<(), IndexError> {
    for s in shards {
        shardwire_protocol::manifest::check_names(&s.tensors).map_err(|reason| {
            let names: Vec<&str> = s.tensors.iter().map(|t| t.name.as_str()).collect();
            src.unsupported_data(reason, names.join(", "))
        })?;
    }
    Ok(())
}

/// What the rows of the file `f` are, for the advice when there are too many.
fn row_kind(f: &Candidate, plans: Plans<'_>, opts: &IndexOptions) -> RowKind {
    match f.kind {
        Kind::Bin if plans.megatron.contains_key(&f.rel) => RowKind::Megatron,
        Kind::Bin if opts.tokens.is_some() => RowKind::Tokens,
        _ => RowKind::Samples,
    }
}

/// Records a skipped column, merging files that skip the same (column, type).
fn add_skipped(
    list: &mut Vec<SkippedColumn>,
    column: String,
    dtype: String,
    reason: String,
    file: &str,
) {
    match list
        .iter_mut()
        .find(|c| c.column == column && c.dtype == dtype)
    {
        Some(c) => c.files.push(file.to_string()),
        None => list.push(SkippedColumn {
            column,
            dtype,
            reason,
            files: vec![file.to_string()],
        }),
    }
}

/// The first [`error::UNUSED_SHOWN`] of `unused` to name in an error: files of a data
/// format first (their reasons say what to fix, e.g. a `.mds` without its `index.json`),
/// then the others (unknown extensions, metadata, Megatron's index caches), which can be
/// many.
fn shown_first(unused: &[Unused]) -> Vec<Unused> {
    let data = |u: &&Unused| {
        let name = u.file.rsplit('/').next().unwrap_or(&u.file);
        Kind::of(name).is_some() && u.reason != walk::MEGATRON_CACHE
    };
    let (mut shown, rest): (Vec<&Unused>, Vec<&Unused>) = unused.iter().partition(data);
    shown.extend(rest);
    shown
        .into_iter()
        .take(error::UNUSED_SHOWN)
        .cloned()
        .collect()
}

/// The validated manifest of `shards` and the `objects` they read (none for a directory;
/// `found`: how many data files were read; `unused`: the files not used, named when there
/// are no shards, as their reasons say what to fix).
fn checked_manifest(
    dir: &Path,
    shards: Vec<ShardEntry>,
    objects: Vec<ObjectEntry>,
    found: usize,
    unused: &[Unused],
) -> Result<Manifest, IndexError> {
    if shards.is_empty() {
        return Err(IndexError::NoUsableFiles {
            dir: dir.to_path_buf(),
            found,
            unused: shown_first(unused),
            unused_total: unused.len(),
        });
    }
    let manifest = Manifest::with_objects(shards, objects);
    manifest.validate().map_err(|source| IndexError::Manifest {
        dir: dir.to_path_buf(),
        source,
    })?;
    Ok(manifest)
}

/// Writes `m` to `dir/shardwire.manifest.json` atomically (temporary file, fsync, rename)
/// and returns the path.
pub fn write_manifest(dir: &Path, m: &Manifest) -> Result<PathBuf, IndexError> {
    let path = dir.join(MANIFEST_FILE);
    write_file(&path, &manifest_json(m, dir)?)?;
    Ok(path)
}

/// The manifest file's bytes, refused when no source could send them to a node
/// ([`Manifest::check_size`]): better at indexing than when the source starts. The error
/// names the rows, most often the cause.
fn manifest_json(m: &Manifest, dir: &Path) -> Result<Vec<u8>, IndexError> {
    let json = m.to_json();
    let len = json.len() as u64;
    Manifest::check_size(len).map_err(|_| budget::too_large(dir, &m.shards, len))?;
    Ok(json)
}

/// Writes `bytes` to `path` atomically: a temporary file beside it, fsync, rename, and a
/// best-effort fsync of the directory.
fn write_file(path: &Path, bytes: &[u8]) -> Result<(), IndexError> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        name.unwrap_or_default(),
        std::process::id()
    ));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_file(&tmp);
        return Err(IndexError::io(&tmp, e));
    }
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(IndexError::io(path, e));
    }
    // Persist the rename; not every filesystem lets a directory be fsynced, so this is
    // best effort.
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// The `indexed 120/4000 files, 3.2 GiB` line on stderr.
struct Progress {
    on: bool,
    total: usize,
    done: usize,
    bytes: u64,
}

impl Progress {
    fn new(on: bool, total: usize) -> Self {
        Self {
            on,
            total,
            done: 0,
            bytes: 0,
        }
    }

    fn file_done(&mut self, size: u64) {
        self.done += 1;
        self.bytes += size;
        if self.on {
            let mut e = std::io::stderr().lock();
            let _ = write!(
                e,
                "\rindexed {}/{} files, {}",
                self.done,
                self.total,
                human_bytes(self.bytes)
            );
            let _ = e.flush();
        }
    }

    fn finish(&self) {
        if self.on && self.done > 0 {
            eprintln!();
        }
    }
}

/// `1536` -> `1.5 KiB`.
fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::temp_dir;

    #[test]
    fn human_sizes() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(3 << 30), "3.0 GiB");
    }

    #[test]
    fn empty_or_missing_dir_is_an_error_naming_it() {
        let dir = temp_dir("lib-empty");
        std::fs::write(dir.join("readme.txt"), b"hi").unwrap();
        let err = index_dir(&dir, &IndexOptions::default()).unwrap_err();
        assert!(
            matches!(err, IndexError::NoUsableFiles { found: 0, .. }),
            "{err}"
        );
        assert!(err.to_string().contains(dir.to_str().unwrap()), "{err}");
        let missing = dir.join("nope");
        let err = index_dir(&missing, &IndexOptions::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("nope") && err.contains("not a directory"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_failed_index_names_the_files_not_used_and_why() {
        // Before, a lone MDS shard gave "no data files found (extensions ... .mds)", and
        // the reason it was not used was dropped.
        let dir = temp_dir("lib-unused");
        std::fs::write(dir.join("shard.00000.mds"), b"x").unwrap();
        let e = index_dir(&dir, &IndexOptions::default()).unwrap_err();
        assert!(
            matches!(&e, IndexError::NoUsableFiles { found: 0, unused, unused_total: 1, .. }
                if unused.len() == 1),
            "{e:?}"
        );
        let text = e.to_string();
        for want in ["shard.00000.mds", "no index.json", "could be used"] {
            assert!(text.contains(want), "{want}: {text}");
        }
        assert!(!text.contains("no data files found"), "{text}");
        // Files with no rows are named too, before files of unknown extensions (sorted by
        // name alone, z-empty.bin fell past the 20 shown), and a long list is cut with a
        // count.
        std::fs::remove_file(dir.join("shard.00000.mds")).unwrap();
        std::fs::write(dir.join("z-empty.bin"), b"").unwrap();
        for i in 0..30 {
            std::fs::write(dir.join(format!("n{i:02}.txt")), b"x").unwrap();
        }
        let text = index_dir(&dir, &IndexOptions::default())
            .unwrap_err()
            .to_string();
        for want in [
            "found 1 data files but none holds any rows",
            "z-empty.bin (holds no rows)",
            "31 files",
            "and 11 more",
        ] {
            assert!(text.contains(want), "{want}: {text}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn too_many_rows_are_refused_while_planning_naming_rows_and_fix() {
        // Before, only the written manifest's size was checked, after every file was read
        // and checksummed, with the advice "use larger shards".
        let dir = temp_dir("lib-rows");
        // 3000 one-token documents: each token is the end-of-document id 0.
        std::fs::write(dir.join("t.bin"), vec![0u8; 6000]).unwrap();
        let eos = RawTokens::new(shardwire_protocol::DType::Uint16, Some(0)).unwrap();
        let opts = IndexOptions {
            tokens: Some(eos),
            ..IndexOptions::default()
        };
        let mut root = Root::Local(dir.clone());
        let e = index_root_within(&mut root, &opts, 20_000).unwrap_err();
        assert!(
            matches!(
                e,
                IndexError::ManifestTooLarge {
                    rows: 3000,
                    limit: 20_000,
                    ..
                }
            ),
            "{e:?}"
        );
        let text = e.to_string();
        for want in [
            "t.bin",
            "3000 rows",
            "20000 bytes",
            "while reading its --eos documents",
            "--eos",
        ] {
            assert!(text.contains(want), "{want}: {text}");
        }
        // Under the real limit it is indexed; the manifest is larger than the 20000 bytes.
        let m = index_dir(&dir, &opts).unwrap();
        assert!(m.to_json().len() > 20_000);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn write_manifest_round_trips_and_is_skipped_on_reindex() {
        let dir = temp_dir("lib-write");
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(dir.join("b.bin"), [1u8, 2, 3]).unwrap();
        std::fs::write(dir.join("sub/a.bin"), [4u8; 10]).unwrap();
        let m = index_dir(&dir, &IndexOptions::default()).unwrap();
        let files: Vec<&str> = m.shards.iter().map(|s| s.file.as_str()).collect();
        assert_eq!(files, ["b.bin", "sub/a.bin"]);
        assert_eq!(m.total_bytes, 13);
        let path = write_manifest(&dir, &m).unwrap();
        assert_eq!(path, dir.join(MANIFEST_FILE));
        let back = Manifest::from_json(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(back, m);
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 3, "no temporary file left behind: {names:?}");
        // Re-indexing ignores the manifest and gives the same digest.
        assert_eq!(
            index_dir(&dir, &IndexOptions::default()).unwrap().digest,
            m.digest
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
