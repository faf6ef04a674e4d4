//! The API server fixture (`integration_tests::apiserver`) driven by the real
//! kube-rs client and runtime: watchers, reflectors, relists, re-watches,
//! outages, selectors, pagination. No root needed.

use std::{
    collections::BTreeSet,
    fmt::Debug,
    future::Future,
    time::{Duration, Instant},
};

use futures_util::StreamExt;
use integration_tests::apiserver::{ApiServer, Kind, Outage};
use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use kube::{
    api::{Api, ListParams},
    runtime::{
        reflector::{self, Store},
        watcher::{self, Event},
        WatchStreamExt,
    },
    Client, Resource, ResourceExt,
};
use serde::de::DeserializeOwned;
use serde_json::json;
use tokio::{sync::mpsc, task::JoinHandle};

/// Every test is bounded by this.
const TEST_TIMEOUT: Duration = Duration::from_secs(40);

async fn bounded<F: Future<Output = ()>>(f: F) {
    tokio::time::timeout(TEST_TIMEOUT, f)
        .await
        .expect("test timed out");
}

fn client(api: &ApiServer) -> Client {
    let config = kube::Config::new(api.url().parse().expect("URL"));
    Client::try_from(config).expect("kube client")
}

fn service(ns: &str, name: &str, labels: &[(&str, &str)], port: u16) -> serde_json::Value {
    let labels: serde_json::Map<String, serde_json::Value> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), json!(v)))
        .collect();
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.10",
                 "ports": [{"name": "http", "port": port, "protocol": "TCP", "targetPort": 8080}]},
    })
}

fn node(name: &str) -> Node {
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "spec": {"podCIDR": "10.244.0.0/24"},
    }))
    .unwrap()
}

fn slice(ns: &str, name: &str, service: &str, ips: &[&str]) -> EndpointSlice {
    serde_json::from_value(json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": ns,
                     "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": ips.iter().map(|ip| json!({
            "addresses": [ip], "conditions": {"ready": true}
        })).collect::<Vec<_>>(),
    }))
    .unwrap()
}

/// `ns/name@rv` of an object.
fn id<K: Resource>(o: &K) -> String {
    format!(
        "{}/{}@{}",
        o.meta().namespace.as_deref().unwrap_or(""),
        o.meta().name.as_deref().unwrap_or(""),
        o.meta().resource_version.as_deref().unwrap_or("")
    )
}

