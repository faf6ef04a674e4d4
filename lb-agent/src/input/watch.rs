//! Cluster mode: kube-rs watchers feed the same `Store` that the manifests
//! mode fills, so both modes share one translation and one reconciler.
//!
//! Each watcher's relist (start, watch expiry, 410 Gone, reconnect) is
//! buffered from `Init` to `InitDone` and then replaces that kind's objects
//! whole, so objects deleted while the watch was broken disappear and the
//! next sync is a full reconcile. While the API server is away the store
//! keeps the last good state and the watchers retry with backoff.
use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
};

use crate::{
    base::metrics::Metrics,
    input::{
        store::{Changes, ObjectKey, Slice, Store, StoredService},
        wire::{WatchedService, WatchedSlice},
    },
};
use anyhow::Context as _;
use futures::{Stream, StreamExt as _};
use k8s_openapi::api::{core::v1::Node, networking::v1::ServiceCIDR};
use kube::{
    api::ObjectMeta,
    runtime::{watcher, WatchStreamExt as _},
    Api, Client, Resource,
};

/// The label selector of the Service and EndpointSlice watches, kube-proxy's
/// (`cmd/kube-proxy/app/server.go`): objects of another proxy
/// (`LABEL_SERVICE_PROXY_NAME`) and of headless Services (`LABEL_HEADLESS`)
/// are never listed. `translate` skips them as well, for the manifests mode.
pub const LABEL_SELECTOR: &str =
    "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";

/// How to reach the API server.
#[derive(Debug, Clone, Default)]
pub struct ApiAccess {
    pub kubeconfig: Option<std::path::PathBuf>,
    pub api_server: Option<String>,
}

/// Builds a client: an explicit server URL (kube-proxy-free clusters cannot
/// reach the `kubernetes` Service before we run), else a kubeconfig, else
/// in-cluster config or the default kubeconfig.
pub async fn client(access: &ApiAccess) -> anyhow::Result<Client> {
    let mut config = match &access.kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
                .await
                .with_context(|| format!("kubeconfig {}", path.display()))?
        }
        None if access.api_server.is_some() => {
            // Service account credentials still apply when present.
            match kube::Config::incluster() {
                Ok(c) => c,
                Err(_) => kube::Config::new("http://127.0.0.1".parse()?),
            }
        }
        None => kube::Config::infer()
            .await
            .context("no --kubeconfig or --k8s-api-server, and no in-cluster config")?,
    };
    if let Some(url) = &access.api_server {
        config.cluster_url = url
            .parse()
            .with_context(|| format!("--k8s-api-server {url:?} is not a URL"))?;
    }
    Client::try_from(config).context("building the Kubernetes client")
}

/// The store as the watchers keep it, and whether each kind has been listed.
#[derive(Debug, Default)]
pub struct ClusterState {
    pub store: Store,
    /// This node, keyed like the other kinds; copied into `store.nodes`.
    node_objects: BTreeMap<ObjectKey, Node>,
    /// The `ServiceCIDR`s' `spec.cidrs`, keyed like the other kinds;
    /// copied into `store.service_cidrs`.
    service_cidr_objects: BTreeMap<ObjectKey, Vec<String>>,
    /// Listed, or the API has none (404). Not waited for: an API without
    /// them, or an agent without the RBAC for them, must still serve.
    pub service_cidrs_listed: bool,
    pub services_listed: bool,
    pub slices_listed: bool,
    pub node_listed: bool,
    /// The objects watch events changed since the last `take_changes`;
    /// `None` after a relist, which may have changed anything.
    changes: Option<Changes>,
}

impl ClusterState {
    pub fn all_listed(&self) -> bool {
        self.services_listed && self.slices_listed && self.node_listed
    }

    /// What changed since the last call (`None`: not known, translate
    /// everything), and starts recording afresh.
    pub fn take_changes(&mut self) -> Option<Changes> {
        self.changes.replace(Changes::default())
    }
}

pub type SharedState = Arc<Mutex<ClusterState>>;

/// Called after each change is applied to the store (a watch event, or a
/// relist once complete): wakes the syncer, and marks an update pending.
pub type OnChange = Arc<dyn Fn() + Send + Sync>;

fn object_key(meta: &ObjectMeta) -> ObjectKey {
    ObjectKey::new(
        meta.namespace.clone().unwrap_or_else(|| "default".into()),
        meta.name.clone().unwrap_or_default(),
    )
}

/// Where each kind lives in the store, so one event loop serves all three.
trait Stored: Resource<DynamicType = ()> + Clone + Send + Sync + 'static {
    const KIND: &'static str;
    /// The form the store keeps this kind in.
    type Kept: Send;
    fn keep(self) -> Self::Kept;
    fn objects(state: &mut ClusterState) -> &mut BTreeMap<ObjectKey, Self::Kept>;
    fn listed(state: &mut ClusterState) -> &mut bool;
    /// Where a change to object `key` of this kind is recorded.
    fn note(changes: &mut Changes, key: &ObjectKey);
}

