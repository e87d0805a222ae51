//! The HTTP server under the admin and trainer APIs, with a bound on every connection state:
//! at most `http_max_connections` connections are served at once, and [`RESERVE`] more
//! that answer only the admin and probe routes (so trainers' long polls cannot starve
//! `/healthz`, `/metrics` or `/v1/drain`; more wait in the kernel's backlog), a request head
//! must arrive within `http_header_timeout_secs` (hyper's header-read timer; it also ends an
//! idle keep-alive connection, counted apart as `phase="idle"`), a request body within
//! `http_body_timeout_secs` (read here, before any handler runs, up to [`BODY_LIMIT`] for an
//! open, [`SMALL_BODY_LIMIT`] elsewhere), and a write of the answer may wait for the client at
//! most `http_write_timeout_secs` without progress ([`super::stall`]).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use shardwire_config::ServeConfig;
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

use shardwire_protocol::trainer::{ErrorCode, MAX_TRAINER_FRAME};

use super::copies::{GRACE, MIN_RATE};
use super::error::ApiError;
use super::stall::{Floor, Unanswered, WriteStall, stall_phase};

/// The floor under a backed-up connection: half a download's rate after its grace, over
/// windows of the grace, counted only while the server's writes wait for the client (across
/// hyper's flush after every 1 MiB piece; not between answers). Per window, unlike a
/// download's deadline (its grace plus its length at the full rate, in all): a download read
/// at under 512 KiB/s over 30 s of the server waiting on it ends even where its deadline is
/// further off.
const FLOOR: Floor = Floor {
    window: GRACE,
    bytes: MIN_RATE * GRACE.as_secs() / 2,
};

/// Largest request body of an open (`POST /v1/streams`): the trainer socket's frame limit, so
/// that every `attach` the socket takes opens over HTTP too (a resumed mixture of 256 datasets
/// with 255-byte names is over 64 KiB).
pub const BODY_LIMIT: usize = MAX_TRAINER_FRAME;

/// Largest request body on every other route (a `next`, a release, a binding): small, so that
/// the connections a client may hold buffer little before any handler runs.
pub const SMALL_BODY_LIMIT: usize = 64 << 10;

/// The body limit of `req`'s route.
fn body_limit(req: &Request) -> usize {
    match req.method() == axum::http::Method::POST && req.uri().path() == "/v1/streams" {
        true => BODY_LIMIT,
        false => SMALL_BODY_LIMIT,
    }
}

/// Connections served beyond `http_max_connections` while those are all in use, for the
/// admin and probe routes only: a trainer route there answers `503 unavailable`.
pub const RESERVE: usize = 8;

/// Marks the requests of a connection served on a [`RESERVE`] slot (the trainer router
/// refuses them).
#[derive(Clone, Copy, Debug)]
pub struct OnReserve;

/// The bounds the server enforces.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections served at once.
    pub max_connections: usize,
    /// Time for a request head (and for an idle keep-alive connection's next one).
    pub header_timeout: Duration,
    /// Time for a request body.
    pub body_timeout: Duration,
    /// Time a write of an answer may make no progress (a client that stopped reading).
    pub write_timeout: Duration,
}

impl Limits {
    /// The limits a node is configured with.
    pub fn from_config(cfg: &ServeConfig) -> Self {
        Self {
            max_connections: cfg.http_max_connections,
            header_timeout: Duration::from_secs(cfg.http_header_timeout_secs),
            body_timeout: Duration::from_secs(cfg.http_body_timeout_secs),
            write_timeout: Duration::from_secs(cfg.http_write_timeout_secs),
        }
    }
}

/// Whether a connection came from this host ([`from_this_host`]).
#[derive(Clone, Copy, Debug)]
struct FromThisHost(bool);

