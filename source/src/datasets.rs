//! The datasets a source serves: name -> manifest and where the shards are: a directory
//! with open files, or objects in object storage ([`crate::remote`]).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use shardwire_protocol::crc::Crc32c;
use shardwire_protocol::manifest::{MANIFEST_FILE, Manifest, ManifestError};
use shardwire_protocol::wire::{DatasetNameError, check_dataset_name};
use shardwire_store::StoreUrl;

use crate::remote::{self, RemoteDataset, RemoteOptions};

/// Why a dataset cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    /// `--dataset` value is not NAME=DIR or NAME=URL; the value as given, any URL's
    /// credentials, query and fragment redacted ([`shardwire_store::redacted`]).
    #[error(
        "dataset spec `{0}` is not NAME=DIR or NAME=URL (s3://, gs://, az://, file://, http(s)://)"
    )]
    Spec(String),
    /// An object-storage dataset cannot be served.
    #[error(transparent)]
    Remote(#[from] remote::OpenError),
    /// The dataset URL is not valid.
    #[error("`datasets` entry (or --dataset) {name}=...: {source}")]
    Url {
        /// The dataset.
        name: String,
        /// Why.
        #[source]
        source: shardwire_store::StoreError,
    },
    /// Bad dataset name.
    #[error("a dataset name in `datasets` (or --dataset NAME=DIR): {0}")]
    Name(#[from] DatasetNameError),
    /// Same name twice.
    #[error("dataset `{0}` is given twice")]
    Duplicate(String),
    /// Manifest missing or unreadable.
    #[error("cannot read {path}: {source} (run `shardwire index {dir}` first)")]
    Read {
        /// Manifest path.
        path: PathBuf,
        /// Dataset directory.
        dir: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// Manifest invalid.
    #[error("{path}: {source}")]
    Manifest {
        /// Manifest path.
        path: PathBuf,
        /// The error.
        #[source]
        source: ManifestError,
    },
    /// A shard's file is missing or shorter than the manifest says.
    #[error("dataset `{dataset}`: shard file {path}: {reason}")]
    ShardFile {
        /// Dataset.
        dataset: String,
        /// File.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// Where a dataset's shards are.
pub enum Backend {
    /// A directory: an open file per shard (shards of one file share it).
    Local {
        /// The directory.
        dir: PathBuf,
        /// Open file per shard.
        files: Vec<Arc<File>>,
        /// What each shard's file was when it was opened (shards of one file share it).
        opened: Vec<Arc<Opened>>,
    },
    /// Objects in object storage.
    Remote(Arc<RemoteDataset>),
}

/// A local shard file as the source opened it: a file rewritten in place or cut short later
/// is refused ([`Opened::check`]), not sent (a file replaced by a rename keeps serving the
/// bytes it had, through the open file); so is a shard whose bytes a recheck found bad
/// ([`Opened::recheck`]).
#[derive(Debug)]
pub struct Opened {
    /// Its path in the dataset's directory.
    pub name: String,
    len: u64,
    modified: Option<std::time::SystemTime>,
    /// Shards of this file (by their byte range) that a node reported corrupt: a recheck of
    /// their bytes under way, or what one found.
    rechecks: Mutex<HashMap<(u64, u64), Recheck>>,
}

/// A recheck of one shard's bytes against the manifest's CRC-32C ([`Opened::recheck`]). One
/// that passes is forgotten.
#[derive(Debug, Clone)]
enum Recheck {
    /// Under way.
    Running,
    /// The bytes fail the CRC.
    Failed {
        /// The manifest's CRC-32C.
        want: u32,
        /// The CRC of the bytes in the file.
        found: u32,
    },
}

/// Why a local shard file no longer holds what the source opened ([`Opened::check`]). Each
/// names the file; the caller adds the fix (re-index the dataset, restart the source).
#[derive(Debug, thiserror::Error)]
pub enum ShardChanged {
    /// The open file could not be examined.
    #[error("shard file {name}: cannot stat it: {source}")]
    Stat {
        /// The file.
        name: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Cut short.
    #[error(
        "shard file {name} changed since the source opened it: {len} bytes, {need} needed (it had {had})"
    )]
    Shorter {
        /// The file.
        name: String,
        /// Its length now.
        len: u64,
        /// The bytes the payload needs.
        need: u64,
        /// Its length when opened.
        had: u64,
    },
    /// Its modification time moved.
    #[error("shard file {name} changed since the source opened it (modified again)")]
    Modified {
        /// The file.
        name: String,
    },
    /// A shard's bytes fail the manifest's CRC-32C, with the file's size and modification
    /// time unchanged (found by a recheck after a node reported a corrupt payload).
    #[error(
        "shard file {name}: bytes {start}..{end} fail the manifest's CRC-32C (want {want:#010x}, \
         found {found:#010x}) though the file's size and modification time did not change: it \
         was rewritten in place or went bad on disk: restore it from a good copy or, if it was \
         rewritten on purpose, re-run `shardwire index` and restart the source"
    )]
    Corrupt {
        /// The file.
        name: String,
        /// Where the shard starts in it.
        start: u64,
        /// Where it ends.
        end: u64,
        /// The manifest's CRC-32C.
        want: u32,
        /// The CRC of the bytes in the file.
        found: u32,
    },
}

impl Opened {
    fn new(name: &str, meta: &std::fs::Metadata) -> Self {
        Self {
            name: name.to_owned(),
            len: meta.len(),
            modified: meta.modified().ok(),
            rechecks: Mutex::default(),
        }
    }

    /// Whether `file` (this one, open) still holds what it held at open for the shard at
    /// bytes `shard`; the error says what changed. Its inode and device need no check:
    /// `fstat` of the open file always names the inode it opened. The inode change time is
    /// not compared either: `chmod`, a new hard link or an rsync of the directory move it on
    /// files that still hold their bytes. A rewrite of the same length with its modification
    /// time put back (or a disk that corrupts it) is caught by the node's CRC check (never
    /// delivered), and once a node reports it, by a recheck ([`Opened::recheck`]) that this
    /// check then refuses.
    pub fn check(&self, file: &File, shard: Range<u64>) -> Result<(), ShardChanged> {
        let need = shard.end;
        let name = || self.name.clone();
        let meta = file.metadata().map_err(|source| ShardChanged::Stat {
            name: name(),
            source,
        })?;
        if meta.len() < need {
            return Err(ShardChanged::Shorter {
                name: name(),
                len: meta.len(),
                need,
                had: self.len,
            });
        }
        if meta.modified().ok() != self.modified {
            return Err(ShardChanged::Modified { name: name() });
        }
        match self.rechecks().get(&(shard.start, shard.end)) {
            Some(Recheck::Failed { want, found }) => Err(ShardChanged::Corrupt {
                name: name(),
                start: shard.start,
                end: shard.end,
                want: *want,
                found: *found,
            }),
            _ => Ok(()),
        }
    }

    /// A node reported that a payload of the shard at bytes `shard` of `file` (this one,
    /// open) failed its CRC-32C check: its bytes are read again on a blocking thread and
    /// checked against `want`, the manifest's CRC, unless a recheck of them is under way or
    /// found them bad already (one that passed, or could not read them, is forgotten: a later
    /// report checks them again). Bytes that fail are refused by
    /// [`Opened::check`] from then on: before, a file rewritten in place with its size and
    /// modification time put back, or one gone bad on disk, was served again at every FETCH
    /// until the node gave up on the shard. Needs a tokio runtime.
    pub(crate) fn recheck(self: &Arc<Self>, file: &Arc<File>, shard: Range<u64>, want: u32) {
        let key = (shard.start, shard.end);
        {
            let mut r = self.rechecks();
            if r.contains_key(&key) {
                return;
            }
            r.insert(key, Recheck::Running);
        }
        let (this, file) = (Arc::clone(self), Arc::clone(file));
        tokio::task::spawn_blocking(move || {
            let got = range_crc(&file, shard.clone());
            this.rechecked(shard, want, got);
        });
    }

    /// Records what the recheck of bytes `shard` found: `got`, against `want`. Only bytes
    /// read whole and found to differ are refused from then on; a recheck that could not
    /// read them (EIO on a network file system that passes) is forgotten, like one that
    /// passed, so a later report checks them again: before, it refused them until a restart.
    fn rechecked(&self, shard: Range<u64>, want: u32, got: std::io::Result<u32>) {
        let key = (shard.start, shard.end);
        let found = match got {
            Ok(crc) if crc == want => {
                tracing::info!(file = %self.name, start = shard.start, end = shard.end,
                    "a node reported a corrupt payload of this shard, but its bytes in the file \
                     match the manifest's CRC-32C: they went bad on their way (network, NIC, the \
                     node's memory)");
                self.rechecks().remove(&key);
                return;
            }
            Ok(crc) => crc,
            Err(e) => {
                tracing::warn!(file = %self.name, start = shard.start, end = shard.end,
                    error = %e, "{}", unread_recheck(&e));
                self.rechecks().remove(&key);
                return;
            }
        };
        tracing::error!(file = %self.name, start = shard.start, end = shard.end,
            want = format_args!("{want:#010x}"), found = format_args!("{found:#010x}"),
            "a node reported a corrupt payload of this shard, and its bytes in the file fail the \
             manifest's CRC-32C though the file's size and modification time did not change \
             (rewritten in place, or bad on disk): its FETCHes are refused as ReadFailed (nodes \
             fetch it from other sources); restore the file (or re-run `shardwire index`) and \
             restart the source");
        self.rechecks().insert(key, Recheck::Failed { want, found });
    }

    fn rechecks(&self) -> std::sync::MutexGuard<'_, HashMap<(u64, u64), Recheck>> {
        self.rechecks.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// What a recheck that could not read a shard's bytes (`e`) means, for the log. A file cut
/// short since the shard was announced (`UnexpectedEof`) is refused as changed by
/// [`Opened::check`] (`Shorter`, `DatasetChanged`): before, the log said it was still served
/// and blamed the file system. Any other read error refuses nothing.
fn unread_recheck(e: &std::io::Error) -> &'static str {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        "a node reported a corrupt payload of this shard, and the file is now shorter than the \
         shard (cut since the source opened it): its FETCHes are refused as a changed dataset; \
         re-run `shardwire index` and restart the source"
    } else {
        "a node reported a corrupt payload of this shard, and its bytes in the file could not be \
         read again to check them: the shard is still served; the next report rechecks it \
         (check the file system if this repeats)"
    }
}

