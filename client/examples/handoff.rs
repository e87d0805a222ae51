//! Hand-off latency of the Rust client: `next` + `release` round trips on batches that are
//! already READY in the stream's region (the node fetched them ahead), over the Unix socket
//! and, with `--http ADMIN`, over the HTTP API (with and without downloading the tensors).
//!
//! ```sh
//! cargo run --release -p shardwire-client --example handoff -- SOCKET DATASET N \
//!     [--warmup W] [--http HOST:PORT] [--settle-ms MS] [--cases LIST] [--work-us US]
//! ```
//!
//! `--cases` picks measurements (comma-separated, default all): `pingpong` (the floor: a bare
//! Unix-socket ping-pong of 32 bytes between two threads, no shardwire code), `next` (`next` +
//! `release`), `next_after` (back to back, and with `--work-us` also after that much CPU work
//! per batch, a stand-in for a training step, with only `next_after` timed), `http`.
//!
//! N is at least 1. The stream is opened with enough epochs for `W + N` batches (`W + N + 1`
//! for `next_after`, whose first batch is taken by a `next` before the timed calls); the example
//! then waits until the node has them all ready (polling the admin API's `/v1/streams` when
//! `--http` names it, `HOST:PORT` or `http://HOST:PORT`, else sleeping `--settle-ms`), so the
//! region must hold `W + N + 1` shards (small shards, a large `--stream-memory`;
//! scripts/bench-handoff sets that up). It prints one human line and one JSON line per
//! measurement (p50/p99/mean in microseconds).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use shardwire_client::http::HttpStream;
use shardwire_client::{Stream, StreamOptions};

type Error = Box<dyn std::error::Error>;

struct Args {
    socket: String,
    dataset: String,
    n: usize,
    warmup: usize,
    http: Option<String>,
    settle: Duration,
    cases: Vec<String>,
    work: Duration,
}

impl Args {
    fn case(&self, name: &str) -> bool {
        self.cases.iter().any(|c| c == name || c == "all")
    }
}

fn usage() -> ! {
    eprintln!(
        "usage: handoff SOCKET DATASET N [--warmup W] [--http HOST:PORT] [--settle-ms MS] \
         [--cases pingpong,next,next_after,http] [--work-us US]"
    );
    std::process::exit(2)
}

fn args() -> Args {
    let mut pos = Vec::new();
    let (mut warmup, mut http, mut settle, mut work_us) = (200, None, 2000, 0);
    let mut cases = vec!["all".to_string()];
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--warmup" => {
                warmup = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| usage())
            }
            "--http" => http = Some(it.next().unwrap_or_else(|| usage())),
            "--cases" => {
                cases = it
                    .next()
                    .unwrap_or_else(|| usage())
                    .split(',')
                    .map(str::to_string)
                    .collect()
            }
            "--settle-ms" => {
                settle = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| usage())
            }
            "--work-us" => {
                work_us = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| usage())
            }
            "-h" | "--help" => usage(),
            _ => pos.push(a),
        }
    }
    let [socket, dataset, n] = <[String; 3]>::try_from(pos).unwrap_or_else(|_| usage());
    let n = match n.parse::<usize>() {
        Ok(n) if n >= 1 => n,
        _ => {
            eprintln!("N must be a count of at least 1 round trip to time, not `{n}`");
            usage()
        }
    };
    Args {
        socket,
        dataset,
        n,
        warmup,
        http,
        settle: Duration::from_millis(settle),
        cases,
        work: Duration::from_micros(work_us),
    }
}

/// GET http://ADMIN/PATH -> body (one connection per request; fine for polling). `admin` is
/// `HOST:PORT` or `http://HOST:PORT[/]`, as `HttpStream::open` takes it.
fn get(admin: &str, path: &str) -> Result<String, Error> {
    let admin = admin.strip_prefix("http://").unwrap_or(admin);
    let admin = admin.strip_suffix('/').unwrap_or(admin);
    let mut s = TcpStream::connect(admin)?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {admin}\r\nConnection: close\r\n\r\n"
    )?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    let (_, body) = out.split_once("\r\n\r\n").ok_or("no HTTP body")?;
    Ok(body.to_string())
}

