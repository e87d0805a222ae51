//! `shardwire status`: a readable table of a node's state, read from its admin API.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use serde_json::Value;

use crate::out::{out, outln};

/// A non-2xx answer of the admin API, with the node's reason.
#[derive(Debug, thiserror::Error)]
#[error("{admin}{path} answered {status}: {message}")]
struct Refused {
    /// The admin address as given.
    admin: String,
    /// The path asked for.
    path: String,
    /// The status line (`HTTP/1.1 403 Forbidden`).
    status: String,
    /// The JSON error's `message` (it says what to change), else the start of the body.
    message: String,
}

/// Most characters of a non-JSON error body shown.
const BODY_SHOWN: usize = 512;

/// GET `path` from `admin` (HTTP/1.0, loopback admin API) and parse the JSON body.
fn get_json(admin: &str, path: &str) -> anyhow::Result<Value> {
    let (mut s, addr) = connect(admin)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    // `Host` names the address connected to, not the name given: over loopback the node
    // answers only requests addressed to localhost or an IP address (its guard against DNS
    // rebinding), and `$(hostname):7400` is often 127.0.1.1.
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    let (head, body) = resp
        .split_once("\r\n\r\n")
        .context("malformed HTTP response")?;
    let status = head.lines().next().unwrap_or("");
    let code = status
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse::<u16>().ok());
    if !code.is_some_and(|c| (200..300).contains(&c)) {
        return Err(Refused {
            admin: admin.to_owned(),
            path: path.to_owned(),
            status: status.to_owned(),
            message: reason(body),
        }
        .into());
    }
    Ok(serde_json::from_str(body)?)
}

/// A connection to the first address `admin` resolves to that answers within 10 s each
/// (`localhost` may be ::1 first while the node listens on 127.0.0.1), and that address.
fn connect(admin: &str) -> anyhow::Result<(TcpStream, SocketAddr)> {
    let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "no address");
    for addr in std::net::ToSocketAddrs::to_socket_addrs(admin)
        .with_context(|| format!("resolving the admin API address {admin}"))?
    {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(10)) {
            Ok(s) => return Ok((s, addr)),
            Err(e) => last = e,
        }
    }
    Err(last).with_context(|| format!("connecting to the admin API at {admin}"))
}

/// What an error answer says: its JSON `message`, else the start of its body.
fn reason(body: &str) -> String {
    if let Ok(v) = serde_json::from_str::<Value>(body)
        && let Some(m) = v["message"].as_str()
    {
        return m.to_owned();
    }
    let body = body.trim();
    match body.char_indices().nth(BODY_SHOWN) {
        Some((end, _)) => format!("{}...", &body[..end]),
        None if body.is_empty() => "(no body)".to_owned(),
        None => body.to_owned(),
    }
}

fn gib(v: &Value) -> String {
    format!("{:.2} GiB", v.as_f64().unwrap_or(0.0) / (1u64 << 30) as f64)
}

/// Prints the node's status.
pub fn run(admin: &str, json: bool) -> anyhow::Result<ExitCode> {
    let st = get_json(admin, "/v1/status")?;
    if json {
        outln!("{}", serde_json::to_string_pretty(&st)?);
    } else {
        out!("{}", render(&st, admin));
    }
    Ok(ExitCode::SUCCESS)
}

/// The status `st` (`/v1/status`) as the table `shardwire status` prints.
fn render(st: &Value, admin: &str) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let s = |v: &Value| v.as_str().unwrap_or("?").to_owned();
    let _ = writeln!(o, "shardwire {} at {admin}", s(&st["version"]));
    let _ = writeln!(
        o,
        "mode      receive={} memory={}",
        s(&st["mode"]["receive"]),
        s(&st["mode"]["memory"])
    );
    let _ = writeln!(
        o,
        "          {}",
        st["mode"]["reason"].as_str().unwrap_or("")
    );
    let _ = writeln!(
        o,
        "data      {}   socket {}",
        s(&st["data_addr"]),
        s(&st["socket"])
    );
    let lanes = st["lanes"].as_array().map_or(0, Vec::len).max(1);
    // `pool.size` is one lane's pool_size; `reserved` counts every lane's streams.
    let _ = writeln!(
        o,
        "pool      {} reserved of {} ({lanes} lane(s) of {} each; stream_memory {})",
        gib(&st["pool"]["reserved"]),
        gib_times(&st["pool"]["size"], lanes),
        gib(&st["pool"]["size"]),
        gib(&st["pool"]["stream_memory"])
    );
    let c = &st["counters"];
    let _ = writeln!(
        o,
        "counters  {} received in {} shards, {} batches delivered, {} CRC failures, {} refetches",
        gib(&c["bytes_received"]),
        c["shards_received"],
        c["batches_delivered"],
        c["crc_failures"],
        c["refetches"]
    );
    lanes_table(&mut o, st);
    sources_table(&mut o, st);
    streams_table(&mut o, st);
    o
}

