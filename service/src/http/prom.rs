//! The node's Prometheus exposition: the recorder, every family's `# HELP`, every documented
//! series registered at 0 when the node starts, periodic upkeep, and a render whose family and
//! series order is the same on every scrape (the exporter keeps them in hash maps).
//!
//! Hot-path counters live in atomics in the node and are copied from its [`Status`] into the
//! recorder on each scrape, as what each grew by since the last one (`Totals`); only the
//! latency histograms are recorded as they happen, and [`upkeep`] folds their samples into
//! buckets every few seconds so that memory stays flat whether or not anyone scrapes. The
//! per-source families are rendered here from the live sources, not kept in the recorder,
//! which never forgets a series (a `dns:` source tier brings new addresses with each rollout).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use metrics::{describe_counter, describe_gauge, describe_histogram};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use shardwire_node::{
    BindingStatus, COUNTERS, CounterDef, Label, Node, SourceStatus, Status, Unit,
};

/// How often histogram samples are folded into their buckets.
pub const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

/// The process-wide Prometheus recorder (installed, and every family described, on first use).
pub fn handle() -> &'static PrometheusHandle {
    static H: OnceLock<PrometheusHandle> = OnceLock::new();
    H.get_or_init(|| {
        // Latency buckets from 10 us (trainer hand-off) to 10 s (a slow fetch).
        let latency = [
            0.000_01, 0.000_02, 0.000_05, 0.000_1, 0.000_2, 0.000_5, 0.001, 0.002, 0.005, 0.01,
            0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
        ];
        let h = PrometheusBuilder::new()
            .set_buckets(&latency)
            .expect("non-empty buckets")
            .install_recorder()
            .expect("no other metrics recorder is installed");
        describe();
        h
    })
}

/// Folds histogram samples into buckets every [`UPKEEP_INTERVAL`] until the runtime stops.
pub async fn upkeep() {
    let mut tick = tokio::time::interval(UPKEEP_INTERVAL);
    loop {
        tick.tick().await;
        handle().run_upkeep();
    }
}

