//! The trainer messages: defaults, round trips, the fast codec against serde's, error codes, limits.

use proptest::prelude::*;

use super::*;
use crate::DType;

#[test]
fn request_defaults_and_round_trip() {
    let r: Request = decode(br#"{"op":"attach","version":1,"dataset":"d"}"#).unwrap();
    assert_eq!(r, Request::Attach(Box::new(StreamRequest::new("d"))));
    let e = decode::<Request>(br#"{"op":"attach","dataset":"d","bogus":1}"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("bogus"), "{e}");
    let mut buf = Vec::new();
    encode(&Request::Release { lease: 9 }, &mut buf);
    let len = check_len(buf[..4].try_into().unwrap()).unwrap();
    assert_eq!(
        decode::<Request>(&buf[4..4 + len]).unwrap(),
        Request::Release { lease: 9 }
    );
}

/// `Request::decode` and `Response::decode` agree with the derived decoder: same value or
/// the same error message (for responses: unless the body starts with the binary batch tag,
/// which is no JSON).
fn same_as_derived(body: &[u8]) {
    let (fast, slow) = (Request::decode(body), decode::<Request>(body));
    match (&fast, &slow) {
        (Ok(a), Ok(b)) => assert_eq!(a, b),
        (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
        _ => panic!(
            "{}: fast {fast:?} derived {slow:?}",
            String::from_utf8_lossy(body)
        ),
    }
    if body.first() == Some(&binary::BINARY_BATCH_TAG) {
        assert!(decode::<Response>(body).is_err(), "not JSON");
        return;
    }
    let (fast, slow) = (Response::decode(body), decode::<Response>(body));
    match (&fast, &slow) {
        (Ok(a), Ok(b)) => assert_eq!(a, b),
        (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
        _ => panic!(
            "{}: fast {fast:?} derived {slow:?}",
            String::from_utf8_lossy(body)
        ),
    }
}

#[test]
fn hot_messages_decode_like_the_derived_code() {
    for body in [
        r#"{"op":"next"}"#,
        r#"{"op":"next","timeout_ms":null}"#,
        r#"{"op":"next","timeout_ms":250,"release":[1,2]}"#,
        r#"{"op":"next","release":[7],"timeout_ms":5}"#,
        r#"{"op":"next","release":[]}"#,
        r#"{"op":"next","release":[7],"release":[8]}"#,
        r#"{"op":"next","timeout_ms":1,"timeout_ms":2}"#,
        r#"{"op":"next","timeout_ms":01}"#,
        r#"{"op":"next","timeout_ms":-1}"#,
        r#"{"op":"next","timeout_ms":1.5}"#,
        r#"{"op":"next","timeout_ms":18446744073709551616}"#,
        r#"{"op":"next","bogus":1}"#,
        r#"{"op":"next"} "#,
        r#"{"op": "next", "release": [3]}"#,
        r#"{"release":[3],"op":"next"}"#,
        r#"{"op":"nexts"}"#,
        r#"{"op":"next","release":[1,]}"#,
        r#"{"op":"batch","lease":1,"epoch":0,"index":2,"shard":3,"tensors":[]}"#,
        r#"{"op":"batch","lease":1,"epoch":0,"index":2,"shard":3,"tensors":[{"name":"x","dtype":"float32","shape":[2,3],"offset":64,"length":24},{"name":"y","dtype":"int64","shape":[],"offset":0,"length":8}]}"#,
        r#"{"op":"batch","lease":1,"epoch":4294967296,"index":2,"shard":3,"tensors":[]}"#,
        r#"{"op":"batch","lease":1,"epoch":0,"index":2,"shard":3,"tensors":[{"name":"x\"y","dtype":"uint8","shape":[1],"offset":0,"length":1}]}"#,
        r#"{"op":"batch","lease":1,"epoch":0,"index":2,"shard":3,"tensors":[{"name":"x","dtype":"complex64","shape":[1],"offset":0,"length":1}]}"#,
        r#"{"op":"batch","lease":1,"epoch":0,"index":2,"shard":3,"tensors":[{"dtype":"uint8","name":"x","shape":[1],"offset":0,"length":1}]}"#,
        r#"{"op":"batch","lease":1,"epoch":0,"index":2,"shard":3,"tensors":[],"extra":1}"#,
        r#"{"op":"batch","lease":1,"epoch":0,"index":2,"shard":3}"#,
        r#"{"op":"released"}"#,
        r#"{"op":"state","release":[5]}"#,
        r#"{"op":"timeout","more":true}"#,
        r#"{"op":"error","code":"closed","message":"bye"}"#,
        r#"{"op":"attach","version":1,"dataset":"d","seed":3,"world_size":2,"rank":1}"#,
    ] {
        same_as_derived(body.as_bytes());
    }
    same_as_derived(b"{\"op\":\"batch\",\"lease\":1,\"epoch\":0,\"index\":2,\"shard\":3,\"tensors\":[{\"name\":\"\xff\",\"dtype\":\"uint8\",\"shape\":[1],\"offset\":0,\"length\":1}]}");
}

#[test]
fn the_hot_path_reads_what_the_writers_write() {
    for body in [
        &br#"{"op":"next","timeout_ms":null,"release":[9]}"#[..],
        br#"{"op":"next","release":[9]}"#, // the Python SDK's form
        br#"{"op":"next","timeout_ms":250}"#,
    ] {
        assert!(fast::decode_next(body).is_some(), "{body:?}");
    }
    let b = br#"{"op":"batch","lease":7,"epoch":1,"index":2,"shard":3,"tensors":[{"name":"x","dtype":"float32","shape":[2,3],"offset":64,"length":24}]}"#;
    assert!(fast::decode_batch(b).is_some());
}

fn dtypes() -> impl Strategy<Value = DType> {
    prop_oneof![
        Just(DType::Int8),
        Just(DType::Int16),
        Just(DType::Int32),
        Just(DType::Int64),
        Just(DType::Uint8),
        Just(DType::Uint16),
        Just(DType::Uint32),
        Just(DType::Uint64),
        Just(DType::Float16),
        Just(DType::Float32),
        Just(DType::Float64),
    ]
}

fn batches() -> impl Strategy<Value = Response> {
    let tensor = (
        prop_oneof![any::<String>(), "[a-z0-9_./]{0,12}"],
        dtypes(),
        proptest::collection::vec(any::<u64>(), 0..4),
        any::<u64>(),
        any::<u64>(),
    )
        .prop_map(|(name, dtype, shape, offset, length)| TensorView {
            name,
            dtype,
            shape,
            offset,
            length,
        });
    (
        any::<u64>(),
        any::<u32>(),
        any::<u64>(),
        any::<u32>(),
        proptest::collection::vec(tensor, 0..4),
        (any::<bool>(), any::<bool>()),
    )
        .prop_map(
            |(lease, epoch, index, shard, tensors, (with_state, more))| Response::Batch {
                lease,
                epoch,
                index: index / 2,
                shard,
                tensors,
                state: with_state.then(|| StreamState {
                    epoch,
                    index: index / 2 + 1,
                    seed: lease,
                    fingerprint: "v2;digest=00;seed=1".into(),
                    cursor: Some(index),
                    partitions: None,
                    shuffle_block: None,
                    mix: None,
                }),
                more,
            },
        )
}

fn nexts() -> impl Strategy<Value = Request> {
    (
        proptest::option::of(any::<u64>()),
        proptest::collection::vec(any::<u64>(), 0..4),
        prop_oneof![Just(1u32), 0..=MAX_NEXT_COUNT + 1],
    )
        .prop_map(|(timeout_ms, release, count)| Request::Next {
            timeout_ms,
            release,
            count,
        })
}

proptest! {
    #[test]
    fn hot_messages_encode_like_serde_and_round_trip(b in batches(), n in nexts()) {
        let (mut fast, mut slow) = (Vec::new(), Vec::new());
        b.encode(&mut fast);
        encode(&b, &mut slow);
        prop_assert_eq!(&fast, &slow);
        prop_assert_eq!(Response::decode(&fast[4..]).unwrap(), b);
        let (mut fast, mut slow) = (Vec::new(), Vec::new());
        n.encode(&mut fast);
        encode(&n, &mut slow);
        prop_assert_eq!(&fast, &slow);
        prop_assert_eq!(Request::decode(&fast[4..]).unwrap(), n);
    }

    #[test]
    fn binary_batches_round_trip_and_other_replies_stay_json(b in batches()) {
        let mut buf = Vec::new();
        b.encode_as(BatchEncoding::Binary, &mut buf);
        let len = check_len(buf[..4].try_into().unwrap()).unwrap();
        prop_assert_eq!(len, buf.len() - 4);
        prop_assert_eq!(buf[4], binary::BINARY_BATCH_TAG);
        prop_assert_eq!(Response::decode(&buf[4..]).unwrap(), b.clone());
        // The same batch with its state left as JSON bytes: those bytes are the state.
        let (raw_batch, raw_state) = binary::decode_batch_raw_state(&buf[4..]).unwrap();
        let Response::Batch { state, .. } = &b else { unreachable!("batches() makes batches") };
        let parsed = raw_state.map(|j| serde_json::from_slice::<StreamState>(j).unwrap());
        prop_assert_eq!(&parsed, state);
        let mut without = b.clone();
        if let Response::Batch { state, .. } = &mut without {
            *state = None;
        }
        prop_assert_eq!(raw_batch, without);
        let (mut bin, mut json) = (Vec::new(), Vec::new());
        Response::Released {}.encode_as(BatchEncoding::Binary, &mut bin);
        Response::Released {}.encode(&mut json);
        prop_assert_eq!(bin, json);
    }

    #[test]
    fn mangled_binary_batches_are_refused_or_decoded_without_panic(
        b in batches(),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0..3u8), 1..4),
    ) {
        let mut buf = Vec::new();
        b.encode_as(BatchEncoding::Binary, &mut buf);
        let mut body = buf[4..].to_vec();
        for (at, byte, how) in &edits {
            let i = at.index(body.len());
            match how {
                0 => body[i] = *byte,
                1 => { body.remove(i); }
                _ => body.insert(i, *byte),
            }
            if body.is_empty() {
                break;
            }
        }
        // No panic, no allocation sized by a count before its bytes are there; whatever
        // decodes is a well-formed batch that round-trips.
        if let Ok(r) = Response::decode(&body) {
            let mut again = Vec::new();
            r.encode_as(BatchEncoding::Binary, &mut again);
            prop_assert_eq!(Response::decode(&again[4..]).unwrap(), r);
        }
    }

    #[test]
    fn mangled_hot_messages_decode_like_the_derived_code(
        b in batches(),
        n in nexts(),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0..3u8), 1..4),
    ) {
        for msg in [serde_json::to_vec(&b).unwrap(), serde_json::to_vec(&n).unwrap()] {
            let mut body = msg.clone();
            for (at, byte, how) in &edits {
                if body.is_empty() {
                    break;
                }
                let i = at.index(body.len());
                match how {
                    0 => body[i] = *byte,
                    1 => { body.remove(i); }
                    _ => body.insert(i, *byte),
                }
            }
            same_as_derived(&body);
        }
    }
}

