//! The bodies of the HTTP trainer API (docs/TRAINER_API.md, "HTTP API"), defined once and
//! serialised from these types by the node and parsed into them by the Rust client. Each is
//! the socket message of the same operation with what HTTP needs instead of a mapped region
//! (tensor lengths rather than offsets, the HTTP stream's idle timeout).

use serde::{Deserialize, Serialize};

use super::messages::{ErrorCode, StreamRequest, StreamState, TensorView};
use crate::DType;

/// `POST /v1/streams`: the socket's `attach` fields, plus the HTTP stream's idle timeout.
#[derive(Clone, Debug, PartialEq)]
pub struct OpenStream {
    /// The stream (the socket's `attach`).
    pub stream: StreamRequest,
    /// Seconds without a request after which the node closes the stream (`None`: its
    /// default).
    pub idle_timeout_s: Option<u64>,
}

/// Why an open body is not acceptable.
#[derive(Debug, thiserror::Error)]
pub enum OpenBodyError {
    /// Not JSON, not an object, or a field the stream request refuses (the message escaped,
    /// as a peer's key it quotes may hold a line break).
    #[error("invalid stream request: {}", crate::wire::json_error_text(.0))]
    Json(#[from] serde_json::Error),
    /// `idle_timeout_s` is not a whole number of seconds.
    #[error("idle_timeout_s is {0}; it must be a whole number of seconds")]
    IdleTimeout(serde_json::Value),
    /// A field of the socket's `attach` that HTTP does not serve.
    #[error(
        "`{0}` is a socket-only field (the HTTP API answers in JSON and has `GET \
         /v1/streams/{{id}}/state`): leave it out"
    )]
    SocketOnly(&'static str),
}

/// Fields of the socket's `attach` that mean nothing over HTTP: taken silently, a trainer
/// would not get what it asked for.
const SOCKET_ONLY: [&str; 2] = ["batch_state", "batch_encoding"];

impl OpenStream {
    /// Parses a body: [`StreamRequest`] refuses unknown fields, so `idle_timeout_s` is taken
    /// out first.
    pub fn from_json(body: &[u8]) -> Result<Self, OpenBodyError> {
        serde_json::from_slice::<NoRepeatedKeys>(body)?;
        let mut fields: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(body)?;
        if let Some(f) = SOCKET_ONLY.iter().find(|f| fields.contains_key(**f)) {
            return Err(OpenBodyError::SocketOnly(f));
        }
        let idle_timeout_s = match fields.remove("idle_timeout_s") {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => Some(v.as_u64().ok_or(OpenBodyError::IdleTimeout(v))?),
        };
        let stream = serde_json::from_value(serde_json::Value::Object(fields))?;
        Ok(Self {
            stream,
            idle_timeout_s,
        })
    }

    /// The body's JSON.
    pub fn to_json(&self) -> Vec<u8> {
        let mut v = serde_json::to_value(&self.stream).expect("a stream request serialises");
        if let (Some(t), Some(map)) = (self.idle_timeout_s, v.as_object_mut()) {
            map.insert("idle_timeout_s".into(), t.into());
        }
        serde_json::to_vec(&v).expect("JSON serialises")
    }
}

/// A JSON value none of whose objects, at any depth, repeats a key: a `serde_json::Map`
/// keeps the last of a repeated key, where the socket's `attach` (derived,
/// `deny_unknown_fields`) refuses it, so `{"dataset": "a", "dataset": "b"}`, or a repeated
/// `epoch` inside `state`, would be taken over HTTP only. Checked before the body is parsed.
pub struct NoRepeatedKeys;

impl<'de> Deserialize<'de> for NoRepeatedKeys {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = NoRepeatedKeys;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut a: A,
            ) -> Result<NoRepeatedKeys, A::Error> {
                let mut seen = std::collections::HashSet::new();
                while let Some(k) = a.next_key::<String>()? {
                    a.next_value::<NoRepeatedKeys>()?;
                    if !seen.insert(k.clone()) {
                        return Err(serde::de::Error::custom(format_args!(
                            "duplicate field `{k}`"
                        )));
                    }
                }
                Ok(NoRepeatedKeys)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut a: A,
            ) -> Result<NoRepeatedKeys, A::Error> {
                while a.next_element::<NoRepeatedKeys>()?.is_some() {}
                Ok(NoRepeatedKeys)
            }
            fn visit_bool<E>(self, _: bool) -> Result<NoRepeatedKeys, E> {
                Ok(NoRepeatedKeys)
            }
            fn visit_i64<E>(self, _: i64) -> Result<NoRepeatedKeys, E> {
                Ok(NoRepeatedKeys)
            }
            fn visit_u64<E>(self, _: u64) -> Result<NoRepeatedKeys, E> {
                Ok(NoRepeatedKeys)
            }
            fn visit_f64<E>(self, _: f64) -> Result<NoRepeatedKeys, E> {
                Ok(NoRepeatedKeys)
            }
            fn visit_str<E>(self, _: &str) -> Result<NoRepeatedKeys, E> {
                Ok(NoRepeatedKeys)
            }
            fn visit_unit<E>(self) -> Result<NoRepeatedKeys, E> {
                Ok(NoRepeatedKeys)
            }
        }
        d.deserialize_any(Visit)
    }
}

/// `201` answer to [`OpenStream`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Opened {
    /// The stream's id (its routes are `/v1/streams/{id}/...`).
    pub stream: u64,
    /// Batches per epoch for this rank.
    pub batches_per_epoch: u64,
    /// Epochs to deliver.
    pub epochs: u32,
    /// The state the stream starts from.
    pub state: StreamState,
    /// The idle timeout in effect.
    pub idle_timeout_s: u64,
}

