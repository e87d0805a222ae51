//! Devmem capability probe for `shardwire nics` and `/v1/nics`.
//!
//! For every netdev in the caller's network namespace: name, driver, queue counts (netdev
//! `queue-get`), header-split state (ethtool netlink `rings-get`) and the outcome of a
//! **trial bind-rx** with an invalid dma-buf fd (-1). The kernel runs its device checks
//! before it looks at the fd (`netdev_nl_bind_rx_doit`: ifindex lookup, ops-lock/queue-mgmt
//! check, queue validation, DMA device; then `net_devmem_bind_dmabuf` → `dma_buf_get`), so:
//!
//! * `EOPNOTSUPP` (bad attr ifindex) = the driver cannot do devmem (lo, veth, virtio_net…);
//! * `EBADF` = every device check passed and only the fd was refused: devmem-capable, from
//!   6.15; before, bind-rx takes the fd first, and the EBADF proves nothing (`verdict`);
//! * `EPERM` = we lack CAP_NET_ADMIN and cannot tell.
//!
//! The trial cannot leave anything bound, even on a devmem NIC: with fd -1 it fails at
//! `dma_buf_get()` before any binding, page pool or queue restart exists, and it runs on its
//! own netlink socket that is closed right after (closing unbinds anything on it anyway).
//! Header split and flow steering are only checked by the kernel after `dma_buf_get`, so the
//! probe reports the ethtool state separately.
#![forbid(unsafe_code)]

use std::path::Path;

use netlink_bindings::ethtool;
use netlink_bindings::traits::NetlinkRequest;
use serde::Serialize;

use crate::netdev::{NetdevClient, NetdevError, QueueType};
use crate::nl::{self, GenlSocket};

/// `ETHTOOL_MSG_RINGS_GET` (user-to-kernel id).
const ETHTOOL_MSG_RINGS_GET: u8 = 15;

/// Drivers known to set `PP_FLAG_ALLOW_UNREADABLE_NETMEM` (reference devmem.md §4.3);
/// `libeth` is the Intel idpf family.
pub const DEVMEM_DRIVERS: &[&str] = &["gve", "bnxt_en", "mlx5_core", "fbnic", "idpf"];

/// The outcome of the trial `bind-rx` (fd -1, rx queue 0).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TrialBind {
    /// errno of the rejection (`None` if the request could not be sent at all).
    pub errno: Option<i32>,
    /// Symbolic errno, e.g. `"EOPNOTSUPP"`.
    pub error: Option<String>,
    /// The kernel's extack message, if any.
    pub message: Option<String>,
    /// The attribute the kernel blamed, if any.
    pub bad_attr: Option<String>,
    /// In words, e.g. "EOPNOTSUPP: the driver has no queue management ops (...)".
    pub reason: String,
}

/// One netdev as seen by the probe.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NicReport {
    /// ifindex.
    pub ifindex: u32,
    /// Interface name.
    pub name: String,
    /// Kernel driver (`/sys/class/net/NAME/device/driver`), or `"virtual"`.
    pub driver: String,
    /// `IFF_UP`.
    pub up: bool,
    /// RX queues (queue-get when up; the sysfs `queues/rx-*` count when down).
    pub rx_queues: u32,
    /// TX queues (likewise).
    pub tx_queues: u32,
    /// RX queues that currently have a devmem binding: `(queue id, binding id)`.
    pub bound_rx_queues: Vec<(u32, u32)>,
    /// `tcp-data-split` from ethtool rings-get: `"enabled"`, `"disabled"` or `"unknown"`.
    pub header_split: String,
    /// `hds-thresh` from ethtool rings-get, `None` when unknown/unsupported.
    pub hds_thresh: Option<u32>,
    /// The trial bind-rx.
    pub trial_bind: TrialBind,
    /// The device passed the kernel's devmem device checks.
    pub devmem_capable: bool,
    /// Why (not), and what is still missing.
    pub reason: String,
}

impl NicReport {
    /// Whether a real bind is worth trying when the NIC is named: capable, or "cannot tell"
    /// because the trial bind's EBADF proves nothing on this kernel (before 6.15) for a
    /// driver off the known list.
    pub fn worth_a_bind(&self) -> bool {
        self.devmem_capable || self.trial_bind.errno == Some(libc::EBADF)
    }
}

