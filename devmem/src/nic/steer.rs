//! Flow steering with the legacy ethtool ioctl (`SIOCETHTOOL`): the ntuple feature flag,
//! ntuple rules (by destination port, or one connection's 5-tuple) and the RSS indirection
//! table (what `ethtool -K ntuple on`, `ethtool -N ... action Q` and `ethtool -X equal N` do).
//!
//! Layouts from include/uapi/linux/ethtool.h, checked with `offsetof` on this machine:
//! `struct ethtool_rxnfc` is 192 bytes with `fs` at 16 and `rule_cnt` at 184, `rule_locs[]`
//! following at 188; inside `fs` (168 bytes) `h_u` is at 4, `m_u` at 76, `ring_cookie` at 152 and `location` at 160; in `ethtool_tcpip4_spec`
//! `ip4src` is at 0, `ip4dst` at 4, `psrc` at 8 and `pdst` at 10. `struct ethtool_rxfh_indir`
//! is `{cmd, size, ring_index[size]}`.

use std::net::{Ipv4Addr, SocketAddrV4};

use serde::{Deserialize, Serialize};

use super::{EthtoolClient, NicError};

const ETHTOOL_GFLAGS: u32 = 0x25;
const ETHTOOL_SFLAGS: u32 = 0x26;
const ETH_FLAG_NTUPLE: u32 = 1 << 27;
const ETHTOOL_GRXRINGS: u32 = 0x2d;
const ETHTOOL_GRXCLSRLCNT: u32 = 0x2e;
const ETHTOOL_GRXCLSRULE: u32 = 0x2f;
const ETHTOOL_GRXCLSRLALL: u32 = 0x30;
const ETHTOOL_SRXCLSRLDEL: u32 = 0x31;
const ETHTOOL_SRXCLSRLINS: u32 = 0x32;
const ETHTOOL_GRXFHINDIR: u32 = 0x38;
const ETHTOOL_SRXFHINDIR: u32 = 0x39;
/// Every `SIOCETHTOOL` command this module sends. [`crate::sys::ethtool_ioctl`] refuses one
/// whose struct length it does not know, so the tests in `sys` send each: a new `ETHTOOL_*`
/// command goes here (they check that every one declared in this file is listed), and in
/// [`READS`] if it only reads.
#[cfg(test)]
pub(crate) const SENT: [u32; 10] = [
    ETHTOOL_GFLAGS,
    ETHTOOL_SFLAGS,
    ETHTOOL_GRXRINGS,
    ETHTOOL_GRXCLSRLCNT,
    ETHTOOL_GRXCLSRULE,
    ETHTOOL_GRXCLSRLALL,
    ETHTOOL_SRXCLSRLDEL,
    ETHTOOL_SRXCLSRLINS,
    ETHTOOL_GRXFHINDIR,
    ETHTOOL_SRXFHINDIR,
];
/// The commands of [`SENT`] that only read: the tests send them to `lo` (the writes are
/// not sent, even there).
#[cfg(test)]
pub(crate) const READS: [u32; 6] = [
    ETHTOOL_GFLAGS,
    ETHTOOL_GRXRINGS,
    ETHTOOL_GRXCLSRLCNT,
    ETHTOOL_GRXCLSRULE,
    ETHTOOL_GRXCLSRLALL,
    ETHTOOL_GRXFHINDIR,
];
const TCP_V4_FLOW: u32 = 1;
const RX_CLS_LOC_ANY: u32 = 0xffff_ffff;
/// Set in `ETHTOOL_GRXCLSRLCNT`'s `data` by a driver that picks a rule's location itself.
const RX_CLS_LOC_SPECIAL: u64 = 0x8000_0000;
/// Flags a driver may set in a rule's `flow_type`: `FLOW_EXT`, `FLOW_MAC_EXT`, `FLOW_RSS`.
const FLOW_TYPE_FLAGS: u32 = 0x8000_0000 | 0x4000_0000 | 0x2000_0000;
/// `ETHTOOL_RX_FLOW_SPEC_RING`: the queue's bits of `ring_cookie`.
const FLOW_SPEC_RING: u64 = 0xffff_ffff;
const RXNFC_LEN: usize = 192;
const FS: usize = 16;
/// `rule_cnt` and `rule_locs[]` in `struct ethtool_rxnfc`.
const RULE_CNT: usize = FS + 168;
const RULE_LOCS: usize = RULE_CNT + 4;
/// Most rule locations we accept a driver's table to have (real ones: 128..8192).
const MAX_RULES: u32 = 1 << 16;
/// Most RSS table entries we accept from a driver (real ones have 64..512).
const MAX_INDIR: u32 = 1 << 16;

