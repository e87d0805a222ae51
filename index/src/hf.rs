//! HF `datasets` folders written by `save_to_disk`. Their `state.json` lists the folder's
//! Arrow files (`_data_files`), and those are all `load_from_disk` reads: a later
//! `save_to_disk` into the same folder with fewer shards deletes nothing, so the files of the
//! earlier save stay beside the new ones. Only the listed files are indexed; any other Arrow
//! file in that folder is named unused (never served as data), and a listed file that is
//! missing is an error. A `dataset_dict.json` (a `DatasetDict`, one folder per split) above
//! the files is refused: indexing it would merge its splits, `test` into `train`. A file of
//! those names that is not JSON, or has no `_data_files`, is another tool's: not read.

use serde_json::Value;

use crate::error::IndexError;
use crate::mds::{join, parent};
use crate::root::Root;
use crate::walk::{Candidate, Kind, Unused};

/// The file `save_to_disk` writes beside a dataset's Arrow files.
const STATE_FILE: &str = "state.json";
/// The file `DatasetDict.save_to_disk` writes above its splits' folders.
const DICT_FILE: &str = "dataset_dict.json";

/// Keeps, in `files`, only the Arrow files each `state.json` (among the `unused` files) lists
/// in its folder; moves the others to `unused`, naming the `state.json`. Refuses a
/// `DatasetDict` of several splits.
pub(crate) fn plan(
    root: &Root,
    files: &mut Vec<Candidate>,
    unused: &mut Vec<Unused>,
) -> Result<(), IndexError> {
    let meta: Vec<String> = unused
        .iter()
        .filter(|u| u.file.rsplit('/').next() == Some(DICT_FILE))
        .chain(
            unused
                .iter()
                .filter(|u| u.file.rsplit('/').next() == Some(STATE_FILE)),
        )
        .map(|u| u.file.clone())
        .collect();
    for rel in meta {
        let arrow_beside = files
            .iter()
            .any(|f| f.kind == Kind::Arrow && parent(&f.rel) == parent(&rel));
        if rel.ends_with(STATE_FILE) && !arrow_beside {
            continue; // no Arrow files of its own to choose among
        }
        let Some(json) = read_json(root, &rel)? else {
            continue; // not JSON: another tool's file of that name, not an HF save
        };
        if rel.ends_with(DICT_FILE) {
            refuse_splits(root, &rel, &json)?;
        } else if let Some(listed) = data_files(root, &rel, &json)? {
            keep_listed(root, &rel, &listed, files, unused)?;
        }
    }
    Ok(())
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
    if let Some(missing) = listed
        .iter()
        .find(|name| !files.iter().any(|f| here(f) && f.rel == join(dir, name)))
    {
        let reason = format!(
            "lists {missing}, which is not in its folder (an interrupted save_to_disk?): save the dataset again"
        );
        return Err(malformed(root, state, &reason, missing));
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
    fn a_state_json_without_data_files_or_arrow_files_beside_it_changes_nothing() {
        let (kept, _) = planned("hf-plain", &[("state.json", "{}"), ("a.arrow", "")]).unwrap();
        assert_eq!(kept, ["a.arrow"]);
        // Not JSON, but no Arrow files of its own: some other tool's state, not read.
        let (kept, _) = planned("hf-other", &[("state.json", "x"), ("d/a.arrow", "")]).unwrap();
        assert_eq!(kept, ["d/a.arrow"]);
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
