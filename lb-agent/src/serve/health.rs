//! `/healthz` and `/readyz`, as kube-proxy serves on port 10256.
use std::{
    net::SocketAddr,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
};

use anyhow::Context as _;
use axum::{
    extract::State,
    http::{header, StatusCode},
    routing::get,
    Router,
};

use crate::base::metrics::Metrics;

/// Set once the first full sync has been programmed.
#[derive(Clone, Default)]
pub struct Readiness(Arc<AtomicBool>);

impl Readiness {
    pub fn set_ready(&self) {
        self.0.store(true, Ordering::Release);
    }

    pub fn is_ready(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

async fn readyz(State(ready): State<Readiness>) -> (StatusCode, &'static str) {
    if ready.is_ready() {
        (StatusCode::OK, "ready\n")
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: first sync not done\n",
        )
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

/// Binds `addr` now (so a taken port fails the start) and serves
/// `/healthz`, `/readyz` and `/metrics` in the background.
pub async fn serve(addr: SocketAddr, ready: Readiness, m: Metrics) -> anyhow::Result<()> {
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(ready)
        .merge(Router::new().route("/metrics", get(metrics)).with_state(m));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the health address {addr}"))?;
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "health server stopped");
        }
    });
    Ok(())
}
