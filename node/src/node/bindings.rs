//! The node's RX bindings as the admin API sees them: one per lane at most. `POST
//! /v1/bindings` binds a lane (the emulator, or a NIC's queues), `DELETE` unbinds one by its
//! id (ids are unique on the host: each binding has its own dma-buf), and status lists them
//! by lane with their counters.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::Node;
use crate::binding::{self, BindingError, NicRequest, RxRegion};
use crate::control::{BindingSpec, ControlError, Reply};
use crate::lanes::Lane;
use crate::status::BindingStatus;

impl Node {
    /// The lane a binding request is for: the one it names, else the lane whose NIC is the
    /// interface, else lane 0. A NIC binding must then be on the lane's own NIC (a lane with
    /// none, the single lane of a node without GPUs, takes any).
    fn lane_for(
        &self,
        lane: Option<u32>,
        ifname: Option<&str>,
    ) -> Result<&Arc<Lane>, BindingError> {
        let all = self.plane.lanes.all();
        match (lane, ifname) {
            (Some(n), _) => self.plane.lanes.get(n).ok_or(BindingError::NoLane {
                lane: n,
                count: all.len(),
            }),
            (None, Some(name)) => Ok(self.lane_of_interface(name)),
            (None, None) => Ok(&all[0]),
        }
    }

    /// Makes the binding `spec` asks for on its lane (which must have none).
    async fn make_binding(&self, spec: BindingSpec) -> Result<(Arc<RxRegion>, u32), BindingError> {
        let (lane, ifname) = match &spec {
            BindingSpec::Emulator { lane, .. } => (*lane, None),
            BindingSpec::Nic { lane, name, .. } => (*lane, Some(name.as_str())),
        };
        let lane = self.lane_for(lane, ifname)?;
        if let (Some(asked), Some(nic)) = (ifname, lane.spec.nic.as_deref())
            && asked != nic
        {
            return Err(BindingError::NotLanesNic {
                lane: lane.id(),
                nic: nic.to_owned(),
                asked: asked.to_owned(),
            });
        }
        if let Some(b) = self.plane.binding(lane.id()) {
            return Err(BindingError::Exists {
                id: b.id(),
                lane: lane.id(),
            });
        }
        let region = match spec {
            BindingSpec::Emulator { bytes, .. } => {
                let (nic, queues) =
                    binding::emulated_nic(lane.id(), lane.spec.nic.as_deref(), &lane.spec.queues);
                binding::emulator(self.plane.emu(), (&nic, &queues), bytes, lane.cuda.clone())?
            }
            BindingSpec::Nic {
                name,
                queues,
                bytes,
                ..
            } => {
                let nics = tokio::task::spawn_blocking(shardwire_devmem::probe::probe_nics)
                    .await
                    .unwrap_or_default();
                let one_lane = self.plane.lanes.all().len() == 1;
                let state_file =
                    binding::kernel::state_file(&self.info.cfg.nic_state_file, &name, one_lane);
                let req = NicRequest {
                    name: Some(name),
                    queues,
                    bytes,
                    state_file,
                    data_port: lane.data_addr.port(),
                    configured: false,
                };
                binding::nic(&nics, req, (lane.id(), lane.cuda.clone()))
                    .await?
                    .0
            }
        };
        Ok((region, lane.id()))
    }

    pub(super) async fn create_binding(
        &self,
        spec: BindingSpec,
    ) -> Result<BindingStatus, BindingError> {
        let (region, lane) = self.make_binding(spec).await?;
        let (ifname, q) = region.queues();
        let what = match region.kind() {
            binding::BindingKind::Kernel => format!("{ifname} RX queues {q:?}"),
            binding::BindingKind::Emulated => {
                format!("the emulator's {ifname} queues {q:?} (NOT GPU-direct)")
            }
        };
        let reason = format!(
            "receive changed over the admin API: binding {} on lane {lane}, {what}, {} dma-buf",
            region.id(),
            shardwire_config::ByteSize(region.bytes() as u64)
        );
        self.plane.set_binding(lane, Some(Arc::clone(&region)));
        tracing::info!(receive = %self.receive(), lane, %reason, "receive path changed");
        self.info.set_mode_reason(reason);
        self.plane.reconnect_all("an RX binding changed"); // data connections come back on it
        tracing::info!(binding = region.id(), lane, %what, "devmem binding created over the admin API");
        Ok(self.binding_status(lane).expect("just bound"))
    }

