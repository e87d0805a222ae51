//! Finds the data files of a dataset directory ([`collect`]) or of an object-store listing
//! ([`from_listing`]): deterministic (sorted by relative path), skipping hidden entries, empty
//! directory markers of object stores and the manifest itself silently. Every other file
//! that is not read (unknown extension, HF `datasets` metadata, megatron-core's index cache
//! wherever `--data-cache-path` put it, a name that is not UTF-8, links to directories,
//! dangling links, a file system's `lost+found` folder) is listed as [`Unused`] with the
//! reason, so that nothing is left out unseen. Both apply the same rules, but for `lost+found`: only a local folder can be fsck's
//! (at the dataset's top or at a mount point); in an object store it is a name like another.
//!
//! What could be data but cannot be read is an error, not an [`Unused`] entry: a data file
//! that cannot be opened, a folder whose name is not UTF-8, a folder that cannot be listed
//! (permission denied, or vanished while listed: [`IndexError::UnlistedFolder`], which says
//! what to do). A dataset is never indexed without files it may hold.

use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use shardwire_protocol::manifest::MANIFEST_FILE;

use crate::error::IndexError;
pub(crate) use crate::unused::Unused;

/// The name of a MosaicML Streaming index file (read by [`crate::mds`]).
pub(crate) const MDS_INDEX_FILE: &str = "index.json";

/// How a file is read, chosen by its extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `.arrow`, `.arrows`, `.ipc`, `.feather`: Arrow IPC, file or stream format.
    Arrow,
    /// `.npy`: a numpy array.
    Npy,
    /// `.bin`: raw bytes.
    Bin,
    /// `.parquet`: converted to Arrow IPC in the cache, then read as [`Kind::Arrow`].
    Parquet,
    /// `.tar`: a WebDataset shard.
    Tar,
    /// `.tar.gz`, `.tgz`, `.tar.xz`, `.txz`, `.tar.bz2`, `.tbz2`, `.tar.zst`, `.tzst`,
    /// `.tar.lz4`, `.tar.lzma`: a compressed tar, refused with the reason
    /// (`webdataset::refuse_compressed`).
    CompressedTar,
    /// `.mds`: a MosaicML Streaming MDS shard, listed by an `index.json`.
    Mds,
    /// `index.json`: a MosaicML Streaming index (read first, see `mds::plan`).
    MdsIndex,
    /// `.idx`: a Megatron-LM index, paired with the `.bin` of the same stem (read first, see
    /// `megatron::plan`).
    MegatronIdx,
}

impl Kind {
    /// The kind for a file name, or `None` for files that are not indexed.
    pub fn of(name: &str) -> Option<Self> {
        if name == MDS_INDEX_FILE {
            return Some(Self::MdsIndex);
        }
        let ext = Path::new(name).extension()?.to_str()?.to_ascii_lowercase();
        match ext.as_str() {
            "arrow" | "arrows" | "ipc" | "feather" => Some(Self::Arrow),
            "npy" => Some(Self::Npy),
            "bin" => Some(Self::Bin),
            "parquet" => Some(Self::Parquet),
            "tar" => Some(Self::Tar),
            "tgz" | "txz" | "tbz2" | "tbz" | "tzst" | "tlz" => Some(Self::CompressedTar),
            "mds" => Some(Self::Mds),
            "idx" => Some(Self::MegatronIdx),
            "gz" | "xz" | "bz2" | "zst" | "zstd" | "lz4" | "lzma" if compressed_tar(name) => {
                Some(Self::CompressedTar)
            }
            _ => None,
        }
    }
}

/// Whether `name` ends in `.tar.EXT` (`x.tar.xz`; any case).
fn compressed_tar(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    let stem = lower.rsplit_once('.').map_or("", |(s, _)| s);
    stem.ends_with(".tar")
}

/// A data file to index.
#[derive(Debug)]
pub(crate) struct Candidate {
    /// Full path.
    pub path: PathBuf,
    /// Path relative to the dataset directory, '/'-separated.
    pub rel: String,
    /// How to read it.
    pub kind: Kind,
    /// Size in bytes when listed (for progress only).
    pub size: u64,
}

