//! Arrow IPC files (`.arrow`, `.arrows`, `.ipc`, `.feather`), file and stream format:
//! one shard per record batch (its body), one tensor per column.
//!
//! Only flatbuffer metadata is read (footer, schema, record batch headers); bodies are
//! checksummed in chunks, never decoded. The file format is recognised by its leading
//! `ARROW1` magic; anything else is read as a stream of encapsulated messages
//! (`[0xFFFFFFFF] <i32 metadata length> <Message flatbuffer + padding> <body>`).
//!
//! Which column types become which tensors: [`layout`] (the schema's columns), [`batch`] (fixed-width) and [`lists`]
//! (lists and strings, ragged or dense; the rule for nested lists is there). Only the
//! offsets buffers of list and string columns are read from a body. Dictionary batches are
//! ignored: a dictionary column is never served (it is an error, or skipped), nor is a
//! `string_view`/`binary_view` column (stepped over with the record batch's
//! `variadicBufferCounts`).

mod batch;
mod body;
mod layout;
mod lists;
mod pytype;

use std::collections::HashSet;

use arrow_ipc::{Endianness, Message, MessageHeader, MetadataVersion, RecordBatch};
use shardwire_protocol::manifest::ShardEntry;

use self::batch::batch_tensors_within;
use self::body::Step;
use self::body::{BatchFail, BatchLayout};
pub(crate) use self::layout::Choice;
use self::layout::{PlanErr, SchemaPlan, Slot, plan_schema};
pub(crate) use self::lists::harmonize;
use crate::budget::{self, FileCheck, Floor};
use crate::error::{BatchAt, IndexError};
use crate::source::Source;

/// What one Arrow file yields.
#[derive(Debug, Default)]
pub(crate) struct ArrowFile {
    /// One per record batch with rows.
    pub shards: Vec<ShardEntry>,
    /// (column, pyarrow type, reason) of the unsupported columns skipped.
    pub skipped: Vec<(String, String, String)>,
    /// Columns that are lists of lists (dense or ragged per shard; see [`harmonize`]).
    pub nested: HashSet<String>,
}

/// File-format magic (at the start, padded to 8 bytes, and at the end).
const MAGIC: &[u8; 6] = b"ARROW1";
/// Continuation marker before the metadata length (since Arrow 0.15).
const CONTINUATION: [u8; 4] = [0xff; 4];

/// Indexes an Arrow IPC file (file or stream format), serving the columns `choice` keeps;
/// each tensor's rows are counted in `check` as it is planned.
pub(crate) fn index(
    src: &mut Source,
    choice: Choice<'_>,
    check: &mut FileCheck<'_>,
) -> Result<ArrowFile, IndexError> {
    if src.len == 0 {
        return Err(src.malformed("the Arrow IPC file is empty", "0 bytes"));
    }
    let head = src.read_at("file header", 0, src.len.min(8))?;
    let (plan, shards) = if head.starts_with(MAGIC) {
        file_format(src, choice, check)?
    } else if head.starts_with(b"FEA1") {
        return Err(src.unsupported(
            "Feather V1 files are not supported; write Feather V2 (Arrow IPC)",
            "FEA1 magic",
        ));
    } else {
        stream_format(src, choice, check)?
    };
    let nested = plan
        .slots
        .iter()
        .filter_map(|s| match s {
            Slot::Column(c) if c.lists.len() >= 2 => Some(c.name.clone()),
            _ => None,
        })
        .collect();
    Ok(ArrowFile {
        shards,
        skipped: plan.skipped,
        nested,
    })
}

/// A schema's plan and the shards of the batches.
type Planned = (SchemaPlan, Vec<ShardEntry>);

