//! The write-ahead journal of one NIC's setup ([`Journal`]): each change is saved to the
//! state file before it is made, an ntuple rule before its insertion, and all are undone in
//! reverse order on shutdown (the undo itself: `undo.rs`).

use std::fs::File;
use std::path::{Path, PathBuf};

use super::undo::{UndoOps, lists_undone, settle_undo, undo, undo_rule, warn_if_stale};
use super::{
    Change, EthtoolClient, InsertedRule, NicError, RuleKind, RuleUndo, StateFile,
    TCP_DATA_SPLIT_ENABLED, boot_id, channels_request, gone_is_done, header_split_request, lock,
    steer, write_state,
};

/// The write-ahead record of NIC changes: each change is saved before it is made. It holds
/// its lock file while it lives ([`lock`]), so another process that starts meanwhile (a
/// second node, `shardwire demo` on the same host) does not take the live setup for a
/// crash's leftover and undo it under the running node.
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    state: StateFile,
    _lock: File,
}

impl Journal {
    /// Start a journal at `path` for one interface; refuses if a state file exists.
    pub fn create(
        path: &Path,
        ifname: &str,
        ifindex: u32,
        netns: Option<PathBuf>,
    ) -> Result<Self, NicError> {
        let lock = lock(path)?;
        if path.exists() {
            return Err(NicError::StateExists(path.into()));
        }
        let j = Self {
            _lock: lock,
            path: path.into(),
            state: StateFile {
                ifname: ifname.into(),
                ifindex,
                netns,
                boot_id: boot_id(),
                changes: Vec::new(),
            },
        };
        j.save()?;
        Ok(j)
    }

    /// The recorded state.
    pub fn state(&self) -> &StateFile {
        &self.state
    }

    fn save(&self) -> Result<(), NicError> {
        write_state(&self.path, &self.state)
    }

    /// Drop entry `at`, a rule not on the NIC (its insertion refused, or the rule deleted
    /// again: [`Journal::insert_journaled`]), and save. A failed save is only reported: the
    /// entry left on disk undoes nothing that exists (a rule not there is `ENOENT`, done; a
    /// pending marker finds no rule).
    fn forget(&mut self, at: usize) {
        self.state.changes.remove(at);
        if let Err(e) = self.save() {
            tracing::warn!(
                ifname = %self.state.ifname,
                path = %self.path.display(),
                error = %e,
                "NIC journal: dropping the entry of a rule not on the NIC (never inserted, or \
                 deleted again) failed; the entry left undoes nothing that exists"
            );
        }
    }

    /// Record `change` durably; call before making it.
    pub fn record(&mut self, change: Change) -> Result<(), NicError> {
        self.state.changes.push(change);
        let saved = self.save();
        if saved.is_err() {
            // Not on disk: not in memory either (the caller will not make the change).
            self.state.changes.pop();
        }
        saved
    }

    /// Set channel counts, journaled.
    pub fn set_channels(
        &mut self,
        client: &mut EthtoolClient,
        rx: u32,
        tx: u32,
        combined: u32,
    ) -> Result<(), NicError> {
        let (ifindex, ifname) = (self.state.ifindex, self.state.ifname.clone());
        let old = client.channels(ifindex, &ifname)?;
        self.record(Change::Channels {
            rx: old.rx,
            tx: old.tx,
            combined: old.combined,
        })?;
        client.set_channels(ifindex, &ifname, rx, tx, combined)
    }

    /// Give the NIC at least `need` RX queues, journaled: the kind of channel it uses now is
    /// raised within that kind's maximum ([`channels_request`]); nothing is done when it has
    /// them, and a NIC that cannot have them is refused ([`NicError::NotEnoughQueues`])
    /// before anything is journaled or changed.
    ///
    /// Called on a live setup too (a lane joining on queues past the channels): the entry
    /// then follows the others, and the reverse undo lowers the channels only after every
    /// later entry, the only ones that can use the new queues (rules onto them, an RSS table
    /// changed since), is undone; the kernel refuses fewer channels than such a rule or a
    /// user-set RSS table uses, and entries before it cannot use queues that did not exist.
    pub fn ensure_queues(&mut self, client: &mut EthtoolClient, need: u32) -> Result<(), NicError> {
        let (ifindex, ifname) = (self.state.ifindex, self.state.ifname.clone());
        let ch = client.channels(ifindex, &ifname)?;
        match channels_request(&ifname, &ch, need)? {
            Some((rx, tx, combined)) => self.set_channels(client, rx, tx, combined),
            None => Ok(()),
        }
    }

