//! Redaction of secrets in URLs that errors and logs repeat: a userinfo (`user:secret@`), a
//! query or fragment (a SAS token, a presigned URL's signature). A leaf: the URL parser and
//! the error classifier both use it.

/// `s` as an error may repeat it: a userinfo (`user:secret@`) becomes `***@`, and a query
/// or fragment (a SAS token, a presigned URL's signature) becomes `?...` (`#...`). The
/// userinfo is found before the cut at `?` or `#` (a secret may hold either), so no part of
/// it is ever shown.
pub fn redacted(s: &str) -> String {
    // Only a real scheme name counts: `b/p?sig=S&r=https://x` has none, and its query goes.
    let (scheme, rest) = match s.split_once("://") {
        Some((name, rest)) if is_scheme(name) => (&s[..name.len() + 3], rest),
        _ => ("", s),
    };
    let (user, rest) = match userinfo_end(rest) {
        Some(at) => ("***@", &rest[at + 1..]),
        None => ("", rest),
    };
    let (head, tail) = match rest.find(['?', '#']) {
        Some(at) => (&rest[..at], &rest[at..at + 1]),
        None => (rest, ""),
    };
    let dots = if tail.is_empty() { "" } else { "..." };
    format!("{scheme}{user}{head}{tail}{dots}")
}

/// Whether `name` is a URL scheme's name (RFC 3986: a letter, then letters, digits, `+`, `-`
/// and `.`).
pub(crate) fn is_scheme(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
}

/// Where the userinfo of `rest` (a URL after `scheme://`, query and fragment included) ends:
/// the last `@` before the first `/` (`user:secret@host`, `user:pa#ss@host`: whatever
/// precedes it there is taken as userinfo); or, when that part holds a `:` that is not a
/// numeric port's (`key:se/cret@bucket/...`: an AWS secret key may hold a `/`), the first
/// `@` after it. An `@` in a key (`bkt/dir:v1@x`) or after a port (`h:8443/a@b`,
/// `[::1]:9000/p@q`) is none.
pub(crate) fn userinfo_end(rest: &str) -> Option<usize> {
    let end = rest.find('/').unwrap_or(rest.len());
    let first = &rest[..end];
    if let Some(at) = first.rfind('@') {
        return Some(at);
    }
    // An IPv6 host's own colons are inside its brackets.
    let host = first.rsplit_once(']').map_or(first, |(_, after)| after);
    let (_, after) = host.split_once(':')?;
    let port = !after.is_empty() && after.bytes().all(|b| b.is_ascii_digit());
    if port {
        return None;
    }
    rest[end..].find('@').map(|i| end + i)
}

/// `s` with each URL in it (`scheme://` up to a space, `"`, `<` or `>`: none of them is ever
/// left unescaped in a URL) as [`redacted`] writes it: userinfo as `***@`, a query or fragment
/// as `?...`. object_store's errors repeat a request's whole URI ("Error performing GET
/// {uri} ..."), built from the endpoint with its userinfo and query (a basic-auth proxy's
/// password, a signature), and these messages reach the logs and the nodes (before, as they
/// came).
pub(crate) fn redact_urls(s: &str) -> String {
    let scheme_char = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.');
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find("://") {
        let bytes = rest.as_bytes();
        let scheme = bytes[..at].iter().rev().take_while(|&&b| scheme_char(b));
        let mut start = at - scheme.count();
        // A scheme's name starts with a letter (ASCII: `start` stays a char boundary).
        while start < at && !bytes[start].is_ascii_alphabetic() {
            start += 1;
        }
        let end = rest[at + 3..]
            .find(|c: char| c.is_whitespace() || matches!(c, '"' | '<' | '>'))
            .map_or(rest.len(), |i| at + 3 + i);
        out.push_str(&rest[..start]);
        out.push_str(&redacted(&rest[start..end]));
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}
