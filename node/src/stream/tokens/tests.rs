//! Token-mode checks: the documents' tensor is chosen or refused by name; a batch plan puts
//! each window's tokens in its row, widened, with positions.

use shardwire_protocol::manifest::{ShardEntry, TensorEntry};
use shardwire_protocol::samples::{SampleRef, TokenPiece};

use super::*;
use crate::stream::assemble::widen_into;

/// A shard whose tensor `name` has rows of `lens` tokens of `dtype`, back to back from 0.
fn shard(tensors: &[(&str, DType, &[u64])]) -> ShardEntry {
    let mut at = 0;
    let mut out = Vec::new();
    for (name, dtype, lens) in tensors {
        let start = at;
        let rows: Vec<[u64; 2]> = lens
            .iter()
            .map(|&n| {
                let r = [at, n * dtype.size()];
                at += n * dtype.size();
                r
            })
            .collect();
        out.push(TensorEntry {
            name: (*name).into(),
            dtype: *dtype,
            shape: vec![(at - start) / dtype.size()],
            offset: start,
            length: at - start,
            rows: Some(rows),
            ragged: true,
        });
    }
    ShardEntry {
        file: "f".into(),
        offset: 0,
        length: at,
        crc32c: 0,
        tensors: out,
    }
}

fn manifest(shards: Vec<ShardEntry>) -> Manifest {
    Manifest {
        format: 1,
        digest: "00".repeat(32),
        total_bytes: shards.iter().map(|s| s.length).sum(),
        shards,
        objects: Vec::new(),
    }
}

fn request(seq_len: u64) -> StreamRequest {
    let mut r = StreamRequest::new("d");
    r.batch_size = Some(2);
    r.seq_len = Some(seq_len);
    r
}