    pub(super) async fn delete_binding(&self, id: &str) -> Result<Reply, ControlError> {
        let found = self
            .plane
            .bindings()
            .into_iter()
            .find(|(_, r)| r.id().to_string() == id);
        let Some((lane, region)) = found else {
            return Err(BindingError::NotFound { id: id.to_owned() }.into());
        };
        let reason = format!(
            "receive changed over the admin API: binding {id} of lane {lane} deleted; plain TCP into host memory on that lane"
        );
        self.plane.set_binding(lane, None);
        tracing::info!(receive = %self.receive(), lane, %reason, "receive path changed");
        self.info.set_mode_reason(reason);
        self.plane.reconnect_all("an RX binding was deleted");
        // Wait until no data connection reads from the binding. Counted by its readers, not
        // its references: one connection holds several.
        let started = Instant::now();
        let limit = Duration::from_secs(self.info.cfg.drain_timeout_secs);
        while region.readers() > 0 && started.elapsed() < limit {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let readers_left = region.readers();
        let r = Arc::clone(&region);
        let _ = tokio::task::spawn_blocking(move || r.unbind()).await;
        let waited_ms = started.elapsed().as_millis() as u64;
        tracing::info!(binding = %id, lane, readers_left, waited_ms, "devmem binding deleted over the admin API");
        Ok(Reply::Deleted {
            id: region.id(),
            waited_ms,
            readers_left,
        })
    }

    /// The lane whose NIC is `ifname`, else lane 0.
    pub(crate) fn lane_of_interface(&self, ifname: &str) -> &Arc<Lane> {
        let all = self.plane.lanes.all();
        all.iter()
            .find(|l| l.spec.nic.as_deref() == Some(ifname))
            .unwrap_or(&all[0])
    }

    /// Every lane's RX binding, by lane (empty in host mode).
    pub fn binding_statuses(&self) -> Vec<BindingStatus> {
        let lanes = self.plane.bindings().into_iter().map(|(l, _)| l);
        lanes.filter_map(|l| self.binding_status(l)).collect()
    }

    /// Lane `lane`'s RX binding, `None` when it receives with plain TCP.
    pub fn binding_status(&self, lane: u32) -> Option<BindingStatus> {
        let region = self.plane.binding(lane)?;
        let c = &region.counters;
        let (free, total) = region.niovs();
        let (ifname, queues) = region.queues();
        Some(BindingStatus {
            lane,
            binding: region.id(),
            kind: region.kind(),
            bytes: region.bytes(),
            interface: ifname.to_owned(),
            queues: queues.to_vec(),
            niovs: total,
            niovs_free: free,
            pool_exhausted: region.exhausted_waits(),
            frags: c.frags.load(Ordering::Relaxed),
            dmabuf_bytes: c.dmabuf_bytes.load(Ordering::Relaxed),
            tokens_returned: c.tokens_returned.load(Ordering::Relaxed),
            linear_bytes: c.linear_bytes.load(Ordering::Relaxed),
            plain_bytes: c.plain_bytes.load(Ordering::Relaxed),
            steering_errors: c.steering_errors.load(Ordering::Relaxed),
            flow_rules: c.flow_rules.load(Ordering::Relaxed),
            flow_rule_failures: c.flow_rule_failures.load(Ordering::Relaxed),
        })
    }
}
