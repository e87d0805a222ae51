//! Lanes whose NIC gets its IPv4 address after the node started. A lane planned on a
//! wildcard because its NIC had no address then (`LaneSpec::awaits_nic_address`: a NIC still
//! training at boot, which systemd-networkd addresses only once it has carrier) is advertised
//! at the control connection's address meanwhile, so its traffic enters through whichever NIC
//! holds that. Every session looks the NIC's address up again
//! ([`super::DataConns::lane_ips`]) and advertises the lane there once it has one
//! ([`super::session::advertised`]); a session that began before ends at a moment with
//! nothing under way ([`SourceLink::readdress_due`]), so that the next one does: the link
//! takes no new fetch from the first check that finds it quiet, and the session ends at the
//! next if it is quiet still (a fetch sent as the first looked is not failed). As for a
//! redial, from [`READDRESS_BUSY_AFTER`] on a busy link takes no new fetch so that such a
//! moment comes, and [`REDIAL_FORCE_GRACE`] later the session ends anyway. Links do so one
//! after another, [`READDRESS_STAGGER`] apart by link index ([`readdress_stagger`]): every
//! link sees the address within one check, and all of them taking no fetch at once would
//! starve every stream.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::time::Duration;

use shardwire_protocol::wire::LaneAddr;

use super::{Kick, REDIAL_FORCE_GRACE, SourceLink};

/// How long a session due to move lanes to their NICs' addresses waits for a moment with
/// nothing under way on the link before the link takes no new fetch, so that one comes.
pub const READDRESS_BUSY_AFTER: Duration = Duration::from_secs(60);

/// How far apart links start ending their sessions for a NIC's address, by link index
/// ([`readdress_stagger`]).
pub const READDRESS_STAGGER: Duration = Duration::from_secs(15);

/// How many links' starts [`READDRESS_STAGGER`] spreads before the next one starts at none
/// again (link ids are never reused, so they grow).
const READDRESS_STAGGER_SLOTS: u32 = 8;

/// How long after a NIC's address was first seen link `index` starts to end its session
/// for it: [`READDRESS_STAGGER`] times its slot, so that links take no new fetch one after
/// another, not all at once (links whose indexes are equal modulo
/// [`READDRESS_STAGGER_SLOTS`] share a slot, as two can once a `dns:` source came back with a
/// new index: those stop taking fetches together; every link starts within 105 s).
pub fn readdress_stagger(index: usize) -> Duration {
    let slot = (index % READDRESS_STAGGER_SLOTS as usize) as u32;
    READDRESS_STAGGER * slot
}

/// The lanes of `cfg` on a wildcard whose NIC has an address now (`ips`, by lane) other than
/// the one a session advertised (`advertised`), each with its address there.
pub fn moved_lanes(
    cfg: &[LaneAddr],
    advertised: &[SocketAddr],
    ips: &[Option<IpAddr>],
) -> Vec<(u16, SocketAddr)> {
    let lanes = cfg.iter().zip(advertised).zip(ips).enumerate();
    lanes
        .filter(|(_, ((c, _), _))| c.data_addr.ip().is_unspecified())
        .filter_map(|(lane, ((c, was), ip))| {
            let now = SocketAddr::new((*ip)?, c.data_addr.port());
            (now != *was).then_some((lane as u16, now))
        })
        .collect()
}

