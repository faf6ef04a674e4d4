//! Fuzz target of the HTTP servers: the health address, the metrics
//! address and a health-check node port, on 127.0.0.1, each given the same
//! malformed requests (the seeds of `fuzz/corpus/http/` mutated, and token
//! soup) over up to six connections at once, each half-closed or left
//! open. Limits are short so that cases are quick; the servers live
//! across cases, as they do in the agent.
//!
//! Properties: every connection ends within the server's own timeouts
//! (plus a margin), what comes back is HTTP, and afterwards a well-formed
//! request to each server still gets its right answer (nothing wedged, no
//! connection slot lost, no task dead).
use std::{
    net::SocketAddr,
    sync::OnceLock,
    time::{Duration, Instant},
};

use proptest::prelude::*;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::{
    base::{
        fuzz::{self, Grammar},
        metrics::Metrics,
    },
    semantics::{model::ServiceName, northsouth::HealthCheck},
    serve::{
        health::{self, Limits, ProxyHealthHandle, Readiness},
        healthcheck::{Bind, HealthCheckServers},
    },
};

/// Cases in the bounded run of `cargo xtask test`.
const SHORT: u32 = 24;

const LIMITS: Limits = Limits {
    max_connections: 4,
    max_connections_per_source: 4,
    header_read_timeout: Duration::from_millis(200),
    connection_timeout: Duration::from_millis(600),
};
const HEAD_TIMEOUT: Duration = Duration::from_millis(200);
/// Beyond the servers' own timeouts: scheduling on a loaded machine.
const MARGIN: Duration = Duration::from_secs(2);

const GRAMMAR: Grammar = Grammar {
    tokens: &[
        b"\r\n",
        b"\r\n\r\n",
        b"\n",
        b"GET ",
        b"POST ",
        b"HEAD ",
        b"OPTIONS * ",
        b"/healthz",
        b"/livez",
        b"/readyz",
        b"/metrics",
        b"/%2e%2e/",
        b"?a=b&c",
        b" HTTP/1.1",
        b" HTTP/1.0",
        b" HTTP/2.0",
        b" HTTP/9.9",
        b"Host: a\r\n",
        b"Host: \r\n",
        b"Content-Length: 5\r\n",
        b"Content-Length: -1\r\n",
        b"Content-Length: 99999999999999999999\r\n",
        b"Transfer-Encoding: chunked\r\n",
        b"0\r\n\r\n",
        b"ffffffffffffffff\r\n",
        b"Connection: close\r\n",
        b"Connection: keep-alive\r\n",
        b"Connection: upgrade\r\nUpgrade: h2c\r\n",
        b"Expect: 100-continue\r\n",
        b" \t",
        b":",
        b"\0",
        b"\xff\xfe",
        b"\x16\x03\x01",
    ],
    offsets: &[],
};

struct Servers {
    runtime: tokio::runtime::Runtime,
    health: SocketAddr,
    metrics: SocketAddr,
    node_port: SocketAddr,
    /// Kept: dropping it stops the node port.
    _checks: HealthCheckServers,
}

fn free_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

/// The three servers, started once for every case.
fn servers() -> &'static Servers {
    static SERVERS: OnceLock<Servers> = OnceLock::new();
    SERVERS.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let (health_at, metrics_at, node_port) = (free_addr(), free_addr(), free_addr());
        let checks = runtime.block_on(async {
            let proxy = ProxyHealthHandle::new(Duration::from_secs(3600));
            health::serve(health_at, Readiness::default(), proxy.clone(), LIMITS)
                .await
                .unwrap();
            health::serve_metrics(metrics_at, Metrics::new(), LIMITS)
                .await
                .unwrap();
            let mut checks = HealthCheckServers::new(proxy, LIMITS).with_head_timeout(HEAD_TIMEOUT);
            let check = HealthCheck {
                port: node_port.port(),
                service: ServiceName {
                    namespace: "demo".into(),
                    name: "web".into(),
                },
                local_endpoints: 2,
            };
            let on = Bind::Addresses(vec![node_port.ip()]);
            assert!(checks.update(&[check], &on).is_empty());
            checks
        });
        Servers {
            runtime,
            health: health_at,
            metrics: metrics_at,
            node_port,
            _checks: checks,
        }
    })
}

/// One client connection of a case.
#[derive(Clone, Debug)]
struct Conn {
    request: Vec<u8>,
    /// Shut the sending side down after the request (a half-close).
    half_close: bool,
}

