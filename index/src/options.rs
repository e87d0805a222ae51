//! Options that act on some formats only: `--columns` and `--skip-unsupported` on Arrow and
//! Parquet files, `--tokens` (and `--eos`) on the `.bin` files that are not half of a
//! Megatron pair. Given for a dataset with no such file, `--columns` and `--tokens` would
//! change nothing, and the dataset would be served as if they had not been given (every
//! WebDataset field, every MDS column; Megatron sequences without `--eos` documents): they
//! are refused, before any data is read ([`IndexError::UnusedOption`]). Where they act on
//! some of the data files only, or `--skip-unsupported` has nothing to skip, a note says so
//! ([`crate::IndexReport::notes`]).

use std::path::Path;

use crate::IndexOptions;
use crate::error::IndexError;
use crate::megatron;
use crate::walk::{Candidate, Kind};

/// The notes on the options of `opts` that act on some of `files` only (the data files of
/// the dataset at `dir`, Megatron `.bin` files among them as `megatron` says); an error for
/// an option that acts on none. Nothing when there is no data file at all: the error for
/// that names the files not used.
pub(crate) fn check(
    dir: &Path,
    files: &[Candidate],
    megatron: &megatron::Plan,
    opts: &IndexOptions,
) -> Result<Vec<String>, IndexError> {
    if files.is_empty() {
        return Ok(Vec::new());
    }
    let is_arrow = |f: &Candidate| matches!(f.kind, Kind::Arrow | Kind::Parquet);
    let is_raw_bin = |f: &Candidate| f.kind == Kind::Bin && !megatron.contains_key(&f.rel);
    let name_of = |f: &Candidate| label(f, megatron);
    let mut notes = Vec::new();
    let arrow = files.iter().filter(|&f| is_arrow(f)).count();
    if opts.columns.is_some() {
        let others: Vec<&Candidate> = files.iter().filter(|&f| !is_arrow(f)).collect();
        if arrow == 0 {
            return Err(IndexError::UnusedOption {
                dir: dir.to_path_buf(),
                option: "--columns".into(),
                reason: "it selects the columns of Arrow and Parquet files, and the dataset has \
                         none"
                    .into(),
                found: found(files.iter(), name_of),
                fix: "drop --columns: every WebDataset field, MDS column and .npy/.bin file is \
                      served; to serve fewer fields, write the dataset without the others"
                    .into(),
            });
        }
        if !others.is_empty() {
            notes.push(format!(
                "--columns: applied to the {arrow} Arrow/Parquet files only; the other data \
                 files are served whole ({})",
                found(others.into_iter(), name_of)
            ));
        }
    }
    if opts.skip_unsupported && arrow == 0 {
        notes.push("--skip-unsupported: no Arrow or Parquet file, so no column to skip".into());
    }
    if let Some(t) = opts.tokens {
        let option = if t.eos.is_some() {
            "--tokens and --eos"
        } else {
            "--tokens"
        };
        let raw = files.iter().filter(|&f| is_raw_bin(f)).count();
        if raw == 0 {
            return Err(IndexError::UnusedOption {
                dir: dir.to_path_buf(),
                option: option.into(),
                reason: "it reads .bin files that are not half of a Megatron .bin/.idx pair as \
                         raw tokens, and the dataset has none"
                    .into(),
                found: found(files.iter(), name_of),
                fix: format!(
                    "drop {option}: a Megatron pair is read as token sequences from its .idx, \
                     other formats as they are"
                ),
            });
        }
        let megatron_bins = files
            .iter()
            .filter(|&f| f.kind == Kind::Bin && !is_raw_bin(f))
            .count();
        if megatron_bins > 0 {
            notes.push(format!(
                "{option}: applied to the {raw} raw .bin files only; the {megatron_bins} \
                 Megatron .bin files are read as the sequences their .idx gives"
            ));
        }
    }
    Ok(notes)
}

