//! What a link's source serves: for each dataset the node asked about, the digest of the
//! version it serves (or that it does not serve it), and in which session that was learnt.
//! A source found while streams run (DNS) joins a stream's dataset only once its manifest's
//! digest is known to match; a reconnected source takes no fetch until it has answered again
//! (a restarted source may serve another version: a fetch sent to it under its old answer was
//! announced with the other version's length and CRC, a protocol violation that ended the
//! session, again at every reconnect).

use std::collections::HashMap;
use std::sync::Mutex;

/// Whether a source serves one version of a dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Serves {
    /// It serves this version.
    Yes,
    /// It does not serve the dataset, or serves another version.
    No,
    /// Not known yet.
    Unknown,
}

#[derive(Debug)]
struct Entry {
    /// The digest served; `None`: the dataset is not served.
    digest: Option<String>,
    /// The session (link generation) that answered.
    generation: u64,
}

/// A link's answers, and the questions being asked now.
#[derive(Debug, Default)]
pub struct Served {
    inner: Mutex<(HashMap<String, Entry>, Vec<String>)>,
}

impl Served {
    /// Whether version `digest` of `dataset` is served, and whether to ask (again): the
    /// answer is missing or from a session before `generation`, and nobody asks already.
    /// When it says to ask, the caller must call [`Served::record`] or [`Served::gave_up`].
    pub fn check(&self, dataset: &str, digest: &str, generation: u64) -> (Serves, bool) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let (answers, asking) = &mut *g;
        let (serves, stale) = match answers.get(dataset) {
            None => (Serves::Unknown, true),
            Some(e) => {
                let stale = e.generation < generation;
                let s = match &e.digest {
                    _ if stale => Serves::Unknown,
                    Some(d) if d == digest => Serves::Yes,
                    _ => Serves::No,
                };
                (s, stale)
            }
        };
        let ask = stale && !asking.iter().any(|d| d == dataset);
        if ask {
            asking.push(dataset.to_owned());
        }
        (serves, ask)
    }

    /// The answer about `dataset` from session `generation` (or a later one), if there is
    /// one: the digest it serves (`None`: not the dataset). Asks nothing.
    pub fn answer(&self, dataset: &str, generation: u64) -> Option<Option<String>> {
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.0.get(dataset)
            .filter(|e| e.generation >= generation)
            .map(|e| e.digest.clone())
    }

    /// Records the answer of session `generation`: the digest served, or `None`.
    pub fn record(&self, dataset: &str, digest: Option<String>, generation: u64) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let (answers, asking) = &mut *g;
        asking.retain(|d| d != dataset);
        answers.insert(dataset.to_owned(), Entry { digest, generation });
    }

    /// A question got no answer (the link went down): it may be asked again.
    pub fn gave_up(&self, dataset: &str) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.1.retain(|d| d != dataset);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_is_asked_once_and_again_after_a_reconnect() {
        let s = Served::default();
        assert_eq!(s.check("web", "d1", 1), (Serves::Unknown, true));
        assert_eq!(
            s.check("web", "d1", 1),
            (Serves::Unknown, false),
            "asked already"
        );
        s.record("web", Some("d1".into()), 1);
        assert_eq!(s.check("web", "d1", 1), (Serves::Yes, false));
        assert_eq!(s.check("web", "d2", 1), (Serves::No, false));
        // A new session's source takes no fetch until it has answered again (a restarted
        // source may serve another version).
        assert_eq!(s.check("web", "d1", 2), (Serves::Unknown, true));
        assert_eq!(
            s.check("web", "d1", 2),
            (Serves::Unknown, false),
            "asked already"
        );
        s.gave_up("web");
        assert_eq!(s.check("web", "d1", 2), (Serves::Unknown, true));
        s.record("web", None, 2);
        assert_eq!(s.check("web", "d1", 2), (Serves::No, false));
        assert_eq!(s.check("code", "d9", 2), (Serves::Unknown, true));
    }
}
