//! A list/watch Kubernetes API server fixture for the agent's cluster mode.
//!
//! No real kube-apiserver can be had here, so [`ApiServer`] serves the three
//! resources the agent follows — `v1 Service`, `discovery.k8s.io/v1
//! EndpointSlice`, `v1 Node` — and, once asked to
//! ([`ApiServer::serve_service_cidrs`]), `networking.k8s.io/v1 ServiceCIDR`
//! (without it a 404, as an API server before Kubernetes 1.33 answers),
//! over plain HTTP/1.1 on `127.0.0.1`, with
//! kube-apiserver's list/watch semantics as kube-rs' `watcher` relies on them:
//!
//! - one global resourceVersion counter; every object carries
//!   `metadata.resourceVersion`, `uid` and `creationTimestamp`;
//! - LIST with `limit`/`continue` (consistent snapshots: every page is served
//!   at the first page's resourceVersion, rebuilt from the event history; a
//!   token older than the compacted history answers `410 Expired`),
//!   `resourceVersion` + `resourceVersionMatch` (`NotOlderThan`, `Exact`),
//!   `labelSelector` (`k`, `!k`, `k=v`, `k==v`, `k!=v`, `k in (..)`,
//!   `k notin (..)`) and `fieldSelector` (`path=v`, `path!=v`);
//! - WATCH (`watch=true`): chunked newline-delimited JSON events, first the
//!   history after the requested resourceVersion, then live events; selectors
//!   applied like the apiserver's cacher (an object that stops matching is
//!   DELETED, one that starts matching is ADDED); `BOOKMARK`s every
//!   [`bookmark interval`](ApiServer::set_bookmark_interval) when
//!   `allowWatchBookmarks=true`; the stream ends after `timeoutSeconds`,
//!   capped (10 s by default) to exercise re-watches; a resourceVersion older
//!   than the compacted history gets a `410 Expired` ERROR event *inside* the
//!   200 stream (what kube-apiserver's cacher does, and what makes kube-rs
//!   relist); `sendInitialEvents=true` (streaming lists) is supported;
//! - discovery (`/api`, `/api/v1`, `/apis`, `/apis/discovery.k8s.io[/v1]`,
//!   legacy and aggregated v2), `/version`, `/healthz`, GET of one object.
//!
//! The server runs on a tokio runtime of its own, on a background thread: its
//! controls are plain synchronous methods, usable from std threads and from
//! async tests alike.
//!
//! ```no_run
//! use integration_tests::apiserver::{ApiServer, Kind};
//! use serde_json::json;
//! let api = ApiServer::start();
//! api.apply(&json!({
//!     "apiVersion": "v1", "kind": "Service",
//!     "metadata": {"name": "web", "namespace": "demo"},
//!     "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": 80}]},
//! })).unwrap();
//! api.write_kubeconfig("/tmp/kubeconfig").unwrap();
//! // ... start the agent with `--k8s-api-server {api.url()}`, then:
//! api.expire_watches();
//! assert!(integration_tests::wait_until(
//!     std::time::Duration::from_secs(5),
//!     std::time::Duration::from_millis(20),
//!     || api.stats(Kind::Service).lists >= 2,
//! ));
//! ```

mod http;
mod selector;
mod store;

use std::{
    collections::{HashMap, VecDeque},
    fmt,
    net::SocketAddr,
    path::Path,
    str::FromStr,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex, MutexGuard,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context as _, Result};
use hyper_util::rt::{TokioIo, TokioTimer};
use serde::Serialize;
use serde_json::Value;
use tokio::{net::TcpListener, sync::mpsc, task::AbortHandle};

pub use selector::{FieldSelector, LabelSelector};
use store::{Msg, Store};

/// The resources the fixture serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// `v1 Service`, namespaced, `/api/v1/services`.
    Service,
    /// `discovery.k8s.io/v1 EndpointSlice`, namespaced,
    /// `/apis/discovery.k8s.io/v1/endpointslices`.
    EndpointSlice,
    /// `v1 Node`, cluster-scoped, `/api/v1/nodes`.
    Node,
    /// `networking.k8s.io/v1 ServiceCIDR`, cluster-scoped,
    /// `/apis/networking.k8s.io/v1/servicecidrs`: served only after
    /// [`ApiServer::serve_service_cidrs`].
    ServiceCIDR,
}

