//! Client for the "netdev" generic-netlink family: dumps and devmem `bind-rx`/`bind-tx`.
//!
//! Kernel interface: `Documentation/netlink/specs/netdev.yaml` and
//! `net/core/netdev-genl.c` (reference devmem.md §3). Encoding and decoding are done by
//! `netlink-bindings` 0.3.5 (generated from the kernel YAML), framed and exchanged by the
//! small blocking transport in `nl.rs`; this module adds typed results, the extack decoding (message, bad and missing
//! attribute) and the binding lifetime:
//!
//! * the family id is dynamic; [`NetdevClient::open`] resolves it with `CTRL_CMD_GETFAMILY`
//!   and keeps the op flags (bind-rx is `GENL_ADMIN_PERM`, bind-tx is not);
//! * a binding lives exactly as long as the netlink socket that created it: the kernel has
//!   no unbind command and unbinds in `netdev_nl_sock_priv_destroy()` when the socket closes.
//!   So [`NetdevClient::bind_rx`] consumes the client and the returned [`RxBinding`] owns the
//!   socket; dropping the binding unbinds;
//! * the ifindex is resolved in the network namespace of the netlink socket, which is fixed
//!   when the socket is created: [`NetdevClient::open_in_netns`] creates it inside another
//!   namespace (from a short-lived thread, so the caller's thread never changes namespace).
#![forbid(unsafe_code)]

use std::fmt;
use std::io;
use std::os::fd::RawFd;
use std::path::Path;

use netlink_bindings::netdev;
use netlink_bindings::traits::NetlinkRequest;
use serde::Serialize;

use crate::nl::{self, GenlSocket, NlError};

/// `NETDEV_CMD_DEV_GET`.
pub const NETDEV_CMD_DEV_GET: u32 = 1;
/// `NETDEV_CMD_PAGE_POOL_GET`.
pub const NETDEV_CMD_PAGE_POOL_GET: u32 = 5;
/// `NETDEV_CMD_QUEUE_GET`.
pub const NETDEV_CMD_QUEUE_GET: u32 = 10;
/// `NETDEV_CMD_NAPI_GET`.
pub const NETDEV_CMD_NAPI_GET: u32 = 11;
/// `NETDEV_CMD_BIND_RX`.
pub const NETDEV_CMD_BIND_RX: u32 = 13;
/// `NETDEV_CMD_BIND_TX` (6.16+).
pub const NETDEV_CMD_BIND_TX: u32 = 15;
/// `GENL_ADMIN_PERM` op flag: the op needs CAP_NET_ADMIN.
pub const GENL_ADMIN_PERM: u32 = 0x1;
/// `NETDEV_QUEUE_TYPE_RX`.
pub const QUEUE_TYPE_RX: u32 = 0;
/// `NETDEV_QUEUE_TYPE_TX`.
pub const QUEUE_TYPE_TX: u32 = 1;

/// `sizeof(struct nlmsghdr)`: extack offsets count from the start of the request message.
const NLMSGHDR_LEN: usize = 16;
/// `sizeof(struct genlmsghdr)`.
const GENLHDR_LEN: usize = 4;
/// `NLA_F_NESTED`.
const NLA_F_NESTED: u16 = 0x8000;
/// `NLA_TYPE_MASK`.
const NLA_TYPE_MASK: u16 = 0x3fff;

/// The netdev operation a result or error belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum NetdevOp {
    /// Socket creation and `CTRL_CMD_GETFAMILY` for "netdev".
    Open,
    /// `dev-get` dump.
    DevGet,
    /// `queue-get` dump.
    QueueGet,
    /// `napi-get` dump.
    NapiGet,
    /// `page-pool-get` dump.
    PagePoolGet,
    /// `bind-rx`.
    BindRx,
    /// `bind-tx`.
    BindTx,
}

impl fmt::Display for NetdevOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Open => "family lookup",
            Self::DevGet => "dev-get",
            Self::QueueGet => "queue-get",
            Self::NapiGet => "napi-get",
            Self::PagePoolGet => "page-pool-get",
            Self::BindRx => "bind-rx",
            Self::BindTx => "bind-tx",
        })
    }
}

/// A netlink attribute named by the kernel's extack (bad or missing), in the attribute set
/// of the op that was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum NetdevAttr {
    /// `ifindex`.
    Ifindex,
    /// `queues` (bind-rx; one nest per queue).
    Queues,
    /// `fd` (the dma-buf fd).
    Fd,
    /// `id` (binding id, queue id or napi id, depending on the op).
    Id,
    /// `type` (queue-get).
    Type,
    /// `rx-page-size` (bind-rx, 7.3+).
    RxPageSize,
    /// `queues.id`: the queue id inside a `queues` nest.
    QueueId,
    /// `queues.type`: the queue type inside a `queues` nest.
    QueueType,
    /// Anything else: the enclosing nest's type (if nested) and the attribute type.
    Other {
        /// Type of the enclosing nest, `None` at top level.
        nest: Option<u16>,
        /// Attribute type.
        attr: u16,
    },
}

