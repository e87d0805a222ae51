//! `shardwire`: the node service, the shard source and the tools around them.

mod bench;
mod cli;
mod consume;
mod demo;
mod http;
mod limits;
mod logging;
mod out;
mod serve;
mod source_admin;
mod status;
mod synth;
mod topology;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    // A reader that went away (`| head`) ends the command with 0 and no message (`out`).
    match out::exit_status(cli::run(cli), out::check()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("shardwire: error: {}", chain_text(&e));
            ExitCode::from(1)
        }
    }
}

/// `e` and its causes, `: `-joined, each cause left out when the text so far already holds
/// it (many errors name their cause in their own message, and would print it twice).
fn chain_text(e: &anyhow::Error) -> String {
    let mut text = e.to_string();
    for cause in e.chain().skip(1) {
        let t = cause.to_string();
        if !text.contains(&t) {
            text.push_str(": ");
            text.push_str(&t);
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot read x.parquet: {source}")]
    struct Named {
        source: std::io::Error,
    }

    #[test]
    fn a_cause_the_message_already_names_is_printed_once() {
        let inner = std::io::Error::other("EOF: file too small");
        let e = anyhow::Error::new(Named { source: inner }).context("indexing /d");
        assert_eq!(
            chain_text(&e),
            "indexing /d: cannot read x.parquet: EOF: file too small"
        );
        let plain = anyhow::anyhow!("outer").context("top");
        assert_eq!(chain_text(&plain), "top: outer");
    }
}
