//! The undo of a NIC's journaled changes: last first, each dropped from the state file once
//! undone, so a retry redoes no finished step ([`undo`]); the undo of a journaled ntuple
//! rule, which deletes no rule but the one journaled ([`undo_rule`], [`undo_pending_rule`]);
//! and, after a crash, the restore of a state file left behind ([`restore_from`]).

use std::io;
use std::path::Path;

use super::{
    Change, EthtoolClient, NicError, Restore, RuleUndo, StateFile, boot_id, gone_is_done, lock,
    remove, steer, write_state,
};

/// After [`undo`] of `state`, journaled at `path` (`undone`: what the undo returned). With
/// steps left: the undo's error, and the file keeps them for the next start (and, where its
/// last save failed, steps already undone too: the callers log that, [`lists_undone`]). With
/// none: the file is removed whatever `undone` says, since a save that failed on the way left
/// it listing steps already undone, which the next start would redo (ntuple turned off again
/// flushes the operator's rules); a failed removal is logged with its own message, not
/// returned, as the NIC is restored.
pub(super) fn settle_undo(
    path: &Path,
    state: &StateFile,
    undone: Result<(), NicError>,
) -> Result<(), NicError> {
    if !state.changes.is_empty() {
        return undone;
    }
    match (remove(path), undone.is_ok()) {
        (Ok(()), true) => {}
        (Ok(()), false) => tracing::info!(
            ifname = %state.ifname,
            path = %path.display(),
            "NIC settings restored: every step was undone; the state file, which could not \
             be saved on the way (logged above), is removed"
        ),
        // The last save went through: the file records no change, and the next start
        // removes it unchecked.
        (Err(e), true) => tracing::warn!(
            ifname = %state.ifname,
            path = %path.display(),
            error = %e,
            "NIC settings restored, but the state file could not be removed; it records no \
             change now, and the next start removes it"
        ),
        (Err(e), false) => tracing::warn!(
            ifname = %state.ifname,
            path = %path.display(),
            error = %e,
            "NIC settings restored, but the state file could neither be saved (logged above) \
             nor removed: it may still list steps already undone, which the next start would \
             redo; remove it before then"
        ),
    }
    Ok(())
}

/// Whether the state file at `path` lists more steps than `state` keeps: a save after a step
/// was undone failed, so the file still lists steps already undone, which the next start
/// undoes again. Read back after a restore that left steps ([`settle_undo`]); the undo only
/// drops steps, so a file listing more is one not saved since. One that cannot be read or
/// parsed counts as not stale (the next start reports it as it is).
pub(super) fn lists_undone(path: &Path, state: &StateFile) -> bool {
    std::fs::read(path)
        .ok()
        .and_then(|raw| serde_json::from_slice::<StateFile>(&raw).ok())
        .is_some_and(|disk| disk.changes.len() > state.changes.len())
}

/// For a restore that returns its error (steps left, the state file kept): logs, where the
/// file could not be saved and so also lists steps already undone ([`lists_undone`]), that
/// the next start will undo those again; nothing where the file keeps only the steps left.
pub(super) fn warn_if_stale(path: &Path, state: &StateFile) {
    if lists_undone(path, state) {
        tracing::warn!(
            ifname = %state.ifname,
            path = %path.display(),
            steps_left = state.changes.len(),
            file_stale = true,
            "NIC restore incomplete, and its state file could not be saved (logged above): \
             besides the steps left it lists steps already undone, which the next start will \
             undo again; free its disk, and check those settings before the next start"
        );
    }
}

/// Undo `state`'s changes, last first, each tried whatever the others did. Each one undone
/// is dropped from `state` and the file at `path` right away, so the file keeps only those
/// not undone: a retry (the next start) redoes no finished step (a rule deleted twice could
/// be someone else's by then; ntuple turned off twice would flush the operator's rules).
/// Where the file cannot be saved (each failure logged, the first returned), it still lists
/// steps undone since its last save: with every step undone it is removed
/// ([`settle_undo`]); with steps left the callers say so ([`lists_undone`]). Returns the
/// first error.
pub(super) fn undo<C: UndoOps>(
    path: &Path,
    state: &mut StateFile,
    client: &mut C,
) -> Result<(), NicError> {
    let mut first_err = None;
    let ifname = state.ifname.clone();
    let mut note = |e: NicError| {
        warn_undo_failed(&ifname, &e);
        first_err.get_or_insert(e);
    };
    for i in (0..state.changes.len()).rev() {
        // `changes[..i]`: the entries this restore undoes after this one.
        let (rest, c) = (&state.changes[..i], &state.changes[i]);
        match undo_one(&mut *client, state.ifindex, &state.ifname, c, rest) {
            Ok(()) => {
                // Saved after each setting put back (a retry must not put it back again over
                // what changed since); rule deletions, one per data connection and checked
                // when redone (a rule entry of an earlier release is not: saved at once),
                // are saved with the rest at the end.
                let c = state.changes.remove(i);
                let checked = matches!(
                    c,
                    Change::Rule {
                        rule: Some(_),
                        queue: Some(_),
                        ..
                    } | Change::PendingRule { .. }
                );
                if !checked && let Err(e) = write_state(path, state) {
                    note(e);
                }
            }
            Err(e) => note(e),
        }
    }
    if let Err(e) = write_state(path, state) {
        note(e);
    }
    first_err.map_or(Ok(()), Err)
}

