//! A small, strict parser for the Python literals numpy writes in a `.npy` header
//! (`{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }`).
//!
//! It understands strings, `True`/`False`/`None`, non-negative integers, tuples, lists and
//! dicts, which covers every header numpy produces (structured dtypes are lists of tuples).

/// A parsed Python literal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Lit {
    /// `'text'` or `"text"`.
    Str(String),
    /// `True` / `False`.
    Bool(bool),
    /// `None`.
    None,
    /// A non-negative integer.
    Int(u64),
    /// `(a, b)`.
    Tuple(Vec<Lit>),
    /// `[a, b]`.
    List(Vec<Lit>),
    /// `{k: v}`, in source order.
    Dict(Vec<(Lit, Lit)>),
}

impl std::fmt::Display for Lit {
    /// Writes the literal back in Python syntax (for error messages).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        fn list(f: &mut std::fmt::Formatter<'_>, items: &[Lit]) -> std::fmt::Result {
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{x}")?;
            }
            Ok(())
        }
        match self {
            Self::Str(s) => write!(f, "'{}'", s.replace('\\', "\\\\").replace('\'', "\\'")),
            Self::Bool(true) => f.write_str("True"),
            Self::Bool(false) => f.write_str("False"),
            Self::None => f.write_str("None"),
            Self::Int(n) => write!(f, "{n}"),
            Self::Tuple(v) if v.len() == 1 => write!(f, "({},)", v[0]),
            Self::Tuple(v) => {
                f.write_str("(")?;
                list(f, v)?;
                f.write_str(")")
            }
            Self::List(v) => {
                f.write_str("[")?;
                list(f, v)?;
                f.write_str("]")
            }
            Self::Dict(kv) => {
                f.write_str("{")?;
                for (i, (k, v)) in kv.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{k}: {v}")?;
                }
                f.write_str("}")
            }
        }
    }
}

/// Nesting limit (numpy headers nest a few levels at most).
const MAX_DEPTH: usize = 16;

