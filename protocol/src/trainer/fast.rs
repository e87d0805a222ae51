//! The hot messages of a training loop (`next` and its `batch` answer), written and read by
//! hand. serde's derived code for an internally tagged enum first buffers the whole object
//! into a generic tree to find the tag; for these small messages that costs several times the
//! parse itself, on the critical path of every hand-off.
//!
//! The writers produce exactly the bytes `serde_json` produces. The readers accept only the
//! compact form (no whitespace, known fields in the order the writers use, for `next` in any
//! order; strings without escapes; plain decimal numbers) and return `None` for anything else,
//! which the callers then hand to the derived decoder: what is accepted, and every error
//! message, stay those of the derived code.

use super::messages::{Request, Response, StreamState, TensorView};
use crate::DType;

fn push_u64(out: &mut Vec<u8>, mut v: u64) {
    let mut buf = [0u8; 20];
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    out.extend_from_slice(&buf[i..]);
}

/// A JSON string, escaped as `serde_json` escapes it.
fn push_str(out: &mut Vec<u8>, s: &str) {
    if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    } else {
        serde_json::to_writer(&mut *out, s).expect("a string serialises");
    }
}

pub(super) fn encode_next(timeout_ms: Option<u64>, release: &[u64], count: u32, out: &mut Vec<u8>) {
    out.extend_from_slice(br#"{"op":"next","timeout_ms":"#);
    match timeout_ms {
        Some(t) => push_u64(out, t),
        None => out.extend_from_slice(b"null"),
    }
    if !release.is_empty() {
        out.extend_from_slice(br#","release":["#);
        for (k, l) in release.iter().enumerate() {
            if k > 0 {
                out.push(b',');
            }
            push_u64(out, *l);
        }
        out.push(b']');
    }
    if count != 1 {
        out.extend_from_slice(br#","count":"#);
        push_u64(out, count.into());
    }
    out.push(b'}');
}

pub(super) fn encode_batch(
    (lease, epoch, index, shard): (u64, u32, u64, u32),
    tensors: &[TensorView],
    (state, more): (Option<&StreamState>, bool),
    out: &mut Vec<u8>,
) {
    out.extend_from_slice(br#"{"op":"batch","lease":"#);
    push_u64(out, lease);
    out.extend_from_slice(br#","epoch":"#);
    push_u64(out, epoch.into());
    out.extend_from_slice(br#","index":"#);
    push_u64(out, index);
    out.extend_from_slice(br#","shard":"#);
    push_u64(out, shard.into());
    out.extend_from_slice(br#","tensors":["#);
    for (k, t) in tensors.iter().enumerate() {
        if k > 0 {
            out.push(b',');
        }
        out.extend_from_slice(br#"{"name":"#);
        push_str(out, &t.name);
        out.extend_from_slice(br#","dtype":""#);
        out.extend_from_slice(t.dtype.name().as_bytes());
        out.extend_from_slice(br#"","shape":["#);
        for (j, d) in t.shape.iter().enumerate() {
            if j > 0 {
                out.push(b',');
            }
            push_u64(out, *d);
        }
        out.extend_from_slice(br#"],"offset":"#);
        push_u64(out, t.offset);
        out.extend_from_slice(br#","length":"#);
        push_u64(out, t.length);
        out.push(b'}');
    }
    out.push(b']');
    if let Some(st) = state {
        // Small and rare next to the tensors: serde writes it, as the derived code would.
        out.extend_from_slice(br#","state":"#);
        serde_json::to_writer(&mut *out, st).expect("a stream state serialises");
    }
    if more {
        out.extend_from_slice(br#","more":true"#);
    }
    out.push(b'}');
}

/// A reader of the compact form; every method returns `None` on anything unexpected.
struct Cursor<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Cursor<'a> {
    fn lit(&mut self, s: &[u8]) -> Option<()> {
        if self.b[self.i..].starts_with(s) {
            self.i += s.len();
            Some(())
        } else {
            None
        }
    }

    fn eat(&mut self, s: &[u8]) -> bool {
        self.lit(s).is_some()
    }

    /// A plain decimal: no sign, fraction, exponent or leading zero.
    fn u64(&mut self) -> Option<u64> {
        let digits = self.b[self.i..]
            .iter()
            .take_while(|b| b.is_ascii_digit())
            .count();
        if digits == 0 || (digits > 1 && self.b[self.i] == b'0') {
            return None;
        }
        let mut v: u64 = 0;
        for &d in &self.b[self.i..self.i + digits] {
            v = v.checked_mul(10)?.checked_add(u64::from(d - b'0'))?;
        }
        self.i += digits;
        Some(v)
    }

    fn u32(&mut self) -> Option<u32> {
        u32::try_from(self.u64()?).ok()
    }

    /// `[n,n,...]`.
    fn u64s(&mut self) -> Option<Vec<u64>> {
        self.lit(b"[")?;
        let mut v = Vec::new();
        if self.eat(b"]") {
            return Some(v);
        }
        loop {
            v.push(self.u64()?);
            if !self.eat(b",") {
                self.lit(b"]")?;
                return Some(v);
            }
        }
    }

    /// A string without escapes or control characters.
    fn str(&mut self) -> Option<&'a str> {
        self.lit(b"\"")?;
        let rest = &self.b[self.i..];
        let n = rest
            .iter()
            .position(|&b| b == b'"' || b == b'\\' || b < 0x20)?;
        if rest[n] != b'"' {
            return None;
        }
        let s = std::str::from_utf8(&rest[..n]).ok()?;
        self.i += n + 1;
        Some(s)
    }

    fn end(&self) -> Option<()> {
        (self.i == self.b.len()).then_some(())
    }
}

fn dtype(name: &str) -> Option<DType> {
    DType::from_name(name)
}

/// `{"op":"next"` then `timeout_ms` (a number or null), `release` and `count`, each at most
/// once.
pub(super) fn decode_next(body: &[u8]) -> Option<Request> {
    let mut c = Cursor { b: body, i: 0 };
    c.lit(br#"{"op":"next""#)?;
    let (mut timeout_ms, mut release, mut count) = (None, None, None);
    while !c.eat(b"}") {
        if c.eat(br#","timeout_ms":"#) {
            if timeout_ms.is_some() {
                return None; // duplicate: the derived decoder words the error
            }
            timeout_ms = Some(if c.eat(b"null") { None } else { Some(c.u64()?) });
        } else if c.eat(br#","release":"#) {
            if release.is_some() {
                return None;
            }
            release = Some(c.u64s()?);
        } else if c.eat(br#","count":"#) {
            if count.is_some() {
                return None;
            }
            count = Some(c.u32()?);
        } else {
            return None;
        }
    }
    c.end()?;
    Some(Request::Next {
        timeout_ms: timeout_ms.flatten(),
        release: release.unwrap_or_default(),
        count: count.unwrap_or(1),
    })
}

/// Exactly what [`encode_batch`] writes (strings without escapes).
pub(super) fn decode_batch(body: &[u8]) -> Option<Response> {
    let mut c = Cursor { b: body, i: 0 };
    c.lit(br#"{"op":"batch","lease":"#)?;
    let lease = c.u64()?;
    c.lit(br#","epoch":"#)?;
    let epoch = c.u32()?;
    c.lit(br#","index":"#)?;
    let index = c.u64()?;
    c.lit(br#","shard":"#)?;
    let shard = c.u32()?;
    c.lit(br#","tensors":["#)?;
    let mut tensors = Vec::new();
    if !c.eat(b"]") {
        loop {
            c.lit(br#"{"name":"#)?;
            let name = c.str()?.to_owned();
            c.lit(br#","dtype":"#)?;
            let dtype = dtype(c.str()?)?;
            c.lit(br#","shape":"#)?;
            let shape = c.u64s()?;
            c.lit(br#","offset":"#)?;
            let offset = c.u64()?;
            c.lit(br#","length":"#)?;
            let length = c.u64()?;
            c.lit(b"}")?;
            tensors.push(TensorView {
                name,
                dtype,
                shape,
                offset,
                length,
            });
            if !c.eat(b",") {
                c.lit(b"]")?;
                break;
            }
        }
    }
    let more = c.eat(br#","more":true"#);
    c.lit(b"}")?;
    c.end()?;
    Some(Response::Batch {
        lease,
        epoch,
        index,
        shard,
        tensors,
        state: None, // a batch with a state is left to the derived decoder
        more,
    })
}