/// Undo one change on interface `ifname` (index `ifindex`); `rest`: the journal's entries
/// undone after it (those before it), whose rules a [`Change::PendingRule`]'s undo leaves to
/// them ([`rules_deleted_by`]).
fn undo_one<C: UndoOps>(
    client: &mut C,
    ifindex: u32,
    ifname: &str,
    c: &Change,
    rest: &[Change],
) -> Result<(), NicError> {
    match *c {
        Change::NtupleOn => client.set_ntuple(ifname, false),
        Change::Rule {
            location,
            ref rule,
            queue,
        } => undo_rule(&*client, ifname, location, rule.as_ref().zip(queue))
            .map(|done| warn_left(ifname, &done)),
        Change::PendingRule {
            ref rule,
            queue,
            ref existing,
        } => {
            let owned = rules_deleted_by(rest, rule, queue);
            undo_pending_rule(&*client, ifname, rule, queue, existing, &owned)
                .map(|done| warn_left(ifname, &done))
        }
        Change::Rss { ref table } => client.set_rss_indir(ifname, table),
        Change::Channels { rx, tx, combined } => {
            client.set_channels(ifindex, ifname, rx, tx, combined)
        }
        // 0 (`unknown`) is set too: it is `tcp-data-split auto`, the driver's default. A
        // driver without the attribute (its rings-get omitted it, read as 0) refuses any
        // rings-set of it: then there is nothing to restore.
        Change::Rings {
            tcp_data_split,
            hds_thresh,
        } => match client.set_rings(ifindex, ifname, tcp_data_split, hds_thresh) {
            Err(NicError::Kernel { errno, .. })
                if tcp_data_split == 0 && errno == libc::EOPNOTSUPP =>
            {
                Ok(())
            }
            other => other,
        },
    }
}

/// A restore's warning for a rule it left ([`RuleUndo`] other than `Removed`): an event in
/// the service's log with the interface, the location(s) and the outcome in words.
pub(super) fn warn_left(ifname: &str, done: &RuleUndo) {
    match done {
        RuleUndo::Removed => {}
        RuleUndo::NotOurs { location } => tracing::warn!(
            %ifname,
            location,
            outcome = %done,
            "restoring NIC settings: a journaled steering rule was not deleted (see outcome)"
        ),
        RuleUndo::PriorLeft { locations } => tracing::warn!(
            %ifname,
            ?locations,
            outcome = %done,
            "restoring NIC settings: steering rules that match one being added when the \
             process stopped were there before it, and stay (see outcome)"
        ),
    }
}

/// A restore's warning for a step whose undo failed (the state file keeps it for the next
/// start's retry), logged once per failure; a caller that cannot return the restore's error
/// logs a summary of what is left, not the error again ([`Journal::restore_or_warn`](super::Journal::restore_or_warn)).
pub(super) fn warn_undo_failed(ifname: &str, e: &NicError) {
    tracing::warn!(%ifname, error = %e, "restoring NIC settings failed (see error)");
}

/// Undo a [`Change::Rule`]: delete the rule at `location`, where it is the one journaled
/// (`what`: its match and queue; an entry of an earlier release has none and is deleted
/// unchecked). Another rule there (the insertion never happened, and the location was taken
/// since, e.g. by `ethtool -N`) is left ([`RuleUndo::NotOurs`]); the caller logs that.
pub(super) fn undo_rule<C: UndoOps>(
    client: &C,
    ifname: &str,
    location: u32,
    what: Option<(&steer::Tcp4Match, u32)>,
) -> Result<RuleUndo, NicError> {
    if let Some((rule, queue)) = what {
        match client.rule_at_is(ifname, location, rule, queue)? {
            None => return Ok(RuleUndo::Removed),
            Some(false) => return Ok(RuleUndo::NotOurs { location }),
            Some(true) => {}
        }
    }
    gone_is_done(client.delete_rule(ifname, location)).map(|()| RuleUndo::Removed)
}

