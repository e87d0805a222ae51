//! What the node knows about itself: its configuration and secrets, the probes taken at start,
//! the data port, the memory kind, and why it receives and assembles the way it does (the one
//! part that changes at run time, when a binding is created or deleted).
//!
//! The reason is told in parts: the receive decision at start, the last binding change of each
//! lane over the admin API since, and the memory decision at start. A change replaces only its
//! own lane's part: the other lanes' and the memory decision (a GPU whose self-test failed
//! behind `memory = auto`) stay said.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Mutex;

use shardwire_config::ServeConfig;
use shardwire_devmem::probe::NicReport;
use shardwire_gpu::GpuProbe;
use shardwire_protocol::trainer::MemoryKind;

/// Static facts, and the mode reason.
#[derive(Debug)]
pub struct Info {
    /// Effective configuration.
    pub cfg: ServeConfig,
    /// Shared secret for sources.
    pub secret: Option<Vec<u8>>,
    /// Bearer token for mutating admin endpoints.
    pub admin_token: Option<Vec<u8>>,
    /// The GPU probe taken at start.
    pub gpus: GpuProbe,
    /// The NIC capability probe taken at start.
    pub nics: Vec<NicReport>,
    /// Bound data port.
    pub data_addr: SocketAddr,
    /// Where stream regions live.
    pub memory: MemoryKind,
    /// Why the node receives as it does, as decided at start.
    receive_reason: String,
    /// Why stream regions live where they do.
    memory_reason: String,
    /// Each lane's last binding change over the admin API, by lane.
    changes: Mutex<BTreeMap<u32, String>>,
}

impl Info {
    /// The facts gathered at start; `reasons`: why the node receives as it does, and why its
    /// memory is `memory`.
    pub fn new(
        cfg: ServeConfig,
        secrets: (Option<Vec<u8>>, Option<Vec<u8>>),
        probes: (GpuProbe, Vec<NicReport>),
        data_addr: SocketAddr,
        memory: MemoryKind,
        reasons: (String, String),
    ) -> Self {
        Self {
            cfg,
            secret: secrets.0,
            admin_token: secrets.1,
            gpus: probes.0,
            nics: probes.1,
            data_addr,
            memory,
            receive_reason: reasons.0,
            memory_reason: reasons.1,
            changes: Mutex::default(),
        }
    }

    /// Why the service receives and assembles the way it does: the receive decision at start,
    /// each lane's binding change since (if any), and the memory decision.
    pub fn mode_reason(&self) -> String {
        let changes = self.changes.lock().unwrap_or_else(|p| p.into_inner());
        let mut receive = self.receive_reason.clone();
        if !changes.is_empty() {
            let each: Vec<String> = (changes.iter())
                .map(|(lane, c)| format!("lane {lane}: {c}"))
                .collect();
            receive = format!(
                "{receive}; receive changed over the admin API since: {}",
                each.join("; ")
            );
        }
        format!("{receive}. memory={}: {}", self.memory, self.memory_reason)
    }

    /// Records lane `lane`'s binding change (`change` says what it receives with now).
    pub(crate) fn set_lane_change(&self, lane: u32, change: String) {
        let mut changes = self.changes.lock().unwrap_or_else(|p| p.into_inner());
        changes.insert(lane, change);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(memory_reason: &str) -> Info {
        let gpus = GpuProbe {
            driver_present: true,
            driver_version: Some(12080),
            devices: Vec::new(),
            usable: false,
            reason: "test".into(),
        };
        Info::new(
            ServeConfig::default(),
            (None, None),
            (gpus, Vec::new()),
            SocketAddr::from(([127, 0, 0, 1], 7401)),
            MemoryKind::Host,
            (
                "receive=devmem-sim: lane 0: ...; lane 1: ...".into(),
                memory_reason.into(),
            ),
        )
    }

    /// A binding change keeps why the memory is host (a GPU self-test that failed behind
    /// `memory = auto`) and the other lanes' part. Before, the change replaced the whole
    /// reason: both were gone after one `POST /v1/bindings`.
    #[test]
    fn a_binding_change_keeps_the_memory_decision_and_the_other_lanes() {
        let why = "GPU 0 failed its self-test (CUDA_ERROR_ILLEGAL_ADDRESS)";
        let i = info(why);
        let at_start = i.mode_reason();
        assert_eq!(
            at_start,
            format!("receive=devmem-sim: lane 0: ...; lane 1: .... memory=host: {why}"),
            "as at start before any change"
        );
        i.set_lane_change(1, "binding 3 deleted; plain TCP into host memory".into());
        i.set_lane_change(0, "binding 4 created".into());
        i.set_lane_change(1, "binding 5 created".into());
        let now = i.mode_reason();
        assert!(
            now.starts_with("receive=devmem-sim: lane 0: ...; lane 1: ..."),
            "{now}"
        );
        assert!(
            now.contains("admin API since: lane 0: binding 4 created; lane 1: binding 5 created."),
            "each lane's last change, by lane: {now}"
        );
        assert!(!now.contains("binding 3"), "{now}");
        assert!(now.ends_with(&format!("memory=host: {why}")), "{now}");
    }
}