/// The IPC file format: footer with the schema and the record batch blocks.
fn file_format(
    src: &mut Source,
    choice: Choice<'_>,
    check: &mut FileCheck<'_>,
) -> Result<Planned, IndexError> {
    if src.len < 8 + 10 {
        return Err(src.malformed(
            "Arrow IPC file is too short to hold a footer",
            format!("{} bytes", src.len),
        ));
    }
    let tail = src.read_at("file trailer", src.len - 10, 10)?;
    if &tail[4..] != MAGIC {
        return Err(src.malformed(
            "Arrow IPC file does not end with the ARROW1 magic (truncated?)",
            hex(&tail[4..]),
        ));
    }
    let footer_len = i32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]);
    let footer_len = u64::try_from(footer_len)
        .ok()
        .filter(|&l| l <= src.len - 18)
        .ok_or_else(|| src.malformed("invalid footer length", footer_len))?;
    let footer_start = src.len - 10 - footer_len;
    let bytes = src.read_at("footer", footer_start, footer_len)?;
    let footer = arrow_ipc::root_as_footer(&bytes)
        .map_err(|e| src.malformed("invalid footer flatbuffer", e))?;
    let schema = footer
        .schema()
        .ok_or_else(|| src.malformed("the footer has no schema", "none"))?;
    let plans = plans_for(src, schema, choice)?;
    let mut shards = Vec::new();
    // After the leading `ARROW1` magic and its padding.
    let mut prev_end = 8u64;
    for (i, block) in footer.recordBatches().into_iter().flatten().enumerate() {
        let (off, meta_len, body_len) = block_range(src, i, block, prev_end, footer_start)?;
        prev_end = off + meta_len + body_len;
        let meta = src.read_at(&format!("record batch {i} metadata"), off, meta_len)?;
        let msg = parse_encapsulated(&meta).map_err(|e| {
            src.malformed(
                format!("record batch {i}: {e}"),
                format!("block at offset {off}"),
            )
        })?;
        if msg.header_type() != MessageHeader::RecordBatch {
            return Err(src.malformed(
                format!("record batch {i}: block does not hold a record batch"),
                header_name(&msg),
            ));
        }
        if u64::try_from(msg.bodyLength()).ok() != Some(body_len) {
            return Err(src.malformed(
                format!("record batch {i}: block and message disagree on the body length"),
                msg.bodyLength(),
            ));
        }
        let body = (off + meta_len, body_len);
        shards.extend(batch_shard(src, &plans.slots, i, &msg, body, check)?);
    }
    Ok((plans, shards))
}

/// The `(offset, metadata length, body length)` of the footer's record batch block `i`:
/// it must start at or after `prev_end`, where the block before it ends, and end by
/// `footer_start`. Writers list the blocks in file order, one after another; a footer that
/// lists one block twice (or blocks that overlap) would serve the same rows twice, and plan
/// a row table for each time.
fn block_range(
    src: &Source,
    i: usize,
    block: &arrow_ipc::Block,
    prev_end: u64,
    footer_start: u64,
) -> Result<(u64, u64, u64), IndexError> {
    let (off, meta_len, body_len) = (block.offset(), block.metaDataLength(), block.bodyLength());
    let bad = |reason: &str| {
        src.malformed(
            format!("record batch {i}: {reason}"),
            format!("offset {off}, metadata {meta_len}, body {body_len}"),
        )
    };
    let (Ok(start), Ok(meta), Ok(body)) = (
        u64::try_from(off),
        u64::try_from(meta_len),
        u64::try_from(body_len),
    ) else {
        return Err(bad("invalid block"));
    };
    if start < prev_end {
        return Err(bad(&format!(
            "its block starts before the block before it ends, at {prev_end}: the footer lists \
             a record batch twice, or out of order (a damaged or hand-edited file); write the \
             file again"
        )));
    }
    let end = start.checked_add(meta).and_then(|e| e.checked_add(body));
    if end.is_none_or(|e| e > footer_start) {
        return Err(bad(&format!(
            "its block runs past the start of the footer, at {footer_start}"
        )));
    }
    Ok((start, meta, body))
}

