//! Which link a fetch goes to. A dataset's *members* are the sources that serve its version
//! (the manifest digest a link's source answered, [`crate::link::served`]) and take new
//! fetches (not draining, not retiring), sorted by name so every node sees the same list. The
//! node's placement over the members ([`super::placement`]) names each shard's source; when
//! that source is down or just failed the shard, the shard goes to the next live member in its
//! rendezvous ranking ([`affinity::pick`]), so only that source's shards move while it is
//! away; one that refused the shard since its last delivery is passed over too while a live
//! member has not ([`Avoid`]). A link whose answer is missing (found while streams run) or
//! from an earlier session is asked for the dataset's manifest in the background, and joins
//! once it answers. A member whose source left the stream's lane out of its session (it could
//! not dial the lane's data address: [`SourceLink::reaches`]) counts as down for that lane's
//! fetches only; a lane no live member reaches waits, and says why ([`unreached`]). A new
//! stream is placed by the same members: not on a lane that no live member of a dataset it
//! reads reaches, while another lane is reached ([`lanes_reached`], [`reserve_reached`]).

use std::net::SocketAddr;
use std::sync::Arc;

use shardwire_protocol::Manifest;

use super::affinity;
use super::placement::Placements;
use crate::admission::{Admission, AdmitError, Reservation};
use crate::link::SourceLink;
use crate::link::served::Serves;
use crate::roster::Roster;

/// One dataset version, as [`members`] and [`choose`] need it.
#[derive(Debug, Clone, Copy)]
pub struct Version<'a> {
    /// Its name on the wire.
    pub dataset: &'a str,
    /// The manifest digest the stream was opened with.
    pub digest: &'a str,
}

/// What routing needs of the node: its sources and the placements shared by its streams.
#[derive(Debug)]
pub struct Routing {
    roster: Arc<Roster>,
    placements: Placements,
}

impl Routing {
    /// Routing over `roster`'s sources.
    pub fn new(roster: Arc<Roster>) -> Arc<Self> {
        Arc::new(Self {
            roster,
            placements: Placements::default(),
        })
    }

    /// The node's sources.
    pub fn roster(&self) -> &Arc<Roster> {
        &self.roster
    }

    /// The placements of the datasets the streams read.
    pub fn placements(&self) -> &Placements {
        &self.placements
    }

    /// [`members`] of `v` over this node's sources.
    pub fn members(&self, v: Version<'_>, next_id: &dyn Fn() -> u64) -> Vec<Arc<SourceLink>> {
        members(&self.roster, v, next_id)
    }

    /// [`placing_members`] of `v`.
    pub fn placing_members(
        &self,
        v: Version<'_>,
        next_id: &dyn Fn() -> u64,
    ) -> Vec<Arc<SourceLink>> {
        placing_members(&self.roster, v, next_id)
    }
}

/// The members of `v` now, sorted by name; links not yet asked about it are asked (request
/// ids from `next_id`).
pub fn members(roster: &Roster, v: Version<'_>, next_id: &dyn Fn() -> u64) -> Vec<Arc<SourceLink>> {
    members_where(roster, v, next_id, SourceLink::takes_new_fetches)
}

/// The members of `v` that streams may be placed by ([`SourceLink::takes_new_streams`]): a
/// link waiting to redial takes no new fetch for a while, but still counts for the lanes it
/// reaches and the lanes it left out.
pub fn placing_members(
    roster: &Roster,
    v: Version<'_>,
    next_id: &dyn Fn() -> u64,
) -> Vec<Arc<SourceLink>> {
    members_where(roster, v, next_id, SourceLink::takes_new_streams)
}

