//! Tests of the WebDataset indexer, on tars written by the `tar` crate's `Builder`.

use std::path::Path;

use shardwire_protocol::manifest::{DType, Manifest, TensorEntry};

use super::split_name;
use crate::testutil::{check_manifest, temp_dir};
use crate::{IndexError, IndexOptions, index_dir, index_report};

/// A tar of `(name, data)` regular-file members, in order.
fn tar_of(members: &[(&str, Vec<u8>)]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, data) in members {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, name, data.as_slice()).unwrap();
    }
    b.into_inner().unwrap()
}

/// A `.npy` 1.0 image, as numpy writes it.
fn npy(descr: &str, shape: &str, data: &[u8]) -> Vec<u8> {
    let mut dict = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    while (10 + dict.len() + 1) % 64 != 0 {
        dict.push(' ');
    }
    dict.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend((dict.len() as u16).to_le_bytes());
    out.extend(dict.as_bytes());
    out.extend(data);
    out
}

/// The bytes a row-table tensor delivers: its rows, concatenated.
fn gather(file: &[u8], shard_offset: u64, t: &TensorEntry) -> Vec<u8> {
    let rows = t.rows.as_ref().expect("a row table");
    rows.iter()
        .flat_map(|&[o, l]| {
            let a = (shard_offset + o) as usize;
            file[a..a + l as usize].to_vec()
        })
        .collect()
}

fn tensor<'m>(m: &'m Manifest, name: &str) -> &'m TensorEntry {
    let found = m.shards[0].tensors.iter().find(|t| t.name == name);
    found.unwrap_or_else(|| panic!("no tensor `{name}` in {:?}", m.shards[0].tensors))
}

fn index_err(dir: &Path) -> String {
    index_dir(dir, &IndexOptions::default())
        .unwrap_err()
        .to_string()
}

