//! The typed error of a data connection's receive path (a leaf: [`crate::fetch`] carries it
//! in `FetchFailure::ConnectionLost`).

use std::io;

/// Why a data connection could not deliver a payload. The connection is then broken: its
/// fetch and every later one queued on it fail with this cause and are fetched again.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RxError {
    /// The peer closed the connection inside a payload.
    #[error("connection closed after {got} of {want} payload bytes")]
    Closed {
        /// Bytes of the payload that arrived.
        got: u64,
        /// The payload's length.
        want: u64,
    },
    /// No byte of a payload arrived for `after` (the read timeout, `DATA_STALL_TIMEOUT`; on
    /// the io_uring path, a wait's timeout with nothing queued on the socket): the source
    /// stopped sending on the connection, or the path to it dropped.
    #[error(
        "no bytes arrived for {after:?} ({got} of {want} payload bytes had): the source stopped \
         sending on this data connection, or the network path to it dropped"
    )]
    Stalled {
        /// How long nothing arrived.
        after: std::time::Duration,
        /// Bytes of the payload that arrived.
        got: u64,
        /// The payload's length.
        want: u64,
    },
    /// A socket or ring call failed.
    #[error("{op}: {message}")]
    Io {
        /// The call.
        op: &'static str,
        /// Its error kind.
        kind: io::ErrorKind,
        /// The OS's words.
        message: String,
    },
    /// The slab lies in other memory than this path writes (a bug).
    #[error("a slab in {found} memory on the {path} receive path")]
    WrongMemory {
        /// The path.
        path: &'static str,
        /// The slab's memory.
        found: &'static str,
    },
    /// A GPU step failed (staging buffers, the H2D copy, the gather or CRC kernel).
    #[error("{what}: {message}")]
    Gpu {
        /// The step.
        what: &'static str,
        /// The driver's words.
        message: String,
    },
    /// Payloads of different shards in a row on one connection failed their CRC-32C: one
    /// was longer or shorter than announced (its bytes ran into the next), so every later one
    /// would fail.
    #[error(
        "{in_a_row} payloads of different shards in a row failed their CRC-32C: the connection \
         has lost its framing (a payload longer or shorter than announced), so it is dropped"
    )]
    Misframed {
        /// Mismatches in a row.
        in_a_row: u32,
    },
    /// Payload bytes were due but fewer than the floor landed in a window
    /// (`shared::PaceRule`): the source, or the path to it, sends at a trickle.
    #[error(
        "only {got} payload bytes landed in {took:?} while {due} more were due (the floor is \
         {floor} bytes every {window:?}): the source or the network path to it has slowed to \
         a trickle, so the connection is dropped and its fetches go again"
    )]
    TooSlow {
        /// Bytes that landed in the window.
        got: u64,
        /// How long the window lasted.
        took: std::time::Duration,
        /// Bytes still due.
        due: u64,
        /// The floor.
        floor: u64,
        /// The window the floor is for.
        window: std::time::Duration,
    },
    /// An earlier payload on this connection failed, so this one cannot be placed.
    #[error("it failed earlier: {0}")]
    Earlier(Box<RxError>),
}

impl RxError {
    /// The error of call `op`.
    pub fn io(op: &'static str, e: &io::Error) -> Self {
        Self::Io {
            op,
            kind: e.kind(),
            message: e.to_string(),
        }
    }

    /// A GPU step's error.
    pub fn gpu(what: &'static str, e: impl std::fmt::Display) -> Self {
        Self::Gpu {
            what,
            message: e.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_what_happened() {
        let e = RxError::Closed {
            got: 1000,
            want: 4096,
        };
        assert_eq!(
            e.to_string(),
            "connection closed after 1000 of 4096 payload bytes"
        );
        assert_eq!(
            RxError::Earlier(Box::new(e)).to_string(),
            "it failed earlier: connection closed after 1000 of 4096 payload bytes"
        );
        let io = RxError::io("recv", &io::Error::from(io::ErrorKind::WouldBlock));
        assert!(matches!(
            io,
            RxError::Io {
                kind: io::ErrorKind::WouldBlock,
                ..
            }
        ));
    }
}