/// A tensor of a batch: its bytes are at `/v1/leases/{lease}/tensors/{name}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorMeta {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<u64>,
    /// Byte length.
    pub length: u64,
}

impl From<&TensorView> for TensorMeta {
    fn from(t: &TensorView) -> Self {
        Self {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            length: t.length,
        }
    }
}

/// A leased batch (`200` answer to `POST /v1/streams/{id}/next`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchBody {
    /// Lease id (release it).
    pub lease: u64,
    /// Epoch.
    pub epoch: u32,
    /// Index within the epoch.
    pub index: u64,
    /// Shard index (`4294967295` in batch mode).
    pub shard: u32,
    /// Tensors.
    pub tensors: Vec<TensorMeta>,
}

/// The answer to `next` when the stream has delivered every epoch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndBody {
    /// Always true: `{"end": false}` does not parse (it is no end, and no batch either; the
    /// Python SDK refuses it too), so a [`NextBody`] never takes it for the end.
    #[serde(deserialize_with = "only_true")]
    pub end: bool,
}

/// A `true`, and nothing else.
fn only_true<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    if bool::deserialize(d)? {
        Ok(true)
    } else {
        Err(serde::de::Error::custom(
            "`end` is false: only `true` ends a stream",
        ))
    }
}

/// `200` answer to `next`: a batch, or the end (a timeout is `204` without a body).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum NextBody {
    /// A batch.
    Batch(BatchBody),
    /// The end.
    End(EndBody),
}

/// Answer to `POST /v1/streams/{id}/close`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClosedBody {
    /// The stream.
    pub stream: u64,
    /// Always true (closing twice is not an error).
    pub closed: bool,
}

/// Answer to `POST /v1/leases/{lease}/release`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleasedBody {
    /// Always true.
    pub released: bool,
}

/// Every error of the HTTP APIs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// Stable code.
    pub code: ErrorCode,
    /// What was wrong.
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_bodies_take_the_idle_timeout_out_and_refuse_unknown_fields() {
        let o = OpenStream::from_json(br#"{"dataset":"d","seed":4,"idle_timeout_s":7}"#).unwrap();
        assert_eq!((o.stream.dataset.as_str(), o.stream.seed), ("d", 4));
        assert_eq!(o.idle_timeout_s, Some(7));
        assert_eq!(OpenStream::from_json(&o.to_json()).unwrap(), o);
        let e = OpenStream::from_json(br#"{"dataset":"d","bogus":1}"#).unwrap_err();
        assert!(
            matches!(e, OpenBodyError::Json(_)) && e.to_string().contains("bogus"),
            "{e}"
        );
        let e = OpenStream::from_json(br#"{"dataset":"d","idle_timeout_s":-1}"#).unwrap_err();
        assert!(matches!(e, OpenBodyError::IdleTimeout(_)), "{e}");
        let none = OpenStream::from_json(br#"{"dataset":"d","idle_timeout_s":null}"#).unwrap();
        assert_eq!(none.idle_timeout_s, None);
        // A repeated key is refused, as the socket's attach refuses it (not the last one kept).
        for body in [
            &br#"{"dataset":"a","dataset":"b"}"#[..],
            br#"{"dataset":"a","idle_timeout_s":5,"idle_timeout_s":9}"#,
            // Inside nested objects too, at any depth.
            br#"{"dataset":"d","state":{"epoch":0,"epoch":5,"index":0,"seed":0}}"#,
            br#"{"mix":[{"dataset":"a","weight":1,"weight":9}],"batch_size":8}"#,
        ] {
            let e = OpenStream::from_json(body).unwrap_err();
            assert!(e.to_string().contains("duplicate field"), "{e}");
        }
        assert!(OpenStream::from_json(b"[1]").is_err());
        // Socket-only fields are refused by name, not taken and ignored.
        for f in ["batch_state", "batch_encoding"] {
            let body = format!(r#"{{"dataset":"d","{f}":true}}"#);
            let e = OpenStream::from_json(body.as_bytes()).unwrap_err();
            assert!(matches!(e, OpenBodyError::SocketOnly(g) if g == f), "{e}");
        }
    }

    #[test]
    fn a_line_break_in_a_key_is_escaped_in_the_error() {
        // Before, the message quoted the key with its `\n` decoded: the HTTP front's log line
        // showing it went on as a forged line.
        let e = OpenStream::from_json(br#"{"dataset":"d","x\nINFO forged\r":1}"#).unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, OpenBodyError::Json(_)), "{text}");
        assert!(!text.contains(|c: char| c.is_control()), "{text:?}");
        assert!(text.contains(r"x\nINFO forged\r"), "{text}");
    }

    #[test]
    fn next_bodies_are_a_batch_or_the_end() {
        let b: NextBody = serde_json::from_str(
            r#"{"lease":3,"epoch":0,"index":1,"shard":2,"tensors":[{"name":"x","dtype":"uint8","shape":[4],"length":4}]}"#,
        )
        .unwrap();
        assert!(matches!(&b, NextBody::Batch(b) if b.tensors[0].name == "x"));
        let e: NextBody = serde_json::from_str(r#"{"end":true}"#).unwrap();
        assert_eq!(e, NextBody::End(EndBody { end: true }));
        assert_eq!(serde_json::to_string(&e).unwrap(), r#"{"end":true}"#);
    }

    #[test]
    fn an_end_that_is_false_is_no_next_body() {
        // Before, `{"end": false}` parsed as the end: the client's `next` ended early.
        assert!(serde_json::from_str::<NextBody>(r#"{"end":false}"#).is_err());
        assert!(serde_json::from_str::<EndBody>(r#"{"end":false}"#).is_err());
        assert!(serde_json::from_str::<NextBody>(r#"{"end":1}"#).is_err());
    }
}