fn put(buf: &mut [u8], at: usize, v: u32) {
    buf[at..at + 4].copy_from_slice(&v.to_ne_bytes());
}

fn get(buf: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes(buf[at..at + 4].try_into().expect("4 bytes"))
}

/// `struct ethtool_rxnfc`'s `data` (a u64 at 8).
fn rxnfc_data(buf: &[u8]) -> u64 {
    u64::from_ne_bytes(buf[8..16].try_into().expect("8 bytes"))
}

impl EthtoolClient {
    /// The index of interface `ifname` in this client's network namespace.
    pub fn ifindex_of(&self, ifname: &str) -> std::io::Result<u32> {
        crate::sys::ifindex_of(std::os::fd::AsFd::as_fd(&self.ioctl_sock), ifname)
    }

    fn ioctl(&self, ifname: &str, op: &'static str, buf: &mut [u8]) -> Result<(), NicError> {
        crate::sys::ethtool_ioctl(std::os::fd::AsFd::as_fd(&self.ioctl_sock), ifname, buf).map_err(
            |e| match e.raw_os_error() {
                Some(errno) => NicError::Kernel {
                    ifname: ifname.into(),
                    op,
                    errno,
                    errno_name: crate::errno_label(errno),
                    msg: None,
                },
                None => NicError::Netlink {
                    ifname: ifname.into(),
                    op,
                    reason: e.to_string(),
                },
            },
        )
    }

    /// Whether the ntuple feature is on (`ETHTOOL_GFLAGS`).
    pub fn ntuple_enabled(&self, ifname: &str) -> Result<bool, NicError> {
        let mut v = [0u8; 8];
        put(&mut v, 0, ETHTOOL_GFLAGS);
        self.ioctl(ifname, "ntuple-get", &mut v)?;
        Ok(get(&v, 4) & ETH_FLAG_NTUPLE != 0)
    }

    /// Turn the ntuple feature on or off (`ETHTOOL_SFLAGS`, other flags kept).
    pub fn set_ntuple(&self, ifname: &str, on: bool) -> Result<(), NicError> {
        let mut v = [0u8; 8];
        put(&mut v, 0, ETHTOOL_GFLAGS);
        self.ioctl(ifname, "ntuple-set", &mut v)?;
        let flags = get(&v, 4);
        let flags = if on {
            flags | ETH_FLAG_NTUPLE
        } else {
            flags & !ETH_FLAG_NTUPLE
        };
        put(&mut v, 0, ETHTOOL_SFLAGS);
        put(&mut v, 4, flags);
        self.ioctl(ifname, "ntuple-set", &mut v)
    }

    /// Insert a rule steering TCP/IPv4 to `dst_port` onto RX queue `queue`; returns the
    /// rule's location (for [`EthtoolClient::delete_rule`]).
    pub fn insert_tcp4_rule(
        &self,
        ifname: &str,
        dst_port: u16,
        queue: u32,
    ) -> Result<u32, NicError> {
        let at = self.next_rule_location(ifname)?;
        let m = Tcp4Match::port(dst_port);
        self.insert_rule(ifname, "ntuple-rule-insert", &m, queue, at)
    }

    /// Insert a rule steering one TCP/IPv4 connection, by its 5-tuple as its packets arrive
    /// (`flow-type tcp4 src-ip S dst-ip D src-port SP dst-port DP action Q`), onto RX queue
    /// `queue`; returns the rule's location (for [`EthtoolClient::delete_rule`]).
    pub fn insert_tcp4_flow_rule(
        &self,
        ifname: &str,
        flow: Tcp4Flow,
        queue: u32,
    ) -> Result<u32, NicError> {
        let at = self.next_rule_location(ifname)?;
        let m = Tcp4Match::flow(flow);
        self.insert_rule(ifname, "ntuple-flow-rule-insert", &m, queue, at)
    }