impl Kind {
    /// The kinds served from the start.
    pub const ALL: [Kind; 3] = [Kind::Service, Kind::EndpointSlice, Kind::Node];
    /// Every kind the fixture knows, [`Kind::ServiceCIDR`] included.
    pub const EVERY: [Kind; 4] = [
        Kind::Service,
        Kind::EndpointSlice,
        Kind::Node,
        Kind::ServiceCIDR,
    ];

    fn index(self) -> usize {
        self as usize
    }

    /// `Service`, `EndpointSlice`, `Node`.
    pub fn kind(self) -> &'static str {
        match self {
            Kind::Service => "Service",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::Node => "Node",
            Kind::ServiceCIDR => "ServiceCIDR",
        }
    }

    /// `""` for the core group.
    pub fn group(self) -> &'static str {
        match self {
            Kind::EndpointSlice => "discovery.k8s.io",
            Kind::ServiceCIDR => "networking.k8s.io",
            _ => "",
        }
    }

    pub fn version(self) -> &'static str {
        "v1"
    }

    /// `v1` or `discovery.k8s.io/v1`.
    pub fn api_version(self) -> &'static str {
        match self {
            Kind::EndpointSlice => "discovery.k8s.io/v1",
            Kind::ServiceCIDR => "networking.k8s.io/v1",
            _ => "v1",
        }
    }

    /// The URL resource name: `services`, `endpointslices`, `nodes`.
    pub fn plural(self) -> &'static str {
        match self {
            Kind::Service => "services",
            Kind::EndpointSlice => "endpointslices",
            Kind::Node => "nodes",
            Kind::ServiceCIDR => "servicecidrs",
        }
    }

    pub fn singular(self) -> &'static str {
        match self {
            Kind::Service => "service",
            Kind::EndpointSlice => "endpointslice",
            Kind::Node => "node",
            Kind::ServiceCIDR => "servicecidr",
        }
    }

    pub fn short_names(self) -> &'static [&'static str] {
        match self {
            Kind::Service => &["svc"],
            Kind::EndpointSlice => &[],
            Kind::Node => &["no"],
            Kind::ServiceCIDR => &[],
        }
    }

    pub fn namespaced(self) -> bool {
        !matches!(self, Kind::Node | Kind::ServiceCIDR)
    }

    /// `ServiceList`, ...
    pub fn list_kind(self) -> String {
        format!("{}List", self.kind())
    }

    /// The cluster-wide collection path, e.g. `/api/v1/services`.
    pub fn path(self) -> String {
        match self.group() {
            "" => format!("/api/{}/{}", self.version(), self.plural()),
            g => format!("/apis/{g}/{}/{}", self.version(), self.plural()),
        }
    }

    /// The kind of an object given its `apiVersion` and `kind`.
    pub fn from_type(api_version: &str, kind: &str) -> Option<Kind> {
        Kind::EVERY
            .into_iter()
            .find(|k| k.api_version() == api_version && k.kind() == kind)
    }

    fn from_resource(group: &str, version: &str, plural: &str) -> Option<Kind> {
        Kind::EVERY
            .into_iter()
            .find(|k| k.group() == group && k.version() == version && k.plural() == plural)
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.kind())
    }
}

impl FromStr for Kind {
    type Err = anyhow::Error;

    /// `Service`/`services`/`svc`, `EndpointSlice`/`endpointslices`, `Node`/`nodes`.
    fn from_str(s: &str) -> Result<Self> {
        let l = s.to_ascii_lowercase();
        Kind::EVERY
            .into_iter()
            .find(|k| {
                l == k.kind().to_ascii_lowercase()
                    || l == k.plural()
                    || k.short_names().contains(&l.as_str())
            })
            .ok_or_else(|| anyhow!("unknown kind {s:?}"))
    }
}

/// Request counters of one kind. `lists` counts LIST requests (each page is
/// one), `watches` WATCH requests, `open_watches` the watch streams open now,
/// `expired` the `410 Expired` ERROR events sent (on resume from a compacted
/// version or by [`ApiServer::expire_watches`]), `gets` single-object GETs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KindStats {
    pub lists: u64,
    pub watches: u64,
    pub open_watches: u64,
    pub expired: u64,
    pub gets: u64,
}

#[derive(Default)]
struct Counters {
    lists: AtomicU64,
    watches: AtomicU64,
    open_watches: AtomicU64,
    expired: AtomicU64,
    gets: AtomicU64,
}