impl NetdevAttr {
    fn name(op: NetdevOp, nest: Option<u16>, attr: u16) -> Self {
        use NetdevAttr::*;
        match (op, nest, attr) {
            (NetdevOp::BindRx | NetdevOp::BindTx, None, 1) => Ifindex,
            (NetdevOp::BindRx | NetdevOp::BindTx, None, 2) => Queues,
            (NetdevOp::BindRx | NetdevOp::BindTx, None, 3) => Fd,
            (NetdevOp::BindRx | NetdevOp::BindTx, None, 4) => Id,
            (NetdevOp::BindRx | NetdevOp::BindTx, None, 5) => RxPageSize,
            (NetdevOp::BindRx | NetdevOp::BindTx, Some(2), 1) => QueueId,
            (NetdevOp::BindRx | NetdevOp::BindTx, Some(2), 3) => QueueType,
            (NetdevOp::QueueGet, None, 1) => Id,
            (NetdevOp::QueueGet, None, 2) => Ifindex,
            (NetdevOp::QueueGet, None, 3) => Type,
            (NetdevOp::NapiGet | NetdevOp::DevGet, None, 1) => Ifindex,
            (NetdevOp::NapiGet, None, 2) => Id,
            (NetdevOp::PagePoolGet, None, 1) => Id,
            (NetdevOp::PagePoolGet, None, 2) => Ifindex,
            _ => Other { nest, attr },
        }
    }
}

impl fmt::Display for NetdevAttr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ifindex => f.write_str("ifindex"),
            Self::Queues => f.write_str("queues"),
            Self::Fd => f.write_str("fd"),
            Self::Id => f.write_str("id"),
            Self::Type => f.write_str("type"),
            Self::RxPageSize => f.write_str("rx-page-size"),
            Self::QueueId => f.write_str("queues.id"),
            Self::QueueType => f.write_str("queues.type"),
            Self::Other {
                nest: Some(n),
                attr,
            } => write!(f, "attribute {attr} in nest {n}"),
            Self::Other { nest: None, attr } => write!(f, "attribute {attr}"),
        }
    }
}

/// One queue selector in a bind request: `{id, type}` (`queue-id` attribute set).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct QueueSel {
    /// Queue id.
    pub id: u32,
    /// Queue type (0 = rx, 1 = tx); raw so that tests can send invalid values.
    pub kind: u32,
}

/// The attributes of a `bind-rx` / `bind-tx` request. Each is optional so that the kernel's
/// validation can be exercised; [`BindRequest::rx`] and [`BindRequest::tx`] build complete
/// ones. This is also what a [`Rejection`] reports as "what was asked".
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct BindRequest {
    /// `ifindex`, resolved in the netlink socket's network namespace.
    pub ifindex: Option<u32>,
    /// `fd`: the dma-buf fd (sent as u32; -1 becomes 0xffffffff).
    pub fd: Option<RawFd>,
    /// `queues`, one nest each (bind-rx only).
    pub queues: Vec<QueueSel>,
}

impl BindRequest {
    /// A complete bind-rx request for RX queues `queues` of `ifindex`.
    pub fn rx(ifindex: u32, dmabuf_fd: RawFd, queues: &[u32]) -> Self {
        Self {
            ifindex: Some(ifindex),
            fd: Some(dmabuf_fd),
            queues: queues
                .iter()
                .map(|&id| QueueSel {
                    id,
                    kind: QUEUE_TYPE_RX,
                })
                .collect(),
        }
    }

    /// A complete bind-tx request.
    pub fn tx(ifindex: u32, dmabuf_fd: RawFd) -> Self {
        Self {
            ifindex: Some(ifindex),
            fd: Some(dmabuf_fd),
            queues: Vec::new(),
        }
    }

    /// The ifindex only (for dumps), as "what was asked".
    fn ifindex(ifindex: u32) -> Self {
        Self {
            ifindex: Some(ifindex),
            ..Self::default()
        }
    }
}

