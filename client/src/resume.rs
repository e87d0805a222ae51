//! [`ResumeState`]: a stream's resume state as the node wrote it, kept whole, for a trainer to
//! save in its checkpoint and pass back when it resumes.
//!
//! The node decides what a state means: it refuses one with a field it does not know (the
//! protocol's [`StreamState`] refuses unknown fields), since a field it ignored could move
//! where the stream resumes (`cursor`, `partitions`, `shuffle_block` and `mix` were each added
//! to the state after the first). This client only carries the state, so it keeps the fields
//! it does not know (a newer node's or SDK's) instead of refusing them, as the Python SDK
//! carries its state as a plain dict, and sends them back on the attach that resumes: a node
//! that knows them resumes exactly there, an older one refuses the state naming the field.
//! The fields this client knows are checked as strictly as [`StreamState`] checks them (type,
//! presence, a key given twice); the fingerprint, which the node compares, is what says
//! whether a state fits a stream (the state has no version of its own).

use serde::de::{self, DeserializeOwned, DeserializeSeed, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};
use shardwire_protocol::trainer::StreamState;

use crate::ClientError;

/// A stream's resume state: the fields this client knows ([`ResumeState::known`]) and those
/// it does not (written by a newer node or SDK), kept as they came.
///
/// It serialises (JSON, for a checkpoint) to the object the node wrote, unknown fields
/// included, and deserialises from it: unknown fields are kept, a known field of the wrong
/// type, a missing one or a key given twice is refused, naming it. Resume from it with
/// [`crate::Stream::open_from`] or [`crate::http::HttpStream::open_from`], which send the
/// unknown fields back to the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResumeState {
    known: StreamState,
    unknown: Map<String, Value>,
}

impl ResumeState {
    /// The fields this client knows.
    pub fn known(&self) -> &StreamState {
        &self.known
    }

    /// The names of the fields this client does not know (empty for a state of this
    /// client's own version).
    pub fn unknown_fields(&self) -> Vec<String> {
        self.unknown.keys().cloned().collect()
    }

    /// The state as a [`StreamState`]: refused with [`ClientError::StateFieldsUnknown`] when
    /// it has fields this client does not know, since dropping them could resume the stream
    /// somewhere else.
    pub fn into_known(self) -> Result<StreamState, ClientError> {
        if self.unknown.is_empty() {
            return Ok(self.known);
        }
        Err(ClientError::StateFieldsUnknown {
            fields: self.unknown_fields(),
        })
    }

    /// The state's JSON object, unknown fields included.
    pub(crate) fn to_value(&self) -> Value {
        let mut v = serde_json::to_value(&self.known).expect("a stream state serialises");
        if let Some(fields) = v.as_object_mut() {
            fields.extend(self.unknown.clone());
        }
        v
    }
}

impl From<StreamState> for ResumeState {
    fn from(known: StreamState) -> Self {
        Self {
            known,
            unknown: Map::new(),
        }
    }
}

impl Serialize for ResumeState {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_value().serialize(s)
    }
}

impl<'de> Deserialize<'de> for ResumeState {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(StateVisitor)
    }
}

struct StateVisitor;

impl<'de> Visitor<'de> for StateVisitor {
    type Value = ResumeState;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a stream's resume state (an object)")
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<ResumeState, A::Error> {
        let mut fields = KnownFields {
            map,
            names: field_names::<StreamState>(),
            unknown: Map::new(),
            key: None,
        };
        let known = StreamState::deserialize(de::value::MapAccessDeserializer::new(&mut fields))?;
        Ok(ResumeState {
            known,
            unknown: fields.unknown,
        })
    }
}

