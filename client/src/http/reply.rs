//! Reading one HTTP/1.1 response off the kept-alive connection: status line, headers (at most
//! [`MAX_HEAD`] bytes), then the body as `Content-Length`, chunked transfer coding or the rest
//! of the connection says. A body grows as its bytes arrive: a length the server claims is
//! never allocated ahead of them, and none may exceed the limit of the answer asked for.

use std::io::{BufRead, ErrorKind, Read};

use serde::de::DeserializeOwned;
use shardwire_protocol::trainer::http::ErrorBody;

use crate::ClientError;

/// Largest response head.
const MAX_HEAD: usize = 64 << 10;
/// Largest chunk-size line or trailer line of a chunked body.
const MAX_CHUNK_LINE: usize = 4 << 10;

/// A response: status, lower-case headers, body.
pub(super) struct Reply {
    pub(super) status: u16,
    pub(super) headers: Vec<(String, String)>,
    pub(super) body: Vec<u8>,
}

impl Reply {
    pub(super) fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }
    /// The body as the API's type for this answer.
    pub(super) fn json<T: DeserializeOwned>(&self) -> Result<T, ClientError> {
        serde_json::from_slice(&self.body).map_err(|e| {
            ClientError::Protocol(format!(
                "HTTP {}: the body is not the expected JSON ({e}): {}",
                self.status,
                String::from_utf8_lossy(&self.body[..self.body.len().min(200)])
            ))
        })
    }
    /// The service's `{code, message}` as an error.
    pub(super) fn error(&self) -> ClientError {
        match self.json::<ErrorBody>() {
            Ok(e) => ClientError::Service {
                code: e.code,
                message: e.message,
            },
            Err(e) => e,
        }
    }
}

/// Why no response was read.
pub(super) enum Fail {
    /// Nothing of a response arrived (a stale kept-alive connection, if it was reused).
    Unanswered(std::io::Error),
    Io(std::io::Error),
    Protocol(String),
}

/// Reads one response whose body is at most `max` bytes; the flag says whether the connection
/// may be used again.
pub(super) fn read_reply(
    r: &mut impl BufRead,
    head_only: bool,
    max: u64,
) -> Result<(Reply, bool), Fail> {
    let (version, status, headers) = read_final_head(r)?;
    let get = |name: &str| header(&headers, name);
    // After `101 Switching Protocols` the connection no longer speaks HTTP/1.1.
    let mut keep = version == "HTTP/1.1"
        && status != 101
        && !get("connection").is_some_and(|v| v.eq_ignore_ascii_case("close"));
    let chunked = get("transfer-encoding").is_some_and(|v| v.contains("chunked"));
    let length = get("content-length")
        .map(|v| {
            v.parse::<u64>()
                .map_err(|_| Fail::Protocol(format!("bad Content-Length {v:?}")))
        })
        .transpose()?;
    // Both framings: the chunked one is read, and the connection is not used again (RFC 9112
    // §6.3: a sender of both may be smuggling a request; what follows is not to be trusted).
    if chunked && length.is_some() {
        keep = false;
    }
    let mut body = Vec::new();
    if head_only || status == 204 || status == 304 || (100..200).contains(&status) {
    } else if chunked {
        read_chunked(r, &mut body, max)?;
    } else if let Some(n) = length {
        if n > max {
            return Err(over(n, max));
        }
        read_exactly(r, n, &mut body)?;
    } else {
        r.by_ref()
            .take(max.saturating_add(1))
            .read_to_end(&mut body)
            .map_err(Fail::Io)?;
        if body.len() as u64 > max {
            return Err(over(body.len() as u64, max));
        }
        keep = false;
    }
    // Grown by doubling as bytes came: give back what a tensor's bytes did not fill.
    if body.capacity() - body.len() > body.len() / 4 {
        body.shrink_to_fit();
    }
    let reply = Reply {
        status,
        headers,
        body,
    };
    Ok((reply, keep))
}

