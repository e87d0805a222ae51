//! What a `file://` listing cannot show: object_store's local listing passes over dangling
//! symbolic links without a word (a shard linked to a volume that is not mounted would be
//! missing from the dataset unseen), so the listing's caller names them ([`dangling_links`]).

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// Deepest directory walked (links to directories are followed, as the listing follows them).
const MAX_DEPTH: usize = 64;

/// The paths under `root` (relative, `/`-separated, sorted) of symbolic links whose target
/// is missing. Links to directories are followed once each (a loop is walked once).
pub(crate) fn dangling_links(root: &Path) -> Vec<String> {
    let mut found = Vec::new();
    let mut seen = HashSet::new();
    walk(root, "", 0, &mut seen, &mut found);
    found.sort();
    found
}

fn walk(
    dir: &Path,
    rel: &str,
    depth: usize,
    seen: &mut HashSet<(u64, u64)>,
    found: &mut Vec<String>,
) {
    let Ok(meta) = std::fs::metadata(dir) else {
        return;
    };
    if depth > MAX_DEPTH || !seen.insert((meta.dev(), meta.ino())) {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let path = e.path();
        let here = match rel {
            "" => name,
            _ => format!("{rel}/{name}"),
        };
        let is_link = std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_symlink());
        match std::fs::metadata(&path) {
            Err(_) if is_link => found.push(here),
            Ok(m) if m.is_dir() => walk(&path, &here, depth + 1, seen, found),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dangling_links_are_found_at_any_depth_and_loops_walked_once() {
        let root = std::env::temp_dir().join(format!("sw-dangling-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("sub")).unwrap();
        std::fs::write(root.join("a.npy"), b"x").unwrap();
        std::os::unix::fs::symlink(root.join("a.npy"), root.join("good.npy")).unwrap();
        std::os::unix::fs::symlink("/nonexistent/volume/b.npy", root.join("b.npy")).unwrap();
        std::os::unix::fs::symlink("../missing.npy", root.join("sub/c.npy")).unwrap();
        std::os::unix::fs::symlink(&root, root.join("sub/loop")).unwrap();
        let found = dangling_links(&root);
        std::fs::remove_dir_all(&root).unwrap();
        assert_eq!(found, ["b.npy", "sub/c.npy"]);
    }
}
