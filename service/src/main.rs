//! `shardwire`: the node service, the shard source and the tools around them.

mod bench;
mod cli;
mod consume;
mod demo;
mod http;
mod logging;
mod serve;
mod source_admin;
mod status;
mod synth;
mod topology;

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
