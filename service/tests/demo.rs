//! The README's first command, as a test: `shardwire demo` must verify every batch and exit 0.

use std::process::Command;

#[test]
fn demo_verifies_every_batch() {
    let out = Command::new(env!("CARGO_BIN_EXE_shardwire"))
        .arg("demo")
        .output()
        .expect("run shardwire demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "demo failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("demo ok: 12 shards"), "{stdout}");
    assert!(stdout.contains("CRC failures: 0"), "{stdout}");
}

#[test]
fn index_rejects_a_missing_directory_with_its_name() {
    let out = Command::new(env!("CARGO_BIN_EXE_shardwire"))
        .args(["index", "/nonexistent/shardwire-dataset"])
        .output()
        .expect("run shardwire index");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/shardwire-dataset"), "{err}");
}

#[test]
fn serve_config_errors_name_the_key() {
    let dir = std::env::temp_dir().join(format!("sw-cfg-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("serve.toml");
    std::fs::write(&f, "sources = [\"127.0.0.1:1\"]\npool_sise = \"1GiB\"\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_shardwire"))
        .args(["serve", "--config"])
        .arg(&f)
        .output()
        .expect("run shardwire serve");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("pool_sise"), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_shardwire"))
        .args(["serve", "--source", "127.0.0.1:1", "--flows", "0"])
        .output()
        .expect("run shardwire serve");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("`flows`") && err.contains("between 1 and 64"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn environment_overrides_the_file_and_foreign_variables_are_ignored() {
    let dir = std::env::temp_dir().join(format!("sw-env-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("serve.toml");
    std::fs::write(&f, "flows = 3\nlog_format = \"text\"\n").unwrap();
    let print = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_shardwire"))
            .args(["config", "print", "--config"])
            .arg(&f)
            .args(args)
            .env("SHARDWIRE_FLOWS", "5")
            .env("SHARDWIRE_SECRET_FILE", "/etc/sw/secret")
            .env("SHARDWIRE_BIN", "ignored: not a key of serve")
            .output()
            .expect("run shardwire config print");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let v = print(&[]);
    assert_eq!(v["flows"], 5, "{v}");
    assert_eq!(v["secret_file"], "/etc/sw/secret", "{v}");
    assert_eq!(v["log_format"], "text", "{v}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn nics_reports_loopback_as_not_devmem_capable_with_the_kernel_reason() {
    let out = Command::new(env!("CARGO_BIN_EXE_shardwire"))
        .args(["nics", "--json"])
        .output()
        .expect("run shardwire nics");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let lo = v
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["name"] == "lo")
        .expect("lo is listed");
    assert_eq!(lo["devmem_capable"], false, "{lo}");
    let reason = lo["reason"].as_str().unwrap();
    // As root the kernel's device check answers (EOPNOTSUPP); without CAP_NET_ADMIN, EPERM.
    assert!(
        reason.contains("EOPNOTSUPP") || reason.contains("EPERM"),
        "{reason}"
    );
}

#[test]
fn memory_cuda_without_a_gpu_refuses_to_start_and_auto_says_why_it_chose_host() {
    let dir = std::env::temp_dir().join(format!("sw-cuda-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_shardwire"))
        .args([
            "serve",
            "--source",
            "127.0.0.1:9",
            "--memory",
            "cuda",
            "--data-listen",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
        ])
        .arg("--socket")
        .arg(dir.join("t.sock"))
        .output()
        .expect("run shardwire serve");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "serve --memory cuda started on a host without CUDA: {err}"
    );
    assert!(
        err.contains("memory = \"cuda\"") && err.contains("libcuda"),
        "{err}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_shardwire"))
        .args(["gpus", "--json"])
        .output()
        .expect("run shardwire gpus");
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    if v["probe"]["driver_present"] == false {
        assert_eq!(v["auto"]["memory"], "host", "{v}");
        assert!(
            v["auto"]["reason"]
                .as_str()
                .unwrap()
                .contains("no CUDA driver"),
            "{v}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn demo_runs_on_the_devmem_emulator_and_says_so() {
    let out = Command::new(env!("CARGO_BIN_EXE_shardwire"))
        .args(["demo", "--receive", "devmem-sim"])
        .output()
        .expect("run shardwire demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("demo ok: 12 shards"), "{stdout}");
    assert!(stdout.contains("receive=devmem-sim"), "{stdout}");
    assert!(stdout.contains("NOT GPU-direct"), "{stdout}");
}

/// Crash recovery of NIC changes: a state file left behind (here: a real channel change on
/// a veth in a fresh network namespace, journaled and then abandoned) is undone when
/// `serve` starts.
#[test]
fn serve_restores_nic_changes_left_by_a_crashed_run() {
    use shardwire_devmem::nic::{EthtoolClient, Journal};
    if !is_root() {
        eprintln!("skipped: needs root (a network namespace and a veth of its own)");
        return;
    }
    let ns = format!("swserve-{}", std::process::id());
    let ip = |args: &[&str]| {
        let st = Command::new("ip").args(args).status().expect("run ip");
        assert!(st.success(), "ip {args:?}");
    };
    ip(&["netns", "add", &ns]);
    struct Del(String);
    impl Drop for Del {
        fn drop(&mut self) {
            let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
        }
    }
    let _del = Del(ns.clone());
    ip(&[
        "-n",
        &ns,
        "link",
        "add",
        "va",
        "numrxqueues",
        "4",
        "numtxqueues",
        "4",
        "type",
        "veth",
        "peer",
        "name",
        "vb",
    ]);
    let nspath = std::path::PathBuf::from("/var/run/netns").join(&ns);
    let ifindex: u32 = String::from_utf8(
        Command::new("ip")
            .args(["-n", &ns, "-o", "link", "show", "dev", "va"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap()
    .split(':')
    .next()
    .unwrap()
    .trim()
    .parse()
    .unwrap();
    let dir = std::env::temp_dir().join(format!("sw-nicstate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let state = dir.join("nic-state.json");
    let mut c = EthtoolClient::open_in_netns(&nspath).unwrap();
    let before = c.channels(ifindex, "va").unwrap();
    let mut j = Journal::create(&state, "va", ifindex, Some(nspath.clone())).unwrap();
    j.set_channels(&mut c, 1, before.tx, before.combined)
        .unwrap();
    drop(j); // the "crash": nothing undone, the journal stays
    assert_eq!(c.channels(ifindex, "va").unwrap().rx, 1);

    let mut child = Command::new(env!("CARGO_BIN_EXE_shardwire"))
        .arg("serve")
        .args(["--source", "127.0.0.1:1", "--data-listen", "127.0.0.1:0"])
        .args(["--admin", "127.0.0.1:0", "--socket"])
        .arg(dir.join("t.sock"))
        .arg("--nic-state-file")
        .arg(&state)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Its log lines arrive on a channel: a serve that never says it is ready fails the test
    // after a minute instead of hanging it, and is killed either way.
    let err = child.stderr.take().unwrap();
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let serve = Kill(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in std::io::BufRead::lines(std::io::BufReader::new(err)) {
            let Ok(l) = l else { break };
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let mut log = String::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                log.push_str(&line);
                log.push('\n');
                if line.contains("node service ready") {
                    break;
                }
            }
            Err(e) => panic!("serve did not get ready ({e}): {log}"),
        }
    }
    drop(serve);
    assert!(log.contains("restored NIC settings"), "{log}");
    assert!(!state.exists(), "state file removed");
    assert_eq!(c.channels(ifindex, "va").unwrap(), before, "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Whether this test runs as root (`ip netns` and ethtool changes need it).
fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|l| l.split_whitespace().nth(1))
            == Some("0")
    })
}