/// The IPC stream format: a schema message, then record batches, up to the end marker
/// (every writer writes it when it closes the stream: one without it was cut short, and its
/// later record batches lost; nothing but zero bytes may follow it: see [`check_after_end`]).
fn stream_format(
    src: &mut Source,
    choice: Choice<'_>,
    check: &mut FileCheck<'_>,
) -> Result<Planned, IndexError> {
    let mut pos = 0u64;
    let mut plans: Option<SchemaPlan> = None;
    let mut shards = Vec::new();
    let mut batch = 0usize;
    // Where the end-of-stream marker ends, once found.
    let mut ended = None;
    while src.len - pos >= 4 {
        let mut word = src.read_at("message length", pos, 4)?;
        let mut prefix = 4;
        if word[..] == CONTINUATION {
            word = src.read_at("message length", pos + 4, 4)?;
            prefix = 8;
        }
        let meta_len = i32::from_le_bytes([word[0], word[1], word[2], word[3]]);
        if meta_len == 0 {
            ended = Some(pos + prefix); // the end-of-stream marker
            break;
        }
        let meta_len = u64::try_from(meta_len).map_err(|_| {
            src.malformed(format!("invalid metadata length at offset {pos}"), meta_len)
        })?;
        let meta_start = pos + prefix;
        let meta = src.read_at(&format!("message at offset {pos}"), meta_start, meta_len)?;
        let msg = arrow_ipc::root_as_message(&meta).map_err(|e| {
            src.malformed(format!("message at offset {pos} is not an IPC message"), e)
        })?;
        let body_len = u64::try_from(msg.bodyLength()).map_err(|_| {
            src.malformed(
                format!("message at offset {pos}: invalid body length"),
                msg.bodyLength(),
            )
        })?;
        let body_start = meta_start + meta_len;
        src.check_range(
            &format!("message body at offset {body_start}"),
            body_start,
            body_len,
        )?;
        check_version(src, &msg)?;
        match (msg.header_type(), &plans) {
            (MessageHeader::Schema, None) => {
                let schema = msg
                    .header_as_schema()
                    .ok_or_else(|| src.malformed("schema message without a schema", pos))?;
                plans = Some(plans_for(src, schema, choice)?);
            }
            (MessageHeader::RecordBatch, Some(p)) => {
                let body = (body_start, body_len);
                shards.extend(batch_shard(src, &p.slots, batch, &msg, body, check)?);
                batch += 1;
            }
            // Only dictionary columns use them, and those are never served.
            (MessageHeader::DictionaryBatch, Some(_)) => {}
            (_, None) => {
                return Err(src.malformed(
                    "the stream does not start with a schema message",
                    header_name(&msg),
                ));
            }
            (_, Some(_)) => {
                return Err(src.unsupported(
                    format!("unexpected message at offset {pos}"),
                    header_name(&msg),
                ));
            }
        }
        pos = body_start + body_len;
    }
    Ok((stream_end(src, plans, ended, pos)?, shards))
}

/// The stream's plan once its messages are read (up to `pos`): refused where it had no schema
/// message, no end-of-stream marker (`ended`, where the marker ends), or data after it.
fn stream_end(
    src: &mut Source,
    plans: Option<SchemaPlan>,
    ended: Option<u64>,
    pos: u64,
) -> Result<SchemaPlan, IndexError> {
    let Some(plans) = plans else {
        let head = src.read_at("file header", 0, src.len.min(8))?;
        return Err(src.malformed(
            "not an Arrow IPC file or stream (no schema message)",
            hex(&head),
        ));
    };
    let Some(end) = ended else {
        return Err(src.malformed(
            "the stream ends without its end-of-stream marker: it was cut short (a writer that did not close it, a partial copy); write or copy it again",
            format!("{} bytes after the last whole message, at {pos}", src.len - pos),
        ));
    };
    check_after_end(src, end)?;
    Ok(plans)
}

