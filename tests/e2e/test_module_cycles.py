"""scripts/check-module-cycles (run by scripts/test's lint phase) on small crates written
here: it must find a circle through `use` trees, `super::` and inline paths, name the lines,
and pass a crate whose children use their parent but not the other way round."""

from __future__ import annotations

import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "check-module-cycles"


def crate(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "Cargo.toml").write_text('[package]\nname = "t"\n')
    for rel, text in files.items():
        p = root / "src" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def run(d: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(d)], capture_output=True, text=True, timeout=60)


def test_a_circle_through_use_trees_and_paths_is_named_with_its_lines(tmp_path: pathlib.Path):
    # a uses b and c through one use tree; b names a only in a comment and a string.
    files = {
        "lib.rs": "mod a;\nmod b;\nmod c;\n",
        "a.rs": "use crate::{b::{self, Thing}, c};\npub fn f() {}\n",
        "b.rs": "// crate::a::f in a comment is not an edge\nfn g() { let s = \"crate::a\"; }\n",
        "c.rs": "fn h() {}\n",
    }
    r = run(crate(tmp_path / "one", files))
    assert r.returncode == 0, r.stdout + r.stderr
    # c now calls back into a with an inline path: a -> c -> a.
    files["c.rs"] = "fn h() { super::a::f(); }\n"
    r = run(crate(tmp_path / "two", files))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "a, c" in r.stdout and "a -> c" in r.stdout and "c -> a" in r.stdout, r.stdout
    assert "src/a.rs:1" in r.stdout and "src/c.rs:1" in r.stdout, r.stdout


def test_children_may_use_their_parent_and_tests_are_not_edges(tmp_path: pathlib.Path):
    d = crate(tmp_path, {
        "lib.rs": "mod s;\n",
        "s/mod.rs": "mod leaf;\nmod user;\nuse self::leaf::X;\n#[cfg(test)]\nmod tests;\n",
        "s/leaf.rs": "pub struct X;\n",
        "s/user.rs": "use super::leaf::X;\nuse super::Y;\n#[cfg(test)]\nmod t {\n    use crate::s::user;\n}\n",
        "s/tests.rs": "use super::user;\n",
    })
    r = run(d)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no import circle" in r.stdout