/// The members of `v` for which `takes` holds, sorted by name; links not yet asked about it
/// are asked.
fn members_where(
    roster: &Roster,
    v: Version<'_>,
    next_id: &dyn Fn() -> u64,
    takes: fn(&SourceLink) -> bool,
) -> Vec<Arc<SourceLink>> {
    let mut out: Vec<Arc<SourceLink>> = Vec::new();
    for m in roster.snapshot().iter() {
        let l = &m.link;
        let generation = l.generation();
        let (serves, ask) = l.served.check(v.dataset, v.digest, generation);
        if ask {
            if l.is_up() {
                ask_about(Arc::clone(l), v, next_id());
            } else {
                l.served.gave_up(v.dataset); // asked when it is up
            }
        }
        if serves == Serves::Yes && takes(l) {
            out.push(Arc::clone(l));
        }
    }
    out.sort_by(|a, b| a.addr.cmp(&b.addr));
    out
}

/// Why no source of `roster` can serve `v` again: every one is up and answered, in its
/// current session, with another version or none. `None` while any may yet serve it (one
/// is down, connecting, not asked yet, or serves it).
pub fn unserved(roster: &Roster, v: Version<'_>) -> Option<String> {
    let links = roster.links();
    let mut said = Vec::with_capacity(links.len());
    for l in &links {
        if !l.is_up() {
            return None;
        }
        match l.served.answer(v.dataset, l.generation())? {
            Some(d) if d == v.digest => return None,
            Some(d) => said.push(format!("{} serves version {d}", l.addr)),
            None => said.push(format!("{} does not serve it", l.addr)),
        }
    }
    (!said.is_empty()).then(|| said.join(", "))
}

/// The links a fetch passes over ([`choose`]), by link id.
#[derive(Debug, Clone, Copy, Default)]
pub struct Avoid<'a> {
    /// The link that failed the shard last: passed over while another member is up.
    pub last: Option<usize>,
    /// The links that refused the shard since its last delivery: passed over, with `last`,
    /// while a live member is neither.
    pub refused: &'a [usize],
}

#[cfg(test)]
impl Avoid<'_> {
    /// Passing over `last` only.
    pub fn last(last: usize) -> Self {
        Self {
            last: Some(last),
            refused: &[],
        }
    }
}

/// The link for shard `shard` of `v` among `members` (sorted), for a stream of lane `lane`:
/// the placement's source when it is live (up, and reaching the lane) and not avoided, else
/// the next such live one in the shard's ranking. Avoided are `avoid.last` and
/// `avoid.refused` while a live member is neither; once every live member is one of them,
/// only `avoid.last` while another is live (so a shard that every source refused still moves
/// on from the last one). `sizes` gives the dataset's shard sizes when the
/// placement must be computed.
pub fn choose(
    placements: &Placements,
    v: Version<'_>,
    (members, lane): (&[Arc<SourceLink>], u16),
    (shard, avoid): (u32, Avoid<'_>),
    sizes: impl FnOnce() -> Vec<u64>,
) -> Option<Arc<SourceLink>> {
    let names: Vec<&str> = members.iter().map(|l| l.addr.as_str()).collect();
    let up: Vec<bool> = members
        .iter()
        .map(|l| l.is_up() && l.reaches(lane))
        .collect();
    let last = avoid
        .last
        .and_then(|id| members.iter().position(|l| l.index == id));
    let fresh: Vec<bool> = (0..members.len())
        .map(|i| up[i] && Some(i) != last && !avoid.refused.contains(&members[i].index))
        .collect();
    let live = if fresh.contains(&true) { &fresh } else { &up };
    let placed = placements.owner((v.dataset, v.digest), &names, shard, sizes);
    let i = match placed {
        Some(o) if live[o] && Some(o) != last => Some(o),
        _ => affinity::pick(v.dataset, shard, &names, live, last),
    }?;
    Some(Arc::clone(&members[i]))
}

/// Why no source of `members` (of `v`) serves lane `lane` now: every one that is up left the
/// lane out of its session (could not dial its data address). `None` while one that is up
/// reaches it, or none is up.
pub fn unreached(members: &[Arc<SourceLink>], v: Version<'_>, lane: u16) -> Option<String> {
    let up: Vec<&Arc<SourceLink>> = members.iter().filter(|l| l.is_up()).collect();
    if up.is_empty() || up.iter().any(|l| l.reaches(lane)) {
        return None;
    }
    let said: Vec<String> = up
        .iter()
        .map(
            |l| match l.lanes_left_out().iter().find(|(n, _)| *n == lane) {
                Some((_, addr)) => format!("{} could not dial its data address {addr}", l.addr),
                None => format!("{} left it out", l.addr),
            },
        )
        .collect();
    Some(format!(
        "lane {lane} is reached by no connected source that serves dataset `{}`: {} (each source's last_error in /v1/status says why; check the lane's NIC and the route to its address)",
        v.dataset,
        said.join(", ")
    ))
}

/// A dataset version a new stream reads, by name, and its [`members`]: the sources its
/// fetches may go to, which placement counts ([`lanes_reached`]).
pub type Serving<'a> = (&'a str, Vec<Arc<SourceLink>>);