/// One line of help per family that is not one of the node's counters ([`COUNTERS`], which
/// carry their own): (kind, name, help).
const FAMILIES: &[(&str, &str, &str)] = &[
    (
        "counter",
        "shardwire_fetches_cancelled_total",
        "Fetches of closed streams that sources dropped before sending them",
    ),
    (
        "counter",
        "shardwire_source_bytes_received_total",
        "Payload bytes received from each source",
    ),
    (
        "counter",
        "shardwire_admin_auth_fails_total",
        "Mutating admin requests refused, by reason (missing or wrong token)",
    ),
    (
        "counter",
        "shardwire_http_timeouts_total",
        "HTTP connections or requests ended by a timeout, by phase (header: a request head began but did not finish within the header timeout, which runs from the connection's start or its last answer; idle: a connection sent nothing within the header timeout since its last answer, such as a kept-alive one between requests, or only a head's start pipelined before that answer; body: a request body did not arrive in time; write: the client read nothing of its answer for the write timeout; download: it read a tensor download, or a backed-up answer, under the minimum rate)",
    ),
    (
        "counter",
        "shardwire_trainer_timeouts_total",
        "Trainer socket connections closed by a timeout, by phase (request: no attach or an unfinished frame; idle: an attached trainer sent nothing; write: a trainer that stopped reading its answers)",
    ),
    (
        "counter",
        "shardwire_trainer_refused_total",
        "Trainer socket connections refused, by reason (connections: over trainer_max_connections; peer: uid/gid not allowed)",
    ),
    (
        "counter",
        "shardwire_devmem_frags_total",
        "Devmem frags received (devmem and devmem-sim)",
    ),
    (
        "counter",
        "shardwire_devmem_bytes_total",
        "Payload bytes received into the RX dma-buf",
    ),
    (
        "counter",
        "shardwire_devmem_tokens_returned_total",
        "Frag tokens given back to the kernel with SO_DEVMEM_DONTNEED",
    ),
    (
        "counter",
        "shardwire_devmem_host_bytes_total",
        "Bytes a devmem socket delivered in host memory, by kind (linear: headers and small payloads; plain: before the binding)",
    ),
    (
        "counter",
        "shardwire_devmem_pool_exhausted_total",
        "Times a devmem receiver waited for free net_iovs",
    ),
    (
        "counter",
        "shardwire_devmem_steering_errors_total",
        "Receives whose frags named another lane's binding (a flow steered to another NIC's queue): tokens returned, payload fetched again, never delivered",
    ),
    (
        "gauge",
        "shardwire_devmem_flow_rules",
        "Per-connection ntuple steering rules installed now on each lane's NIC (receive = devmem: one per open data connection)",
    ),
    (
        "counter",
        "shardwire_devmem_flow_rule_failures_total",
        "Data connections failed because the lane's NIC refused their ntuple steering rule (the NIC's reason is logged)",
    ),
    (
        "counter",
        "shardwire_lane_bytes_received_total",
        "Payload bytes received on each lane's data connections",
    ),
    (
        "counter",
        "shardwire_lane_data_connections_total",
        "Data connections identified on each lane's data address",
    ),
    (
        "counter",
        "shardwire_lane_data_connections_refused_total",
        "Data connections refused because they arrived on another address than their lane's (another NIC), by lane",
    ),
    (
        "counter",
        "shardwire_lane_data_connections_on_nic_total",
        "Data connections dialled at each lane's NIC address that came in on that NIC",
    ),
    (
        "counter",
        "shardwire_lane_data_connections_wrong_nic_total",
        "Data connections dialled at each lane's NIC address that came in on another NIC (received all the same)",
    ),
    (
        "counter",
        "shardwire_lane_data_connections_nic_unknown_total",
        "Data connections dialled at each lane's NIC address whose incoming NIC could not be told (the reason is logged once per lane)",
    ),
    (
        "gauge",
        "shardwire_lane_streams",
        "Open streams on each lane",
    ),
    (
        "gauge",
        "shardwire_lane_pool_bytes_reserved",
        "Bytes of each lane's pool (pool_size) reserved by its open streams",
    ),
    (
        "gauge",
        "shardwire_source_up",
        "1 while the control connection to the source is up and authenticated",
    ),
    (
        "gauge",
        "shardwire_pool_bytes_used",
        "Bytes of stream regions holding shards (fetched ahead or leased)",
    ),
    (
        "gauge",
        "shardwire_pool_bytes_free",
        "Bytes of stream regions free",
    ),
    (
        "gauge",
        "shardwire_pool_bytes_reserved",
        "Bytes of pool_size reserved by open streams",
    ),
    (
        "gauge",
        "shardwire_leases_outstanding",
        "Batches leased to trainers and not yet released",
    ),
    ("gauge", "shardwire_streams_open", "Open streams"),
    (
        "gauge",
        "shardwire_devmem_niovs",
        "net_iovs of the RX binding, by state (free, in_use)",
    ),
    (
        "histogram",
        "shardwire_fetch_duration_seconds",
        "Time from FETCH to a verified shard",
    ),
    (
        "histogram",
        "shardwire_trainer_next_duration_seconds",
        "Time a trainer's next took in the node, by API (socket, http)",
    ),
];

fn describe() {
    for d in COUNTERS.iter().filter(|d| d.unit == Unit::Count) {
        describe_counter!(d.metric, d.help);
    }
    for &(kind, name, help) in FAMILIES {
        match kind {
            "counter" => describe_counter!(name, help),
            "gauge" => describe_gauge!(name, help),
            _ => describe_histogram!(name, help),
        }
    }
}

/// Registers every documented series at 0, so a scrape shows each family from the start
/// (labels: the receive mode, the lanes `0..lanes`). The per-source families ([`PER_SOURCE`])
/// are not in the recorder: each scrape renders every source of the node's roster.
pub fn register_zero(mode: &str, lanes: u32) {
    for d in COUNTERS.iter().filter(|d| d.unit == Unit::Count) {
        counter_of(d, mode).absolute(0);
    }
    for &(kind, name, _) in FAMILIES {
        match (kind, name) {
            (_, name) if PER_SOURCE.contains(&name) => {}
            (kind, _) if name.starts_with("shardwire_lane_") => {
                for lane in 0..lanes {
                    let l = [("lane", lane.to_string())];
                    match kind {
                        "counter" => metrics::counter!(name, &l).absolute(0),
                        _ => metrics::gauge!(name, &l).set(0.0),
                    }
                }
            }
            ("counter", _) => {
                for labels in labels_of(name) {
                    metrics::counter!(name, &labels).absolute(0);
                }
            }
            ("gauge", _) => {
                for labels in labels_of(name) {
                    metrics::gauge!(name, &labels).set(0.0);
                }
            }
            (_, "shardwire_trainer_next_duration_seconds") => {
                for api in ["socket", "http"] {
                    let _ = metrics::histogram!(name, "api" => api);
                }
            }
            _ => {
                let _ = metrics::histogram!(name);
            }
        }
    }
}