    /// Where the next rule goes, as `ethtool -N` chooses it: `None` where the driver picks
    /// the location itself (known only once the rule is in), else the highest free one.
    pub fn next_rule_location(&self, ifname: &str) -> Result<Option<u32>, NicError> {
        let location = self.rule_location(ifname)?;
        Ok((location != RX_CLS_LOC_ANY).then_some(location))
    }

    /// Insert a rule steering what `m` matches onto RX queue `queue`, at `location` (`None`:
    /// where the driver picks, [`EthtoolClient::next_rule_location`]); returns the rule's
    /// location. `op` names the request in errors.
    pub fn insert_rule(
        &self,
        ifname: &str,
        op: &'static str,
        m: &Tcp4Match,
        queue: u32,
        location: Option<u32>,
    ) -> Result<u32, NicError> {
        let mut r = tcp4_rule(m, location.unwrap_or(RX_CLS_LOC_ANY));
        set_queue(&mut r, queue);
        self.ioctl(ifname, op, &mut r)?;
        Ok(get(&r, FS + 160))
    }

    /// The locations of the rules that steer exactly what `m` matches onto `queue`
    /// (`ETHTOOL_GRXCLSRLALL`, then `ETHTOOL_GRXCLSRULE` for each): how an insertion whose
    /// location the driver picked is found again when that location was never recorded.
    pub fn find_rules(
        &self,
        ifname: &str,
        m: &Tcp4Match,
        queue: u32,
    ) -> Result<Vec<u32>, NicError> {
        let (_, used) = self.rule_locations(ifname, true)?;
        let mut want = tcp4_rule(m, 0);
        set_queue(&mut want, queue);
        let mut found = Vec::new();
        for location in used {
            let mut r = [0u8; RXNFC_LEN];
            put(&mut r, 0, ETHTOOL_GRXCLSRULE);
            put(&mut r, FS + 160, location);
            match self.ioctl(ifname, "ntuple-rule-get", &mut r) {
                // Deleted since the listing.
                Err(NicError::Kernel { errno, .. }) if errno == libc::ENOENT => continue,
                res => res?,
            }
            if rule_matches(&r, &want) {
                found.push(location);
            }
        }
        Ok(found)
    }

    /// Whether the rule at `location` steers exactly what `m` matches onto `queue`: `None`
    /// when no rule is there (`ETHTOOL_GRXCLSRULE` answers ENOENT).
    pub fn rule_at_is(
        &self,
        ifname: &str,
        location: u32,
        m: &Tcp4Match,
        queue: u32,
    ) -> Result<Option<bool>, NicError> {
        // Listed first: drivers answer a get of an empty location with ENOENT or EINVAL.
        let (_, used) = self.rule_locations(ifname, true)?;
        if !used.contains(&location) {
            return Ok(None);
        }
        let mut want = tcp4_rule(m, 0);
        set_queue(&mut want, queue);
        let mut r = [0u8; RXNFC_LEN];
        put(&mut r, 0, ETHTOOL_GRXCLSRULE);
        put(&mut r, FS + 160, location);
        match self.ioctl(ifname, "ntuple-rule-get", &mut r) {
            // Deleted since the listing.
            Err(NicError::Kernel { errno, .. }) if errno == libc::ENOENT => Ok(None),
            res => res.map(|()| Some(rule_matches(&r, &want))),
        }
    }

    /// Where a new rule goes, as `ethtool -N` chooses: `RX_CLS_LOC_ANY` where the driver
    /// picks (it sets `RX_CLS_LOC_SPECIAL` in `ETHTOOL_GRXCLSRLCNT`); else the highest free
    /// location of the driver's rule table (`ETHTOOL_GRXCLSRLALL` lists the used ones).
    /// Drivers that do not pick refuse `RX_CLS_LOC_ANY` itself: mlx5 with ENOSPC.
    fn rule_location(&self, ifname: &str) -> Result<u32, NicError> {
        let (size, used) = self.rule_locations(ifname, false)?;
        let Some(size) = size else {
            return Ok(RX_CLS_LOC_ANY);
        };
        free_location(size, &used).ok_or_else(|| NicError::Kernel {
            ifname: ifname.into(),
            op: "ntuple-rule-insert",
            errno: libc::ENOSPC,
            errno_name: crate::errno_label(libc::ENOSPC),
            msg: Some(format!("all {size} rule locations are used")),
        })
    }

