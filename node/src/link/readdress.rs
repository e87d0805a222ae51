//! Lanes whose NIC gets its IPv4 address after the node started. A lane planned on a
//! wildcard because its NIC had no address then (`LaneSpec::awaits_nic_address`: a NIC still
//! training at boot, which systemd-networkd addresses only once it has carrier) is advertised
//! at the control connection's address meanwhile, so its traffic enters through whichever NIC
//! holds that. Every session looks the NIC's address up again
//! ([`super::DataConns::lane_ips`]) and advertises the lane there once it has one
//! ([`super::session::advertised`]); a session that began before ends at a moment with
//! nothing under way ([`SourceLink::readdress_due`]), so that the next one does. As for a
//! redial, from [`READDRESS_BUSY_AFTER`] on the link takes no new fetch so that such a moment
//! comes, and [`REDIAL_FORCE_GRACE`] later the session ends anyway.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::time::Duration;

use shardwire_protocol::wire::LaneAddr;

use super::{Kick, REDIAL_FORCE_GRACE, SourceLink};

/// How long a session due to move lanes to their NICs' addresses waits for a moment with
/// nothing under way on the link before the link takes no new fetch, so that one comes.
pub const READDRESS_BUSY_AFTER: Duration = Duration::from_secs(60);

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
    /// At a moment with nothing under way on the link (ending the session would fail it);
    /// from [`READDRESS_BUSY_AFTER`] after such an address was first seen on, the link takes
    /// no new fetch so that the moment comes, and from [`REDIAL_FORCE_GRACE`] after that the
    /// session ends anyway. Never for a draining source: it takes no new session.
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
        if self.busy() {
            let limit = READDRESS_BUSY_AFTER;
            if waited >= limit && !self.readdress_waiting.swap(true, Ordering::AcqRel) {
                tracing::info!(source = %self.addr, ?moved,
                    "lanes are due to move to their NICs' addresses: no new fetch goes to the source until the ones under way end");
            }
            if waited < limit.saturating_add(REDIAL_FORCE_GRACE) {
                return None;
            }
            tracing::warn!(source = %self.addr, ?moved, ?waited,
                "the session is still busy past its limit to move lanes to their NICs' addresses: ending it anyway, what is under way fails and is retried");
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

    /// A link of [`cfg`]'s lanes with a session up, advertised over a control connection
    /// from 10.0.0.5 while lane 1's NIC has no address.
    fn link_up() -> Arc<SourceLink> {
        let l = SourceLink::new(
            0,
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
        let l = link_up();
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
        l.outstanding.fetch_sub(1, Ordering::Relaxed);
        assert_eq!(
            l.readdress_due(t1, &eth3()),
            Some(want.clone()),
            "nothing out"
        );
        l.set_draining("test: draining");
        assert!(l.readdress_due(late, &eth3()).is_none(), "draining");
        assert!(want.to_string().contains("lanes [1]"), "{want}");
    }
}
