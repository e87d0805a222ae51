//! The node's sources: one [`SourceLink`] per source address, from the configuration and
//! from DNS ([`crate::discovery`]), each with how it was found. Streams read a snapshot on
//! every fetch; the discovery task adds links and retires them. A retiring link takes no new
//! fetches; it leaves the roster when its outstanding fetches have ended or moved.
//!
//! A source's identity, the name every node hashes shards over, is its address as a string:
//! a configured `HOST:PORT` as written, a discovered one as its resolved `IP:PORT` (the same
//! answer on every node that resolves the same name).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use serde::Serialize;
use shardwire_config::SourceEntry;
use tokio::sync::watch;

use crate::link::{LinkConfig, SourceLink};

/// One source of the roster.
#[derive(Debug, Clone)]
pub struct Member {
    /// Its link.
    pub link: Arc<SourceLink>,
    /// How it was found: `config`, or the `dns:NAME:PORT` entry that resolved to it.
    pub found_by: String,
    /// Turns true to stop the link's task (retired, or the node shuts down).
    stop: Arc<watch::Sender<bool>>,
}

impl Member {
    /// Stops the link's task: it goes down, failing what it still holds (fetched again
    /// elsewhere).
    pub fn stop(&self) {
        let _ = self.stop.send(true);
    }
}

/// The last answer for one `dns:` entry (`/v1/status` `discovery`).
#[derive(Debug, Clone, Serialize)]
pub struct Resolution {
    /// The entry, `dns:NAME:PORT`.
    pub entry: String,
    /// The addresses of its last good answer (kept when a resolution fails).
    pub addresses: BTreeSet<String>,
    /// Resolutions tried.
    pub resolutions: u64,
    /// When the last good answer came (seconds since the Unix epoch; 0: none yet).
    pub resolved_at: u64,
    /// Why the last resolution failed; `None` when it succeeded.
    pub last_error: Option<String>,
}

impl Resolution {
    /// No answer yet for `entry`.
    pub fn new(entry: &SourceEntry) -> Self {
        Self {
            entry: entry.to_string(),
            addresses: BTreeSet::new(),
            resolutions: 0,
            resolved_at: 0,
            last_error: None,
        }
    }
}

/// The node's sources.
#[derive(Debug)]
pub struct Roster {
    members: RwLock<Arc<Vec<Member>>>,
    next_index: AtomicUsize,
    cfg: LinkConfig,
    resolutions: Mutex<Vec<Resolution>>,
}

impl Roster {
    /// An empty roster; links it makes use `cfg`.
    pub fn new(cfg: LinkConfig) -> Self {
        Self {
            members: RwLock::default(),
            next_index: AtomicUsize::new(0),
            cfg,
            resolutions: Mutex::default(),
        }
    }

    /// The `dns:` entries, none resolved yet.
    pub fn set_resolutions(&self, r: Vec<Resolution>) {
        *self.resolutions.lock().unwrap_or_else(|p| p.into_inner()) = r;
    }

    /// The `dns:` entries' last answers.
    pub fn resolutions(&self) -> Vec<Resolution> {
        self.resolutions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Records resolution `i`'s answer (an error keeps the previous addresses); returns its
    /// (previous, current) addresses.
    pub fn resolved(
        &self,
        i: usize,
        answer: Result<BTreeSet<String>, String>,
    ) -> (BTreeSet<String>, BTreeSet<String>) {
        let mut all = self.resolutions.lock().unwrap_or_else(|p| p.into_inner());
        let r = &mut all[i];
        r.resolutions += 1;
        let before = r.addresses.clone();
        match answer {
            Ok(set) => {
                r.addresses = set;
                r.resolved_at = now_unix();
                r.last_error = None;
            }
            Err(e) => r.last_error = Some(e),
        }
        (before, r.addresses.clone())
    }

    /// Every address an entry names now: the configured ones and every `dns:` entry's
    /// current answer.
    pub fn named(&self) -> BTreeSet<String> {
        let mut set: BTreeSet<String> = self
            .snapshot()
            .iter()
            .filter(|m| m.found_by == "config")
            .map(|m| m.link.addr.clone())
            .collect();
        for r in self
            .resolutions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            set.extend(r.addresses.iter().cloned());
        }
        set
    }

