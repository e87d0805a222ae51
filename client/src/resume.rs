//! [`ResumeState`]: a stream's resume state as the node wrote it, kept whole, for a trainer to
//! save in its checkpoint and pass back when it resumes.
//!
//! The node decides what a state means: it refuses one with a field it does not know (the
//! protocol's [`StreamState`] and its [`MixState`] refuse unknown fields), since a field it
//! ignored could move where the stream resumes (`cursor`, `partitions`, `shuffle_block` and
//! `mix` were each added to the state after the first). This client only carries the state, so
//! it keeps the fields it does not know (a newer node's or SDK's), at the top level and inside
//! `mix`, instead of refusing them, as the Python SDK carries its state as a plain dict, and
//! sends them back, byte for byte, on the attach that resumes: a node that knows them resumes
//! exactly there, an older one refuses the state naming the field. The fields this client
//! knows are checked as strictly as [`StreamState`] checks them (type, presence, a key given
//! twice, also inside an unknown field's value); the fingerprint, which the node compares, is
//! what says whether a state fits a stream (the state has no version of its own).

use std::collections::BTreeMap;
use std::marker::PhantomData;

use serde::de::{self, DeserializeOwned, DeserializeSeed, MapAccess, Visitor};
use serde::ser::{self, SerializeMap};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use shardwire_protocol::trainer::http::NoRepeatedKeys;
use shardwire_protocol::trainer::{MixState, StreamState};

use crate::ClientError;

/// Fields a struct does not know, by name, each value kept as its JSON text.
type Unknown = BTreeMap<String, Box<RawValue>>;

/// The one field of a state that is itself a struct of fields ([`StreamState::mix`]).
const MIX: &str = "mix";

/// A stream's resume state: the fields this client knows ([`ResumeState::known`]) and those
/// it does not (written by a newer node or SDK, at the top level or inside `mix`), kept as
/// they came.
///
/// Its serialised form is JSON, and only JSON: it serialises to the object the node wrote,
/// unknown fields included, each value byte for byte (an integer beyond `u64`, `1.10`, the
/// spacing inside a value), and deserialises from it with `serde_json` (`from_str`,
/// `from_slice`, `from_reader`, or as a field of a derived struct; `from_value` too, keeping
/// what the `Value` kept): unknown fields are kept, a known field of the wrong type, a missing
/// one or a key given twice (at any depth) is refused, naming it. [`ResumeState::to_json`]
/// and [`ResumeState::from_json`] do both. A non-JSON format (bincode, CBOR) cannot carry the
/// unknown fields' JSON text, nor can serde's buffering adapters (`#[serde(flatten)]`,
/// untagged or internally tagged enums): decoding a state with unknown fields through them
/// fails. Resume from it with [`crate::Stream::open_from`] or
/// [`crate::http::HttpStream::open_from`], which send the unknown fields back to the node.
#[derive(Clone, Debug)]
pub struct ResumeState {
    known: StreamState,
    /// Top-level fields this client does not know.
    unknown: Unknown,
    /// Fields of `mix` this client does not know (none without a `mix`).
    mix_unknown: Unknown,
}

impl ResumeState {
    /// The fields this client knows.
    pub fn known(&self) -> &StreamState {
        &self.known
    }

    /// The names of the fields this client does not know (empty for a state of this
    /// client's own version): a top-level field by its name, one inside `mix` as `mix.NAME`.
    pub fn unknown_fields(&self) -> Vec<String> {
        let mix = self.mix_unknown.keys().map(|name| format!("{MIX}.{name}"));
        self.unknown.keys().cloned().chain(mix).collect()
    }

    /// The state as a [`StreamState`]: refused with [`ClientError::StateFieldsUnknown`] when
    /// it has fields this client does not know, since dropping them could resume the stream
    /// somewhere else.
    pub fn into_known(self) -> Result<StreamState, ClientError> {
        if !self.has_unknown() {
            return Ok(self.known);
        }
        Err(ClientError::StateFieldsUnknown {
            fields: self.unknown_fields(),
        })
    }

    /// The state's JSON object (what a checkpoint saves), unknown fields as they came.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a resume state serialises to JSON")
    }

    /// A state from its JSON object ([`ResumeState::to_json`]'s), checked as the type says.
    pub fn from_json(json: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(json)
    }

    /// Whether it has fields this client does not know.
    pub(crate) fn has_unknown(&self) -> bool {
        !(self.unknown.is_empty() && self.mix_unknown.is_empty())
    }
}