    /// `ETHTOOL_GRXCLSRLCNT`: the rule table's size (`None` where the driver picks rule
    /// locations itself) and the number of rules in it.
    fn rule_count(&self, ifname: &str) -> Result<(Option<u32>, u32), NicError> {
        let mut c = [0u8; RXNFC_LEN];
        put(&mut c, 0, ETHTOOL_GRXCLSRLCNT);
        self.ioctl(ifname, "ntuple-rule-count", &mut c)?;
        let bad = |reason: String| NicError::Netlink {
            ifname: ifname.into(),
            op: "ntuple-rule-count",
            reason,
        };
        match rule_table(&c).map_err(&bad)? {
            Some((size, count)) => Ok((Some(size), count)),
            None => match get(&c, RULE_CNT) {
                count if count > MAX_RULES => Err(bad(format!("{count} rules"))),
                count => Ok((None, count)),
            },
        }
    }

    /// The rule table's size ([`EthtoolClient::rule_count`]) and the locations of its rules
    /// (`ETHTOOL_GRXCLSRLALL`); those of a driver that picks locations itself only with
    /// `list_picked` (else none).
    fn rule_locations(
        &self,
        ifname: &str,
        list_picked: bool,
    ) -> Result<(Option<u32>, Vec<u32>), NicError> {
        let mut attempt = 0;
        loop {
            let (size, count) = self.rule_count(ifname)?;
            if count == 0 || (size.is_none() && !list_picked) {
                return Ok((size, Vec::new()));
            }
            let mut all = vec![0u8; RXNFC_LEN + 4 * count as usize];
            put(&mut all, 0, ETHTOOL_GRXCLSRLALL);
            put(&mut all, RULE_CNT, count);
            match self.ioctl(ifname, "ntuple-rule-list", &mut all) {
                // A rule added since the count (ixgbe, i40e): count again, once.
                Err(NicError::Kernel { errno, .. }) if errno == libc::EMSGSIZE && attempt == 0 => {
                    attempt += 1;
                    continue;
                }
                r => r?,
            }
            return Ok((size, listed_locations(&all, count)));
        }
    }

    /// Delete the ntuple rule at `location`.
    pub fn delete_rule(&self, ifname: &str, location: u32) -> Result<(), NicError> {
        let mut r = [0u8; RXNFC_LEN];
        put(&mut r, 0, ETHTOOL_SRXCLSRLDEL);
        put(&mut r, FS + 160, location);
        self.ioctl(ifname, "ntuple-rule-delete", &mut r)
    }

    /// The RX rings RSS spreads over (`ETHTOOL_GRXRINGS`): what the kernel's default
    /// indirection table is made of (`ethtool_rxfh_indir_default`).
    pub fn rx_rings(&self, ifname: &str) -> Result<u32, NicError> {
        let mut c = [0u8; RXNFC_LEN];
        put(&mut c, 0, ETHTOOL_GRXRINGS);
        self.ioctl(ifname, "rx-rings-get", &mut c)?;
        let rings = rxnfc_data(&c);
        u32::try_from(rings).map_err(|_| NicError::Netlink {
            ifname: ifname.into(),
            op: "rx-rings-get",
            reason: format!("{rings} RX rings"),
        })
    }

    /// The RSS indirection table (`ETHTOOL_GRXFHINDIR`): queue per hash bucket.
    pub fn rss_indir(&self, ifname: &str) -> Result<Vec<u32>, NicError> {
        let mut h = [0u8; 8];
        put(&mut h, 0, ETHTOOL_GRXFHINDIR);
        self.ioctl(ifname, "rss-get", &mut h)?;
        let size = get(&h, 4);
        if size == 0 || size > MAX_INDIR {
            return Err(NicError::Netlink {
                ifname: ifname.into(),
                op: "rss-get",
                reason: format!("indirection table of {size} entries"),
            });
        }
        let mut t = vec![0u8; 8 + 4 * size as usize];
        put(&mut t, 0, ETHTOOL_GRXFHINDIR);
        put(&mut t, 4, size);
        self.ioctl(ifname, "rss-get", &mut t)?;
        Ok((0..size as usize).map(|i| get(&t, 8 + 4 * i)).collect())
    }

