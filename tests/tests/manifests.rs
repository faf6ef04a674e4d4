//! The manifests directory as a live input: edits, new and removed files,
//! and bad files next to good ones.
mod common;

use std::time::{Duration, Instant};

use common::*;
use integration_tests::{
    manifests::{Endpoint, EndpointSlice, Service},
    require_root, wait_until, Env, Proto, Spread,
};
use serde_json::json;

/// Polls with batches of `batch` TCP attempts at `target` until `done` holds
/// for a batch; how long that took.
fn poll(
    env: &Env,
    target: &str,
    batch: usize,
    timeout: Duration,
    done: impl Fn(&Spread) -> bool,
) -> Option<Duration> {
    let t = Instant::now();
    wait_until(timeout, Duration::from_millis(50), || {
        done(&Spread::of(&env.tcp(target, batch)))
    })
    .then(|| t.elapsed())
}

/// The slice of `web` with every backend but `skip`.
fn slice_without(env: &Env, ports: &[(&str, u16, &str)], skip: &str) -> EndpointSlice {
    let s = env.slice("web", ports);
    let skip = std::net::IpAddr::V4(env.topo.host(skip).ipv4);
    EndpointSlice {
        endpoints: s
            .endpoints
            .iter()
            .filter(|e| e.address != skip)
            .cloned()
            .collect(),
        ..s
    }
}

/// Polls 10.96.0.10:80 (batches of 30) until `done`, which must hold
/// within 5 s (else `late`) and took less than 2.5 s (`change`).
fn within_2500ms(env: &Env, label: &str, late: &str, change: &str, done: impl Fn(&Spread) -> bool) {
    let took = poll(env, "10.96.0.10:80", 30, Duration::from_secs(5), done);
    eprintln!("{label} after {took:?}");
    let took = took.expect(late);
    assert!(took < Duration::from_millis(2500), "{change} took {took:?}");
}

#[test]
fn endpoint_slice_edits_apply_live() {
    require_root!();
    let mut env = Env::new("live", 3).unwrap();
    let ports = [("http", 8080, "TCP"), ("dns", 8080, "UDP")];
    env.manifests
        .write("web-svc.yaml", &[web_service().to_value()])
        .unwrap();
    env.manifests
        .write("web-slice.yaml", &[env.slice("web", &ports).to_value()])
        .unwrap();
    env.start_agent().unwrap();
    let a = env.tcp("10.96.0.10:80", 150);
    assert_ok_spread("before the edit", &a, &["b1", "b2", "b3"], 0.15);

    // Remove b3 from the slice.
    env.manifests
        .write(
            "web-slice.yaml",
            &[slice_without(&env, &ports, "b3").to_value()],
        )
        .unwrap();
    within_2500ms(
        &env,
        "b3 removed: no longer chosen",
        "b3 still chosen 5 s after it left the EndpointSlice",
        "the removal",
        |s| s.ok() == s.total && s.count("b3") == 0,
    );
    let a = env.tcp("10.96.0.10:80", 150);
    assert_ok_spread("after removing b3", &a, &["b1", "b2"], 0.30);
    let a = env.attempts(Proto::Udp, "10.96.0.10:53", 60);
    assert_ok_spread("UDP after removing b3", &a, &["b1", "b2"], 0.2);

    // Put it back.
    env.manifests
        .write("web-slice.yaml", &[env.slice("web", &ports).to_value()])
        .unwrap();
    within_2500ms(
        &env,
        "b3 back: chosen again",
        "b3 not chosen 5 s after it came back",
        "the addition",
        |s| s.count("b3") > 0,
    );
    let a = env.tcp("10.96.0.10:80", 150);
    assert_ok_spread("after restoring b3", &a, &["b1", "b2", "b3"], 0.15);

    // Mark b1 unready in place.
    let s = env.slice_of("web", &ports, |h| {
        let ip = std::net::IpAddr::V4(h.ipv4);
        if h.name == "b1" {
            Endpoint::unready(ip)
        } else {
            Endpoint::ready(ip)
        }
    });
    env.manifests
        .write("web-slice.yaml", &[s.to_value()])
        .unwrap();
    let took = poll(&env, "10.96.0.10:80", 30, Duration::from_secs(5), |s| {
        s.ok() == s.total && s.count("b1") == 0
    });
    eprintln!("b1 unready: no longer chosen after {took:?}");
    took.expect("b1 still chosen 5 s after it became unready");
}