impl PartialEq for ResumeState {
    fn eq(&self, other: &Self) -> bool {
        let same = |a: &Unknown, b: &Unknown| {
            a.len() == b.len()
                && a.iter()
                    .zip(b)
                    .all(|((na, va), (nb, vb))| na == nb && va.get() == vb.get())
        };
        self.known == other.known
            && same(&self.unknown, &other.unknown)
            && same(&self.mix_unknown, &other.mix_unknown)
    }
}

impl Eq for ResumeState {}

impl From<StreamState> for ResumeState {
    fn from(known: StreamState) -> Self {
        Self {
            known,
            unknown: Unknown::new(),
            mix_unknown: Unknown::new(),
        }
    }
}

impl Serialize for ResumeState {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let known = serde_json::to_value(&self.known).map_err(<S::Error as ser::Error>::custom)?;
        let Value::Object(known) = known else {
            return Err(ser::Error::custom("a stream state serialises to an object"));
        };
        let fields = Fields {
            known: &known,
            unknown: &self.unknown,
            mix_unknown: Some(&self.mix_unknown),
        };
        fields.serialize(s)
    }
}

/// An object written as a struct's fields (`known`, its JSON) followed by the fields it does
/// not know, each as it came; `mix_unknown`, when given, joins the fields of its `mix`.
struct Fields<'a> {
    known: &'a Map<String, Value>,
    unknown: &'a Unknown,
    mix_unknown: Option<&'a Unknown>,
}

impl Serialize for Fields<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.known.len() + self.unknown.len()))?;
        for (name, value) in self.known {
            match (value, self.mix_unknown) {
                (Value::Object(mix), Some(unknown)) if name == MIX => {
                    let mix = Fields {
                        known: mix,
                        unknown,
                        mix_unknown: None,
                    };
                    map.serialize_entry(name, &mix)?;
                }
                _ => map.serialize_entry(name, value)?,
            }
        }
        for (name, value) in self.unknown {
            map.serialize_entry(name, value)?;
        }
        map.end()
    }
}

/// The JSON of `request` (an object: the socket's `attach`, the HTTP open body) with `state`,
/// whole, as its `state`: the fields of it this client does not know go to the node as they
/// came.
pub(crate) fn with_state(request: &impl Serialize, state: &ResumeState) -> Box<RawValue> {
    let mut fields = match serde_json::to_value(request) {
        Ok(Value::Object(fields)) => fields,
        other => panic!("a request serialises to a JSON object, not {other:?}"),
    };
    fields.remove("state");
    let state = RawValue::from_string(state.to_json()).expect("a resume state is JSON");
    let whole = Fields {
        known: &fields,
        unknown: &Unknown::from([("state".to_string(), state)]),
        mix_unknown: None,
    };
    let json = serde_json::to_string(&whole).expect("a request serialises to JSON");
    RawValue::from_string(json).expect("a request is JSON")
}

impl<'de> Deserialize<'de> for ResumeState {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let state = Split::<StreamState>::deserialize(d)?;
        Ok(Self {
            known: state.known,
            unknown: state.unknown,
            mix_unknown: state.mix_unknown,
        })
    }
}

/// A `T` (a derived struct that refuses the fields it does not know: [`StreamState`],
/// [`MixState`]) decoded from an object whose other fields are set aside, as they came.
struct Split<T> {
    known: T,
    unknown: Unknown,
    /// The fields of its `mix` it does not know ([`StreamState`]'s; none for [`MixState`]).
    mix_unknown: Unknown,
}

impl<'de, T: DeserializeOwned> Deserialize<'de> for Split<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(SplitVisitor(PhantomData))
    }
}

struct SplitVisitor<T>(PhantomData<T>);

impl<'de, T: DeserializeOwned> Visitor<'de> for SplitVisitor<T> {
    type Value = Split<T>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("an object (a stream's resume state, or its `mix`)")
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Split<T>, A::Error> {
        let mut fields = KnownFields {
            map,
            names: field_names::<T>(),
            unknown: Unknown::new(),
            mix_unknown: Unknown::new(),
            key: None,
        };
        let known = T::deserialize(de::value::MapAccessDeserializer::new(&mut fields))?;
        Ok(Split {
            known,
            unknown: fields.unknown,
            mix_unknown: fields.mix_unknown,
        })
    }
}