/// The entries of a state object as [`StreamState`]'s derived decoder sees them: its own
/// fields only (checked by it); the others are set aside in `unknown`.
struct KnownFields<A> {
    map: A,
    /// [`StreamState`]'s field names.
    names: &'static [&'static str],
    unknown: Map<String, Value>,
    /// The known field whose value is read next, to name it in an error.
    key: Option<String>,
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for KnownFields<A> {
    type Error = A::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, A::Error> {
        while let Some(key) = self.map.next_key::<String>()? {
            if self.names.iter().any(|&name| name == key) {
                let field = seed.deserialize(de::value::StrDeserializer::<A::Error>::new(&key))?;
                self.key = Some(key);
                return Ok(Some(field));
            }
            let value = self.map.next_value::<Value>()?;
            if self.unknown.insert(key.clone(), value).is_some() {
                return Err(de::Error::custom(format_args!("duplicate field `{key}`")));
            }
        }
        Ok(None)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, A::Error> {
        let key = self.key.take().unwrap_or_default();
        self.map
            .next_value_seed(seed)
            .map_err(|e| de::Error::custom(format_args!("field `{key}`: {e}")))
    }
}

/// The field names a derived `Deserialize` struct `T` takes (the list its decoder is built
/// with), read by asking it to decode from a deserializer that only records them: so the
/// fields set aside as unknown are exactly those `T` would refuse.
fn field_names<T: DeserializeOwned>() -> &'static [&'static str] {
    let mut names: &'static [&'static str] = &[];
    let _ = T::deserialize(FieldNames(&mut names));
    names
}

/// A deserializer that records the field names of the struct asked of it, and fails.
struct FieldNames<'a>(&'a mut &'static [&'static str]);

impl<'de> Deserializer<'de> for FieldNames<'_> {
    type Error = de::value::Error;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(de::Error::custom("only a struct's field names are read"))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, Self::Error> {
        *self.0 = fields;
        Err(de::Error::custom("only a struct's field names are read"))
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}

/// A JSON answer `body` (a `T`: `attached`, `batch`, the HTTP open's) that the strict decoder
/// refused because its `state` has fields this client does not know: the answer with the
/// state's known fields, and the whole state. None when that is not why (the strict error
/// then stands): no such state, or the answer is wrong besides.
pub(crate) fn with_unknown_state<T: DeserializeOwned>(body: &[u8]) -> Option<(T, ResumeState)> {
    #[derive(Deserialize)]
    struct StateOf {
        state: Option<ResumeState>,
    }
    let state = serde_json::from_slice::<StateOf>(body).ok()?.state?;
    if state.unknown.is_empty() {
        return None;
    }
    let mut answer: Map<String, Value> = serde_json::from_slice(body).ok()?;
    answer.insert("state".into(), serde_json::to_value(&state.known).ok()?);
    let answer = serde_json::from_value(Value::Object(answer)).ok()?;
    Some((answer, state))
}

#[cfg(test)]
mod tests {
    use shardwire_protocol::trainer::{MixState, Response};

    use super::*;