/// Probe every netdev of the caller's network namespace. Never fails: problems end up in
/// the reports' `reason` (an empty list only if no interface can be listed at all).
pub fn probe_nics() -> Vec<NicReport> {
    let devs = NetdevClient::open().and_then(|mut c| Ok((c.dev_get_dump()?, c)));
    let (ifindexes, mut client, fallback_reason) = match devs {
        Ok((devs, c)) => (devs.iter().map(|d| d.ifindex).collect(), Some(c), None),
        Err(e) => (sysfs_ifindexes(), None, Some(e.reason())),
    };
    let mut ethtool = GenlSocket::open()
        .ok()
        .and_then(|mut s| Some((nl::resolve_family(&mut s, b"ethtool").ok()?.id, s)));
    ifindexes
        .into_iter()
        .map(|ifindex| probe_one(ifindex, client.as_mut(), ethtool.as_mut(), &fallback_reason))
        .collect()
}

fn probe_one(
    ifindex: u32,
    client: Option<&mut NetdevClient>,
    ethtool: Option<&mut (u16, GenlSocket)>,
    fallback_reason: &Option<String>,
) -> NicReport {
    let name = crate::sys::if_indextoname(ifindex).unwrap_or_else(|| format!("if{ifindex}"));
    let sys = Path::new("/sys/class/net").join(&name);
    let driver = std::fs::read_link(sys.join("device/driver"))
        .ok()
        .and_then(|p| p.file_name().map(|f| f.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "virtual".to_string());
    let up = std::fs::read_to_string(sys.join("flags"))
        .ok()
        .and_then(|s| u32::from_str_radix(s.trim().trim_start_matches("0x"), 16).ok())
        .is_some_and(|f| f & libc::IFF_UP as u32 != 0);
    let (rx_queues, tx_queues, bound_rx_queues) = queues(ifindex, client, &sys);
    let (header_split, hds_thresh) = ethtool
        .and_then(|(family, sock)| rings(sock, *family, ifindex))
        .unwrap_or_else(|| ("unknown".to_string(), None));

    let (trial, passed) = match fallback_reason {
        Some(r) => (
            TrialBind {
                errno: None,
                error: None,
                message: None,
                bad_attr: None,
                reason: r.clone(),
            },
            false,
        ),
        None => trial_bind(ifindex),
    };
    let release = if passed {
        kernel_release()
    } else {
        String::new()
    };
    let split = (header_split.as_str(), hds_thresh);
    let (trial_bind, passed, reason) = verdict(trial, passed, &driver, split, &release);
    NicReport {
        ifindex,
        name,
        driver,
        up,
        rx_queues,
        tx_queues,
        bound_rx_queues,
        header_split,
        hds_thresh,
        trial_bind,
        devmem_capable: passed,
        reason,
    }
}

/// The NIC's rx and tx queue counts and its rx queues bound to a dma-buf (`(queue, dmabuf
/// id)`), from netdev's queue dump; the counts from sysfs where the dump has none.
fn queues(
    ifindex: u32,
    client: Option<&mut NetdevClient>,
    sys: &Path,
) -> (u32, u32, Vec<(u32, u32)>) {
    let (mut rx_queues, mut tx_queues, mut bound_rx_queues) = (0, 0, Vec::new());
    if let Some(c) = client {
        for q in c.queue_get_dump(ifindex).unwrap_or_default() {
            match q.kind {
                QueueType::Rx => {
                    rx_queues += 1;
                    if let Some(b) = q.dmabuf {
                        bound_rx_queues.push((q.id, b));
                    }
                }
                QueueType::Tx => tx_queues += 1,
                QueueType::Other(_) => {}
            }
        }
    }
    if rx_queues == 0 && tx_queues == 0 {
        (rx_queues, tx_queues) = sysfs_queue_counts(sys);
    }
    (rx_queues, tx_queues, bound_rx_queues)
}

/// The trial bind `trial` (`passed`: answered EBADF) of a NIC of `driver` with its header
/// split and hds-thresh, on kernel `release` (read only for a pass), judged: the trial
/// bind with its reason saying what its EBADF proves on that kernel, whether the NIC counts
/// as capable, and why (not). Before 6.15 bind-rx checks the fd before the device, so an
/// EBADF proves nothing: a driver off the known list is then "cannot tell" (not capable),
/// one on it counts as capable by the list alone.
fn verdict(
    mut trial: TrialBind,
    passed: bool,
    driver: &str,
    (header_split, hds_thresh): (&str, Option<u32>),
    release: &str,
) -> (TrialBind, bool, String) {
    let unproven = (passed && !checks_device_first(release)).then_some(release);
    if trial.errno == Some(libc::EBADF) {
        trial.reason.push_str(match unproven {
            None => "; bind-rx checks the device before the fd, so the device checks passed",
            Some(_) => {
                "; this kernel (before 6.15) checks the fd before the device in bind-rx, so \
                 this says nothing about the device"
            }
        });
    }
    let unsure = unproven.filter(|_| !DEVMEM_DRIVERS.contains(&driver));
    let passed = passed && unsure.is_none();
    let reason = match unsure {
        Some(release) => unsure_reason(driver, release),
        None if passed => passed_reason(driver, header_split, hds_thresh, unproven),
        None => trial.reason.clone(),
    };
    (trial, passed, reason)
}

/// What a NIC whose trial bind passed still needs: a known driver, header split with
/// hds-thresh 0, flows steered to the bound queues. `unproven`: the kernel release, where it
/// checks the fd before the device (before 6.15), so that only the known list vouches for
/// the driver.
fn passed_reason(
    driver: &str,
    header_split: &str,
    hds_thresh: Option<u32>,
    unproven: Option<&str>,
) -> String {
    let mut r = match unproven {
        None => String::from("the kernel's devmem device checks passed"),
        Some(release) => format!(
            "driver {driver} is on the known list; kernel {release} (before 6.15) checks the \
             dma-buf fd before the device in bind-rx, so the trial bind did not run the device \
             checks"
        ),
    };
    if !DEVMEM_DRIVERS.contains(&driver) {
        r.push_str(&format!(
            "; driver {driver} is not on the known list ({}), a real bind may still fail",
            DEVMEM_DRIVERS.join(", ")
        ));
    }
    match (header_split, hds_thresh) {
        ("enabled", Some(0)) => {}
        ("enabled", _) => r.push_str("; hds-thresh must be 0 (ethtool -G <if> hds-thresh 0)"),
        _ => r.push_str("; header split must be on (ethtool -G <if> tcp-data-split on)"),
    }
    r.push_str("; flows must be steered to the bound queues (ethtool -N/-X)");
    r
}

/// `uname -r`: the kernel this process runs on (empty where it cannot be read).
fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|r| r.trim().to_string())
        .unwrap_or_default()
}