#[test]
fn the_only_ragged_integer_tensor_is_chosen_and_others_are_named() {
    let m = manifest(vec![shard(&[("input_ids", DType::Int32, &[3, 4])])]);
    let (spec, mode) = TokenMode::of(&m, &request(2), 2).unwrap();
    assert_eq!(spec.doc_tokens, vec![vec![3, 4]]);
    assert_eq!(
        (mode.src, mode.out, spec.column.as_str()),
        (DType::Int32, DType::Int32, "input_ids")
    );

    let two = manifest(vec![shard(&[
        ("a", DType::Int32, &[3]),
        ("b", DType::Int64, &[3]),
    ])]);
    let e = TokenMode::of(&two, &request(2), 2).unwrap_err();
    assert!(
        e.message
            .contains(r#"["a", "b"]; name the documents with tokens_column"#),
        "{e}"
    );
    let mut r = request(2);
    r.tokens_column = Some("c".into());
    let e = TokenMode::of(&two, &r, 2).unwrap_err();
    assert!(
        e.message.contains(r#"tokens_column "c" is not a tensor"#),
        "{e}"
    );
    r.tokens_column = Some("b".into());
    assert_eq!(TokenMode::of(&two, &r, 2).unwrap().1.tensor(0), 1);

    // Bytes (strings, masks) are not chosen without tokens_column, but may be named.
    let text = manifest(vec![shard(&[
        ("text", DType::Uint8, &[3]),
        ("ids", DType::Int32, &[3]),
    ])]);
    assert_eq!(
        TokenMode::of(&text, &request(2), 2).unwrap().0.column,
        "ids"
    );
    let bytes = manifest(vec![shard(&[("text", DType::Uint8, &[9])])]);
    assert!(TokenMode::of(&bytes, &request(2), 2).is_err());
    let mut r = request(2);
    r.tokens_column = Some("text".into());
    assert_eq!(TokenMode::of(&bytes, &r, 2).unwrap().1.src, DType::Uint8);

    let floats = manifest(vec![shard(&[("x", DType::Float32, &[3])])]);
    let e = TokenMode::of(&floats, &request(2), 2).unwrap_err();
    assert!(e.message.contains("ragged integer tensor"), "{e}");
}

#[test]
fn token_dtype_must_hold_every_token() {
    let m = manifest(vec![shard(&[("t", DType::Uint32, &[5])])]);
    let mut r = request(2);
    r.token_dtype = Some(DType::Int32);
    let e = TokenMode::of(&m, &r, 2).unwrap_err();
    assert!(
        e.message
            .contains("token_dtype int32 cannot hold every uint32 token"),
        "{e}"
    );
    r.token_dtype = Some(DType::Int64);
    assert_eq!(TokenMode::of(&m, &r, 2).unwrap().1.out, DType::Int64);
}

#[test]
fn a_batch_plan_places_windows_in_rows_with_positions_and_widening() {
    // Documents of 3 and 4 uint16 tokens in one shard; seq_len 2 (width 3).
    let m = manifest(vec![shard(&[("t", DType::Uint16, &[3, 4])])]);
    let mut r = request(2);
    r.token_dtype = Some(DType::Int64);
    r.boundaries = true;
    let (_, mode) = TokenMode::of(&m, &r, 2).unwrap();
    let doc = |row| SampleRef { shard: 0, row };
    // Window 1 = tokens 2..5 of the stream: the last of doc 0, the first two of doc 1.
    let windows = vec![
        vec![TokenPiece {
            doc: doc(0),
            start: 0,
            len: 3,
        }],
        vec![
            TokenPiece {
                doc: doc(0),
                start: 2,
                len: 1,
            },
            TokenPiece {
                doc: doc(1),
                start: 0,
                len: 2,
            },
        ],
    ];
    let p = plan(&m, &mode, &windows);
    assert_eq!(p.views[0].shape, vec![2, 3]);
    assert_eq!(p.views[0].length, 2 * 3 * 8);
    assert_eq!(p.views[1].name, POSITIONS);
    let pos: Vec<i32> = p.writes[0]
        .1
        .chunks(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(pos, vec![0, 1, 2, 2, 0, 1]);
    // Doc 0 token 2 and doc 1 follow on in the shard and in row 1: one piece, 3 tokens.
    assert_eq!(p.pieces.len(), 2, "{:?}", p.pieces);
    assert_eq!(
        (p.pieces[1].src, p.pieces[1].dst, p.pieces[1].len),
        (4, 24, 6)
    );
    assert_eq!(p.bytes, 64 + 64);
}

#[test]
fn widening_extends_sign_and_zero() {
    let w = Widen {
        from: DType::Int16,
        to: DType::Int64,
    };
    let mut out = [0u8; 16];
    widen_into(w, &[0xff, 0xff, 0x02, 0x00], &mut out);
    assert_eq!(i64::from_le_bytes(out[..8].try_into().unwrap()), -1);
    assert_eq!(i64::from_le_bytes(out[8..].try_into().unwrap()), 2);
    let w = Widen {
        from: DType::Uint16,
        to: DType::Int32,
    };
    let mut out = [0u8; 4];
    widen_into(w, &[0xff, 0xff], &mut out);
    assert_eq!(i32::from_le_bytes(out), 65535);
}

#[test]
fn a_batch_whose_size_overflows_is_as_large_as_can_be_and_refused() {
    let m = manifest(vec![shard(&[("ids", DType::Int32, &[3, 4])])]);
    let (_, mode) = TokenMode::of(&m, &request(2), 2).unwrap();
    assert_eq!(
        mode.batch_bytes(2),
        64,
        "2 windows of 3 int32 tokens, aligned"
    );
    let (_, huge) = TokenMode::of(&m, &request(2), (1 << 62) - 1).unwrap();
    // (2^62 tokens) x 4 bytes wrapped to 0 before: a tiny slab passed the memory check.
    assert_eq!(huge.batch_bytes(u32::MAX), u64::MAX);
    let e = crate::stream::open::check_batch_fits(u64::MAX, 64 << 20).unwrap_err();
    assert!(
        e.message.contains("more than 2^64 bytes") && e.message.contains("lower batch_size"),
        "{e}"
    );
    assert!(crate::stream::open::check_batch_fits(64, 64).is_ok());
}