    const NEWER: &str = r#"{"epoch":1,"index":7,"seed":3,"fingerprint":"f","cursor":56,
        "added":{"nested":[1,2]},"flag":true}"#;

    #[test]
    fn unknown_fields_are_kept_and_written_back_as_they_came() {
        // Before, the only state type (StreamState) refused a newer node's or SDK's state.
        assert!(serde_json::from_str::<StreamState>(NEWER).is_err());
        let st: ResumeState = serde_json::from_str(NEWER).unwrap();
        assert_eq!((st.known().epoch, st.known().index), (1, 7));
        assert_eq!(st.known().cursor, Some(56));
        assert_eq!(st.unknown_fields(), ["added", "flag"]);
        let back = serde_json::to_value(&st).unwrap();
        assert_eq!(back, serde_json::from_str::<Value>(NEWER).unwrap());
        let again: ResumeState = serde_json::from_value(back).unwrap();
        assert_eq!(again, st);
    }

    #[test]
    fn a_state_with_unknown_fields_is_not_taken_as_a_stream_state() {
        let st: ResumeState = serde_json::from_str(NEWER).unwrap();
        let e = st.into_known().unwrap_err();
        assert!(
            matches!(&e, ClientError::StateFieldsUnknown { fields } if fields == &["added", "flag"]),
            "{e}"
        );
        let msg = e.to_string();
        assert!(
            msg.contains("\"added\"") && msg.contains("resume_state()"),
            "{msg}"
        );
        let plain = r#"{"epoch":0,"index":2,"seed":0,"fingerprint":"f"}"#;
        let st: ResumeState = serde_json::from_str(plain).unwrap();
        assert_eq!(st.into_known().unwrap().index, 2);
    }

    #[test]
    fn known_fields_are_checked_as_strictly_as_a_stream_state_checks_them() {
        for (bad, names) in [
            (
                r#"{"epoch":0,"index":"x","seed":0,"fingerprint":"f"}"#,
                "`index`",
            ),
            (
                r#"{"epoch":0,"index":0,"fingerprint":"f","new":1}"#,
                "`seed`",
            ),
            (
                r#"{"epoch":0,"epoch":5,"index":0,"seed":0,"fingerprint":"f"}"#,
                "`epoch`",
            ),
            (
                r#"{"epoch":0,"index":0,"seed":0,"fingerprint":"f","n":1,"n":2}"#,
                "`n`",
            ),
            (
                r#"{"epoch":0,"index":0,"seed":0,"fingerprint":"f","cursor":-1}"#,
                "`cursor`",
            ),
        ] {
            let e = serde_json::from_str::<ResumeState>(bad)
                .unwrap_err()
                .to_string();
            assert!(e.contains(names), "{bad}: {e}");
        }
        // Inside `mix`, as MixState decodes it: its own unknown fields are refused by name.
        let mixed = r#"{"epoch":0,"index":0,"seed":0,"fingerprint":"f","mix":{"step":0,
            "datasets":[],"weights":[],"cursors":[],"carry":[],"later":1}}"#;
        let e = serde_json::from_str::<ResumeState>(mixed)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`mix`") && e.contains("later"), "{e}");
        assert!(serde_json::from_str::<ResumeState>("[1]").is_err());
    }

    #[test]
    fn every_field_a_stream_state_has_is_known() {
        let full = StreamState {
            epoch: 1,
            index: 2,
            seed: 3,
            fingerprint: "f".into(),
            cursor: Some(4),
            partitions: Some(5),
            shuffle_block: Some(6),
            mix: Some(MixState {
                step: 7,
                datasets: vec!["a".into()],
                weights: vec![1],
                cursors: vec![8],
                carry: vec![0],
            }),
        };
        let st: ResumeState = serde_json::from_value(serde_json::to_value(&full).unwrap()).unwrap();
        assert!(st.unknown_fields().is_empty(), "{:?}", st.unknown_fields());
        assert_eq!(st.into_known().unwrap(), full);
        assert_eq!(
            ResumeState::from(full.clone()).to_value(),
            serde_json::to_value(&full).unwrap()
        );
    }

    #[test]
    fn an_answer_whose_state_has_unknown_fields_decodes_with_its_known_ones() {
        let body = br#"{"op":"batch","lease":3,"epoch":0,"index":1,"shard":0,"tensors":[],
            "state":{"epoch":0,"index":2,"seed":0,"fingerprint":"f","added":1}}"#;
        // Before, the whole answer was refused.
        assert!(Response::decode(body).is_err());
        let (answer, st) = with_unknown_state::<Response>(body).expect("decodes");
        let Response::Batch { lease, state, .. } = answer else {
            panic!("not a batch")
        };
        assert_eq!((lease, state.as_ref()), (3, Some(st.known())));
        assert_eq!(st.unknown_fields(), ["added"]);
        // An answer wrong besides, or whose state is whole, is left to the strict error.
        let wrong = br#"{"op":"batch","lease":3,"surprise":1,
            "state":{"epoch":0,"index":2,"seed":0,"fingerprint":"f","added":1}}"#;
        assert!(with_unknown_state::<Response>(wrong).is_none());
        let plain = br#"{"op":"batch","lease":1,"surprise":true}"#;
        assert!(with_unknown_state::<Response>(plain).is_none());
    }
}