    /// Set the RSS indirection table (`ETHTOOL_SRXFHINDIR`); an empty table restores the
    /// driver's default spread.
    pub fn set_rss_indir(&self, ifname: &str, table: &[u32]) -> Result<(), NicError> {
        let mut t = vec![0u8; 8 + 4 * table.len()];
        put(&mut t, 0, ETHTOOL_SRXFHINDIR);
        put(&mut t, 4, table.len() as u32);
        for (i, q) in table.iter().enumerate() {
            put(&mut t, 8 + 4 * i, *q);
        }
        self.ioctl(ifname, "rss-set", &mut t)
    }
}

/// One TCP/IPv4 connection as its packets arrive at the NIC: from the peer (`src`) to this
/// host (`dst`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tcp4Flow {
    /// The sender: the remote end of the connection.
    pub src: SocketAddrV4,
    /// The receiver: this end.
    pub dst: SocketAddrV4,
}

/// The fields a TCP/IPv4 ntuple rule matches exactly (`None`: any). Journaled with a rule
/// whose location the driver picks ([`super::Change::PendingRule`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tcp4Match {
    /// Source address (the peer).
    pub src_ip: Option<Ipv4Addr>,
    /// Destination address (this host).
    pub dst_ip: Option<Ipv4Addr>,
    /// Source port.
    pub src_port: Option<u16>,
    /// Destination port.
    pub dst_port: Option<u16>,
}

impl Tcp4Match {
    /// One connection's 5-tuple ([`EthtoolClient::insert_tcp4_flow_rule`]).
    pub fn flow(f: Tcp4Flow) -> Self {
        Self {
            src_ip: Some(*f.src.ip()),
            dst_ip: Some(*f.dst.ip()),
            src_port: Some(f.src.port()),
            dst_port: Some(f.dst.port()),
        }
    }

    /// Every connection to `dst_port` ([`EthtoolClient::insert_tcp4_rule`]).
    pub fn port(dst_port: u16) -> Self {
        Self {
            dst_port: Some(dst_port),
            ..Self::default()
        }
    }
}

/// Offsets in `struct ethtool_tcpip4_spec`: `ip4src`, `ip4dst`, `psrc`, `pdst`.
const IP4_SRC: usize = 0;
const IP4_DST: usize = 4;
const PSRC: usize = 8;
const PDST: usize = 10;
/// `fs.h_u` (the values) and `fs.m_u` (their masks: all ones where matched) in the request.
const H_U: usize = FS + 4;
const M_U: usize = FS + 76;
/// Bytes of `struct ethtool_tcpip4_spec` a rule can match: the addresses, ports and `tos`.
const TCP4_SPEC_LEN: usize = 13;
/// `fs.m_ext` (`struct ethtool_flow_ext` masks: VLAN, user data, destination MAC).
const M_EXT: usize = FS + 128;
const FLOW_EXT_LEN: usize = 20;

/// What an `ETHTOOL_GRXCLSRLCNT` answer says: `None` where the driver picks a rule's
/// location (`RX_CLS_LOC_SPECIAL` in `data`), else the table's size (`data`) and the rules in
/// it (`rule_cnt`); an error for a table this code does not take.
fn rule_table(answer: &[u8]) -> Result<Option<(u32, u32)>, String> {
    let data = rxnfc_data(answer);
    if data & RX_CLS_LOC_SPECIAL != 0 {
        return Ok(None);
    }
    let (size, count) = (data as u32, get(answer, RULE_CNT));
    if size == 0 || size > MAX_RULES || count > size {
        return Err(format!(
            "a rule table of {size} locations holding {count} rules"
        ));
    }
    Ok(Some((size, count)))
}

/// The locations an `ETHTOOL_GRXCLSRLALL` answer lists (`rule_locs`, as many as its
/// `rule_cnt` says, at most the `asked` the buffer holds).
fn listed_locations(answer: &[u8], asked: u32) -> Vec<u32> {
    if asked == 0 {
        return Vec::new();
    }
    let listed = get(answer, RULE_CNT).min(asked) as usize;
    (0..listed)
        .map(|i| get(answer, RULE_LOCS + 4 * i))
        .collect()
}

/// The highest location below `size` not in `used` (rules at higher locations have lower
/// priority: ours go last, as `ethtool -N`'s do); `None` when the table is full.
fn free_location(size: u32, used: &[u32]) -> Option<u32> {
    let used: std::collections::HashSet<u32> = used.iter().copied().collect();
    (0..size).rev().find(|l| !used.contains(l))
}

