//! HF `datasets` folders written by `save_to_disk`. Their `state.json` lists the folder's
//! Arrow files (`_data_files`), and those are all `load_from_disk` reads: a later
//! `save_to_disk` into the same folder with fewer shards deletes nothing, so the files of the
//! earlier save stay beside the new ones. Only the listed files are indexed; any other Arrow
//! file in that folder is named unused (never served as data), and a listed file that is
//! missing is an error. A `dataset_dict.json` (a `DatasetDict`, one folder per split) above
//! the files is refused: indexing it would merge its splits, `test` into `train`. A file of
//! those names that is not JSON, or has no `_data_files`, is another tool's: not read.
//!
//! A `load_dataset` cache folder (no `state.json`) holds every split the builder made
//! (`json-train.arrow`, `json-test-00000-of-00002.arrow`, ...) beside a `dataset_info.json`
//! listing them, and the `cache-<fingerprint>.arrow` files `.map()` and `.filter()` write
//! there. Such a cache file (in any folder with a `dataset_info.json`) is named unused, and a
//! folder with the files of two or more of the splits `dataset_info.json` lists is refused:
//! it would merge them into one dataset.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::error::{IndexError, UNUSED_SHOWN};
use crate::mds::{join, parent};
use crate::root::Root;
use crate::walk::{Candidate, Kind, Unused};

/// The file `save_to_disk` writes beside a dataset's Arrow files.
const STATE_FILE: &str = "state.json";
/// The file `DatasetDict.save_to_disk` writes above its splits' folders.
const DICT_FILE: &str = "dataset_dict.json";
/// The file `datasets` writes beside the Arrow files of a dataset it built or saved.
const INFO_FILE: &str = "dataset_info.json";
/// How `datasets` names the files `.map()` and `.filter()` write beside a dataset's Arrow
/// files (`cache-<fingerprint>.arrow`).
const CACHE_PREFIX: &str = "cache-";
/// The reason given for those files.
const CACHE_REASON: &str = "a datasets .map()/.filter() cache file";

/// The file name of the relative path `rel`.
fn base(rel: &str) -> &str {
    rel.rsplit('/').next().unwrap_or(rel)
}

/// Keeps, in `files`, only the Arrow files each `state.json` (among the `unused` files) lists
/// in its folder; moves the others to `unused`, naming the `state.json`; then moves the
/// `.map()`/`.filter()` cache files beside a `dataset_info.json` to `unused`. Refuses a
/// `DatasetDict` of several splits, and a `load_dataset` cache folder of several.
pub(crate) fn plan(
    root: &Root,
    files: &mut Vec<Candidate>,
    unused: &mut Vec<Unused>,
) -> Result<(), IndexError> {
    let listed: &[Unused] = unused;
    let meta: Vec<String> = [DICT_FILE, STATE_FILE, INFO_FILE]
        .into_iter()
        .flat_map(|name| listed.iter().filter(move |u| base(&u.file) == name))
        .map(|u| u.file.clone())
        .collect();
    // Folders whose `state.json` chose the files: its list is the save's, whatever the names.
    let mut saved: Vec<String> = Vec::new();
    for rel in meta {
        let arrow_beside = files
            .iter()
            .any(|f| f.kind == Kind::Arrow && parent(&f.rel) == parent(&rel));
        // A `dataset_info.json` with no Arrow files beside it has none to drop or refuse. A
        // `state.json` is read even then: the files it lists are missing, an error.
        if base(&rel) == INFO_FILE && !arrow_beside {
            continue;
        }
        let Some(json) = read_json(root, &rel)? else {
            continue; // not JSON: another tool's file of that name, not an HF save
        };
        match base(&rel) {
            DICT_FILE => refuse_splits(root, &rel, &json)?,
            STATE_FILE => {
                if let Some(listed) = data_files(root, &rel, &json)? {
                    keep_listed(root, &rel, &listed, files, unused)?;
                    saved.push(parent(&rel).to_owned());
                }
            }
            _ => {
                if !saved.iter().any(|d| d == parent(&rel)) {
                    drop_caches(&rel, files, unused);
                }
                refuse_builder_splits(root, &rel, &json, files)?;
            }
        }
    }
    Ok(())
}

