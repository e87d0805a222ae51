//! A record batch's IPC body as read from its message: its field nodes, buffers, variadic
//! buffer counts and metadata version ([`BatchLayout`]), a depth-first cursor over them
//! ([`Walk`]) that checks each buffer lies inside the body, and the shape of a batch problem
//! ([`BatchErr`], [`BatchFail`]). Shared by the fixed-width columns ([`super::batch`]) and the
//! list columns ([`super::lists`]).

use arrow_ipc::MetadataVersion;

use shardwire_protocol::manifest::TensorEntry;

use super::pytype::IpcCounts;
use crate::error::IndexError;

/// One record batch's layout, as read from its message.
pub(crate) struct BatchLayout {
    /// Row count.
    pub rows: u64,
    /// Field nodes: (length, null count), depth-first.
    pub nodes: Vec<(i64, i64)>,
    /// Buffers: (offset, length) within the body, depth-first.
    pub buffers: Vec<(i64, i64)>,
    /// `variadicBufferCounts`: the data buffers of each `string_view`/`binary_view` field,
    /// depth-first (empty when the schema has none).
    pub variadic: Vec<i64>,
    /// The message's metadata version: before V5, a union or run-end-encoded field has a
    /// validity buffer.
    pub version: MetadataVersion,
}

/// Where a batch problem lies: `Some(column)` or `None` for the batch as a whole; plus
/// (reason, value).
pub(crate) type BatchErr = (Option<String>, String, String);

/// Why a batch's tensors could not be found.
#[derive(Debug)]
pub(crate) enum BatchFail {
    /// The layout is wrong or unsupported.
    Layout(BatchErr),
    /// Reading an offsets buffer from the file failed, or a tensor (built, or a row table
    /// about to be built) did not pass the caller's check (the manifest budget).
    Read(IndexError),
}

impl From<BatchErr> for BatchFail {
    fn from(e: BatchErr) -> Self {
        Self::Layout(e)
    }
}

/// Reads `len` bytes at body offset `offset` (`what` names them in errors).
pub(crate) type ReadBody<'a> = dyn FnMut(&str, u64, u64) -> Result<Vec<u8>, IndexError> + 'a;

/// A cursor over a batch's field nodes and buffers, depth-first.
pub(crate) struct Walk<'a> {
    layout: &'a BatchLayout,
    node: usize,
    buffer: usize,
    variadic: usize,
    /// Body length in bytes.
    pub body_len: u64,
}

impl<'a> Walk<'a> {
    /// A cursor at the first field node and buffer of `layout`, whose body is `body_len`
    /// bytes long.
    pub fn new(layout: &'a BatchLayout, body_len: u64) -> Self {
        Self {
            layout,
            node: 0,
            buffer: 0,
            variadic: 0,
            body_len,
        }
    }

    /// True when every field node, buffer and variadic buffer count has been walked over.
    pub fn at_end(&self) -> bool {
        self.node == self.layout.nodes.len()
            && self.buffer == self.layout.buffers.len()
            && self.variadic == self.layout.variadic.len()
    }

    fn short(&self, what: &str, have: usize) -> BatchErr {
        (
            None,
            format!("the record batch has fewer {what} than its schema needs"),
            format!("{have} {what}"),
        )
    }

    /// The next field node: (length, null count).
    pub fn node(&mut self) -> Result<(i64, i64), BatchErr> {
        let n = self.layout.nodes.get(self.node).copied();
        self.node += 1;
        n.ok_or_else(|| self.short("field nodes", self.layout.nodes.len()))
    }

    /// The next buffer: (offset, length) within the body.
    pub fn buffer(&mut self) -> Result<(i64, i64), BatchErr> {
        let b = self.layout.buffers.get(self.buffer).copied();
        self.buffer += 1;
        b.ok_or_else(|| self.short("buffers", self.layout.buffers.len()))
    }