/// The CRC-32C of bytes `range` of `file`, read in pieces of at most 1 MiB.
fn range_crc(file: &File, range: Range<u64>) -> std::io::Result<u32> {
    use std::os::unix::fs::FileExt;
    let mut crc = Crc32c::new();
    let mut buf = vec![0u8; (range.end - range.start).min(1 << 20) as usize];
    let mut at = range.start;
    while at < range.end {
        let n = (range.end - at).min(buf.len() as u64) as usize;
        file.read_exact_at(&mut buf[..n], at)?;
        crc.update(&buf[..n]);
        at += n as u64;
    }
    Ok(crc.finish())
}

/// One served dataset.
pub struct Dataset {
    /// Name nodes ask for.
    pub name: String,
    /// Parsed manifest.
    pub manifest: Manifest,
    /// The manifest file's bytes (sent verbatim).
    pub manifest_json: Vec<u8>,
    /// Where its shards are.
    pub backend: Backend,
}

impl Dataset {
    /// A node reported that a payload of `shard` failed its CRC-32C check: for a local
    /// dataset, has the shard's bytes rechecked against the manifest's CRC
    /// ([`Opened::recheck`]). Nothing for an object-storage dataset (its cache entries have
    /// their own recheck) or a shard out of range. Needs a tokio runtime.
    pub(crate) fn recheck_local(&self, shard: u32) {
        let Backend::Local { files, opened, .. } = &self.backend else {
            return;
        };
        let i = shard as usize;
        let (Some(entry), Some(file), Some(opened)) =
            (self.manifest.shards.get(i), files.get(i), opened.get(i))
        else {
            return;
        };
        opened.recheck(
            file,
            entry.offset..entry.offset + entry.length,
            entry.crc32c,
        );
    }
}

