//! `shardwire status`: a readable table of a node's state, read from its admin API.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use serde_json::Value;

/// GET `path` from `admin` (HTTP/1.0, loopback admin API) and parse the JSON body.
fn get_json(admin: &str, path: &str) -> anyhow::Result<Value> {
    let mut s = TcpStream::connect(admin)
        .with_context(|| format!("connecting to the admin API at {admin}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {admin}\r\n\r\n")?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    let (head, body) = resp
        .split_once("\r\n\r\n")
        .context("malformed HTTP response")?;
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        bail!("{admin}{path}: {}", head.lines().next().unwrap_or(""));
    }
    Ok(serde_json::from_str(body)?)
}

fn gib(v: &Value) -> String {
    format!("{:.2} GiB", v.as_f64().unwrap_or(0.0) / (1u64 << 30) as f64)
}

/// Prints the node's status.
pub fn run(admin: &str, json: bool) -> anyhow::Result<ExitCode> {
    let st = get_json(admin, "/v1/status")?;
    if json {
        println!("{}", serde_json::to_string_pretty(&st)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "shardwire {} at {admin}",
        st["version"].as_str().unwrap_or("?")
    );
    println!(
        "mode      receive={} memory={}",
        st["mode"]["receive"].as_str().unwrap_or("?"),
        st["mode"]["memory"].as_str().unwrap_or("?")
    );
    println!("          {}", st["mode"]["reason"].as_str().unwrap_or(""));
    println!(
        "data      {}   socket {}",
        st["data_addr"].as_str().unwrap_or("?"),
        st["socket"].as_str().unwrap_or("?")
    );
    println!(
        "pool      {} reserved of {} (stream_memory {})",
        gib(&st["pool"]["reserved"]),
        gib(&st["pool"]["size"]),
        gib(&st["pool"]["stream_memory"])
    );
    let c = &st["counters"];
    println!(
        "counters  {} received in {} shards, {} batches delivered, {} CRC failures, {} refetches",
        gib(&c["bytes_received"]),
        c["shards_received"],
        c["batches_delivered"],
        c["crc_failures"],
        c["refetches"]
    );
    println!(
        "\n{:<28} {:<5} {:>9} {:>14}  last error",
        "SOURCE", "UP", "IN FLIGHT", "BYTES"
    );
    for s in st["sources"].as_array().into_iter().flatten() {
        println!(
            "{:<28} {:<5} {:>9} {:>14}  {}",
            s["addr"].as_str().unwrap_or("?"),
            if s["up"].as_bool() == Some(true) {
                "yes"
            } else {
                "no"
            },
            s["in_flight"],
            s["bytes_received"],
            s["last_error"].as_str().unwrap_or("-")
        );
    }
    println!(
        "\n{:<6} {:<16} {:>9} {:>12} {:>6} {:>6} {:>16}",
        "STREAM", "DATASET", "RANK", "DELIVERED", "READY", "LEASED", "REGION USED"
    );
    for s in st["streams"].as_array().into_iter().flatten() {
        println!(
            "{:<6} {:<16} {:>9} {:>12} {:>6} {:>6} {:>16}",
            s["id"],
            s["dataset"].as_str().unwrap_or("?"),
            format!("{}/{}", s["rank"], s["world_size"]),
            format!("{}/{}", s["delivered"], s["total"]),
            s["ready"],
            s["leased"],
            format!("{}/{}", s["region_used"], s["region_bytes"])
        );
    }
    Ok(ExitCode::SUCCESS)
}