fn conn() -> impl Strategy<Value = Conn> {
    let request = prop_oneof![
        4 => fuzz::mutated(fuzz::corpus("http"), GRAMMAR, 6).prop_map(|(_, bytes)| bytes),
        1 => fuzz::generated(GRAMMAR, 24),
    ];
    (request, any::<bool>()).prop_map(|(request, half_close)| Conn {
        request,
        half_close,
    })
}

/// Sends `c` to `addr` and reads until the server closes (or resets), for
/// at most `bound`: what came back, or an error naming the hang.
async fn exchange(addr: SocketAddr, c: &Conn, bound: Duration) -> Result<Vec<u8>, String> {
    let started = Instant::now();
    let run = async {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        // A server that closed early (a parse error, the connection cap)
        // may refuse the rest: that is an answer too.
        if s.write_all(&c.request).await.is_ok() && c.half_close {
            let _ = s.shutdown().await;
        }
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
        Ok::<_, std::io::Error>(out)
    };
    match tokio::time::timeout(bound, run).await {
        Ok(Ok(out)) => Ok(out),
        Ok(Err(e)) => Err(format!("{addr}: connect: {e}")),
        Err(_) => Err(format!("{addr}: still open after {:?}", started.elapsed())),
    }
}

/// A well-formed request answers as it should: status and body. Tried a
/// few times: a server frees a connection's slot just after closing it.
async fn answers(addr: SocketAddr, path: &str, want: &str) -> Result<(), String> {
    let c = Conn {
        request: format!("GET {path} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
            .into_bytes(),
        half_close: false,
    };
    let bound = LIMITS.connection_timeout + MARGIN;
    let mut last = String::new();
    for _ in 0..20 {
        last = String::from_utf8_lossy(&exchange(addr, &c, bound).await?).into_owned();
        if last.starts_with("HTTP/1.1 200 ") && last.contains(want) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(format!("{addr} {path}: {last:?}"))
}

async fn run_case(conns: &[Conn]) -> Result<(), String> {
    let s = servers();
    let targets = [
        (s.health, LIMITS.connection_timeout),
        (s.metrics, LIMITS.connection_timeout),
        (s.node_port, HEAD_TIMEOUT),
    ];
    let mut all = Vec::new();
    for (addr, timeout) in targets {
        for c in conns {
            all.push(async move { (addr, exchange(addr, c, timeout + MARGIN).await) });
        }
    }
    for (addr, result) in futures::future::join_all(all).await {
        let out = result?;
        if !out.is_empty() && !out.starts_with(b"HTTP/1.") {
            return Err(format!(
                "{addr}: not HTTP: {:?}",
                String::from_utf8_lossy(&out)
            ));
        }
    }
    answers(s.health, "/healthz", "\"nodeEligible\": true").await?;
    answers(s.metrics, "/metrics", "# EOF").await?;
    answers(s.node_port, "/", "\"localEndpoints\":2").await
}

/// The seeds as they are, half-closed or not: the well-formed requests
/// (`get-*`) get their answer from each server, the rest end in time.
#[test]
fn fuzz_http_seeds_as_they_are() {
    let s = servers();
    s.runtime.block_on(async {
        for seed in fuzz::corpus("http") {
            for half_close in [false, true] {
                let c = Conn {
                    request: seed.bytes.clone(),
                    half_close,
                };
                let well_formed = seed.name.starts_with("get-");
                for (addr, timeout) in [
                    (s.health, LIMITS.connection_timeout),
                    (s.metrics, LIMITS.connection_timeout),
                    (s.node_port, HEAD_TIMEOUT),
                ] {
                    let what = format!("{} (half-closed: {half_close}) to {addr}", seed.name);
                    let out = exchange(addr, &c, timeout + MARGIN)
                        .await
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    let out = String::from_utf8_lossy(&out);
                    if well_formed {
                        assert!(
                            out.starts_with("HTTP/1.1 ") || out.starts_with("HTTP/1.0 "),
                            "{what}: no answer: {out:?}"
                        );
                    }
                }
            }
        }
    });
}

proptest! {
    #![proptest_config(fuzz::config(SHORT))]

    #[test]
    fn fuzz_http_servers(conns in prop::collection::vec(conn(), 1..=6)) {
        let result = servers().runtime.block_on(run_case(&conns));
        prop_assert!(result.is_ok(), "{}", result.unwrap_err());
    }
}