/// How the server is unavailable between [`ApiServer::go_away_with`] and
/// [`ApiServer::come_back`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outage {
    /// The listening socket is closed: connections are refused
    /// (`ECONNREFUSED`). The same port is bound again on `come_back`.
    Refuse,
    /// The socket keeps listening, but every accepted connection is reset
    /// at once (`ECONNRESET`), before any response.
    Reset,
}

struct Tunables {
    delay: Duration,
    watch_timeout_cap: Duration,
    bookmark_interval: Duration,
}

/// State shared by the controls and the server tasks.
struct Shared {
    store: Mutex<Store>,
    tunables: Mutex<Tunables>,
    counters: [Counters; 4],
    /// Whether `ServiceCIDR`s are served (else their paths answer 404).
    service_cidrs: std::sync::atomic::AtomicBool,
    requests: Mutex<VecDeque<String>>,
    conns: Mutex<HashMap<u64, AbortHandle>>,
    next_conn: AtomicU64,
    away: Mutex<Option<Outage>>,
    /// Wakes the bookmark ticker when its interval changes.
    bookmark_changed: tokio::sync::Notify,
    addr: SocketAddr,
}

const REQUEST_LOG: usize = 2000;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    fn counters(&self, kind: Kind) -> &Counters {
        &self.counters[kind.index()]
    }

    fn log_request(&self, line: String) {
        let mut r = lock(&self.requests);
        if r.len() >= REQUEST_LOG {
            r.pop_front();
        }
        r.push_back(line);
    }

    fn delay(&self) -> Duration {
        lock(&self.tunables).delay
    }
}

enum Cmd {
    /// Close the listening socket; ack when closed.
    Close(std::sync::mpsc::Sender<()>),
    /// Serve on this (re-bound) socket; ack when listening.
    Listen(std::net::TcpListener, std::sync::mpsc::Sender<()>),
    Shutdown,
}

/// The fixture. Dropping it stops the server (closing every connection).
pub struct ApiServer {
    shared: Arc<Shared>,
    cmd: mpsc::UnboundedSender<Cmd>,
    thread: Option<JoinHandle<()>>,
}

impl fmt::Debug for ApiServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ApiServer")
            .field("url", &self.url())
            .finish()
    }
}

impl ApiServer {
    /// Starts a server on `127.0.0.1:<free port>`; panics if it cannot.
    pub fn start() -> ApiServer {
        Self::try_start().expect("starting the API server fixture")
    }