/// Whether kernel `release` (uname -r) checks the device (its queue management ops: the
/// netdev instance lock) before the dma-buf fd in bind-rx, so that a trial bind's EBADF
/// means the device checks passed: 6.15 and later. Before, bind-rx took the fd first, and
/// every present device answered EBADF.
fn checks_device_first(release: &str) -> bool {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    let major = parts.next().and_then(|p| p.parse::<u32>().ok());
    let minor = parts.next().and_then(|p| p.parse::<u32>().ok());
    match (major, minor) {
        (Some(major), Some(minor)) => (major, minor) >= (6, 15),
        _ => true, // not a Linux version string: judge by the answer, as on a current kernel
    }
}

/// Why a trial bind's EBADF proves nothing on kernel `release` for a driver off the list.
fn unsure_reason(driver: &str, release: &str) -> String {
    format!(
        "cannot tell: kernel {release} (before 6.15) checks the dma-buf fd before the device in bind-rx, so the trial bind's EBADF says nothing, and driver {driver} is not on the known list ({}); name the interface to try a real bind",
        DEVMEM_DRIVERS.join(", ")
    )
}

/// Trial bind-rx with fd -1 on rx queue 0, on its own socket (closed on return).
fn trial_bind(ifindex: u32) -> (TrialBind, bool) {
    let result = NetdevClient::open().and_then(|c| c.bind_rx(ifindex, -1, &[0]));
    match result {
        // Cannot happen with fd -1; if it ever did, dropping the binding unbinds at once.
        Ok(binding) => {
            drop(binding);
            (
                TrialBind {
                    errno: None,
                    error: None,
                    message: None,
                    bad_attr: None,
                    reason: "trial bind with fd -1 unexpectedly succeeded (unbound again)".into(),
                },
                true,
            )
        }
        Err(e) => {
            let errno = e.errno();
            let label = errno.map(crate::errno_label);
            let passed = errno == Some(libc::EBADF);
            let reason = match (&e, errno) {
                (_, Some(libc::EPERM)) => format!(
                    "EPERM: cannot tell: the trial bind-rx {}",
                    "needs CAP_NET_ADMIN (run as root)"
                ),
                (NetdevError::Rejected(r), Some(_)) => {
                    format!("{}: {}", label.clone().unwrap_or_default(), r.reason())
                }
                _ => e.reason(),
            };
            let rej = e.rejection();
            (
                TrialBind {
                    errno,
                    error: label,
                    message: rej.and_then(|r| r.message.clone()),
                    bad_attr: rej.and_then(|r| r.bad_attr.map(|a| a.to_string())),
                    reason,
                },
                passed,
            )
        }
    }
}

