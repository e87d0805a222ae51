//! Token windows (DESIGN §10): a sample is `seq_len + 1` consecutive tokens of the documents
//! (the rows of one ragged integer tensor) laid end to end; consecutive windows start
//! `seq_len` tokens apart and overlap by one, Megatron's extra token.
//!
//! One epoch in window mode:
//! 1. The documents are ordered as rows are ordered with one partition: shards permuted
//!    (`shards`, `block`), documents shuffled within blocks of about `shuffle_block` documents
//!    (`block`), storage order for `none`. Laid end to end they are the epoch's token stream of
//!    T tokens, the same T every epoch, so every epoch has the same `n = (T - 1) / seq_len`
//!    windows (the tokens after the last whole window are not read that epoch).
//! 2. Window w is tokens `[w*seq_len, w*seq_len + seq_len + 1)` of the stream. The windows are
//!    cut into `partitions` contiguous ranges at `n*c/C`, and each range into blocks: the
//!    windows starting in one document block. `block` shuffles each block's windows with a
//!    keyed bijection; the global sequence interleaves the partitions as rows do.
//!
//! So a window block reads the shards of its document block and the few after it that its
//! last window reaches; memory stays bounded by the blocks, as for rows. The tables are the
//! document blocks' token counts (O(shards)) and, for the blocks in use, their documents'
//! token prefix in shuffled order (O(shuffle_block), cached).

use std::sync::Arc;

use super::megatron::{MegatronIndex, MegatronSpec};
use super::{Block, DocLevel, EpochOrder, Part, SampleError, SampleRef, Shuffle};
use crate::bijection::{Bijection, mix};

/// Shuffled blocks whose token prefix is kept, at least; an order of more partitions keeps
/// two per partition ([`EpochOrder::cached_blocks`]), up to [`MAX_CACHED_BLOCKS`]: a rank's
/// consecutive windows rotate through the partitions it reads, each in its own block, and a
/// cache smaller than that rotation missed on every window (rebuilding a block's table, one
/// bijection per document).
const CACHED_BLOCKS: usize = 16;

/// The most block tables kept (a table is 8 bytes per document of its block: about 3 MiB at
/// the default block; the cache is scanned on every window).
const MAX_CACHED_BLOCKS: usize = 64;

/// Salt of the key that shuffles documents inside a block (windows use the epoch's key).
const DOC_SALT: u64 = 0x646f_6375_6d65_6e74;

/// What makes a sample a token window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WindowSpec {
    /// Window length less the extra token: a window holds `seq_len + 1` tokens.
    pub seq_len: u64,
    /// The tensor whose rows are the documents (named in the fingerprint).
    pub column: String,
    /// Tokens of each document (row), per shard in manifest order.
    pub doc_tokens: Vec<Vec<u32>>,
    /// The order of megatron-core's `GPTDataset` (documents = rows in storage order, one
    /// partition) instead of shuffled blocks.
    pub megatron: bool,
}

/// Dataset items a unit of a Megatron-order epoch covers.
const MEGATRON_UNIT: u64 = 8;

/// A Megatron-order epoch: GPTDataset's indices and the shards of each unit of items.
#[derive(Debug)]
pub(super) struct MegatronEpoch {
    index: MegatronIndex,
    /// Tokens of each sequence (row), in storage order.
    lengths: Vec<u32>,
    /// `starts[k]`: sequences before shard k (`len = shards + 1`).
    starts: Vec<u64>,
    /// Shards of each unit of [`MEGATRON_UNIT`] items, back to back (see the blocks' ranges).
    pub(super) unit_shards: Vec<u32>,
}

/// Tokens `[start, start + len)` of document (row) `doc`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenPiece {
    /// The document.
    pub doc: SampleRef,
    /// First token, counted from the document's start.
    pub start: u64,
    /// Tokens.
    pub len: u64,
}

impl WindowSpec {
    /// Tokens in the dataset.
    pub fn tokens(&self) -> u64 {
        self.doc_tokens
            .iter()
            .flatten()
            .map(|&t| u64::from(t))
            .sum()
    }

    /// Whole windows in one epoch.
    pub fn windows(&self) -> u64 {
        self.tokens().saturating_sub(1) / self.seq_len.max(1)
    }

