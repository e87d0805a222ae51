//! Tests for the `.npy` reader, with files written byte by byte.

use shardwire_protocol::manifest::DType;

use crate::testutil::{check_manifest, temp_dir};
use crate::{IndexOptions, index_dir};

/// A `.npy` file as numpy writes it: header padded with spaces to a multiple of 64 bytes.
fn npy(major: u8, dict: &str, data: &[u8]) -> Vec<u8> {
    let pre = if major == 1 { 10 } else { 12 };
    let mut header = dict.to_string();
    while !(pre + header.len() + 1).is_multiple_of(64) {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY".to_vec();
    out.extend([major, 0]);
    if major == 1 {
        out.extend((header.len() as u16).to_le_bytes());
    } else {
        out.extend((header.len() as u32).to_le_bytes());
    }
    out.extend(header.as_bytes());
    out.extend(data);
    out
}

fn index_one(
    name: &str,
    bytes: &[u8],
) -> (
    std::path::PathBuf,
    Result<shardwire_protocol::manifest::Manifest, String>,
) {
    let dir = temp_dir(&format!("npy-{name}"));
    std::fs::write(dir.join(name), bytes).unwrap();
    let r = index_dir(&dir, &IndexOptions::default()).map_err(|e| e.to_string());
    (dir, r)
}

fn expect_err(name: &str, bytes: &[u8], needles: &[&str]) {
    let (dir, r) = index_one(name, bytes);
    let err = r.expect_err("must be rejected");
    for n in needles {
        assert!(err.contains(n), "`{err}` lacks `{n}`");
    }
    assert!(err.contains(name), "`{err}` does not name the file");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn float32_2d_v1() {
    let vals: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 1.0).collect();
    let data: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let bytes = npy(
        1,
        "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }",
        &data,
    );
    let (dir, r) = index_one("feat.npy", &bytes);
    let m = r.unwrap();
    let s = &m.shards[0];
    assert_eq!(s.offset, 128); // numpy pads the header to a multiple of 64
    assert_eq!(s.length, 48);
    let t = &s.tensors[0];
    assert_eq!(
        (t.name.as_str(), t.dtype, t.shape.as_slice(), t.offset),
        ("feat", DType::Float32, &[3u64, 4][..], 128)
    );
    check_manifest(&dir, &m, &[("feat", data)]);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn int16_1d_v2_and_v3_and_scalar() {
    let data: Vec<u8> = [-3i16, 7, 300]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    for major in [2u8, 3] {
        let bytes = npy(
            major,
            "{'descr': '<i2', 'fortran_order': False, 'shape': (3,), }",
            &data,
        );
        let (dir, r) = index_one("lab.npy", &bytes);
        let m = r.unwrap();
        assert_eq!(m.shards[0].tensors[0].shape, [3]);
        assert_eq!(m.shards[0].tensors[0].dtype, DType::Int16);
        check_manifest(&dir, &m, &[("lab", data.clone())]);
        std::fs::remove_dir_all(dir).unwrap();
    }
    let scalar = 2.5f64.to_le_bytes();
    let bytes = npy(
        1,
        "{'descr': '<f8', 'fortran_order': False, 'shape': (), }",
        &scalar,
    );
    let (dir, r) = index_one("s.npy", &bytes);
    let m = r.unwrap();
    assert_eq!(m.shards[0].tensors[0].shape, Vec::<u64>::new());
    check_manifest(&dir, &m, &[("s", scalar.to_vec())]);
    std::fs::remove_dir_all(dir).unwrap();
    let bytes = npy(
        1,
        "{'descr': '|u1', 'fortran_order': False, 'shape': (2, 1, 2), }",
        &[1, 2, 3, 4],
    );
    let (dir, r) = index_one("u.npy", &bytes);
    assert_eq!(r.unwrap().shards[0].tensors[0].dtype, DType::Uint8);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn rejections() {
    let d24 = [0u8; 24];
    let hdr = |descr: &str, fortran: &str, shape: &str| {
        format!("{{'descr': {descr}, 'fortran_order': {fortran}, 'shape': {shape}, }}")
    };
    expect_err(
        "f.npy",
        &npy(1, &hdr("'<f4'", "True", "(2, 3)"), &d24),
        &["Fortran-order", "np.ascontiguousarray", "True"],
    );
    // numpy refuses a shape whose non-zero dimensions' product passes 2^63 - 1, zeros or not.
    expect_err(
        "huge.npy",
        &npy(
            1,
            &hdr("'|u1'", "False", "(4611686018427387904, 4, 0)"),
            &[],
        ),
        &[
            "more elements than numpy takes",
            "(4611686018427387904, 4, 0)",
        ],
    );
    // `(3)` is the int 3 in Python, and numpy refuses the file: before, it was indexed.
    expect_err(
        "paren.npy",
        &npy(1, &hdr("'|u1'", "False", "(3)"), &d24[..3]),
        &["'shape' is not a tuple", "3"],
    );
    expect_err(
        "o.npy",
        &npy(1, &hdr("'|O'", "False", "(3,)"), &d24),
        &["object", "|O"],
    );
    expect_err(
        "be.npy",
        &npy(1, &hdr("'>f4'", "False", "(6,)"), &d24),
        &["big-endian", ">f4"],
    );
    expect_err(
        "b.npy",
        &npy(1, &hdr("'|b1'", "False", "(24,)"), &d24),
        &["bool", "|b1"],
    );
    expect_err(
        "c.npy",
        &npy(1, &hdr("'<c8'", "False", "(3,)"), &d24),
        &["not supported", "<c8"],
    );
    expect_err(
        "st.npy",
        &npy(
            1,
            &hdr("[('a', '<f4'), ('b', '<i8')]", "False", "(2,)"),
            &d24,
        ),
        &["structured", "'a'"],
    );
    expect_err(
        "sz.npy",
        &npy(1, &hdr("'<f4'", "False", "(2, 2)"), &d24),
        &["does not match", "24 bytes", "(2, 2)"],
    );
    expect_err(
        "k.npy",
        &npy(
            1,
            "{'descr': '<f4', 'fortran_order': False, 'shape': (6,), 'x': 1}",
            &d24,
        ),
        &["unexpected key", "'x'"],
    );
    expect_err("m.npy", b"PK\x03\x04 not numpy", &["magic", "50 4b 03 04"]);
    expect_err(
        "v.npy",
        &npy(1, &hdr("'<f4'", "False", "(6,)"), &d24)
            .iter()
            .enumerate()
            .map(|(i, &b)| if i == 6 { 9 } else { b })
            .collect::<Vec<_>>(),
        &["version", "9.0"],
    );
    let mut trunc = npy(1, &hdr("'<f4'", "False", "(6,)"), &d24);
    trunc[8] = 0xff; // header length beyond the file
    expect_err("t.npy", &trunc, &["beyond the end"]);
}

#[test]
fn files_with_no_elements_are_named_as_holding_no_rows_beside_the_others() {
    let dir = crate::testutil::temp_dir("npy-empty");
    let data: Vec<u8> = (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect();
    std::fs::write(
        dir.join("a.npy"),
        npy(
            1,
            "{'descr': '<f4', 'fortran_order': False, 'shape': (6,), }",
            &data,
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("z.npy"),
        npy(
            1,
            "{'descr': '<f4', 'fortran_order': False, 'shape': (0, 3), }",
            &[],
        ),
    )
    .unwrap();
    // A zero dimension after others: no elements, as numpy counts them.
    std::fs::write(
        dir.join("zz.npy"),
        npy(
            1,
            "{'descr': '|u1', 'fortran_order': False, 'shape': (1099511627776, 4, 0), }",
            &[],
        ),
    )
    .unwrap();
    std::fs::write(dir.join("e.bin"), b"").unwrap();
    // Before, either stopped the whole index (other formats named theirs and went on).
    let r = crate::index_report(&dir, &crate::IndexOptions::default()).unwrap();
    assert_eq!(r.manifest.shards.len(), 1);
    let mut unused: Vec<(&str, &str)> = r
        .unused
        .iter()
        .map(|u| (u.file.as_str(), u.reason.as_str()))
        .collect();
    unused.sort();
    assert_eq!(
        unused,
        [
            ("e.bin", "holds no rows"),
            ("z.npy", "holds no rows"),
            ("zz.npy", "holds no rows")
        ]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