/// Parses `text` as exactly one literal (surrounding whitespace allowed).
pub(crate) fn parse(text: &str) -> Result<Lit, String> {
    let mut p = Parser {
        s: text.as_bytes(),
        i: 0,
    };
    let v = p.value(0)?;
    p.ws();
    if p.i != p.s.len() {
        return Err(format!("unexpected text after the literal at byte {}", p.i));
    }
    Ok(v)
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn ws(&mut self) {
        while self.i < self.s.len() && self.s[self.i].is_ascii_whitespace() {
            self.i += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.ws();
        self.s.get(self.i).copied()
    }

    fn value(&mut self, depth: usize) -> Result<Lit, String> {
        if depth > MAX_DEPTH {
            return Err("literal nests too deeply".into());
        }
        match self.peek() {
            None => Err("unexpected end of header".into()),
            Some(b'\'' | b'"') => self.string(),
            Some(b'(') => self.paren(depth),
            Some(b'[') => self.seq(b']', depth).map(Lit::List),
            Some(b'{') => self.dict(depth),
            Some(c) if c.is_ascii_digit() => self.int(),
            Some(c) if c.is_ascii_alphabetic() => self.word(),
            Some(c) => Err(format!(
                "unexpected character {:?} at byte {}",
                c as char, self.i
            )),
        }
    }

    fn string(&mut self) -> Result<Lit, String> {
        let quote = self.s[self.i];
        self.i += 1;
        let mut out = Vec::new();
        loop {
            match self.s.get(self.i).copied() {
                None => return Err("unterminated string".into()),
                Some(c) if c == quote => {
                    self.i += 1;
                    break;
                }
                Some(b'\\') => {
                    let esc = self
                        .s
                        .get(self.i + 1)
                        .copied()
                        .ok_or("unterminated string")?;
                    if !matches!(esc, b'\\' | b'\'' | b'"') {
                        return Err(format!("unsupported escape \\{} in string", esc as char));
                    }
                    out.push(esc);
                    self.i += 2;
                }
                Some(c) => {
                    out.push(c);
                    self.i += 1;
                }
            }
        }
        String::from_utf8(out)
            .map(Lit::Str)
            .map_err(|_| "string is not valid text".into())
    }

    fn int(&mut self) -> Result<Lit, String> {
        let start = self.i;
        while self.i < self.s.len() && self.s[self.i].is_ascii_digit() {
            self.i += 1;
        }
        let digits = std::str::from_utf8(&self.s[start..self.i]).unwrap_or_default();
        // Python 2 numpy wrote long integers as `3L`.
        if self.s.get(self.i) == Some(&b'L') {
            self.i += 1;
        }
        digits
            .parse()
            .map(Lit::Int)
            .map_err(|_| format!("integer {digits} is out of range"))
    }

    fn word(&mut self) -> Result<Lit, String> {
        let start = self.i;
        while self.i < self.s.len() && self.s[self.i].is_ascii_alphanumeric() {
            self.i += 1;
        }
        match &self.s[start..self.i] {
            b"True" => Ok(Lit::Bool(true)),
            b"False" => Ok(Lit::Bool(false)),
            b"None" => Ok(Lit::None),
            w => Err(format!("unexpected word {:?}", String::from_utf8_lossy(w))),
        }
    }

    /// A tuple, or a parenthesised value: Python's `(3)` is the int 3, a one-element tuple
    /// is `(3,)` (numpy refuses a header whose shape is `(3)`).
    fn paren(&mut self, depth: usize) -> Result<Lit, String> {
        let mut items = self.seq(b')', depth)?;
        let before_close = self.s[..self.i - 1]
            .iter()
            .rev()
            .find(|c| !c.is_ascii_whitespace());
        if items.len() == 1 && before_close != Some(&b',') {
            return Ok(items.remove(0));
        }
        Ok(Lit::Tuple(items))
    }

    /// Comma-separated values up to `close`; a trailing comma is allowed.
    fn seq(&mut self, close: u8, depth: usize) -> Result<Vec<Lit>, String> {
        self.i += 1;
        let mut items = Vec::new();
        loop {
            if self.peek() == Some(close) {
                self.i += 1;
                return Ok(items);
            }
            items.push(self.value(depth + 1)?);
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(c) if c == close => {}
                _ => {
                    return Err(format!(
                        "expected ',' or '{}' at byte {}",
                        close as char, self.i
                    ));
                }
            }
        }
    }

    fn dict(&mut self, depth: usize) -> Result<Lit, String> {
        self.i += 1;
        let mut items = Vec::new();
        loop {
            if self.peek() == Some(b'}') {
                self.i += 1;
                return Ok(Lit::Dict(items));
            }
            let k = self.value(depth + 1)?;
            if self.peek() != Some(b':') {
                return Err(format!("expected ':' at byte {}", self.i));
            }
            self.i += 1;
            let v = self.value(depth + 1)?;
            items.push((k, v));
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b'}') => {}
                _ => return Err(format!("expected ',' or '}}' at byte {}", self.i)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_numpy_headers() {
        let h = "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }          \n";
        let Lit::Dict(items) = parse(h).unwrap() else {
            panic!("not a dict")
        };
        assert_eq!(items[0], (Lit::Str("descr".into()), Lit::Str("<f4".into())));
        assert_eq!(items[1].1, Lit::Bool(false));
        assert_eq!(items[2].1, Lit::Tuple(vec![Lit::Int(3), Lit::Int(4)]));
        assert_eq!(parse("(5,)").unwrap(), Lit::Tuple(vec![Lit::Int(5)]));
        assert_eq!(parse("( 5 , )").unwrap(), Lit::Tuple(vec![Lit::Int(5)]));
        // Before, `(5)` was the tuple `(5,)`: a header numpy refuses was indexed.
        assert_eq!(parse("(5)").unwrap(), Lit::Int(5));
        assert_eq!(parse("('a,')").unwrap(), Lit::Str("a,".into()));
        assert_eq!(parse("()").unwrap(), Lit::Tuple(vec![]));
        assert_eq!(
            parse("(2L, 3L)").unwrap(),
            Lit::Tuple(vec![Lit::Int(2), Lit::Int(3)])
        );
        let structured = parse("[('a', '<f4'), ('b', '<i8', (2,))]").unwrap();
        assert!(matches!(structured, Lit::List(ref v) if v.len() == 2));
        assert_eq!(structured.to_string(), "[('a', '<f4'), ('b', '<i8', (2,))]");
        assert_eq!(
            parse(r"{'q\'s': True, 'n': None}").unwrap().to_string(),
            r"{'q\'s': True, 'n': None}"
        );
    }

    #[test]
    fn rejects_garbage() {
        for bad in [
            "{'a' 1}",
            "{'a': 1",
            "(1 2)",
            "'open",
            "{'a': -1}",
            "1 2",
            "foo",
            "((((((((((((((((((1))))))))))))))))))",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
