//! The fake libcuda for tests (`gpu/fakecuda/fake_cuda.c`, a test double of the CUDA driver on
//! host memory): built once per test process by `scripts/build-fakecuda` (the one place with
//! its compiler flags) into `<target>/fakecuda`, and children of the test binary run against it.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The folder holding the fake's `libcuda.so` and `libcuda.so.1`, built on first use.
pub fn lib_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("the workspace root holds gpu/");
        // The test binary is <target>/<profile>/deps/<name>: the fake goes to <target>/fakecuda.
        let exe = std::env::current_exe().expect("the test binary's path");
        let out = exe
            .ancestors()
            .nth(3)
            .expect("<target>/<profile>/deps/<binary>")
            .join("fakecuda");
        let built = Command::new("bash")
            .arg(root.join("scripts/build-fakecuda"))
            .arg(&out)
            .output()
            .expect("run scripts/build-fakecuda (needs bash and a C compiler `cc`)");
        assert!(
            built.status.success(),
            "scripts/build-fakecuda failed:\n{}",
            String::from_utf8_lossy(&built.stderr)
        );
        out
    })
}

/// `LD_LIBRARY_PATH` for a child that must load the fake (first) instead of any real driver.
pub fn ld_library_path() -> OsString {
    let mut path = OsString::from(lib_dir());
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|p| !p.is_empty()) {
        path.push(":");
        path.push(old);
    }
    path
}