/// Moves the `cache-*.arrow` files beside the `dataset_info.json` `info` to `unused`.
fn drop_caches(info: &str, files: &mut Vec<Candidate>, unused: &mut Vec<Unused>) {
    let dir = parent(info);
    files.retain(|f| {
        let name = base(&f.rel);
        let cache = f.kind == Kind::Arrow
            && parent(&f.rel) == dir
            && name.starts_with(CACHE_PREFIX)
            && name.ends_with(".arrow");
        if cache {
            unused.push(Unused {
                file: f.rel.clone(),
                reason: CACHE_REASON.into(),
            });
        }
        !cache
    });
}

/// The split names a `dataset_info.json` lists (`"splits": {"train": {...}, ...}`; older
/// versions: a list of `{"name": ...}`).
fn info_splits(json: &Value) -> Vec<String> {
    match json.get("splits") {
        Some(Value::Object(m)) => m.keys().cloned().collect(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|s| s.get("name")?.as_str().map(str::to_owned))
            .collect(),
        _ => Vec::new(),
    }
}

/// The split among `splits` of an Arrow file a `datasets` builder wrote: `BUILDER-SPLIT.arrow`
/// or `BUILDER-SPLIT-NNNNN-of-NNNNN.arrow`.
fn file_split<'a>(name: &str, splits: &'a [String]) -> Option<&'a str> {
    let stem = name.strip_suffix(".arrow")?;
    let number = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let mut parts = stem.rsplitn(4, '-');
    let stem = match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some(n), Some("of"), Some(i), Some(rest)) if number(n) && number(i) => rest,
        _ => stem,
    };
    splits
        .iter()
        .find(|s| {
            stem.strip_suffix(s.as_str())
                .is_some_and(|p| p.ends_with('-'))
        })
        .map(String::as_str)
}

/// Refuses the folder of the `dataset_info.json` `info` when its Arrow files belong to two
/// or more of the splits it lists (a `load_dataset` cache: indexing it would merge them).
fn refuse_builder_splits(
    root: &Root,
    info: &str,
    json: &Value,
    files: &[Candidate],
) -> Result<(), IndexError> {
    let splits = info_splits(json);
    let dir = parent(info);
    let mut found: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for f in files
        .iter()
        .filter(|f| f.kind == Kind::Arrow && parent(&f.rel) == dir)
    {
        if let Some(split) = file_split(base(&f.rel), &splits) {
            found.entry(split).or_default().push(base(&f.rel));
        }
    }
    if found.len() < 2 {
        return Ok(());
    }
    let names: Vec<&str> = found.keys().copied().collect();
    let reason = format!(
        "a datasets load_dataset cache folder holding the splits {}: indexing it would merge \
         them into one dataset; index one split: `load_dataset(...)[\"{}\"].save_to_disk(DIR)` \
         and index DIR, or point at a folder holding only that split's files",
        names.join(", "),
        names[0]
    );
    let value: Vec<String> = found
        .iter()
        .map(|(split, files)| format!("{split}: {}", files.join(", ")))
        .collect();
    Err(IndexError::Unsupported {
        file: root.path().join(info),
        reason,
        value: value.join("; "),
    })
}

/// The JSON of the metadata file `rel`; `None` when it is not JSON (then it is not one HF
/// `datasets` wrote, and stays named as unused).
fn read_json(root: &Root, rel: &str) -> Result<Option<Value>, IndexError> {
    let mut src = root.open(rel)?;
    let text = src.read_at(rel, 0, src.len)?;
    Ok(serde_json::from_slice(&text).ok())
}

