//! Health-check node ports of `externalTrafficPolicy: Local` Services, in
//! kube-proxy's format (`pkg/proxy/healthcheck/service_health.go`): any
//! path answers 200 with the count of local endpoints when there are some
//! and the proxy is healthy (`serviceProxyHealthy`, the state `/healthz`
//! reports without the Node's), 503 otherwise, so that an external load
//! balancer sends traffic only to nodes that can serve it locally. They
//! listen on every address, or with `--nodeport-addresses` on the node
//! addresses within those prefixes.
use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    task::JoinHandle,
};

use crate::{
    semantics::model::ServiceName,
    semantics::northsouth::HealthCheck,
    serve::{
        health::{Limits, ProxyHealthHandle},
        slots::{self, Gate},
    },
};

/// The status line and body kube-proxy answers for one Service.
pub fn response(
    service: &ServiceName,
    local_endpoints: usize,
    proxy_healthy: bool,
) -> (u16, String) {
    let body = serde_json::json!({
        "service": {"namespace": service.namespace, "name": service.name},
        "localEndpoints": local_endpoints,
        "serviceProxyHealthy": proxy_healthy,
    });
    let code = if local_endpoints > 0 && proxy_healthy {
        200
    } else {
        503
    };
    (code, format!("{body}\n"))
}

/// Where the health-check node ports listen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bind {
    /// Every address (no `--nodeport-addresses`): dual-stack where the
    /// host has IPv6.
    All,
    /// These node addresses only (none: no listener at all).
    Addresses(Vec<IpAddr>),
}

fn http(code: u16, body: &str) -> String {
    let reason = if code == 200 {
        "OK"
    } else {
        "Service Unavailable"
    };
    format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: application/json\r\nX-Content-Type-Options: nosniff\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

type Shared = Arc<Mutex<(ServiceName, usize)>>;

/// How long a request head may take before the answer goes out anyway.
const HEAD_TIMEOUT: Duration = Duration::from_secs(2);

/// Listeners per health-check node port, following the Services. All
/// ports share one set of connection slots (`limits`, one source's
/// connections counted over every port): the descriptors they may take
/// are bounded however many Services there are.
pub struct HealthCheckServers {
    health: ProxyHealthHandle,
    head_timeout: Duration,
    gate: Gate,
    bind: Bind,
    servers: BTreeMap<u16, (Shared, Vec<JoinHandle<()>>)>,
}

impl Drop for HealthCheckServers {
    fn drop(&mut self) {
        for (_, (_, tasks)) in std::mem::take(&mut self.servers) {
            tasks.iter().for_each(JoinHandle::abort);
        }
    }
}

fn bind_one(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    slots::listen(addr)
}

/// The listeners of `port`; the first error aborts (kube-proxy closes what
/// it opened then).
fn bind(how: &Bind, port: u16) -> std::io::Result<Vec<tokio::net::TcpListener>> {
    match how {
        // Dual-stack where IPv6 exists, else IPv4 only.
        Bind::All => bind_one(SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)))
            .or_else(|_| bind_one(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port))))
            .map(|l| vec![l]),
        Bind::Addresses(addrs) => addrs
            .iter()
            .map(|a| bind_one(SocketAddr::new(*a, port)))
            .collect(),
    }
}