/// Those of `members` that are up.
fn up_members(members: &[Arc<SourceLink>]) -> Vec<&Arc<SourceLink>> {
    members.iter().filter(|l| l.is_up()).collect()
}

/// Per lane of a node's `lanes`: whether a new stream's fetches there find a source. For each
/// dataset it reads (`serving`) that has a member up, a member that is up reaches the lane
/// (did not leave it out of its session: [`SourceLink::reaches`]); sources that serve none of
/// its datasets, or take no new fetches, do not count. `None` while no member of any is up:
/// nothing tells the lanes apart then, and the stream waits for a source wherever it goes.
pub fn lanes_reached(serving: &[Serving<'_>], lanes: usize) -> Option<Vec<bool>> {
    let mut reached: Option<Vec<bool>> = None;
    for (_, members) in serving {
        let up = up_members(members);
        if up.is_empty() {
            continue; // waits on any lane
        }
        let all = reached.get_or_insert_with(|| vec![true; lanes]);
        for (lane, r) in all.iter_mut().enumerate() {
            *r = *r && up.iter().any(|l| l.reaches(lane as u16));
        }
    }
    reached
}

/// The lanes a stream may go to instead of lane `chosen`, best first: those its sources reach
/// (`reached`, per lane: [`lanes_reached`]), of either memory kind (the open plans the stream
/// again for the kind of the lane it gets), by the most bytes free (`usage`: streams, reserved
/// and pool bytes per lane, as [`Admission::lane_usage`] gives them), then the fewest streams,
/// then the lowest id.
pub fn detour(chosen: usize, reached: &[bool], usage: &[(usize, u64, u64)]) -> Vec<usize> {
    let mut lanes: Vec<usize> = (0..reached.len())
        .filter(|&l| l != chosen && reached[l])
        .collect();
    lanes.sort_by_key(|&l| {
        let (streams, reserved, pool) = usage.get(l).copied().unwrap_or_default();
        (std::cmp::Reverse(pool.saturating_sub(reserved)), streams, l)
    });
    lanes
}

/// Why [`reserve_reached`] set nothing aside.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unplaced {
    /// Admission refused the least loaded lane (draining, no room).
    Refused(AdmitError),
    /// None of the stream's sources that is up reaches `lane`, the least loaded lane; `full`:
    /// the other lanes they reach have no room for the stream (else they reach none).
    Unreached {
        /// The least loaded lane.
        lane: u32,
        /// Other lanes are reached, but full.
        full: bool,
    },
}