impl fmt::Display for BindRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut sep = "";
        if let Some(i) = self.ifindex {
            write!(f, "ifindex {i}")?;
            sep = ", ";
        }
        if let Some(fd) = self.fd {
            write!(f, "{sep}fd {fd}")?;
            sep = ", ";
        }
        if !self.queues.is_empty() {
            write!(f, "{sep}queues [")?;
            for (i, q) in self.queues.iter().enumerate() {
                let kind = match q.kind {
                    QUEUE_TYPE_RX => "rx".to_string(),
                    QUEUE_TYPE_TX => "tx".to_string(),
                    k => format!("type {k}"),
                };
                write!(f, "{}{kind} {}", if i == 0 { "" } else { ", " }, q.id)?;
            }
            f.write_str("]")?;
        }
        Ok(())
    }
}

/// The kernel refused a request: errno plus the extended ack, and what was asked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Rejection {
    /// The operation.
    pub op: NetdevOp,
    /// Positive errno from the `NLMSG_ERROR` reply.
    pub errno: i32,
    /// `NLMSGERR_ATTR_MSG`, if the kernel set one.
    pub message: Option<String>,
    /// The attribute `NLMSGERR_ATTR_OFFS` points at, if any.
    pub bad_attr: Option<NetdevAttr>,
    /// `NLMSGERR_ATTR_MISS_TYPE` (inside `NLMSGERR_ATTR_MISS_NEST` if set), if any.
    pub missing_attr: Option<NetdevAttr>,
    /// What was asked.
    pub request: BindRequest,
}

impl Rejection {
    /// Why, in words, for the common cases (reference devmem.md §4.3 and §5.1).
    pub fn reason(&self) -> String {
        let msg = self.message.as_deref();
        let ifindex = self
            .request
            .ifindex
            .map_or_else(|| "?".to_string(), |i| i.to_string());
        let op = self.op;
        match self.errno {
            libc::EPERM => format!(
                "{op} needs CAP_NET_ADMIN (in the initial user namespace): run as root or grant the capability"
            ),
            libc::EOPNOTSUPP if op == NetdevOp::BindTx => match msg {
                Some(m) => format!("the device cannot do devmem TX: {m}"),
                None => "the driver does not support netmem TX".to_string(),
            },
            libc::EOPNOTSUPP => match msg {
                Some(m) if m.contains("DMA device mismatch") => format!(
                    "{m}: the queues sit on different DMA devices; bind queues of one PCI function only"
                ),
                Some(m) => m.to_string(),
                None => "the driver has no queue management ops (devmem needs gve, bnxt, mlx5, fbnic or idpf)"
                    .to_string(),
            },
            libc::ENODEV => format!(
                "no network device with ifindex {ifindex} in the netlink socket's network namespace"
            ),
            libc::ERANGE => match (self.bad_attr, msg) {
                (_, Some(m)) if m.contains("rx queue index") => {
                    format!("{m}: the queue id is beyond the device's rx queues")
                }
                (Some(NetdevAttr::Ifindex), _) => "ifindex out of range: it must be at least 1".to_string(),
                (Some(NetdevAttr::QueueType), _) => {
                    "queue type out of range: it must be 0 (rx) or 1 (tx)".to_string()
                }
                (Some(a), m) => format!("{a} out of range{}", suffix(m)),
                (None, m) => format!("a value is out of range{}", suffix(m)),
            },
            libc::EINVAL => match (self.missing_attr, self.bad_attr, msg) {
                (Some(a), _, _) => format!(
                    "required attribute {a} is missing ({})",
                    if op == NetdevOp::BindTx {
                        "bind-tx needs ifindex and fd"
                    } else {
                        "bind-rx needs ifindex, fd and at least one rx queue"
                    }
                ),
                (_, _, Some(m)) if m.contains("tcp-data-split") => format!(
                    "{m}: turn header split on (ethtool -G <if> tcp-data-split on)"
                ),
                (_, _, Some(m)) if m.contains("hds-thresh") => {
                    format!("{m}: set the header-split threshold to 0 (ethtool -G <if> hds-thresh 0)")
                }
                (_, Some(a @ (NetdevAttr::Queues | NetdevAttr::QueueId | NetdevAttr::QueueType)), _) => format!(
                    "bad {a}: each queue must be an rx queue of the device with id below its rx queue count"
                ),
                (_, Some(a), m) => format!("invalid {a}{}", suffix(m)),
                (None, None, Some(m)) => m.to_string(),
                (None, None, None) => "invalid argument: the fd is probably not a dma-buf, or the dma-buf is not page aligned".to_string(),
            },
            // Whether the device checks ran before depends on the kernel (6.15+: they did;
            // before, bind-rx took the fd first): the probe says which (`probe::verdict`).
            libc::EBADF => "the fd is not an open file (dma_buf_get failed)".to_string(),
            libc::EEXIST => msg.map_or_else(
                || "the queue already has a memory provider or an XDP program".to_string(),
                str::to_string,
            ),
            libc::EBUSY => msg.map_or_else(|| "the queue is in use by AF_XDP".to_string(), str::to_string),
            libc::ENODATA => "the driver's page pool did not take the memory provider (the driver lacks PP_FLAG_ALLOW_UNREADABLE_NETMEM)".to_string(),
            libc::ENOMEM => "out of memory while mapping the dma-buf".to_string(),
            e => msg.map_or_else(|| io::Error::from_raw_os_error(e).to_string(), str::to_string),
        }
    }
}

