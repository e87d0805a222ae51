//! Finds the data files of a dataset directory: recursive, deterministic (sorted by relative
//! path), skipping hidden entries, the manifest itself and unknown extensions.

use std::path::{Path, PathBuf};

use shardwire_protocol::manifest::MANIFEST_FILE;

use crate::error::IndexError;

/// How a file is read, chosen by its extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `.arrow`, `.arrows`, `.ipc`, `.feather`: Arrow IPC, file or stream format.
    Arrow,
    /// `.npy`: a numpy array.
    Npy,
    /// `.bin`: raw bytes.
    Bin,
}

impl Kind {
    /// The kind for a file name, or `None` for files that are not indexed.
    pub fn of(name: &str) -> Option<Self> {
        let ext = Path::new(name).extension()?.to_str()?.to_ascii_lowercase();
        match ext.as_str() {
            "arrow" | "arrows" | "ipc" | "feather" => Some(Self::Arrow),
            "npy" => Some(Self::Npy),
            "bin" => Some(Self::Bin),
            _ => None,
        }
    }
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

/// Lists the data files under `dir`, sorted by relative path.
///
/// Symbolic links to files are followed; symbolic links to directories are not (no cycles).
pub(crate) fn collect(dir: &Path) -> Result<Vec<Candidate>, IndexError> {
    let mut out = Vec::new();
    let mut stack: Vec<(PathBuf, String)> = vec![(dir.to_path_buf(), String::new())];
    while let Some((path, prefix)) = stack.pop() {
        let entries = std::fs::read_dir(&path).map_err(|e| IndexError::io(&path, e))?;
        for entry in entries {
            let entry = entry.map_err(|e| IndexError::io(&path, e))?;
            let full = entry.path();
            let name = entry.file_name();
            let Some(name) = name.to_str() else {
                return Err(IndexError::NonUtf8Name { file: full });
            };
            if name.starts_with('.') || (prefix.is_empty() && name == MANIFEST_FILE) {
                continue;
            }
            let rel = if prefix.is_empty() {
                name.to_owned()
            } else {
                format!("{prefix}/{name}")
            };
            let ftype = entry.file_type().map_err(|e| IndexError::io(&full, e))?;
            if ftype.is_dir() {
                stack.push((full, rel));
                continue;
            }
            let Some(kind) = Kind::of(name) else { continue };
            // Follows a symbolic link to a file; skips links to directories and dangling links.
            let meta = match std::fs::metadata(&full) {
                Ok(m) if m.is_file() => m,
                Ok(_) => continue,
                Err(_) if ftype.is_symlink() => continue,
                Err(e) => return Err(IndexError::io(&full, e)),
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
    Ok(out)
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
        assert_eq!(Kind::of("x.json"), None);
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
            MANIFEST_FILE,
        ] {
            std::fs::write(dir.join(f), b"x").unwrap();
        }
        let rels: Vec<String> = collect(&dir).unwrap().into_iter().map(|c| c.rel).collect();
        assert_eq!(rels, ["a.npy", "b.bin", "sub/c.arrow", "sub/deeper/z.bin"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