/// The fixed label sets of a family (one empty set for families without labels).
fn labels_of(name: &str) -> Vec<Vec<(&'static str, &'static str)>> {
    let one = |key: &'static str, values: &[&'static str]| -> Vec<Vec<(&str, &str)>> {
        values.iter().map(|v| vec![(key, *v)]).collect()
    };
    match name {
        "shardwire_admin_auth_fails_total" => one("reason", &["missing", "wrong"]),
        "shardwire_http_timeouts_total" => {
            one("phase", &["header", "idle", "body", "write", "download"])
        }
        "shardwire_trainer_timeouts_total" => one("phase", &["request", "idle", "write"]),
        "shardwire_trainer_refused_total" => one("reason", &["connections", "peer"]),
        // Per lane: a series appears with its lane's binding.
        n if n.starts_with(DEVMEM) => vec![],
        _ => vec![vec![]],
    }
}

/// What each of the node's counter figures grew by between scrapes. The recorder's counters
/// add these up, so a series never goes down and never stops: its figure may start again
/// from 0 (a source's new link, a lane's new binding) or leave a sum (a retired source's
/// cancels), where the recorder's `absolute` would keep the old maximum until the figure
/// passed it; and a `mode` counter gives the bytes that came in since the last scrape to the
/// receive mode in effect at this one (a switch of mode between two scrapes puts them all
/// under the new mode).
#[derive(Debug, Default)]
struct Totals {
    /// Per series: who its figure belongs to (a binding id; 0 where the figure lives as long
    /// as its series), and the figure's value at the last scrape.
    last: BTreeMap<String, (u64, u64)>,
    /// The series this scrape has seen so far.
    seen: BTreeSet<String>,
    /// The per-source series of the sources of the last scrape, by address.
    sources: BTreeMap<String, SourceSeries>,
}

/// One source's series ([`PER_SOURCE`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct SourceSeries {
    /// `shardwire_source_bytes_received_total`: what its links' figures grew by, added up
    /// while it stays in the roster (one that a scrape saw gone counts from 0 when it comes
    /// back; one gone and back between two scrapes goes on from its sum).
    bytes: u64,
    /// `shardwire_source_up`.
    up: bool,
}

impl Totals {
    /// How much a series' figure grew since the last scrape: the difference, or the whole
    /// figure where it is new, has another owner, or went down (it started again from 0).
    fn growth(&mut self, series: String, owner: u64, now: u64) -> u64 {
        let before = self.last.insert(series.clone(), (owner, now));
        self.seen.insert(series);
        match before {
            Some((was, last)) if was == owner && now >= last => now - last,
            _ => now,
        }
    }

    /// Forgets the series this scrape did not see: their figure is gone (a source that left,
    /// a lane unbound), and one that comes back counts from 0.
    fn end_scrape(&mut self) {
        let seen = std::mem::take(&mut self.seen);
        self.last.retain(|series, _| seen.contains(series));
    }
}

/// The figures of the last scrape. Held across the node's snapshot and its recording, so an
/// older snapshot is never compared with a newer one (it would read as a restart).
static TOTALS: Mutex<Totals> = Mutex::new(Totals {
    last: BTreeMap::new(),
    seen: BTreeSet::new(),
    sources: BTreeMap::new(),
});

/// Copies the node's figures into the recorder and renders the exposition text.
pub fn render(node: &Node) -> String {
    let (st, per_source) = {
        let mut totals = TOTALS.lock().unwrap_or_else(|p| p.into_inner());
        let st = node.status();
        record(&st, &mut totals);
        totals.end_scrape();
        (st, per_source_blocks(&totals.sources))
    };
    let seconds: Vec<(&CounterDef, f64)> = st
        .counters
        .values()
        .into_iter()
        .filter(|(d, _)| d.unit == Unit::Seconds)
        .collect();
    let bound = Bound::of(st.lanes.iter().filter_map(|l| l.binding.as_ref()));
    render_text(&seconds, &bound, per_source)
}

/// The recorder's series of one of the node's integer counters (a `mode` counter's: the one
/// of the receive mode `mode`).
fn counter_of(d: &CounterDef, mode: &str) -> metrics::Counter {
    match d.label {
        Label::None => metrics::counter!(d.metric),
        Label::Mode => metrics::counter!(d.metric, "mode" => mode.to_owned()),
        Label::Fixed(k, value) => metrics::counter!(d.metric, k => value),
    }
}