fn suffix(msg: Option<&str>) -> String {
    msg.map(|m| format!(": {m}")).unwrap_or_default()
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "netdev {} ({}) rejected with {}",
            self.op,
            self.request,
            crate::errno_label(self.errno)
        )?;
        if let Some(m) = &self.message {
            write!(f, ", kernel says {m:?}")?;
        }
        if let Some(a) = self.bad_attr {
            write!(f, ", bad attribute {a}")?;
        }
        if let Some(a) = self.missing_attr {
            write!(f, ", missing attribute {a}")?;
        }
        write!(f, ": {}", self.reason())
    }
}

impl std::error::Error for Rejection {}

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum NetdevError {
    /// Creating the netlink socket, resolving the family or the socket I/O failed.
    #[error("netdev netlink {op}: {source}")]
    Socket {
        /// The operation.
        op: NetdevOp,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The kernel rejected the request (`NLMSG_ERROR` with a non-zero errno).
    #[error(transparent)]
    Rejected(Box<Rejection>),
    /// A reply lacked a required attribute or could not be decoded.
    #[error("netdev netlink {op}: malformed reply: {detail}")]
    Malformed {
        /// The operation.
        op: NetdevOp,
        /// What was wrong.
        detail: String,
    },
}

impl NetdevError {
    /// The errno, for kernel rejections and OS-level socket errors.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Self::Socket { source, .. } => source.raw_os_error(),
            Self::Rejected(r) => Some(r.errno),
            Self::Malformed { .. } => None,
        }
    }

    /// The kernel's rejection, if that is what this is.
    pub fn rejection(&self) -> Option<&Rejection> {
        match self {
            Self::Rejected(r) => Some(r),
            _ => None,
        }
    }

    /// Why, in words.
    pub fn reason(&self) -> String {
        match self {
            Self::Rejected(r) => r.reason(),
            Self::Socket { source, .. } if source.kind() == io::ErrorKind::Unsupported => {
                "the kernel has no \"netdev\" generic netlink family (devmem needs Linux 6.12+)"
                    .to_string()
            }
            Self::Socket { source, .. } => {
                format!("cannot talk to the kernel over netlink: {source}")
            }
            Self::Malformed { detail, .. } => format!("unexpected reply from the kernel: {detail}"),
        }
    }
}

fn socket_err(op: NetdevOp) -> impl FnOnce(io::Error) -> NetdevError {
    move |source| NetdevError::Socket { op, source }
}

/// Turn a transport error into ours: errno, extack message, bad/missing attribute located
/// in `payload`, the request as sent (genl header + attributes).
fn rejected(op: NetdevOp, asked: &BindRequest, payload: &[u8], e: NlError) -> NetdevError {
    let (errno, extack) = match e {
        NlError::Io(source) => return NetdevError::Socket { op, source },
        NlError::Malformed(detail) => return NetdevError::Malformed { op, detail },
        NlError::Kernel { errno, extack } => (errno, extack),
    };
    let bad_attr = extack
        .offs
        .and_then(|off| locate_attr(payload, off as usize))
        .map(|(n, t)| NetdevAttr::name(op, n, t));
    let missing_attr = extack.miss_type.map(|ty| {
        let nest = extack
            .miss_nest
            .and_then(|off| locate_attr(payload, off as usize))
            .map(|(_, t)| t);
        NetdevAttr::name(op, nest, ty)
    });
    NetdevError::Rejected(Box::new(Rejection {
        op,
        errno,
        message: extack.msg,
        bad_attr,
        missing_attr,
        request: asked.clone(),
    }))
}

fn decode_err(e: netlink_bindings::utils::ErrorContext) -> String {
    e.to_string()
}

/// A NAPI instance from its `napi-get` reply (do or dump).
fn napi_info(n: &netdev::IterableNapi<'_>) -> Result<NapiInfo, String> {
    Ok(NapiInfo {
        id: n.get_id().map_err(decode_err)?,
        ifindex: n.get_ifindex().map_err(decode_err)?,
        irq: n.get_irq().ok(),
        pid: n.get_pid().ok(),
        threaded: n.get_threaded().ok(),
    })
}