/// All datasets of a source.
#[derive(Default)]
pub struct Datasets(BTreeMap<String, Dataset>);

/// Whether `at` starts with a URL scheme's name and `://` (RFC 3986: a letter, then letters,
/// digits, `+`, `-` and `.`), served or not: such a place is no directory.
fn names_a_scheme(at: &str) -> bool {
    let Some((scheme, _)) = at.split_once("://") else {
        return false;
    };
    let mut chars = scheme.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
}

impl Datasets {
    /// Loads datasets from `NAME=DIR` and `NAME=URL` specs (an object-storage dataset's
    /// manifest is read and its objects checked here).
    pub async fn open<S: AsRef<str>>(
        specs: &[S],
        remote: &RemoteOptions,
    ) -> Result<Self, DatasetError> {
        let mut out = Datasets::default();
        for spec in specs {
            let spec = spec.as_ref();
            // A URL with its `NAME=` left out is no name either, whatever `=` its secret or
            // query holds. The spec is repeated redacted: a URL's userinfo or signature never
            // reaches a log (before, `https://user:secret@host/ds` was repeated whole).
            let (name, at) = spec
                .split_once('=')
                .filter(|(name, _)| !name.contains("://"))
                .ok_or_else(|| DatasetError::Spec(shardwire_store::redacted(spec)))?;
            // A URL of a scheme no store serves (`gcs://`, `s3a://`) is refused naming the
            // ones served (before, it was opened as a directory: "cannot read
            // gcs://b/d/manifest.json ... run `shardwire index` first").
            if StoreUrl::is_remote(at) || names_a_scheme(at) {
                out.add_remote(name, at, remote).await?;
            } else {
                out.add(name, Path::new(at))?;
            }
        }
        Ok(out)
    }