/// Undo a [`Change::PendingRule`]: the insertion may or may not have happened, at a
/// location nobody recorded. Rules that match it at the locations `owned` are deleted by
/// the journal's own entries later in the same restore ([`rules_deleted_by`]), so are left
/// to them. Other rules that match it but were there before (`existing`) are not the one it
/// was adding and stay ([`RuleUndo::PriorLeft`]; the caller logs that). Of the rest: none,
/// nothing to do; one, delete it; more than one, which is ours cannot be told, so none is
/// deleted ([`NicError::AmbiguousRule`]).
fn undo_pending_rule<C: UndoOps>(
    client: &C,
    ifname: &str,
    rule: &steer::Tcp4Match,
    queue: u32,
    existing: &[u32],
    owned: &[u32],
) -> Result<RuleUndo, NicError> {
    let found = client.find_rules(ifname, rule, queue)?;
    let (ours, theirs) = pending_rule_candidates(found, existing, owned);
    match ours.as_slice() {
        [] => {}
        [location] => gone_is_done(client.delete_rule(ifname, *location))?,
        locations => {
            return Err(NicError::AmbiguousRule {
                ifname: ifname.into(),
                locations: locations.to_vec(),
            });
        }
    }
    if theirs.is_empty() {
        Ok(RuleUndo::Removed)
    } else {
        Ok(RuleUndo::PriorLeft { locations: theirs })
    }
}

/// The rules `found` matching a [`Change::PendingRule`], split into those that may be the
/// one it was inserting and those that stay: the `existing` ones, there before it. Those at
/// `owned` locations are in neither: the journal's own entries delete them in the same
/// restore ([`rules_deleted_by`]), so they neither stay nor are the marker's to delete.
pub(super) fn pending_rule_candidates(
    found: Vec<u32>,
    existing: &[u32],
    owned: &[u32],
) -> (Vec<u32>, Vec<u32>) {
    found
        .into_iter()
        .filter(|l| !owned.contains(l))
        .partition(|l| !existing.contains(l))
}

/// The locations whose rule the undo of the `Rule` entries in `entries` deletes where that
/// rule steers what `rule` matches onto `queue` (a [`Change::PendingRule`]'s match): entries
/// of the same match and queue (checked at undo, and the rule there is one of theirs) and
/// those of an earlier release without them (deleted unchecked). Entries of another match
/// leave such a rule ([`RuleUndo::NotOurs`]), so are not counted.
pub(super) fn rules_deleted_by(
    entries: &[Change],
    rule: &steer::Tcp4Match,
    queue: u32,
) -> Vec<u32> {
    let deletes = |c: &Change| match *c {
        Change::Rule {
            location,
            rule: Some(ref r),
            queue: Some(q),
        } => (r == rule && q == queue).then_some(location),
        Change::Rule { location, .. } => Some(location),
        _ => None,
    };
    entries.iter().filter_map(deletes).collect()
}

/// The requests a restore makes of the NIC ([`undo`]): [`EthtoolClient`]'s own (each
/// forwards to its method of the same name), or a test's stand-in for a NIC's rules.
pub(super) trait UndoOps {
    fn set_ntuple(&self, ifname: &str, on: bool) -> Result<(), NicError>;
    fn find_rules(
        &self,
        ifname: &str,
        m: &steer::Tcp4Match,
        queue: u32,
    ) -> Result<Vec<u32>, NicError>;
    fn rule_at_is(
        &self,
        ifname: &str,
        location: u32,
        m: &steer::Tcp4Match,
        queue: u32,
    ) -> Result<Option<bool>, NicError>;
    fn delete_rule(&self, ifname: &str, location: u32) -> Result<(), NicError>;
    fn set_rss_indir(&self, ifname: &str, table: &[u32]) -> Result<(), NicError>;
    fn set_channels(
        &mut self,
        ifindex: u32,
        ifname: &str,
        rx: u32,
        tx: u32,
        combined: u32,
    ) -> Result<(), NicError>;
    fn set_rings(
        &mut self,
        ifindex: u32,
        ifname: &str,
        tcp_data_split: u8,
        hds_thresh: Option<u32>,
    ) -> Result<(), NicError>;
}