/// Find the attribute at `offset` (extack offsets count from the request's `nlmsghdr`)
/// in `request`, the request as sent without its `nlmsghdr` (genl header + attributes).
/// Returns `(enclosing nest type, attribute type)`; one level of nesting is enough for the
/// netdev family.
fn locate_attr(request: &[u8], offset: usize) -> Option<(Option<u16>, u16)> {
    let target = offset.checked_sub(NLMSGHDR_LEN)?;
    let walk = |from: usize, to: usize| -> Option<(usize, u16, usize)> {
        // Returns (attr start, type, attr len) of the attribute containing `target`.
        let mut pos = from;
        while pos + 4 <= to {
            let len = usize::from(u16::from_ne_bytes([request[pos], request[pos + 1]]));
            let ty = u16::from_ne_bytes([request[pos + 2], request[pos + 3]]);
            if len < 4 || pos + len > to {
                return None;
            }
            if (pos..pos + len).contains(&target) {
                return Some((pos, ty, len));
            }
            pos += (len + 3) & !3;
        }
        None
    };
    let (pos, ty, len) = walk(GENLHDR_LEN, request.len())?;
    if pos == target {
        return Some((None, ty & NLA_TYPE_MASK));
    }
    if ty & NLA_F_NESTED != 0 {
        let (ipos, ity, _) = walk(pos + 4, pos + len)?;
        if ipos == target {
            return Some((Some(ty & NLA_TYPE_MASK), ity & NLA_TYPE_MASK));
        }
    }
    None
}

/// One generic-netlink op of the family, as `CTRL_CMD_GETFAMILY` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct GenlOp {
    /// Command number (`NETDEV_CMD_*`).
    pub cmd: u32,
    /// `GENL_*` flags (admin-perm 0x1, do 0x2, dump 0x4, has-policy 0x8).
    pub flags: u32,
}

/// `dev-get` reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DevInfo {
    /// ifindex.
    pub ifindex: u32,
    /// `xdp-features` (xdp-act flags).
    pub xdp_features: u64,
    /// `xdp-zc-max-segs`.
    pub xdp_zc_max_segs: Option<u32>,
    /// `xsk-features`.
    pub xsk_features: u64,
}

/// Queue direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum QueueType {
    /// Receive queue.
    Rx,
    /// Transmit queue.
    Tx,
    /// A value this crate does not know.
    Other(u32),
}

impl From<u32> for QueueType {
    fn from(v: u32) -> Self {
        match v {
            QUEUE_TYPE_RX => Self::Rx,
            QUEUE_TYPE_TX => Self::Tx,
            v => Self::Other(v),
        }
    }
}

/// `queue-get` reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct QueueInfo {
    /// Queue id.
    pub id: u32,
    /// ifindex.
    pub ifindex: u32,
    /// rx or tx.
    pub kind: QueueType,
    /// `napi-id`, if the queue has a NAPI instance.
    pub napi_id: Option<u32>,
    /// `dmabuf`: the devmem binding id, if the queue is bound.
    pub dmabuf: Option<u32>,
    /// An io_uring zcrx instance is bound.
    pub io_uring: bool,
    /// An AF_XDP socket uses the queue.
    pub xsk: bool,
}

/// `napi-get` reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NapiInfo {
    /// NAPI id.
    pub id: u32,
    /// ifindex.
    pub ifindex: u32,
    /// IRQ, if any.
    pub irq: Option<u32>,
    /// Thread pid when threaded.
    pub pid: Option<u32>,
    /// `threaded` (0/1).
    pub threaded: Option<u32>,
}

/// `page-pool-get` reply. The `uint` attributes may be 4 or 8 bytes and are read as such.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PagePoolInfo {
    /// Page pool id.
    pub id: u64,
    /// ifindex (absent once the netdev is gone).
    pub ifindex: Option<u32>,
    /// NAPI id.
    pub napi_id: Option<u64>,
    /// Pages in flight.
    pub inflight: Option<u64>,
    /// Bytes in flight.
    pub inflight_mem: Option<u64>,
    /// Set once the driver detached the pool.
    pub detach_time: Option<u64>,
    /// Devmem binding id, if the pool has a dma-buf provider.
    pub dmabuf: Option<u32>,
    /// An io_uring zcrx provider is installed.
    pub io_uring: bool,
}