/// Files HF `datasets` writes next to its Arrow files (`save_to_disk`).
const HF_METADATA: [&str; 3] = ["dataset_info.json", "state.json", "dataset_dict.json"];

/// Why a regular file named `name` is not read.
fn unused_reason(name: &str) -> String {
    if HF_METADATA.contains(&name) {
        return "HF datasets metadata".into();
    }
    match Path::new(name).extension() {
        Some(ext) => format!("unknown extension .{}", ext.to_string_lossy()),
        None => "no extension".into(),
    }
}

/// The reason given for the files of megatron-core's dataset index cache.
pub(crate) const MEGATRON_CACHE: &str = "Megatron's dataset index cache";

/// The last `-`-separated part of the names megatron-core gives the files of its dataset
/// index cache (`<hash>-GPTDataset-<split>-document_index.npy`; `BlendedDataset` writes
/// `dataset_index` and `dataset_sample_index`).
const MEGATRON_CACHE_FILES: [&str; 6] = [
    "document_index.npy",
    "sample_index.npy",
    "shuffle_index.npy",
    "dataset_index.npy",
    "dataset_sample_index.npy",
    "description.txt",
];

/// Whether `rel` is a file megatron-core's `GPTDataset` (or another of its datasets) wrote
/// in its index cache: `cache/<Class>_indices/<hash>-...-{document,sample,shuffle}_index.npy`,
/// which it puts next to the `.bin` it indexes when `path_to_cache` is not set, or a file
/// named as megatron-core names them wherever it is ([`mcore_cache_name`]: where
/// `--data-cache-path` says); or one Megatron-LM wrote before megatron-core
/// ([`megatron_lm_cache`], [`hashed_cache`]).
fn megatron_cache(rel: &str) -> bool {
    let mut parts = rel.rsplit('/');
    let name = parts.next().unwrap_or(rel);
    let dir = parts.next();
    let in_cache = dir.is_some_and(|d| d.to_ascii_lowercase().contains("cache"));
    if megatron_lm_cache(name) || hashed_cache(name, in_cache) || mcore_cache_name(name) {
        return true;
    }
    let (Some(dir), Some(cache)) = (dir, parts.next()) else {
        return false;
    };
    cache == "cache"
        && dir.ends_with("_indices")
        && name
            .rsplit_once('-')
            .is_some_and(|(_, last)| MEGATRON_CACHE_FILES.contains(&last))
}

/// Whether `name` is `<md5>-<Class>-<split>-<file>` (`<md5>-BlendedDataset-train-
/// dataset_index.npy`), the MD5 32 hex digits and `<file>` one of [`MEGATRON_CACHE_FILES`]:
/// megatron-core names every file of its index cache so (`f"{base}-{affix}"`, `base` being
/// `f"{md5}-{Class}-{split}"`), and with `path_to_cache` set (`--data-cache-path P`) writes
/// them straight into `P`, which can be any folder (the dataset's own, `cache/`, `idx/`).
fn mcore_cache_name(name: &str) -> bool {
    let Some((hash, rest)) = name.split_once('-') else {
        return false;
    };
    let Some((class, file)) = rest.rsplit_once('-') else {
        return false;
    };
    md5_hex(hash) && !class.is_empty() && MEGATRON_CACHE_FILES.contains(&file)
}

