//! Prints what `shardwire-topology` finds under a sysfs root, as text or JSON:
//! `cargo run -p shardwire-topology --example topology -- [ROOT] [--json] [--include-virtual IF]...`
//! (ROOT defaults to `/sys`). For checking a real host or a fixture tree by eye.

use std::path::PathBuf;
use std::process::ExitCode;

use shardwire_topology::{DEFAULT_ROOT, PairOptions, Topology, render_text};

fn main() -> ExitCode {
    let mut root = PathBuf::from(DEFAULT_ROOT);
    let mut json = false;
    let mut opts = PairOptions::default();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--json" => json = true,
            "--include-virtual" => opts.include_virtual.extend(args.next()),
            _ => root = PathBuf::from(arg),
        }
    }
    let topo = match Topology::discover(&root, &opts) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    if json {
        match serde_json::to_string_pretty(&topo) {
            Ok(s) => println!("{s}"),
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        print!("{}", render_text(&topo));
    }
    ExitCode::SUCCESS
}