    pub fn try_start() -> Result<ApiServer> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").context("binding 127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            store: Mutex::new(Store::new()),
            tunables: Mutex::new(Tunables {
                delay: Duration::ZERO,
                watch_timeout_cap: Duration::from_secs(10),
                bookmark_interval: Duration::from_secs(1),
            }),
            counters: Default::default(),
            service_cidrs: Default::default(),
            requests: Mutex::new(VecDeque::new()),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(0),
            away: Mutex::new(None),
            bookmark_changed: tokio::sync::Notify::new(),
            addr,
        });
        let (cmd, cmd_rx) = mpsc::unbounded_channel();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("apiserver-fixture")
            .enable_all()
            .build()
            .context("building the fixture's tokio runtime")?;
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name("apiserver-fixture".into())
            .spawn(move || {
                rt.block_on(serve(sh, listener, cmd_rx));
                rt.shutdown_timeout(Duration::from_secs(1));
            })
            .context("spawning the fixture thread")?;
        Ok(ApiServer {
            shared,
            cmd,
            thread: Some(thread),
        })
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> SocketAddr {
        self.shared.addr
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.shared.addr)
    }

    /// A kubeconfig for this server: no auth, namespace `default`.
    pub fn kubeconfig(&self) -> String {
        format!(
            "apiVersion: v1\n\
             kind: Config\n\
             clusters:\n\
             - name: lb-fixture\n  cluster:\n    server: {url}\n\
             contexts:\n\
             - name: lb-fixture\n  context:\n    cluster: lb-fixture\n    user: lb-fixture\n    namespace: default\n\
             current-context: lb-fixture\n\
             users:\n\
             - name: lb-fixture\n  user: {{}}\n\
             preferences: {{}}\n",
            url = self.url()
        )
    }

    /// Writes [`kubeconfig`](Self::kubeconfig) to `path`.
    pub fn write_kubeconfig(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.kubeconfig())
            .with_context(|| format!("writing {}", path.display()))
    }

    /// Creates or updates an object: anything serializable to a Service,
    /// EndpointSlice or Node with `apiVersion` and `kind` (a
    /// `serde_json::Value`, or a typed `k8s_openapi` object, which serializes
    /// them). Namespaced objects without a namespace go to `default`.
    /// Client-set `resourceVersion`/`uid`/`creationTimestamp` are ignored.
    /// An update that changes nothing is a no-op (no new resourceVersion, no
    /// event), as on a real server. Returns the stored object.
    pub fn apply<T: Serialize + ?Sized>(&self, obj: &T) -> Result<Value> {
        let v = serde_json::to_value(obj).context("serializing the object")?;
        lock(&self.shared.store).apply(v).map_err(|e| anyhow!(e))
    }

    /// [`apply`](Self::apply) for a typed object, returned typed.
    pub fn apply_typed<K>(&self, obj: &K) -> Result<K>
    where
        K: Serialize + serde::de::DeserializeOwned,
    {
        let v = self.apply(obj)?;
        serde_json::from_value(v).context("deserializing the stored object")
    }

    /// Deletes an object (`namespace` is ignored for Nodes; empty means
    /// `default`). Returns its last state, with the deletion's
    /// resourceVersion, or None if it did not exist.
    pub fn delete(&self, kind: Kind, namespace: &str, name: &str) -> Option<Value> {
        lock(&self.shared.store).delete(kind, namespace, name)
    }

    /// One stored object.
    pub fn get(&self, kind: Kind, namespace: &str, name: &str) -> Option<Value> {
        let ns = kind.namespaced().then_some(if namespace.is_empty() {
            "default"
        } else {
            namespace
        });
        lock(&self.shared.store)
            .kind(kind)
            .objects
            .get(&store::object_key(ns, name))
            .map(|o| (**o).clone())
    }

    /// Every stored object of `kind`, in key order.
    pub fn objects(&self, kind: Kind) -> Vec<Value> {
        lock(&self.shared.store)
            .kind(kind)
            .objects
            .values()
            .map(|o| (**o).clone())
            .collect()
    }

    /// `(namespace, name, resourceVersion)` of every object of `kind`, in
    /// key order (namespace empty for Nodes): handy to compare with a
    /// client's view.
    pub fn keys(&self, kind: Kind) -> Vec<(String, String, String)> {
        let s = |o: &Value, p: &str| {
            o.pointer(p)
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string()
        };
        self.objects(kind)
            .iter()
            .map(|o| {
                (
                    s(o, "/metadata/namespace"),
                    s(o, "/metadata/name"),
                    s(o, "/metadata/resourceVersion"),
                )
            })
            .collect()
    }

    /// The current (latest) resourceVersion.
    pub fn resource_version(&self) -> u64 {
        lock(&self.shared.store).rv
    }

    /// Drops the event history of every kind, like an etcd compaction: the
    /// resourceVersion is bumped and becomes the oldest one can watch or
    /// read from. Open watches keep streaming (and, with bookmarks, their
    /// clients learn a new enough version within a bookmark interval), but a
    /// watch resumed from any version handed out before — after
    /// [`drop_connections`](Self::drop_connections), a timeout, or
    /// [`go_away`](Self::go_away) — gets `410 Expired` and its client
    /// relists; continue tokens of unfinished paginated lists expire too.
    pub fn compact(&self) {
        lock(&self.shared.store).compact();
    }

    /// Keeps at most `n` events of history per kind (10000 by default); older
    /// ones are compacted away.
    pub fn set_history_limit(&self, n: usize) {
        lock(&self.shared.store).history_limit = n.max(1);
    }

    /// Sends a `410 Expired` ERROR event on every open watch now, then ends
    /// those streams: kube-rs watchers relist.
    pub fn expire_watches(&self) {
        let mut st = lock(&self.shared.store);
        st.broadcast(None, |_| Some(Msg::Expire));
    }

    /// Abruptly closes every open connection — watch streams included, which
    /// end mid-body, without an ERROR event or the final chunk — and waits
    /// (up to 2 s) until they are closed. Clients re-watch from their last
    /// resourceVersion.
    pub fn drop_connections(&self) {
        self.kill_connections();
    }

    fn kill_connections(&self) {
        let (ids, handles): (Vec<u64>, Vec<AbortHandle>) = lock(&self.shared.conns)
            .iter()
            .map(|(id, h)| (*id, h.clone()))
            .unzip();
        for h in handles {
            h.abort();
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            let conns = lock(&self.shared.conns);
            if ids.iter().all(|id| !conns.contains_key(id)) {
                return;
            }
            drop(conns);
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Serves `networking.k8s.io/v1 ServiceCIDR` from now on (or no
    /// more: 404, as before Kubernetes 1.33): list, watch and get, as the
    /// other kinds. Objects can be applied either way.
    pub fn serve_service_cidrs(&self, serve: bool) {
        self.shared.service_cidrs.store(serve, Ordering::SeqCst);
    }

    /// Delays every resource request (LIST, GET, and WATCH before its
    /// response starts) by `delay`; zero (the default) for none.
    pub fn set_delay(&self, delay: Duration) {
        lock(&self.shared.tunables).delay = delay;
    }

    /// Caps watches' `timeoutSeconds` (10 s by default; kube-rs asks 290 s).
    pub fn set_watch_timeout_cap(&self, cap: Duration) {
        lock(&self.shared.tunables).watch_timeout_cap = cap;
    }

    /// How often watches with `allowWatchBookmarks=true` get a BOOKMARK
    /// with the current resourceVersion (1 s by default).
    pub fn set_bookmark_interval(&self, every: Duration) {
        lock(&self.shared.tunables).bookmark_interval = every.max(Duration::from_millis(10));
        self.shared.bookmark_changed.notify_one();
    }

    /// Makes the server unavailable ([`Outage::Refuse`]): closes the
    /// listening socket and every connection. Until [`come_back`](Self::come_back),
    /// connecting fails with `ECONNREFUSED`.
    pub fn go_away(&self) {
        self.go_away_with(Outage::Refuse);
    }

    /// Makes the server unavailable in the given way; see [`Outage`].
    pub fn go_away_with(&self, outage: Outage) {
        {
            let mut away = lock(&self.shared.away);
            if away.is_some() {
                return;
            }
            *away = Some(outage);
        }
        if outage == Outage::Refuse {
            let (tx, rx) = std::sync::mpsc::channel();
            if self.cmd.send(Cmd::Close(tx)).is_ok() {
                let _ = rx.recv_timeout(Duration::from_secs(5));
            }
        }
        self.kill_connections();
    }

    /// Ends an outage: the server listens (again) on the same address.
    /// Panics if the port cannot be bound again within 10 s.
    pub fn come_back(&self) {
        let outage = lock(&self.shared.away).take();
        if outage != Some(Outage::Refuse) {
            return;
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        let listener = loop {
            // std sets SO_REUSEADDR on Unix listeners, so the TIME_WAIT
            // connections we closed do not keep the port busy.
            match std::net::TcpListener::bind(self.shared.addr) {
                Ok(l) => break l,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => panic!("re-binding {}: {e}", self.shared.addr),
            }
        };
        listener.set_nonblocking(true).expect("set_nonblocking");
        let (tx, rx) = std::sync::mpsc::channel();
        if self.cmd.send(Cmd::Listen(listener, tx)).is_ok() {
            let _ = rx.recv_timeout(Duration::from_secs(5));
        }
    }

    /// Whether the server is away.
    pub fn is_away(&self) -> bool {
        lock(&self.shared.away).is_some()
    }

    /// The request counters of `kind`.
    pub fn stats(&self, kind: Kind) -> KindStats {
        let c = self.shared.counters(kind);
        KindStats {
            lists: c.lists.load(Ordering::SeqCst),
            watches: c.watches.load(Ordering::SeqCst),
            open_watches: c.open_watches.load(Ordering::SeqCst),
            expired: c.expired.load(Ordering::SeqCst),
            gets: c.gets.load(Ordering::SeqCst),
        }
    }

    /// LIST requests of `kind` so far.
    pub fn list_count(&self, kind: Kind) -> u64 {
        self.stats(kind).lists
    }

    /// WATCH requests of `kind` so far.
    pub fn watch_count(&self, kind: Kind) -> u64 {
        self.stats(kind).watches
    }

    /// Watch streams of `kind` open now.
    pub fn open_watches(&self, kind: Kind) -> u64 {
        self.stats(kind).open_watches
    }

    /// Watch streams open now, all kinds.
    pub fn open_watches_total(&self) -> u64 {
        Kind::ALL.into_iter().map(|k| self.open_watches(k)).sum()
    }

    /// The last requests served (up to 2000), as `METHOD PATH?QUERY`.
    pub fn requests(&self) -> Vec<String> {
        lock(&self.shared.requests).iter().cloned().collect()
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        let _ = self.cmd.send(Cmd::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

// The fixture can be shared between threads (e.g. in an `Arc`).
const _: fn() = || {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<ApiServer>();
};

/// Removes a connection from the registry when its task ends or is aborted.
struct ConnGuard {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        lock(&self.shared.conns).remove(&self.id);
    }
}

/// Counts an open watch stream while alive.
struct OpenWatchGuard {
    shared: Arc<Shared>,
    kind: Kind,
}

impl OpenWatchGuard {
    fn new(shared: Arc<Shared>, kind: Kind) -> Self {
        shared
            .counters(kind)
            .open_watches
            .fetch_add(1, Ordering::SeqCst);
        Self { shared, kind }
    }
}

impl Drop for OpenWatchGuard {
    fn drop(&mut self) {
        self.shared
            .counters(self.kind)
            .open_watches
            .fetch_sub(1, Ordering::SeqCst);
    }
}

fn spawn_connection(shared: &Arc<Shared>, stream: tokio::net::TcpStream) {
    let _ = stream.set_nodelay(true);
    let id = shared.next_conn.fetch_add(1, Ordering::SeqCst);
    // Registered before the task can finish (its guard takes the same lock).
    let mut conns = lock(&shared.conns);
    let sh = shared.clone();
    let task = tokio::spawn(async move {
        let _guard = ConnGuard {
            shared: sh.clone(),
            id,
        };
        let svc = hyper::service::service_fn(move |req| http::handle(sh.clone(), req));
        let _ = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .serve_connection(TokioIo::new(stream), svc)
            .await;
    });
    conns.insert(id, task.abort_handle());
}

async fn bookmarks(shared: Arc<Shared>) {
    loop {
        let every = lock(&shared.tunables).bookmark_interval;
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = shared.bookmark_changed.notified() => continue,
        }
        let mut st = lock(&shared.store);
        let rv = st.rv;
        st.broadcast(None, |w| w.bookmarks.then_some(Msg::Bookmark(rv)));
    }
}

/// The accept loop, with its commands.
async fn serve(
    shared: Arc<Shared>,
    listener: std::net::TcpListener,
    mut cmds: mpsc::UnboundedReceiver<Cmd>,
) {
    let ticker = tokio::spawn(bookmarks(shared.clone()));
    let mut listener = match TcpListener::from_std(listener) {
        Ok(l) => Some(l),
        Err(e) => {
            eprintln!("apiserver fixture: cannot listen: {e}");
            None
        }
    };
    loop {
        let accept = async {
            match &listener {
                Some(l) => l.accept().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            res = accept => match res {
                Ok((stream, _)) => {
                    if *lock(&shared.away) == Some(Outage::Reset) {
                        // SO_LINGER 0: close with RST.
                        if let Ok(s) = stream.into_std() {
                            let _ = socket_linger_zero(&s);
                        }
                        continue;
                    }
                    spawn_connection(&shared, stream);
                }
                Err(e) => {
                    // EMFILE and the like: do not spin.
                    eprintln!("apiserver fixture: accept: {e}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            },
            cmd = cmds.recv() => match cmd {
                Some(Cmd::Close(ack)) => {
                    listener = None;
                    let _ = ack.send(());
                }
                Some(Cmd::Listen(l, ack)) => {
                    match TcpListener::from_std(l) {
                        Ok(l) => listener = Some(l),
                        Err(e) => eprintln!("apiserver fixture: cannot listen again: {e}"),
                    }
                    let _ = ack.send(());
                }
                Some(Cmd::Shutdown) | None => break,
            },
        }
    }
    ticker.abort();
    drop(listener);
    let conns: Vec<AbortHandle> = lock(&shared.conns).values().cloned().collect();
    for c in conns {
        c.abort();
    }
}

fn socket_linger_zero(s: &std::net::TcpStream) -> Result<()> {
    use std::os::fd::AsRawFd;
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: a valid socket and a properly sized option value.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            &linger as *const libc::linger as *const libc::c_void,
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        bail!("SO_LINGER: {}", std::io::Error::last_os_error());
    }
    Ok(())
}
