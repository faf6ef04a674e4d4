//! The reverse view of TCP sockets (`LB_SOCK_PEER`, an array of entries
//! by socket cookie): connect records one entry per socket it sends to a
//! backend, `sock_release` frees it when the socket is closed, so the map
//! holds the sockets open now and never fills with closed ones; past its
//! capacity connects still work, and only `getpeername` shows the backend.
mod common;

use std::time::Duration;

use common::*;
use integration_tests::{
    cluster::HeldTcp, pinned::PinnedMap, require_root, wait_until, AgentOpts, Env,
};

/// The pinned `LB_SOCK_PEER`'s held slots: (cookie, frontend port,
/// backend port), decoded from `lb_common::SockPeerEntry` (a free slot's
/// cookie is 0).
fn sock_peers(env: &Env) -> Vec<(u64, u16, u16)> {
    let map = PinnedMap::open(&env.agent().pin_dir().join("LB_SOCK_PEER")).unwrap();
    assert_eq!((map.key_size, map.value_size), (4, 48));
    map.entries()
        .unwrap()
        .into_iter()
        .filter_map(|(_, v)| {
            let cookie = u64::from_ne_bytes(v[..8].try_into().unwrap());
            (cookie != 0).then(|| {
                (
                    cookie,
                    u16::from_ne_bytes([v[42], v[43]]),
                    u16::from_ne_bytes([v[40], v[41]]),
                )
            })
        })
        .collect()
}

/// `lb_datapath_events_total{event}`, once the agent has added the
/// kernel's counters to /metrics (at each sweep, every 5 s).
fn events(env: &Env, event: &str) -> Option<f64> {
    let (code, body) = env.agent().metrics().unwrap();
    assert_eq!(code, 200, "{body}");
    let prefix = format!("lb_datapath_events_total{{event=\"{event}\"}} ");
    body.lines()
        .find_map(|l| l.strip_prefix(&prefix)?.parse().ok())
}

#[test]
fn open_sockets_are_recorded_and_closed_ones_forgotten() {
    require_root!();
    let env = web_env("sockpeer", 3);
    for round in 0..3 {
        let held = HeldTcp::open(&env, &format!("{VIP}:80"), 50).unwrap();
        for p in &held.peers {
            assert_eq!(p.as_deref(), Ok("10.96.0.10:80"), "round {round}");
        }
        let peers = sock_peers(&env);
        assert_eq!(peers.len(), 50, "round {round}: {peers:?}");
        assert!(
            peers.iter().all(|&(_, f, b)| f == 80 && b == 8080),
            "{peers:?}"
        );
        held.close().unwrap();
        // The sockets are released when their last reference goes, right
        // after close(2) returns; allow the probe's exit a moment.
        let mut left = Vec::new();
        let gone = wait_until(Duration::from_secs(5), Duration::from_millis(50), || {
            left = sock_peers(&env);
            left.is_empty()
        });
        assert!(
            gone,
            "round {round}: closed sockets still recorded: {left:?}"
        );
    }
    // Short connections (connect, read, close) leave nothing either.
    let a = env.tcp(&format!("{VIP}:80"), 200);
    assert_all_ok("TCP", &a);
    assert_peer("TCP getpeername", &a, "10.96.0.10:80");
    assert!(
        wait_until(Duration::from_secs(5), Duration::from_millis(50), || {
            sock_peers(&env).is_empty()
        }),
        "{:?}",
        sock_peers(&env)
    );
    // The agent adds the kernel's counters to /metrics at each sweep (5 s).
    std::thread::sleep(Duration::from_secs(6));
    assert_eq!(events(&env, "sock_peer_lost"), Some(0.0));
}

#[test]
fn past_capacity_connects_work_and_show_the_backend() {
    require_root!();
    let mut env = Env::new("sockpeerfull", 3).unwrap();
    env.manifests.write("web.yaml", &web(&env)).unwrap();
    env.start_agent_with(AgentOpts {
        extra_args: vec!["--max-sock-peers".into(), "8".into()],
        ..Default::default()
    })
    .unwrap();
    let held = HeldTcp::open(&env, &format!("{VIP}:80"), 12).unwrap();
    let vip = held
        .peers
        .iter()
        .filter(|p| p.as_deref() == Ok("10.96.0.10:80"))
        .count();
    let backend = held
        .peers
        .iter()
        .filter(|p| p.as_ref().is_ok_and(|p| p.ends_with(":8080")))
        .count();
    // 8 slots: a socket takes one of the 4 its cookie names, so at most 8
    // and at least 4 (the first 4 always find one) are recorded; the rest
    // connect all the same.
    assert_eq!(vip + backend, 12, "{:?}", held.peers);
    assert!((4..=8).contains(&vip), "{:?}", held.peers);
    assert_eq!(sock_peers(&env).len(), vip);
    let mut lost = None;
    wait_until(Duration::from_secs(15), Duration::from_millis(200), || {
        lost = events(&env, "sock_peer_lost");
        lost >= Some(backend as f64)
    });
    assert_eq!(lost, Some(backend as f64));
    held.close().unwrap();
    // Room again once they are closed.
    assert!(wait_until(
        Duration::from_secs(5),
        Duration::from_millis(50),
        || sock_peers(&env).is_empty()
    ));
    let held = HeldTcp::open(&env, &format!("{VIP}:80"), 4).unwrap();
    for p in &held.peers {
        assert_eq!(p.as_deref(), Ok("10.96.0.10:80"));
    }
    held.close().unwrap();
}