/// The `_data_files` file names of a `state.json`, or `None` when it has none (not one
/// `save_to_disk` wrote: its folder is indexed as any other).
fn data_files(root: &Root, rel: &str, json: &Value) -> Result<Option<Vec<String>>, IndexError> {
    let Some(list) = json.get("_data_files") else {
        return Ok(None);
    };
    let names = list.as_array().and_then(|a| {
        a.iter()
            .map(|f| f.get("filename")?.as_str().map(str::to_owned))
            .collect::<Option<Vec<_>>>()
    });
    match names {
        Some(n) if n.iter().all(|f| !f.is_empty() && !f.contains('/')) => Ok(Some(n)),
        _ => Err(malformed(
            root,
            rel,
            "`_data_files` is not a list of {\"filename\": NAME} in this folder",
            list,
        )),
    }
}

/// Moves the Arrow files of `state`'s folder that it does not list from `files` to `unused`;
/// an error if a listed one is not there.
fn keep_listed(
    root: &Root,
    state: &str,
    listed: &[String],
    files: &mut Vec<Candidate>,
    unused: &mut Vec<Unused>,
) -> Result<(), IndexError> {
    let dir = parent(state);
    let here = |f: &Candidate| f.kind == Kind::Arrow && parent(&f.rel) == dir;
    let missing: Vec<&str> = listed
        .iter()
        .filter(|name| !files.iter().any(|f| here(f) && f.rel == join(dir, name)))
        .map(String::as_str)
        .collect();
    if let Some(first) = missing.first() {
        let reason = format!(
            "lists {} file(s) that are not in its folder, the first {first} (an interrupted \
             save_to_disk, or a copy without its Arrow files?): save the dataset again, or \
             copy the missing files",
            missing.len()
        );
        let mut named = missing[..missing.len().min(UNUSED_SHOWN)].join(", ");
        if missing.len() > UNUSED_SHOWN {
            named.push_str(&format!(" and {} more", missing.len() - UNUSED_SHOWN));
        }
        return Err(malformed(root, state, &reason, named));
    }
    files.retain(|f| {
        let stale = here(f) && !listed.iter().any(|name| f.rel == join(dir, name));
        if stale {
            unused.push(Unused {
                file: f.rel.clone(),
                reason: format!(
                    "not listed in {state} (left by an earlier save_to_disk into this folder?)"
                ),
            });
        }
        !stale
    });
    Ok(())
}

/// Refuses a `dataset_dict.json` that names several splits.
fn refuse_splits(root: &Root, rel: &str, json: &Value) -> Result<(), IndexError> {
    let splits: Vec<&str> = json
        .get("splits")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if splits.len() < 2 {
        return Ok(());
    }
    let reason = format!(
        "a DatasetDict of the splits {}: indexing it would merge them into one dataset; index one split's folder instead (e.g. {})",
        splits.join(", "),
        root.path().join(join(parent(rel), splits[0])).display()
    );
    Err(malformed(root, rel, &reason, splits.join(",")))
}