/// Refuses a stream with data after its end-of-stream marker (which ends at `end`): writers
/// put nothing there, and a reader stops at the marker, so what follows (most often a second
/// stream, `cat a.arrows b.arrows > c.arrows`) would be left out without a word. Zero bytes
/// (padding) are allowed.
fn check_after_end(src: &mut Source, end: u64) -> Result<(), IndexError> {
    let Some(at) = src.first_nonzero("the bytes after the end-of-stream marker", end)? else {
        return Ok(());
    };
    Err(src.malformed(
        "data follows the stream's end-of-stream marker, which readers stop at: the file looks \
         like several streams concatenated (`cat a.arrows b.arrows`), whose later record \
         batches would be left out; keep each stream in a file of its own, or write them \
         again as one stream",
        format!(
            "{} bytes after the marker at {end}, the first non-zero at {at}",
            src.len - end
        ),
    ))
}

/// Checks endianness and converts the schema into column plans.
fn plans_for(
    src: &Source,
    schema: arrow_ipc::Schema<'_>,
    choice: Choice<'_>,
) -> Result<SchemaPlan, IndexError> {
    if schema.endianness() != Endianness::Little {
        return Err(src.unsupported("big-endian Arrow data is not supported", "endianness Big"));
    }
    let schema = arrow_ipc::convert::try_fb_to_schema(schema)
        .map_err(|e| src.malformed("invalid schema", e))?;
    plan_schema(&schema, choice).map_err(|e| match e {
        PlanErr::Column((column, reason, value)) if column.is_empty() => {
            src.unsupported_data(reason, value)
        }
        PlanErr::Column((column, reason, value)) => IndexError::Column {
            file: src.data_file().to_path_buf(),
            batch: None,
            column,
            reason,
            value,
        },
        PlanErr::Unknown(column, available) => IndexError::UnknownColumn {
            file: src.data_file().to_path_buf(),
            column,
            available: available.join(", "),
        },
    })
}

/// The shard of one record batch message whose body is `(start, length)` (None for a batch
/// with no rows); each of its tensors is counted in `check` as soon as it is built, and a
/// ragged one's row count also before its row table is built.
fn batch_shard(
    src: &mut Source,
    slots: &[Slot],
    index: usize,
    msg: &Message<'_>,
    (body_start, body_len): (u64, u64),
    check: &mut FileCheck<'_>,
) -> Result<Option<ShardEntry>, IndexError> {
    check_version(src, msg)?;
    let rb = msg
        .header_as_record_batch()
        .ok_or_else(|| src.malformed(format!("record batch {index}: no header"), "none"))?;
    if let Some(c) = rb.compression() {
        return Err(src.unsupported(
            "compressed IPC (LZ4/ZSTD) is not supported; write with compression=None \
             (pyarrow.feather.write_feather: compression='uncompressed')",
            format!(
                "record batch {index} compressed with {}",
                c.codec().variant_name().unwrap_or("an unknown codec")
            ),
        ));
    }
    src.check_range(&format!("record batch {index} body"), body_start, body_len)?;
    let rows = u64::try_from(rb.length()).map_err(|_| {
        src.malformed(
            format!("record batch {index}: invalid row count"),
            rb.length(),
        )
    })?;
    if rows == 0 {
        return Ok(None);
    }
    let layout = batch_layout(&rb, msg, rows);
    let rel = src.rel.clone();
    let mut read = |what: &str, off: u64, len: u64| {
        src.read_at(
            &format!("record batch {index} {what}"),
            body_start + off,
            len,
        )
    };
    let tensors = batch_tensors_within(
        slots,
        &layout,
        body_start,
        body_len,
        &mut read,
        &mut batch_check(check, &rel, index),
    );
    let tensors = match tensors {
        Ok(t) => t,
        Err(BatchFail::Read(e)) => return Err(e),
        Err(BatchFail::Layout((Some(column), reason, value))) => {
            return Err(IndexError::Column {
                file: src.data_file().to_path_buf(),
                batch: Some(Box::new(BatchAt::Batch(index))),
                column,
                reason,
                value,
            });
        }
        Err(BatchFail::Layout((None, reason, value))) => {
            return Err(src.malformed(format!("record batch {index}: {reason}"), value));
        }
    };
    if body_len == 0 {
        return Err(src.unsupported(
            format!("record batch {index} has an empty body; a shard cannot be empty"),
            "0 bytes",
        ));
    }
    let shard = src.shard(body_start, body_len, tensors)?;
    check.planned(&shard);
    Ok(Some(shard))
}