#[test]
fn services_come_and_go_with_their_files() {
    require_root!();
    let env = web_env("churn", 2);

    let target = "10.96.0.40:80";
    assert_all_fail("before api.json", &env.tcp(target, 2), "ENETUNREACH");
    // A JSON List, the other input format.
    let list = json!({
        "apiVersion": "v1",
        "kind": "List",
        "items": one_pod_http("api", "10.96.0.40", 2),
    });
    env.manifests.write_json("api.json", &list).unwrap();
    let took = poll(&env, target, 5, Duration::from_secs(5), |s| {
        s.count("b2") == s.total
    });
    eprintln!("new Service served after {took:?}");
    took.expect("a new Service file was not picked up within 5 s");

    env.manifests.remove("api.json").unwrap();
    let t = Instant::now();
    let gone = wait_until(Duration::from_secs(5), Duration::from_millis(50), || {
        env.tcp(target, 2)
            .iter()
            .all(|a| a.error.as_deref() == Some("ENETUNREACH"))
    });
    eprintln!("removed Service gone after {:?}", t.elapsed());
    assert!(gone, "the Service of a removed file is still served");
    assert_all_ok("web after the churn", &env.tcp("10.96.0.10:80", 20));
}

#[test]
fn bad_manifests_leave_good_services_served() {
    require_root!();
    let mut env = Env::new("bad", 2).unwrap();
    let m = &env.manifests;
    m.write("web.yaml", &web(&env)).unwrap();
    m.write_raw(
        "broken.yaml",
        "apiVersion: v1\nkind: Service\nmetadata: {name: broken\nspec: [\n",
    )
    .unwrap();
    m.write_raw(
        "broken.json",
        "{\"apiVersion\": \"v1\", \"kind\": \"Service\", ",
    )
    .unwrap();
    m.write(
        "port70000.yaml",
        &[Service::new("demo", "bigport")
            .cluster_ip("10.96.0.30")
            .port("http", 70000, "TCP", json!(8080))
            .to_value()],
    )
    .unwrap();
    m.write(
        "badip.yaml",
        &[http_service("badip", "10.96.0.999").to_value()],
    )
    .unwrap();
    env.start_agent().unwrap();

    let a = env.tcp("10.96.0.10:80", 60);
    assert_ok_spread("good Service next to bad files", &a, &["b1", "b2"], 0.2);

    // More bad input while running.
    let m = &env.manifests;
    m.write_raw("later.yaml", "kind: [\n  - :\n").unwrap();
    m.write(
        "later-ip.yaml",
        &[http_service("notanip", "not-an-ip").to_value()],
    )
    .unwrap();
    // A second definition of web: the file that loses is named.
    m.write("web2.yaml", &[web_service().to_value()]).unwrap();
    // ... and a good Service after it: once that is served, the bad files
    // have been through a sync too.
    m.write("good2.yaml", &one_pod_http("good2", "10.96.0.41", 1))
        .unwrap();
    let took = poll(&env, "10.96.0.41:80", 5, Duration::from_secs(5), |s| {
        s.count("b1") == s.total
    });
    took.expect("a good Service written next to bad files was not served within 5 s");

    let agent = env.agent();
    eprintln!("the agent's log (its complaints):\n{}", agent.log());
    assert!(
        agent.is_running(),
        "the agent died on bad input:\n{}",
        agent.log()
    );
    assert_eq!(agent.get("/healthz").unwrap().0, 200);
    assert_eq!(agent.get("/readyz").unwrap().0, 200);
    // Found by translation, named by file.
    let log = agent.log();
    let bigport = env.manifests.path().join("port70000.yaml");
    assert!(
        log.contains(&format!(
            "{}: Service demo/bigport: spec.ports[0].port: 70000 is outside 1..65535",
            bigport.display()
        )),
        "the port's rejection does not name its file"
    );
    let (web, again) = (m.path().join("web.yaml"), m.path().join("web2.yaml"));
    assert!(
        log.contains(&format!(
            "skipped: {}: Service demo/web: metadata.name: duplicate: already defined in {}, which wins",
            again.display(),
            web.display()
        )),
        "the duplicate is not reported against the file that loses"
    );
    assert_all_ok(
        "good Service after more bad files",
        &env.tcp("10.96.0.10:80", 30),
    );
}
