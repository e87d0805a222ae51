//! Refuses a dataset whose data files belong to different splits by name: nanoGPT's
//! `prepare.py` writes `train.bin` and `val.bin` into one folder, and WebDataset, MDS and
//! Parquet datasets come as `train-*.tar` beside `val-*.tar`, or `train/` beside `val/`.
//! Indexed together they would be one dataset, the held-out rows trained on, without a word
//! (`hf.rs` refuses the same for HF `datasets` folders, from the split lists they carry).
//!
//! A file's split is named by the word of its relative path nearest its name (the path cut
//! at every character that is not a letter or digit: `/`, `-`, `_`, `.`, and `=` of Hive
//! partitions such as `split=train/`) that is a split's word, ignoring case and trailing
//! digits (`train2017/`, `val0.bin`): `code_eval/train.bin` is training data. Only two or
//! more different splits are refused: one split, or names that mark none, are indexed as
//! before; `allow_mixed_splits` (`--allow-mixed-splits`) indexes them together when the
//! words mislead.

use std::collections::BTreeMap;
use std::path::Path;

use crate::error::IndexError;
use crate::mds::parent;
use crate::walk::Candidate;

/// Each split, and the words that name it. Whole words only, not prefixes: `values.npy`,
/// `trainer_state.bin` and `testament.txt` name no split.
const SPLITS: [(&str, &[&str]); 4] = [
    ("train", &["train", "training"]),
    ("val", &["val", "valid", "validation"]),
    ("test", &["test", "testing"]),
    ("eval", &["eval", "evaluation"]),
];

/// The split (an index into [`SPLITS`]) the relative path `rel` is named for, if any.
fn split_of(rel: &str) -> Option<usize> {
    rel.rsplit(|c: char| !c.is_ascii_alphanumeric())
        .find_map(|word| {
            let word = word
                .trim_end_matches(|c: char| c.is_ascii_digit())
                .to_ascii_lowercase();
            SPLITS
                .iter()
                .position(|(_, words)| words.contains(&word.as_str()))
        })
}

/// Refuses `files` (of the dataset at `dir`) when they are named for two or more splits,
/// naming each split's files and how to index one.
pub(crate) fn refuse_mixed(dir: &Path, files: &[Candidate]) -> Result<(), IndexError> {
    let mut found: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    for f in files {
        if let Some(split) = split_of(&f.rel) {
            found.entry(split).or_default().push(f.rel.clone());
        }
    }
    if found.len() < 2 {
        return Ok(());
    }
    let splits: Vec<(String, Vec<String>)> = found
        .into_iter()
        .map(|(i, files)| (SPLITS[i].0.to_owned(), files))
        .collect();
    let fix = fix(dir, &splits);
    Err(IndexError::MixedSplits {
        dir: dir.to_path_buf(),
        splits,
        fix,
    })
}

/// How to index the first split: its own folder where one holds its files and no other
/// split's (`DIR/train`), else a folder made for it (the CLI has no option to pick files);
/// and how to index them together where the names mislead.
fn fix(dir: &Path, splits: &[(String, Vec<String>)]) -> String {
    format!(
        "{}; if the names mislead and these files are one dataset, index them with \
         --allow-mixed-splits",
        one_split(dir, splits)
    )
}

/// How to index the first split alone.
fn one_split(dir: &Path, splits: &[(String, Vec<String>)]) -> String {
    let (name, files) = &splits[0];
    let own = common_folder(files).filter(|d| {
        let inside = format!("{d}/");
        let mut others = splits[1..].iter().flat_map(|(_, f)| f);
        others.all(|f| !f.starts_with(&inside))
    });
    match own {
        Some(d) => format!(
            "index one split's folder instead, e.g. {}",
            dir.join(d).display()
        ),
        None => format!(
            "index one split at a time: put the {name} files in a folder of their own (in \
             object storage: under a prefix of their own; on a local disk a folder of \
             symbolic links to them will do) and index that folder"
        ),
    }
}