    /// Checks the spec: `seq_len` at least 1 and at least one whole window.
    pub fn check(&self) -> Result<u64, SampleError> {
        if self.seq_len == 0 || self.seq_len >= i32::MAX as u64 {
            return Err(SampleError::SeqLen {
                seq_len: self.seq_len,
            });
        }
        let docs: usize = self.doc_tokens.iter().map(Vec::len).sum();
        if self.megatron && docs > i32::MAX as usize {
            return Err(SampleError::MegatronLimit(format!(
                "{docs} documents; Megatron's int32 document index holds at most {}",
                i32::MAX
            )));
        }
        if self.megatron {
            // Every check the index's build makes before it allocates (its size above all),
            // so an epoch's build cannot fail later (it panicked there).
            let lengths: Vec<u32> = self.doc_tokens.iter().flatten().copied().collect();
            MegatronIndex::check(&lengths, &megatron_spec(self, 0))
                .map_err(|e| SampleError::MegatronLimit(e.to_string()))?;
        }
        match self.windows() {
            0 => Err(SampleError::TooFewTokens {
                tokens: self.tokens(),
                seq_len: self.seq_len,
            }),
            n => Ok(n),
        }
    }

    fn doc_len(&self, r: SampleRef) -> u64 {
        u64::from(self.doc_tokens[r.shard as usize][r.row as usize])
    }

    /// `tok[k]`: the tokens before document block k (X positions are documents).
    pub(super) fn block_tokens(&self, perm: &[u32], prefix: &[u64], blocks: &[Block]) -> Vec<u64> {
        let mut tok = Vec::with_capacity(blocks.len() + 1);
        let mut acc = 0u64;
        tok.push(0);
        for b in blocks {
            for k in b.first_shard..b.end_shard {
                let k = k as usize;
                let lo = prefix[k].max(b.start) - prefix[k];
                let hi = prefix[k + 1].min(b.start + b.len) - prefix[k];
                let rows = &self.doc_tokens[perm[k] as usize][lo as usize..hi as usize];
                acc += rows.iter().map(|&t| u64::from(t)).sum::<u64>();
            }
            tok.push(acc);
        }
        tok
    }

    /// The window partitions (n windows, `partitions` ranges) and their blocks: the windows
    /// of a partition starting in one document block, with the shards from that block to
    /// the one holding their last token.
    pub(super) fn cut(
        &self,
        n: u64,
        partitions: u32,
        docs: &[Block],
        tok: &[u64],
    ) -> (Vec<Part>, Vec<Block>) {
        let l = self.seq_len;
        let c = u64::from(partitions);
        let mut parts = Vec::with_capacity(partitions as usize);
        let mut blocks = Vec::new();
        let mut k = 0usize;
        for i in 0..c {
            let (ws, we) = (super::cut_at(n, i, c), super::cut_at(n, i + 1, c));
            let first_block = blocks.len() as u32;
            let mut w = ws;
            while w < we {
                // The document block holding window w's first token, and where its windows end.
                while tok[k + 1] <= w * l {
                    k += 1;
                }
                let end = tok[k + 1].div_ceil(l).min(we);
                let last_token = end * l; // the last window's last token
                let kk = (tok.partition_point(|&t| t <= last_token) - 1).min(docs.len() - 1);
                blocks.push(Block {
                    start: w,
                    len: end - w,
                    first_shard: docs[k].first_shard,
                    end_shard: docs[kk].end_shard,
                });
                w = end;
            }
            parts.push(Part {
                start: ws,
                len: we - ws,
                first_block,
                end_block: blocks.len() as u32,
            });
        }
        (parts, blocks)
    }
}

/// GPTDataset's settings for one epoch of `spec` under `seed`: one pass, the extra token,
/// whole samples only.
fn megatron_spec(spec: &WindowSpec, seed: u32) -> MegatronSpec {
    MegatronSpec {
        seed,
        seq_len: spec.seq_len,
        add_extra_token: true,
        num_samples: None,
        drop_last: true,
    }
}

impl MegatronEpoch {
    /// GPTDataset's indices for `seed` (num_samples None: one epoch, drop_last) and the
    /// window-space partition and units over them.
    pub(super) fn new(spec: &WindowSpec, seed: u32) -> (Self, Vec<Part>, Vec<Block>) {
        let lengths: Vec<u32> = spec.doc_tokens.iter().flatten().copied().collect();
        let mut starts = Vec::with_capacity(spec.doc_tokens.len() + 1);
        starts.push(0u64);
        for d in &spec.doc_tokens {
            starts.push(starts.last().copied().unwrap_or(0) + d.len() as u64);
        }
        let ms = megatron_spec(spec, seed);
        let index = MegatronIndex::build(&lengths, &ms).expect("checked by WindowSpec::check");
        let mut m = Self {
            index,
            lengths,
            starts,
            unit_shards: Vec::new(),
        };
        let n = m.index.len();
        let mut blocks = Vec::with_capacity(n.div_ceil(MEGATRON_UNIT) as usize);
        for start in (0..n).step_by(MEGATRON_UNIT as usize) {
            let len = MEGATRON_UNIT.min(n - start);
            let mut shards: Vec<u32> = (start..start + len)
                .flat_map(|i| m.window(i).into_iter().map(|p| p.doc.shard))
                .collect();
            shards.sort_unstable();
            shards.dedup();
            let first_shard = m.unit_shards.len() as u32;
            m.unit_shards.extend(shards);
            let end_shard = m.unit_shards.len() as u32;
            blocks.push(Block {
                start,
                len,
                first_shard,
                end_shard,
            });
        }
        let part = Part {
            start: 0,
            len: n,
            first_block: 0,
            end_block: blocks.len() as u32,
        };
        (m, vec![part], blocks)
    }