    /// Turn header split on with `hds-thresh` 0, journaled.
    pub fn enable_header_split(&mut self, client: &mut EthtoolClient) -> Result<(), NicError> {
        let (ifindex, ifname) = (self.state.ifindex, self.state.ifname.clone());
        let old = client.rings(ifindex, &ifname)?;
        let Some(hds_thresh) = header_split_request(&old) else {
            return Ok(());
        };
        self.record(Change::Rings {
            tcp_data_split: old.tcp_data_split,
            hds_thresh: old.hds_thresh,
        })?;
        client.set_rings(ifindex, &ifname, TCP_DATA_SPLIT_ENABLED, hds_thresh)
    }

    /// Steer TCP/IPv4 to `dst_port` onto `queue`: with `Some(n)`, RSS kept on queues `0..n`
    /// (only narrowed: [`steer::narrowed_table`]; `Some(0)` is refused), the ntuple feature
    /// on, one ntuple rule; all journaled. Returns the rule.
    pub fn steer(
        &mut self,
        client: &mut EthtoolClient,
        dst_port: u16,
        queue: u32,
        rss_queues: Option<u32>,
    ) -> Result<InsertedRule, NicError> {
        let ifname = self.state.ifname.clone();
        if let Some(n) = rss_queues {
            self.narrow_rss(client, n)?;
        }
        if !client.ntuple_enabled(&ifname)? {
            self.record(Change::NtupleOn)?;
            client.set_ntuple(&ifname, true)?;
        }
        let m = steer::Tcp4Match::port(dst_port);
        self.insert_rule(client, "ntuple-rule-insert", m, queue, RuleKind::Port)
    }

    /// Keep RSS off queues `rss_queues..`, journaled: the table's entries at or above it are
    /// moved below it, the others kept ([`steer::narrowed_table`]); a table with none there
    /// (the default of a NIC with no more queues, or one an operator narrowed further) is
    /// left as it is. `0` is refused: no queue is left for RSS.
    fn narrow_rss(&mut self, client: &mut EthtoolClient, rss_queues: u32) -> Result<(), NicError> {
        let ifname = self.state.ifname.clone();
        let Some(below) = std::num::NonZeroU32::new(rss_queues) else {
            return Err(NicError::QueueZeroBound {
                ifname,
                queues: vec![0],
            });
        };
        let old = client.rss_indir(&ifname)?;
        let Some(new) = steer::narrowed_table(&old, below) else {
            return Ok(());
        };
        // The kernel's default spreads over `ETHTOOL_GRXRINGS` rings; where that cannot be
        // read, the table is restored as it was.
        let table = match client.rx_rings(&ifname) {
            Ok(rings) => steer::table_to_restore(old, rings),
            Err(_) => old,
        };
        self.record(Change::Rss { table })?;
        client.set_rss_indir(&ifname, &new)
    }

    /// Steer one connection onto `queue` with a 5-tuple ntuple rule, journaled (the ntuple
    /// feature must be on: [`Journal::steer`] turned it on). Returns the rule.
    pub fn add_flow(
        &mut self,
        client: &mut EthtoolClient,
        flow: steer::Tcp4Flow,
        queue: u32,
    ) -> Result<InsertedRule, NicError> {
        let m = steer::Tcp4Match::flow(flow);
        self.insert_rule(client, "ntuple-flow-rule-insert", m, queue, RuleKind::Flow)
    }

    /// Insert an ntuple rule steering what `m` matches onto `queue`, journaled before it is
    /// made ([`Journal::insert_journaled`]). `op` names the request in errors; `kind` says
    /// where rules that match it already can come from ([`Journal::prior_rules`]).
    fn insert_rule(
        &mut self,
        client: &mut EthtoolClient,
        op: &'static str,
        m: steer::Tcp4Match,
        queue: u32,
        kind: RuleKind,
    ) -> Result<InsertedRule, NicError> {
        let ifname = self.state.ifname.clone();
        let client: &EthtoolClient = client;
        let at = client.next_rule_location(&ifname)?;
        let existing = self.prior_rules(kind, at, &m, queue, || {
            client.find_rules(&ifname, &m, queue)
        })?;
        let location = self.insert_journaled(
            at,
            existing,
            m,
            queue,
            |at| client.insert_rule(&ifname, op, &m, queue, at),
            |location| gone_is_done(client.delete_rule(&ifname, location)),
        )?;
        Ok(InsertedRule {
            location,
            rule: m,
            queue,
        })
    }

