//! [`plan_requests`]: the ranged GETs that read a list of pieces (shards, or parts of one) of
//! objects: a piece larger than the request size is split into parts, read in parallel;
//! consecutive, exactly adjacent pieces of one object are merged while the merged request
//! stays within the request size. Never unbounded coalescing (object_store's `get_ranges`
//! merges ranges of any total size into one GET), never gaps read and thrown away.

use std::ops::Range;

/// A byte range of one object to read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Which object (an index into the caller's list).
    pub object: usize,
    /// Offset in the object.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// One ranged GET.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// Which object.
    pub object: usize,
    /// The bytes to GET.
    pub range: Range<u64>,
    /// The consecutive pieces it covers (one, when `part` is set).
    pub pieces: Range<usize>,
    /// For a piece split into parts: `(index, count)` of this part.
    pub part: Option<(usize, usize)>,
}

impl Request {
    /// Bytes requested.
    pub fn len(&self) -> u64 {
        self.range.end - self.range.start
    }

    /// Whether the request reads nothing (a zero-length piece on its own).
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }
}

/// The requests that read `pieces` (in their order), each at most `request_size` bytes
/// (a `request_size` of 0 counts as 1).
pub fn plan_requests(pieces: &[Piece], request_size: u64) -> Vec<Request> {
    let size = request_size.max(1);
    let mut out: Vec<Request> = Vec::new();
    let mut open = false; // whether the last request in `out` may still grow
    for (i, p) in pieces.iter().enumerate() {
        let end = p.offset.saturating_add(p.len);
        if p.len > size {
            let count = p.len.div_ceil(size) as usize;
            out.extend((0..count).map(|k| {
                // Saturating like `end`: a piece at the very top of u64 cannot wrap around.
                let start = p.offset.saturating_add(k as u64 * size);
                Request {
                    object: p.object,
                    range: start..start.saturating_add(size).min(end),
                    pieces: i..i + 1,
                    part: Some((k, count)),
                }
            }));
            open = false;
            continue;
        }
        if let Some(last) = out.last_mut().filter(|_| open) {
            let adjacent = last.object == p.object && last.range.end == p.offset;
            if adjacent && last.len() + p.len <= size {
                last.range.end = end;
                last.pieces.end = i + 1;
                continue;
            }
        }
        out.push(Request {
            object: p.object,
            range: p.offset..end,
            pieces: i..i + 1,
            part: None,
        });
        open = true;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(object: usize, offset: u64, len: u64) -> Piece {
        Piece {
            object,
            offset,
            len,
        }
    }

    /// (object, range, pieces, part) of each request.
    type Row = (usize, Range<u64>, Range<usize>, Option<(usize, usize)>);

    fn ranges(rs: &[Request]) -> Vec<Row> {
        rs.iter()
            .map(|r| (r.object, r.range.clone(), r.pieces.clone(), r.part))
            .collect()
    }

    #[test]
    fn adjacent_small_pieces_merge_up_to_the_size() {
        let ps = [
            piece(0, 0, 3),
            piece(0, 3, 4),
            piece(0, 7, 3),
            piece(0, 10, 2),
        ];
        let got = ranges(&plan_requests(&ps, 10));
        assert_eq!(got, [(0, 0..10, 0..3, None), (0, 10..12, 3..4, None)]);
    }

    #[test]
    fn gaps_other_objects_and_order_break_merges() {
        let ps = [
            piece(0, 0, 2),
            piece(0, 3, 2), // gap of one byte: never read
            piece(1, 5, 2), // another object at the adjacent offset
            piece(1, 7, 1),
            piece(1, 0, 2), // behind: not merged backwards
        ];
        let got = ranges(&plan_requests(&ps, 100));
        assert_eq!(
            got,
            [
                (0, 0..2, 0..1, None),
                (0, 3..5, 1..2, None),
                (1, 5..8, 2..4, None),
                (1, 0..2, 4..5, None)
            ]
        );
    }

    #[test]
    fn large_pieces_split_into_parts_and_end_a_merge() {
        let ps = [piece(0, 0, 4), piece(0, 4, 25), piece(0, 29, 1)];
        let got = ranges(&plan_requests(&ps, 10));
        assert_eq!(
            got,
            [
                (0, 0..4, 0..1, None),
                (0, 4..14, 1..2, Some((0, 3))),
                (0, 14..24, 1..2, Some((1, 3))),
                (0, 24..29, 1..2, Some((2, 3))),
                (0, 29..30, 2..3, None),
            ]
        );
        // Exactly the size: one request, no parts.
        let got = ranges(&plan_requests(&[piece(0, 0, 10)], 10));
        assert_eq!(got, [(0, 0..10, 0..1, None)]);
    }

    #[test]
    fn every_byte_once_and_no_request_over_the_size() {
        // A deterministic mix of sizes and gaps over three objects.
        let mut ps = Vec::new();
        let mut off = [0u64; 3];
        for i in 0..200u64 {
            let obj = (i * 7 % 3) as usize;
            let len = 1 + (i * 37 % 50);
            let gap = if i % 11 == 0 { 5 } else { 0 };
            ps.push(piece(obj, off[obj] + gap, len));
            off[obj] += gap + len;
        }
        for size in [1, 7, 16, 64, 1000] {
            let rs = plan_requests(&ps, size);
            let mut covered: Vec<(usize, Range<u64>)> = Vec::new();
            for r in &rs {
                assert!(r.len() <= size && !r.is_empty(), "{r:?} over {size}");
                covered.push((r.object, r.range.clone()));
            }
            let want: u64 = ps.iter().map(|p| p.len).sum();
            assert_eq!(rs.iter().map(Request::len).sum::<u64>(), want);
            // Pieces are covered in order by consecutive requests.
            let mut next = 0;
            for r in &rs {
                assert!(r.pieces.start == next || r.pieces.start + 1 == next);
                next = r.pieces.end;
            }
            assert_eq!(next, ps.len());
        }
    }
}