/// A body of `n` bytes (or more) where at most `max` may come.
fn over(n: u64, max: u64) -> Fail {
    Fail::Protocol(format!(
        "a response body of {n} bytes or more; this answer has at most {max} (is this the node's HTTP address?)"
    ))
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

/// A response's HTTP version, status code and headers.
type Head = (String, u16, Vec<(String, String)>);

/// The final response's HTTP version, status code and headers: interim `1xx` responses
/// before it (`100 Continue`, `103 Early Hints`) are read and set aside, their heads counted
/// against [`MAX_HEAD`] with the final one's. `101 Switching Protocols` is final.
fn read_final_head(r: &mut impl BufRead) -> Result<Head, Fail> {
    let mut head = 0;
    loop {
        let (version, status, line) = read_status(r, head)?;
        head += line;
        let headers = read_headers(r, &mut head)?;
        if !(100..200).contains(&status) || status == 101 {
            return Ok((version, status, headers));
        }
        if head >= MAX_HEAD {
            return Err(oversized_head());
        }
    }
}

/// The error of a head over [`MAX_HEAD`] bytes, or one the connection cut short.
fn oversized_head() -> Fail {
    Fail::Protocol(format!(
        "truncated or oversized HTTP head (the limit is {MAX_HEAD} bytes)"
    ))
}

/// The status line, after `head` bytes of interim responses: HTTP version, status code, and
/// the line's length in bytes. Nothing at all arriving is [`Fail::Unanswered`]; the connection
/// ending after an interim response is [`Fail::Io`] (the server had the request).
fn read_status(r: &mut impl BufRead, head: usize) -> Result<(String, u16, usize), Fail> {
    let mut line = String::new();
    let left = MAX_HEAD.saturating_sub(head) as u64;
    match r.by_ref().take(left).read_line(&mut line) {
        Ok(0) if head == 0 => {
            return Err(Fail::Unanswered(std::io::Error::new(
                ErrorKind::UnexpectedEof,
                "the server closed the connection",
            )));
        }
        Ok(0) => {
            return Err(Fail::Io(std::io::Error::new(
                ErrorKind::UnexpectedEof,
                "the server closed the connection after an interim (1xx) response",
            )));
        }
        Ok(_) => {}
        Err(e) if head == 0 && e.kind() == ErrorKind::ConnectionReset => {
            return Err(Fail::Unanswered(e));
        }
        Err(e) => return Err(Fail::Io(e)),
    }
    let bad = || Fail::Protocol(format!("bad HTTP status line {:?}", line.trim_end()));
    let mut parts = line.trim_end().splitn(3, ' ');
    let (Some(version), Some(code)) = (parts.next(), parts.next()) else {
        return Err(bad());
    };
    let status = code.parse().map_err(|_| bad())?;
    Ok((version.to_string(), status, line.len()))
}

/// Header lines up to the blank line, names lower-cased; `head` bytes were read before them,
/// and counts the bytes of these too.
fn read_headers(r: &mut impl BufRead, head: &mut usize) -> Result<Vec<(String, String)>, Fail> {
    let mut headers = Vec::new();
    let mut line = String::new();
    loop {
        line.clear();
        let left = MAX_HEAD.saturating_sub(*head) as u64 + 1;
        let n = r
            .by_ref()
            .take(left)
            .read_line(&mut line)
            .map_err(Fail::Io)?;
        *head += n;
        if n == 0 || *head > MAX_HEAD {
            return Err(oversized_head());
        }
        let l = line.trim_end();
        if l.is_empty() {
            return Ok(headers);
        }
        let Some((k, v)) = l.split_once(':') else {
            return Err(Fail::Protocol(format!("bad HTTP header {l:?}")));
        };
        headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
    }
}

/// A chunked body (RFC 9112 §7.1): chunks until the zero-size one, then trailers (ignored).
fn read_chunked(r: &mut impl BufRead, body: &mut Vec<u8>, max: u64) -> Result<(), Fail> {
    let mut line = String::new();
    loop {
        read_chunk_line(r, &mut line)?;
        let size = line.trim_end().split(';').next().unwrap_or("").trim();
        let size = u64::from_str_radix(size, 16)
            .map_err(|_| Fail::Protocol(format!("bad chunk size {:?}", line.trim_end())))?;
        if size == 0 {
            while read_chunk_line(r, &mut line)? > 0 && !line.trim_end().is_empty() {}
            return Ok(());
        }
        let total = (body.len() as u64).saturating_add(size);
        if total > max {
            return Err(over(total, max));
        }
        read_exactly(r, size, body)?;
        // The CRLF after the chunk's data, and nothing else: more data than the size said is
        // a framing error (what follows it would be taken for the next chunk's size).
        if read_chunk_line(r, &mut line)? == 0 {
            return Err(Fail::Io(std::io::Error::new(
                ErrorKind::UnexpectedEof,
                "the server closed the connection inside a chunked body",
            )));
        }
        if line != "\r\n" && line != "\n" {
            let what: String = line.chars().take(64).collect();
            return Err(Fail::Protocol(format!(
                "a chunk of {size} bytes is followed by {what:?}, not CRLF"
            )));
        }
    }
}

/// One line of a chunked body's framing into `line` (cleared first); its length in bytes.
fn read_chunk_line(r: &mut impl BufRead, line: &mut String) -> Result<usize, Fail> {
    line.clear();
    let n = r
        .by_ref()
        .take(MAX_CHUNK_LINE as u64)
        .read_line(line)
        .map_err(Fail::Io)?;
    if n == MAX_CHUNK_LINE && !line.ends_with('\n') {
        return Err(Fail::Protocol(format!(
            "a chunked body's size or trailer line is over {MAX_CHUNK_LINE} bytes"
        )));
    }
    Ok(n)
}

/// Appends exactly `n` bytes to `body`, growing it as they arrive.
fn read_exactly(r: &mut impl BufRead, n: u64, body: &mut Vec<u8>) -> Result<(), Fail> {
    let got = r.by_ref().take(n).read_to_end(body).map_err(Fail::Io)?;
    if (got as u64) < n {
        return Err(Fail::Io(std::io::Error::new(
            ErrorKind::UnexpectedEof,
            format!("the server closed the connection after {got} of {n} body bytes"),
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::{BufReader, Write};
    use std::net::{TcpListener, TcpStream};

    use super::*;

    /// `read_reply` over a real connection from a server that writes `raw` and closes.
    fn reply_to(raw: &'static [u8], head_only: bool) -> Result<(Reply, bool), Fail> {
        reply_to_at_most(raw, head_only, u64::MAX)
    }

    /// [`reply_to`] with a body limit.
    fn reply_to_at_most(
        raw: &'static [u8],
        head_only: bool,
        max: u64,
    ) -> Result<(Reply, bool), Fail> {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let _ = s.write_all(raw);
        });
        let mut r = BufReader::new(TcpStream::connect(addr).unwrap());
        let out = read_reply(&mut r, head_only, max);
        server.join().unwrap();
        out
    }

    fn protocol_error(r: Result<(Reply, bool), Fail>) -> String {
        match r {
            Err(Fail::Protocol(m)) => m,
            Err(Fail::Io(e) | Fail::Unanswered(e)) => panic!("expected a protocol error, got {e}"),
            Ok((reply, _)) => panic!("expected a protocol error, got HTTP {}", reply.status),
        }
    }

    #[test]
    fn a_length_body_and_keep_alive() {
        let (reply, keep) = reply_to(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", false)
            .unwrap_or_else(|_| panic!("a plain reply"));
        assert_eq!(
            (reply.status, reply.body.as_slice(), keep),
            (200, &b"hello"[..], true)
        );
        let (_, keep) = reply_to(
            b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
            false,
        )
        .unwrap_or_else(|_| panic!("a plain reply"));
        assert!(!keep, "Connection: close is honoured");
    }

    #[test]
    fn a_large_body_is_kept_without_the_room_it_grew_by() {
        let raw: &'static [u8] = Box::leak(
            [
                &b"HTTP/1.1 200 OK\r\nContent-Length: 3000000\r\n\r\n"[..],
                &[7u8; 3_000_000],
            ]
            .concat()
            .into_boxed_slice(),
        );
        let (reply, _) = reply_to(raw, false).unwrap_or_else(|_| panic!("a plain reply"));
        assert_eq!(reply.body.len(), 3_000_000);
        assert!(
            reply.body.capacity() <= 3_000_000 * 5 / 4,
            "{}",
            reply.body.capacity()
        );
    }

    #[test]
    fn a_chunked_body_with_extensions_and_trailers() {
        let raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;x=y\r\nabc\r\n2\r\nde\r\n0\r\nX-Trailer: 1\r\n\r\n";
        let (reply, _) = reply_to(raw, false).unwrap_or_else(|_| panic!("a chunked reply"));
        assert_eq!(reply.body, b"abcde");
    }

    #[test]
    fn a_claimed_length_is_not_allocated_before_its_bytes() {
        // 1 TiB claimed, 4 bytes sent: the read fails at the end of the connection instead of
        // reserving the claim.
        match reply_to(
            b"HTTP/1.1 200 OK\r\nContent-Length: 1099511627776\r\n\r\nabcd",
            false,
        ) {
            Err(Fail::Io(e)) => {
                assert_eq!(e.kind(), ErrorKind::UnexpectedEof);
                assert!(e.to_string().contains("4 of 1099511627776"), "{e}");
            }
            _ => panic!("a short body must fail"),
        }
        let chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffff\r\nab";
        assert!(matches!(reply_to(chunked, false), Err(Fail::Io(_))));
    }

    #[test]
    fn a_body_over_the_answers_limit_is_refused_however_it_is_framed() {
        let at_most = |raw| protocol_error(reply_to_at_most(raw, false, 4));
        let m = at_most(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello");
        assert!(
            m.contains("5 bytes or more; this answer has at most 4"),
            "{m}"
        );
        let m = at_most(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n");
        assert!(m.contains("5 bytes or more"), "{m}");
        let m = at_most(b"HTTP/1.0 200 OK\r\n\r\nhello world");
        assert!(m.contains("5 bytes or more"), "{m}");
        let (reply, _) = reply_to_at_most(
            b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nabcd",
            false,
            4,
        )
        .unwrap_or_else(|_| panic!("a body at the limit"));
        assert_eq!(reply.body, b"abcd");
    }

    #[test]
    fn bad_heads_and_chunk_lines_are_named() {
        let m = protocol_error(reply_to(b"HTTP/1.1 abc OK\r\n\r\n", false));
        assert!(
            m.contains("bad HTTP status line \"HTTP/1.1 abc OK\""),
            "{m}"
        );
        let m = protocol_error(reply_to(b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n", false));
        assert!(m.contains("bad HTTP header \"no colon\""), "{m}");
        let m = protocol_error(reply_to(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            false,
        ));
        assert!(m.contains("bad chunk size \"zz\""), "{m}");
        let long: &'static [u8] = Box::leak(
            [
                &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"[..],
                &[b'1'; 5000],
            ]
            .concat()
            .into_boxed_slice(),
        );
        let m = protocol_error(reply_to(long, false));
        assert!(m.contains("over 4096 bytes"), "{m}");
        let huge: &'static [u8] = Box::leak(
            [&b"HTTP/1.1 200 OK\r\nX: "[..], &[b'a'; 70_000], b"\r\n\r\n"]
                .concat()
                .into_boxed_slice(),
        );
        let m = protocol_error(reply_to(huge, false));
        assert!(m.contains("oversized HTTP head"), "{m}");
    }

    #[test]
    fn interim_responses_are_set_aside_for_the_final_one() {
        // Before, `100 Continue` was taken as the answer: its empty body returned, and the
        // final response left on the connection to be read as the next request's answer.
        let raw = b"HTTP/1.1 100 Continue\r\n\r\n\
            HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n\
            HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello";
        let (reply, keep) = reply_to(raw, false).unwrap_or_else(|_| panic!("a final reply"));
        assert_eq!(
            (reply.status, reply.body.as_slice(), keep),
            (200, &b"hello"[..], true)
        );
        assert_eq!(
            reply.header("link"),
            None,
            "the interim headers are not the answer's"
        );
        // The connection ending after an interim response: the server had the request.
        let cut = reply_to(b"HTTP/1.1 100 Continue\r\n\r\n", false);
        assert!(matches!(cut, Err(Fail::Io(_))));
        let (reply, keep) = reply_to(b"HTTP/1.1 101 Switching Protocols\r\n\r\n", false)
            .unwrap_or_else(|_| panic!("a 101 reply"));
        assert_eq!((reply.status, keep), (101, false));
    }

    #[test]
    fn a_chunk_followed_by_more_than_crlf_is_refused() {
        // Before, "XY" after the 3 bytes the size said was skipped as if it were the CRLF.
        let m = protocol_error(reply_to(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcXY\r\n0\r\n\r\n",
            false,
        ));
        assert!(m.contains("not CRLF"), "{m}");
        let cut = reply_to(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc",
            false,
        );
        assert!(matches!(cut, Err(Fail::Io(_))));
    }

    #[test]
    fn a_chunked_body_with_a_content_length_closes_the_connection() {
        // Before, the connection was used again (RFC 9112 §6.3: it must be closed).
        let raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n3\r\nabc\r\n0\r\n\r\n";
        let (reply, keep) = reply_to(raw, false).unwrap_or_else(|_| panic!("a chunked reply"));
        assert_eq!((reply.body.as_slice(), keep), (&b"abc"[..], false));
    }

    #[test]
    fn a_closed_connection_is_unanswered() {
        assert!(matches!(reply_to(b"", false), Err(Fail::Unanswered(_))));
        let (reply, _) = reply_to(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n", true)
            .unwrap_or_else(|_| panic!("a HEAD reply"));
        assert!(reply.body.is_empty(), "HEAD reads no body");
    }
}
