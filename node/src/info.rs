//! What the node knows about itself: its configuration and secrets, the probes taken at start,
//! the data port, the memory kind, and why it receives and assembles the way it does (the one
//! part that changes at run time, when a binding is created or deleted).

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
    mode_reason: Mutex<String>,
}

impl Info {
    /// The facts gathered at start.
    pub fn new(
        cfg: ServeConfig,
        secrets: (Option<Vec<u8>>, Option<Vec<u8>>),
        probes: (GpuProbe, Vec<NicReport>),
        data_addr: SocketAddr,
        memory: MemoryKind,
        mode_reason: String,
    ) -> Self {
        Self {
            cfg,
            secret: secrets.0,
            admin_token: secrets.1,
            gpus: probes.0,
            nics: probes.1,
            data_addr,
            memory,
            mode_reason: Mutex::new(mode_reason),
        }
    }

    /// Why the service receives and assembles the way it does.
    pub fn mode_reason(&self) -> String {
        self.mode_reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Records a new reason (a binding changed).
    pub(crate) fn set_mode_reason(&self, reason: String) {
        *self.mode_reason.lock().unwrap_or_else(|p| p.into_inner()) = reason;
    }
}
