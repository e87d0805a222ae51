//! `shardwire`: the node service, the shard source and the tools around them.

mod admin;
mod bench;
mod bindings;
mod cli;
mod consume;
mod demo;
mod httpd;
mod node;
mod prom;
mod status;
mod synth;
mod trainer_http;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    match cli::run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("shardwire: error: {e:#}");
            ExitCode::from(1)
        }
    }
}
