//! The health address (kube-proxy's `--healthz-bind-address`, port 10256):
//! `/healthz` and `/livez` as kube-proxy answers them
//! (`semantics::health`), and our `/readyz`. `/metrics` has an address of
//! its own (kube-proxy's `--metrics-bind-address`, 127.0.0.1:10249): the
//! health address is open to the network for cloud load balancers.
use std::{
    net::{Ipv6Addr, SocketAddr},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use anyhow::Context as _;
use axum::{
    extract::State,
    http::{header, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
    routing::get,
    Router,
};

use crate::{
    base::metrics::Metrics,
    semantics::health::{Answer, Now, ProxyHealth},
    serve::slots,
};

/// Ready once the first full sync has been programmed, and while every
/// datapath part asked for is attached: a part that failed is not a silent
/// half-start. Frontends that do not fit in the maps leave it ready but
/// "degraded" in the body: everything else is served, a restart would not
/// make room, and an unready node agent helps no one (its pods' traffic
/// goes through it regardless). `/healthz` turns 503 after
/// `--healthz-timeout` of failing syncs, as kube-proxy's does.
#[derive(Clone, Default)]
pub struct Readiness {
    synced: Arc<AtomicBool>,
    /// Why a datapath part asked for is not attached.
    unattached: Arc<Mutex<Option<String>>>,
    /// What is not programmed, while something is not.
    degraded: Arc<Mutex<Option<String>>>,
}

impl Readiness {
    pub fn set_ready(&self) {
        self.synced.store(true, Ordering::Release);
    }

    /// `Some(reason)` while a part asked for is not attached.
    pub fn set_unattached(&self, reason: Option<String>) {
        *self.unattached.lock().unwrap_or_else(|e| e.into_inner()) = reason;
    }

    /// `Ok` when ready, else why not.
    pub fn check(&self) -> Result<(), String> {
        if !self.synced.load(Ordering::Acquire) {
            return Err("first sync not done".into());
        }
        match &*self.unattached.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(reason) => Err(reason.clone()),
            None => Ok(()),
        }
    }

    pub fn is_ready(&self) -> bool {
        self.check().is_ok()
    }

    /// `Some(what)` while some frontends could not be programmed.
    pub fn set_degraded(&self, what: Option<String>) {
        *self.degraded.lock().unwrap_or_else(|e| e.into_inner()) = what;
    }

    fn degraded(&self) -> Option<String> {
        self.degraded
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// The proxy's health, shared by the change sources (which queue updates),
/// the sync loop (which reports them done), and the HTTP answers; on the
/// real clock.
#[derive(Clone)]
pub struct ProxyHealthHandle(Arc<Mutex<ProxyHealth>>);

impl ProxyHealthHandle {
    pub fn new(timeout: Duration) -> Self {
        Self(Arc::new(Mutex::new(ProxyHealth::new(timeout))))
    }

    fn with<R>(&self, f: impl FnOnce(&mut ProxyHealth) -> R) -> R {
        f(&mut self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// A change was received; called where it arrives, not by the sync
    /// loop, so that a loop that is stuck still goes unhealthy.
    pub fn queued_update(&self) {
        self.with(|h| h.queued_update(Instant::now()));
    }

    /// A sync programmed everything.
    pub fn updated(&self) {
        self.with(|h| h.updated(Now::real()));
    }

    pub fn set_node_eligible(&self, eligible: bool) {
        self.with(|h| h.set_node_eligible(eligible));
    }

    /// kube-proxy's `IsHealthy`, as the health-check node ports report it.
    pub fn is_healthy(&self) -> bool {
        self.with(|h| h.is_healthy(Instant::now()))
    }

    pub fn healthz(&self) -> Answer {
        self.with(|h| h.healthz(Now::real()))
    }

    pub fn livez(&self) -> Answer {
        self.with(|h| h.livez(Now::real()))
    }
}

/// kube-proxy's headers and status for a health answer.
fn json_answer(a: Answer) -> Response {
    let code = if a.healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let mut r = (code, a.body).into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    r
}

async fn readyz(State(ready): State<Readiness>) -> (StatusCode, String) {
    match ready.check() {
        Ok(()) => match ready.degraded() {
            None => (StatusCode::OK, "ready\n".into()),
            Some(what) => (StatusCode::OK, format!("ready, degraded: {what}\n")),
        },
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        ),
    }
}

async fn metrics(
    State(metrics): State<Metrics>,
) -> ([(header::HeaderName, &'static str); 1], String) {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        metrics.encode(),
    )
}

/// Binds `addr`; `0.0.0.0` means every address, IPv6 ones included where
/// the host has IPv6 (as Go's listener, and so kube-proxy, takes it).
async fn bind(addr: SocketAddr, what: &str) -> anyhow::Result<tokio::net::TcpListener> {
    if addr.ip().is_unspecified() && addr.is_ipv4() {
        let any6 = SocketAddr::from((Ipv6Addr::UNSPECIFIED, addr.port()));
        if let Ok(l) = slots::listen(any6) {
            return Ok(l);
        }
    }
    slots::listen(addr).with_context(|| format!("binding the {what} address {addr}"))
}

/// What one HTTP server (health, metrics, or the health-check node ports
/// together) allows. The health address and the node ports are open to
/// the network: without these, idle and slowloris connections are kept
/// forever and take the agent's file descriptors, and without the
/// per-source one a single client holds every slot (issue 41).
///
/// Bounds, per server: at most `max_connections` connections (file
/// descriptors), each for at most `header_read_timeout` before its request
/// head is in and `connection_timeout` in all, each with a read buffer of
/// at most [`MAX_READ_BUFFER`]; connections beyond the limits are accepted
/// and closed at once, so they hold no descriptor.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections served at once, from every source together; at that
    /// total a new connection takes the oldest slot of the source holding
    /// the most (see `slots`).
    pub max_connections: usize,
    /// Connections one source (an IPv4 address, an IPv6 /64) holds at
    /// once; one more from it is closed at once.
    pub max_connections_per_source: usize,
    /// For a request's head, from when the connection is idle (so also
    /// how long an idle keep-alive connection stays open). hyper's deadline
    /// is for the whole head: bytes trickling in do not extend it.
    pub header_read_timeout: Duration,
    /// For a whole connection, however it is used.
    pub connection_timeout: Duration,
}

/// A probe needs one connection at a time; the kubelet's liveness and
/// readiness probes, a few load balancers' health checkers (Azure's all
/// come from 168.63.129.16, one per rule) and a Prometheus scraper stay
/// far below 16 at once from one address, while 16 is little enough that
/// hundreds of sources fit in the total.
pub const PER_SOURCE: usize = 16;
/// Each server takes at most this share (1/8) of the open-file limit: the
/// three (health, metrics, node ports) 3/8 together, leaving the rest for
/// the BPF maps, programs and links, the API connections and manifest
/// files.
const OPEN_FILES_SHARE: u64 = 8;
/// Not fewer, even with a tiny open-file limit: two sources at their
/// per-source limit.
const MIN_TOTAL: usize = 2 * PER_SOURCE;
/// Not more, whatever the open-file limit: memory. A connection costs at
/// most ~24 KiB here ([`MAX_READ_BUFFER`], the task, hyper's state, the
/// slot; an idle one ~10 KiB): 1024 of them at most ~24 MiB per server.
/// Past the total, sources that hold fewer still get slots (`slots`), so
/// more would not make the endpoints more available.
const MAX_TOTAL: usize = 1024;
/// hyper's read buffer per connection at most (its minimum, 8 KiB, is the
/// first allocation): a longer request head is answered 431.
pub const MAX_READ_BUFFER: usize = 16 * 1024;

impl Limits {
    /// For a process whose soft open-file limit is `open_files`: a total
    /// of 1/8 of it, within [32, 1024] (128 at 1024).
    pub fn for_open_file_limit(open_files: u64) -> Self {
        let total = usize::try_from(open_files / OPEN_FILES_SHARE)
            .unwrap_or(usize::MAX)
            .clamp(MIN_TOTAL, MAX_TOTAL);
        Limits {
            max_connections: total,
            max_connections_per_source: PER_SOURCE,
            header_read_timeout: Duration::from_secs(5),
            connection_timeout: Duration::from_secs(30),
        }
    }

    /// For this process's soft open-file limit now (read it after raising
    /// it); that of 1024 where it cannot be read.
    pub fn for_this_process() -> Self {
        use nix::sys::resource::{getrlimit, Resource};
        let open_files = match getrlimit(Resource::RLIMIT_NOFILE) {
            Ok((soft, _)) => soft,
            Err(e) => {
                tracing::warn!("reading the open-file limit: {e}; taking 1024");
                1024
            }
        };
        Self::for_open_file_limit(open_files)
    }

    /// The slots these limits give, for `what` (the log's name).
    pub fn gate(&self, what: &'static str) -> slots::Gate {
        slots::Gate::new(what, self.max_connections_per_source, self.max_connections)
    }
}

impl Default for Limits {
    /// As for an open-file limit of 1024, a common default.
    fn default() -> Self {
        Self::for_open_file_limit(1024)
    }
}

fn spawn(listener: tokio::net::TcpListener, app: Router, what: &'static str, limits: Limits) {
    tokio::spawn(serve_limited(listener, app, what, limits));
}

/// Serves `app` on `listener` within `limits`, until the task is dropped.
async fn serve_limited(
    listener: tokio::net::TcpListener,
    app: Router,
    what: &'static str,
    limits: Limits,
) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    let gate = limits.gate(what);
    let mut http = hyper::server::conn::http1::Builder::new();
    // half_close: a client that shuts its side down after the request
    // (`nc -N`, some load balancers' checks) still gets the answer, as
    // from kube-proxy's Go server; hyper would close without one.
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(MAX_READ_BUFFER)
        .half_close(true);
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // EMFILE and the like: wait instead of spinning.
                tracing::warn!(error = %e, "{what} server: accepting a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // Refused: closed at once (the gate logs it, at most every 10 s).
        let Some(mut slot) = gate.admit(peer.ip()) else {
            drop(stream);
            continue;
        };
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let conn = http.serve_connection(TokioIo::new(stream), service);
        tokio::spawn(async move {
            // Errors are the client's (timeouts, resets): nothing to log.
            tokio::select! {
                _ = tokio::time::timeout(limits.connection_timeout, conn) => {}
                () = slot.evicted() => {}
            }
            drop(slot);
        });
    }
}

/// The health server's routes.
fn health_app(ready: Readiness, health: ProxyHealthHandle) -> Router {
    Router::new()
        .route("/readyz", get(readyz))
        .with_state(ready)
        .merge(
            Router::new()
                .route(
                    "/healthz",
                    get(|State(h): State<ProxyHealthHandle>| async move { json_answer(h.healthz()) }),
                )
                .route(
                    "/livez",
                    get(|State(h): State<ProxyHealthHandle>| async move { json_answer(h.livez()) }),
                )
                .with_state(health),
        )
}

/// Binds `addr` now (so a taken port fails the start) and serves
/// `/healthz`, `/livez` and `/readyz` in the background.
pub async fn serve(
    addr: SocketAddr,
    ready: Readiness,
    health: ProxyHealthHandle,
    limits: Limits,
) -> anyhow::Result<()> {
    let listener = bind(addr, "health").await?;
    spawn(listener, health_app(ready, health), "health", limits);
    Ok(())
}

/// Binds `addr` now and serves `/metrics` in the background.
pub async fn serve_metrics(addr: SocketAddr, m: Metrics, limits: Limits) -> anyhow::Result<()> {
    let app = Router::new().route("/metrics", get(metrics)).with_state(m);
    let listener = bind(addr, "metrics").await?;
    spawn(listener, app, "metrics", limits);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    async fn get(addr: SocketAddr, path: &str) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[test]
    fn totals_follow_the_open_file_limit() {
        for (open_files, total) in [
            (0, 32),
            (64, 32),
            (1024, 128),
            (4096, 512),
            (8192, 1024),
            (1 << 20, 1024),
            (u64::MAX, 1024),
        ] {
            let l = Limits::for_open_file_limit(open_files);
            assert_eq!(l.max_connections, total, "open files {open_files}");
            assert_eq!(l.max_connections_per_source, PER_SOURCE);
            // The three servers leave most descriptors to the rest.
            assert!(
                open_files < 256 || 3 * l.max_connections as u64 <= open_files / 2,
                "open files {open_files}"
            );
        }
    }

    fn free_addr() -> SocketAddr {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    }

    /// `/healthz` and `/livez` with kube-proxy's headers, status and body;
    /// `/metrics` only on the metrics address.
    #[tokio::test]
    async fn health_and_metrics_addresses() {
        let (haddr, maddr) = (free_addr(), free_addr());
        let health = ProxyHealthHandle::new(Duration::from_millis(50));
        serve(
            haddr,
            Readiness::default(),
            health.clone(),
            Limits::default(),
        )
        .await
        .unwrap();
        serve_metrics(maddr, Metrics::new(), Limits::default())
            .await
            .unwrap();

        let r = get(haddr, "/healthz").await;
        assert!(
            r.starts_with("HTTP/1.0 200") || r.starts_with("HTTP/1.1 200"),
            "{r}"
        );
        let lower = r.to_ascii_lowercase();
        assert!(lower.contains("content-type: application/json\r\n"), "{r}");
        assert!(lower.contains("x-content-type-options: nosniff\r\n"), "{r}");
        let body: serde_json::Value =
            serde_json::from_str(r.split_once("\r\n\r\n").unwrap().1).unwrap();
        assert_eq!(body["nodeEligible"], true, "{r}");
        assert!(body["lastUpdated"].is_string() && body["currentTime"].is_string());
        let r = get(haddr, "/livez").await;
        assert!(r.contains(" 200 "), "{r}");
        assert!(!r.contains("nodeEligible"), "{r}");

        // A change that no sync programs, past the timeout.
        health.updated();
        health.queued_update();
        tokio::time::sleep(Duration::from_millis(80)).await;
        assert!(get(haddr, "/healthz").await.contains(" 503 "));
        assert!(get(haddr, "/livez").await.contains(" 503 "));
        assert!(!health.is_healthy());
        health.updated();
        assert!(get(haddr, "/healthz").await.contains(" 200 "));
        // Node being deleted: /healthz only.
        health.set_node_eligible(false);
        let r = get(haddr, "/healthz").await;
        assert!(
            r.contains(" 503 ") && r.contains(r#""nodeEligible": false"#),
            "{r}"
        );
        assert!(get(haddr, "/livez").await.contains(" 200 "));

        assert!(get(haddr, "/readyz").await.contains(" 503 "));
        assert!(get(haddr, "/metrics").await.contains(" 404 "));
        let r = get(maddr, "/metrics").await;
        assert!(r.contains(" 200 ") && r.contains("# EOF"), "{r}");
    }
}