/// An `ETHTOOL_SRXCLSRLINS` request for `m` (fields big-endian, as on the wire) at
/// `location` ([`EthtoolClient::rule_location`]).
fn tcp4_rule(m: &Tcp4Match, location: u32) -> [u8; RXNFC_LEN] {
    let mut r = [0u8; RXNFC_LEN];
    put(&mut r, 0, ETHTOOL_SRXCLSRLINS);
    put(&mut r, 4, TCP_V4_FLOW);
    put(&mut r, FS, TCP_V4_FLOW);
    let mut field = |at: usize, value: Option<&[u8]>| {
        if let Some(v) = value {
            r[H_U + at..H_U + at + v.len()].copy_from_slice(v);
            r[M_U + at..M_U + at + v.len()].fill(0xff);
        }
    };
    field(
        IP4_SRC,
        m.src_ip.map(|a| a.octets()).as_ref().map(|o| &o[..]),
    );
    field(
        IP4_DST,
        m.dst_ip.map(|a| a.octets()).as_ref().map(|o| &o[..]),
    );
    field(
        PSRC,
        m.src_port.map(u16::to_be_bytes).as_ref().map(|o| &o[..]),
    );
    field(
        PDST,
        m.dst_port.map(u16::to_be_bytes).as_ref().map(|o| &o[..]),
    );
    put(&mut r, FS + 160, location);
    r
}

/// The rule's action: deliver to RX queue `queue` (`fs.ring_cookie`).
fn set_queue(r: &mut [u8; RXNFC_LEN], queue: u32) {
    r[FS + 152..FS + 160].copy_from_slice(&u64::from(queue).to_ne_bytes());
}

/// Whether `got` (an `ETHTOOL_GRXCLSRULE` answer) is the rule `want` (a [`tcp4_rule`] with
/// its queue set): a TCP/IPv4 rule (the driver's `FLOW_*` flags aside) matching the same
/// fields (masks) with the same values under them, no extension fields, the same queue.
fn rule_matches(got: &[u8; RXNFC_LEN], want: &[u8; RXNFC_LEN]) -> bool {
    if get(got, FS) & !FLOW_TYPE_FLAGS != get(want, FS) {
        return false;
    }
    let same_fields = (0..TCP4_SPEC_LEN).all(|i| {
        let (mask, want_mask) = (got[M_U + i], want[M_U + i]);
        mask == want_mask && got[H_U + i] & mask == want[H_U + i] & mask
    });
    let no_ext = got[M_EXT..M_EXT + FLOW_EXT_LEN].iter().all(|&b| b == 0);
    let ring = |r: &[u8; RXNFC_LEN]| {
        u64::from_ne_bytes(r[FS + 152..FS + 160].try_into().expect("8 bytes")) & FLOW_SPEC_RING
    };
    same_fields && no_ext && ring(got) == ring(want)
}

/// `ethtool -X equal n`: `entries` buckets spread over queues `0..n`.
pub fn equal_table(entries: usize, n: u32) -> Vec<u32> {
    (0..entries).map(|i| i as u32 % n.max(1)).collect()
}

/// RSS table `old` kept off queues `below..` (what [`super::Journal::steer`] sets): its
/// entries below are kept, and those at or above are moved, in turn (counted over the moved
/// entries alone, not by table index), onto the queues below that `old` already uses (onto
/// `0..below` where it uses none), so each of those queues gets an even share of them. Not
/// `ethtool -X equal below` as such: the kept entries stay where they are. `None` when no
/// entry is at or above `below`: the table keeps off those queues already (an operator's
/// narrower table, which leaves queues between for another user, is never widened).
pub fn narrowed_table(old: &[u32], below: std::num::NonZeroU32) -> Option<Vec<u32>> {
    let below = below.get();
    if old.iter().all(|&q| q < below) {
        return None;
    }
    let mut kept: Vec<u32> = old.iter().copied().filter(|&q| q < below).collect();
    kept.sort_unstable();
    kept.dedup();
    if kept.is_empty() {
        kept = (0..below).collect();
    }
    let mut k = 0;
    let mut moved = |q: u32| {
        if q < below {
            return q;
        }
        let to = kept[k % kept.len()];
        k += 1;
        to
    };
    Some(old.iter().map(|&q| moved(q)).collect())
}