/// A page pool from the attributes of its `page-pool-get` reply. Read raw: the `uint`
/// attributes may be 8 bytes, the bindings read 4. An id of another length is refused rather
/// than read as pool 0 (other attributes of a bad length read as absent).
fn page_pool_info(attrs: &[u8]) -> Result<PagePoolInfo, String> {
    let mut info = PagePoolInfo {
        id: 0,
        ifindex: None,
        napi_id: None,
        inflight: None,
        inflight_mem: None,
        detach_time: None,
        dmabuf: None,
        io_uring: false,
    };
    let mut id = None;
    for (ty, payload) in nl::attrs(attrs) {
        match ty {
            1 => {
                id = Some(nla_uint(payload).ok_or_else(|| {
                    format!(
                        "page pool id attribute of {} bytes (a netlink uint has 4 or 8)",
                        payload.len()
                    )
                })?);
            }
            2 => info.ifindex = nla_uint(payload).map(|v| v as u32),
            3 => info.napi_id = nla_uint(payload),
            4 => info.inflight = nla_uint(payload),
            5 => info.inflight_mem = nla_uint(payload),
            6 => info.detach_time = nla_uint(payload),
            7 => info.dmabuf = nla_uint(payload).map(|v| v as u32),
            8 => info.io_uring = true,
            _ => {}
        }
    }
    info.id = id.ok_or("page pool without id")?;
    Ok(info)
}

/// A netlink `uint` (4 or 8 bytes).
fn nla_uint(p: &[u8]) -> Option<u64> {
    match p.len() {
        4 => Some(u64::from(u32::from_ne_bytes(p.try_into().ok()?))),
        8 => Some(u64::from_ne_bytes(p.try_into().ok()?)),
        _ => None,
    }
}

/// A netdev generic-netlink socket, with the family resolved.
pub struct NetdevClient {
    sock: GenlSocket,
    family_id: u16,
    version: u32,
    ops: Vec<GenlOp>,
}

impl fmt::Debug for NetdevClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NetdevClient")
            .field("family_id", &self.family_id)
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

impl NetdevClient {
    /// Create the socket (in the calling thread's network namespace) and resolve the
    /// "netdev" family.
    pub fn open() -> Result<Self, NetdevError> {
        let op = NetdevOp::Open;
        let mut sock = GenlSocket::open().map_err(socket_err(op))?;
        let fam = nl::resolve_family(&mut sock, b"netdev").map_err(|e| match e {
            // The controller answers ENOENT for an unknown family.
            NlError::Kernel {
                errno: libc::ENOENT,
                ..
            } => NetdevError::Socket {
                op,
                source: io::ErrorKind::Unsupported.into(),
            },
            e => rejected(op, &BindRequest::default(), &[], e),
        })?;
        Ok(Self {
            sock,
            family_id: fam.id,
            version: fam.version,
            ops: fam
                .ops
                .into_iter()
                .map(|(cmd, flags)| GenlOp { cmd, flags })
                .collect(),
        })
    }

    /// Like [`NetdevClient::open`], but the socket is created inside the network namespace
    /// at `netns` (e.g. `/var/run/netns/NAME` or `/proc/PID/ns/net`). A short-lived thread
    /// enters the namespace and creates the socket; the caller's thread is not moved. The
    /// socket, and every ifindex it resolves, stays in that namespace.
    pub fn open_in_netns(netns: &Path) -> Result<Self, NetdevError> {
        crate::sys::in_netns(netns, Self::open).map_err(socket_err(NetdevOp::Open))?
    }

    /// The dynamic family id.
    pub fn family_id(&self) -> u16 {
        self.family_id
    }

    /// The family version (1).
    pub fn family_version(&self) -> u32 {
        self.version
    }

    /// The ops the kernel registered, with their flags.
    pub fn ops(&self) -> &[GenlOp] {
        &self.ops
    }

    /// The flags of op `cmd`, if the kernel has it.
    pub fn op_flags(&self, cmd: u32) -> Option<u32> {
        self.ops.iter().find(|o| o.cmd == cmd).map(|o| o.flags)
    }

