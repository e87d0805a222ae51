//! `.npy` files (format versions 1.0, 2.0 and 3.0): the data section is one shard holding
//! one tensor named after the file stem.
//!
//! Layout: `\x93NUMPY`, major, minor, header length (u16 for 1.x, u32 for 2.x/3.x), then a
//! Python-literal dict with `descr`, `fortran_order` and `shape`, padded with spaces and a
//! newline; the raw C-order array data follows.

use shardwire_protocol::manifest::{DType, ShardEntry, TensorEntry, shape_elements};

use crate::error::IndexError;
use crate::pylit::{self, Lit};
use crate::source::Source;

const MAGIC: &[u8; 6] = b"\x93NUMPY";

/// What the header says.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Header {
    /// Element type.
    pub dtype: DType,
    /// Shape (empty for a scalar).
    pub shape: Vec<u64>,
    /// File offset of the data section.
    pub data_offset: u64,
}

/// Indexes a `.npy` file.
pub(crate) fn index(src: &mut Source) -> Result<Vec<ShardEntry>, IndexError> {
    let h = read_header(src)?;
    let have = src.len - h.data_offset;
    let Some(elems) = shape_elements(&h.shape) else {
        return Err(src.malformed(
            "the shape holds more elements than numpy takes (a dimension, or the product of the non-zero ones, past 2^63 - 1)",
            shape_str(&h.shape),
        ));
    };
    let need = elems.checked_mul(h.dtype.size());
    if need != Some(have) {
        return Err(src.malformed(
            format!(
                "data section size does not match shape {} x {} bytes ({})",
                shape_str(&h.shape),
                h.dtype.size(),
                need.map_or("overflow".to_string(), |n| format!("{n} bytes expected"))
            ),
            format!("{have} bytes"),
        ));
    }
    if have == 0 {
        // No elements: named with the other files that hold no rows, as in every format.
        return Ok(Vec::new());
    }
    let tensor = TensorEntry::dense(src.stem(), h.dtype, h.shape, h.data_offset, have);
    Ok(vec![src.shard(h.data_offset, have, vec![tensor])?])
}

/// Reads and checks the magic, version and header dict.
pub(crate) fn read_header(src: &mut Source) -> Result<Header, IndexError> {
    let len = src.len;
    read_header_at(src, 0, len)
}

/// Reads and checks the header of an `.npy` image of `avail` bytes at `base` (a whole file,
/// or a tar member); the data offset returned is absolute.
pub(crate) fn read_header_at(
    src: &mut Source,
    base: u64,
    avail: u64,
) -> Result<Header, IndexError> {
    let pre = src.read_at("npy preamble", base, 10.min(avail))?;
    if pre.len() < 10 || &pre[..6] != MAGIC {
        return Err(src.malformed(
            "not a .npy file (missing \\x93NUMPY magic)",
            hex_prefix(&pre),
        ));
    }
    let (major, minor) = (pre[6], pre[7]);
    let (hlen, hstart) = match major {
        1 => (u64::from(u16::from_le_bytes([pre[8], pre[9]])), 10u64),
        2 | 3 => {
            let b = src.read_at(
                "npy header length",
                base + 8,
                4.min(avail.saturating_sub(8)),
            )?;
            if b.len() < 4 {
                return Err(src.malformed("npy header length is truncated", hex_prefix(&pre)));
            }
            (
                u64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]])),
                12u64,
            )
        }
        _ => {
            return Err(src.unsupported(
                "unsupported .npy format version (1.0, 2.0, 3.0 are)",
                format!("{major}.{minor}"),
            ));
        }
    };
    if hstart + hlen > avail {
        return Err(src.malformed(
            format!("npy header lies beyond the end of the array ({avail} bytes)"),
            format!("header length {hlen}"),
        ));
    }
    let raw = src.read_at("npy header", base + hstart, hlen)?;
    // 1.x and 2.x headers are latin-1, 3.x is UTF-8.
    let text: String = if major == 3 {
        String::from_utf8(raw)
            .map_err(|_| src.malformed("npy 3.0 header is not UTF-8", "invalid bytes"))?
    } else {
        raw.iter().map(|&b| b as char).collect()
    };
    let (dtype, shape) = parse_header_dict(&text).map_err(|(reason, value, malformed)| {
        if malformed {
            src.malformed(reason, value)
        } else {
            src.unsupported(reason, value)
        }
    })?;
    Ok(Header {
        dtype,
        shape,
        data_offset: base + hstart + hlen,
    })
}

/// Error from the header: (reason, offending value, whether the file is malformed rather
/// than unsupported).
type HeaderErr = (String, String, bool);

