//! The datasets a source serves: name -> manifest and where the shards are: a directory
//! with open files, or objects in object storage ([`crate::remote`]).

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use shardwire_protocol::manifest::{MANIFEST_FILE, Manifest, ManifestError};
use shardwire_protocol::wire::{DatasetNameError, check_dataset_name};
use shardwire_store::StoreUrl;

use crate::remote::{self, RemoteDataset, RemoteOptions};

/// Why a dataset cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    /// `--dataset` value is not NAME=DIR.
    #[error(
        "dataset spec `{0}` is not NAME=DIR or NAME=URL (s3://, gs://, az://, file://, http(s)://)"
    )]
    Spec(String),
    /// An object-storage dataset cannot be served.
    #[error(transparent)]
    Remote(#[from] remote::OpenError),
    /// The dataset URL is not valid.
    #[error("--dataset {name}=...: {source}")]
    Url {
        /// The dataset.
        name: String,
        /// Why.
        #[source]
        source: shardwire_store::StoreError,
    },
    /// Bad dataset name.
    #[error("--dataset NAME=DIR: {0}")]
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
/// bytes it had, through the open file).
#[derive(Debug)]
pub struct Opened {
    /// Its path in the dataset's directory.
    pub name: String,
    len: u64,
    modified: Option<std::time::SystemTime>,
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
}

impl Opened {
    fn new(name: &str, meta: &std::fs::Metadata) -> Self {
        Self {
            name: name.to_owned(),
            len: meta.len(),
            modified: meta.modified().ok(),
        }
    }

    /// Whether `file` (this one, open) still holds what it held at open, up to byte `need`;
    /// the error says what changed. Its inode and device need no check: `fstat` of the open
    /// file always names the inode it opened. The inode change time is not compared either:
    /// `chmod`, a new hard link or an rsync of the directory move it on files that still hold
    /// their bytes, and a rewrite of the same length with its modification time put back is
    /// caught by the node's CRC check (never delivered).
    pub fn check(&self, file: &File, need: u64) -> Result<(), ShardChanged> {
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
        Ok(())
    }
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

/// All datasets of a source.
#[derive(Default)]
pub struct Datasets(BTreeMap<String, Dataset>);

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
            let (name, at) = spec
                .split_once('=')
                .ok_or_else(|| DatasetError::Spec(spec.into()))?;
            if StoreUrl::is_remote(at) {
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
        let kept = opened.check(&file, 4096);
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
        let kept = opened.check(&file, 4096);
        std::fs::remove_file(&path).unwrap();
        kept.expect("the open file still holds its bytes");
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
        }
    }
}