/// Adds what one of the node's integer counters grew by since the last scrape to its series;
/// a `mode` counter's growth goes to the mode in effect now (`mode`), so that bytes received
/// before a binding changed the mode stay with the mode they came in under.
fn record_counter(totals: &mut Totals, d: &CounterDef, mode: &str, v: u64) {
    let grew = totals.growth(d.status.to_owned(), 0, v);
    counter_of(d, mode).increment(grew);
}

/// Sets every counter and gauge from the status.
fn record(st: &Status, totals: &mut Totals) {
    for (d, v) in st.counters.values() {
        if d.unit == Unit::Count {
            record_counter(totals, d, &st.mode.receive, v as u64);
        }
    }
    record_sources(&st.sources, totals);
    // The node keeps these per lane for its whole life (an ended connection's bytes move to
    // the lane's total), so they never start again: the recorder keeps their maximum.
    for l in &st.lanes {
        let labels = [("lane", l.lane.to_string())];
        metrics::counter!("shardwire_lane_bytes_received_total", &labels)
            .absolute(l.bytes_received);
        metrics::counter!("shardwire_lane_data_connections_total", &labels)
            .absolute(l.data_connections);
        metrics::counter!("shardwire_lane_data_connections_refused_total", &labels)
            .absolute(l.data_connections_refused);
        metrics::counter!("shardwire_lane_data_connections_on_nic_total", &labels)
            .absolute(l.data_connections_on_nic);
        metrics::counter!("shardwire_lane_data_connections_wrong_nic_total", &labels)
            .absolute(l.data_connections_wrong_nic);
        metrics::counter!("shardwire_lane_data_connections_nic_unknown_total", &labels)
            .absolute(l.data_connections_nic_unknown);
        metrics::gauge!("shardwire_lane_streams", &labels).set(l.streams as f64);
        metrics::gauge!("shardwire_lane_pool_bytes_reserved", &labels).set(l.pool_reserved as f64);
    }
    let used: usize = st.streams.iter().map(|s| s.region_used).sum();
    let cap: usize = st.streams.iter().map(|s| s.region_bytes).sum();
    let leases: usize = st.streams.iter().map(|s| s.leased).sum();
    metrics::gauge!("shardwire_pool_bytes_used").set(used as f64);
    metrics::gauge!("shardwire_pool_bytes_free").set((cap - used) as f64);
    metrics::gauge!("shardwire_pool_bytes_reserved").set(st.pool.reserved as f64);
    metrics::gauge!("shardwire_leases_outstanding").set(leases as f64);
    metrics::gauge!("shardwire_streams_open").set(st.streams.len() as f64);
    for d in st.lanes.iter().filter_map(|l| l.binding.as_ref()) {
        record_binding(totals, d);
    }
}

/// Each source's figures. A link's counters start at 0 (a source that left DNS and came back
/// has a new link), and `shardwire_fetches_cancelled_total` adds up every source's growth,
/// not their sum now: a retired source's cancels leaving that sum take nothing back.
fn record_sources(sources: &[SourceStatus], totals: &mut Totals) {
    let mut cancelled = 0;
    let mut live = BTreeMap::new();
    for s in sources {
        // Owned by the link: one that replaced another of its address between two scrapes
        // counts from 0, even when it has passed the old one's figures.
        let link = s.link as u64;
        cancelled += totals.growth(format!("cancelled {}", s.addr), link, s.cancelled);
        let grew = totals.growth(format!("bytes {}", s.addr), link, s.bytes_received);
        let before = totals.sources.get(&s.addr).map_or(0, |x| x.bytes);
        let series = SourceSeries {
            bytes: before + grew,
            up: s.up,
        };
        live.insert(s.addr.clone(), series);
    }
    // A source that left the roster is forgotten (its series ends).
    totals.sources = live;
    metrics::counter!("shardwire_fetches_cancelled_total").increment(cancelled);
}

/// The per-source families' blocks (name, text), from the sources of this scrape; each with
/// its `# HELP` and `# TYPE` while no source is known yet.
fn per_source_blocks(sources: &BTreeMap<String, SourceSeries>) -> Vec<(String, String)> {
    PER_SOURCE
        .iter()
        .map(|&name| {
            let (kind, help) = FAMILIES
                .iter()
                .find(|f| f.1 == name)
                .map_or(("untyped", ""), |f| (f.0, f.2));
            let mut b = format!("# HELP {name} {help}\n# TYPE {name} {kind}\n");
            for (addr, s) in sources {
                let v = match name {
                    "shardwire_source_up" => u64::from(s.up),
                    _ => s.bytes,
                };
                let _ = writeln!(b, "{name}{{source=\"{}\"}} {v}", label_value(addr));
            }
            (name.to_owned(), b)
        })
        .collect()
}