/// Whether a connection from `peer`, accepted on a socket whose own address is `local`, comes
/// from this host: a loopback peer, or a peer at the socket's own address (a process here that
/// dialled one of the host's other addresses, say its LAN address on a wildcard listener: the
/// kernel gives the connection that address as its source too). An unknown `local` counts as
/// this host (the `Host` check then applies: it refuses names, never addresses).
fn from_this_host(peer: IpAddr, local: Option<IpAddr>) -> bool {
    let peer = peer.to_canonical();
    peer.is_loopback() || local.is_none_or(|l| l.to_canonical() == peer)
}

/// A request from this host ([`from_this_host`]) must name this host in `Host`: `localhost`
/// or an IP address. A web page whose name an attacker rebinds to 127.0.0.1, or to the host's
/// LAN address (DNS rebinding), is same-origin to the browser, which then sends no `Origin` on
/// its GETs and lets it read the answers (tensor bytes, the node's status); its requests name
/// that name. Judged per connection, so a node listening on a wildcard address (which
/// loopback and the host's own addresses reach too) is covered. A process that binds its
/// source to another of the host's addresses than the one it dials is judged remote (a
/// browser does not).
async fn addressed_to_this_host(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    if !req.extensions().get::<FromThisHost>().is_some_and(|l| l.0) {
        return next.run(req).await;
    }
    let host = req
        .headers()
        .get(axum::http::header::HOST)
        .map(|h| String::from_utf8_lossy(h.as_bytes()).into_owned());
    match host {
        Some(h) if !local_host_name(&h) => ApiError::new(
            ErrorCode::Forbidden,
            format!(
                "Host `{h}`: from this host the node answers requests addressed to localhost \
                 or an IP address only (a web page whose name resolves to this host must not \
                 read it): use http://localhost:PORT or http://ADDRESS:PORT"
            ),
        )
        .into_response(),
        _ => next.run(req).await,
    }
}

/// Whether `host` (a `Host` header: name or address, with or without a port) is `localhost`
/// (or a name under it) or an IP address.
fn local_host_name(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(v6) => {
            return v6
                .split(']')
                .next()
                .is_some_and(|a| a.parse::<std::net::Ipv6Addr>().is_ok());
        }
        None => host
            .rsplit_once(':')
            .map_or(host, |(n, port)| match port.parse::<u16>() {
                Ok(_) => n,
                Err(_) => host,
            }),
    };
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    name == "localhost" || name.ends_with(".localhost") || name.parse::<std::net::IpAddr>().is_ok()
}

/// How long a shutdown waits for connections to finish their current request.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// Serves `app` on `listener` until `shutdown` turns true; connections in progress are asked
/// to finish their current request, and this returns once they have (or after
/// [`SHUTDOWN_GRACE`]), so an answer such as the one to `POST /v1/drain` is not cut off.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    limits: Limits,
    mut shutdown: watch::Receiver<bool>,
) {
    let app = with_checks(app, limits);
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let reserve = Arc::new(Semaphore::new(RESERVE));
    loop {
        let (mut permit, mut reserved) = tokio::select! {
            biased;
            p = Arc::clone(&slots).acquire_owned() => (p.expect("never closed"), false),
            p = Arc::clone(&reserve).acquire_owned() => (p.expect("never closed"), true),
            _ = shutdown.changed() => break,
        };
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "HTTP accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = shutdown.changed() => break,
        };
        // A slot may have come free while this one waited for its connection.
        if reserved && let Ok(p) = Arc::clone(&slots).try_acquire_owned() {
            (permit, reserved) = (p, false);
        }
        let local = stream.local_addr().ok().map(|a| a.ip());
        let svc = connection_service(&app, reserved, from_this_host(peer.ip(), local));
        let stop = shutdown.clone();
        tokio::spawn(run_connection(stream, peer, svc, limits, stop, permit));
    }
    wait_for_connections(&slots, &reserve, limits.max_connections).await;
}