    /// The sources now, in the order they were added.
    pub fn snapshot(&self) -> Arc<Vec<Member>> {
        Arc::clone(&self.members.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// Every link now.
    pub fn links(&self) -> Vec<Arc<SourceLink>> {
        self.snapshot()
            .iter()
            .map(|m| Arc::clone(&m.link))
            .collect()
    }

    /// The link with id `index`, if it is still in the roster.
    pub fn link(&self, index: usize) -> Option<Arc<SourceLink>> {
        let snap = self.snapshot();
        let m = snap.iter().find(|m| m.link.index == index)?;
        Some(Arc::clone(&m.link))
    }

    /// Adds a link to `addr` found by `found_by`, and returns it with the receiver its task
    /// stops on; `None` when `addr` is in the roster already (a retiring one is kept: its
    /// address came back before it was gone).
    pub fn add(
        &self,
        addr: &str,
        found_by: &str,
    ) -> Option<(Arc<SourceLink>, watch::Receiver<bool>)> {
        let mut members = self.members.write().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = members.iter().find(|m| m.link.addr == addr) {
            if m.link.is_retiring() {
                m.link.set_retiring(false);
                tracing::info!(
                    source = addr,
                    found_by,
                    "source is back; no longer retiring it"
                );
            }
            return None;
        }
        let index = self.next_index.fetch_add(1, Ordering::Relaxed);
        let link = SourceLink::new(index, addr.to_owned(), self.cfg.clone());
        let (stop, stopped) = watch::channel(false);
        let mut next = Vec::clone(&members);
        next.push(Member {
            link: Arc::clone(&link),
            found_by: found_by.to_owned(),
            stop: Arc::new(stop),
        });
        *members = Arc::new(next);
        Some((link, stopped))
    }

    /// Marks the link to `addr` retiring: no new fetches go to it. Returns it, unless it is
    /// not in the roster or retiring already.
    pub fn retire(&self, addr: &str) -> Option<Member> {
        let members = self.members.read().unwrap_or_else(|p| p.into_inner());
        let m = members.iter().find(|m| m.link.addr == addr)?;
        if m.link.is_retiring() {
            return None;
        }
        m.link.set_retiring(true);
        Some(m.clone())
    }

    /// Takes link `index` out of the roster (its task was stopped).
    pub fn remove(&self, index: usize) {
        let mut members = self.members.write().unwrap_or_else(|p| p.into_inner());
        let next: Vec<Member> = members
            .iter()
            .filter(|m| m.link.index != index)
            .cloned()
            .collect();
        *members = Arc::new(next);
    }

    /// Takes link `index` out of the roster if it is still retiring, deciding under the lock
    /// [`Roster::add`] takes (an address that came back un-retires it there); returns
    /// whether it was removed.
    pub fn remove_if_retiring(&self, index: usize) -> bool {
        let mut members = self.members.write().unwrap_or_else(|p| p.into_inner());
        let Some(m) = members.iter().find(|m| m.link.index == index) else {
            return false;
        };
        if !m.link.is_retiring() {
            return false;
        }
        let next: Vec<Member> = members
            .iter()
            .filter(|m| m.link.index != index)
            .cloned()
            .collect();
        *members = Arc::new(next);
        true
    }

    /// Stops every link's task (the node shuts down).
    pub fn stop_all(&self) {
        for m in self.snapshot().iter() {
            m.stop();
        }
    }
}

/// Seconds since the Unix epoch (for status).
fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roster() -> Roster {
        Roster::new(LinkConfig {
            secret: None,
            lanes: vec![shardwire_protocol::wire::LaneAddr {
                data_addr: "127.0.0.1:1".parse().unwrap(),
                flows: 1,
            }],
        })
    }

    #[test]
    fn addresses_are_added_once_and_ids_never_reused() {
        let r = roster();
        let (a, _) = r.add("10.0.0.2:7500", "dns:src:7500").unwrap();
        assert!(r.add("10.0.0.2:7500", "config").is_none());
        let (b, _) = r.add("10.0.0.3:7500", "config").unwrap();
        assert_ne!(a.index, b.index);
        r.remove(a.index);
        let (c, _) = r.add("10.0.0.2:7500", "dns:src:7500").unwrap();
        assert!(c.index > b.index, "a returning address gets a new link");
        assert_eq!(r.snapshot().len(), 2);
        assert_eq!(r.link(b.index).unwrap().addr, "10.0.0.3:7500");
        assert!(r.link(a.index).is_none());
    }

    #[test]
    fn only_a_link_still_retiring_is_removed() {
        let r = roster();
        let (a, _) = r.add("10.0.0.2:7500", "dns:src:7500").unwrap();
        assert!(!r.remove_if_retiring(a.index), "not retiring: kept");
        r.retire("10.0.0.2:7500").unwrap();
        assert!(
            r.add("10.0.0.2:7500", "dns:src:7500").is_none(),
            "came back: un-retired"
        );
        assert!(
            !r.remove_if_retiring(a.index),
            "came back before the removal: kept"
        );
        assert_eq!(r.snapshot().len(), 1);
        r.retire("10.0.0.2:7500").unwrap();
        assert!(r.remove_if_retiring(a.index));
        assert!(r.link(a.index).is_none());
        assert!(!r.remove_if_retiring(a.index), "gone already");
    }

    #[test]
    fn a_retiring_source_takes_no_new_fetches_until_it_comes_back() {
        let r = roster();
        let (a, mut stopped) = r.add("10.0.0.2:7500", "dns:src:7500").unwrap();
        let m = r.retire("10.0.0.2:7500").unwrap();
        assert!(!a.takes_new_fetches());
        assert!(r.retire("10.0.0.2:7500").is_none(), "retiring already");
        assert!(r.add("10.0.0.2:7500", "dns:src:7500").is_none());
        assert!(a.takes_new_fetches(), "its address came back");
        m.stop();
        assert!(*stopped.borrow_and_update());
        assert!(r.retire("10.9.9.9:1").is_none());
    }
}