/// What a data file is, for messages: `Arrow`, `WebDataset .tar`, `Megatron .bin/.idx`, ...
fn label(f: &Candidate, megatron: &megatron::Plan) -> &'static str {
    match f.kind {
        Kind::Arrow => "Arrow",
        Kind::Parquet => "Parquet",
        Kind::Npy => ".npy",
        Kind::Bin if megatron.contains_key(&f.rel) => "Megatron .bin/.idx",
        Kind::Bin => ".bin",
        Kind::Tar => "WebDataset .tar",
        Kind::CompressedTar => "compressed tar",
        Kind::Mds => "MDS .mds",
        Kind::MdsIndex => "MDS index.json",
        Kind::MegatronIdx => "Megatron .idx",
    }
}

/// `3 WebDataset .tar, 1 .npy`: how many `files` of each label, in order of first seen.
fn found<'a>(
    files: impl Iterator<Item = &'a Candidate>,
    label: impl Fn(&Candidate) -> &'static str,
) -> String {
    let mut counts: Vec<(&'static str, usize)> = Vec::new();
    for f in files {
        let l = label(f);
        match counts.iter_mut().find(|(k, _)| *k == l) {
            Some((_, n)) => *n += 1,
            None => counts.push((l, 1)),
        }
    }
    if counts.is_empty() {
        return "no data files".into();
    }
    let parts: Vec<String> = counts.iter().map(|(l, n)| format!("{n} {l}")).collect();
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::{ArrayRef, Int64Array, RecordBatch};
    use arrow_ipc::writer::FileWriter;
    use shardwire_protocol::manifest::DType;

    use crate::testutil::temp_dir;
    use crate::{IndexError, IndexOptions, RawTokens, index_report};

    fn opts(columns: bool, skip: bool, eos: Option<u64>) -> IndexOptions {
        IndexOptions {
            columns: columns.then(|| vec!["jpg".to_owned()]),
            skip_unsupported: skip,
            tokens: eos.map(|e| RawTokens::new(DType::Uint16, Some(e)).unwrap()),
            ..IndexOptions::default()
        }
    }

    #[test]
    fn columns_and_tokens_that_act_on_no_file_are_refused_before_reading() {
        // Before, `--columns` on a folder with no Arrow file (and `--tokens --eos` with no
        // raw .bin) was ignored: every field served, exit 0, no word.
        let dir = temp_dir("options-none");
        // Not a tar: refused if it were read, so the error below is from before reading.
        std::fs::write(dir.join("s.tar"), b"not a tar").unwrap();
        std::fs::write(dir.join("a.npy"), b"not an npy").unwrap();
        let e = index_report(&dir, &opts(true, false, None)).unwrap_err();
        assert!(matches!(&e, IndexError::UnusedOption { option, .. } if option == "--columns"));
        let text = e.to_string();
        for want in [
            "--columns would change nothing",
            "1 .npy, 1 WebDataset .tar",
        ] {
            assert!(text.contains(want), "{want}: {text}");
        }
        let e = index_report(&dir, &opts(false, false, Some(0))).unwrap_err();
        let text = e.to_string();
        for want in [
            "--tokens and --eos would change nothing",
            "drop --tokens and --eos",
        ] {
            assert!(text.contains(want), "{want}: {text}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn options_that_act_on_some_files_only_are_named_in_notes() {
        // Before, nothing said that --columns left the .bin whole, nor that
        // --skip-unsupported had nothing to skip.
        let dir = temp_dir("options-some");
        std::fs::write(dir.join("raw.bin"), [0u8, 1, 2, 0]).unwrap();
        let r = index_report(&dir, &opts(false, true, Some(0))).unwrap();
        let notes = r.notes().join("\n");
        assert!(
            notes.contains("--skip-unsupported: no Arrow or Parquet file"),
            "{notes}"
        );
        assert!(!notes.contains("--tokens"), "{notes}");
        let ids: ArrayRef = Arc::new(Int64Array::from(vec![1i64, 2]));
        let batch = RecordBatch::try_from_iter([("jpg", ids)]).unwrap();
        let file = std::fs::File::create(dir.join("a.arrow")).unwrap();
        let mut w = FileWriter::try_new(file, &batch.schema()).unwrap();
        w.write(&batch).unwrap();
        w.finish().unwrap();
        let r = index_report(&dir, &opts(true, false, None)).unwrap();
        let notes = r.notes().join("\n");
        assert!(
            notes.contains(
                "--columns: applied to the 1 Arrow/Parquet files only; the other data files \
                 are served whole (1 .bin)"
            ),
            "{notes}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