/// `impl Stored` for one kind: where it lives in the store and how a change
/// to it is recorded.
macro_rules! stored {
    ($kind:ty, kept: $kept:ty = $keep:expr, objects: $($objects:ident).+, listed: $listed:ident,
     note: $note:expr) => {
        impl Stored for $kind {
            const KIND: &'static str = <$kind as k8s_openapi::Resource>::KIND;
            type Kept = $kept;
            fn keep(self) -> $kept {
                $keep(self)
            }
            fn objects(state: &mut ClusterState) -> &mut BTreeMap<ObjectKey, $kept> {
                &mut state.$($objects).+
            }
            fn listed(state: &mut ClusterState) -> &mut bool {
                &mut state.$listed
            }
            fn note(changes: &mut Changes, key: &ObjectKey) {
                let note: fn(&mut Changes, &ObjectKey) = $note;
                note(changes, key)
            }
        }
    };
}

// Decoded straight into the stored form, like the slices.
stored!(WatchedService, kept: Box<StoredService> = |s: WatchedService| Box::new(s.service), objects: store.services,
    listed: services_listed, note: |c, k| { c.services.insert(k.clone()); });
// Decoded straight into the compact form, like the manifests: both modes
// share one store.
stored!(WatchedSlice, kept: Slice = |w: WatchedSlice| w.slice, objects: store.slices,
    listed: slices_listed, note: |c, k| { c.slices.insert(k.clone()); });
// Nodes are keyed by name alone in the store; this wrapper map keeps the
// loop generic and `Store::nodes` is refreshed from it.
stored!(Node, kept: Node = std::convert::identity, objects: node_objects,
    listed: node_listed, note: |c, k| { c.nodes.insert(k.name.to_string()); });
// Only their `spec.cidrs`; translation does not read them (each sync
// reads the union afresh), so a change notes nothing.
stored!(ServiceCIDR, kept: Vec<String> = |s: ServiceCIDR| s.spec.and_then(|s| s.cidrs).unwrap_or_default(),
    objects: service_cidr_objects, listed: service_cidrs_listed, note: |_, _| {});

fn after_change<K: Stored>(state: &mut ClusterState) {
    if K::KIND == "Node" {
        state.store.nodes = state
            .node_objects
            .iter()
            .map(|(k, n)| (k.name.to_string(), n.clone()))
            .collect();
    }
    if K::KIND == "ServiceCIDR" {
        state.store.service_cidrs = state
            .service_cidr_objects
            .iter()
            .map(|(k, c)| (k.name.to_string(), c.clone()))
            .collect();
    }
}

/// Whether a watch failed because the API does not serve the resource
/// (its list answered 404).
fn not_served(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s)) => s.code == 404,
        _ => false,
    }
}

/// The API has no objects of kind `K` (`not_served`): none are kept, and
/// the syncer is woken if that changed what it had.
fn absent<K: Stored>(state: &SharedState, on_change: &OnChange) {
    let mut st = state.lock().expect("cluster state lock");
    let had = !K::objects(&mut st).is_empty();
    K::objects(&mut st).clear();
    *K::listed(&mut st) = true;
    after_change::<K>(&mut st);
    drop(st);
    if had {
        on_change();
    }
}

/// Applies one watcher event; `buffer` holds a relist in progress.
fn apply_event<K: Stored>(
    state: &SharedState,
    buffer: &mut Option<BTreeMap<ObjectKey, K::Kept>>,
    event: watcher::Event<K>,
    metrics: &Metrics,
) {
    let mut state = state.lock().expect("cluster state lock");
    match event {
        watcher::Event::Init => {
            if *K::listed(&mut state) {
                metrics
                    .watch_restarts
                    .get_or_create(&kind_label(K::KIND))
                    .inc();
            }
            *buffer = Some(BTreeMap::new());
        }
        watcher::Event::InitApply(obj) => {
            if let Some(b) = buffer.as_mut() {
                b.insert(object_key(obj.meta()), obj.keep());
            }
        }
        watcher::Event::InitDone => {
            if let Some(b) = buffer.take() {
                *K::objects(&mut state) = b;
            }
            *K::listed(&mut state) = true;
            // Replaced whole: the next sync translates everything.
            state.changes = None;
        }
        watcher::Event::Apply(obj) => {
            let key = object_key(obj.meta());
            if let Some(changes) = state.changes.as_mut() {
                K::note(changes, &key);
            }
            K::objects(&mut state).insert(key, obj.keep());
        }
        watcher::Event::Delete(obj) => {
            let key = object_key(obj.meta());
            if let Some(changes) = state.changes.as_mut() {
                K::note(changes, &key);
            }
            K::objects(&mut state).remove(&key);
        }
    }
    after_change::<K>(&mut state);
}

