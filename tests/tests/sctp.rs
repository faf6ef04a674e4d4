//! SCTP Services: reported per frontend, never served, their connects left
//! alone.
//!
//! Linux runs no connect or sendmsg hook for SCTP sockets
//! (`sctp_inet_connect` and `sctp_sendmsg` call none; only getpeername's,
//! `inet_getname`, runs), which Debian's 5.10 and 6.1 kernels booted under
//! `cargo xtask kernels` confirm: the socket path cannot rewrite an SCTP
//! connect. The tc path does not rewrite SCTP either (a port rewrite needs
//! its CRC32c recomputed). So the agent serves no SCTP frontend and says so:
//! in its log, in `lb-agent inspect services` and in `/metrics`.
mod common;

use std::time::Duration;

use common::*;
use integration_tests::{
    cluster::metric, netns::pod_v4, require_root, wait_until, Attempt, Env, Proto,
};
use serde_json::{json, Value};

const VIP: &str = "10.96.0.30";
const EXTERNAL_IP: &str = "192.0.2.50";

/// Service `demo/sig`: port 80 twice, `sig` SCTP and `http` TCP, both to
/// 8080, on its ClusterIP and an externalIP.
fn sig_service() -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "sig", "namespace": "demo"},
        "spec": {
            "clusterIP": VIP, "clusterIPs": [VIP],
            "ports": [
                {"name": "sig", "port": 80, "protocol": "SCTP", "targetPort": 8080},
                {"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080},
            ],
            "externalIPs": [EXTERNAL_IP],
        },
    })
}

/// Whether this kernel has SCTP (`CONFIG_IP_SCTP`, module loaded on demand).
fn kernel_has_sctp() -> bool {
    // SAFETY: a socket call; the descriptor is closed at once.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, libc::IPPROTO_SCTP) };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        assert!(
            matches!(
                e.raw_os_error(),
                Some(libc::EPROTONOSUPPORT | libc::ESOCKTNOSUPPORT)
            ),
            "socket(AF_INET, SOCK_STREAM, IPPROTO_SCTP): {e}"
        );
        return false;
    }
    // SAFETY: our own descriptor.
    unsafe { libc::close(fd) };
    true
}

/// `(address, scope)` of every SCTP frontend `inspect services` lists.
fn sctp_frontends(views: &Value) -> Vec<(String, String, &Value)> {
    let mut out: Vec<_> = views
        .as_array()
        .expect("inspect services --json is a list")
        .iter()
        .filter(|v| v["protocol"] == "Sctp")
        .map(|v| {
            let addr = format!("{}:{}", v["addr"].as_str().unwrap_or("?"), v["port"]);
            (addr, v["scope"].as_str().unwrap_or("?").to_owned(), v)
        })
        .collect();
    out.sort_by(|a, b| (&a.0, &a.1).cmp(&(&b.0, &b.1)));
    out
}

