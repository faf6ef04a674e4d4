//! Health-check node ports of `externalTrafficPolicy: Local` Services, in
//! kube-proxy's format (`pkg/proxy/healthcheck/service_health.go`): any
//! path answers 200 with the count of local endpoints when there are some,
//! 503 when there are none, so that an external load balancer sends traffic
//! only to nodes that can serve it locally.
use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    task::JoinHandle,
};

use crate::{semantics::model::ServiceName, semantics::northsouth::HealthCheck};

/// The status line and body kube-proxy answers for one Service.
pub fn response(service: &ServiceName, local_endpoints: usize) -> (u16, String) {
    let body = serde_json::json!({
        "service": {"namespace": service.namespace, "name": service.name},
        "localEndpoints": local_endpoints,
        "serviceProxyHealthy": true,
    });
    let code = if local_endpoints > 0 { 200 } else { 503 };
    (code, format!("{body}\n"))
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

/// One listener per health-check node port, following the Services.
#[derive(Default)]
pub struct HealthCheckServers {
    servers: BTreeMap<u16, (Shared, JoinHandle<()>)>,
}

impl Drop for HealthCheckServers {
    fn drop(&mut self) {
        for (_, (_, task)) in std::mem::take(&mut self.servers) {
            task.abort();
        }
    }
}

fn bind(port: u16) -> std::io::Result<std::net::TcpListener> {
    // Dual-stack where IPv6 exists, else IPv4 only.
    let l = std::net::TcpListener::bind(SocketAddr::from((Ipv6Addr::UNSPECIFIED, port))).or_else(
        |_| std::net::TcpListener::bind(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port))),
    )?;
    l.set_nonblocking(true)?;
    Ok(l)
}

async fn serve(listener: tokio::net::TcpListener, state: Shared) {
    loop {
        let Ok((mut s, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let state = state.clone();
        tokio::spawn(async move {
            // Read the request head (any path is answered alike).
            let mut buf = [0u8; 2048];
            let mut seen = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(2), async {
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
            let (code, body) = {
                let st = state.lock().unwrap_or_else(|e| e.into_inner());
                response(&st.0, st.1)
            };
            let _ = s.write_all(http(code, &body).as_bytes()).await;
            let _ = s.shutdown().await;
        });
    }
}

impl HealthCheckServers {
    /// Serves exactly `checks`: new ports start listening, gone ones stop,
    /// counts change in place. Must run inside the tokio runtime. Returns
    /// problems (a port that cannot be bound), for the log.
    pub fn update(&mut self, checks: &[HealthCheck]) -> Vec<String> {
        let mut problems = Vec::new();
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
        self.servers.retain(|port, (_, task)| {
            let keep = wanted.contains_key(port);
            if !keep {
                task.abort();
            }
            keep
        });
        for (port, c) in wanted {
            if let Some((state, _)) = self.servers.get(&port) {
                *state.lock().unwrap_or_else(|e| e.into_inner()) =
                    (c.service.clone(), c.local_endpoints);
                continue;
            }
            let listener = match bind(port).and_then(tokio::net::TcpListener::from_std) {
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
            let task = tokio::spawn(serve(listener, state.clone()));
            tracing::info!(port, service = %c.service, "serving health-check node port");
            self.servers.insert(port, (state, task));
        }
        problems
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kube_proxy_format() {
        let svc = ServiceName {
            namespace: "demo".into(),
            name: "web".into(),
        };
        let (code, body) = response(&svc, 2);
        assert_eq!(code, 200);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"service": {"namespace": "demo", "name": "web"},
                "localEndpoints": 2, "serviceProxyHealthy": true})
        );
        assert_eq!(response(&svc, 0).0, 503);
        assert!(http(503, "x").starts_with("HTTP/1.1 503 Service Unavailable\r\n"));
    }

    #[tokio::test]
    async fn serves_and_follows_counts() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let svc = ServiceName {
            namespace: "demo".into(),
            name: "web".into(),
        };
        let mut servers = HealthCheckServers::default();
        let check = |n| HealthCheck {
            port,
            service: svc.clone(),
            local_endpoints: n,
        };
        assert!(servers.update(&[check(0)]).is_empty());
        let get = || async {
            let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .unwrap();
            s.write_all(b"GET / HTTP/1.0\r\n\r\n").await.unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).await.unwrap();
            out
        };
        assert!(get().await.starts_with("HTTP/1.1 503"));
        servers.update(&[check(3)]);
        let r = get().await;
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        assert!(r.contains("\"localEndpoints\":3"), "{r}");
        servers.update(&[]);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err());
    }
}