impl UndoOps for EthtoolClient {
    fn set_ntuple(&self, ifname: &str, on: bool) -> Result<(), NicError> {
        EthtoolClient::set_ntuple(self, ifname, on)
    }

    fn find_rules(
        &self,
        ifname: &str,
        m: &steer::Tcp4Match,
        queue: u32,
    ) -> Result<Vec<u32>, NicError> {
        EthtoolClient::find_rules(self, ifname, m, queue)
    }

    fn rule_at_is(
        &self,
        ifname: &str,
        location: u32,
        m: &steer::Tcp4Match,
        queue: u32,
    ) -> Result<Option<bool>, NicError> {
        EthtoolClient::rule_at_is(self, ifname, location, m, queue)
    }

    fn delete_rule(&self, ifname: &str, location: u32) -> Result<(), NicError> {
        EthtoolClient::delete_rule(self, ifname, location)
    }

    fn set_rss_indir(&self, ifname: &str, table: &[u32]) -> Result<(), NicError> {
        EthtoolClient::set_rss_indir(self, ifname, table)
    }

    fn set_channels(
        &mut self,
        ifindex: u32,
        ifname: &str,
        rx: u32,
        tx: u32,
        combined: u32,
    ) -> Result<(), NicError> {
        EthtoolClient::set_channels(self, ifindex, ifname, rx, tx, combined)
    }

    fn set_rings(
        &mut self,
        ifindex: u32,
        ifname: &str,
        tcp_data_split: u8,
        hds_thresh: Option<u32>,
    ) -> Result<(), NicError> {
        EthtoolClient::set_rings(self, ifindex, ifname, tcp_data_split, hds_thresh)
    }
}

/// After a crash: undo what the state file at `path` records (entering its network
/// namespace if it names one) and delete it. `Ok(None)` when there is no state file;
/// [`NicError::StateInUse`] when a running process holds its lock (its live setup). A file
/// made before the last reboot is removed without undoing anything ([`Restore::Stale`]); one
/// whose interface name no longer has the index it recorded is left, and nothing undone
/// ([`NicError::StateMismatch`]). One that records no change is removed unchecked
/// ([`Restore::Undone`] with no changes). A step whose undo fails is returned as the error,
/// the file keeping the steps left (and, where it could not be saved, steps already undone,
/// which the next start undoes again: logged, [`warn_if_stale`]); with every step undone the
/// file is removed, even where saving it on the way failed ([`settle_undo`]).
pub fn restore_from(path: &Path) -> Result<Option<Restore>, NicError> {
    if !path.exists() {
        return Ok(None);
    }
    // Held until this returns: the file is a leftover only if no running process holds it.
    let _lock = lock(path)?;
    let raw = match std::fs::read(path) {
        Ok(r) => r,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(NicError::State {
                path: path.into(),
                reason: e.to_string(),
            });
        }
    };
    let mut state: StateFile = serde_json::from_slice(&raw).map_err(|e| NicError::State {
        path: path.into(),
        reason: format!("not a shardwire NIC state file: {e}"),
    })?;
    if let (Some(then), Some(now)) = (&state.boot_id, boot_id())
        && *then != now
    {
        remove(path)?;
        return Ok(Some(Restore::Stale(state)));
    }
    if state.changes.is_empty() {
        // Nothing to undo (the process stopped right after creating the journal), so the
        // interface and namespace need not be there: kept, the file would refuse every
        // later setup (`StateExists`). Reported as undone, which the caller logs.
        remove(path)?;
        return Ok(Some(Restore::Undone(state)));
    }
    let mut client = match &state.netns {
        Some(ns) => EthtoolClient::open_in_netns(ns)?,
        None => EthtoolClient::open()?,
    };
    let found = match client.ifindex_of(&state.ifname) {
        Ok(i) => Some(i),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => {
            return Err(NicError::State {
                path: path.into(),
                reason: format!("looking up interface {}: {e}", state.ifname),
            });
        }
    };
    if found != Some(state.ifindex) {
        return Err(NicError::StateMismatch {
            path: path.into(),
            ifname: state.ifname,
            recorded: state.ifindex,
            found,
        });
    }
    // What the file held: `undo` drops each change from it (and `state`) once undone.
    let recorded = state.clone();
    let undone = undo(path, &mut state, &mut client);
    settle_undo(path, &state, undone).inspect_err(|_| warn_if_stale(path, &state))?;
    Ok(Some(Restore::Undone(recorded)))
}