    /// Dataset item `i` as pieces of documents.
    pub(super) fn window(&self, i: u64) -> Vec<TokenPiece> {
        let doc = |seq: u32| {
            let seq = u64::from(seq);
            let k = self.starts.partition_point(|&s| s <= seq) - 1;
            SampleRef {
                shard: k as u32,
                row: seq - self.starts[k],
            }
        };
        self.index
            .pieces(&self.lengths, i)
            .into_iter()
            .map(|(seq, start, len)| TokenPiece {
                doc: doc(seq),
                start: u64::from(start),
                len: u64::from(len),
            })
            .collect()
    }

    /// Bytes of the indices.
    pub(super) fn bytes(&self) -> usize {
        self.index.document_index.capacity() * 4
            + self.index.sample_index.capacity() * 16
            + self.index.shuffle_index.capacity() * 8
            + self.lengths.capacity() * 4
            + self.unit_shards.capacity() * 4
    }
}

impl EpochOrder {
    /// The window `G[t]` as pieces of documents, in order (window mode only).
    pub fn window(&self, t: u64) -> Vec<TokenPiece> {
        if let Some(m) = &self.megatron {
            return m.window(t % self.order.total);
        }
        let spec = self.order.windows.as_ref().expect("a window-mode order");
        let d = self.docs.as_ref().expect("a window-mode epoch");
        let mut pos = self.x_of(t) * spec.seq_len;
        let mut need = spec.seq_len + 1;
        let mut out = Vec::with_capacity(2);
        let mut k = d.tok.partition_point(|&x| x <= pos) - 1;
        while need > 0 && k < d.blocks.len() {
            let table = self.block_table(d, k as u32);
            let local = pos - d.tok[k];
            let mut j = table.partition_point(|&x| x <= local) - 1;
            while need > 0 && j + 1 < table.len() {
                let off = (pos - d.tok[k]).saturating_sub(table[j]);
                let take = (table[j + 1] - table[j] - off).min(need);
                if take > 0 {
                    out.push(TokenPiece {
                        doc: self.doc_in_block(d, k as u32, j as u64),
                        start: off,
                        len: take,
                    });
                }
                pos += take;
                need -= take;
                j += 1;
            }
            k += 1;
        }
        debug_assert_eq!(need, 0, "a whole window lies inside the stream");
        out
    }

    /// Document `j` of document block `k`, in the epoch's order.
    fn doc_in_block(&self, d: &DocLevel, k: u32, j: u64) -> SampleRef {
        let b = &d.blocks[k as usize];
        let off = match self.order.shuffle {
            Shuffle::Block => {
                Bijection::new(b.len, mix(mix(self.key ^ DOC_SALT) ^ mix(u64::from(k)))).apply(j)
            }
            _ => j,
        };
        self.at_x(b.start + off)
    }

    /// How many blocks' token prefixes [`Self::block_table`] keeps: two per partition (a
    /// partition's current block and the next one, which a window across the edge reads),
    /// within [`CACHED_BLOCKS`]..=[`MAX_CACHED_BLOCKS`] (a rank reading more than 32 partitions
    /// rebuilds tables again, each in its turn).
    fn cached_blocks(&self) -> usize {
        (2 * self.order.partitions as usize).clamp(CACHED_BLOCKS, MAX_CACHED_BLOCKS)
    }

    /// Token prefix of block `k`'s documents in shuffled order (`len = documents + 1`).
    fn block_table(&self, d: &DocLevel, k: u32) -> Arc<Vec<u64>> {
        let mut cache = d.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, t)) = cache.iter().find(|(b, _)| *b == k) {
            return Arc::clone(t);
        }
        let spec = self.order.windows.as_ref().expect("a window-mode order");
        let b = &d.blocks[k as usize];
        let mut t = Vec::with_capacity(b.len as usize + 1);
        let mut acc = 0u64;
        t.push(0);
        for j in 0..b.len {
            acc += spec.doc_len(self.doc_in_block(d, k, j));
            t.push(acc);
        }
        let t = Arc::new(t);
        if cache.len() >= self.cached_blocks() {
            cache.pop_front();
        }
        cache.push_back((k, Arc::clone(&t)));
        t
    }
}

#[cfg(test)]
mod tests;
