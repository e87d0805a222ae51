//! Warnings that any peer can cause at will, at most one per key (a kind of line and the
//! peer's host) every [`EVERY`]: on a node, a connection to a data port that no source
//! announces; on a source, a control connection refused or dropped before its handshake
//! ended. The lines in between are counted: the next line of that key says how many were left
//! out, and so does [`WarnLimit::flush`] once the key's window is over. Without it, a host
//! that could reach such a port made the service log a line per connection, at its accept
//! rate. At most [`MAX_KEYS`] keys are tracked at once: the lines of any other key are counted
//! together and said by the next flush. Pure (the caller passes the time): shared by the node
//! and the source.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::{Duration, Instant};

/// One line per key at most this often.
pub const EVERY: Duration = Duration::from_secs(10);

/// Keys tracked at once.
pub const MAX_KEYS: usize = 4096;

/// What [`WarnLimit::flush`] found left out.
#[derive(Debug, PartialEq, Eq)]
pub struct LeftOut<K> {
    /// Keys whose window ended with lines left out, each with their count.
    pub keys: Vec<(K, u64)>,
    /// Lines of keys that were not tracked (the table was full).
    pub untracked: u64,
}

/// The lines logged and left out, by key.
#[derive(Debug)]
pub struct WarnLimit<K> {
    every: Duration,
    /// Key -> (when its last line was logged, lines left out since).
    seen: HashMap<K, (Instant, u64)>,
    /// Lines of untracked keys left out since the last flush.
    untracked: u64,
}

impl<K: Eq + Hash + Clone> WarnLimit<K> {
    /// At most one line per key every `every`.
    pub fn new(every: Duration) -> Self {
        Self {
            every,
            seen: HashMap::new(),
            untracked: 0,
        }
    }

    /// Whether a line of `key` at `now` is logged: `Some` with the lines of that key left out
    /// since its last one, or `None` (it is left out, and counted).
    pub fn hit(&mut self, key: K, now: Instant) -> Option<u64> {
        let every = self.every;
        let full = self.seen.len() >= MAX_KEYS;
        match self.seen.get_mut(&key) {
            Some((since, n)) if now.saturating_duration_since(*since) < every => {
                *n += 1;
                None
            }
            Some((since, n)) => {
                *since = now;
                Some(std::mem::take(n))
            }
            None if full => {
                self.untracked += 1;
                None
            }
            None => {
                self.seen.insert(key, (now, 0));
                Some(0)
            }
        }
    }

    /// Forgets the keys whose window is over at `now` and returns the lines left out in
    /// them (to be said in one line each), with those of untracked keys.
    pub fn flush(&mut self, now: Instant) -> LeftOut<K> {
        let every = self.every;
        let mut keys = Vec::new();
        self.seen.retain(|k, (since, n)| {
            let over = now.saturating_duration_since(*since) >= every;
            if over && *n > 0 {
                keys.push((k.clone(), *n));
            }
            !over
        });
        LeftOut {
            keys,
            untracked: std::mem::take(&mut self.untracked),
        }
    }

    /// Keys tracked now.
    #[cfg(test)]
    fn tracked(&self) -> usize {
        self.seen.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A flood of one key logs one line per window, and the count of the others is said:
    /// by the key's next line, or by the flush after its window.
    #[test]
    fn one_line_per_key_and_window_with_the_rest_counted() {
        let mut w = WarnLimit::new(EVERY);
        let t0 = Instant::now();
        let logged = (0..10_000u64)
            .filter(|i| w.hit("a", t0 + Duration::from_micros(*i)).is_some())
            .count();
        assert_eq!(logged, 1, "one line in the window, not one per connection");
        assert_eq!(w.hit("b", t0), Some(0), "another key has its own window");
        assert_eq!(
            w.hit("a", t0 + EVERY),
            Some(9_999),
            "the next line says the rest"
        );
        assert_eq!(w.hit("a", t0 + EVERY + Duration::from_secs(1)), None);
        let left = w.flush(t0 + EVERY * 2);
        assert_eq!(left.keys, vec![("a", 1)], "b left nothing out");
        assert_eq!((left.untracked, w.tracked()), (0, 0), "both windows over");
        assert!(w.flush(t0 + EVERY * 3).keys.is_empty(), "said once");
    }

    /// The table does not grow past [`MAX_KEYS`]: further keys are counted together.
    #[test]
    fn keys_past_the_limit_are_counted_together() {
        let mut w = WarnLimit::new(EVERY);
        let t0 = Instant::now();
        for k in 0..MAX_KEYS + 5 {
            w.hit(k, t0);
        }
        assert_eq!(w.tracked(), MAX_KEYS);
        assert_eq!(w.hit(MAX_KEYS + 9, t0), None);
        let left = w.flush(t0 + EVERY);
        assert_eq!((left.keys.len(), left.untracked), (0, 6));
        assert_eq!(w.hit(MAX_KEYS + 9, t0 + EVERY), Some(0), "room again");
    }
}