#[test]
fn npy_fields_are_typed_and_the_rest_ragged() {
    let dir = temp_dir("wds-basic");
    let mut members = Vec::new();
    let (mut img, mut cls, mut txt) = (Vec::<u8>::new(), Vec::new(), Vec::new());
    for i in 0..3u8 {
        let data: Vec<u8> = (0..24).map(|j| i * 24 + j).collect();
        let t = "x".repeat(i as usize * 7 + 1).into_bytes();
        members.push((format!("s{i:03}.img.npy"), npy("<f4", "(2, 3)", &data)));
        members.push((format!("s{i:03}.cls"), vec![b'0' + i]));
        members.push((format!("s{i:03}.txt"), t.clone()));
        img.extend(&data);
        cls.push(b'0' + i);
        txt.extend(t);
    }
    let members: Vec<(&str, Vec<u8>)> = members
        .iter()
        .map(|(n, d)| (n.as_str(), d.clone()))
        .collect();
    let bytes = tar_of(&members);
    std::fs::write(dir.join("shard-0.tar"), &bytes).unwrap();
    let m = index_dir(&dir, &IndexOptions::default()).unwrap();
    check_manifest(&dir, &m, &[]);
    let s = &m.shards[0];
    assert_eq!(
        (s.file.as_str(), s.offset, s.length),
        ("shard-0.tar", 0, bytes.len() as u64)
    );
    let names: Vec<&str> = s.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        ["cls", "img.npy", "txt"],
        "by name, as TarWriter orders them"
    );
    let t = tensor(&m, "img.npy");
    assert_eq!(
        (t.dtype, t.shape.as_slice(), t.ragged),
        (DType::Float32, &[3u64, 2, 3][..], false)
    );
    assert_eq!(gather(&bytes, 0, t), img);
    for (name, want) in [("cls", cls), ("txt", txt)] {
        let t = tensor(&m, name);
        assert_eq!(
            (t.dtype, t.ragged, t.shape.clone()),
            (DType::Uint8, true, vec![want.len() as u64])
        );
        assert_eq!(gather(&bytes, 0, t), want, "{name}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn mixed_npy_shapes_or_dtypes_are_ragged_raw_bytes() {
    let dir = temp_dir("wds-mixed");
    let a = npy("<f4", "(2,)", &[1u8; 8]);
    let b = npy("<f4", "(3,)", &[2u8; 12]);
    let c = npy("<i4", "(2,)", &[3u8; 8]);
    let d = b"not an npy".to_vec();
    let shape = tar_of(&[("0.npy", a.clone()), ("1.npy", b.clone())]);
    let dtype = tar_of(&[("0.npy", a.clone()), ("1.npy", c.clone())]);
    let junk = tar_of(&[("0.npy", a.clone()), ("1.npy", d.clone())]);
    for (name, bytes, want) in [
        ("shape.tar", &shape, [a.clone(), b].concat()),
        ("dtype.tar", &dtype, [a.clone(), c].concat()),
        ("junk.tar", &junk, [a.clone(), d].concat()),
    ] {
        let sub = dir.join(name.trim_end_matches(".tar"));
        std::fs::create_dir_all(&sub).unwrap();
        std::fs::write(sub.join(name), bytes).unwrap();
        let m = index_dir(&sub, &IndexOptions::default()).unwrap();
        let t = tensor(&m, "npy");
        assert!(t.ragged && t.dtype == DType::Uint8, "{name}: {t:?}");
        assert_eq!(gather(bytes, 0, t), want, "{name}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn samples_must_share_their_fields() {
    let dir = temp_dir("wds-fields");
    let x = || b"x".to_vec();
    let missing = tar_of(&[("a.cls", x()), ("a.txt", x()), ("b.cls", x())]);
    std::fs::write(dir.join("m.tar"), missing).unwrap();
    let err = index_err(&dir);
    assert!(
        err.contains("m.tar") && err.contains("sample `b`") && err.contains("lacks field `txt`"),
        "{err}"
    );
    std::fs::remove_file(dir.join("m.tar")).unwrap();
    let extra = tar_of(&[("a.cls", x()), ("b.cls", x()), ("b.json", x())]);
    std::fs::write(dir.join("e.tar"), extra).unwrap();
    let err = index_dir(&dir, &IndexOptions::default()).unwrap_err();
    assert!(
        matches!(&err, IndexError::Sample { key, .. } if key == "b"),
        "{err}"
    );
    let err = err.to_string();
    assert!(
        err.contains("e.tar") && err.contains("has field `json`"),
        "{err}"
    );
    std::fs::remove_file(dir.join("e.tar")).unwrap();
    let dup = tar_of(&[("a.cls", x()), ("a.CLS", x())]);
    std::fs::write(dir.join("d.tar"), dup).unwrap();
    let err = index_err(&dir);
    assert!(
        err.contains("duplicate field") && err.contains("cls"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn empty_tar_holds_no_rows() {
    let dir = temp_dir("wds-empty");
    std::fs::write(dir.join("e.tar"), tar_of(&[])).unwrap();
    let err = index_dir(&dir, &IndexOptions::default()).unwrap_err();
    assert!(
        matches!(err, IndexError::NoUsableFiles { found: 1, .. }),
        "{err}"
    );
    std::fs::write(dir.join("b.bin"), [1u8, 2]).unwrap();
    let r = index_report(&dir, &IndexOptions::default()).unwrap();
    assert_eq!(r.unused.len(), 1);
    assert_eq!(
        (r.unused[0].file.as_str(), r.unused[0].reason.as_str()),
        ("e.tar", "holds no rows")
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn names_split_like_webdataset() {
    // Checked against webdataset.tariterators.base_plus_ext.
    let cases = [
        ("a/b/000123.img.npy", Some(("a/b/000123", "img.npy"))),
        ("000.cls", Some(("000", "cls"))),
        ("dir.v2/000.seg.png", Some(("dir.v2/000", "seg.png"))),
        ("a/.x", Some(("a/", "x"))),
        ("a.b/c/.x", Some(("a.b/c/", "x"))),
        ("a.b/.x", None),
        ("noext", None),
        ("a.b/noext", None),
        (".hidden", None),
    ];
    for (name, want) in cases {
        assert_eq!(split_name(name), want, "{name}");
    }
}

#[test]
fn keys_with_dirs_long_names_and_meta_members() {
    let dir = temp_dir("wds-keys");
    let long = format!("{}/k1", "d".repeat(120));
    let m1 = format!("{long}.Seg.PNG");
    let m2 = format!("{long}.json");
    let bytes = tar_of(&[
        ("__meta__", b"skipped".to_vec()),
        ("a.b/k0.seg.png", b"p0".to_vec()),
        ("a.b/k0.json", b"j0".to_vec()),
        ("README", b"no split, skipped".to_vec()),
        (&m1, b"p1!".to_vec()),
        (&m2, b"j1".to_vec()),
    ]);
    std::fs::write(dir.join("k.tar"), &bytes).unwrap();
    let m = index_dir(&dir, &IndexOptions::default()).unwrap();
    check_manifest(&dir, &m, &[]);
    assert_eq!(gather(&bytes, 0, tensor(&m, "seg.png")), b"p0p1!");
    assert_eq!(gather(&bytes, 0, tensor(&m, "json")), b"j0j1");
    assert_eq!(m.shards[0].tensors.len(), 2);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn gzip_and_garbage_are_refused() {
    let dir = temp_dir("wds-gz");
    std::fs::write(dir.join("d.tar.gz"), b"\x1f\x8b junk").unwrap();
    let err = index_err(&dir);
    assert!(
        err.contains("d.tar.gz") && err.contains("byte range") && err.contains("gunzip"),
        "{err}"
    );
    std::fs::remove_file(dir.join("d.tar.gz")).unwrap();
    std::fs::write(dir.join("g.tar"), [7u8; 1024]).unwrap();
    let err = index_dir(&dir, &IndexOptions::default()).unwrap_err();
    assert!(matches!(err, IndexError::Malformed { .. }), "{err}");
    assert!(err.to_string().contains("g.tar"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn npy_fields_take_one_form_over_the_dataset() {
    let dir = temp_dir("wds-harmonize");
    let a = npy("<f4", "(2,)", &[1u8; 8]);
    let b = npy("<f4", "(3,)", &[2u8; 12]);
    let one = tar_of(&[("0.img.npy", a.clone()), ("1.img.npy", a.clone())]);
    let two = tar_of(&[("2.img.npy", b.clone()), ("3.img.npy", b.clone())]);
    std::fs::write(dir.join("1.tar"), &one).unwrap();
    std::fs::write(dir.join("2.tar"), &two).unwrap();
    let m = index_dir(&dir, &IndexOptions::default()).unwrap();
    check_manifest(&dir, &m, &[]);
    for (s, bytes, want) in [(0, &one, [a.clone(), a.clone()]), (1, &two, [b.clone(), b])] {
        let t = &m.shards[s].tensors[0];
        assert!(t.ragged && t.dtype == DType::Uint8, "shard {s}: {t:?}");
        assert_eq!(gather(bytes, 0, t), want.concat(), "shard {s}");
    }
    std::fs::write(dir.join("2.tar"), &one).unwrap();
    let m = index_dir(&dir, &IndexOptions::default()).unwrap();
    for s in &m.shards {
        let t = &s.tensors[0];
        assert_eq!(
            (t.ragged, t.dtype, t.shape.as_slice()),
            (false, DType::Float32, &[2u64, 2][..])
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_member_with_an_empty_field_name_is_refused_naming_it() {
    let dir = temp_dir("wds-empty-field");
    let bytes = tar_of(&[("0001.txt", b"a".to_vec()), ("0001.", b"b".to_vec())]);
    std::fs::write(dir.join("e.tar"), &bytes).unwrap();
    // Before, it became a tensor named "" (with offsets named `.offsets`).
    let err = index_err(&dir);
    assert!(
        err.contains("e.tar")
            && err.contains("sample `0001`")
            && err.contains("field")
            && err.contains("(found: 0001.)"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_field_that_clashes_with_another_fields_offsets_is_refused_naming_the_file() {
    let dir = temp_dir("wds-offsets-clash");
    let bytes = tar_of(&[
        ("0001.txt", b"ab".to_vec()),
        ("0001.txt.offsets", b"cd".to_vec()),
        ("0002.txt", b"e".to_vec()),
        ("0002.txt.offsets", b"f".to_vec()),
    ]);
    std::fs::write(dir.join("c.tar"), &bytes).unwrap();
    // Before: "internal error, the built manifest is invalid".
    let err = index_err(&dir);
    assert!(
        err.contains("c.tar")
            && err.contains("two tensors are named `txt.offsets`")
            && !err.contains("internal"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A blob whose reads fail as a GET does after its retries.
struct Unreachable;

impl crate::blob::Blob for Unreachable {
    fn read_at(&mut self, _: u64, _: &mut [u8]) -> Result<(), IndexError> {
        Err(IndexError::Store(
            shardwire_store::StoreError::Unavailable {
                bucket: "b".into(),
                key: "ds/0.tar".into(),
                range: Some(0..10),
                reason: "connection reset".into(),
            },
        ))
    }

    fn crc32c(&mut self, _: &[(u64, u64)]) -> Result<Vec<u32>, IndexError> {
        unreachable!("not checksummed")
    }
}

#[test]
fn a_failed_read_of_an_npy_member_is_an_error_not_raw_bytes() {
    // Before, every error but a local I/O one made the field raw uint8 (and, harmonised,
    // raw in every tar): a GET that failed changed the manifest's dtype.
    let mut src = crate::source::Source::new(
        "s3://b/ds/0.tar".into(),
        "0.tar",
        4096,
        Box::new(Unreachable),
    );
    let got = super::npy_tensor(&mut src, "img", &[[512, 128]]);
    assert!(matches!(got, Err(IndexError::Store(_))), "{got:?}");
}

#[test]
fn a_tar_cut_short_after_a_member_is_refused_not_read_as_fewer_samples() {
    // Three 1-byte members: headers at 0, 1024 and 2048, each member's data in the block
    // after its header. Cut at 2048 (right before the third header) or inside the padding
    // after the second member, the tar reader ends quietly with two samples.
    let dir = temp_dir("wds-cut");
    let members = [
        ("000.cls", vec![b'a']),
        ("001.cls", vec![b'b']),
        ("002.cls", vec![b'c']),
    ];
    let whole = tar_of(&members);
    for cut in [2048, 1600, 2048 + 512 + 1] {
        std::fs::write(dir.join("s.tar"), &whole[..cut]).unwrap();
        let e = index_err(&dir);
        assert!(
            e.contains("s.tar") && e.contains("cut short"),
            "cut at {cut}: {e}"
        );
    }
    // A header damaged where the third member's is: refused too, naming the file.
    let mut damaged = whole[..2048].to_vec();
    damaged.extend([7u8; 1024]);
    std::fs::write(dir.join("s.tar"), &damaged).unwrap();
    assert!(index_err(&dir).contains("s.tar"));
    std::fs::write(dir.join("s.tar"), &whole).unwrap();
    assert_eq!(
        index_dir(&dir, &IndexOptions::default()).unwrap().shards[0].tensors[0].shape,
        [3]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_pax_sparse_member_is_refused_not_served_as_its_encoded_bytes() {
    // `tar --sparse --format=posix`: a regular member named `GNUSparseFile.N/NAME` whose data
    // is the sparse map and chunks, its real name in PAX records. Before, its encoded bytes
    // were served under the key `GNUSparseFile.0/000`.
    let dir = temp_dir("wds-pax-sparse");
    let mut b = tar::Builder::new(Vec::new());
    let records: [(&str, &[u8]); 4] = [
        ("GNU.sparse.major", b"1"),
        ("GNU.sparse.minor", b"0"),
        ("GNU.sparse.name", b"000.npy"),
        ("GNU.sparse.realsize", b"4096"),
    ];
    b.append_pax_extensions(records).unwrap();
    let data = b"1\n0\n512\n".to_vec();
    let mut h = tar::Header::new_ustar();
    h.set_size(data.len() as u64);
    h.set_mode(0o644);
    h.set_cksum();
    b.append_data(&mut h, "GNUSparseFile.0/000.npy", data.as_slice())
        .unwrap();
    std::fs::write(dir.join("s.tar"), b.into_inner().unwrap()).unwrap();
    let e = index_err(&dir);
    assert!(e.contains("s.tar") && e.contains("sparse"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_tar_with_another_after_its_end_blocks_is_refused_zero_padding_is_not() {
    // Before, `cat a.tar b.tar` indexed a's samples only, without a word.
    let dir = temp_dir("wds-concat");
    let a = tar_of(&[("s0.cls", b"0".to_vec()), ("s0.txt", b"zero".to_vec())]);
    let b = tar_of(&[("s1.cls", b"1".to_vec()), ("s1.txt", b"one".to_vec())]);
    // Padded to a 10 KiB record, as GNU tar and Python's tarfile write it: indexed.
    let mut padded = a.clone();
    padded.resize(10240, 0);
    std::fs::write(dir.join("s.tar"), &padded).unwrap();
    let m = index_dir(&dir, &IndexOptions::default()).unwrap();
    assert_eq!(tensor(&m, "cls").rows.as_ref().unwrap().len(), 1);
    let mut cat = padded.clone();
    cat.extend(&b);
    std::fs::write(dir.join("s.tar"), &cat).unwrap();
    let err = index_err(&dir);
    let at = format!("a non-zero byte at {}", padded.len());
    for want in ["s.tar", "concatenated", "tar --concatenate", &at] {
        assert!(err.contains(want), "{want}: {err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_sample_of_more_fields_than_a_shard_holds_is_refused_before_the_checksum() {
    // Before, the tar was read and checksummed, and only then refused by the manifest
    // ("has 4097 tensors"), with advice for other formats.
    let dir = temp_dir("wds-fields");
    let names: Vec<String> = (0..4097).map(|i| format!("s0.f{i:04}")).collect();
    let members: Vec<(&str, Vec<u8>)> = names.iter().map(|n| (n.as_str(), vec![1u8])).collect();
    std::fs::write(dir.join("wide.tar"), tar_of(&members)).unwrap();
    let err = index_dir(&dir, &IndexOptions::default()).unwrap_err();
    assert!(matches!(err, IndexError::Unsupported { .. }), "{err:?}");
    let text = err.to_string();
    for want in ["wide.tar", "4097 tensors", "at most 4096", "fewer fields"] {
        assert!(text.contains(want), "{want}: {text}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn other_compressed_tars_are_refused_like_gzip() {
    // Before, they were named "not used (unknown extension .xz)" and the rest indexed.
    let dir = temp_dir("wds-xz");
    std::fs::write(dir.join("a.bin"), [1u8]).unwrap();
    for (name, fix) in [
        ("d.tar.xz", "`unxz`"),
        ("d.tar.bz2", "`bunzip2`"),
        ("d.tar.zst", "`unzstd`"),
        ("d.tbz2", "rename to .tar.bz2"),
    ] {
        std::fs::write(dir.join(name), b"junk").unwrap();
        let err = index_err(&dir);
        assert!(
            err.contains(name) && err.contains("byte range") && err.contains(fix),
            "{name}: {err}"
        );
        std::fs::remove_file(dir.join(name)).unwrap();
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A tar member for [`tar_with_links`]: `(name, Ok(text))` a regular file, `(name,
/// Err((target, hard)))` a link (symbolic, or hard when `hard`).
type Member<'a> = (&'a str, Result<&'a str, (&'a str, bool)>);

/// A tar of `members`, in order.
fn tar_with_links(members: &[Member<'_>]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, m) in members {
        let mut h = tar::Header::new_gnu();
        h.set_mode(0o644);
        match m {
            Ok(data) => {
                h.set_size(data.len() as u64);
                h.set_cksum();
                b.append_data(&mut h, name, data.as_bytes()).unwrap();
            }
            Err((target, hard)) => {
                let kind = if *hard {
                    tar::EntryType::Link
                } else {
                    tar::EntryType::Symlink
                };
                h.set_entry_type(kind);
                h.set_size(0);
                b.append_link(&mut h, name, target).unwrap();
            }
        }
    }
    b.into_inner().unwrap()
}

#[test]
fn a_field_made_of_links_is_refused_and_other_skipped_members_are_noted() {
    // `ln -s /img/1.jpg st/000001.jpg; tar cf s.tar -C st .`: every .jpg a symbolic link.
    // Before, the tar was indexed as a `cls`-only dataset, exit 0, no word.
    let dir = temp_dir("wds-links");
    let tar = tar_with_links(&[
        ("000001.jpg", Err(("/img/1.jpg", false))),
        ("000001.cls", Ok("1")),
        ("000002.jpg", Err(("/img/2.jpg", false))),
        ("000002.cls", Ok("2")),
    ]);
    std::fs::write(dir.join("s.tar"), &tar).unwrap();
    let e = index_err(&dir);
    for want in [
        "s.tar",
        "every `jpg` member is a link",
        "tar -h",
        "2 links, the first 000001.jpg -> /img/1.jpg",
    ] {
        assert!(e.contains(want), "{want}: {e}");
    }
    // A hard link (a second name of another member's file): its sample is refused by name,
    // saying why it lacks the field (before: "lacks field `jpg`", no word of the link).
    let tar = tar_with_links(&[
        ("000001.jpg", Ok("img")),
        ("000001.cls", Ok("1")),
        ("000002.jpg", Err(("000001.jpg", true))),
        ("000002.cls", Ok("2")),
    ]);
    std::fs::write(dir.join("s.tar"), &tar).unwrap();
    let e = index_err(&dir);
    assert!(
        e.contains("sample `000002` has its `jpg` member as a link")
            && e.contains("--hard-dereference"),
        "{e}"
    );
    // A link beside the file it names, and a member with no key.field name: served, and
    // named in a note (before: dropped without a word).
    let tar = tar_with_links(&[
        ("000001.jpg", Ok("img")),
        ("000001.cls", Ok("1")),
        ("000001.JPG", Err(("000001.jpg", false))),
        ("README", Ok("about")),
    ]);
    std::fs::write(dir.join("s.tar"), &tar).unwrap();
    let r = index_report(&dir, &IndexOptions::default()).unwrap();
    assert_eq!(r.manifest.shards[0].tensors.len(), 2);
    let notes = r.notes().join("\n");
    assert!(
        notes.contains(
            "tar members skipped: 1 tar: s.tar (1 link, not followed; 1 without a key.field \
             name: 000001.JPG -> 000001.jpg, README)"
        ),
        "{notes}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