#[test]
fn error_codes_keep_their_wire_names_and_map_to_http() {
    for (code, name, status) in [
        (ErrorCode::BadRequest, "bad_request", 400),
        (ErrorCode::UnknownDataset, "unknown_dataset", 404),
        (ErrorCode::StateMismatch, "state_mismatch", 409),
        (ErrorCode::NoMemory, "no_memory", 503),
        (ErrorCode::Timeout, "timeout", 408),
        (ErrorCode::DataUnavailable, "data_unavailable", 502),
        (ErrorCode::UnknownDevice, "unknown_device", 404),
    ] {
        assert_eq!(serde_json::to_string(&code).unwrap(), format!("\"{name}\""));
        assert_eq!(code.as_str(), name);
        assert_eq!(code.http_status(), status);
    }
    assert!(ErrorCode::NoMemory.retryable() && !ErrorCode::BadPlan.retryable());
    let r: Response = decode(br#"{"op":"error","code":"from_the_future","message":"x"}"#).unwrap();
    assert_eq!(
        r,
        Response::Error {
            code: ErrorCode::Unknown,
            message: "x".into()
        }
    );
}

#[test]
fn device_and_info_round_trip() {
    let mut r = StreamRequest::new("d");
    assert!(
        !serde_json::to_string(&r).unwrap().contains("device"),
        "absent unless given"
    );
    r.device = Some("0000:19:00.0".into());
    let json = serde_json::to_string(&Request::Attach(Box::new(r.clone()))).unwrap();
    assert!(json.contains(r#""device":"0000:19:00.0""#), "{json}");
    assert_eq!(
        decode::<Request>(json.as_bytes()).unwrap(),
        Request::Attach(Box::new(r))
    );
    assert_eq!(
        decode::<Request>(br#"{"op":"info"}"#).unwrap(),
        Request::Info {}
    );
    let info = Response::Info {
        memory: MemoryKind::Cuda,
        lanes: vec![LaneRef {
            lane: 0,
            gpu: Some("0000:19:00.0".into()),
            uuid: None,
        }],
    };
    let mut frame = Vec::new();
    info.encode(&mut frame);
    assert_eq!(decode::<Response>(&frame[4..]).unwrap(), info);
}

#[test]
fn unknown_fields_and_long_frames_are_rejected() {
    let e = decode::<Request>(br#"{"op":"next","bogus":1}"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("bogus"), "{e}");
    assert!(check_len((MAX_TRAINER_FRAME as u32 + 1).to_le_bytes()).is_err());
}

#[test]
fn messages_without_fields_refuse_unknown_fields() {
    // Before, a unit variant took any key unread: `state` with a `release` list was answered
    // as `state`, and lease 5 stayed held without a word.
    for (body, field) in [
        (&br#"{"op":"state","release":[5]}"#[..], "release"),
        (br#"{"op":"info","x":1}"#, "x"),
    ] {
        for e in [Request::decode(body), decode::<Request>(body)] {
            let e = e.unwrap_err().to_string();
            assert!(e.contains(&format!("unknown field `{field}`")), "{e}");
        }
    }
    for (body, field) in [
        (&br#"{"op":"timeout","more":true}"#[..], "more"),
        (br#"{"op":"end","x":1}"#, "x"),
        (br#"{"op":"released","lease":5}"#, "lease"),
    ] {
        let e = Response::decode(body).unwrap_err().to_string();
        assert!(e.contains(&format!("unknown field `{field}`")), "{e}");
    }
    assert_eq!(
        Request::decode(br#"{"op":"state"}"#).unwrap(),
        Request::State {}
    );
    assert_eq!(
        Request::decode(br#"{"op":"info"}"#).unwrap(),
        Request::Info {}
    );
    for (body, r) in [
        (&br#"{"op":"timeout"}"#[..], Response::Timeout {}),
        (br#"{"op":"end"}"#, Response::End {}),
        (br#"{"op":"released"}"#, Response::Released {}),
    ] {
        assert_eq!(Response::decode(body).unwrap(), r);
    }
}

#[test]
fn messages_without_fields_keep_their_bytes() {
    let framed = |body: &str| {
        let mut f = (body.len() as u32).to_le_bytes().to_vec();
        f.extend_from_slice(body.as_bytes());
        f
    };
    for (r, body) in [
        (Request::State {}, r#"{"op":"state"}"#),
        (Request::Info {}, r#"{"op":"info"}"#),
    ] {
        let (mut derived, mut own) = (Vec::new(), Vec::new());
        encode(&r, &mut derived);
        r.encode(&mut own);
        assert_eq!((derived, own), (framed(body), framed(body)), "{body}");
    }
    for (r, body) in [
        (Response::Timeout {}, r#"{"op":"timeout"}"#),
        (Response::End {}, r#"{"op":"end"}"#),
        (Response::Released {}, r#"{"op":"released"}"#),
    ] {
        let (mut derived, mut own, mut binary) = (Vec::new(), Vec::new(), Vec::new());
        encode(&r, &mut derived);
        r.encode(&mut own);
        r.encode_as(BatchEncoding::Binary, &mut binary);
        let want = framed(body);
        assert_eq!(
            (derived, own, binary),
            (want.clone(), want.clone(), want),
            "{body}"
        );
    }
}

#[test]
fn a_peers_line_break_is_escaped_in_the_decode_error() {
    // Before, serde_json's message quoted the peer's key or tag with its `\n` decoded, and the
    // node's WARN line showing it went on as a forged log line.
    for (body, escaped) in [
        (
            &br#"{"op":"attach","x\nINFO shardwire_node: source 10.0.0.9 authenticated":1}"#[..],
            r"x\nINFO shardwire_node",
        ),
        (br#"{"op":"x\ny"}"#, r"x\ny"),
        (br#"{"op":"info","a\rb":1}"#, r"a\rb"),
        (br#"{"op":"x\u2028y"}"#, r"x\u{2028}y"),
    ] {
        let e = Request::decode(body).unwrap_err().to_string();
        assert!(
            !e.contains(|c: char| c.is_control() || c == '\u{2028}'),
            "{e:?}"
        );
        assert!(e.contains(escaped), "{e}");
    }
}

#[test]
fn binary_batch_errors_name_the_field_and_oversized_replies_go_as_json() {
    let b = Response::Batch {
        lease: 7,
        epoch: 1,
        index: 2,
        shard: 3,
        tensors: vec![TensorView {
            name: "x".into(),
            dtype: DType::Float32,
            shape: vec![2, 3],
            offset: 4096,
            length: 24,
        }],
        state: None,
        more: false,
    };
    let mut buf = Vec::new();
    b.encode_as(BatchEncoding::Binary, &mut buf);
    let body = &buf[4..];
    // Header, then offset/length/desc_len, then the desc: name_len, "x", dtype_len, "float32", ndim, dims.
    assert_eq!(body.len(), 32 + 18 + 2 + 1 + 1 + 7 + 1 + 16);
    let e = binary::decode_batch(&body[..36]).unwrap_err();
    assert_eq!(
        e,
        binary::BinaryBatchError::Short {
            len: 36,
            field: "tensor offset",
            at: 32
        }
    );
    let mut long = body.to_vec();
    long.push(0);
    assert_eq!(
        binary::decode_batch(&long).unwrap_err(),
        binary::BinaryBatchError::Trailing(1)
    );
    let mut bad = body.to_vec();
    bad[32 + 18 + 2 + 1 + 1] = b'q'; // "qloat32"
    let e = Response::decode(&bad).unwrap_err().to_string();
    assert!(e.contains("unknown dtype \"qloat32\""), "{e}");
    // `more` is flag bit 0; a bit this decoder does not know is refused, not ignored.
    let mut flagged = body.to_vec();
    flagged[1] = 0x01;
    assert!(matches!(
        binary::decode_batch(&flagged),
        Ok(Response::Batch { more: true, .. })
    ));
    flagged[1] = 0x03;
    assert_eq!(
        binary::decode_batch(&flagged).unwrap_err(),
        binary::BinaryBatchError::Flags(0x03)
    );
    // A name too long for its u16 field: the JSON form instead.
    let Response::Batch { mut tensors, .. } = b.clone() else {
        unreachable!()
    };
    tensors[0].name = "n".repeat(70_000);
    let big = Response::Batch {
        lease: 7,
        epoch: 1,
        index: 2,
        shard: 3,
        tensors,
        state: None,
        more: true,
    };
    let mut buf = Vec::new();
    big.encode_as(BatchEncoding::Binary, &mut buf);
    assert_eq!(buf[4], b'{');
    assert_eq!(Response::decode(&buf[4..]).unwrap(), big);
}

#[test]
fn batch_encoding_is_an_attach_field() {
    let r: Request = decode(br#"{"op":"attach","dataset":"d","batch_encoding":"binary"}"#).unwrap();
    let Request::Attach(a) = r else {
        panic!("{r:?}")
    };
    assert_eq!(a.batch_encoding, BatchEncoding::Binary);
    assert!(
        !serde_json::to_string(&StreamRequest::new("d"))
            .unwrap()
            .contains("batch_encoding")
    );
    let e = decode::<Request>(br#"{"op":"attach","dataset":"d","batch_encoding":"xml"}"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("xml"), "{e}");
}