fn kind_label(kind: &'static str) -> crate::base::metrics::KindLabel {
    crate::base::metrics::KindLabel {
        kind: kind.to_owned(),
    }
}

/// Follows one kind's watch, applying its events to the store. With
/// `optional`, an API that does not serve the kind (`not_served`) ends it:
/// the kind is then empty, and the caller decides when to ask again.
async fn follow<K, S>(
    stream: S,
    state: SharedState,
    on_change: OnChange,
    metrics: Metrics,
    optional: bool,
) where
    K: Stored + std::fmt::Debug + serde::de::DeserializeOwned,
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>>,
{
    let mut buffer: Option<BTreeMap<ObjectKey, K::Kept>> = None;
    let mut listing_since = None;
    let mut stream = std::pin::pin!(stream);
    while let Some(item) = stream.next().await {
        match item {
            Ok(event) => {
                let batch_done =
                    !matches!(event, watcher::Event::Init | watcher::Event::InitApply(_));
                match event {
                    watcher::Event::Init => listing_since = Some(std::time::Instant::now()),
                    watcher::Event::InitDone => {
                        if let (Some(since), Some(b)) = (listing_since.take(), &buffer) {
                            // How long a (paginated) list of this kind takes
                            // is what an operator needs to size a cluster's
                            // start-up and relists.
                            tracing::info!(
                                kind = K::KIND,
                                objects = b.len(),
                                list_ms = since.elapsed().as_secs_f64() * 1e3,
                                "listed"
                            );
                        }
                    }
                    _ => {}
                }
                apply_event(&state, &mut buffer, event, &metrics);
                // A relist wakes the syncer once, when it is complete.
                if batch_done {
                    on_change();
                }
            }
            Err(e) if optional && not_served(&e) => {
                absent::<K>(&state, &on_change);
                return;
            }
            Err(e) => {
                metrics
                    .watch_errors
                    .get_or_create(&kind_label(K::KIND))
                    .inc();
                tracing::warn!(kind = K::KIND, error = %e, "watch failed; retrying with backoff, keeping the last good state");
            }
        }
    }
}

/// Creates the per-kind watch counters at zero: a family without samples
/// is left out of `/metrics` altogether, so without this the restarts and
/// errors of the watches would only appear after the first one.
fn init_watch_metrics(metrics: &Metrics) {
    for kind in [
        WatchedService::KIND,
        WatchedSlice::KIND,
        Node::KIND,
        ServiceCIDR::KIND,
    ] {
        let _ = metrics.watch_restarts.get_or_create(&kind_label(kind));
        let _ = metrics.watch_errors.get_or_create(&kind_label(kind));
    }
}

/// The watcher configuration of the Node watch, and that of the Service and
/// EndpointSlice watches (with [`LABEL_SELECTOR`]).
fn configs() -> (watcher::Config, watcher::Config) {
    let cfg = watcher::Config::default().any_semantic();
    let labelled = cfg.clone().labels(LABEL_SELECTOR);
    (cfg, labelled)
}

/// How long the agent waits before it asks again an API that served no
/// `ServiceCIDR`s: an upgrade of the API server may bring them.
const SERVICE_CIDR_RECHECK: std::time::Duration = std::time::Duration::from_secs(300);

/// Follows the `ServiceCIDR`s (`networking.k8s.io/v1`, Kubernetes 1.33),
/// the guarded Service CIDRs with `--service-cluster-ip-range`. An API
/// without them (404) is no error: said once at info, asked again every
/// [`SERVICE_CIDR_RECHECK`], never in a loop.
async fn follow_service_cidrs(
    api: Api<ServiceCIDR>,
    cfg: watcher::Config,
    state: SharedState,
    on_change: OnChange,
    metrics: Metrics,
) {
    let mut told = false;
    loop {
        let stream = watcher(api.clone(), cfg.clone()).default_backoff();
        follow(
            stream,
            state.clone(),
            on_change.clone(),
            metrics.clone(),
            true,
        )
        .await;
        if !told {
            told = true;
            tracing::info!(
                "the API server serves no networking.k8s.io/v1 ServiceCIDR (404): the guarded \
                 Service CIDRs are --service-cluster-ip-range's alone; asking again every {}s",
                SERVICE_CIDR_RECHECK.as_secs()
            );
        }
        tokio::time::sleep(SERVICE_CIDR_RECHECK).await;
    }
}