#[test]
fn sctp_ports_are_reported_not_served_and_their_connects_left_alone() {
    require_root!();
    let mut env = Env::new("sctp", 2).unwrap();
    let slice = env.slice("sig", &[("sig", 8080, "SCTP"), ("http", 8080, "TCP")]);
    env.manifests
        .write("sig.yaml", &[sig_service(), slice.to_value()])
        .unwrap();
    env.start_agent().unwrap();
    let agent = env.agent();

    // The TCP port of the same Service and number is served as ever.
    let a = env.tcp(&format!("{VIP}:80"), 40);
    assert_ok_spread("TCP to the ClusterIP", &a, &["b1", "b2"], 0.2);

    // Every SCTP frontend is listed as not served, with nothing of it in
    // the datapath: the ClusterIP (pods), the externalIP in both scopes.
    let mut views = Value::Null;
    let listed = wait_until(Duration::from_secs(10), Duration::from_millis(100), || {
        views = agent.inspect_services().unwrap();
        sctp_frontends(&views).len() == 3
    });
    let sctp = sctp_frontends(&views);
    let names: Vec<(String, String)> = sctp
        .iter()
        .map(|(a, s, _)| (a.clone(), s.clone()))
        .collect();
    assert!(
        listed,
        "SCTP frontends in inspect services: {names:?}\n{views:#}"
    );
    assert_eq!(
        names,
        [
            (format!("{VIP}:80"), "Internal".to_owned()),
            (format!("{EXTERNAL_IP}:80"), "External".to_owned()),
            (format!("{EXTERNAL_IP}:80"), "Internal".to_owned()),
        ]
    );
    for (addr, scope, v) in &sctp {
        let u = &v["unprogrammed"];
        assert_eq!(u["reason"], "not_served", "{addr} {scope}: {v:#}");
        assert_eq!(u["service"], "demo/sig", "{addr} {scope}: {v:#}");
        assert_eq!(u["port_name"], "sig", "{addr} {scope}: {v:#}");
        assert_eq!(v["service_id"], 0, "{addr} {scope}: programmed? {v:#}");
        assert_eq!(v["backends"], json!([]), "{addr} {scope}: {v:#}");
    }
    let table = agent.inspect_services_raw(false).unwrap();
    assert!(
        table.contains("NOT SERVED for Service demo/sig port sig: SCTP is not served"),
        "inspect services:\n{table}"
    );

    // Counted by kind; not a failure to program, so /readyz stays plain.
    let (_, text) = agent.metrics().unwrap();
    let count = |kind: &str| {
        metric(
            &text,
            &format!("lb_frontends_not_served{{protocol=\"SCTP\",kind=\"{kind}\"}}"),
        )
    };
    assert_eq!(count("ClusterIP"), Some(1.0), "/metrics:\n{text}");
    assert_eq!(count("externalIP"), Some(2.0), "/metrics:\n{text}");
    let (code, body) = agent.get("/readyz").unwrap();
    assert_eq!(
        (code, body.contains("degraded")),
        (200, false),
        "/readyz: {body}"
    );

    // Logged once, naming the object, the field and the frontends.
    let log = agent.log();
    assert!(
        log.contains(
            "Service demo/sig: spec.ports[0].protocol: SCTP is not served (Linux runs no connect \
             or sendmsg hook for SCTP sockets, and the tc path does not rewrite SCTP): \
             ClusterIP 10.96.0.30:80/SCTP, externalIP 192.0.2.50:80/SCTP left alone"
        ),
        "agent log:\n{log}"
    );

    if !kernel_has_sctp() {
        eprintln!(
            "\n**************************************************************\n\
             SKIPPED the SCTP traffic: this kernel has no SCTP (socket(AF_INET, \
             SOCK_STREAM, IPPROTO_SCTP) fails with EPROTONOSUPPORT); \
             `cargo xtask kernels` runs it on kernels that have it\n\
             **************************************************************\n"
        );
        return;
    }
    // SCTP itself works between the namespaces: straight to a backend,
    // from the client in the agent's cgroup.
    let b1 = format!("{}:8080", pod_v4(1));
    let direct = env.client().proto(Proto::Sctp).run(&b1, 5).unwrap();
    assert_all_ok("SCTP straight to b1", &direct);
    assert!(
        direct.iter().all(|a| a.backend.as_deref() == Some("b1")),
        "{direct:?}"
    );

    // Through the ClusterIP no hook runs: the INIT leaves for 10.96.0.30
    // itself, which nothing answers, so the connect is still in progress
    // when the probe's 2 s are up (EINPROGRESS; ENETUNREACH without a
    // route), where the same client's connects to a backend complete at
    // once. A kernel that ran the connect hook for SCTP would fail this
    // (and should be served).
    let via_vip: Vec<Attempt> = env
        .client()
        .proto(Proto::Sctp)
        .run(&format!("{VIP}:80"), 3)
        .unwrap();
    for a in &via_vip {
        assert!(
            !a.ok
                && a.stage.as_deref() == Some("connect")
                && matches!(a.error.as_deref(), Some("EINPROGRESS" | "ENETUNREACH")),
            "SCTP to the ClusterIP: expected a connect that never completes, got {a:?}"
        );
    }
}