/// `app` behind the server's checks, outermost first: a reserve connection closed after
/// its answer (whoever made it: the checks' own `403`, `413`, `400` and `408` too), the
/// `Host` of a request from this host, and the body read whole within its timeout. (The last
/// `layer` is the outermost.)
fn with_checks(app: Router, limits: Limits) -> Router {
    app.layer(axum::middleware::from_fn_with_state(limits, bounded_body))
        .layer(axum::middleware::from_fn(addressed_to_this_host))
        .layer(axum::middleware::from_fn(close_reserve_connections))
}

/// The app for one connection, marked when it came from this host (`this_host`) and when it
/// holds a [`RESERVE`] slot.
fn connection_service(
    app: &Router,
    reserved: bool,
    this_host: bool,
) -> TowerToHyperService<Router> {
    let local = axum::Extension(FromThisHost(this_host));
    match reserved {
        true => {
            TowerToHyperService::new(app.clone().layer(axum::Extension(OnReserve)).layer(local))
        }
        false => TowerToHyperService::new(app.clone().layer(local)),
    }
}

/// Serves one connection until it ends (once `stop` turns, after its current request);
/// `permit`, its slot, is given back then.
async fn run_connection(
    stream: TcpStream,
    peer: SocketAddr,
    svc: TowerToHyperService<Router>,
    limits: Limits,
    mut stop: watch::Receiver<bool>,
    permit: OwnedSemaphorePermit,
) {
    let io = WriteStall::new(stream, limits.write_timeout).with_floor(FLOOR);
    let unanswered = io.unanswered();
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .serve_connection(TokioIo::new(io), svc);
    tokio::pin!(conn);
    let done = tokio::select! {
        r = conn.as_mut() => r,
        _ = stop.changed() => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = done {
        connection_failed(peer, &e, &unanswered);
    }
    drop(permit);
}

/// Which of the server's limits ended a connection, as `shardwire_http_timeouts_total` names
/// it: hyper's header timer is `"header"` when the client had sent part of a request (a head
/// that began and did not finish: a slow client or a slowloris) and `"idle"` when it had sent
/// nothing since its last answer (a kept-alive connection between requests, or a new one that
/// never sent a byte); a write limit is [`stall_phase`]'s. Two limits of the split: hyper's
/// timer runs from the connection's start or its last answer, not from a head's first byte;
/// and a head's start pipelined before the last answer went out counts as `"idle"`
/// ([`Unanswered`]).
fn timeout_phase(e: &hyper::Error, unanswered: &Unanswered) -> Option<&'static str> {
    match e.is_timeout() {
        true if unanswered.get() => Some("header"),
        true => Some("idle"),
        false => stall_phase(e),
    }
}

/// Counts a connection that a timeout ended, by phase, and logs why a connection ended.
fn connection_failed(peer: SocketAddr, e: &hyper::Error, unanswered: &Unanswered) {
    let phase = timeout_phase(e, unanswered);
    if let Some(phase) = phase {
        metrics::counter!("shardwire_http_timeouts_total", "phase" => phase).increment(1);
    }
    match phase {
        Some("header") => tracing::debug!(
            %peer,
            "HTTP connection closed: a request head did not finish within the header timeout"
        ),
        Some("idle") => {
            tracing::trace!(%peer, "HTTP connection closed: idle for the header timeout")
        }
        Some(_) => tracing::warn!(
            %peer,
            error = %e,
            "HTTP connection closed: the client stopped reading its answer, or read it at a trickle"
        ),
        None => tracing::debug!(%peer, error = %e, "HTTP connection ended with an error"),
    }
}

/// Waits, at most [`SHUTDOWN_GRACE`], until every connection has ended: each holds a permit
/// of `slots` or `reserve` until then.
async fn wait_for_connections(slots: &Semaphore, reserve: &Semaphore, max_connections: usize) {
    let all = u32::try_from(max_connections).unwrap_or(u32::MAX);
    let _ = tokio::time::timeout(SHUTDOWN_GRACE, async {
        let _ = slots.acquire_many(all).await;
        let _ = reserve.acquire_many(RESERVE as u32).await;
    })
    .await;
}