/// ethtool `rings-get`: (tcp-data-split, hds-thresh); `None` when the driver has no
/// `get_ringparam` (EOPNOTSUPP), "unknown"/None fields when it does not report them.
fn rings(sock: &mut GenlSocket, family: u16, ifindex: u32) -> Option<(String, Option<u32>)> {
    let mut req = ethtool::Request::new().op_rings_get_do();
    // netlink-bindings 0.3.5 numbers ethtool commands as if the family had one id space
    // (it writes 15 = features-set here); ethtool uses directional ids
    // (include/uapi/linux/ethtool_netlink_generated.h), so set the right one.
    req.header_mut().cmd = ETHTOOL_MSG_RINGS_GET;
    req.encode()
        .nested_header()
        .push_dev_index(ifindex)
        .end_nested();
    let mut out = None;
    sock.request(family, req.flags(), req.payload(), &mut |p| {
        let a = ethtool::OpRingsGetDo::decode_reply(p);
        let split = match a.get_tcp_data_split() {
            Ok(1) => "disabled",
            Ok(2) => "enabled",
            _ => "unknown",
        };
        out = Some((split.to_string(), a.get_hds_thresh().ok()));
        Ok(())
    })
    .ok()?;
    out
}

fn sysfs_ifindexes() -> Vec<u32> {
    let mut v: Vec<u32> = std::fs::read_dir("/sys/class/net")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("ifindex")).ok())
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    v.sort_unstable();
    v
}

