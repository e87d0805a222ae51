//! `shardwire config check` refuses what `serve` and `source` refuse at start, so a file that
//! passes it (CI checks every rendered Kubernetes config with it) does not crash-loop.

use std::process::Command;

fn check(name: &str, body: &str, source: bool) -> (bool, String) {
    check_with_env(name, body, source, &[])
}

/// `config check` of `body` with the variables `env` exported to it.
fn check_with_env(name: &str, body: &str, source: bool, env: &[(&str, &str)]) -> (bool, String) {
    let p = std::env::temp_dir().join(format!(
        "sw-config-check-{}-{name}.toml",
        std::process::id()
    ));
    std::fs::write(&p, body).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_shardwire"));
    cmd.args(["config", "check"])
        .arg(&p)
        .envs(env.iter().copied());
    if source {
        cmd.arg("--source-config");
    }
    let out = cmd.output().unwrap();
    let _ = std::fs::remove_file(&p);
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn a_serve_file_without_sources_and_a_source_file_with_a_bad_dataset_are_refused() {
    // Before, both passed `config check`, and the process refused them at start.
    let (ok, text) = check("nosources", "flows = 2\n", false);
    assert!(!ok && text.contains("`sources` is empty"), "{text}");
    let (ok, text) = check("good", "sources = [\"dns:src.ml.svc:7500\"]\n", false);
    assert!(ok, "{text}");
    let (ok, text) = check("dataset", "datasets = [\"example\"]\n", true);
    assert!(!ok && text.contains("datasets"), "{text}");
}

#[test]
fn config_check_judges_the_file_alone_whatever_is_exported() {
    // Before, the SHARDWIRE_* variables of the shell were merged over the file: an exported
    // `SHARDWIRE_FLOWS=2` hid the file's `flows = 0`, and a stray bad variable failed a good
    // file. `config print` still shows them merged, as `serve` reads them.
    let bad = "sources = [\"dns:src.ml.svc:7500\"]\nflows = 0\n";
    let (ok, text) = check_with_env("flows0", bad, false, &[("SHARDWIRE_FLOWS", "2")]);
    assert!(!ok && text.contains("flows"), "{text}");
    let good = "sources = [\"dns:src.ml.svc:7500\"]\n";
    let (ok, text) = check_with_env("good-env", good, false, &[("SHARDWIRE_POOL_SIZE", "abc")]);
    assert!(ok, "{text}");
    let (ok, text) = check_with_env(
        "src-env",
        "datasets = [\"d=/data\"]\n",
        true,
        &[("SHARDWIRE_DATASETS", "[\"my data=/d\"]")],
    );
    assert!(ok, "{text}");
}