fn parse_header_dict(text: &str) -> Result<(DType, Vec<u64>), HeaderErr> {
    let bad = |reason: &str, value: &dyn std::fmt::Display| {
        (reason.to_string(), short(&value.to_string()), true)
    };
    let lit = pylit::parse(text).map_err(|e| {
        (
            format!("npy header is not a Python literal: {e}"),
            text.trim().to_string(),
            true,
        )
    })?;
    let Lit::Dict(items) = lit else {
        return Err(bad("npy header is not a dict", &text.trim()));
    };
    let (mut descr, mut fortran, mut shape) = (None, None, None);
    for (k, v) in items {
        let slot = match &k {
            Lit::Str(s) if s == "descr" => &mut descr,
            Lit::Str(s) if s == "fortran_order" => &mut fortran,
            Lit::Str(s) if s == "shape" => &mut shape,
            _ => return Err(bad("unexpected key in npy header", &k)),
        };
        if slot.replace(v).is_some() {
            return Err(bad("duplicate key in npy header", &k));
        }
    }
    let (Some(descr), Some(fortran), Some(shape)) = (descr, fortran, shape) else {
        return Err(bad(
            "npy header lacks one of 'descr', 'fortran_order', 'shape'",
            &text.trim(),
        ));
    };
    let dtype = match &descr {
        Lit::Str(s) => {
            parse_descr(s).map_err(|reason| (reason, format!("'descr': '{s}'"), false))?
        }
        Lit::List(_) => {
            return Err((
                "structured (record) dtypes are not supported; save each field as its own array"
                    .into(),
                format!("'descr': {}", short(&descr.to_string())),
                false,
            ));
        }
        other => return Err(bad("'descr' is not a string", other)),
    };
    match fortran {
        Lit::Bool(false) => {}
        Lit::Bool(true) => {
            return Err((
                "Fortran-order arrays are not supported; save with np.ascontiguousarray".into(),
                "'fortran_order': True".into(),
                false,
            ));
        }
        other => return Err(bad("'fortran_order' is not True or False", &other)),
    }
    let Lit::Tuple(dims) = shape else {
        return Err(bad("'shape' is not a tuple", &shape));
    };
    let dims = dims
        .iter()
        .map(|d| match d {
            Lit::Int(n) => Ok(*n),
            other => Err(bad("'shape' holds a non-integer", other)),
        })
        .collect::<Result<Vec<u64>, _>>()?;
    if dims.len() > shardwire_protocol::manifest::MAX_DIMS {
        return Err((
            format!(
                "array has more than {} dimensions",
                shardwire_protocol::manifest::MAX_DIMS
            ),
            shape_str(&dims),
            false,
        ));
    }
    Ok((dtype, dims))
}

/// Maps a numpy type string (`'<f4'`) to a [`DType`], or says why not.
fn parse_descr(s: &str) -> Result<DType, String> {
    let mut chars = s.chars();
    let order = chars.next().unwrap_or(' ');
    let code = chars.as_str();
    let dtype = match code {
        "i1" => DType::Int8,
        "i2" => DType::Int16,
        "i4" => DType::Int32,
        "i8" => DType::Int64,
        "u1" => DType::Uint8,
        "u2" => DType::Uint16,
        "u4" => DType::Uint32,
        "u8" => DType::Uint64,
        "f2" => DType::Float16,
        "f4" => DType::Float32,
        "f8" => DType::Float64,
        "b1" => return Err("bool arrays are not supported; convert with .astype(np.uint8)".into()),
        "O" | "O8" | "O4" => {
            return Err(
                "object arrays (pickled Python objects) are not supported; use a numeric dtype"
                    .into(),
            );
        }
        _ => {
            return Err(
                "dtype is not supported (supported: int8..int64, uint8..uint64, float16/32/64, little-endian)".into(),
            );
        }
    };
    match order {
        '<' => Ok(dtype),
        '|' if dtype.size() == 1 => Ok(dtype),
        '>' => Err("big-endian arrays are not supported; convert with .astype(arr.dtype.newbyteorder('<'))".into()),
        _ => Err("byte order must be '<' (or '|' for 1-byte types)".into()),
    }
}

fn shape_str(dims: &[u64]) -> String {
    match dims {
        [d] => format!("({d},)"),
        _ => format!(
            "({})",
            dims.iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

fn short(s: &str) -> String {
    if s.len() <= 120 {
        s.to_string()
    } else {
        format!("{}...", s.chars().take(117).collect::<String>())
    }
}

fn hex_prefix(b: &[u8]) -> String {
    let hex: Vec<String> = b.iter().take(8).map(|x| format!("{x:02x}")).collect();
    format!("first bytes {}", hex.join(" "))
}

#[cfg(test)]
mod tests;