/// Every answer on a [`RESERVE`] connection closes it, so a keep-alive client does not hold a
/// reserve slot: the outermost check ([`with_checks`]), so the other checks' refusals close
/// it too. (The trainer routes refuse such requests: `trainer::refuse_on_reserve`.)
async fn close_reserve_connections(req: Request, next: Next) -> Response {
    let reserved = req.extensions().get::<OnReserve>().is_some();
    let mut answer = next.run(req).await;
    if reserved {
        answer.headers_mut().insert(
            axum::http::header::CONNECTION,
            axum::http::HeaderValue::from_static("close"),
        );
    }
    answer
}

/// Reads the whole request body within the body timeout (and its route's limit) before the
/// handler runs: a client that promises more than it sends gets `408` instead of holding
/// the handler.
async fn bounded_body(State(limits): State<Limits>, req: Request, next: Next) -> Response {
    let declared = req
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let limit = body_limit(&req);
    if let Some(n) = declared.filter(|&n| n > limit as u64) {
        let msg = format!("the request body is {n} bytes; at most {limit} are accepted here");
        return ApiError::bad_request(msg)
            .with_status(StatusCode::PAYLOAD_TOO_LARGE)
            .into_response();
    }
    let (parts, body) = req.into_parts();
    let read = axum::body::to_bytes(body, limit);
    match tokio::time::timeout(limits.body_timeout, read).await {
        Ok(Ok(bytes)) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        Ok(Err(e)) => {
            // Over the limit (a chunked body says its length only as it comes): 413; a body
            // that is not well-formed HTTP (a bad chunk header): 400.
            let e = e.into_inner();
            let too_large = e
                .downcast_ref::<http_body_util::LengthLimitError>()
                .is_some();
            let status = match too_large {
                true => StatusCode::PAYLOAD_TOO_LARGE,
                false => StatusCode::BAD_REQUEST,
            };
            ApiError::bad_request(format!(
                "cannot read the request body (at most {limit} bytes here): {e}"
            ))
            .with_status(status)
            .into_response()
        }
        Err(_) => {
            metrics::counter!("shardwire_http_timeouts_total", "phase" => "body").increment(1);
            let msg = format!(
                "the request body did not arrive within {:?} (http_body_timeout_secs)",
                limits.body_timeout
            );
            ApiError::new(ErrorCode::Timeout, msg).into_response()
        }
    }
}