/// Sets `bytes` aside for a stream without a device on `adm`'s least loaded lane, unless its
/// sources are up and none reaches that lane (`reached`, per lane: [`lanes_reached`]; `None`:
/// none is up): its fetches would wait for ever. Then on the best lane, of either memory kind,
/// that they reach and that has room ([`detour`]), and with none, [`Unplaced::Unreached`].
pub fn reserve_reached<'a, S>(
    adm: &'a Admission<S>,
    bytes: u64,
    reached: Option<&[bool]>,
) -> Result<Reservation<'a, S>, Unplaced> {
    let first = adm.reserve_least_loaded(bytes).map_err(Unplaced::Refused)?;
    let chosen = first.lane() as usize;
    let Some(reached) = reached.filter(|r| r.get(chosen) == Some(&false)) else {
        return Ok(first);
    };
    let usage: Vec<_> = (0..reached.len())
        .map(|l| adm.lane_usage(l as u32))
        .collect();
    let instead = detour(chosen, reached, &usage);
    for &lane in &instead {
        if let Ok(r) = adm.reserve(lane as u32, bytes) {
            tracing::info!(
                least_loaded = chosen,
                lane,
                "no connected source of the stream's datasets reaches the least loaded lane: the stream goes to a lane one reaches"
            );
            return Ok(r);
        }
    }
    Err(Unplaced::Unreached {
        lane: chosen as u32,
        full: !instead.is_empty(),
    })
}

/// Why a stream cannot go to lane `lane` (data address `addr`): for a dataset it reads
/// (`serving`, as [`lanes_reached`] takes it), every member that is up left the lane out of
/// its session. Names each such dataset and those sources, with the address each could not
/// dial; `detail` says what that means for the stream.
pub fn unreached_lane(
    serving: &[Serving<'_>],
    lane: u16,
    addr: SocketAddr,
    detail: &str,
) -> String {
    let mut said = Vec::new();
    for (dataset, members) in serving {
        let up = up_members(members);
        if up.is_empty() || up.iter().any(|l| l.reaches(lane)) {
            continue;
        }
        let why: Vec<String> = up
            .iter()
            .map(
                |l| match l.lanes_left_out().iter().find(|(n, _)| *n == lane) {
                    Some((_, a)) => format!("{} could not dial {a}", l.addr),
                    None => format!("{} left it out", l.addr),
                },
            )
            .collect();
        said.push(format!("of dataset `{dataset}` ({})", why.join(", ")));
    }
    let said = if said.is_empty() {
        "that serves the stream's datasets".to_owned()
    } else {
        said.join(", nor ")
    };
    format!(
        "lane {lane} (data address {addr}) is reached by no connected source {said}; {detail}. Try again once one does (each source's last_error in /v1/status says why; check the lane's NIC and the route from the source to its address)"
    )
}

/// Asks `link`'s source for `v`'s manifest in the background and records whether it serves
/// that version (nothing is recorded when the link goes down first: it is asked again).
fn ask_about(link: Arc<SourceLink>, v: Version<'_>, req: u64) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        link.served.gave_up(v.dataset);
        return;
    };
    let (dataset, digest) = (v.dataset.to_owned(), v.digest.to_owned());
    rt.spawn(async move {
        let generation = link.generation();
        let answer = link.request_manifest(req, &dataset).await;
        match answer.map(|json| Manifest::from_json(&json)) {
            Ok(Ok(m)) => {
                let same = m.digest == digest;
                if same {
                    tracing::info!(source = %link.addr, %dataset, "source serves the dataset; it takes its share of the shards");
                } else {
                    tracing::warn!(source = %link.addr, %dataset, theirs = %m.digest, ours = %digest, "source serves another version of the dataset; not using it for it");
                }
                link.served.record(&dataset, Some(m.digest), generation);
            }
            Ok(Err(e)) => {
                tracing::warn!(source = %link.addr, %dataset, error = %e, "source's manifest does not parse; not using it for the dataset");
                link.served.record(&dataset, None, generation);
            }
            Err(crate::link::ManifestError::Refused { code, message }) => {
                tracing::info!(source = %link.addr, %dataset, ?code, %message, "source does not serve the dataset");
                link.served.record(&dataset, None, generation);
            }
            Err(e) => {
                tracing::debug!(source = %link.addr, %dataset, error = %e, "no answer about the dataset yet");
                link.served.gave_up(&dataset);
            }
        }
    });
}