    /// The rules that steer what `m` matches onto `queue` already, recorded in a
    /// [`Change::PendingRule`] marker so that its undo (a restore after a crash mid-insertion,
    /// which finds the rule by its match) leaves them. None are needed where the location
    /// `at` is chosen before the insertion: the marker is not used.
    ///
    /// A port rule's are looked for on the NIC (`find`): an operator's identical `ethtool -N`
    /// rule may be there. A connection's 5-tuple rule ([`RuleKind::Flow`]) is not looked for:
    /// that is a listing and one read per rule on the NIC, one rule per live connection,
    /// before every new connection. Its match holds the peer's ephemeral port of a connection
    /// just accepted, which no operator's rule names ahead of time; the only rules that can
    /// match it already are this journal's own, for an earlier connection of the same 4-tuple
    /// whose deletion failed, and those are taken from the journal (their own entries delete
    /// them). Were an unjournaled identical rule there all the same, the undo would find two
    /// rules (it and ours) and delete neither ([`NicError::AmbiguousRule`]), or, where the
    /// crash came before the insertion reached the NIC, delete that one: the risk the
    /// ephemeral port rules out.
    pub(super) fn prior_rules(
        &self,
        kind: RuleKind,
        at: Option<u32>,
        m: &steer::Tcp4Match,
        queue: u32,
        find: impl FnOnce() -> Result<Vec<u32>, NicError>,
    ) -> Result<Vec<u32>, NicError> {
        match (at, kind) {
            (Some(_), _) => Ok(Vec::new()),
            (None, RuleKind::Port) => find(),
            (None, RuleKind::Flow) => Ok(self.journaled_rules(m, queue)),
        }
    }

    /// The locations of this journal's rule entries that steer what `m` matches onto `queue`.
    fn journaled_rules(&self, m: &steer::Tcp4Match, queue: u32) -> Vec<u32> {
        let ours = |c: &Change| match *c {
            Change::Rule {
                location,
                rule: Some(ref r),
                queue: Some(q),
            } if r == m && q == queue => Some(location),
            _ => None,
        };
        self.state.changes.iter().filter_map(ours).collect()
    }

    /// Journal one rule insertion, then make it with `insert`: `Rule { location }` is saved
    /// first where the location `at` is chosen before, else a [`Change::PendingRule`] marker
    /// (with the `existing` rules that match already), resolved to the location `insert`
    /// returns. A refused insertion drops the entry again; a resolution that cannot be saved
    /// deletes the rule (`delete`) and drops it too, or, where that deletion fails, keeps
    /// the entry (resolved in memory; on disk as first saved) for the restore to delete the
    /// rule, and logs that.
    pub(super) fn insert_journaled(
        &mut self,
        at: Option<u32>,
        existing: Vec<u32>,
        rule: steer::Tcp4Match,
        queue: u32,
        insert: impl FnOnce(Option<u32>) -> Result<u32, NicError>,
        delete: impl FnOnce(u32) -> Result<(), NicError>,
    ) -> Result<u32, NicError> {
        let placed = |location| Change::Rule {
            location,
            rule: Some(rule),
            queue: Some(queue),
        };
        self.record(match at {
            Some(location) => placed(location),
            None => Change::PendingRule {
                rule,
                queue,
                existing,
            },
        })?;
        let entry = self.state.changes.len() - 1;
        let location = match insert(at) {
            Ok(location) => location,
            Err(e) => {
                // Not made: not journaled either.
                self.forget(entry);
                return Err(e);
            }
        };
        if at != Some(location) {
            self.state.changes[entry] = placed(location);
            if let Err(e) = self.save() {
                // Not journaled by its location: not left on the NIC either, if it can be
                // deleted; else its entry stays, for the restore.
                match delete(location) {
                    Ok(()) => self.forget(entry),
                    Err(del) => tracing::warn!(
                        ifname = %self.state.ifname,
                        location,
                        error = %del,
                        "NIC journal: a rule inserted but not journaled by its location could \
                         not be deleted; its entry is kept, for the restore to delete it"
                    ),
                }
                return Err(e);
            }
        }
        Ok(location)
    }