    /// Opens the object-storage dataset at `url` under `name`.
    pub async fn add_remote(
        &mut self,
        name: &str,
        url: &str,
        opts: &RemoteOptions,
    ) -> Result<(), DatasetError> {
        self.check_new(name)?;
        let url = StoreUrl::parse(url).map_err(|source| DatasetError::Url {
            name: name.into(),
            source,
        })?;
        let (d, manifest, manifest_json) = RemoteDataset::open(name, &url, opts).await?;
        self.0.insert(
            name.into(),
            Dataset {
                name: name.into(),
                manifest,
                manifest_json,
                backend: Backend::Remote(d),
            },
        );
        Ok(())
    }

    fn check_new(&self, name: &str) -> Result<(), DatasetError> {
        check_dataset_name(name)?;
        if self.0.contains_key(name) {
            return Err(DatasetError::Duplicate(name.into()));
        }
        Ok(())
    }

    /// Loads one dataset directory under `name`.
    pub fn add(&mut self, name: &str, dir: &Path) -> Result<(), DatasetError> {
        self.check_new(name)?;
        let path = dir.join(MANIFEST_FILE);
        let read_err = |source| DatasetError::Read {
            path: path.clone(),
            dir: dir.display().to_string(),
            source,
        };
        let len = std::fs::metadata(&path).map_err(read_err)?.len();
        Manifest::check_size(len).map_err(|source| DatasetError::Manifest {
            path: path.clone(),
            source,
        })?;
        let manifest_json = std::fs::read(&path).map_err(read_err)?;
        let manifest =
            Manifest::from_json(&manifest_json).map_err(|source| DatasetError::Manifest {
                path: path.clone(),
                source,
            })?;
        // The bytes each file must hold: the end of its last shard (one pass over the shards).
        let mut ends: BTreeMap<&str, u64> = BTreeMap::new();
        for s in &manifest.shards {
            let end = ends.entry(s.file.as_str()).or_default();
            *end = (*end).max(s.offset + s.length);
        }
        let mut open: BTreeMap<&str, (Arc<File>, Arc<Opened>)> = BTreeMap::new();
        let mut files = Vec::with_capacity(manifest.shards.len());
        let mut opened = Vec::with_capacity(manifest.shards.len());
        for s in &manifest.shards {
            let (f, o) = match open.get(s.file.as_str()) {
                Some((f, o)) => (Arc::clone(f), Arc::clone(o)),
                None => {
                    let p = dir.join(&s.file);
                    let bad = |reason: String| DatasetError::ShardFile {
                        dataset: name.into(),
                        path: p.clone(),
                        reason,
                    };
                    let f = File::open(&p).map_err(|e| bad(open_failed(&e, ends.len())))?;
                    let meta = f.metadata().map_err(|e| bad(e.to_string()))?;
                    let len = meta.len();
                    let need = ends[s.file.as_str()];
                    if len < need {
                        return Err(bad(format!(
                            "is {len} bytes, the manifest needs {need} (re-run `shardwire index`)"
                        )));
                    }
                    let (f, o) = (Arc::new(f), Arc::new(Opened::new(&s.file, &meta)));
                    open.insert(&s.file, (Arc::clone(&f), Arc::clone(&o)));
                    (f, o)
                }
            };
            files.push(f);
            opened.push(o);
        }
        drop(open);
        self.0.insert(
            name.into(),
            Dataset {
                name: name.into(),
                manifest,
                manifest_json,
                backend: Backend::Local {
                    dir: dir.into(),
                    files,
                    opened,
                },
            },
        );
        Ok(())
    }