    /// Steps over a column that is not served: its field nodes and buffers (with a validity
    /// buffer per union or run-end-encoded field before metadata V5, as the writers of
    /// arrow-rs, `has_validity_bitmap`, and Arrow C++ have it), and the data buffers of each
    /// of its view fields (as many as its variadic buffer count says).
    pub fn skip(&mut self, c: &IpcCounts) -> Result<(), BatchErr> {
        for _ in 0..c.nodes {
            self.node()?;
        }
        let mut fixed = c.buffers;
        if self.layout.version < MetadataVersion::V5 {
            fixed = fixed.saturating_add(c.v4_validity);
        }
        if fixed > self.left() {
            self.buffer = self.layout.buffers.len();
            return Err(self.short("buffers", self.layout.buffers.len()));
        }
        self.buffer += fixed;
        for _ in 0..c.views {
            let k = self.variadic()?;
            let left = self.left();
            if k > left {
                self.buffer = self.layout.buffers.len();
                return Err((
                    None,
                    "a string_view/binary_view column not served claims more data buffers (its \
                     variadic buffer count) than the record batch has left"
                        .into(),
                    format!("variadic buffer count {k}, {left} buffers left"),
                ));
            }
            self.buffer += k;
        }
        Ok(())
    }

    /// Buffers not yet walked over.
    fn left(&self) -> usize {
        self.layout.buffers.len().saturating_sub(self.buffer)
    }

    /// The next variadic buffer count: the data buffers of a view field.
    fn variadic(&mut self) -> Result<usize, BatchErr> {
        let n = self.layout.variadic.get(self.variadic).copied();
        self.variadic += 1;
        let n =
            n.ok_or_else(|| self.short("variadic buffer counts", self.layout.variadic.len()))?;
        usize::try_from(n).map_err(|_| {
            (
                None,
                "a variadic buffer count (data buffers of a view column) is negative".into(),
                n.to_string(),
            )
        })
    }

    /// The next buffer, which must hold `need` bytes (`None`: overflowed) inside the body;
    /// returns its body offset. `what` names the buffer, `need_desc` the requirement.
    pub fn data(
        &mut self,
        col: &str,
        what: &str,
        need: Option<u64>,
        need_desc: &str,
    ) -> Result<u64, BatchErr> {
        let (off, len) = self.buffer()?;
        let err = |reason: String| {
            (
                Some(col.to_string()),
                reason,
                format!("buffer {off}+{len} in a body of {} bytes", self.body_len),
            )
        };
        let (Ok(off), Ok(len), Some(need)) = (u64::try_from(off), u64::try_from(len), need) else {
            return Err(err(format!("invalid {what}")));
        };
        if len < need {
            return Err(err(format!("{what} is shorter than {need_desc}")));
        }
        if off.checked_add(need).is_none_or(|end| end > self.body_len) {
            return Err(err(format!("{what} lies outside the record batch body")));
        }
        Ok(off)
    }
}

/// Refuses a field node with nulls; `where_` says which part of column `col` it is.
pub(crate) fn no_nulls(col: &str, nulls: i64, where_: &str) -> Result<(), BatchErr> {
    if nulls == 0 {
        return Ok(());
    }
    Err((
        Some(col.to_string()),
        format!("{where_} has {nulls} nulls; shardwire tensors cannot carry nulls"),
        format!("null_count {nulls}"),
    ))
}

/// What a [`CheckTensor`] is shown as a record batch's tensors are planned.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Step<'t> {
    /// The ragged column `name` is about to build its row table of `rows` rows (16 bytes a
    /// row in memory, where its offsets buffer took 4 or 8): checked first, so that a table
    /// the manifest cannot hold is never built.
    Rows { name: &'t str, rows: u64 },
    /// A tensor, once built.
    Built(&'t TensorEntry),
}

/// Checks each tensor of a record batch before its row table is built and once it is built
/// (the manifest budget: the row table of one list column can be 4 times the size of its
/// offsets buffer, and columns may share one buffer).
pub(crate) type CheckTensor<'a> = dyn FnMut(Step<'_>) -> Result<(), IndexError> + 'a;