/// Waits until stream `id` has `want` batches ready (or the settle time without an admin).
fn settle(a: &Args, id: u64, want: u64) -> Result<(), Error> {
    let Some(admin) = &a.http else {
        std::thread::sleep(a.settle);
        return Ok(());
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let v: serde_json::Value = serde_json::from_str(&get(admin, "/v1/streams")?)?;
        let ready = v["streams"]
            .as_array()
            .and_then(|ss| ss.iter().find(|s| s["id"] == id))
            .and_then(|s| s["ready"].as_u64())
            .unwrap_or(0);
        if ready >= want {
            std::thread::sleep(Duration::from_millis(200)); // let the fetcher go quiet
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "stream {id}: only {ready} of {want} batches ready after 120 s; \
                 is --stream-memory large enough to hold them all?"
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The stream's options: enough epochs for `batches` batches.
fn options(a: &Args, per_epoch: u64, batches: u64) -> StreamOptions {
    let mut o = StreamOptions::new(a.dataset.clone());
    o.epochs = batches.div_ceil(per_epoch.max(1)) as u32;
    o
}

fn report(name: &str, mut v: Vec<Duration>) {
    if v.is_empty() {
        println!("{name:<40} no samples");
        return;
    }
    v.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let n = v.len();
    let p50 = us(v[n / 2]);
    let p99 = us(v[(n * 99).div_ceil(100).saturating_sub(1)]);
    let mean = v.iter().map(|d| us(*d)).sum::<f64>() / n as f64;
    println!("{name:<40} n={n:<6} p50 {p50:8.1} us   p99 {p99:8.1} us   mean {mean:8.1} us");
    println!(
        "{}",
        serde_json::json!({ "client": "rust", "case": name, "n": n, "p50_us": p50, "p99_us": p99, "mean_us": mean })
    );
}

/// The floor: a bare ping-pong of 32 bytes over a Unix socket pair between two threads.
fn pingpong(a: &Args) -> Result<(), Error> {
    let (mut c, mut s) = std::os::unix::net::UnixStream::pair()?;
    let echo = std::thread::spawn(move || {
        let mut buf = [0u8; 32];
        while s.read_exact(&mut buf).is_ok() {
            if s.write_all(&buf).is_err() {
                break;
            }
        }
    });
    let mut buf = [7u8; 32];
    let mut times = Vec::with_capacity(a.n);
    for i in 0..a.warmup + a.n {
        let t = Instant::now();
        c.write_all(&buf)?;
        c.read_exact(&mut buf)?;
        if i >= a.warmup {
            times.push(t.elapsed());
        }
    }
    drop(c);
    echo.join().map_err(|_| "echo thread panicked")?;
    report("socket ping-pong floor (32 B, no shardwire)", times);
    Ok(())
}

/// The training-loop form: the previous batch is released on the `next` request itself, and
/// the stream asks for the following batches ahead of time. Back to back, and with
/// `--work-us` also after that much CPU work per batch (only `next_after` timed).
fn next_after(a: &Args, per_epoch: u64, total: u64) -> Result<(), Error> {
    let works = [Duration::ZERO, a.work];
    for work in works.iter().take(if a.work.is_zero() { 1 } else { 2 }) {
        // The first batch comes from a `next`, untimed: W + N timed `next_after` calls follow.
        let mut s = Stream::open(&a.socket, options(a, per_epoch, total + 1))?;
        settle(a, s.info.stream, total + 1)?;
        let mut times = Vec::with_capacity(a.n);
        let mut prev = s.next()?.ok_or("the stream ended early")?;
        for i in 0..a.warmup + a.n {
            busy(*work);
            let t = Instant::now();
            prev = s.next_after(prev)?.ok_or("the stream ended early")?;
            if i >= a.warmup {
                times.push(t.elapsed());
            }
        }
        match work.as_micros() {
            0 => report("socket next_after (release rides on next)", times),
            us => report(&format!("socket next_after after {us} us work"), times),
        }
    }
    Ok(())
}

/// Spins on this CPU for `d` (a stand-in for a training step).
fn busy(d: Duration) {
    let end = Instant::now() + d;
    while Instant::now() < end {
        std::hint::spin_loop();
    }
}

fn main() -> Result<(), Error> {
    let a = args();
    let total = (a.warmup + a.n) as u64;
    if a.case("pingpong") {
        pingpong(&a)?;
    }

    // A probe learns the batches per epoch (the plan), so the stream can hold W + N batches.
    let per_epoch = Stream::open(&a.socket, StreamOptions::new(a.dataset.clone()))?
        .info
        .batches_per_epoch;

    if a.case("next") {
        let mut s = Stream::open(&a.socket, options(&a, per_epoch, total))?;
        settle(&a, s.info.stream, total)?;
        let mut times = Vec::with_capacity(a.n);
        for i in 0..a.warmup + a.n {
            let t = Instant::now();
            let b = s.next()?.ok_or("the stream ended early")?;
            s.release(b)?;
            if i >= a.warmup {
                times.push(t.elapsed());
            }
        }
        report("socket next+release", times);
    }

    if a.case("next_after") {
        next_after(&a, per_epoch, total)?;
    }

    if let Some(admin) = a.http.as_ref().filter(|_| a.case("http")) {
        for download in [false, true] {
            let mut s = HttpStream::open(admin, options(&a, per_epoch, total))?;
            settle(&a, s.info.stream, total)?;
            let mut times = Vec::with_capacity(a.n);
            let mut bytes = 0usize;
            for i in 0..a.warmup + a.n {
                let t = Instant::now();
                let b = s.next()?.ok_or("the stream ended early")?;
                if download {
                    for name in b
                        .tensors()
                        .iter()
                        .map(|t| t.name.clone())
                        .collect::<Vec<_>>()
                    {
                        bytes += s.tensor_bytes(&b, &name)?.len();
                    }
                }
                s.release(b)?;
                if i >= a.warmup {
                    times.push(t.elapsed());
                }
            }
            s.close()?;
            let name = if download {
                format!(
                    "http next+download+release ({} B)",
                    bytes / (a.warmup + a.n)
                )
            } else {
                "http next+release".to_string()
            };
            report(&name, times);
        }
    }
    Ok(())
}