fn sysfs_queue_counts(dev: &Path) -> (u32, u32) {
    let (mut rx, mut tx) = (0, 0);
    for e in std::fs::read_dir(dev.join("queues"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let n = e.file_name();
        let n = n.to_string_lossy();
        if n.starts_with("rx-") {
            rx += 1;
        } else if n.starts_with("tx-") {
            tx += 1;
        }
    }
    (rx, tx)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ethtool rings-get over our transport: lo has no `get_ringparam` (EOPNOTSUPP → None);
    /// every answer that does come back decodes.
    #[test]
    fn rings_get_runs_for_every_device() {
        let mut sock = GenlSocket::open().unwrap();
        let family = nl::resolve_family(&mut sock, b"ethtool").unwrap().id;
        assert_eq!(rings(&mut sock, family, 1), None);
        for ifindex in sysfs_ifindexes() {
            let r = rings(&mut sock, family, ifindex);
            eprintln!("ifindex {ifindex}: rings {r:?}");
            let name = crate::sys::if_indextoname(ifindex).unwrap_or_default();
            let driver = std::fs::read_link(format!("/sys/class/net/{name}/device/driver"));
            if driver.is_ok_and(|d| d.ends_with("virtio_net")) {
                // virtio_net has get_ringparam but no header split.
                assert_eq!(r, Some(("unknown".to_string(), None)), "{name}");
            }
        }
        let mut req = ethtool::Request::new().op_rings_get_do();
        req.encode().nested_header().push_dev_index(4).end_nested();
        let mut req = ethtool::Request::new().op_rings_get_do();
        req.header_mut().cmd = ETHTOOL_MSG_RINGS_GET;
        req.encode().nested_header().push_dev_index(1).end_nested();
        let e = sock
            .request(family, req.flags(), req.payload(), &mut |_| Ok(()))
            .unwrap_err();
        assert!(
            matches!(
                e,
                nl::NlError::Kernel {
                    errno: libc::EOPNOTSUPP,
                    ..
                }
            ),
            "{e:?}"
        );
    }

    /// A NIC that passed the trial bind is told what it still needs, and only that.
    #[test]
    fn a_passed_bind_still_names_what_the_nic_lacks() {
        let ready = passed_reason("mlx5_core", "enabled", Some(0), None);
        assert_eq!(
            ready,
            "the kernel's devmem device checks passed; flows must be steered to the bound \
             queues (ethtool -N/-X)"
        );
        let r = passed_reason("e1000e", "disabled", None, None);
        assert!(r.contains("driver e1000e is not on the known list"), "{r}");
        assert!(r.contains("tcp-data-split on"), "{r}");
        let r = passed_reason("gve", "enabled", Some(256), None);
        assert!(r.contains("hds-thresh must be 0"), "{r}");
    }

    /// A trial bind answered EBADF, with the netdev layer's own reason for it.
    fn ebadf() -> TrialBind {
        let rejection = crate::netdev::Rejection {
            op: crate::netdev::NetdevOp::BindRx,
            errno: libc::EBADF,
            message: None,
            bad_attr: None,
            missing_attr: None,
            request: crate::netdev::BindRequest::rx(2, -1, &[0]),
        };
        TrialBind {
            errno: Some(libc::EBADF),
            error: Some("EBADF".into()),
            message: None,
            bad_attr: None,
            reason: format!("EBADF: {}", rejection.reason()),
        }
    }

    #[test]
    fn before_6_15_no_reason_says_the_device_checks_passed() {
        // Before, the trial bind's EBADF text said "the device checks passed" on every
        // kernel: on 6.12 `lo` and virtio_net showed it beside a reason of "cannot tell".
        let split = ("enabled", Some(0));
        let (trial, capable, reason) = verdict(ebadf(), true, "virtio_net", split, "6.12.117");
        assert!(!capable);
        assert!(
            reason.starts_with("cannot tell: kernel 6.12.117"),
            "{reason}"
        );
        assert!(!trial.reason.contains("checks passed"), "{}", trial.reason);
        assert!(
            trial.reason.contains("says nothing about the device"),
            "{}",
            trial.reason
        );
        // A driver on the known list counts by the list alone, and says so.
        let (trial, capable, reason) = verdict(ebadf(), true, "gve", split, "6.12.117");
        assert!(capable);
        assert!(!trial.reason.contains("checks passed"), "{}", trial.reason);
        assert!(!reason.contains("checks passed"), "{reason}");
        assert!(
            reason.starts_with("driver gve is on the known list"),
            "{reason}"
        );
        // From 6.15 the EBADF proves the device checks, for any driver.
        let (trial, capable, reason) = verdict(ebadf(), true, "virtio_net", split, "6.18.0");
        assert!(capable);
        assert!(
            trial.reason.ends_with("so the device checks passed"),
            "{}",
            trial.reason
        );
        assert!(
            reason.starts_with("the kernel's devmem device checks passed"),
            "{reason}"
        );
        // A failed trial is its own reason, on any kernel.
        let mut refused = ebadf();
        refused.errno = Some(libc::EOPNOTSUPP);
        refused.reason = "EOPNOTSUPP: the driver has no queue management ops".into();
        let (trial, capable, reason) = verdict(refused.clone(), false, "virtual", split, "");
        assert_eq!(
            (trial, capable, reason),
            (refused.clone(), false, refused.reason)
        );
    }

    #[test]
    fn ebadf_proves_the_device_checks_only_from_6_15() {
        for (release, first) in [
            ("6.12.117-amd64", false),
            ("6.14.0", false),
            ("6.15.0-rc1", true),
            ("6.18.0-1-cloud-amd64", true),
            ("7.0.0", true),
            ("5.15.0-generic", false),
            ("weird", true),
        ] {
            assert_eq!(checks_device_first(release), first, "{release}");
        }
        let r = unsure_reason("virtio_net", "6.12.117-amd64");
        assert!(r.starts_with("cannot tell: kernel 6.12.117-amd64"), "{r}");
        assert!(r.contains("virtio_net") && r.contains("mlx5_core"), "{r}");
    }

    /// Real kernel, root: `lo` is listed, virtual, and fails the trial with EOPNOTSUPP.
    #[test]
    fn probe_reports_lo_as_not_capable() {
        let reports = probe_nics();
        let lo = reports
            .iter()
            .find(|r| r.ifindex == 1)
            .expect("lo in the probe");
        assert_eq!(lo.name, "lo");
        assert_eq!(lo.driver, "virtual");
        assert!(lo.up);
        assert_eq!((lo.rx_queues, lo.tx_queues), (1, 1));
        assert!(!lo.devmem_capable);
        assert_eq!(lo.trial_bind.errno, Some(libc::EOPNOTSUPP), "{lo:?}");
        assert_eq!(lo.trial_bind.bad_attr.as_deref(), Some("ifindex"));
        assert!(
            lo.reason
                .starts_with("EOPNOTSUPP: the driver has no queue management ops"),
            "{}",
            lo.reason
        );
        let json = serde_json::to_string(&reports).unwrap();
        assert!(json.contains("\"devmem_capable\":false"), "{json}");
        eprintln!("{}", serde_json::to_string_pretty(&reports).unwrap());
    }
}