    /// Looks a dataset up.
    pub fn get(&self, name: &str) -> Option<&Dataset> {
        self.0.get(name)
    }

    /// All datasets.
    pub fn iter(&self) -> impl Iterator<Item = &Dataset> {
        self.0.values()
    }

    /// Number of datasets.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True with no datasets.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Why a shard file did not open; running out of file descriptors says what to raise (the
/// source keeps each of a dataset's files open).
fn open_failed(e: &std::io::Error, files: usize) -> String {
    if e.raw_os_error() == Some(rustix::io::Errno::MFILE.raw_os_error()) {
        format!(
            "{e}: the source keeps each of the dataset's {files} files open; raise the open-file limit (`ulimit -n`, LimitNOFILE) above the files of every dataset it serves"
        )
    } else {
        e.to_string()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A scratch file of `bytes`, unique to this test process and `tag`.
    fn scratch(tag: &str, bytes: &[u8]) -> PathBuf {
        let p = std::env::temp_dir().join(format!("sw-opened-{tag}-{}", std::process::id()));
        std::fs::write(&p, bytes).unwrap();
        p
    }

    #[test]
    fn a_file_whose_mode_changed_still_serves() {
        // `chmod -R g+r` on a live dataset: the bytes are those the manifest describes.
        use std::os::unix::fs::PermissionsExt;
        let path = scratch("chmod", &[1u8; 4096]);
        let file = File::open(&path).unwrap();
        let opened = Opened::new("s0.bin", &file.metadata().unwrap());
        std::thread::sleep(Duration::from_millis(50));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        let kept = opened.check(&file, 0..4096);
        std::fs::remove_file(&path).unwrap();
        kept.expect("a mode change is no change of the bytes");
    }

    #[test]
    fn a_file_replaced_by_a_rename_keeps_serving_what_it_had() {
        let path = scratch("renamed", &[1u8; 4096]);
        let file = File::open(&path).unwrap();
        let opened = Opened::new("s0.bin", &file.metadata().unwrap());
        std::thread::sleep(Duration::from_millis(50));
        let new = scratch("renamed-new", &[2u8; 4096]);
        std::fs::rename(&new, &path).unwrap();
        let kept = opened.check(&file, 0..4096);
        std::fs::remove_file(&path).unwrap();
        kept.expect("the open file still holds its bytes");
    }

    /// Waits (at most 10 s) until no recheck of `opened` is under way.
    async fn rechecked(opened: &Opened) {
        let t0 = std::time::Instant::now();
        while opened
            .rechecks()
            .values()
            .any(|r| matches!(r, Recheck::Running))
        {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "no recheck done in 10 s"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_shard_rewritten_in_place_with_its_time_put_back_is_refused_once_rechecked() {
        use std::os::unix::fs::FileExt;
        let bytes: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
        let crc = |b: &[u8]| {
            let mut c = Crc32c::new();
            c.update(b);
            c.finish()
        };
        let path = scratch("rot", &bytes);
        let file = Arc::new(File::open(&path).unwrap());
        let opened = Arc::new(Opened::new("s0.bin", &file.metadata().unwrap()));
        let (first, second) = (0..4096u64, 4096..8192u64);
        // A report about bytes that are good in the file (they went bad on their way).
        opened.recheck(&file, first.clone(), crc(&bytes[..4096]));
        rechecked(&opened).await;
        assert!(opened.check(&file, first.clone()).is_ok());
        assert!(
            opened.rechecks().is_empty(),
            "a recheck that passed is forgotten"
        );
        // The second shard rewritten in place, its modification time put back.
        let w = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        let mtime = w.metadata().unwrap().modified().unwrap();
        w.write_all_at(&[0xA5; 4096], 4096).unwrap();
        w.set_modified(mtime).unwrap();
        opened
            .check(&file, second.clone())
            .expect("size and time as opened: it passes");
        opened.recheck(&file, second.clone(), crc(&bytes[4096..]));
        rechecked(&opened).await;
        let refused = opened.check(&file, second.clone());
        let kept = opened.check(&file, first);
        std::fs::remove_file(&path).unwrap();
        // Before, nothing but the node's CRC check ever found it.
        let e = refused.expect_err("refused once rechecked");
        assert!(matches!(e, ShardChanged::Corrupt { .. }), "{e}");
        let m = e.to_string();
        for says in ["s0.bin", "4096..8192", "good copy", "found 0x"] {
            assert!(m.contains(says), "{says}: {m}");
        }
        kept.expect("the file's other shard is served");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_recheck_that_cannot_read_the_bytes_refuses_nothing_and_is_done_again() {
        let path = scratch("eio", &[7u8; 4096]);
        let file = Arc::new(File::open(&path).unwrap());
        let opened = Arc::new(Opened::new("s0.bin", &file.metadata().unwrap()));
        // A read error on the blocking thread (here: the range runs past the file's end).
        opened.recheck(&file, 4096..8192, 0x1234_5678);
        rechecked(&opened).await;
        let forgotten = opened.rechecks().is_empty();
        // EIO from a network file system that passes.
        opened.rechecks().insert((0, 4096), Recheck::Running);
        opened.rechecked(
            0..4096,
            0x1234_5678,
            Err(std::io::Error::from_raw_os_error(5)),
        );
        let served = opened.check(&file, 0..4096);
        let again = opened.rechecks().is_empty();
        std::fs::remove_file(&path).unwrap();
        // Before, each was recorded as failed: the shard refused until the source restarted.
        assert!(forgotten, "a recheck that read nothing is forgotten");
        served.expect("still served");
        assert!(again, "a later report rechecks it");
    }

    #[test]
    fn a_recheck_of_a_file_cut_short_says_it_is_refused_as_changed() {
        let path = scratch("cut", &[7u8; 4096]);
        let file = File::open(&path).unwrap();
        let cut = range_crc(&file, 0..8192).expect_err("past the end");
        std::fs::remove_file(&path).unwrap();
        // Before: "could not be read again ... still served ... check the file system".
        let said = unread_recheck(&cut);
        assert!(
            said.contains("now shorter") && said.contains("refused"),
            "{said}"
        );
        assert!(!said.contains("still served"), "{said}");
        let eio = unread_recheck(&std::io::Error::from_raw_os_error(5));
        assert!(eio.contains("still served"), "{eio}");
    }

    fn no_cache() -> RemoteOptions {
        RemoteOptions {
            request_size: 8 << 20,
            max_inflight: 4,
            cache_dir: None,
            cache_size: 0,
        }
    }

    #[tokio::test]
    async fn a_url_of_a_scheme_no_store_serves_is_refused_naming_the_schemes_served() {
        for (spec, scheme) in [
            ("imagenet=gcs://bucket/imagenet", "gcs"),
            ("web=s3a://AKIA:tok3n@bkt/web", "s3a"),
            ("w=abfss://c@acct.dfs.core.windows.net/w", "abfss"),
        ] {
            let e = Datasets::open(&[spec], &no_cache())
                .await
                .err()
                .expect("refused");
            assert!(matches!(e, DatasetError::Url { .. }), "{spec}: {e}");
            let m = e.to_string();
            // Before: "cannot read gcs://bucket/imagenet/manifest.json: No such file or
            // directory (run `shardwire index gcs://bucket/imagenet` first)".
            assert!(m.contains(&format!("unsupported scheme `{scheme}`")), "{m}");
            assert!(
                m.contains("gs://BUCKET/PREFIX") && m.contains("s3://"),
                "{m}"
            );
            assert!(!m.contains("manifest.json") && !m.contains("tok3n"), "{m}");
        }
        // A directory stays a directory, `://` nowhere near a scheme's name.
        assert!(!names_a_scheme("/data/x") && !names_a_scheme("/d/a://b"));
        assert!(names_a_scheme("gcs://b") && names_a_scheme("S3A://b"));
    }

    #[tokio::test]
    async fn a_spec_without_its_name_is_refused_without_repeating_a_urls_secret() {
        for spec in [
            "https://alice:s3cr3t@files.example/ds",
            // An `=` in the secret or the query: no name before it either.
            "https://alice:s3=cr3t@files.example/ds",
            "s3://bkt/ds?X-Amz-Signature=s3cr3t",
        ] {
            let e = Datasets::open(&[spec], &no_cache())
                .await
                .err()
                .expect("refused");
            assert!(matches!(e, DatasetError::Spec(_)), "{spec}: {e}");
            let m = e.to_string();
            // Before: the spec whole, `alice:s3cr3t` and all (or, split at the `=`, a
            // refused name `https://alice:s3`).
            assert!(!m.contains("cr3t") && !m.contains("alice"), "{m}");
            assert!(m.contains("NAME=URL"), "{m}");
        }
        let e = Datasets::open(&["https://alice:s3cr3t@files.example/ds"], &no_cache()).await;
        let m = e.err().expect("refused").to_string();
        assert!(m.contains("https://***@files.example/ds"), "{m}");
    }

    #[tokio::test]
    async fn dot_names_are_refused_before_any_directory_is_touched() {
        for spec in ["..=s3://bucket/prefix", ".=/nonexistent"] {
            let opts = RemoteOptions {
                request_size: 8 << 20,
                max_inflight: 4,
                cache_dir: None,
                cache_size: 0,
            };
            let e = Datasets::open(&[spec], &opts).await.err().expect("refused");
            assert!(
                matches!(e, DatasetError::Name(DatasetNameError::DotName { .. })),
                "{spec}: {e}"
            );
            // Before: only "--dataset NAME=DIR", a flag a config file's user never gave.
            assert!(
                e.to_string().contains("a dataset name in `datasets`"),
                "{e}"
            );
        }
    }
}