/// The entries of an object as a derived struct's decoder sees them: its own fields only
/// (checked by it); the others are set aside in `unknown`, each checked for a repeated key.
/// Its `mix` (a [`StreamState`]'s) is split likewise, its unknown fields set aside in
/// `mix_unknown`.
struct KnownFields<A> {
    map: A,
    /// The struct's field names.
    names: &'static [&'static str],
    unknown: Unknown,
    mix_unknown: Unknown,
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
            let value = self.map.next_value::<Box<RawValue>>()?;
            // Kept as text, so checked here: a `Map` would keep the last of a repeated key.
            if let Err(e) = serde_json::from_str::<NoRepeatedKeys>(value.get()) {
                return Err(de::Error::custom(format_args!("field `{key}`: {e}")));
            }
            if self.unknown.insert(key.clone(), value).is_some() {
                return Err(de::Error::custom(format_args!("duplicate field `{key}`")));
            }
        }
        Ok(None)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, A::Error> {
        let key = self.key.take().unwrap_or_default();
        let named = |e: &dyn std::fmt::Display| -> A::Error {
            de::Error::custom(format_args!("field `{key}`: {e}"))
        };
        if key != MIX {
            return self.map.next_value_seed(seed).map_err(|e| named(&e));
        }
        // A struct that refuses unknown fields itself: split likewise, its known fields handed
        // to the state's decoder.
        let mix = self
            .map
            .next_value::<Option<Split<MixState>>>()
            .map_err(|e| named(&e))?;
        let known = mix.map(|mix| {
            self.mix_unknown = mix.unknown;
            mix.known
        });
        let known = serde_json::to_value(known).map_err(|e| named(&e))?;
        seed.deserialize(known).map_err(|e| named(&e))
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
/// then stands): no such state, a key given twice anywhere in it (the strict decoder refuses
/// one; the `Map` it is read into here would keep the last), or the answer is wrong besides.
pub(crate) fn with_unknown_state<T: DeserializeOwned>(body: &[u8]) -> Option<(T, ResumeState)> {
    #[derive(Deserialize)]
    struct StateOf {
        state: Option<ResumeState>,
    }
    serde_json::from_slice::<NoRepeatedKeys>(body).ok()?;
    let state = serde_json::from_slice::<StateOf>(body).ok()?.state?;
    if !state.has_unknown() {
        return None;
    }
    let mut answer: Map<String, Value> = serde_json::from_slice(body).ok()?;
    answer.insert("state".into(), serde_json::to_value(&state.known).ok()?);
    let answer = serde_json::from_value(Value::Object(answer)).ok()?;
    Some((answer, state))
}

#[cfg(test)]
mod tests {
    use shardwire_protocol::trainer::Response;

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
        // Inside `mix`, as MixState checks them, named with `mix`.
        for (bad, names) in [
            (r#""step":"x","later":1"#, "`step`"),
            (r#""step":0,"step":1"#, "`step`"),
            (r#""step":0,"later":1,"later":2"#, "`later`"),
        ] {
            let bad = format!(
                r#"{{"epoch":0,"index":0,"seed":0,"fingerprint":"f","mix":{{{bad},
                "datasets":[],"weights":[],"cursors":[],"carry":[]}}}}"#
            );
            let e = ResumeState::from_json(&bad).unwrap_err().to_string();
            assert!(e.contains("`mix`") && e.contains(names), "{bad}: {e}");
        }
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
            serde_json::to_value(ResumeState::from(full.clone())).unwrap(),
            serde_json::to_value(&full).unwrap()
        );
    }

    const MIXED: &str = r#"{"epoch":0,"index":0,"seed":0,"fingerprint":"f","mix":{"step":4,
        "datasets":["a"],"weights":[1],"cursors":[4],"carry":[0],"later":{"x":[1]}},"top":2}"#;

    #[test]
    fn unknown_fields_inside_mix_are_kept_and_written_back() {
        // Before, MixState's decoder refused them, failing the state (and the connection
        // whose answer carried it).
        assert!(serde_json::from_str::<StreamState>(MIXED).is_err());
        let st = ResumeState::from_json(MIXED).unwrap();
        assert_eq!(
            st.known().mix.as_ref().map(|m| m.cursors.clone()),
            Some(vec![4])
        );
        assert_eq!(st.unknown_fields(), ["top", "mix.later"]);
        let back: Value = serde_json::from_str(&st.to_json()).unwrap();
        assert_eq!(back, serde_json::from_str::<Value>(MIXED).unwrap());
        assert_eq!(ResumeState::from_json(&st.to_json()).unwrap(), st);
        let e = st.clone().into_known().unwrap_err();
        let ClientError::StateFieldsUnknown { fields } = &e else {
            panic!("{e}")
        };
        assert_eq!(fields, &["top", "mix.later"]);
        // Only in `mix`, an unknown field still makes the state one this client cannot
        // take as a StreamState.
        let only_mix = MIXED.replace(r#","top":2"#, "");
        let st = ResumeState::from_json(&only_mix).unwrap();
        assert_eq!(st.unknown_fields(), ["mix.later"]);
        assert!(st.into_known().is_err());
        // And an answer whose state has one decodes with its known fields.
        let body = format!(
            r#"{{"op":"batch","lease":3,"epoch":0,"index":1,"shard":0,"tensors":[],
            "state":{only_mix}}}"#
        );
        assert!(Response::decode(body.as_bytes()).is_err());
        let (answer, st) = with_unknown_state::<Response>(body.as_bytes()).expect("decodes");
        let Response::Batch { state, .. } = answer else {
            panic!("not a batch")
        };
        assert_eq!(state.as_ref(), Some(st.known()));
    }

    #[test]
    fn unknown_values_go_back_byte_for_byte() {
        // Through serde_json::Value, the integer became 1.8446744073709552e22, 1.10 became 1.1
        // and the spacing went.
        let odd = r#"{"big":18446744073709551616123,"dec":1.10,"spaced":{"a": [1, 2]}}"#;
        let json = NEWER.replace(r#""flag":true}"#, &odd[1..]);
        let st = ResumeState::from_json(&json).unwrap();
        let back = st.to_json();
        for kept in [
            r#""big":18446744073709551616123"#,
            r#""dec":1.10"#,
            r#""spaced":{"a": [1, 2]}"#,
        ] {
            assert!(back.contains(kept), "{kept} in {back}");
        }
        // As sent to the node, too.
        let frame = with_state(&serde_json::json!({"op": "attach", "state": null}), &st);
        assert!(
            frame.get().contains(r#""big":18446744073709551616123"#),
            "{frame}"
        );
        let sent: Value = serde_json::from_str(frame.get()).unwrap();
        assert_eq!(sent["op"], "attach", "{sent}");
        assert_eq!(sent["state"]["index"], 7, "{sent}");
    }

    #[test]
    fn a_key_given_twice_is_refused_inside_unknown_fields_and_in_the_answer() {
        // Before, the unknown field was read into a Map, which kept the last one.
        let twice = r#"{"epoch":0,"index":2,"seed":0,"fingerprint":"f","added":{"x":1,"x":2}}"#;
        let e = ResumeState::from_json(twice).unwrap_err().to_string();
        assert!(e.contains("`added`") && e.contains("`x`"), "{e}");
        let body = format!(
            r#"{{"op":"batch","lease":3,"epoch":0,"index":1,"shard":0,"tensors":[],
            "state":{twice}}}"#
        );
        assert!(with_unknown_state::<Response>(body.as_bytes()).is_none());
        // A key of the answer given twice: refused by the strict decoder, so by the fallback,
        // which read the answer into a Map that kept the last `lease`.
        let body = br#"{"op":"batch","lease":3,"lease":4,"epoch":0,"index":1,"shard":0,
            "tensors":[],"state":{"epoch":0,"index":2,"seed":0,"fingerprint":"f","added":1}}"#;
        assert!(Response::decode(body).is_err());
        assert!(with_unknown_state::<Response>(body).is_none());
        let once = br#"{"op":"batch","lease":3,"epoch":0,"index":1,"shard":0,
            "tensors":[],"state":{"epoch":0,"index":2,"seed":0,"fingerprint":"f","added":1}}"#;
        assert!(with_unknown_state::<Response>(once).is_some());
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