fn gib_times(v: &Value, n: usize) -> String {
    gib(&Value::from(v.as_f64().unwrap_or(0.0) * n as f64))
}

/// A JSON value as one table cell: a `String`, which `{:<N}` pads (a [`Value`]'s own
/// `Display` ignores width and alignment, so its columns did not line up); a string without
/// its quotes, a missing value as `-`.
fn cell(v: &Value) -> String {
    match v {
        Value::Null => "-".to_owned(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn lanes_table(o: &mut String, st: &Value) {
    use Align::{Left, Right};
    let cols = [
        ("LANE", Left),
        ("GPU", Left),
        ("NIC", Left),
        ("DATA", Left),
        ("STREAMS", Right),
        ("POOL RESERVED", Right),
        ("BYTES", Right),
    ];
    let rows: Vec<Vec<String>> = st["lanes"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|l| {
            vec![
                cell(&l["lane"]),
                l["gpu"].as_str().unwrap_or("-").to_owned(),
                l["nic"].as_str().unwrap_or("-").to_owned(),
                l["data_addr"].as_str().unwrap_or("?").to_owned(),
                cell(&l["streams"]),
                format!("{} of {}", gib(&l["pool_reserved"]), gib(&l["pool_size"])),
                cell(&l["bytes_received"]),
            ]
        })
        .collect();
    table(o, &cols, &rows);
}

fn sources_table(o: &mut String, st: &Value) {
    use Align::{Left, Right};
    let cols = [
        ("SOURCE", Left),
        ("UP", Left),
        ("IN FLIGHT", Right),
        ("BYTES", Right),
        ("last error", Left),
    ];
    let rows: Vec<Vec<String>> = st["sources"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|s| {
            let up = if s["up"].as_bool() == Some(true) {
                "yes"
            } else {
                "no"
            };
            vec![
                s["addr"].as_str().unwrap_or("?").to_owned(),
                up.to_owned(),
                cell(&s["in_flight"]),
                cell(&s["bytes_received"]),
                s["last_error"].as_str().unwrap_or("-").to_owned(),
            ]
        })
        .collect();
    table(o, &cols, &rows);
}

fn streams_table(o: &mut String, st: &Value) {
    use Align::{Left, Right};
    let cols = [
        ("STREAM", Left),
        ("DATASET", Left),
        ("RANK", Right),
        ("DELIVERED", Right),
        ("READY", Right),
        ("LEASED", Right),
        ("REGION USED", Right),
    ];
    let rows: Vec<Vec<String>> = st["streams"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|s| {
            vec![
                cell(&s["id"]),
                s["dataset"].as_str().unwrap_or("?").to_owned(),
                format!("{}/{}", s["rank"], s["world_size"]),
                format!("{}/{}", s["delivered"], s["total"]),
                cell(&s["ready"]),
                cell(&s["leased"]),
                format!("{}/{}", s["region_used"], s["region_bytes"]),
            ]
        })
        .collect();
    table(o, &cols, &rows);
}

/// Where a table column's cells sit.
#[derive(Clone, Copy)]
enum Align {
    Left,
    Right,
}

/// Writes a blank line, the header `cols` and `rows`, each column as wide as its header or
/// its widest cell, whichever is wider (fixed widths let a long cell, "123456/1000000" or an
/// IPv6 `[addr]:port`, push the rest of its row out of line). Trailing spaces are dropped.
fn table(o: &mut String, cols: &[(&str, Align)], rows: &[Vec<String>]) {
    use std::fmt::Write as _;
    let mut widths: Vec<usize> = cols.iter().map(|(h, _)| h.chars().count()).collect();
    for row in rows {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let header: Vec<String> = cols.iter().map(|(h, _)| (*h).to_owned()).collect();
    o.push('\n');
    for row in std::iter::once(&header).chain(rows) {
        let mut line = String::new();
        let columns = widths.iter().copied().zip(cols);
        for (i, (c, (w, (_, align)))) in row.iter().zip(columns).enumerate() {
            if i > 0 {
                line.push(' ');
            }
            let _ = match align {
                Align::Left => write!(line, "{c:<w$}"),
                Align::Right => write!(line, "{c:>w$}"),
            };
        }
        let _ = writeln!(o, "{}", line.trim_end());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_answer_names_the_nodes_reason_and_host_is_the_address_connected() {
        // Before: `Host: localhost:PORT` (the name given; `$(hostname)` is refused over
        // loopback) and only "HTTP/1.1 403 Forbidden", the node's JSON reason dropped.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let node = std::thread::spawn(move || {
            let (mut c, _) = l.accept().unwrap();
            let mut head = Vec::new();
            let mut b = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") {
                c.read_exact(&mut b).unwrap();
                head.push(b[0]);
            }
            let body = r#"{"code":"forbidden","message":"Host `x`: use an IP address"}"#;
            let len = body.len();
            write!(
                c,
                "HTTP/1.1 403 Forbidden\r\ncontent-length: {len}\r\n\r\n{body}"
            )
            .unwrap();
            String::from_utf8(head).unwrap()
        });
        let e = get_json(&format!("localhost:{port}"), "/v1/status").unwrap_err();
        let head = node.join().unwrap();
        assert!(
            head.contains(&format!("\r\nHost: 127.0.0.1:{port}\r\n")),
            "{head}"
        );
        let refused = e.downcast_ref::<Refused>().expect("a Refused");
        assert_eq!(refused.status, "HTTP/1.1 403 Forbidden");
        assert_eq!(refused.message, "Host `x`: use an IP address");
        assert_eq!(reason("<html>nope</html>\n"), "<html>nope</html>");
        assert_eq!(reason(&"x".repeat(2000)).len(), BODY_SHOWN + 3);
    }

    #[test]
    fn the_pool_line_counts_every_lane_and_each_lane_has_its_row() {
        // Before: "2.50 GiB reserved of 2.00 GiB" on 8 lanes of 2 GiB (an over-committed
        // pool, it read), and no lane at all.
        let lane = |i: u32, reserved: u64| {
            serde_json::json!({"lane": i, "gpu": format!("0000:0{i}:00.0"), "nic": format!("eth{i}"),
                "data_addr": format!("10.0.{i}.1:7401"), "streams": 1, "pool_reserved": reserved,
                "pool_size": 2u64 << 30, "bytes_received": 7})
        };
        let st = serde_json::json!({
            "version": "x", "mode": {"receive": "host", "memory": "host", "reason": "r"},
            "data_addr": "0.0.0.0:7401", "socket": "/s",
            "pool": {"reserved": 5u64 << 29, "size": 2u64 << 30, "stream_memory": 1u64 << 29},
            "counters": {}, "sources": [], "streams": [],
            "lanes": (0..8).map(|i| lane(i, if i < 5 { 1 << 29 } else { 0 })).collect::<Vec<_>>(),
        });
        let text = render(&st, "127.0.0.1:7400");
        assert!(
            text.contains("pool      2.50 GiB reserved of 16.00 GiB (8 lane(s) of 2.00 GiB each"),
            "{text}"
        );
        assert!(text.contains("eth7"), "{text}");
        assert_eq!(text.matches("0.50 GiB of 2.00 GiB").count(), 5, "{text}");
    }

    #[test]
    fn table_columns_line_up_whatever_the_numbers() {
        // Before: numbers were written with `Value`'s Display, which ignores `{:>7}`, so a
        // row's columns moved with each number's digits; then fixed widths, which a cell
        // wider than its column ("123456/1000000", 10^14 bytes, an IPv6 address) still
        // pushed out of line.
        assert_eq!(cell(&serde_json::json!(7)), "7");
        assert_eq!(cell(&serde_json::json!("a")), "a");
        assert_eq!(cell(&Value::Null), "-");
        let lane = |i: u32, addr: &str, bytes: u64| {
            serde_json::json!({"lane": i, "gpu": "g", "nic": "eth0", "data_addr": addr,
                "streams": 1, "pool_reserved": 0, "pool_size": 1, "bytes_received": bytes})
        };
        let stream = |id: u64, delivered: u64, total: u64| {
            serde_json::json!({"id": id, "dataset": "d", "rank": 0, "world_size": 1,
                "delivered": delivered, "total": total, "ready": 2, "leased": 0,
                "region_used": 0, "region_bytes": 1})
        };
        let source = |addr: &str, bytes: u64| {
            serde_json::json!({"addr": addr, "up": true, "in_flight": 3, "bytes_received": bytes,
                "last_error": "E"})
        };
        let v6 = "[2001:db8:aaaa:bbbb:cccc:dddd:1234:5678]:7401";
        let st = serde_json::json!({
            "lanes": [lane(0, "a", 7), lane(12, v6, 123_456_789_012_345_678)],
            "streams": [stream(1, 1, 2), stream(4567, 123_456, 1_000_000)],
            "sources": [source("s", 1), source(v6, 987_654_321_098_765_432)],
        });
        let mut o = String::new();
        lanes_table(&mut o, &st);
        streams_table(&mut o, &st);
        let lines: Vec<&str> = o.lines().filter(|l| !l.is_empty()).collect();
        let (lanes, streams) = lines.split_at(3);
        for table in [lanes, streams] {
            for row in &table[1..] {
                assert_eq!(row.len(), table[0].len(), "{o}");
            }
        }
        assert!(o.contains("123456/1000000"), "{o}");
        let mut o = String::new();
        sources_table(&mut o, &st);
        let header = o.lines().nth(1).unwrap();
        let at = header.find("last error").unwrap();
        for row in o.lines().skip(2) {
            assert_eq!(row.find('E'), Some(at), "{o}");
        }
    }
}
