//! When a source that is alive stops answering the FETCHes that wait on it.
//!
//! A source answers every FETCH with a `Shard` announcement or an `Error`. The session's idle
//! timeout does not see a source that pings but answers nothing (a wedged session, a request
//! it lost), and a pending fetch has no data connection yet, so no stall timeout of its own.
//! So the session checks its pending fetches every [`CHECK_EVERY`] ([`check`]) and ends
//! itself on a [`Stall`]: every fetch waiting on it fails as `LinkDown` and is fetched again
//! (from another source when one is up), and the link reconnects.
//!
//! The limits are generous on purpose: a source reads a shard from object storage before it
//! announces it, and waits for room on a data connection behind the fetches before it. Both
//! grow by a second per [`ALLOWANCE_RATE`] bytes of the largest fetch concerned, so a shard
//! of any size may be read at that rate. The payloads a pending fetch waits behind are
//! announced already, so no pending fetch stands for them: payload bytes landing on the
//! session's data connections count as the source answering instead ([`Answered`]), however
//! long the payloads ahead take to send.

use std::time::{Duration, Instant};

/// How often a session checks its pending fetches.
pub const CHECK_EVERY: Duration = Duration::from_secs(5);

/// A source that answers none of the fetches waiting on it for this long (plus the size
/// allowance) is wedged.
pub const SILENCE_LIMIT: Duration = Duration::from_secs(300);

/// A fetch unanswered for this long (plus the size allowance) while the source answers
/// others was lost by the source.
pub const UNANSWERED_LIMIT: Duration = Duration::from_secs(1800);

/// Bytes per second of allowance on top of both limits.
pub const ALLOWANCE_RATE: u64 = 1 << 20;

/// A pending fetch as the check sees it.
#[derive(Clone, Copy, Debug)]
pub struct Waiting {
    /// Its request id.
    pub req: u64,
    /// When it was sent.
    pub issued: Instant,
    /// Its payload length.
    pub length: u64,
}

/// When the source last answered, as the stall check sees it: a fetch answered (or the
/// session begun), or payload bytes landed on the session's data connections since the last
/// look (a source busy sending the payloads a pending fetch waits behind is at work).
#[derive(Clone, Copy, Debug)]
pub struct Answered {
    /// When.
    at: Instant,
    /// The link's count of payload bytes landed at the last look.
    landed: u64,
}

impl Answered {
    /// Answered at `at`, with `landed` payload bytes landed so far.
    pub fn new(at: Instant, landed: u64) -> Self {
        Self { at, landed }
    }

    /// The source answered a fetch (or a session began) at `now`.
    pub fn answered(&mut self, now: Instant) {
        self.at = self.at.max(now);
    }

    /// The last answer, looked at `now` while the link's count of payload bytes landed is
    /// `landed`: bytes that landed since the last look count as an answer now.
    pub fn last(&mut self, now: Instant, landed: u64) -> Instant {
        if landed != self.landed {
            self.landed = landed;
            self.answered(now);
        }
        self.at
    }
}

/// Why a session gives up on its source.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Stall {
    /// No fetch was answered for this long while some waited.
    #[error(
        "the source answered none of the {fetches} FETCHes waiting on it for {waited:?} (limit {limit:?}): it keeps the session alive but serves nothing"
    )]
    Silent {
        /// How many waited.
        fetches: usize,
        /// How long nothing was answered.
        waited: Duration,
        /// The limit it passed.
        limit: Duration,
    },
    /// One fetch waited past its limit while the source answered others.
    #[error(
        "the source has not answered FETCH {req} for {waited:?} (limit {limit:?}) while it answered later ones: it lost the request"
    )]
    Unanswered {
        /// The request.
        req: u64,
        /// How long it waited.
        waited: Duration,
        /// The limit it passed.
        limit: Duration,
    },
}

/// `base` plus a second per [`ALLOWANCE_RATE`] bytes of `length`.
fn limit(base: Duration, length: u64) -> Duration {
    base + Duration::from_secs(length / ALLOWANCE_RATE)
}