/// What undoing a change of RSS table `old` sets, on a NIC with `rx_queues` RX rings
/// (`ETHTOOL_GRXRINGS`): an empty table (the driver's default, `ethtool -X IFACE default`)
/// where `old` is the default spread over them (`i % rx_queues`,
/// ethtool_rxfh_indir_default), else `old`. (A table the user set equal to the default is
/// restored as the default: the same spread, no longer marked user-set.)
/// Setting the default's entries instead would mark the table user-set, and the kernel then
/// refuses to lower the channel count below its highest queue (the undo lowers it next).
pub fn table_to_restore(old: Vec<u32>, rx_queues: u32) -> Vec<u32> {
    if rx_queues > 0 && old == equal_table(old.len(), rx_queues) {
        Vec::new()
    } else {
        old
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flow_rule_matches_all_four_fields_big_endian() {
        let flow = Tcp4Flow {
            src: "10.1.2.3:40000".parse().unwrap(),
            dst: "10.9.8.7:7401".parse().unwrap(),
        };
        let mut r = tcp4_rule(&Tcp4Match::flow(flow), 1021);
        set_queue(&mut r, 12);
        assert_eq!(get(&r, 0), ETHTOOL_SRXCLSRLINS);
        assert_eq!(get(&r, FS), TCP_V4_FLOW);
        assert_eq!(
            &r[H_U..H_U + 12],
            &[10, 1, 2, 3, 10, 9, 8, 7, 0x9c, 0x40, 0x1c, 0xe9]
        );
        assert_eq!(&r[M_U..M_U + 12], &[0xff; 12]);
        // tos and its mask stay 0 (not matched).
        assert_eq!((r[H_U + 12], r[M_U + 12]), (0, 0));
        assert_eq!(
            u64::from_ne_bytes(r[FS + 152..FS + 160].try_into().unwrap()),
            12
        );
        assert_eq!(get(&r, FS + 160), 1021);
    }

    #[test]
    fn a_rule_goes_to_the_highest_free_location_as_ethtool_puts_it() {
        // Before, every rule asked for RX_CLS_LOC_ANY, which mlx5 refuses (ENOSPC: it has
        // no location > 1023) as every driver that does not pick locations itself does.
        assert_eq!(free_location(1024, &[]), Some(1023));
        assert_eq!(free_location(1024, &[1023, 1022, 5]), Some(1021));
        assert_eq!(free_location(4, &[0, 1, 3]), Some(2));
        assert_eq!(free_location(3, &[0, 1, 2]), None, "full");
        assert_eq!(
            free_location(2, &[7, 1]),
            Some(0),
            "a location past the table is ignored"
        );
    }

    #[test]
    fn a_port_rule_matches_the_destination_port_only() {
        let r = tcp4_rule(
            &Tcp4Match {
                dst_port: Some(7401),
                ..Tcp4Match::default()
            },
            RX_CLS_LOC_ANY,
        );
        assert_eq!(
            &r[H_U..H_U + 12],
            &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x1c, 0xe9]
        );
        assert_eq!(
            &r[M_U..M_U + 12],
            &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]
        );
    }

    #[test]
    fn the_rule_count_and_list_answers_are_read_at_their_offsets() {
        let mut count = [0u8; RXNFC_LEN];
        count[8..16].copy_from_slice(&1024u64.to_ne_bytes());
        put(&mut count, RULE_CNT, 2);
        assert_eq!(rule_table(&count), Ok(Some((1024, 2))));
        count[8..16].copy_from_slice(&(RX_CLS_LOC_SPECIAL | 2048).to_ne_bytes());
        assert_eq!(rule_table(&count), Ok(None), "the driver picks");
        count[8..16].copy_from_slice(&4u64.to_ne_bytes());
        put(&mut count, RULE_CNT, 5);
        assert!(
            rule_table(&count)
                .unwrap_err()
                .contains("4 locations holding 5")
        );
        let mut list = vec![0u8; RXNFC_LEN + 8];
        put(&mut list, RULE_CNT, 2);
        put(&mut list, RULE_LOCS, 1023);
        put(&mut list, RULE_LOCS + 4, 7);
        assert_eq!(listed_locations(&list, 2), [1023, 7]);
        put(&mut list, RULE_CNT, 9);
        assert_eq!(
            listed_locations(&list, 2),
            [1023, 7],
            "no more than the buffer holds"
        );
        assert_eq!(free_location(1024, &listed_locations(&list, 2)), Some(1022));
    }

    #[test]
    fn a_default_table_is_restored_as_the_default_not_as_its_entries() {
        assert_eq!(table_to_restore(equal_table(8, 4), 4), Vec::<u32>::new());
        // `ethtool -X equal 2` on 4 queues is the user's table: kept.
        assert_eq!(table_to_restore(equal_table(8, 2), 4), equal_table(8, 2));
        assert_eq!(table_to_restore(vec![3, 3, 0, 1], 4), vec![3, 3, 0, 1]);
    }

    #[test]
    fn a_listed_rule_is_recognised_by_its_match_and_queue() {
        // What finds a rule the driver placed when only its match was journaled.
        let flow = Tcp4Flow {
            src: "10.1.2.3:40000".parse().unwrap(),
            dst: "10.9.8.7:7401".parse().unwrap(),
        };
        let m = Tcp4Match::flow(flow);
        let mut want = tcp4_rule(&m, 0);
        set_queue(&mut want, 3);
        let mut got = tcp4_rule(&m, 1021);
        set_queue(&mut got, 3);
        put(&mut got, 0, ETHTOOL_GRXCLSRULE);
        assert!(rule_matches(&got, &want));
        put(&mut got, FS, TCP_V4_FLOW | 0x8000_0000);
        got[H_U + 12] = 0x10; // tos, under a zero mask: not matched, so ignored
        assert!(
            rule_matches(&got, &want),
            "FLOW_EXT without extension masks"
        );
        let mut other = got;
        set_queue(&mut other, 4);
        assert!(!rule_matches(&other, &want), "another queue");
        let mut other = got;
        other[H_U + PSRC + 1] ^= 1;
        assert!(!rule_matches(&other, &want), "another source port");
        let mut other = got;
        other[M_EXT + 10] = 0xff;
        assert!(!rule_matches(&other, &want), "a VLAN match too");
        let mut port = tcp4_rule(&Tcp4Match::port(7401), 5);
        set_queue(&mut port, 3);
        assert!(
            !rule_matches(&port, &want),
            "a port rule is not the 5-tuple rule"
        );
        let mut port_want = tcp4_rule(&Tcp4Match::port(7401), 0);
        set_queue(&mut port_want, 3);
        assert!(rule_matches(&port, &port_want));
    }

    #[test]
    fn rss_is_only_narrowed_never_widened() {
        let below = |n| std::num::NonZeroU32::new(n).unwrap();
        // The default table of a 16-queue NIC, queues 8..15 bound: `equal 8`, as before.
        assert_eq!(
            narrowed_table(&equal_table(128, 16), below(8)),
            Some(equal_table(128, 8))
        );
        // An operator's `equal 2` (queues 2..7 kept for another user): left as it is.
        // Before, it became `equal 8`, sending flows onto queues 2..7.
        assert_eq!(narrowed_table(&equal_table(128, 2), below(8)), None);
        // Entries below stay where they are; those above go to the queues the table uses.
        assert_eq!(
            narrowed_table(&[0, 1, 12, 13, 1, 0, 12, 13], below(8)),
            Some(vec![0, 1, 0, 1, 1, 0, 0, 1])
        );
        // A table over the bound queues only: spread below them.
        assert_eq!(
            narrowed_table(&[8, 9, 8, 9, 8], below(4)),
            Some(vec![0, 1, 2, 3, 0])
        );
        // Moved entries all at odd indices share the kept queues evenly. Before (by table
        // index) every one went to queue 1: [0, 1, 1, 1, 0, 1, 1, 1], 6 of 8 flows there.
        assert_eq!(
            narrowed_table(&[0, 9, 1, 9, 0, 9, 1, 9], below(8)),
            Some(vec![0, 0, 1, 1, 0, 0, 1, 1])
        );
    }

    #[test]
    fn equal_spreads_round_robin() {
        assert_eq!(equal_table(6, 4), [0, 1, 2, 3, 0, 1]);
        assert_eq!(equal_table(3, 0), [0, 0, 0]);
    }
}