/// Whether `s` is an MD5 digest in hex: 32 hex digits.
fn md5_hex(s: &str) -> bool {
    s.len() == 32 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Whether `name` is a file of the index caches Megatron-LM wrote before megatron-core, next
/// to the `.bin` it indexes: GPT's `<prefix>_<split>_indexmap_<n>ns_<len>sl_<seed>s_doc_idx.npy`
/// (and `_sample_idx.npy`, `_shuffle_idx.npy`), BERT's and T5's samples mapping
/// `<prefix>_<split>_indexmap_<n>mns_<len>msl_<p>ssp_<seed>s.npy`, ICT's block mapping
/// (`..._1sentok.npy`).
fn megatron_lm_cache(name: &str) -> bool {
    let Some((_, map)) = name.split_once("_indexmap_") else {
        return false;
    };
    let gpt = ["_doc_idx.npy", "_sample_idx.npy", "_shuffle_idx.npy"]
        .iter()
        .any(|end| map.ends_with(end));
    gpt || (map.contains("msl_") && (map.ends_with("s.npy") || map.ends_with("sentok.npy")))
}

/// Whether `name` is one of the files Megatron-LM (mid-2023, and Megatron-DeepSpeed) names by
/// the MD5 of their description: `<md5>_{doc,sample,shuffle}_idx.npy`, `<md5>.dsc`, and
/// BlendableDataset's `<md5>_index.npy`, `<md5>_sample_index.npy`. Those two only in a
/// folder whose name says cache (`index-cache/` beside the `.bin`, or the `cache/` that
/// `--data-cache-path` usually names; `in_cache`): elsewhere such names can be a
/// content-addressed dataset's own arrays (a uuid's hex is 32 digits too).
fn hashed_cache(name: &str, in_cache: bool) -> bool {
    const ENDS: [&str; 4] = [
        "_doc_idx.npy",
        "_sample_idx.npy",
        "_shuffle_idx.npy",
        ".dsc",
    ];
    const IN_CACHE: [&str; 2] = ["_sample_index.npy", "_index.npy"];
    let stem = ENDS
        .iter()
        .chain(IN_CACHE.iter().filter(|_| in_cache))
        .find_map(|end| name.strip_suffix(end));
    stem.is_some_and(md5_hex)
}

/// The folder `fsck` of ext2/3/4 keeps at the root of a file system (so at the top of a
/// dataset on a volume of its own, or where a volume is mounted inside it), readable by root
/// only and holding no dataset's files: there ([`fsck_folder`]) never read (whoever indexes,
/// the same manifest), named unused with [`LOST_FOUND_REASON`]. Elsewhere, a folder of the
/// dataset like another.
const LOST_FOUND: &str = "lost+found";
/// Why fsck's `lost+found` folder is not read.
const LOST_FOUND_REASON: &str = "the file system's lost+found folder (not read)";

/// How the regular file `rel` (named `name`) is read, or why it is not.
fn classify(rel: &str, name: &str) -> Result<Kind, String> {
    if megatron_cache(rel) {
        return Err(MEGATRON_CACHE.into());
    }
    Kind::of(name).ok_or_else(|| unused_reason(name))
}

/// `prefix/name`, or `name` at the top.
fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_owned()
    } else {
        format!("{prefix}/{name}")
    }
}

/// Whether the entry `name` (at the top of the dataset when `top`) is skipped without a word:
/// hidden entries and the manifest.
fn skipped(name: &str, top: bool) -> bool {
    name.starts_with('.') || (top && name == MANIFEST_FILE)
}

/// The data files and the files not used among the objects of a listing (`(key relative to
/// the prefix, size)`), by the same rules as [`collect`]; `display` names an object in
/// messages (its URL).
pub(crate) fn from_listing<'a>(
    objects: impl Iterator<Item = (&'a str, u64)>,
    display: impl Fn(&str) -> PathBuf,
) -> (Vec<Candidate>, Vec<Unused>) {
    let mut out = Vec::new();
    let mut unused = Vec::new();
    for (rel, size) in objects {
        let parts: Vec<&str> = rel.split('/').collect();
        let name = parts.last().copied().unwrap_or("");
        // Hidden entries at any depth are not files to read.
        if parts
            .iter()
            .enumerate()
            .any(|(i, p)| skipped(p, i == 0 && parts.len() == 1))
        {
            continue;
        }
        if name.is_empty() {
            // `a/`: an empty one is a directory marker; one with bytes is named.
            if size > 0 {
                unused.push(Unused {
                    file: rel.to_owned(),
                    reason: format!(
                        "object key ends in '/' but holds {size} bytes (not an empty directory \
                         marker): copy it to a key without the trailing '/' if it is data"
                    ),
                });
            }
            continue;
        }
        match classify(rel, name) {
            Ok(kind) => out.push(Candidate {
                path: display(rel),
                rel: rel.to_owned(),
                kind,
                size,
            }),
            Err(reason) => unused.push(Unused {
                file: rel.to_owned(),
                reason,
            }),
        }
    }
    out.sort_by(|a, b| a.rel.cmp(&b.rel));
    unused.sort_by(|a, b| a.file.cmp(&b.file));
    (out, unused)
}