    /// Send `req` and decode each reply with `each`.
    fn exec<R: NetlinkRequest>(
        &mut self,
        op: NetdevOp,
        req: &R,
        asked: &BindRequest,
        mut each: impl for<'b> FnMut(R::ReplyType<'b>) -> Result<(), String>,
    ) -> Result<(), NetdevError> {
        self.sock
            .request(self.family_id, req.flags(), req.payload(), &mut |p| {
                each(R::decode_reply(p))
            })
            .map_err(|e| rejected(op, asked, req.payload(), e))
    }

    /// `dev-get` dump: every netdev in the socket's namespace.
    pub fn dev_get_dump(&mut self) -> Result<Vec<DevInfo>, NetdevError> {
        let req = netdev::Request::new().op_dev_get_dump();
        let mut out = Vec::new();
        self.exec(NetdevOp::DevGet, &req, &BindRequest::default(), |d| {
            out.push(DevInfo {
                ifindex: d.get_ifindex().map_err(decode_err)?,
                xdp_features: d.get_xdp_features().unwrap_or(0),
                xdp_zc_max_segs: d.get_xdp_zc_max_segs().ok(),
                xsk_features: d.get_xsk_features().unwrap_or(0),
            });
            Ok(())
        })?;
        Ok(out)
    }

    /// `queue-get` dump for one device. The kernel lists only the queues of a device that is
    /// up; a down device gives an empty list. An unknown ifindex gives ENODEV.
    pub fn queue_get_dump(&mut self, ifindex: u32) -> Result<Vec<QueueInfo>, NetdevError> {
        let mut req = netdev::Request::new().op_queue_get_dump();
        req.encode().push_ifindex(ifindex);
        let mut out = Vec::new();
        self.exec(
            NetdevOp::QueueGet,
            &req,
            &BindRequest::ifindex(ifindex),
            |q| {
                out.push(QueueInfo {
                    id: q.get_id().map_err(decode_err)?,
                    ifindex: q.get_ifindex().map_err(decode_err)?,
                    kind: q.get_type().map_err(decode_err)?.into(),
                    napi_id: q.get_napi_id().ok(),
                    dmabuf: q.get_dmabuf().ok(),
                    io_uring: q.get_io_uring().is_ok(),
                    xsk: q.get_xsk().is_ok(),
                });
                Ok(())
            },
        )?;
        Ok(out)
    }

    /// `napi-get` dump for one device.
    pub fn napi_get_dump(&mut self, ifindex: u32) -> Result<Vec<NapiInfo>, NetdevError> {
        let mut req = netdev::Request::new().op_napi_get_dump();
        req.encode().push_ifindex(ifindex);
        let mut out = Vec::new();
        self.exec(
            NetdevOp::NapiGet,
            &req,
            &BindRequest::ifindex(ifindex),
            |n| {
                out.push(napi_info(&n)?);
                Ok(())
            },
        )?;
        Ok(out)
    }

    /// `napi-get` of one NAPI instance by its id (what `SO_INCOMING_NAPI_ID` reads off a
    /// socket); `None` when the kernel has no instance of that id (its device went, or was
    /// reconfigured and its instances were made anew): ENOENT, or EINVAL from Linux 6.8,
    /// whose `napi-get` answered an unknown id so (the request has no other attribute to be
    /// invalid).
    pub fn napi_get(&mut self, id: u32) -> Result<Option<NapiInfo>, NetdevError> {
        let mut req = netdev::Request::new().op_napi_get_do();
        req.encode().push_id(id);
        let mut out = None;
        let got = self.exec(NetdevOp::NapiGet, &req, &BindRequest::default(), |n| {
            out = Some(napi_info(&n)?);
            Ok(())
        });
        match got {
            Err(e) if matches!(e.errno(), Some(libc::ENOENT | libc::EINVAL)) => Ok(None),
            Err(e) => Err(e),
            Ok(()) => Ok(out),
        }
    }

    /// `page-pool-get` dump: every page pool in the socket's namespace.
    pub fn page_pool_get_dump(&mut self) -> Result<Vec<PagePoolInfo>, NetdevError> {
        let req = netdev::Request::new().op_page_pool_get_dump();
        let mut out = Vec::new();
        self.exec(NetdevOp::PagePoolGet, &req, &BindRequest::default(), |p| {
            out.push(page_pool_info(p.get_buf())?);
            Ok(())
        })?;
        Ok(out)
    }

    /// `bind-rx`: bind the dma-buf `dmabuf_fd` to RX `queues` of `ifindex`. Consumes the
    /// client, because the binding lives as long as this netlink socket.
    pub fn bind_rx(
        self,
        ifindex: u32,
        dmabuf_fd: RawFd,
        queues: &[u32],
    ) -> Result<RxBinding, NetdevError> {
        self.bind_rx_request(&BindRequest::rx(ifindex, dmabuf_fd, queues))
    }

    /// `bind-rx` with an explicit (possibly incomplete or invalid) request.
    pub fn bind_rx_request(mut self, request: &BindRequest) -> Result<RxBinding, NetdevError> {
        let mut req = netdev::Request::new().op_bind_rx_do();
        {
            let mut enc = req.encode();
            if let Some(i) = request.ifindex {
                enc = enc.push_ifindex(i);
            }
            if let Some(fd) = request.fd {
                enc = enc.push_fd(fd as u32);
            }
            for q in &request.queues {
                enc = enc
                    .nested_queues()
                    .push_id(q.id)
                    .push_type(q.kind)
                    .end_nested();
            }
        }
        let id = self.bind_id(NetdevOp::BindRx, &req, request)?;
        Ok(RxBinding {
            client: self,
            id,
            request: request.clone(),
        })
    }

    /// `bind-tx`: bind the dma-buf `dmabuf_fd` for devmem TX on `ifindex`. Consumes the
    /// client, because the binding lives as long as this netlink socket.
    pub fn bind_tx(self, ifindex: u32, dmabuf_fd: RawFd) -> Result<TxBinding, NetdevError> {
        self.bind_tx_request(&BindRequest::tx(ifindex, dmabuf_fd))
    }

    /// `bind-tx` with an explicit request (`queues` is ignored).
    pub fn bind_tx_request(mut self, request: &BindRequest) -> Result<TxBinding, NetdevError> {
        let mut req = netdev::Request::new().op_bind_tx_do();
        {
            let mut enc = req.encode();
            if let Some(i) = request.ifindex {
                enc = enc.push_ifindex(i);
            }
            if let Some(fd) = request.fd {
                let _ = enc.push_fd(fd as u32);
            }
        }
        let id = self.bind_id(NetdevOp::BindTx, &req, request)?;
        Ok(TxBinding {
            client: self,
            id,
            request: request.clone(),
        })
    }

    /// Both bind ops reply with the `dmabuf` attribute set carrying only `id`.
    fn bind_id<R>(&mut self, op: NetdevOp, req: &R, asked: &BindRequest) -> Result<u32, NetdevError>
    where
        R: for<'b> NetlinkRequest<ReplyType<'b> = netdev::IterableDmabuf<'b>>,
    {
        let mut id = None;
        self.exec(op, req, asked, |d| {
            id = Some(d.get_id().map_err(decode_err)?);
            Ok(())
        })?;
        id.ok_or_else(|| NetdevError::Malformed {
            op,
            detail: "no reply with the binding id".into(),
        })
    }
}