/// `v` escaped as a Prometheus label value (backslash, double quote, newline).
fn label_value(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// A series' labels.
type Labels = [(&'static str, String)];

/// One lane's binding figures, labelled with its lane. A new binding's figures start at 0;
/// its lane's series go on from the last binding's totals.
fn record_binding(totals: &mut Totals, d: &BindingStatus) {
    let lane = [("lane", d.lane.to_string())];
    let with = |k: &'static str, v: &'static str| [lane[0].clone(), (k, v.to_owned())];
    let (linear, plain) = (with("kind", "linear"), with("kind", "plain"));
    let figures: [(&'static str, &Labels, u64); 8] = [
        ("shardwire_devmem_frags_total", &lane, d.frags),
        ("shardwire_devmem_bytes_total", &lane, d.dmabuf_bytes),
        (
            "shardwire_devmem_tokens_returned_total",
            &lane,
            d.tokens_returned,
        ),
        (
            "shardwire_devmem_steering_errors_total",
            &lane,
            d.steering_errors,
        ),
        ("shardwire_devmem_host_bytes_total", &linear, d.linear_bytes),
        ("shardwire_devmem_host_bytes_total", &plain, d.plain_bytes),
        (
            "shardwire_devmem_pool_exhausted_total",
            &lane,
            d.pool_exhausted,
        ),
        (
            "shardwire_devmem_flow_rule_failures_total",
            &lane,
            d.flow_rule_failures,
        ),
    ];
    for (name, labels, now) in figures {
        grow(totals, u64::from(d.binding), name, labels, now);
    }
    metrics::gauge!("shardwire_devmem_flow_rules", &lane).set(d.flow_rules as f64);
    // Only a binding that counts its net_iovs sets these; the text shows them for such
    // bindings only ([`Bound`]), not a last emulator's values under a later NIC's binding.
    if let Some(free) = d.niovs_free {
        metrics::gauge!(NIOVS, &with("state", "free")).set(free as f64);
        metrics::gauge!(NIOVS, &with("state", "in_use")).set((d.niovs - free) as f64);
    }
}

/// The family of a binding's net_iovs, set only by bindings that count them (`devmem-sim`).
const NIOVS: &str = "shardwire_devmem_niovs";

/// The lanes whose binding series are live (as `lane` label values): every lane with a
/// binding, and of those the ones whose binding counts its net_iovs ([`NIOVS`]). The recorder
/// keeps a series' last value for good, so the text leaves out every other lane's series.
#[derive(Debug, Default)]
struct Bound {
    lanes: Vec<String>,
    niovs: Vec<String>,
}

impl Bound {
    /// The lanes of `bindings`, the bindings of the node now.
    fn of<'a>(bindings: impl IntoIterator<Item = &'a BindingStatus>) -> Self {
        let mut bound = Self::default();
        for d in bindings {
            bound.lanes.push(d.lane.to_string());
            if d.niovs_free.is_some() {
                bound.niovs.push(d.lane.to_string());
            }
        }
        bound
    }

    /// The lanes whose series of the binding family `name` are live.
    fn of_family(&self, name: &str) -> &[String] {
        match name {
            NIOVS => &self.niovs,
            _ => &self.lanes,
        }
    }
}

/// Adds what the figure `now` of `owner` grew by to the series `name` `labels`.
fn grow(
    totals: &mut Totals,
    owner: u64,
    name: &'static str,
    labels: &[(&'static str, String)],
    now: u64,
) {
    let grew = totals.growth(format!("{name}{labels:?}"), owner, now);
    metrics::counter!(name, labels).increment(grew);
}

/// The exposition text: the recorder's families in name order (counter and gauge series in
/// label order; histogram series as the recorder keeps them, in registration order, each
/// with its buckets in `le` order), then the node's counters in seconds, rendered here (the
/// recorder's counters are integers).
fn render_text(
    seconds: &[(&CounterDef, f64)],
    bound: &Bound,
    per_source: Vec<(String, String)>,
) -> String {
    let mut blocks: Vec<(String, String)> = handle()
        .render()
        .split("\n\n")
        .filter(|b| !b.trim().is_empty())
        .map(|b| (family_name(b), sorted_block(b)))
        .filter_map(|(name, b)| {
            if name.starts_with(DEVMEM) {
                labelled_only(&b, "lane", bound.of_family(&name)).map(|b| (name, b))
            } else if PER_SOURCE.contains(&name.as_str()) {
                None // rendered from the live sources, below (`per_source`)
            } else {
                Some((name, b))
            }
        })
        .collect();
    blocks.extend(per_source);
    let mut families: Vec<&str> = seconds.iter().map(|(d, _)| d.metric).collect();
    families.dedup();
    for family in families {
        let mut own = String::new();
        let defs = seconds.iter().filter(|(d, _)| d.metric == family);
        for (i, (d, v)) in defs.enumerate() {
            if i == 0 {
                let _ = writeln!(own, "# HELP {family} {}", d.help);
                let _ = writeln!(own, "# TYPE {family} counter");
            }
            match d.label {
                Label::Fixed(k, value) => {
                    let _ = writeln!(own, "{family}{{{k}=\"{value}\"}} {v}");
                }
                _ => {
                    let _ = writeln!(own, "{family} {v}");
                }
            }
        }
        blocks.push((family.to_owned(), own));
    }
    blocks.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out = String::with_capacity(blocks.iter().map(|b| b.1.len() + 1).sum());
    for (_, b) in blocks {
        out.push_str(b.trim_end());
        out.push_str("\n\n");
    }
    out
}

/// The prefix of the per-lane binding families ([`record_binding`]).
const DEVMEM: &str = "shardwire_devmem_";

/// The node's families labelled by `source`, rendered from the sources of the roster now
/// ([`per_source_blocks`]): a source that left the DNS answer must not stay `up` for good, nor
/// leave a series in memory per rollout.
const PER_SOURCE: [&str; 2] = [
    "shardwire_source_up",
    "shardwire_source_bytes_received_total",
];

/// A block without the series whose label `key` is not in `current` (the recorder keeps a
/// gone series' last values: a deleted binding's lane; they must not look live), or None
/// when no series is left.
fn labelled_only(block: &str, key: &str, current: &[String]) -> Option<String> {
    let (open, next) = (format!("{{{key}=\""), format!(",{key}=\""));
    let value_of = |l: &str| {
        let rest = l.split_once(&open).or_else(|| l.split_once(&next))?.1;
        Some(rest[..rest.find('"')?].to_owned())
    };
    let keep = |l: &&str| l.starts_with('#') || value_of(l).is_some_and(|n| current.contains(&n));
    let lines: Vec<&str> = block.lines().filter(keep).collect();
    lines.iter().any(|l| !l.starts_with('#')).then(|| {
        let mut out = lines.join("\n");
        out.push('\n');
        out
    })
}

/// The family a block describes: the name on its `# TYPE` line (or its first sample's).
fn family_name(block: &str) -> String {
    block
        .lines()
        .find_map(|l| l.strip_prefix("# TYPE "))
        .or_else(|| block.lines().find(|l| !l.starts_with('#')))
        .and_then(|l| l.split([' ', '{']).next())
        .unwrap_or_default()
        .to_owned()
}

/// A block with its sample lines sorted, unless it is a histogram or summary (whose lines
/// must stay grouped per series and in `le` order).
fn sorted_block(block: &str) -> String {
    let (comments, mut samples): (Vec<&str>, Vec<&str>) =
        block.lines().partition(|l| l.starts_with('#'));
    let grouped = comments
        .iter()
        .any(|l| l.starts_with("# TYPE") && (l.ends_with("histogram") || l.ends_with("summary")));
    if !grouped {
        samples.sort_unstable();
    }
    let mut out = String::with_capacity(block.len() + 1);
    for l in comments.into_iter().chain(samples) {
        out.push_str(l);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardwire_node::BindingKind;

    /// A series' value in the recorder now (0 where it has none yet).
    fn value(series: &str) -> u64 {
        handle()
            .render()
            .lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or(0)
    }

    #[test]
    fn a_mode_counter_gives_each_mode_what_came_in_under_it() {
        // Before: the lifetime total went to the mode in effect at each scrape, so after
        // host -> devmem-sim -> host the series read 180 and 150 (330 bytes of 180).
        handle();
        let d = CounterDef {
            status: "test_mode_bytes",
            metric: "shardwire_test_mode_bytes_total",
            label: Label::Mode,
            help: "test",
            unit: Unit::Count,
        };
        let mut totals = Totals::default();
        record_counter(&mut totals, &d, "host", 100);
        record_counter(&mut totals, &d, "devmem-sim", 150);
        record_counter(&mut totals, &d, "host", 180);
        let host = value("shardwire_test_mode_bytes_total{mode=\"host\"}");
        let sim = value("shardwire_test_mode_bytes_total{mode=\"devmem-sim\"}");
        assert_eq!((host, sim), (130, 50));
        assert_eq!(host + sim, 180);
    }

    fn binding(lane: u32, binding: u32, frags: u64) -> BindingStatus {
        BindingStatus {
            lane,
            binding,
            kind: BindingKind::Emulated,
            bytes: 1 << 20,
            interface: "emu0".into(),
            queues: vec![0],
            niovs: 256,
            niovs_free: None,
            pool_exhausted: 0,
            frags,
            dmabuf_bytes: 0,
            tokens_returned: 0,
            linear_bytes: 0,
            plain_bytes: 0,
            steering_errors: 0,
            flow_rules: 0,
            flow_rule_failures: 0,
        }
    }

    #[test]
    fn a_binding_series_goes_on_when_its_figure_starts_again() {
        // Before: `absolute` (the maximum) froze the series at 1000 until a new binding's
        // figure passed it.
        handle();
        let series = "shardwire_devmem_frags_total{lane=\"9001\"}";
        let mut totals = Totals::default();
        record_binding(&mut totals, &binding(9001, 7, 1000));
        record_binding(&mut totals, &binding(9001, 7, 10)); // its figure went down: a restart
        assert_eq!(value(series), 1010);
        record_binding(&mut totals, &binding(9001, 8, 5)); // a new binding on the lane
        record_binding(&mut totals, &binding(9001, 8, 25));
        assert_eq!(value(series), 1035);
    }

    fn source(link: usize, addr: &str, cancelled: u64, bytes_received: u64) -> SourceStatus {
        SourceStatus {
            link,
            addr: addr.into(),
            found_by: "dns:sources.test:7500".into(),
            up: true,
            state: "active",
            fetches: 0,
            outstanding: 0,
            in_flight: 0,
            cancels_sent: cancelled,
            cancelled,
            bytes_received,
            last_error: None,
        }
    }

    #[test]
    fn a_retired_source_takes_nothing_back_and_a_returning_one_counts_from_0() {
        // Cancels are added up per source, not taken from their sum: a retired source's
        // cancels leaving the sum (8, then 4) are no restart of anything, and reading that
        // drop as one would add all 4 again for a single new cancel. Before: the maximum of
        // the sum, stuck at 8; and 100 bytes for a source that came back with 150.
        handle();
        let cancelled = || value("shardwire_fetches_cancelled_total");
        let c0 = cancelled();
        let mut totals = Totals::default();
        let mut scrape = |sources: &[SourceStatus]| {
            record_sources(sources, &mut totals);
            totals.end_scrape();
            totals.sources.get("192.0.2.1:7500").map(|s| s.bytes)
        };
        let b = scrape(&[
            source(0, "192.0.2.1:7500", 5, 100),
            source(1, "192.0.2.2:7500", 3, 0),
        ]);
        assert_eq!((cancelled() - c0, b), (8, Some(100)));
        let b = scrape(&[source(1, "192.0.2.2:7500", 4, 0)]); // .1 left DNS: its series ends
        assert_eq!((cancelled() - c0, b), (9, None));
        // .1 came back: a new link, counted from 0 though it passed the old one's figures;
        // its series starts again (a counter reset).
        let b = scrape(&[
            source(2, "192.0.2.1:7500", 7, 150),
            source(1, "192.0.2.2:7500", 4, 0),
        ]);
        assert_eq!((cancelled() - c0, b), (16, Some(150)));
        // .1 left and came back between two scrapes: its new link's 160 bytes all count, not
        // the 10 by which they pass the old link's 150.
        let b = scrape(&[
            source(3, "192.0.2.1:7500", 7, 160),
            source(1, "192.0.2.2:7500", 4, 0),
        ]);
        assert_eq!(b, Some(310));
    }

    #[test]
    fn blocks_sort_their_samples_except_histograms() {
        let c = "# HELP a_total x\n# TYPE a_total counter\na_total{k=\"b\"} 1\na_total{k=\"a\"} 2";
        assert_eq!(
            sorted_block(c),
            "# HELP a_total x\n# TYPE a_total counter\na_total{k=\"a\"} 2\na_total{k=\"b\"} 1\n"
        );
        let h = "# TYPE h histogram\nh_bucket{le=\"0.5\"} 1\nh_bucket{le=\"+Inf\"} 1\nh_sum 0.1\nh_count 1";
        assert_eq!(sorted_block(h), format!("{h}\n"));
        assert_eq!(family_name(h), "h");
    }

    #[test]
    fn niovs_of_an_emulator_binding_are_left_out_under_a_later_nic_binding() {
        // Before: the recorder kept the emulator's last net_iovs, and the text showed them
        // under the NIC's binding that replaced it on the lane, as if they were live.
        handle();
        let mut totals = Totals::default();
        let mut emulator = binding(9002, 1, 0);
        emulator.niovs_free = Some(200);
        record_binding(&mut totals, &emulator);
        let text = render_text(&[], &Bound::of([&emulator]), vec![]);
        assert!(
            text.contains("shardwire_devmem_niovs{lane=\"9002\",state=\"free\"} 200\n")
                && text.contains("shardwire_devmem_niovs{lane=\"9002\",state=\"in_use\"} 56\n"),
            "{text}"
        );
        let mut nic = binding(9002, 2, 0);
        nic.kind = BindingKind::Kernel;
        record_binding(&mut totals, &nic);
        let text = render_text(&[], &Bound::of([&nic]), vec![]);
        assert!(
            !text.contains("shardwire_devmem_niovs{lane=\"9002\""),
            "{text}"
        );
        assert!(
            text.contains("shardwire_devmem_frags_total{lane=\"9002\"}"),
            "the lane's other series stay: {text}"
        );
    }

    #[test]
    fn devmem_series_of_unbound_lanes_are_left_out() {
        let b = "# HELP shardwire_devmem_frags_total x\n# TYPE shardwire_devmem_frags_total counter\n\
                 shardwire_devmem_frags_total{lane=\"0\"} 5\nshardwire_devmem_frags_total{lane=\"1\"} 7\n";
        let kept = labelled_only(b, "lane", &["1".to_owned()]).unwrap();
        assert!(
            kept.contains("{lane=\"1\"} 7") && !kept.contains("lane=\"0\""),
            "{kept}"
        );
        assert!(kept.starts_with("# HELP"), "{kept}");
        assert_eq!(labelled_only(b, "lane", &[]), None);
        // `lane="1"` is not `lane="10"`.
        assert_eq!(labelled_only(b, "lane", &["10".to_owned()]), None);
    }

    #[test]
    fn series_of_sources_that_left_the_roster_are_left_out_and_forgotten() {
        // Before: a source retired from the DNS answer stayed in the recorder for good (one
        // series per address per rollout), only hidden from the text.
        handle();
        let mut totals = Totals::default();
        let mut down = source(0, "10.0.0.1:7500", 0, 5);
        down.up = false;
        record_sources(&[down, source(1, "10.0.0.2:7500", 0, 7)], &mut totals);
        record_sources(&[source(1, "10.0.0.2:7500", 0, 9)], &mut totals);
        assert_eq!(totals.sources.len(), 1, "{:?}", totals.sources);
        let blocks = per_source_blocks(&totals.sources);
        let text: String = blocks.iter().map(|b| b.1.as_str()).collect();
        assert!(!text.contains("10.0.0.1"), "{text}");
        assert!(
            text.contains("shardwire_source_up{source=\"10.0.0.2:7500\"} 1\n")
                && text.contains(
                    "shardwire_source_bytes_received_total{source=\"10.0.0.2:7500\"} 9\n"
                ),
            "{text}"
        );
        // No series in the recorder: none left behind by any source.
        assert!(!handle().render().contains("shardwire_source_up{"));
        // A family of no known source keeps its headers.
        let none = per_source_blocks(&BTreeMap::new());
        assert_eq!(
            none[0].1,
            format!(
                "# HELP shardwire_source_up {}\n# TYPE shardwire_source_up gauge\n",
                FAMILIES
                    .iter()
                    .find(|f| f.1 == "shardwire_source_up")
                    .unwrap()
                    .2
            )
        );
        assert_eq!(label_value("a\"b\\c"), "a\\\"b\\\\c");
        let other = "x{mode=\"host\",lane=\"3\"} 1\n";
        assert!(
            labelled_only(other, "lane", &["3".to_owned()]).is_some(),
            "a later label"
        );
    }

    #[test]
    fn every_family_is_documented_in_operations() {
        let doc = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../docs/OPERATIONS.md"
        ))
        .expect("docs/OPERATIONS.md exists");
        let node = COUNTERS.iter().map(|d| d.metric);
        for name in FAMILIES.iter().map(|f| f.1).chain(node) {
            assert!(
                doc.contains(name),
                "docs/OPERATIONS.md does not mention {name}"
            );
        }
    }
}