/// The deepest folder (relative, '/'-separated) holding all of `files`; `None` at the top.
fn common_folder(files: &[String]) -> Option<String> {
    let mut common: Vec<&str> = parent(files.first()?).split('/').collect();
    for f in files {
        let same = common
            .iter()
            .zip(parent(f).split('/'))
            .take_while(|(a, b)| **a == *b)
            .count();
        common.truncate(same);
    }
    let folder = common.join("/");
    (!folder.is_empty()).then_some(folder)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::temp_dir;
    use crate::{IndexOptions, index_dir};

    #[test]
    fn split_words_are_whole_words_of_the_path() {
        let name = |rel: &str| split_of(rel).map(|i| SPLITS[i].0);
        assert_eq!(name("train.bin"), Some("train"));
        assert_eq!(name("data/Validation-00001.tar"), Some("val"));
        assert_eq!(name("val2017/x.npy"), Some("val"));
        assert_eq!(name("test_0.arrow"), Some("test"));
        // The word nearest the name: a source folder's name does not decide the split.
        assert_eq!(name("code_eval/train.bin"), Some("train"));
        assert_eq!(name("train/shard-0.tar"), Some("train"));
        // Hive partitions (pyarrow write_to_dataset, Spark partitionBy) and spaces.
        assert_eq!(name("split=test/part-0.parquet"), Some("test"));
        assert_eq!(name("my data/valid set.npy"), Some("val"));
        for none in [
            "values.npy",
            "trainer_state.bin",
            "interval.npy",
            "a/b.tar",
            "contest/latest.bin",
            "retrain/protest.bin",
        ] {
            assert_eq!(name(none), None, "{none}");
        }
    }

    #[test]
    fn train_and_val_side_by_side_are_refused_naming_both_and_the_fix() {
        // nanoGPT's prepare.py: before, both were indexed as one dataset without a word.
        let dir = temp_dir("split-nanogpt");
        std::fs::write(dir.join("train.bin"), [0u8; 8]).unwrap();
        std::fs::write(dir.join("val.bin"), [0u8; 4]).unwrap();
        let e = index_dir(&dir, &IndexOptions::default()).unwrap_err();
        assert!(matches!(e, IndexError::MixedSplits { .. }), "{e:?}");
        let text = e.to_string();
        for want in [
            "train, val",
            "train: train.bin",
            "val: val.bin",
            "merge",
            "folder of their own",
            "--allow-mixed-splits",
        ] {
            assert!(text.contains(want), "{want}: {text}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn split_folders_are_refused_naming_one_to_index_and_one_split_is_indexed() {
        let folders = temp_dir("split-folders");
        for f in ["train/shard-0.tar", "train/shard-1.tar", "test/shard-0.tar"] {
            std::fs::create_dir_all(folders.join(parent(f))).unwrap();
            std::fs::write(folders.join(f), b"").unwrap();
        }
        let text = index_dir(&folders, &IndexOptions::default())
            .unwrap_err()
            .to_string();
        let want = folders.join("train").display().to_string();
        assert!(
            text.contains("train, test") && text.contains(&want),
            "{text}"
        );
        std::fs::remove_dir_all(&folders).unwrap();
        // One split (`train-*.bin`) beside files that name none: indexed.
        let dir = temp_dir("split-one");
        for f in ["train-0.bin", "train-1.bin", "values.bin"] {
            std::fs::write(dir.join(f), [1u8; 4]).unwrap();
        }
        let m = index_dir(&dir, &IndexOptions::default()).unwrap();
        assert_eq!(m.shards.len(), 3);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn hive_split_partitions_are_refused_and_the_override_indexes_them_together() {
        let dir = temp_dir("split-hive");
        for f in ["split=train/a.bin", "split=test/a.bin"] {
            std::fs::create_dir_all(dir.join(parent(f))).unwrap();
            std::fs::write(dir.join(f), [1u8; 4]).unwrap();
        }
        let e = index_dir(&dir, &IndexOptions::default()).unwrap_err();
        assert!(matches!(e, IndexError::MixedSplits { .. }), "{e:?}");
        let opts = IndexOptions {
            allow_mixed_splits: true,
            ..IndexOptions::default()
        };
        assert_eq!(index_dir(&dir, &opts).unwrap().shards.len(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