/// Starts the watchers: Services, EndpointSlices, this Node, and the
/// `ServiceCIDR`s. Each change calls `on_change`.
pub fn start(
    client: Client,
    node_name: &str,
    state: SharedState,
    on_change: OnChange,
    metrics: Metrics,
) {
    init_watch_metrics(&metrics);
    let services: Api<WatchedService> = Api::all(client.clone());
    let slices: Api<WatchedSlice> = Api::all(client.clone());
    let nodes: Api<Node> = Api::all(client.clone());
    let service_cidrs: Api<ServiceCIDR> = Api::all(client);
    let (cfg, labelled) = configs();
    tokio::spawn(follow(
        watcher(services, labelled.clone()).default_backoff(),
        state.clone(),
        on_change.clone(),
        metrics.clone(),
        false,
    ));
    tokio::spawn(follow(
        watcher(slices, labelled).default_backoff(),
        state.clone(),
        on_change.clone(),
        metrics.clone(),
        false,
    ));
    tokio::spawn(follow_service_cidrs(
        service_cidrs,
        cfg.clone(),
        state.clone(),
        on_change.clone(),
        metrics.clone(),
    ));
    tokio::spawn(follow(
        watcher(nodes, cfg.fields(&format!("metadata.name={node_name}"))).default_backoff(),
        state,
        on_change,
        metrics,
        false,
    ));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The metadata of object `ns/name`.
    fn meta(name: &str) -> ObjectMeta {
        ObjectMeta {
            name: Some(name.into()),
            namespace: Some("ns".into()),
            ..Default::default()
        }
    }

    fn service(name: &str) -> WatchedService {
        WatchedService {
            metadata: meta(name),
            ..Default::default()
        }
    }

    fn slice(name: &str) -> WatchedSlice {
        WatchedSlice {
            metadata: meta(name),
            ..Default::default()
        }
    }

    /// Watch events name what changed; a relist makes it unknown.
    #[test]
    fn events_record_what_changed() {
        let state: SharedState = Default::default();
        let metrics = Metrics::new();
        let (mut services, mut slices) = (None, None);
        let keys = |set: &std::collections::BTreeSet<ObjectKey>| -> Vec<String> {
            set.iter().map(ToString::to_string).collect()
        };
        // Nothing taken yet: unknown, so the first sync is full anyway.
        assert_eq!(state.lock().unwrap().take_changes(), None);
        apply_event(
            &state,
            &mut services,
            watcher::Event::Apply(service("a")),
            &metrics,
        );
        apply_event(
            &state,
            &mut slices,
            watcher::Event::Apply(slice("a-1")),
            &metrics,
        );
        apply_event(
            &state,
            &mut services,
            watcher::Event::Delete(service("b")),
            &metrics,
        );
        let changes = state.lock().unwrap().take_changes().unwrap();
        assert_eq!(keys(&changes.services), ["ns/a", "ns/b"]);
        assert_eq!(keys(&changes.slices), ["ns/a-1"]);
        assert_eq!(
            state.lock().unwrap().take_changes(),
            Some(Changes::default())
        );
        for event in [
            watcher::Event::Init,
            watcher::Event::InitApply(service("c")),
            watcher::Event::InitDone,
        ] {
            apply_event(&state, &mut services, event, &metrics);
        }
        apply_event(
            &state,
            &mut services,
            watcher::Event::Apply(service("d")),
            &metrics,
        );
        assert_eq!(state.lock().unwrap().take_changes(), None);
        let stored: Vec<String> = keys(
            &state
                .lock()
                .unwrap()
                .store
                .services
                .keys()
                .cloned()
                .collect(),
        );
        assert_eq!(stored, ["ns/c", "ns/d"]);
    }

    /// kube-proxy's selector, built from the labels `translate` skips; the
    /// Node watch is not filtered by it.
    #[test]
    fn services_and_slices_are_watched_with_kube_proxys_label_selector() {
        use crate::input::store::{LABEL_HEADLESS, LABEL_SERVICE_PROXY_NAME};
        assert_eq!(
            LABEL_SELECTOR,
            format!("!{LABEL_SERVICE_PROXY_NAME},!{LABEL_HEADLESS}")
        );
        let (nodes, labelled) = configs();
        assert_eq!(labelled.label_selector.as_deref(), Some(LABEL_SELECTOR));
        assert_eq!(nodes.label_selector, None);
        assert_eq!(
            labelled.clone().labels(""),
            nodes.clone().labels(""),
            "nothing else differs"
        );
    }

    #[test]
    fn watch_metrics_are_exposed_before_the_first_restart() {
        let metrics = Metrics::new();
        init_watch_metrics(&metrics);
        let text = metrics.encode();
        for kind in ["Service", "EndpointSlice", "Node"] {
            for family in ["lb_watch_restarts_total", "lb_watch_errors_total"] {
                let sample = format!("{family}{{kind=\"{kind}\"}} 0");
                assert!(text.contains(&sample), "no {sample} in\n{text}");
            }
        }
    }
}