#[cfg(test)]
pub(crate) mod tests {
    use std::net::SocketAddr;

    use super::*;
    use crate::link::LinkConfig;

    /// Routing over an empty roster (stream tests that issue through a fake).
    pub(crate) fn routing() -> Arc<Routing> {
        Routing::new(Arc::new(roster(&[]).0))
    }

    /// Routing over live sources at `addrs` that serve `v` (stream tests that issue through
    /// a fake and watch where hints go: the links never connect, so nothing reaches them).
    pub(crate) fn serving(addrs: &[&str], v: Version<'_>) -> Arc<Routing> {
        let (r, links) = roster(addrs);
        for l in &links {
            l.force_up(true);
            l.served.record(v.dataset, Some(v.digest.to_owned()), 0);
        }
        Routing::new(Arc::new(r))
    }

    fn roster(addrs: &[&str]) -> (Roster, Vec<Arc<SourceLink>>) {
        let r = Roster::new(LinkConfig {
            secret: None,
            lanes: vec![shardwire_protocol::wire::LaneAddr {
                data_addr: "127.0.0.1:1".parse().unwrap(),
                flows: 1,
            }],
        });
        let links = addrs
            .iter()
            .map(|a| r.add(a, "config").unwrap().0)
            .collect();
        (r, links)
    }