/// Whether the fetches in `pending` show a stalled source at `now`, given the last time the
/// source answered a fetch of this session (`answered`; the session's start if none yet).
pub fn check(
    now: Instant,
    answered: Instant,
    pending: impl IntoIterator<Item = Waiting>,
) -> Option<Stall> {
    let pending: Vec<Waiting> = pending.into_iter().collect();
    let oldest = pending.iter().map(|w| w.issued).min()?;
    let largest = pending.iter().map(|w| w.length).max().unwrap_or(0);
    let waited = now.saturating_duration_since(answered.max(oldest));
    let silence = limit(SILENCE_LIMIT, largest);
    if waited > silence {
        return Some(Stall::Silent {
            fetches: pending.len(),
            waited,
            limit: silence,
        });
    }
    // The oldest fetch past its own limit, if any.
    pending
        .iter()
        .map(|w| {
            (
                w,
                now.saturating_duration_since(w.issued),
                limit(UNANSWERED_LIMIT, w.length),
            )
        })
        .filter(|(_, waited, limit)| waited > limit)
        .max_by_key(|(_, waited, _)| *waited)
        .map(|(w, waited, limit)| Stall::Unanswered {
            req: w.req,
            waited,
            limit,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn at(t0: Instant, secs: u64) -> Instant {
        t0 + Duration::from_secs(secs)
    }

    fn waiting(req: u64, issued: Instant, length: u64) -> Waiting {
        Waiting {
            req,
            issued,
            length,
        }
    }

    #[test]
    fn nothing_pending_is_never_a_stall() {
        let t0 = Instant::now();
        assert_eq!(check(at(t0, 100_000), t0, []), None);
    }

    #[test]
    fn a_source_that_answers_nothing_is_silent_past_the_limit_and_its_allowance() {
        let t0 = Instant::now();
        let p = [waiting(1, t0, 4 * MIB), waiting(2, at(t0, 10), 64 * MIB)];
        // 300 s plus 64 s for the largest (64 MiB at 1 MiB/s).
        assert_eq!(check(at(t0, 364), t0, p), None);
        assert_eq!(
            check(at(t0, 365), t0, p),
            Some(Stall::Silent {
                fetches: 2,
                waited: Duration::from_secs(365),
                limit: Duration::from_secs(364),
            })
        );
    }

    #[test]
    fn answers_and_young_fetches_restart_the_silence() {
        let t0 = Instant::now();
        let p = [waiting(1, t0, MIB)];
        // The source answered another fetch at 200 s: silent only from there.
        assert_eq!(check(at(t0, 450), at(t0, 200), p), None);
        assert!(check(at(t0, 502), at(t0, 200), p).is_some());
        // A fetch sent long after the last answer counts from when it was sent.
        let young = [waiting(2, at(t0, 1000), MIB)];
        assert_eq!(check(at(t0, 1200), t0, young), None);
    }

    #[test]
    fn one_fetch_left_behind_while_others_are_answered_is_lost() {
        let t0 = Instant::now();
        let p = [
            waiting(7, t0, 2 * MIB),
            waiting(8, at(t0, 100), 2 * MIB),
            waiting(9, at(t0, 1790), MIB),
        ];
        let answered = at(t0, 1795);
        assert_eq!(
            check(at(t0, 1802), answered, p),
            None,
            "1800 s + 2 s allowed"
        );
        assert_eq!(
            check(at(t0, 1903), answered, p),
            Some(Stall::Unanswered {
                req: 7,
                waited: Duration::from_secs(1903),
                limit: Duration::from_secs(1802),
            }),
            "the oldest one is named"
        );
    }

    /// A pending fetch that waits behind large payloads announced before it (the source
    /// has no free slot to announce it on) while those payloads' bytes keep landing: the
    /// source is at work, not silent. Before, only answered fetches counted, and the session
    /// ended at 300 s plus the pending fetch's allowance, failing payloads almost received.
    #[test]
    fn payload_bytes_landing_count_as_the_source_answering() {
        let t0 = Instant::now();
        let p = [waiting(1, t0, 8 * MIB)]; // 308 s allowed
        let mut a = Answered::new(t0, 0);
        for s in (5..=600).step_by(5) {
            let landed = s * 2 * MIB; // 2 MiB/s on the announced payloads
            let last = a.last(at(t0, s), landed);
            assert_eq!(check(at(t0, s), last, p), None, "at {s} s");
        }
        // What the check saw before: the last answered fetch only.
        assert!(matches!(
            check(at(t0, 600), t0, p),
            Some(Stall::Silent { .. })
        ));
        // Once nothing lands any more, the silence counts from the last bytes seen.
        let quiet = a.last(at(t0, 700), 600 * 2 * MIB);
        assert_eq!(quiet, at(t0, 600));
        assert_eq!(check(at(t0, 908), quiet, p), None);
        assert!(matches!(
            check(at(t0, 909), quiet, p),
            Some(Stall::Silent { .. })
        ));
    }

    #[test]
    fn a_huge_shard_gets_time_to_be_read_at_the_allowance_rate() {
        let t0 = Instant::now();
        let p = [waiting(1, t0, 100 << 30)]; // 100 GiB: 102 400 s of allowance
        assert_eq!(check(at(t0, 100_000), t0, p), None);
        assert!(check(at(t0, 102_701), t0, p).is_some());
    }
}