    /// Delete rule `r` ([`Journal::add_flow`], [`Journal::steer`]) and its journal entry. The
    /// rule at its location is deleted only if it is still `r`, as a restore checks it: one
    /// already gone (a driver reset, `ethtool -K ntuple off`) is as good as deleted, and a
    /// rule put there since (another connection's) is not `r`'s to delete. Returns which
    /// ([`RuleUndo`]), for the caller to log.
    pub fn remove_flow(
        &mut self,
        client: &mut EthtoolClient,
        r: InsertedRule,
    ) -> Result<RuleUndo, NicError> {
        let ifname = self.state.ifname.clone();
        let client: &EthtoolClient = client;
        self.remove_journaled(r, || {
            undo_rule(client, &ifname, r.location, Some((&r.rule, r.queue)))
        })
    }

    /// Drop `r`'s own journal entry (matched by location, match and queue: another entry at
    /// the same location is another rule's) once `delete` has dealt with the rule; if it
    /// fails the entry stays, for the restore.
    pub(super) fn remove_journaled(
        &mut self,
        r: InsertedRule,
        delete: impl FnOnce() -> Result<RuleUndo, NicError>,
    ) -> Result<RuleUndo, NicError> {
        let done = delete()?;
        let entry = r.change();
        if let Some(at) = self.state.changes.iter().rposition(|c| *c == entry) {
            self.state.changes.remove(at);
            self.save()?;
        }
        Ok(done)
    }

    /// Undo every change in reverse order and delete the state file. When a step fails, its
    /// error is returned and the file is kept for the next start: with only the changes
    /// whose undo failed where it could be saved, else also steps already undone, which the
    /// next start undoes again (logged, `file_stale`: [`warn_if_stale`]). With every step
    /// undone the changes are returned and the file removed, even where saving it on the way
    /// or removing it failed (each logged): the NIC is restored ([`settle_undo`]).
    pub fn restore(self, client: &mut EthtoolClient) -> Result<Vec<Change>, NicError> {
        self.restore_with(client)
    }

    /// [`Journal::restore`] through any [`UndoOps`] (a test's stand-in for a NIC).
    pub(super) fn restore_with<C: UndoOps>(
        mut self,
        client: &mut C,
    ) -> Result<Vec<Change>, NicError> {
        let changes = self.state.changes.clone();
        let undone = undo(&self.path, &mut self.state, client);
        settle_undo(&self.path, &self.state, undone)
            .inspect_err(|_| warn_if_stale(&self.path, &self.state))?;
        Ok(changes)
    }

    /// [`Journal::restore`] for a caller that cannot return its error (drop, the undo of a
    /// failed setup). Each failed step is logged by the undo ([`warn_undo_failed`](super::undo::warn_undo_failed)); this
    /// logs once what is left (the state file, kept for the next start), not those errors
    /// again: the steps left, and whether the file, which could not be saved, also lists
    /// steps already undone, which the next start undoes again (`file_stale`:
    /// [`lists_undone`]). With no step left there is no such summary: the file is removed
    /// ([`settle_undo`]).
    pub(super) fn restore_or_warn<C: UndoOps>(mut self, client: &mut C) {
        let undone = undo(&self.path, &mut self.state, client);
        if settle_undo(&self.path, &self.state, undone).is_err() {
            let (path, state) = (&self.path, &self.state);
            if lists_undone(path, state) {
                tracing::warn!(
                    ifname = %state.ifname,
                    path = %path.display(),
                    steps_left = state.changes.len(),
                    file_stale = true,
                    "NIC restore incomplete: its state file is kept, and the next start retries \
                     the steps left (each failure is logged on its own); the file could not be \
                     saved (logged above), so it also lists steps already undone, which the \
                     next start will undo again: free its disk, and check those settings \
                     before the next start"
                );
            } else {
                tracing::warn!(
                    ifname = %state.ifname,
                    path = %path.display(),
                    steps_left = state.changes.len(),
                    file_stale = false,
                    "NIC restore incomplete: its state file is kept, and the next start retries \
                     the steps left (each failure is logged on its own)"
                );
            }
        }
    }
}