impl SourceLink {
    /// Whether the node ends the current session at `now` so that the next one advertises
    /// lanes at their NICs' addresses (`ips`, by lane: [`super::DataConns::lane_ips`]): a
    /// lane on a wildcard whose NIC has an address now that this session did not advertise.
    /// From this link's [`readdress_stagger`] after such an address was first seen on: at
    /// a check that finds nothing under way, the link takes no new fetch, and the session
    /// ends at the next check if nothing is under way still (ending it would fail a fetch
    /// sent as the first looked). A link still busy [`READDRESS_BUSY_AFTER`] past its
    /// stagger takes no new fetch so that the moment comes, and [`REDIAL_FORCE_GRACE`]
    /// after that the session ends anyway. Never for a draining source: it takes no new
    /// session.
    pub fn readdress_due(&self, now: tokio::time::Instant, ips: &[Option<IpAddr>]) -> Option<Kick> {
        if self.is_draining() {
            return None;
        }
        let mut st = self.state.lock().expect("poisoned");
        let moved = moved_lanes(&self.cfg.lanes, &st.advertised, ips);
        if moved.is_empty() {
            // No such address, or it went again: nothing to end the session for.
            st.moved_since = None;
            self.readdress_waiting.store(false, Ordering::Release);
            return None;
        }
        let waited = now.saturating_duration_since(*st.moved_since.get_or_insert(now));
        let stagger = readdress_stagger(self.index);
        if waited < stagger {
            return None;
        }
        if self.busy() {
            let limit = stagger.saturating_add(READDRESS_BUSY_AFTER);
            if waited >= limit && !self.readdress_waiting.swap(true, Ordering::AcqRel) {
                tracing::info!(source = %self.addr, ?moved,
                    "lanes are due to move to their NICs' addresses: no new fetch goes to the source until the ones under way end");
            }
            if waited < limit.saturating_add(REDIAL_FORCE_GRACE) {
                return None;
            }
            tracing::warn!(source = %self.addr, ?moved, ?waited,
                "the session is still busy past its limit to move lanes to their NICs' addresses: ending it anyway, what is under way fails and is retried");
        } else if !self.readdress_waiting.swap(true, Ordering::AcqRel) {
            // Quiet now, but a fetch may be on its way as this looked: none goes from now on,
            // and the session ends at the next check if that is quiet too.
            tracing::debug!(source = %self.addr, ?moved,
                "lanes are due to move to their NICs' addresses and the link is quiet: no new fetch goes to the source, its session ends at the next check");
            return None;
        }
        Some(Kick::Readdressed {
            lanes: moved.iter().map(|(l, _)| *l).collect(),
            addrs: moved.iter().map(|(_, a)| *a).collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::link::LinkConfig;
    use crate::link::session::advertised;

    /// Lane 0 on 10.0.0.5:7401, lane 1 on the wildcard (its NIC had no address at start).
    fn cfg() -> Vec<LaneAddr> {
        let lane = |a: &str| LaneAddr {
            data_addr: a.parse().unwrap(),
            flows: 1,
        };
        vec![lane("10.0.0.5:7401"), lane("0.0.0.0:7401")]
    }

    /// Link `index` of [`cfg`]'s lanes with a session up, advertised over a control
    /// connection from 10.0.0.5 while lane 1's NIC has no address.
    fn link_up(index: usize) -> Arc<SourceLink> {
        let l = SourceLink::new(
            index,
            "source-a:7500".into(),
            LinkConfig {
                secret: None,
                lanes: cfg(),
            },
        );
        let lanes = advertised(&l.cfg.lanes, "10.0.0.5".parse().unwrap(), &[None, None]);
        let lanes = lanes.unwrap();
        assert_eq!(lanes[1].data_addr.to_string(), "10.0.0.5:7401");
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        l.establish(tx, &lanes);
        l
    }

    fn eth3() -> [Option<IpAddr>; 2] {
        [None, Some("10.0.3.5".parse().unwrap())]
    }

    #[test]
    fn only_a_wildcard_lane_whose_nic_has_another_address_moves() {
        let advertised: Vec<SocketAddr> = vec![
            "10.0.0.5:7401".parse().unwrap(),
            "10.0.0.5:7401".parse().unwrap(),
        ];
        assert!(moved_lanes(&cfg(), &advertised, &[None, None]).is_empty());
        let both = [Some("10.0.0.9".parse().unwrap()), eth3()[1]];
        let moved = moved_lanes(&cfg(), &advertised, &both);
        assert_eq!(moved, vec![(1, "10.0.3.5:7401".parse().unwrap())]);
        let there = [advertised[0], "10.0.3.5:7401".parse().unwrap()];
        assert!(
            moved_lanes(&cfg(), &there, &eth3()).is_empty(),
            "advertised there already"
        );
    }

    /// Before, a lane whose NIC had no address at start was advertised at the control
    /// connection's address for the node's whole life. Now the session ends once the NIC has
    /// one, at a moment with nothing under way, and never fails a fetch for it before the
    /// busy limit and its grace.
    #[test]
    fn a_session_ends_for_a_nic_address_once_nothing_is_under_way() {
        let l = link_up(0);
        let t0 = tokio::time::Instant::now();
        assert!(l.readdress_due(t0, &[None, None]).is_none());
        l.outstanding.fetch_add(1, Ordering::Relaxed);
        assert!(l.readdress_due(t0, &eth3()).is_none(), "a fetch is out");
        assert!(l.takes_new_fetches(), "before the busy limit");
        assert!(
            l.readdress_due(t0 + READDRESS_BUSY_AFTER, &eth3())
                .is_none()
        );
        assert!(
            !l.takes_new_fetches(),
            "no new fetch once the busy limit passed"
        );
        // The address went again: the link takes fetches again, nothing is due.
        assert!(
            l.readdress_due(t0 + READDRESS_BUSY_AFTER, &[None, None])
                .is_none()
        );
        assert!(l.takes_new_fetches());
        let t1 = t0 + READDRESS_BUSY_AFTER;
        assert!(l.readdress_due(t1, &eth3()).is_none(), "a fetch is out");
        let late = t1 + READDRESS_BUSY_AFTER + REDIAL_FORCE_GRACE;
        let second = Duration::from_secs(1);
        assert!(
            l.readdress_due(late - second, &eth3()).is_none(),
            "within the grace"
        );
        let want = Kick::Readdressed {
            lanes: vec![1],
            addrs: vec!["10.0.3.5:7401".parse().unwrap()],
        };
        assert_eq!(l.readdress_due(late, &eth3()), Some(want.clone()));
        // Waiting since the busy limit, and quiet now: due at once.
        l.outstanding.fetch_sub(1, Ordering::Relaxed);
        assert_eq!(
            l.readdress_due(t1, &eth3()),
            Some(want.clone()),
            "nothing out"
        );
        l.set_draining("test: draining");
        assert!(l.readdress_due(late, &eth3()).is_none(), "draining");
        let text = want.to_string();
        assert!(text.contains("lanes [1]"), "{text}");
        assert!(
            text.contains("other than the one this session advertised"),
            "an address that changed too: {text}"
        );
    }

    /// A fetch sent just as a check found the link quiet was failed by the session's end.
    /// Now that check only stops new fetches, and the session ends at the next check if it is
    /// quiet still; a fetch that got out in between is waited for.
    #[test]
    fn a_quiet_link_takes_no_new_fetch_for_one_check_before_its_session_ends() {
        let l = link_up(0);
        let t0 = tokio::time::Instant::now();
        assert!(
            l.readdress_due(t0, &eth3()).is_none(),
            "quiet: one check first"
        );
        assert!(
            !l.takes_new_fetches(),
            "no new fetch from the first quiet check"
        );
        // A fetch that got out as the first check looked.
        l.outstanding.fetch_add(1, Ordering::Relaxed);
        let next = t0 + crate::link::stall::CHECK_EVERY;
        assert!(l.readdress_due(next, &eth3()).is_none(), "it is waited for");
        assert!(!l.takes_new_fetches());
        l.outstanding.fetch_sub(1, Ordering::Relaxed);
        let then = next + crate::link::stall::CHECK_EVERY;
        assert!(l.readdress_due(then, &eth3()).is_some(), "quiet still");
    }

    /// Every link sees a NIC's address within one check: before, on a busy node every link
    /// reached the busy limit together and took no fetch at once, starving every stream. Now
    /// link `i` starts [`READDRESS_STAGGER`] x `i` later (by slot: ids grow).
    #[test]
    fn links_start_to_end_their_sessions_for_a_nic_address_one_after_another() {
        assert_eq!(readdress_stagger(0), Duration::ZERO);
        assert_eq!(readdress_stagger(1), READDRESS_STAGGER);
        assert_eq!(readdress_stagger(9), READDRESS_STAGGER);
        let l = link_up(2);
        let t0 = tokio::time::Instant::now();
        let stagger = 2 * READDRESS_STAGGER;
        assert!(l.readdress_due(t0, &eth3()).is_none());
        let second = Duration::from_secs(1);
        assert!(l.readdress_due(t0 + stagger - second, &eth3()).is_none());
        assert!(l.takes_new_fetches(), "quiet, but not its turn yet");
        l.outstanding.fetch_add(1, Ordering::Relaxed);
        let busy_limit = t0 + stagger + READDRESS_BUSY_AFTER;
        assert!(l.readdress_due(busy_limit - second, &eth3()).is_none());
        assert!(l.takes_new_fetches(), "busy, before its own limit");
        assert!(l.readdress_due(busy_limit, &eth3()).is_none());
        assert!(!l.takes_new_fetches(), "busy past its own limit");
        let late = busy_limit + REDIAL_FORCE_GRACE;
        assert!(l.readdress_due(late, &eth3()).is_some(), "past its grace");
    }
}
