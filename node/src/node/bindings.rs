//! The node's RX bindings as the admin API sees them: one per lane at most. `POST
//! /v1/bindings` binds a lane (the emulator, or a NIC's queues), `DELETE` unbinds one by its
//! id, and status lists them by lane with their counters.
//!
//! Ids are unique among the node's bindings: the kernel numbers its bindings for the whole
//! host and the emulator its own from 1, so a binding of one kind may get the id of one of
//! the other; it is then made again until its id is free ([`fresh_id`]), and a delete never
//! finds two.

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
    /// interface, else lane 0. A NIC binding must then be one start would make there
    /// ([`binding::kernel::lane_takes`]: the single lane of a node takes any NIC, and each of
    /// several lanes its own).
    fn lane_for(
        &self,
        lane: Option<u32>,
        ifname: Option<&str>,
    ) -> Result<&Arc<Lane>, BindingError> {
        let all = self.plane.lanes.all();
        let lane = match (lane, ifname) {
            (Some(n), _) => self.plane.lanes.get(n).ok_or(BindingError::NoLane {
                lane: n,
                count: all.len(),
            })?,
            (None, Some(name)) => self.lane_of_interface(name),
            (None, None) => &all[0],
        };
        if let Some(asked) = ifname {
            binding::kernel::lane_takes((lane.id(), lane.spec.nic.as_deref()), all.len(), asked)?;
        }
        Ok(lane)
    }

    /// Makes the binding `spec` asks for on its lane (which must have none), with an id that
    /// none of the node's other bindings has.
    async fn make_binding(&self, spec: BindingSpec) -> Result<(Arc<RxRegion>, u32), BindingError> {
        let (lane, ifname) = match &spec {
            BindingSpec::Emulator { lane, .. } => (*lane, None),
            BindingSpec::Nic { lane, name, .. } => (*lane, Some(name.as_str())),
        };
        let lane = self.lane_for(lane, ifname)?;
        if let Some(b) = self.plane.binding(lane.id()) {
            return Err(BindingError::Exists {
                id: b.id(),
                lane: lane.id(),
            });
        }
        let taken: Vec<u32> = self.plane.bindings().iter().map(|(_, r)| r.id()).collect();
        let spec = &spec;
        let region = fresh_id(&taken, move || self.new_region(lane, spec)).await?;
        Ok((region, lane.id()))
    }

    /// A new binding on `lane` as `spec` asks.
    async fn new_region(
        &self,
        lane: &Arc<Lane>,
        spec: &BindingSpec,
    ) -> Result<Arc<RxRegion>, BindingError> {
        let (name, queues, bytes) = match spec {
            BindingSpec::Emulator { bytes, .. } => {
                let (nic, queues) =
                    binding::emulated_nic(lane.id(), lane.spec.nic.as_deref(), &lane.spec.queues);
                let emu = self.plane.emu();
                return binding::emulator(emu, (&nic, &queues), *bytes, lane.cuda.clone());
            }
            BindingSpec::Nic {
                name,
                queues,
                bytes,
                ..
            } => (name, queues, *bytes),
        };
        let nics = tokio::task::spawn_blocking(shardwire_devmem::probe::probe_nics)
            .await
            .unwrap_or_default();
        let one_lane = self.plane.lanes.all().len() == 1;
        let state_file = binding::kernel::state_file(&self.info.cfg.nic_state_file, name, one_lane);
        let req = NicRequest {
            name: Some(name.clone()),
            queues: queues.clone(),
            bytes,
            state_file,
            data_port: lane.data_addr.port(),
            configured: false,
        };
        let (region, _) = binding::nic(&nics, req, (lane.id(), lane.cuda.clone())).await?;
        Ok(region)
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
        let change = format!(
            "binding {} created, {what}, {} dma-buf",
            region.id(),
            shardwire_config::ByteSize(region.bytes() as u64)
        );
        self.plane.set_binding(lane, Some(Arc::clone(&region)));
        tracing::info!(receive = %self.receive(), lane, %change, "receive path changed over the admin API");
        self.info.set_lane_change(lane, change);
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
        let cuda = self.plane.cuda(lane).is_some();
        let change = deleted(region.id(), cuda);
        self.plane.set_binding(lane, None);
        tracing::info!(receive = %self.receive(), lane, %change, "receive path changed over the admin API");
        self.info.set_lane_change(lane, change);
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

/// What a lane receives with once its binding `id` is deleted: plain TCP, into its GPU's
/// memory through pinned staging buffers (`cuda`) or into host memory.
fn deleted(id: u32, cuda: bool) -> String {
    let into = match cuda {
        true => "GPU memory through pinned host staging",
        false => "host memory",
    };
    format!("binding {id} deleted, plain TCP into {into}")
}

/// A binding from `make` whose id none of `taken` (the node's other bindings) has. One whose
/// id is taken is unbound and made again, which gives it another (the emulator and the kernel
/// each number onwards), at most once per taken id: then the ids tried are refused.
async fn fresh_id<F, Fut>(taken: &[u32], mut make: F) -> Result<Arc<RxRegion>, BindingError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Arc<RxRegion>, BindingError>>,
{
    let mut tried = Vec::new();
    loop {
        let region = make().await?;
        let id = region.id();
        if !taken.contains(&id) {
            return Ok(region);
        }
        tracing::info!(
            binding = id,
            ?taken,
            "a new binding got the id of another binding of this node (of the other kind); binding again for another id"
        );
        // Unbound (a kernel binding's NIC set up again by the next try) off the runtime.
        let _ = tokio::task::spawn_blocking(move || region.unbind()).await;
        tried.push(id);
        if tried.len() > taken.len() {
            let taken = taken.to_vec();
            return Err(BindingError::IdsTaken { tried, taken });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardwire_devmem::emu::host::EmuHost;

    /// A binding whose id another binding of the node has is made again until its id is free.
    /// The emulator numbers from 1, as the kernel does after a boot: before, an emulator
    /// binding beside a kernel one could get its id, status listed two bindings of that id,
    /// and `DELETE /v1/bindings/{id}` unbound whichever lane came first.
    #[tokio::test]
    async fn a_binding_is_made_again_until_no_other_binding_has_its_id() {
        let emu = EmuHost::new();
        let make = || {
            let emu = Arc::clone(&emu);
            async move { binding::emulator(&emu, ("emu1", &[8, 9]), 1 << 20, None) }
        };
        // Two other lanes' kernel bindings have ids 1 and 2, the emulator's first two.
        let region = fresh_id(&[1, 2], make).await.expect("a free id");
        assert_eq!(region.id(), 3);
        assert_eq!(
            region.queues(),
            ("emu1", &[8, 9][..]),
            "the queues let go are bound again"
        );
        drop(region);
        // A bind that fails is the answer.
        let fails =
            || async { Err::<Arc<RxRegion>, _>(BindingError::NoLane { lane: 9, count: 1 }) };
        let failed = fresh_id(&[], fails).await;
        assert!(matches!(failed, Err(BindingError::NoLane { lane: 9, .. })));
    }

    /// A binding that keeps getting taken ids is refused after one try per taken id, naming
    /// them, instead of binding for ever.
    #[tokio::test]
    async fn a_binding_that_keeps_getting_taken_ids_is_refused() {
        // Each try on a new emulated host: id 1 every time.
        let make = || {
            let emu = EmuHost::new();
            async move { binding::emulator(&emu, ("emu0", &[8]), 1 << 20, None) }
        };
        match fresh_id(&[1], make).await {
            Err(BindingError::IdsTaken { tried, taken }) => {
                assert_eq!((tried, taken), (vec![1, 1], vec![1]))
            }
            other => panic!("{:?}", other.map(|r| r.id())),
        }
    }

    /// A deleted binding's lane is said to receive into its own memory kind: before, a CUDA
    /// lane (plain TCP through pinned staging into its GPU) was said to receive into host
    /// memory.
    #[test]
    fn a_deleted_binding_names_its_lanes_memory() {
        assert_eq!(
            deleted(3, true),
            "binding 3 deleted, plain TCP into GPU memory through pinned host staging"
        );
        assert_eq!(
            deleted(3, false),
            "binding 3 deleted, plain TCP into host memory"
        );
    }
}
