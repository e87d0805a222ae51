//! Arrow IPC files (`.arrow`, `.arrows`, `.ipc`, `.feather`), file and stream format:
//! one shard per record batch (its body), one tensor per column.
//!
//! Only flatbuffer metadata is read (footer, schema, record batch headers); bodies are
//! checksummed in chunks, never decoded. The file format is recognised by its leading
//! `ARROW1` magic; anything else is read as a stream of encapsulated messages
//! (`[0xFFFFFFFF] <i32 metadata length> <Message flatbuffer + padding> <body>`).

mod layout;

use arrow_ipc::{Endianness, Message, MessageHeader, MetadataVersion};
use shardwire_protocol::manifest::ShardEntry;

use self::layout::{BatchLayout, ColumnPlan, batch_tensors, plan_schema};
use crate::error::IndexError;
use crate::source::Source;

/// File-format magic (at the start, padded to 8 bytes, and at the end).
const MAGIC: &[u8; 6] = b"ARROW1";
/// Continuation marker before the metadata length (since Arrow 0.15).
const CONTINUATION: [u8; 4] = [0xff; 4];

/// Indexes an Arrow IPC file (file or stream format).
pub(crate) fn index(src: &mut Source) -> Result<Vec<ShardEntry>, IndexError> {
    if src.len == 0 {
        return Err(src.malformed("the Arrow IPC file is empty", "0 bytes"));
    }
    let head = src.read_at("file header", 0, src.len.min(8))?;
    if head.starts_with(MAGIC) {
        file_format(src)
    } else if head.starts_with(b"FEA1") {
        Err(src.unsupported(
            "Feather V1 files are not supported; write Feather V2 (Arrow IPC)",
            "FEA1 magic",
        ))
    } else {
        stream_format(src)
    }
}

/// The IPC file format: footer with the schema and the record batch blocks.
fn file_format(src: &mut Source) -> Result<Vec<ShardEntry>, IndexError> {
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
    let bytes = src.read_at("footer", src.len - 10 - footer_len, footer_len)?;
    let footer = arrow_ipc::root_as_footer(&bytes)
        .map_err(|e| src.malformed("invalid footer flatbuffer", e))?;
    let schema = footer
        .schema()
        .ok_or_else(|| src.malformed("the footer has no schema", "none"))?;
    let plans = plans_for(src, schema)?;
    if footer.dictionaries().is_some_and(|d| !d.is_empty()) {
        return Err(src.unsupported(
            "dictionary batches are not supported",
            "dictionary blocks in the footer",
        ));
    }
    let mut shards = Vec::new();
    for (i, block) in footer.recordBatches().into_iter().flatten().enumerate() {
        let (off, meta_len, body_len) =
            (block.offset(), block.metaDataLength(), block.bodyLength());
        let bad = || {
            src.malformed(
                format!("record batch {i}: invalid block"),
                format!("offset {off}, metadata {meta_len}, body {body_len}"),
            )
        };
        let (Ok(off), Ok(meta_len), Ok(body_len)) = (
            u64::try_from(off),
            u64::try_from(meta_len),
            u64::try_from(body_len),
        ) else {
            return Err(bad());
        };
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
        shards.extend(batch_shard(src, &plans, i, &msg, off + meta_len, body_len)?);
    }
    Ok(shards)
}

/// The IPC stream format: a schema message, then record batches, up to an end marker or EOF.
fn stream_format(src: &mut Source) -> Result<Vec<ShardEntry>, IndexError> {
    let mut pos = 0u64;
    let mut plans: Option<Vec<ColumnPlan>> = None;
    let mut shards = Vec::new();
    let mut batch = 0usize;
    while src.len - pos >= 4 {
        let mut word = src.read_at("message length", pos, 4)?;
        let mut prefix = 4;
        if word[..] == CONTINUATION {
            word = src.read_at("message length", pos + 4, 4)?;
            prefix = 8;
        }
        let meta_len = i32::from_le_bytes([word[0], word[1], word[2], word[3]]);
        if meta_len == 0 {
            break; // end-of-stream marker
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
                plans = Some(plans_for(src, schema)?);
            }
            (MessageHeader::RecordBatch, Some(p)) => {
                shards.extend(batch_shard(src, p, batch, &msg, body_start, body_len)?);
                batch += 1;
            }
            (MessageHeader::DictionaryBatch, _) => {
                return Err(src.unsupported(
                    "dictionary batches are not supported",
                    format!("dictionary batch at offset {pos}"),
                ));
            }
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
    if plans.is_none() {
        let head = src.read_at("file header", 0, src.len.min(8))?;
        return Err(src.malformed(
            "not an Arrow IPC file or stream (no schema message)",
            hex(&head),
        ));
    }
    Ok(shards)
}

/// Checks endianness and converts the schema into column plans.
fn plans_for(src: &Source, schema: arrow_ipc::Schema<'_>) -> Result<Vec<ColumnPlan>, IndexError> {
    if schema.endianness() != Endianness::Little {
        return Err(src.unsupported("big-endian Arrow data is not supported", "endianness Big"));
    }
    let schema = arrow_ipc::convert::try_fb_to_schema(schema)
        .map_err(|e| src.malformed("invalid schema", e))?;
    plan_schema(&schema).map_err(|(column, reason, value)| IndexError::Column {
        file: src.path.clone(),
        batch: None,
        column,
        reason,
        value,
    })
}

/// The shard of one record batch message (None for a batch with no rows).
fn batch_shard(
    src: &mut Source,
    plans: &[ColumnPlan],
    index: usize,
    msg: &Message<'_>,
    body_start: u64,
    body_len: u64,
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
    let layout = BatchLayout {
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
    };
    let tensors = batch_tensors(plans, &layout, body_start, body_len).map_err(
        |(column, reason, value)| match column {
            Some(column) => IndexError::Column {
                file: src.path.clone(),
                batch: Some(index),
                column,
                reason,
                value,
            },
            None => src.malformed(format!("record batch {index}: {reason}"), value),
        },
    )?;
    if body_len == 0 {
        return Err(src.unsupported(
            format!("record batch {index} has an empty body; a shard cannot be empty"),
            "0 bytes",
        ));
    }
    Ok(Some(src.shard(body_start, body_len, tensors)?))
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
mod tests;