fn malformed(root: &Root, rel: &str, reason: &str, value: impl ToString) -> IndexError {
    IndexError::Malformed {
        file: root.path().join(rel),
        reason: reason.to_owned(),
        value: value.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;
    use crate::testutil::temp_dir;

    /// `plan` over a folder of the given files (contents irrelevant but for the JSON ones).
    fn planned(
        name: &str,
        files: &[(&str, &str)],
    ) -> Result<(Vec<String>, Vec<Unused>), IndexError> {
        let dir = temp_dir(name);
        for (rel, text) in files {
            let p = dir.join(rel);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, text).unwrap();
        }
        let root = Root::Local(dir);
        let (mut files, mut unused) = root.collect()?;
        plan(&root, &mut files, &mut unused)?;
        Ok((files.into_iter().map(|f| f.rel).collect(), unused))
    }

    const STATE_2: &str = r#"{"_data_files": [{"filename": "data-00000-of-00002.arrow"},
        {"filename": "data-00001-of-00002.arrow"}], "_fingerprint": "f", "_split": null}"#;

    #[test]
    fn only_the_files_state_json_lists_are_indexed() {
        // A save in 4 shards, then one in 2 into the same folder: load_from_disk reads the 2.
        let files = [
            ("state.json", STATE_2),
            ("dataset_info.json", "{}"),
            ("data-00000-of-00004.arrow", ""),
            ("data-00001-of-00004.arrow", ""),
            ("data-00002-of-00004.arrow", ""),
            ("data-00003-of-00004.arrow", ""),
            ("data-00000-of-00002.arrow", ""),
            ("data-00001-of-00002.arrow", ""),
            ("extra/other.arrow", ""),
        ];
        let (kept, unused) = planned("hf-stale", &files).unwrap();
        assert_eq!(
            kept,
            [
                "data-00000-of-00002.arrow",
                "data-00001-of-00002.arrow",
                "extra/other.arrow"
            ]
        );
        let stale: Vec<_> = unused
            .iter()
            .filter(|u| u.reason.starts_with("not listed in state.json"))
            .map(|u| u.file.as_str())
            .collect();
        assert_eq!(stale.len(), 4, "{unused:?}");
        assert!(
            stale.iter().all(|f| f.ends_with("-of-00004.arrow")),
            "{stale:?}"
        );
    }

    #[test]
    fn a_listed_file_that_is_missing_is_an_error_and_a_state_json_not_json_is_not_read() {
        let e = planned(
            "hf-missing",
            &[("state.json", STATE_2), ("data-00000-of-00002.arrow", "")],
        )
        .unwrap_err();
        assert!(e.to_string().contains("data-00001-of-00002.arrow"), "{e}");
        // Not JSON: another tool's file, not read (the Arrow file beside it is indexed).
        let (kept, _) = planned(
            "hf-bad",
            &[("state.json", "{\"_data_files\": ["), ("a.arrow", "")],
        )
        .unwrap();
        assert_eq!(kept, ["a.arrow"]);
        let e = planned(
            "hf-shape",
            &[
                (
                    "state.json",
                    r#"{"_data_files": [{"filename": "../x.arrow"}]}"#,
                ),
                ("a.arrow", ""),
            ],
        )
        .unwrap_err();
        assert!(e.to_string().contains("_data_files"), "{e}");
    }

    #[test]
    fn a_state_json_whose_files_are_all_missing_is_an_error_naming_them() {
        // Before, a state.json with no Arrow file beside it was not read at all.
        let e = planned(
            "hf-all-missing",
            &[("part/state.json", STATE_2), ("other/a.arrow", "")],
        )
        .unwrap_err();
        assert!(matches!(e, IndexError::Malformed { .. }), "{e:?}");
        let text = e.to_string();
        for want in [
            "part/state.json",
            "2 file(s)",
            "data-00000-of-00002.arrow, data-00001-of-00002.arrow",
        ] {
            assert!(text.contains(want), "{want}: {text}");
        }
        // A save of many shards without its Arrow files: the first ones named, not all.
        let files: Vec<String> = (0..100)
            .map(|i| format!(r#"{{"filename": "data-{i:05}-of-00100.arrow"}}"#))
            .collect();
        let many = format!(r#"{{"_data_files": [{}]}}"#, files.join(","));
        let e = planned(
            "hf-many-missing",
            &[("state.json", &many), ("x/a.arrow", "")],
        )
        .unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("100 file(s)") && text.contains("and 80 more"),
            "{text}"
        );
        assert!(!text.contains("data-00099-of-00100.arrow"), "{text}");
    }

    #[test]
    fn a_state_json_without_data_files_or_arrow_files_beside_it_changes_nothing() {
        let (kept, _) = planned("hf-plain", &[("state.json", "{}"), ("a.arrow", "")]).unwrap();
        assert_eq!(kept, ["a.arrow"]);
        // Not JSON, but no Arrow files of its own: some other tool's state, not read.
        let (kept, _) = planned("hf-other", &[("state.json", "x"), ("d/a.arrow", "")]).unwrap();
        assert_eq!(kept, ["d/a.arrow"]);
    }

    const INFO_2: &str = r#"{"builder_name": "json", "splits": {
        "train": {"name": "train", "num_examples": 3, "dataset_name": "json"},
        "test": {"name": "test", "num_examples": 1, "dataset_name": "json"}}}"#;

    #[test]
    fn a_load_dataset_cache_of_several_splits_is_refused() {
        // Before, every Arrow file was indexed: test merged into train, and the .map()
        // output's rows served twice.
        let cache = [
            ("dataset_info.json", INFO_2),
            ("json-train.arrow", ""),
            ("json-test.arrow", ""),
            ("cache-0123abcd.arrow", ""),
        ];
        let e = planned("hf-cache", &cache).unwrap_err().to_string();
        for want in [
            "test, train",
            "json-test.arrow",
            "json-train.arrow",
            "save_to_disk",
        ] {
            assert!(e.contains(want), "{want}: {e}");
        }
        let sharded = [
            ("dataset_info.json", INFO_2),
            ("parquet-train-00000-of-00002.arrow", ""),
            ("parquet-train-00001-of-00002.arrow", ""),
            ("parquet-test-00000-of-00001.arrow", ""),
        ];
        let e = planned("hf-cache-sharded", &sharded)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("test, train") && e.contains("parquet-train-00001-of-00002.arrow"),
            "{e}"
        );
    }

    #[test]
    fn map_caches_are_unused_and_one_split_or_a_save_is_indexed() {
        // One split's files: indexed; the .map() cache named unused.
        let one = [
            ("dataset_info.json", INFO_2),
            ("json-train.arrow", ""),
            ("cache-0123abcd.arrow", ""),
        ];
        let (kept, unused) = planned("hf-cache-one", &one).unwrap();
        assert_eq!(kept, ["json-train.arrow"]);
        let cache = unused.iter().find(|u| u.file == "cache-0123abcd.arrow");
        assert_eq!(cache.map(|u| u.reason.as_str()), Some(CACHE_REASON));
        // A save_to_disk folder's dataset_info.json lists the builder's splits too: its
        // data-*.arrow files are one split.
        let saved = [
            ("dataset_info.json", INFO_2),
            ("state.json", STATE_2),
            ("data-00000-of-00002.arrow", ""),
            ("data-00001-of-00002.arrow", ""),
        ];
        assert_eq!(
            planned("hf-saved-info", &saved).unwrap().0,
            ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
        );
        // A save whose state.json lists a file named like a cache (old `save_to_disk` copies
        // kept `.map()` outputs' names): the list is the save's, the file is data.
        let listed = [
            ("dataset_info.json", INFO_2),
            (
                "state.json",
                r#"{"_data_files": [{"filename": "cache-0123abcd.arrow"}]}"#,
            ),
            ("cache-0123abcd.arrow", ""),
        ];
        assert_eq!(
            planned("hf-saved-cache", &listed).unwrap().0,
            ["cache-0123abcd.arrow"]
        );
    }

    #[test]
    fn a_dataset_dict_of_several_splits_is_refused_naming_one_split() {
        let dict = r#"{"splits": ["train", "test"]}"#;
        let state = r#"{"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}"#;
        let files = [
            ("dataset_dict.json", dict),
            ("train/state.json", state),
            ("train/data-00000-of-00001.arrow", ""),
            ("test/state.json", state),
            ("test/data-00000-of-00001.arrow", ""),
        ];
        let e = planned("hf-dict", &files).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("train, test") && text.contains("hf-dict/train"),
            "{text}"
        );
        // One split: nothing to merge.
        let one = [
            ("dataset_dict.json", r#"{"splits": ["train"]}"#),
            files[1],
            files[2],
        ];
        assert_eq!(
            planned("hf-dict1", &one).unwrap().0,
            ["train/data-00000-of-00001.arrow"]
        );
    }
}