/// Lists the data files under `dir`, sorted by relative path, and the files not used.
///
/// Symbolic links to files are followed; symbolic links to directories are not (no cycles).
pub(crate) fn collect(dir: &Path) -> Result<(Vec<Candidate>, Vec<Unused>), IndexError> {
    let mut out = Vec::new();
    let mut unused = Vec::new();
    let mut stack: Vec<(PathBuf, String)> = vec![(dir.to_path_buf(), String::new())];
    while let Some((path, prefix)) = stack.pop() {
        let top = prefix.is_empty();
        let entries = std::fs::read_dir(&path).map_err(|e| unlisted(&path, top, e))?;
        for entry in entries {
            let entry = entry.map_err(|e| unlisted(&path, top, e))?;
            let full = entry.path();
            let name = entry.file_name();
            let Some(name) = name.to_str() else {
                unused.extend(non_utf8(&entry, &prefix)?);
                continue;
            };
            if skipped(name, prefix.is_empty()) {
                continue;
            }
            let rel = join(&prefix, name);
            let ftype = entry.file_type().map_err(|e| IndexError::io(&full, e))?;
            if ftype.is_dir() {
                if name == LOST_FOUND && fsck_folder(&path, &full, top) {
                    unused.push(Unused {
                        file: format!("{rel}/"),
                        reason: LOST_FOUND_REASON.into(),
                    });
                } else {
                    stack.push((full, rel));
                }
                continue;
            }
            // Follows a symbolic link to a file; skips links to directories and dangling links.
            let meta = match std::fs::metadata(&full) {
                Ok(m) if m.is_file() => Ok(m),
                Ok(m) if m.is_dir() => Err("symbolic link to a directory (not followed)"),
                Ok(_) => Err("not a regular file"),
                Err(_) if ftype.is_symlink() => Err("dangling symbolic link"),
                Err(e) => return Err(IndexError::io(&full, e)),
            };
            let found = meta
                .map_err(String::from)
                .and_then(|m| classify(&rel, name).map(|k| (k, m)));
            let (kind, meta) = match found {
                Ok(found) => found,
                Err(reason) => {
                    unused.push(Unused { file: rel, reason });
                    continue;
                }
            };
            out.push(Candidate {
                path: full,
                rel,
                kind,
                size: meta.len(),
            });
        }
    }
    out.sort_by(|a, b| a.rel.cmp(&b.rel));
    unused.sort_by(|a, b| a.file.cmp(&b.file));
    Ok((out, unused))
}

/// Whether the folder `lost+found` at `full`, in the folder `parent` (the dataset's own when
/// `top`), is the one `fsck` keeps at a file system's root: at the dataset's top, or at a
/// mount point (`full` on another file system than `parent`, or `parent` on another than
/// its own parent). Where a file system cannot be told (`stat` fails), it is walked: a
/// folder that cannot be listed is then an error saying what to do.
fn fsck_folder(parent: &Path, full: &Path, top: bool) -> bool {
    use std::os::unix::fs::MetadataExt;
    if top {
        return true;
    }
    let dev = |p: &Path| std::fs::metadata(p).ok().map(|m| m.dev());
    let Some(here) = dev(parent) else {
        return false;
    };
    dev(&parent.join("..")).is_some_and(|up| up != here) || dev(full).is_some_and(|own| own != here)
}