/// The field nodes, buffers, variadic counts and version of a record batch of `rows` rows, as
/// its message `msg` (header `rb`) gives them.
fn batch_layout(rb: &RecordBatch<'_>, msg: &Message<'_>, rows: u64) -> BatchLayout {
    BatchLayout {
        rows,
        nodes: rb
            .nodes()
            .into_iter()
            .flatten()
            .map(|n| (n.length(), n.null_count()))
            .collect(),
        buffers: rb
            .buffers()
            .into_iter()
            .flatten()
            .map(|b| (b.offset(), b.length()))
            .collect(),
        variadic: rb.variadicBufferCounts().into_iter().flatten().collect(),
        version: msg.version(),
    }
}

/// Counts the tensors of record batch `index` of the file `rel` in `check` as they are built.
/// A row table about to be built is checked first, with the tensors built before it, and not
/// kept: its tensor is counted once built, with at least as many bytes
/// ([`budget::ragged_floor`] with rows ending at 0).
fn batch_check<'a>(
    check: &'a FileCheck<'_>,
    rel: &'a str,
    index: usize,
) -> impl FnMut(Step<'_>) -> Result<(), IndexError> + 'a {
    let mut part = Floor::default();
    move |step: Step<'_>| {
        let at = |what: String| {
            format!(" (counted up to {rel}, while planning its record batch {index}{what})")
        };
        match step {
            Step::Rows { name, rows } => {
                let more = part.plus(budget::ragged_floor(name, rows, 0));
                let why = || at(format!(": column {name}, before building its {rows} rows"));
                check.check(more, why)
            }
            Step::Built(t) => {
                part = part.plus(budget::tensor_floor(t));
                check.check(part, || at(String::new()))
            }
        }
    }
}

/// Accepts metadata versions V4 and V5 (Arrow 0.8 and later).
fn check_version(src: &Source, msg: &Message<'_>) -> Result<(), IndexError> {
    let v = msg.version();
    if v == MetadataVersion::V4 || v == MetadataVersion::V5 {
        Ok(())
    } else {
        Err(src.unsupported(
            "IPC metadata version is not supported (V4 and V5 are)",
            v.variant_name().unwrap_or("unknown"),
        ))
    }
}

/// Parses an encapsulated message: optional continuation marker, i32 length, flatbuffer.
fn parse_encapsulated(buf: &[u8]) -> Result<Message<'_>, String> {
    let rest = if buf.len() >= 4 && buf[..4] == CONTINUATION {
        &buf[4..]
    } else {
        buf
    };
    if rest.len() < 4 {
        return Err("message metadata is truncated".into());
    }
    let len = i32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
    let fb = usize::try_from(len)
        .ok()
        .and_then(|l| rest.get(4..4 + l))
        .ok_or_else(|| format!("message metadata length {len} exceeds the block"))?;
    arrow_ipc::root_as_message(fb).map_err(|e| format!("invalid message flatbuffer: {e}"))
}

fn header_name(msg: &Message<'_>) -> String {
    msg.header_type()
        .variant_name()
        .unwrap_or("unknown message")
        .to_string()
}

fn hex(b: &[u8]) -> String {
    b.iter()
        .map(|x| format!("{x:02x}"))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod hostile_tests;
#[cfg(test)]
mod list_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod view_tests;