/// A devmem RX binding. It owns the netlink socket that created it: dropping the binding
/// closes the socket and the kernel unbinds (restarting the queues with ordinary pages).
pub struct RxBinding {
    client: NetdevClient,
    id: u32,
    request: BindRequest,
}

impl fmt::Debug for RxBinding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RxBinding")
            .field("id", &self.id)
            .field("request", &self.request)
            .finish_non_exhaustive()
    }
}

impl RxBinding {
    /// The binding id (`NETDEV_A_DMABUF_ID`); frags carry it as `dmabuf_id`.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// The bound device.
    pub fn ifindex(&self) -> u32 {
        self.request.ifindex.unwrap_or(0)
    }

    /// The bound RX queues.
    pub fn queues(&self) -> impl Iterator<Item = u32> + '_ {
        self.request.queues.iter().map(|q| q.id)
    }

    /// The binding's socket, e.g. to check with `queue_get_dump` that the queues show
    /// `dmabuf = id`. Do not move it out: the binding lives with it.
    pub fn client(&mut self) -> &mut NetdevClient {
        &mut self.client
    }

    /// Unbind now (same as dropping).
    pub fn unbind(self) {}
}

/// A devmem TX binding; like [`RxBinding`], dropping it unbinds.
pub struct TxBinding {
    client: NetdevClient,
    id: u32,
    request: BindRequest,
}

impl fmt::Debug for TxBinding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TxBinding")
            .field("id", &self.id)
            .field("request", &self.request)
            .finish_non_exhaustive()
    }
}

impl TxBinding {
    /// The binding id to put in the `SCM_DEVMEM_DMABUF` cmsg of `sendmsg`.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// The bound device.
    pub fn ifindex(&self) -> u32 {
        self.request.ifindex.unwrap_or(0)
    }

    /// The binding's socket.
    pub fn client(&mut self) -> &mut NetdevClient {
        &mut self.client
    }

    /// Unbind now (same as dropping).
    pub fn unbind(self) {}
}

/// `bind-rx` on a fresh netlink socket in the calling thread's network namespace.
pub fn bind_rx(ifindex: u32, dmabuf_fd: RawFd, queues: &[u32]) -> Result<RxBinding, NetdevError> {
    NetdevClient::open()?.bind_rx(ifindex, dmabuf_fd, queues)
}

/// `bind-tx` on a fresh netlink socket in the calling thread's network namespace.
pub fn bind_tx(ifindex: u32, dmabuf_fd: RawFd) -> Result<TxBinding, NetdevError> {
    NetdevClient::open()?.bind_tx(ifindex, dmabuf_fd)
}

#[cfg(test)]
mod tests;