/// The answer of `app` to `req`, as a connection gets it (for the routes' tests).
#[cfg(test)]
pub(super) async fn answer(app: Router, req: Request) -> Response {
    use hyper::service::Service as _;
    match TowerToHyperService::new(app).call(req).await {
        Ok(r) => r,
        Err(never) => match never {},
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardwire_protocol::samples::mix::MAX_MIX_DATASETS;
    use shardwire_protocol::trainer::http::OpenStream;
    use shardwire_protocol::wire::MAX_DATASET_NAME;

    /// The body of `POST /v1/streams` resuming the largest mixture the node takes: 256
    /// datasets with 255-byte names, every number at its widest.
    fn largest_resume() -> Vec<u8> {
        let names: Vec<String> = (0..MAX_MIX_DATASETS)
            .map(|i| format!("{i:03}{}", "d".repeat(MAX_DATASET_NAME - 3)))
            .collect();
        let n = names.len();
        let weight = 1.0_f64 / 3.0;
        let mix: Vec<serde_json::Value> = names
            .iter()
            .map(|name| serde_json::json!({ "dataset": name, "weight": weight }))
            .collect();
        let state = serde_json::json!({
            "epoch": u32::MAX, "index": u64::MAX, "seed": u64::MAX, "fingerprint": "v2",
            "mix": {
                "step": u64::MAX, "datasets": names, "weights": vec![i64::MAX; n],
                "cursors": vec![u64::MAX; n], "carry": vec![i64::MIN; n],
            },
        });
        serde_json::to_vec(&serde_json::json!({ "mix": mix, "state": state })).unwrap()
    }

    #[tokio::test]
    async fn the_largest_valid_open_is_read_and_a_larger_body_is_413() {
        // Before: bodies over 64 KiB were refused, below this valid resume of a mixture.
        let body = largest_resume();
        OpenStream::from_json(&body).expect("a valid open request");
        assert!(body.len() > 64 << 10, "{} bytes", body.len());
        let limits = Limits {
            max_connections: 1,
            header_timeout: Duration::from_secs(5),
            body_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(5),
        };
        let echo = axum::routing::post(|b: axum::body::Bytes| async move { b.len().to_string() });
        let router = Router::new()
            .route("/v1/streams", echo.clone())
            .route("/v1/streams/{id}/next", echo);
        let app = with_checks(router, limits);
        let post_to = |path: &str, body: Vec<u8>| {
            axum::http::Request::post(path)
                .header(axum::http::header::CONTENT_LENGTH, body.len())
                .body(Body::from(body))
                .unwrap()
        };
        let post = |body: Vec<u8>| post_to("/v1/streams", body);
        let n = body.len();
        let r = answer(app.clone(), post(body)).await;
        assert_eq!(r.status(), StatusCode::OK);
        let read = axum::body::to_bytes(r.into_body(), 64).await.unwrap();
        assert_eq!(
            read,
            n.to_string().as_bytes(),
            "the handler got the whole body"
        );
        let r = answer(app.clone(), post(vec![b' '; BODY_LIMIT + 1])).await;
        assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
        // Every other route keeps the small limit.
        let next = |n: usize| post_to("/v1/streams/1/next", vec![b' '; n]);
        let r = answer(app.clone(), next(SMALL_BODY_LIMIT)).await;
        assert_eq!(r.status(), StatusCode::OK);
        let r = answer(app, next(SMALL_BODY_LIMIT + 1)).await;
        assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
    }

    /// Every answer on a reserve connection says `Connection: close`, the server's own
    /// refusals too (a wrong `Host`, a body over the limit); on a normal one none does.
    #[tokio::test]
    async fn a_reserve_connection_closes_after_the_checks_refusals_too() {
        // Before: the close was the innermost check, so the `Host` check's 403 and the body
        // check's 413 kept a keep-alive client on its reserve slot.
        let limits = Limits {
            max_connections: 1,
            header_timeout: Duration::from_secs(5),
            body_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(5),
        };
        let ok = axum::routing::post(|| async { "ok" });
        let app = with_checks(Router::new().route("/x", ok), limits);
        let request = |host: &str, len: usize| {
            axum::http::Request::post("/x")
                .header(axum::http::header::HOST, host)
                .header(axum::http::header::CONTENT_LENGTH, len)
                .body(Body::from(vec![b' '; len]))
                .unwrap()
        };
        let cases = [
            ("evil.example", 0, StatusCode::FORBIDDEN),
            (
                "localhost",
                SMALL_BODY_LIMIT + 1,
                StatusCode::PAYLOAD_TOO_LARGE,
            ),
            ("localhost", 0, StatusCode::OK),
        ];
        for (host, len, status) in cases {
            for reserved in [true, false] {
                let local = axum::Extension(FromThisHost(true));
                let app = match reserved {
                    true => app.clone().layer(axum::Extension(OnReserve)).layer(local),
                    false => app.clone().layer(local),
                };
                let r = answer(app, request(host, len)).await;
                assert_eq!(r.status(), status, "Host {host}, {len} bytes");
                let close = r.headers().get(axum::http::header::CONNECTION);
                assert_eq!(
                    close.is_some_and(|v| v == "close"),
                    reserved,
                    "{status} on a reserve connection: {reserved}"
                );
            }
        }
    }

    /// How hyper's header timer ends a connection whose client sends each of `steps` in turn,
    /// reading the answer to each whole request before it sends the next step.
    async fn phase_after(steps: &[&[u8]]) -> Option<&'static str> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (server, mut client) = tokio::io::duplex(64 << 10);
        let io = WriteStall::new(server, Duration::from_secs(5));
        let unanswered = io.unanswered();
        let app: Router = Router::new().route("/", axum::routing::get(|| async { "ok" }));
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(Duration::from_millis(200))
            .serve_connection(TokioIo::new(io), TowerToHyperService::new(app));
        let conn = tokio::spawn(conn);
        for step in steps {
            client.write_all(step).await.unwrap();
            let mut answer = Vec::new();
            while step.ends_with(b"\r\n\r\n") && !answer.ends_with(b"ok") {
                let mut buf = [0u8; 1024];
                let n = client.read(&mut buf).await.unwrap();
                assert!(n > 0, "the server answers {answer:?}");
                answer.extend_from_slice(&buf[..n]);
            }
        }
        let e = tokio::time::timeout(Duration::from_secs(5), conn)
            .await
            .expect("the header timer ends the connection")
            .unwrap()
            .expect_err("a header timeout");
        drop(client);
        timeout_phase(&e, &unanswered)
    }

    #[tokio::test]
    async fn an_idle_keep_alive_connection_is_not_counted_as_a_slow_head() {
        // Before: every close by the header timer was `header`, a kept-alive client's too.
        const GET: &[u8] = b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n";
        assert_eq!(
            phase_after(&[GET]).await,
            Some("idle"),
            "answered, then idle"
        );
        assert_eq!(
            phase_after(&[]).await,
            Some("idle"),
            "connected, sent nothing"
        );
        let partial: &[u8] = b"GET / HTTP/1.1\r\nHo";
        assert_eq!(
            phase_after(&[partial]).await,
            Some("header"),
            "a head begun"
        );
        assert_eq!(
            phase_after(&[GET, partial]).await,
            Some("header"),
            "a second head begun after an answer"
        );
    }

    #[test]
    fn a_peer_at_the_sockets_own_address_is_this_host() {
        // Before: only loopback peers were, so a browser here reaching a wildcard listener
        // through the host's LAN address (its source that address too) skipped the `Host`
        // check, and a page rebound to that address read the node.
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let lan = ip("10.1.2.3");
        assert!(from_this_host(lan, Some(lan)), "LAN address to itself");
        assert!(
            from_this_host(ip("::ffff:10.1.2.3"), Some(lan)),
            "dual-stack socket"
        );
        assert!(from_this_host(
            ip("::ffff:10.1.2.3"),
            Some(ip("::ffff:10.1.2.3"))
        ));
        assert!(from_this_host(ip("127.0.0.1"), Some(lan)), "loopback");
        assert!(
            from_this_host(ip("127.0.1.1"), Some(ip("127.0.0.1"))),
            "loopback"
        );
        assert!(from_this_host(ip("::1"), Some(ip("::1"))), "loopback");
        assert!(
            from_this_host(ip("10.9.9.9"), None),
            "unknown socket address: checked"
        );
        assert!(!from_this_host(ip("10.1.2.4"), Some(lan)), "another host");
        assert!(
            !from_this_host(ip("::ffff:10.1.2.4"), Some(lan)),
            "another host"
        );
        assert!(
            !from_this_host(ip("fd00::2"), Some(ip("fd00::1"))),
            "another host"
        );
    }

    #[test]
    fn loopback_answers_localhost_and_addresses_not_other_names() {
        for ok in [
            "localhost",
            "localhost:7400",
            "LocalHost.:7400",
            "node.localhost:1",
            "127.0.0.1:7400",
            "10.0.0.5",
            "[::1]:7400",
            "[::1]",
        ] {
            assert!(local_host_name(ok), "{ok}");
        }
        for bad in [
            "evil.example",
            "evil.example:7400",
            "localhost.evil.example",
            "127.0.0.1.nip.io:7400",
            "[evil]:1",
            "",
        ] {
            assert!(!local_host_name(bad), "{bad}");
        }
    }
}