async fn serve(
    listener: tokio::net::TcpListener,
    state: Shared,
    health: ProxyHealthHandle,
    head_timeout: Duration,
    gate: Gate,
) {
    loop {
        let Ok((s, peer)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        // Refused: closed at once (the gate logs it, at most every 10 s).
        let Some(mut slot) = gate.admit(peer.ip()) else {
            drop(s);
            continue;
        };
        let (state, health) = (state.clone(), health.clone());
        tokio::spawn(async move {
            tokio::select! {
                () = answer(s, state, health, head_timeout) => {}
                () = slot.evicted() => {}
            }
            drop(slot);
        });
    }
}

/// Reads a request head on `s` (any path is answered alike) for at most
/// `head_timeout`, then answers and closes it.
async fn answer(
    mut s: tokio::net::TcpStream,
    state: Shared,
    health: ProxyHealthHandle,
    head_timeout: Duration,
) {
    let mut buf = [0u8; 2048];
    let mut seen = Vec::new();
    let _ = tokio::time::timeout(head_timeout, async {
        while let Ok(n) = s.read(&mut buf).await {
            if n == 0 {
                break;
            }
            seen.extend_from_slice(&buf[..n]);
            if seen.windows(4).any(|w| w == b"\r\n\r\n") || seen.len() > 8192 {
                break;
            }
        }
    })
    .await;
    let (service, count) = state.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let (code, body) = response(&service, count, health.is_healthy());
    // A client that reads nothing cannot keep the slot either.
    let _ = tokio::time::timeout(head_timeout, async {
        let _ = s.write_all(http(code, &body).as_bytes()).await;
        let _ = s.shutdown().await;
    })
    .await;
}

impl HealthCheckServers {
    /// Serving within `limits`' per-source and total connections (their
    /// timeouts are the health address's; these ports answer within
    /// [`HEAD_TIMEOUT`] whatever comes).
    pub fn new(health: ProxyHealthHandle, limits: Limits) -> Self {
        Self {
            health,
            head_timeout: HEAD_TIMEOUT,
            gate: limits.gate("health-check node port"),
            bind: Bind::All,
            servers: BTreeMap::new(),
        }
    }

    /// A shorter wait for request heads, for the fuzz target's many cases.
    #[cfg(test)]
    pub(crate) fn with_head_timeout(mut self, timeout: Duration) -> Self {
        self.head_timeout = timeout;
        self
    }

    /// Serves exactly `checks` on `bind`: new ports start listening, gone
    /// ones stop, counts change in place; when the addresses changed, every
    /// port listens afresh. Must run inside the tokio runtime. Returns
    /// problems (a port that cannot be bound), for the log.
    pub fn update(&mut self, checks: &[HealthCheck], on: &Bind) -> Vec<String> {
        let mut problems = Vec::new();
        if *on != self.bind {
            for (_, (_, tasks)) in std::mem::take(&mut self.servers) {
                tasks.iter().for_each(JoinHandle::abort);
            }
            self.bind = on.clone();
        }
        let mut wanted: BTreeMap<u16, &HealthCheck> = BTreeMap::new();
        for c in checks {
            if let Some(other) = wanted.get(&c.port) {
                problems.push(format!(
                    "healthCheckNodePort {} of Service {} is taken by Service {}",
                    c.port, c.service, other.service
                ));
                continue;
            }
            wanted.insert(c.port, c);
        }
        self.servers.retain(|port, (_, tasks)| {
            let keep = wanted.contains_key(port);
            if !keep {
                tasks.iter().for_each(JoinHandle::abort);
            }
            keep
        });
        for (port, c) in wanted {
            if let Some((state, _)) = self.servers.get(&port) {
                *state.lock().unwrap_or_else(|e| e.into_inner()) =
                    (c.service.clone(), c.local_endpoints);
                continue;
            }
            let listeners = match bind(&self.bind, port) {
                Ok(l) => l,
                Err(e) => {
                    problems.push(format!(
                        "healthCheckNodePort {port} of Service {}: {e}",
                        c.service
                    ));
                    continue;
                }
            };
            let state: Shared = Arc::new(Mutex::new((c.service.clone(), c.local_endpoints)));
            let tasks = listeners
                .into_iter()
                .map(|l| {
                    let health = self.health.clone();
                    tokio::spawn(serve(
                        l,
                        state.clone(),
                        health,
                        self.head_timeout,
                        self.gate.clone(),
                    ))
                })
                .collect();
            tracing::info!(port, service = %c.service, bind = ?self.bind, "serving health-check node port");
            self.servers.insert(port, (state, tasks));
        }
        problems
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn web() -> ServiceName {
        ServiceName {
            namespace: "demo".into(),
            name: "web".into(),
        }
    }

    /// kube-proxy's `hcHandler`: 200 only with local endpoints and a
    /// healthy proxy.
    #[test]
    fn kube_proxy_format() {
        for (local, healthy, code) in [
            (2, true, 200),
            (0, true, 503),
            (2, false, 503),
            (0, false, 503),
        ] {
            let (got, body) = response(&web(), local, healthy);
            assert_eq!(got, code, "{local} endpoints, healthy {healthy}");
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(
                v,
                serde_json::json!({"service": {"namespace": "demo", "name": "web"},
                    "localEndpoints": local, "serviceProxyHealthy": healthy})
            );
        }
        assert!(http(503, "x").starts_with("HTTP/1.1 503 Service Unavailable\r\n"));
    }

    fn free_port() -> u16 {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    }

    async fn get(ip: &str, port: u16) -> std::io::Result<String> {
        let mut s = tokio::net::TcpStream::connect((ip, port)).await?;
        s.write_all(b"GET / HTTP/1.0\r\n\r\n").await?;
        let mut out = String::new();
        s.read_to_string(&mut out).await?;
        Ok(out)
    }

    fn check(port: u16, n: usize) -> HealthCheck {
        HealthCheck {
            port,
            service: web(),
            local_endpoints: n,
        }
    }

    #[tokio::test]
    async fn serves_and_follows_counts_and_proxy_health() {
        let port = free_port();
        let health = ProxyHealthHandle::new(Duration::from_millis(30));
        let mut servers = HealthCheckServers::new(health.clone(), Limits::default());
        assert!(servers.update(&[check(port, 0)], &Bind::All).is_empty());
        let get = || async { get("127.0.0.1", port).await.unwrap() };
        assert!(get().await.starts_with("HTTP/1.1 503"));
        servers.update(&[check(port, 3)], &Bind::All);
        let r = get().await;
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        assert!(r.contains("\"localEndpoints\":3"), "{r}");
        assert!(r.contains("\"serviceProxyHealthy\":true"), "{r}");
        // An update pending past the timeout: the proxy is unhealthy.
        health.updated();
        health.queued_update();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let r = get().await;
        assert!(r.starts_with("HTTP/1.1 503"), "{r}");
        assert!(r.contains("\"serviceProxyHealthy\":false"), "{r}");
        // A Node being deleted does not count here (kube-proxy's IsHealthy).
        health.updated();
        health.set_node_eligible(false);
        assert!(get().await.starts_with("HTTP/1.1 200"));
        servers.update(&[], &Bind::All);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err());
    }

    /// With `--nodeport-addresses` only the node addresses listen, and a
    /// change of addresses moves the listeners.
    #[tokio::test]
    async fn listens_on_the_node_addresses_only() {
        let port = free_port();
        let mut servers = HealthCheckServers::new(
            ProxyHealthHandle::new(Duration::from_secs(60)),
            Limits::default(),
        );
        let only = |a: &str| Bind::Addresses(vec![a.parse().unwrap()]);
        assert!(servers
            .update(&[check(port, 1)], &only("127.0.0.2"))
            .is_empty());
        assert!(get("127.0.0.2", port)
            .await
            .unwrap()
            .starts_with("HTTP/1.1 200"));
        assert!(
            get("127.0.0.1", port).await.is_err(),
            "not on other addresses"
        );
        servers.update(&[check(port, 1)], &only("127.0.0.3"));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(get("127.0.0.2", port).await.is_err());
        assert!(get("127.0.0.3", port)
            .await
            .unwrap()
            .starts_with("HTTP/1.1 200"));
        // No node address within the prefixes: nothing listens.
        servers.update(&[check(port, 1)], &Bind::Addresses(Vec::new()));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(get("127.0.0.3", port).await.is_err());
    }
}