fn rv_of(v: &serde_json::Value) -> String {
    v["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_string()
}

fn fmt_event<K: Resource>(e: &Result<Event<K>, watcher::Error>) -> String {
    match e {
        Ok(Event::Init) => "Init".into(),
        Ok(Event::InitApply(o)) => format!("InitApply({})", id(o)),
        Ok(Event::InitDone) => "InitDone".into(),
        Ok(Event::Apply(o)) => format!("Apply({})", id(o)),
        Ok(Event::Delete(o)) => format!("Delete({})", id(o)),
        Err(e) => format!("Err({e})"),
    }
}

/// A watcher (with the default backoff) feeding a reflector store, and
/// every event it yielded, formatted.
struct Watch<K: Resource + Clone + 'static>
where
    K::DynamicType: std::hash::Hash + Eq + Clone,
{
    store: Store<K>,
    events: mpsc::UnboundedReceiver<String>,
    task: JoinHandle<()>,
}

impl<K: Resource + Clone + 'static> Drop for Watch<K>
where
    K::DynamicType: std::hash::Hash + Eq + Clone,
{
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn reflect<K>(api: Api<K>, cfg: watcher::Config) -> Watch<K>
where
    K: Resource + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: std::hash::Hash + Eq + Clone + Default,
{
    let (store, writer) = reflector::store();
    let (tx, events) = mpsc::unbounded_channel();
    let stream = watcher::watcher(api, cfg).default_backoff().reflect(writer);
    let task = tokio::spawn(async move {
        stream
            .for_each(|e| {
                let _ = tx.send(fmt_event(&e));
                async {}
            })
            .await;
    });
    Watch {
        store,
        events,
        task,
    }
}

impl<K: Resource + Clone + 'static> Watch<K>
where
    K::DynamicType: std::hash::Hash + Eq + Clone,
{
    /// `ns/name@rv` of the reflector's objects.
    fn view(&self) -> BTreeSet<String> {
        self.store.state().iter().map(|o| id(o.as_ref())).collect()
    }

    /// The next `n` events.
    async fn next(&mut self, n: usize) -> Vec<String> {
        let mut out = Vec::new();
        while out.len() < n {
            match tokio::time::timeout(Duration::from_secs(10), self.events.recv()).await {
                Ok(Some(e)) => out.push(e),
                _ => panic!("only got {out:?}, wanted {n} events"),
            }
        }
        out
    }

    /// The next `n` events that are not errors (a client may see a
    /// transient error when the server closes connections under it, e.g.
    /// a request sent on a pooled connection being closed).
    async fn next_ok(&mut self, n: usize) -> Vec<String> {
        let mut out = Vec::new();
        while out.len() < n {
            let e = self.next(1).await.remove(0);
            if !e.starts_with("Err(") {
                out.push(e);
            }
        }
        out
    }

    /// Every event received so far.
    fn drain(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        while let Ok(e) = self.events.try_recv() {
            out.push(e);
        }
        out
    }
}

/// `ns/name@rv` of the server's objects of `kind` passing `keep`.
fn server_view(
    api: &ApiServer,
    kind: Kind,
    keep: impl Fn(&serde_json::Value) -> bool,
) -> BTreeSet<String> {
    api.objects(kind)
        .iter()
        .filter(|o| keep(o))
        .map(|o| {
            format!(
                "{}/{}@{}",
                o["metadata"]["namespace"].as_str().unwrap_or(""),
                o["metadata"]["name"].as_str().unwrap(),
                rv_of(o)
            )
        })
        .collect()
}

/// Polls `f` until true, or panics after `timeout` with `what`.
async fn eventually(timeout: Duration, what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        if Instant::now() > deadline {
            panic!("timed out waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the reflector shows exactly the server's objects.
async fn converge<K: Resource + Clone + 'static>(
    w: &Watch<K>,
    api: &ApiServer,
    kind: Kind,
    keep: impl Fn(&serde_json::Value) -> bool,
    timeout: Duration,
) where
    K::DynamicType: std::hash::Hash + Eq + Clone,
{
    let deadline = Instant::now() + timeout;
    loop {
        let want = server_view(api, kind, &keep);
        let got = w.view();
        if want == got {
            return;
        }
        if Instant::now() > deadline {
            panic!(
                "the reflector did not converge:\n  server: {want:?}\n  client: {got:?}\n  requests: {:#?}",
                api.requests().iter().rev().take(15).collect::<Vec<_>>()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn all(_: &serde_json::Value) -> bool {
    true
}

/// Services `demo/s0` .. `demo/s{n-1}`, port 80.
fn apply_services(api: &ApiServer, n: usize) {
    for i in 0..n {
        api.apply(&service("demo", &format!("s{i}"), &[], 80))
            .unwrap();
    }
}

/// A watch of every Service.
fn watch_services(api: &ApiServer, cfg: watcher::Config) -> Watch<Service> {
    reflect(Api::<Service>::all(client(api)), cfg)
}

/// Waits (up to 5 s) until exactly `n` watches of `kind` are open.
async fn open_watches(api: &ApiServer, kind: Kind, n: u64) {
    eventually(
        Duration::from_secs(5),
        &format!("{n} open {kind:?} watch(es)"),
        || api.open_watches(kind) == n,
    )
    .await;
}

/// Init/InitApply/InitDone with the initial objects, then Apply/Delete for
/// changes, with the server's resourceVersions.
async fn watch_events(cfg: watcher::Config, objects: usize) -> ApiServer {
    let api = ApiServer::start();
    let mut initial = Vec::new();
    for i in 0..objects {
        let v = api
            .apply(&service("demo", &format!("s{i}"), &[], 80))
            .unwrap();
        initial.push(format!("InitApply(demo/s{i}@{})", rv_of(&v)));
    }
    let mut w = watch_services(&api, cfg);
    let mut want = vec!["Init".to_string()];
    want.extend(initial);
    want.push("InitDone".into());
    assert_eq!(w.next(objects + 2).await, want);

    open_watches(&api, Kind::Service, 1).await;
    let added = api.apply(&service("other", "new", &[], 80)).unwrap();
    let modified = api.apply(&service("demo", "s0", &[], 81)).unwrap();
    let deleted = api.delete(Kind::Service, "demo", "s1").unwrap();
    assert_eq!(
        w.next(3).await,
        [
            format!("Apply(other/new@{})", rv_of(&added)),
            format!("Apply(demo/s0@{})", rv_of(&modified)),
            format!("Delete(demo/s1@{})", rv_of(&deleted)),
        ]
    );
    // A no-op update is no event.
    let same = api.apply(&service("demo", "s0", &[], 81)).unwrap();
    assert_eq!(rv_of(&same), rv_of(&modified));
    converge(&w, &api, Kind::Service, all, Duration::from_secs(5)).await;
    assert_eq!(w.drain(), Vec::<String>::new());
    api
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watcher_default_config_sees_init_then_changes() {
    bounded(async {
        let api = watch_events(watcher::Config::default(), 3).await;
        let s = api.stats(Kind::Service);
        assert_eq!(s.lists, 1, "{s:?}");
        assert!(s.watches >= 1, "{s:?}");
        assert!(api
            .requests()
            .iter()
            .any(|r| r.starts_with("GET /api/v1/services?")
                && r.contains("watch=true")
                && r.contains("allowWatchBookmarks=true")));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watcher_any_semantic() {
    bounded(async {
        // With a page size, kube-rs omits resourceVersion=0 (it would
        // disable pagination on a real server) ...
        let api = watch_events(watcher::Config::default().any_semantic(), 2).await;
        assert_eq!(api.list_count(Kind::Service), 1);
        // ... without one, it asks for "any" version.
        let mut cfg = watcher::Config::default().any_semantic();
        cfg.page_size = None;
        let api = watch_events(cfg, 2).await;
        assert!(
            api.requests()
                .iter()
                .any(|r| r.contains("resourceVersion=0&resourceVersionMatch=NotOlderThan")),
            "{:?}",
            api.requests()
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watcher_paginates() {
    bounded(async {
        let api = watch_events(watcher::Config::default().page_size(2), 5).await;
        // 5 objects in pages of 2.
        assert_eq!(api.list_count(Kind::Service), 3);
        let lists: Vec<String> = api
            .requests()
            .into_iter()
            .filter(|r| !r.contains("watch="))
            .collect();
        assert!(lists[1].contains("continue="), "{lists:?}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watcher_streaming_lists() {
    bounded(async {
        let api = watch_events(watcher::Config::default().streaming_lists(), 3).await;
        assert_eq!(api.list_count(Kind::Service), 0);
        assert!(api
            .requests()
            .iter()
            .any(|r| r.contains("sendInitialEvents=true")));
    })
    .await;
}

/// Paginated lists are consistent snapshots; their continue tokens expire
/// with compaction; list items carry no kind; GET works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pagination_is_a_consistent_snapshot() {
    bounded(async {
        let api = ApiServer::start();
        apply_services(&api, 4);
        let svcs = Api::<Service>::all(client(&api));
        let page1 = svcs.list(&ListParams::default().limit(2)).await.unwrap();
        let names = |l: &kube::core::ObjectList<Service>| -> Vec<String> {
            l.items.iter().map(|s| s.name_any()).collect()
        };
        assert_eq!(names(&page1), ["s0", "s1"]);
        assert_eq!(page1.metadata.remaining_item_count, Some(2));
        let token = page1.metadata.continue_.clone().unwrap();
        // Changes after the first page do not show in the next ones.
        api.delete(Kind::Service, "demo", "s3").unwrap();
        api.apply(&service("demo", "s2", &[], 99)).unwrap();
        api.apply(&service("demo", "s4", &[], 80)).unwrap();
        let page2 = svcs
            .list(&ListParams::default().limit(2).continue_token(&token))
            .await
            .unwrap();
        assert_eq!(names(&page2), ["s2", "s3"]);
        assert_eq!(
            page2.metadata.resource_version,
            page1.metadata.resource_version
        );
        assert_eq!(
            page2.items[0]
                .spec
                .as_ref()
                .unwrap()
                .ports
                .as_ref()
                .unwrap()[0]
                .port,
            80
        );
        assert!(page2.metadata.continue_.is_none());
        // A fresh list sees the changes.
        let now = svcs.list(&ListParams::default()).await.unwrap();
        assert_eq!(names(&now), ["s0", "s1", "s2", "s4"]);
        assert_eq!(
            now.metadata.resource_version,
            Some(api.resource_version().to_string())
        );
        // Compaction expires continue tokens: 410.
        api.compact();
        match svcs
            .list(&ListParams::default().limit(2).continue_token(&token))
            .await
        {
            Err(kube::Error::Api(s)) => assert_eq!((s.code, s.reason.as_str()), (410, "Expired")),
            other => panic!("expected 410, got {other:?}"),
        }
        // Raw items carry no kind/apiVersion, like kube-apiserver's.
        let raw = client(&api)
            .request_text(http_get("/api/v1/namespaces/demo/services?limit=1"))
            .await
            .unwrap();
        let raw: serde_json::Value = serde_json::from_str(&raw).unwrap();
        assert_eq!(raw["kind"], "ServiceList");
        assert!(raw["items"][0].get("kind").is_none(), "{raw}");
        assert!(raw["metadata"]["continue"].is_string());
        // GET one object, and a 404.
        let ns = Api::<Service>::namespaced(client(&api), "demo");
        assert_eq!(ns.get("s4").await.unwrap().name_any(), "s4");
        match ns.get("nope").await {
            Err(kube::Error::Api(s)) => assert_eq!(s.code, 404),
            other => panic!("expected 404, got {other:?}"),
        }
    })
    .await;
}

fn http_get(path: &str) -> hyper::Request<Vec<u8>> {
    hyper::Request::get(path).body(Vec::new()).unwrap()
}

/// `expire_watches` makes the watcher relist; changes made around it all
/// arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_watch_relists_and_converges() {
    bounded(async {
        let api = ApiServer::start();
        apply_services(&api, 4);
        let mut w = watch_services(&api, watcher::Config::default());
        converge(&w, &api, Kind::Service, all, Duration::from_secs(5)).await;
        open_watches(&api, Kind::Service, 1).await;
        assert_eq!(api.list_count(Kind::Service), 1);
        w.drain();

        api.expire_watches();
        api.delete(Kind::Service, "demo", "s0").unwrap();
        api.apply(&service("demo", "s9", &[], 80)).unwrap();
        eventually(Duration::from_secs(10), "a relist", || {
            api.list_count(Kind::Service) == 2
        })
        .await;
        converge(&w, &api, Kind::Service, all, Duration::from_secs(10)).await;
        let s = api.stats(Kind::Service);
        assert_eq!((s.lists, s.expired), (2, 1), "{s:?}");
        let events = w.drain();
        assert!(
            events
                .iter()
                .any(|e| e.starts_with("Err(") && e.contains("Expired"))
                && events.iter().any(|e| e == "Init"),
            "{events:?}"
        );
    })
    .await;
}

/// Deletions and additions made while the watch is broken, then compacted
/// away: the resume gets 410, the watcher relists, the reflector drops the
/// deleted objects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compacted_history_relists_and_converges() {
    bounded(async {
        let api = ApiServer::start();
        apply_services(&api, 5);
        let w = watch_services(&api, watcher::Config::default());
        converge(&w, &api, Kind::Service, all, Duration::from_secs(5)).await;
        open_watches(&api, Kind::Service, 1).await;

        api.go_away();
        api.delete(Kind::Service, "demo", "s0").unwrap();
        api.delete(Kind::Service, "demo", "s2").unwrap();
        api.apply(&service("demo", "s3", &[], 443)).unwrap();
        api.apply(&service("demo", "s7", &[], 80)).unwrap();
        api.compact();
        tokio::time::sleep(Duration::from_millis(300)).await;
        api.come_back();
        eventually(Duration::from_secs(15), "a relist", || {
            api.list_count(Kind::Service) == 2
        })
        .await;
        converge(&w, &api, Kind::Service, all, Duration::from_secs(10)).await;
        assert!(!w
            .view()
            .iter()
            .any(|o| o.starts_with("demo/s0@") || o.starts_with("demo/s2@")));
        assert_eq!(api.stats(Kind::Service).expired, 1);

        // Without bookmarks, a compaction plus a dropped connection is
        // enough: the watcher resumes from its last event's version.
        let w2 = watch_services(&api, watcher::Config::default().disable_bookmarks());
        converge(&w2, &api, Kind::Service, all, Duration::from_secs(5)).await;
        open_watches(&api, Kind::Service, 2).await;
        let lists = api.list_count(Kind::Service);
        api.compact();
        api.drop_connections();
        api.delete(Kind::Service, "demo", "s1").unwrap();
        eventually(Duration::from_secs(10), "a relist of w2", || {
            api.list_count(Kind::Service) > lists
        })
        .await;
        converge(&w2, &api, Kind::Service, all, Duration::from_secs(10)).await;
        converge(&w, &api, Kind::Service, all, Duration::from_secs(10)).await;
    })
    .await;
}

/// A dropped connection (and a watch timeout) makes the watcher re-watch
/// from its last resourceVersion: no relist, every event exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_connections_rewatch_without_relist() {
    bounded(async {
        let api = ApiServer::start();
        api.set_watch_timeout_cap(Duration::from_secs(1));
        apply_services(&api, 3);
        let mut w = watch_services(&api, watcher::Config::default());
        assert_eq!(w.next(5).await.last().unwrap(), "InitDone");
        // Watches time out after 1 s and are resumed.
        eventually(Duration::from_secs(10), "re-watches after timeouts", || {
            api.watch_count(Kind::Service) >= 3
        })
        .await;
        api.set_watch_timeout_cap(Duration::from_secs(10));
        open_watches(&api, Kind::Service, 1).await;
        let watches = api.watch_count(Kind::Service);

        // (The watcher re-watches at once: the open count may be back to 1
        // by the time this returns.)
        api.drop_connections();
        let a = api.apply(&service("demo", "s7", &[], 80)).unwrap();
        let m = api.apply(&service("demo", "s1", &[], 81)).unwrap();
        let d = api.delete(Kind::Service, "demo", "s2").unwrap();
        let want = [
            format!("Apply(demo/s7@{})", rv_of(&a)),
            format!("Apply(demo/s1@{})", rv_of(&m)),
            format!("Delete(demo/s2@{})", rv_of(&d)),
        ];
        assert_eq!(w.next_ok(3).await, want);
        converge(&w, &api, Kind::Service, all, Duration::from_secs(5)).await;
        open_watches(&api, Kind::Service, 1).await;
        let s = api.stats(Kind::Service);
        assert_eq!((s.lists, s.expired), (1, 0), "{s:?}");
        assert!(s.watches > watches, "{s:?}");
        // And nothing else (the abrupt close is a quiet EOF to kube-rs).
        tokio::time::sleep(Duration::from_millis(300)).await;
        let rest: Vec<String> = w
            .drain()
            .into_iter()
            .filter(|e| !e.starts_with("Err("))
            .collect();
        assert_eq!(rest, Vec::<String>::new());
    })
    .await;
}

/// An outage with changes made meanwhile: with the default backoff the
/// watcher recovers and converges; with history kept, it resumes without a
/// relist.
async fn outage(kind_of_outage: Outage) {
    let api = ApiServer::start();
    apply_services(&api, 3);
    let w = watch_services(&api, watcher::Config::default());
    converge(&w, &api, Kind::Service, all, Duration::from_secs(5)).await;
    open_watches(&api, Kind::Service, 1).await;

    api.go_away_with(kind_of_outage);
    assert!(api.is_away());
    assert_eq!(api.open_watches(Kind::Service), 0);
    // Clients see errors at once, not hangs.
    let t = Instant::now();
    let r = Api::<Service>::all(client(&api))
        .list(&ListParams::default())
        .await;
    assert!(r.is_err(), "{r:?}");
    assert!(t.elapsed() < Duration::from_secs(2));
    if kind_of_outage == Outage::Refuse {
        let e = std::net::TcpStream::connect(api.addr()).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused);
    }
    api.delete(Kind::Service, "demo", "s0").unwrap();
    api.apply(&service("demo", "s1", &[], 8080)).unwrap();
    api.apply(&service("demo", "s5", &[], 80)).unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    api.come_back();
    assert!(!api.is_away());
    converge(&w, &api, Kind::Service, all, Duration::from_secs(15)).await;
    // The failed list above was ours, not the watcher's.
    let s = api.stats(Kind::Service);
    assert_eq!((s.lists, s.expired), (1, 0), "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outage_refused_recovers() {
    bounded(outage(Outage::Refuse)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outage_reset_recovers() {
    bounded(outage(Outage::Reset)).await;
}

const PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn label_and_field_selectors() {
    bounded(async {
        let api = ApiServer::start();
        api.apply(&service("demo", "plain", &[], 80)).unwrap();
        api.apply(&service(
            "demo",
            "other-proxy",
            &[(PROXY_NAME, "other")],
            80,
        ))
        .unwrap();
        api.apply(&service("demo", "web", &[("app", "web")], 80))
            .unwrap();
        api.apply(&service("kube-system", "db", &[("app", "db")], 80))
            .unwrap();
        let unproxied = |o: &serde_json::Value| o["metadata"]["labels"].get(PROXY_NAME).is_none();

        let mut w = watch_services(
            &api,
            watcher::Config::default().labels(&format!("!{PROXY_NAME}")),
        );
        converge(&w, &api, Kind::Service, unproxied, Duration::from_secs(5)).await;
        assert_eq!(w.view().len(), 3);
        open_watches(&api, Kind::Service, 1).await;
        w.drain();
        // Starting to match is an ADDED, stopping a DELETED (the cacher's way).
        let gone = api
            .apply(&service("demo", "plain", &[(PROXY_NAME, "x")], 80))
            .unwrap();
        let back = api.apply(&service("demo", "other-proxy", &[], 80)).unwrap();
        api.apply(&service("demo", "plain", &[(PROXY_NAME, "y")], 80))
            .unwrap(); // unseen
        assert_eq!(
            w.next(2).await,
            [
                format!("Delete(demo/plain@{})", rv_of(&gone)),
                format!("Apply(demo/other-proxy@{})", rv_of(&back)),
            ]
        );
        converge(&w, &api, Kind::Service, unproxied, Duration::from_secs(5)).await;

        let names = |l: kube::core::ObjectList<Service>| -> Vec<String> {
            l.items
                .iter()
                .map(|s| format!("{}/{}", s.namespace().unwrap(), s.name_any()))
                .collect()
        };
        let svcs = Api::<Service>::all(client(&api));
        let lp = |s: &str| ListParams::default().labels(s);
        assert_eq!(
            names(svcs.list(&lp("app")).await.unwrap()),
            ["demo/web", "kube-system/db"]
        );
        assert_eq!(
            names(svcs.list(&lp("app=web")).await.unwrap()),
            ["demo/web"]
        );
        assert_eq!(
            names(svcs.list(&lp("app!=web")).await.unwrap()),
            ["demo/other-proxy", "demo/plain", "kube-system/db"]
        );
        assert_eq!(
            names(svcs.list(&lp("app in (db,x),!nope")).await.unwrap()),
            ["kube-system/db"]
        );
        assert_eq!(
            names(
                svcs.list(
                    &ListParams::default().fields("metadata.namespace=demo,metadata.name!=web")
                )
                .await
                .unwrap()
            ),
            ["demo/other-proxy", "demo/plain"]
        );
        assert_eq!(
            names(
                Api::<Service>::namespaced(client(&api), "kube-system")
                    .list(&ListParams::default())
                    .await
                    .unwrap()
            ),
            ["kube-system/db"]
        );
        match svcs.list(&lp("a in (b")).await {
            Err(kube::Error::Api(s)) => assert_eq!(s.code, 400),
            other => panic!("expected 400, got {other:?}"),
        }

        // Nodes by name.
        for n in ["n1", "n2", "n3"] {
            api.apply_typed(&node(n)).unwrap();
        }
        let is_n2 = |o: &serde_json::Value| o["metadata"]["name"] == "n2";
        let mut nw = reflect(
            Api::<Node>::all(client(&api)),
            watcher::Config::default().fields("metadata.name=n2"),
        );
        converge(&nw, &api, Kind::Node, is_n2, Duration::from_secs(5)).await;
        assert_eq!(nw.view().len(), 1);
        open_watches(&api, Kind::Node, 1).await;
        nw.drain();
        let mut n1 = node("n1");
        n1.spec.as_mut().unwrap().unschedulable = Some(true);
        api.apply(&n1).unwrap();
        let mut n2 = node("n2");
        n2.spec.as_mut().unwrap().unschedulable = Some(true);
        let n2 = api.apply_typed(&n2).unwrap();
        assert_eq!(
            nw.next(1).await,
            [format!("Apply(/n2@{})", n2.resource_version().unwrap())]
        );
        converge(&nw, &api, Kind::Node, is_n2, Duration::from_secs(5)).await;
        let nodes = Api::<Node>::all(client(&api));
        assert_eq!(nodes.get("n3").await.unwrap().name_any(), "n3");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpointslices_list_watch() {
    bounded(async {
        let api = ApiServer::start();
        api.apply(&slice("demo", "web-a", "web", &["10.0.0.1", "10.0.0.2"]))
            .unwrap();
        api.apply(&slice("demo", "web-b", "web", &["10.0.0.3"]))
            .unwrap();
        api.apply(&slice("demo", "db-a", "db", &["10.0.0.9"]))
            .unwrap();
        api.apply(&slice("other", "web-a", "web", &["10.1.0.1"]))
            .unwrap();

        let mut w = reflect(
            Api::<EndpointSlice>::all(client(&api)),
            watcher::Config::default().page_size(2),
        );
        converge(&w, &api, Kind::EndpointSlice, all, Duration::from_secs(5)).await;
        assert_eq!(api.list_count(Kind::EndpointSlice), 2);
        open_watches(&api, Kind::EndpointSlice, 1).await;
        w.drain();
        let changed = api
            .apply_typed(&slice("demo", "web-b", "web", &["10.0.0.3", "10.0.0.4"]))
            .unwrap();
        assert_eq!(w.next(1).await, [format!("Apply({})", id(&changed))]);
        assert_eq!(
            w.store
                .state()
                .iter()
                .find(|s| s.name_any() == "web-b")
                .unwrap()
                .endpoints
                .as_ref()
                .map_or(0, Vec::len),
            2
        );
        api.delete(Kind::EndpointSlice, "demo", "db-a").unwrap();
        converge(&w, &api, Kind::EndpointSlice, all, Duration::from_secs(5)).await;
        api.expire_watches();
        api.apply(&slice("demo", "db-b", "db", &["10.0.0.10"]))
            .unwrap();
        eventually(Duration::from_secs(10), "a relist", || {
            api.list_count(Kind::EndpointSlice) >= 4
        })
        .await;
        converge(&w, &api, Kind::EndpointSlice, all, Duration::from_secs(5)).await;

        // The namespaced collection and a label selector, as kube-proxy uses.
        let web: Vec<String> = Api::<EndpointSlice>::namespaced(client(&api), "demo")
            .list(&ListParams::default().labels("kubernetes.io/service-name=web"))
            .await
            .unwrap()
            .items
            .iter()
            .map(|s| s.name_any())
            .collect();
        assert_eq!(web, ["web-a", "web-b"]);
        // Services are not disturbed by EndpointSlice traffic.
        assert_eq!(api.stats(Kind::Service), Default::default());
    })
    .await;
}

/// The agent's way in: a kubeconfig file. Plus discovery and /version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubeconfig_and_discovery() {
    bounded(async {
        let api = ApiServer::start();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubeconfig");
        api.write_kubeconfig(&path).unwrap();
        let kc = kube::config::Kubeconfig::read_from(&path).unwrap();
        let config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .unwrap();
        assert_eq!(config.default_namespace, "default");
        let client = Client::try_from(config).unwrap();
        let v = client.apiserver_version().await.unwrap();
        assert_eq!((v.major.as_str(), v.minor.as_str()), ("1", "33"));
        let core = client.list_core_api_versions().await.unwrap();
        assert_eq!(core.versions, ["v1"]);
        let groups = client.list_api_groups().await.unwrap();
        assert_eq!(groups.groups[0].name, "discovery.k8s.io");
        let res = client
            .list_api_group_resources("discovery.k8s.io/v1")
            .await
            .unwrap();
        assert_eq!(res.resources[0].kind, "EndpointSlice");
        let core_res = client.list_core_api_resources("v1").await.unwrap();
        assert_eq!(core_res.resources.len(), 2);
        let agg = client.list_api_groups_aggregated().await.unwrap();
        assert_eq!(
            agg.items[0].versions[0].resources[0].resource.as_deref(),
            Some("endpointslices")
        );
        let agg_core = client.list_core_api_versions_aggregated().await.unwrap();
        assert_eq!(agg_core.items[0].versions[0].resources.len(), 2);
        let discovery = kube::discovery::Discovery::new(client.clone())
            .run()
            .await
            .unwrap();
        assert!(discovery.has_group("discovery.k8s.io"));

        // And the default namespace works for namespaced Apis.
        api.apply(&json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}}))
            .unwrap();
        let got = Api::<Service>::default_namespaced(client)
            .get("x")
            .await
            .unwrap();
        assert_eq!(got.namespace().as_deref(), Some("default"));
        assert!(got.uid().is_some() && got.creation_timestamp().is_some());
    })
    .await;
}

/// `set_delay` slows lists and watch starts; many objects and changes
/// stream in order without gaps or duplicates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delay_and_event_order() {
    bounded(async {
        let api = ApiServer::start();
        api.set_delay(Duration::from_millis(400));
        let t = Instant::now();
        let mut w = watch_services(&api, watcher::Config::default());
        assert_eq!(w.next(2).await, ["Init", "InitDone"]);
        assert!(t.elapsed() >= Duration::from_millis(400));
        // Changes during the (slow) watch start are replayed.
        let mut want = Vec::new();
        for i in 0..200 {
            let name = format!("s{}", i % 17);
            let v = if i % 5 == 4 {
                match api.delete(Kind::Service, "demo", &name) {
                    Some(v) => {
                        want.push(format!("Delete(demo/{name}@{})", rv_of(&v)));
                        continue;
                    }
                    None => api
                        .apply(&service("demo", &name, &[], 80 + i as u16))
                        .unwrap(),
                }
            } else {
                api.apply(&service("demo", &name, &[], 80 + i as u16))
                    .unwrap()
            };
            want.push(format!("Apply(demo/{name}@{})", rv_of(&v)));
        }
        assert_eq!(w.next(want.len()).await, want);
        converge(&w, &api, Kind::Service, all, Duration::from_secs(5)).await;
        api.set_delay(Duration::ZERO);
    })
    .await;
}

/// One raw HTTP/1.1 GET; the response head and (de-chunked) body, read until
/// the server ends it or `within` passes.
fn raw_get(api: &ApiServer, path_and_query: &str, within: Duration) -> (String, String, bool) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(api.addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    write!(
        s,
        "GET {path_and_query} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let deadline = Instant::now() + within;
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    let ended = loop {
        match s.read(&mut buf) {
            Ok(0) => break true,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => panic!("{e}"),
        }
        if Instant::now() > deadline {
            break false;
        }
    };
    let raw = String::from_utf8(raw).unwrap();
    let (head, mut rest) = raw.split_once("\r\n\r\n").unwrap();
    let mut body = String::new();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        while let Some((size, tail)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).unwrap();
            if n == 0 || tail.len() < n {
                break;
            }
            body.push_str(&tail[..n]);
            rest = tail[n..].trim_start_matches("\r\n");
        }
    } else {
        body.push_str(rest);
    }
    (head.to_string(), body, ended)
}

/// The wire format, checked without kube-rs: 410 inside a 200 stream,
/// bookmarks, the timeout, and the open-watch count after a client leaves.
#[test]
fn raw_watch_protocol() {
    let api = ApiServer::start();
    let first = api.apply(&service("demo", "a", &[], 80)).unwrap();
    let first_rv = rv_of(&first);
    api.apply(&service("demo", "a", &[], 81)).unwrap();
    api.set_bookmark_interval(Duration::from_millis(100));

    // Replay after a version, bookmarks, end after timeoutSeconds.
    let t = Instant::now();
    let (head, body, ended) = raw_get(
        &api,
        &format!("/api/v1/services?watch=1&resourceVersion={first_rv}&allowWatchBookmarks=true&timeoutSeconds=1"),
        Duration::from_secs(5),
    );
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        ended && t.elapsed() < Duration::from_secs(3),
        "{:?}",
        t.elapsed()
    );
    let lines: Vec<serde_json::Value> = body
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines[0]["type"], "MODIFIED");
    assert_eq!(lines[0]["object"]["kind"], "Service");
    assert_eq!(lines[0]["object"]["apiVersion"], "v1");
    let bookmark = lines
        .iter()
        .find(|l| l["type"] == "BOOKMARK")
        .expect("a bookmark");
    assert_eq!(
        bookmark["object"],
        json!({"kind": "Service", "apiVersion": "v1",
               "metadata": {"resourceVersion": api.resource_version().to_string(), "creationTimestamp": null}})
    );

    // Too old: 200, one ERROR event with a 410 Status, end.
    api.compact();
    let (head, body, ended) = raw_get(
        &api,
        &format!("/api/v1/services?watch=true&resourceVersion={first_rv}"),
        Duration::from_secs(5),
    );
    assert!(head.starts_with("HTTP/1.1 200") && ended, "{head}");
    let ev: serde_json::Value = serde_json::from_str(body.trim()).unwrap();
    assert_eq!(ev["type"], "ERROR");
    assert_eq!(ev["object"]["kind"], "Status");
    assert_eq!(ev["object"]["code"], 410);
    assert_eq!(ev["object"]["reason"], "Expired");

    // A client that goes away is noticed (at the next bookmark).
    let (_, _, ended) = raw_get(
        &api,
        "/api/v1/services?watch=true&allowWatchBookmarks=true",
        Duration::from_millis(300),
    );
    assert!(!ended);
    assert!(integration_tests::wait_until(
        Duration::from_secs(3),
        Duration::from_millis(20),
        || api.open_watches_total() == 0
    ));

    // Errors are Status objects.
    let (head, body, _) = raw_get(&api, "/api/v1/pods", Duration::from_secs(2));
    assert!(head.starts_with("HTTP/1.1 404"), "{head}");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&body).unwrap()["kind"],
        "Status"
    );
    let (head, _, _) = raw_get(
        &api,
        "/api/v1/services?resourceVersion=1&resourceVersionMatch=Exact",
        Duration::from_secs(2),
    );
    assert!(head.starts_with("HTTP/1.1 410"), "{head}");
}
