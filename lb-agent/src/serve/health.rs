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
        if let Ok(l) = tokio::net::TcpListener::bind(any6).await {
            return Ok(l);
        }
    }
    tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the {what} address {addr}"))
}

/// What one HTTP server (health or metrics) allows. The health address
/// is open to the network: without these, idle and slowloris connections
/// are kept forever and take the agent's file descriptors.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections served at once; one more is closed at once.
    pub max_connections: usize,
    /// For a request's head, counted from when the connection is idle (so
    /// also how long an idle keep-alive connection stays open).
    pub header_read_timeout: Duration,
    /// For a whole connection, however it is used.
    pub connection_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            // Probes come from a few load balancers and the kubelet.
            max_connections: 128,
            header_read_timeout: Duration::from_secs(5),
            connection_timeout: Duration::from_secs(30),
        }
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
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let mut http = hyper::server::conn::http1::Builder::new();
    // half_close: a client that shuts its side down after the request
    // (`nc -N`, some load balancers' checks) still gets the answer, as
    // from kube-proxy's Go server; hyper would close without one.
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .half_close(true);
    let mut refused_logged = false;
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // EMFILE and the like: wait instead of spinning.
                tracing::warn!(error = %e, "{what} server: accepting a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            if !refused_logged {
                tracing::warn!(
                    max = limits.max_connections,
                    "{what} server: connection limit reached, closing new connections"
                );
                refused_logged = true;
            }
            drop(stream);
            continue;
        };
        refused_logged = false;
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let conn = http.serve_connection(TokioIo::new(stream), service);
        tokio::spawn(async move {
            // Errors are the client's (timeouts, resets): nothing to log.
            let _ = tokio::time::timeout(limits.connection_timeout, conn).await;
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