/// The error for the folder `path` (the dataset's own when `top`) that could not be listed,
/// with what to do.
fn unlisted(path: &Path, top: bool, source: std::io::Error) -> IndexError {
    let fix = match source.kind() {
        ErrorKind::NotFound => {
            "it vanished while the dataset was listed: index again once nothing moves or \
             deletes files in the dataset"
        }
        _ if top => "make it readable (chmod, chown), or index it as a user who can read it",
        _ => {
            "its files could be data, and the dataset is not indexed without them: make it \
             readable (chmod, chown), move it out of the dataset, or rename it to start with \
             '.' (hidden folders are skipped)"
        }
    };
    IndexError::UnlistedFolder {
        dir: path.to_path_buf(),
        source,
        fix,
    }
}

/// The entry `entry` of the folder `prefix`, whose name is not UTF-8 (so cannot be written
/// into the manifest): skipped when hidden, an error when it could be data (a directory, or
/// a data file's extension), else named unused by its lossy name.
fn non_utf8(entry: &std::fs::DirEntry, prefix: &str) -> Result<Option<Unused>, IndexError> {
    let full = entry.path();
    let lossy = entry.file_name().to_string_lossy().into_owned();
    if skipped(&lossy, prefix.is_empty()) {
        return Ok(None);
    }
    let ftype = entry.file_type().map_err(|e| IndexError::io(&full, e))?;
    if ftype.is_dir() || Kind::of(&lossy).is_some() {
        return Err(IndexError::NonUtf8Name { file: full });
    }
    Ok(Some(Unused {
        file: join(prefix, &lossy),
        reason: "file name is not valid UTF-8 (shown with U+FFFD for the bytes that are not)"
            .into(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_by_extension() {
        assert_eq!(Kind::of("a.arrow"), Some(Kind::Arrow));
        assert_eq!(Kind::of("a.FEATHER"), Some(Kind::Arrow));
        assert_eq!(Kind::of("a.arrows"), Some(Kind::Arrow));
        assert_eq!(Kind::of("a.ipc"), Some(Kind::Arrow));
        assert_eq!(Kind::of("x.npy"), Some(Kind::Npy));
        assert_eq!(Kind::of("x.bin"), Some(Kind::Bin));
        assert_eq!(Kind::of("x.Parquet"), Some(Kind::Parquet));
        assert_eq!(Kind::of("x.tar"), Some(Kind::Tar));
        assert_eq!(Kind::of("x.TGZ"), Some(Kind::CompressedTar));
        assert_eq!(Kind::of("x.tar.gz"), Some(Kind::CompressedTar));
        assert_eq!(Kind::of("x.gz"), None);
        // Before, these were "unknown extension .xz" (and so on), not compressed tars.
        for name in [
            "x.tar.xz",
            "x.TAR.BZ2",
            "x.tar.zst",
            "x.tar.lz4",
            "x.txz",
            "x.tbz2",
        ] {
            assert_eq!(Kind::of(name), Some(Kind::CompressedTar), "{name}");
        }
        assert_eq!(Kind::of("x.xz"), None);
        assert_eq!(Kind::of("x.json.zst"), None);
        assert_eq!(Kind::of("x.json"), None);
        assert_eq!(Kind::of("x.mds"), Some(Kind::Mds));
        assert_eq!(Kind::of("index.json"), Some(Kind::MdsIndex));
        assert_eq!(Kind::of("x.idx"), Some(Kind::MegatronIdx));
        assert_eq!(Kind::of("npy"), None);
    }

    #[test]
    fn walk_is_sorted_and_skips_hidden_unknown_and_manifest() {
        let dir = crate::testutil::temp_dir("walk");
        std::fs::create_dir_all(dir.join("sub/deeper")).unwrap();
        std::fs::create_dir_all(dir.join(".hidden")).unwrap();
        for f in [
            "b.bin",
            "a.npy",
            "sub/deeper/z.bin",
            "sub/c.arrow",
            ".dot.bin",
            ".hidden/x.bin",
            "notes.txt",
            "sub/state.json",
            "data.tar",
            "README",
            MANIFEST_FILE,
        ] {
            std::fs::write(dir.join(f), b"x").unwrap();
        }
        let (found, unused) = collect(&dir).unwrap();
        let rels: Vec<String> = found.into_iter().map(|c| c.rel).collect();
        assert_eq!(
            rels,
            [
                "a.npy",
                "b.bin",
                "data.tar",
                "sub/c.arrow",
                "sub/deeper/z.bin"
            ]
        );
        let unused: Vec<(&str, &str)> = unused
            .iter()
            .map(|u| (u.file.as_str(), u.reason.as_str()))
            .collect();
        assert_eq!(
            unused,
            [
                ("README", "no extension"),
                ("notes.txt", "unknown extension .txt"),
                ("sub/state.json", "HF datasets metadata"),
            ]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_listing_follows_the_same_rules() {
        let listing = [
            ("b.bin", 3),
            ("a.npy", 1),
            ("sub/deeper/z.bin", 1),
            ("sub/c.arrow", 1),
            (".dot.bin", 1),
            (".hidden/x.bin", 1),
            ("sub/.shardwire-cache/p.arrow", 1),
            ("notes.txt", 1),
            ("sub/state.json", 1),
            ("dir/", 0),
            ("odd/", 5),
            ("README", 1),
            (MANIFEST_FILE, 1),
            ("sub/shardwire.manifest.json", 1),
        ];
        let (found, unused) = from_listing(listing.into_iter(), |r| {
            PathBuf::from(format!("s3://b/{r}"))
        });
        let rels: Vec<(&str, u64)> = found.iter().map(|c| (c.rel.as_str(), c.size)).collect();
        assert_eq!(
            rels,
            [
                ("a.npy", 1),
                ("b.bin", 3),
                ("sub/c.arrow", 1),
                ("sub/deeper/z.bin", 1)
            ]
        );
        assert_eq!(found[0].path, PathBuf::from("s3://b/a.npy"));
        let names: Vec<&str> = unused.iter().map(|u| u.file.as_str()).collect();
        assert_eq!(
            names,
            [
                "README",
                "notes.txt",
                "odd/",
                "sub/shardwire.manifest.json",
                "sub/state.json"
            ]
        );
        // Before, a key ending in '/' was skipped as a directory marker whatever it held.
        assert!(
            unused[2].reason.contains("ends in '/'") && unused[2].reason.contains("5 bytes"),
            "{:?}",
            unused[2]
        );
    }

    #[test]
    fn megatron_core_index_cache_is_named_unused() {
        // Written next to corpus.bin by GPTDataset when path_to_cache is not set.
        let cache = "corpus/cache/GPTDataset_indices";
        let dir = crate::testutil::temp_dir("walk-mcore-cache");
        std::fs::create_dir_all(dir.join(cache)).unwrap();
        std::fs::create_dir_all(dir.join("index-cache")).unwrap();
        std::fs::create_dir_all(dir.join("cache")).unwrap();
        std::fs::create_dir_all(dir.join("shards")).unwrap();
        std::fs::create_dir_all(dir.join("blend")).unwrap();
        let md5 = "0123456789abcdef0123456789abcdef";
        let names = [
            "corpus.bin".to_owned(),
            "corpus.idx".to_owned(),
            format!("{cache}/0a1b-GPTDataset-train-document_index.npy"),
            format!("{cache}/0a1b-GPTDataset-train-sample_index.npy"),
            format!("{cache}/0a1b-GPTDataset-train-shuffle_index.npy"),
            format!("{cache}/0a1b-GPTDataset-train-description.txt"),
            // Not a name megatron-core writes: still data.
            format!("{cache}/features.npy"),
            // Megatron-LM before megatron-core, next to the .bin: its split words made the
            // folder look like three splits.
            "corpus_train_indexmap_100ns_2048sl_1234s_doc_idx.npy".to_owned(),
            "corpus_valid_indexmap_10ns_2048sl_1234s_sample_idx.npy".to_owned(),
            "corpus_test_indexmap_10ns_2048sl_1234s_shuffle_idx.npy".to_owned(),
            "bert_text_sentence_train_indexmap_1000mns_512msl_0.10ssp_1234s.npy".to_owned(),
            "index-cache/0123456789abcdef0123456789abcdef_doc_idx.npy".to_owned(),
            "index-cache/0123456789abcdef0123456789abcdef.dsc".to_owned(),
            "cache/fedcba9876543210fedcba9876543210_sample_index.npy".to_owned(),
            // --data-cache-path in a folder not named for a cache: the md5 names still are.
            "shards/fedcba9876543210fedcba9876543210_doc_idx.npy".to_owned(),
            // megatron-core with --data-cache-path: its files straight in that folder,
            // whatever its name (before, data: three extra dense shards, or three splits).
            format!("cache/{md5}-GPTDataset-train-document_index.npy"),
            format!("shards/{md5}-GPTDataset-valid-sample_index.npy"),
            format!("shards/{md5}-GPTDataset-test-shuffle_index.npy"),
            format!("{md5}-GPTDataset-train-description.txt"),
            format!("blend/{md5}-BlendedDataset-train-dataset_index.npy"),
            format!("blend/{md5}-BlendedDataset-train-dataset_sample_index.npy"),
            // Data that only looks alike: kept.
            "index-cache/embeddings.npy".to_owned(),
            "shards/00112233445566778899aabbccddeeff_index.npy".to_owned(),
            "corpus_indexmap.npy".to_owned(),
            format!("shards/{md5}-document_index.npy"),
            "shards/0a1b-GPTDataset-train-document_index.npy".to_owned(),
        ];
        for f in &names {
            std::fs::write(dir.join(f), b"x").unwrap();
        }
        let (found, unused) = collect(&dir).unwrap();
        let rels: Vec<&str> = found.iter().map(|c| c.rel.as_str()).collect();
        let data = format!("{cache}/features.npy");
        let bare = format!("shards/{md5}-document_index.npy");
        let want = [
            "corpus.bin",
            "corpus.idx",
            data.as_str(),
            "corpus_indexmap.npy",
            "index-cache/embeddings.npy",
            "shards/00112233445566778899aabbccddeeff_index.npy",
            bare.as_str(),
            "shards/0a1b-GPTDataset-train-document_index.npy",
        ];
        assert_eq!(rels, want);
        assert_eq!(unused.len(), 18, "{unused:?}");
        assert!(
            unused.iter().all(|u| u.reason == MEGATRON_CACHE),
            "{unused:?}"
        );
        // An object-store listing follows the same rule.
        let listing = names.iter().map(|n| (n.as_str(), 1));
        let (found, unused) = from_listing(listing, |r| PathBuf::from(format!("s3://b/{r}")));
        assert_eq!(found.len(), 8);
        assert!(
            unused.iter().all(|u| u.reason == MEGATRON_CACHE),
            "{unused:?}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn lost_found_is_named_unused_and_never_read_at_the_top_or_a_mount_point() {
        use std::os::unix::fs::MetadataExt;
        // Before, it was walked: unreadable (root's, mode 700) it failed the index of a
        // dataset at the top of a volume; readable, the files fsck left there were data.
        let dir = crate::testutil::temp_dir("walk-lost-found");
        std::fs::create_dir_all(dir.join("lost+found/#1234")).unwrap();
        std::fs::create_dir_all(dir.join("sub/lost+found")).unwrap();
        for f in [
            "a.bin",
            "lost+found/#1234/x.arrow",
            "lost+found/y.npy",
            "sub/lost+found/z.npy",
        ] {
            std::fs::write(dir.join(f), b"x").unwrap();
        }
        // Deeper, on the dataset's own file system, it is a folder of the dataset (before,
        // skipped at any depth).
        let (found, unused) = collect(&dir).unwrap();
        let rels: Vec<&str> = found.iter().map(|c| c.rel.as_str()).collect();
        assert_eq!(rels, ["a.bin", "sub/lost+found/z.npy"]);
        let unused: Vec<(&str, &str)> = unused
            .iter()
            .map(|u| (u.file.as_str(), u.reason.as_str()))
            .collect();
        assert_eq!(unused, [("lost+found/", LOST_FOUND_REASON)]);
        assert!(!fsck_folder(
            &dir.join("sub"),
            &dir.join("sub/lost+found"),
            false
        ));
        // At a mount point (a folder on another file system than its parent), it is fsck's.
        let dev = |p: &str| std::fs::metadata(p).map(|m| m.dev()).ok();
        for mount in ["/proc", "/sys", "/dev"] {
            if dev(mount).is_some() && dev(mount) != dev("/") {
                let at = Path::new(mount);
                assert!(fsck_folder(at, &at.join(LOST_FOUND), false), "{mount}");
            }
        }
        // An object store has no file systems: a name like another (before, skipped).
        let listing = [
            ("a.bin", 1),
            ("lost+found/y.npy", 1),
            ("sub/lost+found/z.npy", 1),
        ];
        let (found, unused) = from_listing(listing.into_iter(), |r| {
            PathBuf::from(format!("s3://b/{r}"))
        });
        let rels: Vec<&str> = found.iter().map(|c| c.rel.as_str()).collect();
        assert_eq!(rels, ["a.bin", "lost+found/y.npy", "sub/lost+found/z.npy"]);
        assert!(unused.is_empty(), "{unused:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_folder_that_cannot_be_listed_is_an_error_naming_it_and_what_to_do() {
        use std::os::unix::fs::PermissionsExt;
        // Before, a bare I/O error (`/d/shards: Permission denied`) without what to do.
        let denied = || std::io::Error::from(ErrorKind::PermissionDenied);
        let e = unlisted(Path::new("/d/shards"), false, denied()).to_string();
        assert!(
            e.starts_with("/d/shards: cannot list this folder of the dataset (permission denied)")
                && e.contains("move it out of the dataset")
                && e.contains("start with '.'"),
            "{e}"
        );
        let e = unlisted(Path::new("/d"), true, denied()).to_string();
        assert!(
            e.contains("make it readable") && !e.contains("move it out"),
            "{e}"
        );
        let gone = std::io::Error::from(ErrorKind::NotFound);
        let e = unlisted(Path::new("/d/tmp"), false, gone).to_string();
        assert!(e.contains("vanished while the dataset was listed"), "{e}");
        // A real one, where permissions hold (root lists any folder).
        let dir = crate::testutil::temp_dir("walk-unlisted");
        let locked = dir.join("locked");
        std::fs::create_dir(&locked).unwrap();
        std::fs::write(locked.join("a.bin"), b"x").unwrap();
        std::fs::write(dir.join("b.bin"), b"x").unwrap();
        std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o000)).unwrap();
        let enforced = std::fs::read_dir(&locked).is_err();
        let r = collect(&dir);
        std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o755)).unwrap();
        match r {
            Err(IndexError::UnlistedFolder { dir: d, .. }) if enforced => assert_eq!(d, locked),
            Ok((found, _)) if !enforced => assert_eq!(found.len(), 2),
            other => panic!("enforced {enforced}: {other:?}"),
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_non_utf8_name_is_skipped_when_hidden_named_when_not_data_else_refused() {
        use std::ffi::OsStr;
        use std::os::unix::ffi::OsStrExt;
        // Before, any name that is not UTF-8 aborted the walk, even a hidden one.
        let dir = crate::testutil::temp_dir("walk-utf8");
        std::fs::write(dir.join("a.bin"), b"x").unwrap();
        std::fs::write(dir.join(OsStr::from_bytes(b".lock\xff")), b"x").unwrap();
        std::fs::write(dir.join(OsStr::from_bytes(b"notes\xff.txt")), b"x").unwrap();
        let (found, unused) = collect(&dir).unwrap();
        let rels: Vec<&str> = found.iter().map(|c| c.rel.as_str()).collect();
        assert_eq!(rels, ["a.bin"]);
        assert_eq!(unused.len(), 1, "{unused:?}");
        assert_eq!(unused[0].file, "notes\u{FFFD}.txt");
        assert!(unused[0].reason.contains("not valid UTF-8"), "{unused:?}");
        // One that would be data is still an error naming it.
        std::fs::write(dir.join(OsStr::from_bytes(b"data\xff.bin")), b"x").unwrap();
        let e = collect(&dir).unwrap_err();
        assert!(matches!(e, IndexError::NonUtf8Name { .. }), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
