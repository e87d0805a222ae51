//! The harness the integration tests share: real `shardwire source` and `shardwire serve`
//! processes on loopback over a dataset of `.bin` shards, a temporary directory, and raw HTTP
//! requests to the node's admin API.
#![allow(dead_code)] // each test crate uses its part

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_shardwire");
pub const WAIT: Duration = Duration::from_secs(60);

/// A temporary directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let p = std::env::temp_dir().join(format!("sw-test-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A child process killed on drop; its stdout lines arrive on a channel.
pub struct Proc {
    child: Child,
    lines: mpsc::Receiver<String>,
    name: &'static str,
}

impl Proc {
    pub fn start(name: &'static str, args: &[&str]) -> Self {
        let mut child = Command::new(BIN)
            .args(args)
            .env("RUST_LOG", "error")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("start {BIN} {args:?}: {e}"));
        let out = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines() {
                let Ok(l) = l else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Self { child, lines, name }
    }

    /// The text after `prefix` on the first stdout line that starts with it.
    pub fn wait_line(&self, prefix: &str) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    if let Some(rest) = l.strip_prefix(prefix) {
                        return rest.trim().to_string();
                    }
                }
                Err(e) => panic!("{}: no line starting {prefix:?}: {e}", self.name),
            }
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A source serving dataset `d` from `dir`, and a node service using it.
pub struct Cluster {
    serve: Proc, // dropped (killed) before its source
    source: Proc,
    /// The node's trainer socket.
    pub socket: PathBuf,
    /// The node's admin API, `HOST:PORT`.
    pub admin: String,
}

impl Cluster {
    /// The source process's pid (to stop and continue it).
    pub fn source_pid(&self) -> u32 {
        self.source.child.id()
    }

    /// The node service's pid (to stop and continue it).
    pub fn serve_pid(&self) -> u32 {
        self.serve.child.id()
    }

    pub fn start(dir: &Path, tmp: &Path, stream_memory: &str) -> Self {
        let ds = format!("d={}", dir.display());
        let source = Proc::start(
            "source",
            &["source", "--listen", "127.0.0.1:0", "--dataset", &ds],
        );
        let src = source.wait_line("source listening on ");
        let socket = tmp.join("sw.sock");
        let serve = Proc::start(
            "serve",
            &[
                "serve",
                "--source",
                &src,
                "--socket",
                socket.to_str().unwrap(),
                "--data-listen",
                "127.0.0.1:0",
                "--admin",
                "127.0.0.1:0",
                "--pool-size",
                "1GiB",
                "--stream-memory",
                stream_memory,
            ],
        );
        let ready = serve.wait_line("node service ready: socket ");
        let (sock, admin) = ready.split_once(" admin http://").expect("ready line");
        assert_eq!(Path::new(sock), socket);
        let c = Self {
            source,
            serve,
            socket,
            admin: admin.to_string(),
        };
        let deadline = Instant::now() + WAIT;
        while raw(&c.admin, "GET", "/readyz", "").0 != 200 {
            assert!(Instant::now() < deadline, "the node never became ready");
            std::thread::sleep(Duration::from_millis(50));
        }
        c
    }
}

/// Deterministic bytes.
pub fn bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Writes `sizes.len()` `.bin` shards into `dir`, indexes it, returns name -> bytes.
pub fn dataset(dir: &Path, sizes: &[usize]) -> HashMap<String, Vec<u8>> {
    std::fs::create_dir_all(dir).unwrap();
    let mut files = HashMap::new();
    for (i, &n) in sizes.iter().enumerate() {
        let name = format!("part-{i:02}");
        let b = bytes(i as u64 + 1, n);
        std::fs::write(dir.join(format!("{name}.bin")), &b).unwrap();
        files.insert(name, b);
    }
    let out = Command::new(BIN)
        .arg("index")
        .arg(dir)
        .output()
        .expect("run shardwire index");
    assert!(
        out.status.success(),
        "index: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    files
}

/// One raw HTTP/1.1 request on its own connection: (status, headers, body).
pub fn raw_full(
    addr: &str,
    method: &str,
    path: &str,
    body: &[u8],
) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    let _ = s.write_all(body); // the server may answer (413) before reading it all
    let mut all = Vec::new();
    let _ = s.read_to_end(&mut all);
    let split = all
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("an HTTP head");
    let head = String::from_utf8_lossy(&all[..split]).to_string();
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    (status, headers, all[split + 4..].to_vec())
}

pub fn raw(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let (status, _, b) = raw_full(addr, method, path, body.as_bytes());
    (status, String::from_utf8_lossy(&b).to_string())
}

pub fn json(body: &str) -> serde_json::Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}