    const V: Version<'static> = Version {
        dataset: "web",
        digest: "d1",
    };

    /// A stream waited for ever, without a word, once its sources served another version:
    /// it is unserved once every source is up and answered so; not while one may yet serve
    /// it.
    #[test]
    fn unserved_once_every_source_is_up_and_serves_another_version_or_none() {
        let (r, l) = roster(&["10.0.0.2:1", "10.0.0.3:1"]);
        assert_eq!(unserved(&r, V), None, "down: they may come back serving it");
        l[0].force_up(true);
        l[1].force_up(true);
        assert_eq!(unserved(&r, V), None, "not asked yet");
        l[0].served.record("web", Some("d2".into()), 0);
        assert_eq!(unserved(&r, V), None, "one not asked yet");
        l[1].served.record("web", None, 0);
        assert_eq!(
            unserved(&r, V).as_deref(),
            Some("10.0.0.2:1 serves version d2, 10.0.0.3:1 does not serve it")
        );
        l[1].served.record("web", Some("d1".into()), 0);
        assert_eq!(unserved(&r, V), None, "one serves it");
        l[1].force_up(false);
        assert_eq!(unserved(&r, V), None);
        assert_eq!(
            unserved(&roster(&[]).0, V),
            None,
            "no sources: nothing was answered"
        );
    }

    #[test]
    fn members_serve_the_version_and_take_new_fetches_sorted_by_name() {
        let (r, l) = roster(&["10.0.0.3:1", "10.0.0.2:1", "10.0.0.4:1", "10.0.0.5:1"]);
        l[0].served.record("web", Some("d1".into()), 0);
        l[1].served.record("web", Some("d1".into()), 0);
        l[2].served.record("web", Some("d2".into()), 0); // another version
        // l[3] unknown: not a member (it is down, so it is asked once it is up).
        let ids = || 1;
        let m = members(&r, V, &ids);
        let names: Vec<&str> = m.iter().map(|l| l.addr.as_str()).collect();
        assert_eq!(names, ["10.0.0.2:1", "10.0.0.3:1"]);
        l[1].set_draining("test");
        assert_eq!(members(&r, V, &ids).len(), 1);
        l[0].set_retiring(true);
        assert!(members(&r, V, &ids).is_empty());
    }

    #[test]
    fn a_down_or_failed_source_hands_its_shard_to_the_next_in_its_ranking() {
        let (_, l) = roster(&["10.0.0.2:1", "10.0.0.3:1", "10.0.0.4:1"]);
        let p = Placements::default();
        let sizes = || vec![1000u64; 300];
        assert!(
            choose(&p, V, (&l, 0), (0, Avoid::default()), sizes).is_none(),
            "all down"
        );
        for x in &l {
            x.force_up(true);
        }
        let names: Vec<&str> = l.iter().map(|x| x.addr.as_str()).collect();
        let placed = affinity::balance("web", &sizes(), &names);
        let mut moved = 0;
        for shard in 0..300u32 {
            let owner = usize::from(placed[shard as usize]);
            let got = choose(&p, V, (&l, 0), (shard, Avoid::default()), sizes).unwrap();
            assert_eq!(
                got.index, l[owner].index,
                "shard {shard} goes to its placement"
            );
            // Its source failed it: the next in the ranking, never the one that failed.
            let retry =
                choose(&p, V, (&l, 0), (shard, Avoid::last(l[owner].index)), sizes).unwrap();
            assert_ne!(retry.index, l[owner].index);
            // Its source is down: the same next one.
            l[owner].force_up(false);
            let away = choose(&p, V, (&l, 0), (shard, Avoid::default()), sizes).unwrap();
            assert_eq!(away.index, retry.index);
            l[owner].force_up(true);
            let others: Vec<bool> = (0..3).map(|i| i != owner).collect();
            let next = affinity::pick("web", shard, &names, &others, None).unwrap();
            assert_eq!(away.index, l[next].index, "the next in the shard's ranking");
            moved += 1;
        }
        assert_eq!(moved, 300);
    }

    /// A source that could not dial a lane's data address stopped every session, so no lane
    /// got data from it. Now it serves the lanes it reached: a member that left lane 1 out is
    /// passed over for lane 1's fetches only, and a lane no live member reaches says why.
    #[test]
    fn a_member_that_left_a_lane_out_is_passed_over_for_that_lane_only() {
        let (_, l) = roster(&["10.0.0.2:1", "10.0.0.3:1"]);
        for x in &l {
            x.force_up(true);
        }
        let p = Placements::default();
        let sizes = || vec![1000u64; 40];
        let lane_1: SocketAddr = "10.0.1.5:7401".parse().unwrap();
        l[0].force_lane_out(1, lane_1);
        assert_eq!(unreached(&l, V, 1), None, "the other member reaches it");
        let mut on_lane_0 = std::collections::BTreeSet::new();
        for shard in 0..40u32 {
            let on_1 = choose(&p, V, (&l, 1), (shard, Avoid::default()), sizes).unwrap();
            assert_eq!(on_1.index, l[1].index, "shard {shard} of lane 1");
            let on_0 = choose(&p, V, (&l, 0), (shard, Avoid::default()), sizes).unwrap();
            on_lane_0.insert(on_0.index);
        }
        assert_eq!(on_lane_0.len(), 2, "lane 0's shards are spread over both");
        l[1].force_lane_out(1, lane_1);
        assert!(choose(&p, V, (&l, 1), (0, Avoid::default()), sizes).is_none());
        let why = unreached(&l, V, 1).expect("lane 1 is reached by none");
        for says in [
            "lane 1",
            "10.0.0.2:1",
            "10.0.0.3:1",
            "10.0.1.5:7401",
            "`web`",
        ] {
            assert!(why.contains(says), "{says}: {why}");
        }
        assert_eq!(unreached(&l, V, 0), None);
        l[1].force_up(false);
        l[0].force_up(false);
        assert_eq!(unreached(&l, V, 1), None, "none is up: it is not the lane");
    }

    /// A stream without a device went to the least loaded lane even when every connected
    /// source had left that lane out, and its fetches waited for ever. Now it goes to the
    /// least loaded lane, of either memory kind, that a source reaches (a GPU-less lane
    /// reached while the GPU lanes are not: refused before), and is refused when there is none
    /// with room; nothing stays reserved on the lane passed over.
    #[test]
    fn a_stream_goes_to_a_lane_a_connected_source_reaches() {
        let (rs, l) = roster(&["10.0.0.2:1", "10.0.0.3:1"]);
        for x in &l {
            x.served.record("web", Some("d1".into()), 0);
        }
        let ids = || 1;
        let serving = || vec![("web", members(&rs, V, &ids))];
        assert_eq!(
            lanes_reached(&serving(), 3),
            None,
            "none is up: it is not the lanes"
        );
        for x in &l {
            x.force_up(true);
        }
        let lane_0: SocketAddr = "10.0.0.5:7401".parse().unwrap();
        l[0].force_lane_out(0, lane_0);
        assert_eq!(
            lanes_reached(&serving(), 3),
            Some(vec![true; 3]),
            "the other reaches it"
        );
        l[1].force_lane_out(0, lane_0);
        assert_eq!(lanes_reached(&serving(), 3), Some(vec![false, true, true]));
        let why = unreached_lane(&serving(), 0, lane_0, "nor any other lane");
        for says in [
            "lane 0",
            "10.0.0.2:1",
            "10.0.0.3:1",
            "10.0.0.5:7401",
            "`web`",
            "nor any",
        ] {
            assert!(why.contains(says), "{says}: {why}");
        }
        // Lanes 0, 1 and 3 are GPU memory, lane 2 host memory; lane 1 has the least free.
        let adm: Admission<u8> = Admission::new(vec![100; 4]);
        adm.reserve(1, 10).unwrap().commit(1, Arc::new(0));
        assert_eq!(reserve_reached(&adm, 10, None).unwrap().lane(), 0);
        let all = [true; 4];
        assert_eq!(reserve_reached(&adm, 10, Some(&all[..])).unwrap().lane(), 0);
        let reached = [false, true, false, true];
        let r = reserve_reached(&adm, 10, Some(&reached[..])).unwrap();
        assert_eq!(r.lane(), 3, "reached, the most free");
        assert_eq!(
            adm.lane_usage(0),
            (0, 0, 100),
            "lane 0's reservation given back"
        );
        drop(r);
        // Only the host lane is reached: the stream goes there (planned again for it).
        let host_only = [false, false, true, false];
        let r = reserve_reached(&adm, 10, Some(&host_only[..])).unwrap();
        assert_eq!(r.lane(), 2, "a lane of the other memory kind");
        drop(r);
        let got = reserve_reached(&adm, 10, Some(&[false; 4][..])).err();
        assert_eq!(
            got,
            Some(Unplaced::Unreached {
                lane: 0,
                full: false
            })
        );
        adm.reserve(1, 90).unwrap().commit(2, Arc::new(0));
        let lane_1 = [false, true, false, false];
        let got = reserve_reached(&adm, 10, Some(&lane_1[..])).err();
        assert_eq!(
            got,
            Some(Unplaced::Unreached {
                lane: 0,
                full: true
            })
        );
        assert_eq!(adm.lane_usage(0), (0, 0, 100), "nothing left reserved");
        adm.start_draining();
        let got = reserve_reached(&adm, 10, Some(&reached[..])).err();
        assert_eq!(got, Some(Unplaced::Refused(AdmitError::Draining)));
    }

    /// Placement counted every connected source: a lane reached only by a source that does
    /// not serve the stream's dataset (or drains) took the stream, whose fetches then waited.
    /// Now only the stream's members count (those fetch routing chooses from), per dataset of
    /// a mixture, and the refusal names them alone.
    #[test]
    fn placement_counts_only_the_sources_of_the_streams_datasets() {
        let (r, l) = roster(&["10.0.0.2:1", "10.0.0.3:1", "10.0.0.4:1"]);
        let code = Version {
            dataset: "code",
            digest: "d9",
        };
        l[0].served.record("web", Some("d1".into()), 0);
        l[1].served.record("code", Some("d9".into()), 0); // serves only `code`
        l[2].served.record("web", Some("d1".into()), 0);
        l[2].set_draining("test"); // takes no new fetches
        for x in &l {
            x.force_up(true);
        }
        let lane_1: SocketAddr = "10.0.1.5:7401".parse().unwrap();
        l[0].force_lane_out(1, lane_1);
        let ids = || 1;
        let web = vec![("web", members(&r, V, &ids))];
        assert_eq!(
            lanes_reached(&web, 2),
            Some(vec![true, false]),
            "10.0.0.3:1 and 10.0.0.4:1 reach lane 1, but take none of `web`'s fetches"
        );
        let why = unreached_lane(&web, 1, lane_1, "device d is on that lane");
        for says in ["lane 1", "`web`", "10.0.0.2:1 could not dial 10.0.1.5:7401"] {
            assert!(why.contains(says), "{says}: {why}");
        }
        for not in ["10.0.0.3:1", "10.0.0.4:1", "`code`"] {
            assert!(!why.contains(not), "{not}: {why}");
        }
        // A mixture: a lane must be reached for each of its datasets.
        let lane_0: SocketAddr = "10.0.0.5:7401".parse().unwrap();
        l[1].force_lane_out(0, lane_0);
        let mix = vec![web[0].clone(), ("code", members(&r, code, &ids))];
        assert_eq!(lanes_reached(&mix, 2), Some(vec![false, false]));
        let why = unreached_lane(&mix, 0, lane_0, "d");
        assert!(why.contains("`code` (10.0.0.3:1 could not dial"), "{why}");
        assert!(
            !why.contains("`web`"),
            "`web`'s source reaches lane 0: {why}"
        );
        // `web`'s only member is down: nothing tells the lanes apart for it (a source serving
        // another dataset that is up does not make them differ).
        l[0].force_up(false);
        let web = vec![("web", members(&r, V, &ids))];
        assert_eq!(lanes_reached(&web, 2), None);
    }

    /// Only the last refusing source was avoided: a shard that the two best-ranked of three
    /// sources refused went back to the first, never to the third.
    #[test]
    fn a_shard_goes_past_every_source_that_refused_it_while_one_has_not() {
        let (_, l) = roster(&["10.0.0.2:1", "10.0.0.3:1", "10.0.0.4:1"]);
        for x in &l {
            x.force_up(true);
        }
        let p = Placements::default();
        let sizes = || vec![1000u64; 30];
        for shard in 0..30u32 {
            let a = choose(&p, V, (&l, 0), (shard, Avoid::default()), sizes)
                .unwrap()
                .index;
            let b = choose(&p, V, (&l, 0), (shard, Avoid::last(a)), sizes)
                .unwrap()
                .index;
            let refused = [a, b];
            let by_both = Avoid {
                last: Some(b),
                refused: &refused,
            };
            let c = choose(&p, V, (&l, 0), (shard, by_both), sizes)
                .unwrap()
                .index;
            assert!(c != a && c != b, "shard {shard}: the third");
            // The third is down: every live one refused, so only the last is passed over.
            l.iter().find(|x| x.index == c).unwrap().force_up(false);
            let next = choose(&p, V, (&l, 0), (shard, by_both), sizes)
                .unwrap()
                .index;
            assert_eq!(next, a, "shard {shard}: as with the last one avoided");
            l.iter().find(|x| x.index == c).unwrap().force_up(true);
            // A refuser that is not the last failure (another failed it since): both passed
            // over while the third is up.
            let lost = Avoid {
                last: Some(b),
                refused: &refused[..1],
            };
            assert_eq!(
                choose(&p, V, (&l, 0), (shard, lost), sizes).unwrap().index,
                c
            );
        }
    }
}
