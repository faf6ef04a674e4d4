//! Kubernetes semantics: turns the objects of a [`Store`] into the
//! [`DesiredState`] of the datapath. Pure and deterministic, so that every
//! rule can be tested with a table of objects.
//!
//! The rules follow kube-proxy (`pkg/proxy/serviceport.go`,
//! `endpointslicecache.go`, `topology.go`): which addresses a Service is
//! reachable on, which endpoints back each of them (readiness, KEP-1669
//! terminating fallback, traffic policies, topology hints), and the
//! per-family split of dual-stack Services.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Arc,
};

use k8s_openapi::api::core::v1::Endpoints;

use crate::{
    input::store::{
        Changes, IpField, NodeInfo, ObjectKey, Rejection, Slice, Store, StoredService, StoredSpec,
    },
    semantics::model::{
        Algorithm, BackendAddr, BackendRef, Cidr, DesiredState, Frontend, FrontendKind,
        FrontendState, NotServed, OutlierMode, Protocol, Scope, Selection, ServiceName,
    },
};

// `ANNOTATION_ALGORITHM`: a Service's selection algorithm, one of
// `lb_common::algorithm::NAMES`. `ANNOTATION_OUTLIER_DETECTION`: a
// Service's outlier detection, `off`, `dry-run` or `on`.
pub use crate::input::store::{
    ANNOTATION_ALGORITHM, ANNOTATION_OUTLIER_DETECTION, LABEL_HEADLESS, LABEL_SERVICE_PROXY_NAME,
};
/// The API server's default `sessionAffinityConfig.clientIP.timeoutSeconds`.
pub const DEFAULT_AFFINITY_TIMEOUT: u32 = 10800;
/// The largest timeout the API server accepts.
pub const MAX_AFFINITY_TIMEOUT: u32 = 86400;

/// Stores with fewer Services are translated on one thread.
const PARALLEL_SERVICES: usize = 256;

/// `Rejection::source` of everything found here; the caller may relabel.
const SOURCE: &str = "translate";

/// Settings of the translation that do not come from Kubernetes objects.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TranslateOptions {
    /// Used unless a Service's `lb-agent.dev/lb-algorithm` says otherwise.
    pub default_algorithm: Algorithm,
    /// `--outlier-detection`: the most a Service's
    /// `lb-agent.dev/outlier-detection` may ask for, and what it gets
    /// without the annotation.
    pub default_outlier: OutlierMode,
    /// The node's own addresses, on which NodePorts are served; may be empty.
    pub node_addresses: Vec<IpAddr>,
    /// `--allowed-external-ip-cidrs` (CVE-2020-8554): when not empty,
    /// externalIPs outside these prefixes are refused, both scopes, and
    /// claim nothing (kube-proxy filters them out of the Service before it
    /// writes a rule).
    pub allowed_external_ips: Vec<Cidr>,
    /// `--external-clusterip`: ClusterIPs are `External` frontends too, for
    /// clients outside the node (a routed Service CIDR).
    pub external_cluster_ip: bool,
}

/// Translates every Service of `store` as seen from `node`.
///
/// Problems never abort: the offending Service port, address or endpoint is
/// left out and reported as a [`Rejection`] naming the object and field.
pub fn translate(
    store: &Store,
    node: &NodeInfo,
    opts: &TranslateOptions,
) -> (DesiredState, Vec<Rejection>) {
    let mut translator = Translator::default();
    translator.full(store, node, opts);
    let rejections = translator.rejections();
    (translator.state, rejections)
}

/// What the translation of every Service reads.
struct Context<'a> {
    store: &'a Store,
    node: &'a NodeInfo,
    opts: &'a TranslateOptions,
    /// A full translation's previous states, which the reconciler still
    /// holds (what it has programmed): an unchanged frontend takes its
    /// previous state rather than a copy, so that a periodic resync does not
    /// hold every frontend twice (at 100 000 Services, ~40 MiB).
    previous: Option<&'a BTreeMap<Frontend, Arc<FrontendState>>>,
}

/// The translation of one Service on its own, before its frontends are
/// checked against those of other Services.
#[derive(Default)]
struct ServiceOut {
    /// `(frontend, state, field)` in the order the Service asks for them.
    claims: Vec<Claim>,
    vips: Vec<(IpAddr, Scope)>,
    /// Its SCTP frontends, in the order the Service asks for them.
    not_served: Vec<NotServed>,
    /// Problems of its EndpointSlices or Endpoints, reported before the
    /// Service's own.
    endpoint_rejections: Vec<Rejection>,
}

/// What is remembered of one translated Service.
#[derive(Debug, Default)]
struct Translated {
    /// Every frontend it claimed, won or not, in claim order.
    frontends: Vec<Frontend>,
    vips: Vec<(IpAddr, Scope)>,
    not_served: Vec<NotServed>,
    /// Its rejections, conflicts included, in the order a full
    /// translation reports them.
    rejections: Vec<Rejection>,
}

/// A Service's claim on a frontend: the frontend, its state, and the field
/// that asked for it.
type Claim = (Frontend, Arc<FrontendState>, String);

/// A translated Service's record, and its claims that won: those `losses`
/// (claim index to reason) does not reject, in claim order.
fn record_of(
    out: ServiceOut,
    mut report: Report,
    losses: Option<&BTreeMap<usize, String>>,
) -> (Translated, Vec<Claim>) {
    let ServiceOut {
        claims,
        vips,
        not_served,
        endpoint_rejections,
    } = out;
    let mut frontends = Vec::with_capacity(claims.len());
    let mut won = Vec::with_capacity(claims.len());
    for (j, (frontend, state, field)) in claims.into_iter().enumerate() {
        frontends.push(frontend);
        match losses.and_then(|l| l.get(&j)) {
            Some(reason) => report.reject(field, reason.clone()),
            None => won.push((frontend, state, field)),
        }
    }
    let mut rejections = endpoint_rejections;
    rejections.extend(report.rejections);
    let record = Translated {
        frontends,
        vips,
        not_served,
        rejections,
    };
    (record, won)
}

/// What an update changed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Update {
    /// Everything was translated again: every frontend may have changed.
    pub full: bool,
    /// Otherwise the frontends added, changed or removed.
    pub touched: BTreeSet<Frontend>,
}

/// The translation kept between syncs, so that a change to a few objects
/// re-translates only the Services they belong to.
///
/// A frontend claimed more than once goes to the claim of the lowest
/// [`Rank`]. An update is done in place only while no frontend it involves
/// is or becomes claimed twice; otherwise everything is translated again,
/// which settles conflicts exactly as before.
#[derive(Debug, Default)]
pub struct Translator {
    state: DesiredState,
    services: BTreeMap<ObjectKey, Translated>,
    /// Who serves each frontend of `state`, and from which field.
    owners: BTreeMap<Frontend, (ObjectKey, String)>,
    /// Frontends claimed more than once.
    contested: BTreeSet<Frontend>,
    /// How many claims each VIP has.
    vip_refs: BTreeMap<(IpAddr, Scope), u32>,
    /// `(Service, EndpointSlice)` pairs, and the Service of each slice.
    /// Flat: a set per Service would cost a tree node each.
    slices: BTreeSet<(ObjectKey, ObjectKey)>,
    slice_service: BTreeMap<ObjectKey, ObjectKey>,
    /// What the last translation was done with.
    inputs: Option<(NodeInfo, TranslateOptions)>,
    /// Moves whenever [`rejections`](Self::rejections) may have changed,
    /// so that the caller need not look at them otherwise.
    rejections_version: u64,
}

impl Translator {
    /// The translated state.
    pub fn state(&self) -> &DesiredState {
        &self.state
    }

    /// Every rejection, in Service key order.
    pub fn rejections(&self) -> Vec<Rejection> {
        self.rejections_iter().cloned().collect()
    }

    pub fn rejections_iter(&self) -> impl Iterator<Item = &Rejection> {
        self.services.values().flat_map(|t| t.rejections.iter())
    }

    /// Every frontend a Service asks for that no datapath serves (SCTP),
    /// in Service key order. They claim nothing: two Services may name
    /// the same one.
    pub fn not_served(&self) -> impl Iterator<Item = &NotServed> {
        self.services.values().flat_map(|t| t.not_served.iter())
    }

    /// See `rejections_version` in the struct.
    pub fn rejections_version(&self) -> u64 {
        self.rejections_version
    }

    /// Translates every Service of `store` again.
    pub fn full(&mut self, store: &Store, node: &NodeInfo, opts: &TranslateOptions) -> Update {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        self.full_on(store, node, opts, threads)
    }

    /// [`full`](Self::full) on up to `threads` threads.
    fn full_on(
        &mut self,
        store: &Store,
        node: &NodeInfo,
        opts: &TranslateOptions,
        threads: usize,
    ) -> Update {
        let previous = std::mem::take(&mut self.state.frontends);
        *self = Translator {
            inputs: Some((node.clone(), opts.clone())),
            rejections_version: self.rejections_version + 1,
            ..Default::default()
        };
        // Built at once (a sort and a bulk build), as `settle_all` does.
        let owned: Vec<(ObjectKey, ObjectKey)> = store
            .slices
            .iter()
            .filter_map(|(key, slice)| Some((key.clone(), service_of_slice(key, slice)?)))
            .collect();
        self.slices = owned
            .iter()
            .map(|(slice, service)| (service.clone(), slice.clone()))
            .collect();
        self.slice_service = owned.into_iter().collect();
        let ctx = Context {
            store,
            node,
            opts,
            previous: Some(&previous),
        };
        // Each Service translates on its own, so a large store is split
        // over the cores; the claims are settled afterwards, by `Rank`.
        let services: Vec<(&ObjectKey, &StoredService)> =
            store.services.iter().map(|(k, s)| (k, &**s)).collect();
        let chunk = services.len().div_ceil(threads).max(PARALLEL_SERVICES);
        let this = &*self;
        let translate = |part: &[(&ObjectKey, &StoredService)]| -> Vec<_> {
            part.iter()
                .map(|(key, svc)| this.translate_one(&ctx, key, svc))
                .collect()
        };
        let outs: Vec<Option<(ServiceOut, Report)>> = if services.len() <= chunk {
            translate(&services)
        } else {
            std::thread::scope(|scope| {
                let handles: Vec<_> = services
                    .chunks(chunk)
                    .map(|part| scope.spawn(move || translate(part)))
                    .collect();
                handles
                    .into_iter()
                    .flat_map(|h| h.join().expect("translation does not panic"))
                    .collect()
            })
        };
        let losses = self.elect(&services, &outs);
        self.settle_all(&services, outs, &losses);
        Update {
            full: true,
            touched: BTreeSet::new(),
        }
    }

    /// Finds the winning claim of every frontend claimed more than once
    /// (recorded as contested) and says why each other claim lost: by
    /// Service index (key order), claim index to the rejection's reason.
    fn elect(
        &mut self,
        services: &[(&ObjectKey, &StoredService)],
        outs: &[Option<(ServiceOut, Report)>],
    ) -> BTreeMap<usize, BTreeMap<usize, String>> {
        let claim =
            |rank: &Rank| &outs[rank.service].as_ref().expect("ranked").0.claims[rank.claim];
        // The best claim so far, and whether there were others.
        let mut best: BTreeMap<Frontend, (Rank, bool)> = BTreeMap::new();
        for (i, ((_, svc), out)) in services.iter().zip(outs).enumerate() {
            let Some((out, _)) = out else { continue };
            let created = svc.metadata.creation_timestamp.as_ref().map(|t| t.0);
            for (j, (frontend, state, _)) in out.claims.iter().enumerate() {
                let rank = Rank {
                    kind: precedence(state.kind),
                    created: (created.is_none(), created),
                    service: i,
                    claim: j,
                };
                best.entry(*frontend)
                    .and_modify(|(best, others)| {
                        *others = true;
                        *best = (*best).min(rank);
                    })
                    .or_insert((rank, false));
            }
        }
        let mut losses: BTreeMap<usize, BTreeMap<usize, String>> = BTreeMap::new();
        for (i, ((_, svc), out)) in services.iter().zip(outs).enumerate() {
            let Some((out, _)) = out else { continue };
            for (j, (frontend, state, _)) in out.claims.iter().enumerate() {
                let Some((winner, true)) = best.get(frontend) else {
                    continue;
                };
                if (i, j) == (winner.service, winner.claim) {
                    continue;
                }
                let (_, won, won_field) = claim(winner);
                let why = if i == winner.service {
                    format!("already claimed by its {won_field}")
                } else {
                    let created = svc.metadata.creation_timestamp.as_ref().map(|t| t.0);
                    format!(
                        "also claimed by Service {} ({won_field}), which keeps it: {}",
                        services[winner.service].0,
                        why_first(won.kind, winner.created.1, state.kind, created),
                    )
                };
                losses
                    .entry(i)
                    .or_default()
                    .insert(j, format!("frontend {frontend} is {why}; ignored"));
            }
        }
        self.contested.extend(
            best.into_iter()
                .filter(|(_, (_, others))| *others)
                .map(|(f, _)| f),
        );
        losses
    }

    /// Brings the translation up to date with `store` after `changes`,
    /// re-translating only the Services they touch when that is safe.
    pub fn update(
        &mut self,
        store: &Store,
        changes: &Changes,
        node: &NodeInfo,
        opts: &TranslateOptions,
    ) -> Update {
        // Nodes matter only through `node` and `opts`.
        if self.inputs.as_ref() != Some(&(node.clone(), opts.clone())) {
            return self.full(store, node, opts);
        }
        let mut dirty: BTreeSet<ObjectKey> = changes.services.clone();
        dirty.extend(changes.endpoints.iter().cloned());
        for key in &changes.slices {
            if let Some(old) = self.slice_service.remove(key) {
                self.slices.remove(&(old.clone(), key.clone()));
                dirty.insert(old);
            }
            let new = store
                .slices
                .get(key)
                .and_then(|slice| service_of_slice(key, slice));
            if let Some(new) = new {
                self.slices.insert((new.clone(), key.clone()));
                self.slice_service.insert(key.clone(), new.clone());
                dirty.insert(new);
            }
        }
        let ctx = Context {
            store,
            node,
            opts,
            previous: None,
        };
        let mut touched = BTreeSet::new();
        for key in dirty {
            let out = store
                .services
                .get(&key)
                .and_then(|svc| self.translate_one(&ctx, &key, svc));
            if !self.replace(&key, out, &mut touched) {
                return self.full(store, node, opts);
            }
        }
        Update {
            full: false,
            touched,
        }
    }

    /// Translates one Service; `None` when it is not ours to serve.
    fn translate_one(
        &self,
        ctx: &Context<'_>,
        key: &ObjectKey,
        svc: &StoredService,
    ) -> Option<(ServiceOut, Report)> {
        if !serves(svc) {
            return None;
        }
        // The empty key sorts first: the range starts at this Service.
        let slices: Vec<(&ObjectKey, &Slice)> = self
            .slices
            .range((key.clone(), ObjectKey::default())..)
            .take_while(|(service, _)| service == key)
            .filter_map(|(_, k)| ctx.store.slices.get_key_value(k))
            .collect();
        let slices = (!slices.is_empty()).then_some(slices);
        let mut report = Report::new("Service", key);
        let mut out = ServiceOut::default();
        translate_service(ctx, key, svc, slices.as_ref(), &mut report, &mut out);
        Some((out, report))
    }

    /// Records every Service's translation after an election (`losses`:
    /// the claims that lost, by Service index and claim index). The maps
    /// start empty here, so each is built at once from its entries (a sort
    /// and a bulk build instead of a search per insert); where one key comes
    /// twice, the later entry wins, as it would by inserting in order.
    fn settle_all(
        &mut self,
        services: &[(&ObjectKey, &StoredService)],
        outs: Vec<Option<(ServiceOut, Report)>>,
        losses: &BTreeMap<usize, BTreeMap<usize, String>>,
    ) {
        debug_assert!(self.services.is_empty() && self.owners.is_empty());
        debug_assert!(self.state.frontends.is_empty() && self.vip_refs.is_empty());
        let mut translated = Vec::with_capacity(services.len());
        let mut owners = Vec::with_capacity(services.len());
        let mut frontends = Vec::with_capacity(services.len());
        let mut all_vips = Vec::with_capacity(services.len());
        for (i, ((key, _), out)) in services.iter().zip(outs).enumerate() {
            let Some((out, report)) = out else {
                continue;
            };
            let (record, won) = record_of(out, report, losses.get(&i));
            for (frontend, state, field) in won {
                owners.push((frontend, ((*key).clone(), field)));
                frontends.push((frontend, state));
            }
            all_vips.extend_from_slice(&record.vips);
            translated.push(((*key).clone(), record));
        }
        self.services = translated.into_iter().collect();
        self.owners = owners.into_iter().collect();
        self.state.frontends = frontends.into_iter().collect();
        all_vips.sort_unstable();
        let refs: Vec<((IpAddr, Scope), u32)> = all_vips
            .chunk_by(|a, b| a == b)
            .map(|run| (run[0], run.len() as u32))
            .collect();
        self.state.vips = refs.iter().map(|(vip, _)| *vip).collect();
        self.vip_refs = refs.into_iter().collect();
    }

    /// Adds a translated Service: every claim but those `losses` rejects
    /// (claim index to reason) serves its frontend.
    fn settle(
        &mut self,
        key: &ObjectKey,
        out: ServiceOut,
        report: Report,
        losses: Option<&BTreeMap<usize, String>>,
    ) {
        let (record, won) = record_of(out, report, losses);
        for (frontend, state, field) in won {
            self.owners.insert(frontend, (key.clone(), field));
            self.state.frontends.insert(frontend, state);
        }
        for vip in &record.vips {
            *self.vip_refs.entry(*vip).or_default() += 1;
            self.state.vips.insert(*vip);
        }
        self.services.insert(key.clone(), record);
    }

    /// Replaces the translation of Service `key` by `out` (`None`: gone or
    /// not ours), recording the frontends that changed. `false` when a
    /// frontend involved is contested: only a full translation settles it.
    fn replace(
        &mut self,
        key: &ObjectKey,
        out: Option<(ServiceOut, Report)>,
        touched: &mut BTreeSet<Frontend>,
    ) -> bool {
        let old = self.services.get(key);
        if old.is_some_and(|t| t.frontends.iter().any(|f| self.contested.contains(f))) {
            return false;
        }
        if let Some((out, _)) = &out {
            let mut seen = BTreeSet::new();
            for (frontend, ..) in &out.claims {
                let taken = self
                    .owners
                    .get(frontend)
                    .is_some_and(|(owner, _)| owner != key);
                if taken || self.contested.contains(frontend) || !seen.insert(*frontend) {
                    return false;
                }
            }
        }
        let old = self.services.remove(key);
        let old_rejections = old.as_ref().map(|o| o.rejections.clone());
        if let Some(old) = old {
            for frontend in old.frontends {
                self.owners.remove(&frontend);
                self.state.frontends.remove(&frontend);
                touched.insert(frontend);
            }
            for vip in old.vips {
                if let Some(n) = self.vip_refs.get_mut(&vip) {
                    *n -= 1;
                    if *n == 0 {
                        self.vip_refs.remove(&vip);
                        self.state.vips.remove(&vip);
                    }
                }
            }
        }
        if let Some((out, report)) = out {
            touched.extend(out.claims.iter().map(|(f, ..)| *f));
            // Checked above: every frontend is this Service's alone.
            self.settle(key, out, report, None);
        }
        let new_rejections = self.services.get(key).map(|t| &t.rejections);
        let none = Vec::new();
        if old_rejections.as_ref().unwrap_or(&none) != new_rejections.unwrap_or(&none) {
            self.rejections_version += 1;
        }
        true
    }
}

/// Where a claim stands when several claim one frontend: the lowest wins.
///
/// kube-proxy looks up ClusterIPs, externalIPs and LoadBalancer IPs before
/// NodePorts: its iptables mode jumps to `KUBE-NODEPORTS` from the last
/// rule of `KUBE-SERVICES` ("NOTE: this must be the last rule in this
/// chain", `pkg/proxy/iptables/proxier.go`, `syncProxyRules`), its nftables
/// mode's `services` chain looks up `@service-ips` before
/// `@service-nodeports` (`pkg/proxy/nftables/proxier.go`, `setupNFTables`).
/// So a NodePort yields. Among the others kube-proxy has no order: both
/// modes write one rule or map element per Service port while ranging over
/// a Go map (`for svcName, svc := range proxier.svcPortMap`), the first
/// match (iptables) or the last write (nftables' `ensureElem` replaces the
/// element) wins, and that can change at every sync. Here the order is
/// fixed: ClusterIP (the API server allocates it, unique), then
/// LoadBalancer IP (its controller writes it to the status), then
/// externalIP (anyone who may write a Service's spec, CVE-2020-8554); then
/// the older Service (`creationTimestamp`: a new Service cannot take an
/// address from one that serves it); then namespace/name; within one
/// Service, its first claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Rank {
    kind: u8,
    /// No `creationTimestamp` (manifests) sorts after every time.
    created: (bool, Option<k8s_openapi::jiff::Timestamp>),
    /// Index of the Service in key order.
    service: usize,
    /// Index of the claim in its Service's claims.
    claim: usize,
}

/// The kind's place in [`Rank`].
fn precedence(kind: FrontendKind) -> u8 {
    match kind {
        FrontendKind::ClusterIp => 0,
        FrontendKind::LoadBalancer => 1,
        FrontendKind::ExternalIp => 2,
        FrontendKind::NodePort => 3,
    }
}

/// "a ClusterIP", "an externalIP", ...
fn a_kind(kind: FrontendKind) -> &'static str {
    match kind {
        FrontendKind::ClusterIp => "a ClusterIP",
        FrontendKind::LoadBalancer => "a LoadBalancer IP",
        FrontendKind::ExternalIp => "an externalIP",
        FrontendKind::NodePort => "a NodePort",
    }
}

/// Why the claim of another Service of kind `won`, created at
/// `won_created`, ranks before one of kind `lost` created at `lost_created`.
fn why_first(
    won: FrontendKind,
    won_created: Option<k8s_openapi::jiff::Timestamp>,
    lost: FrontendKind,
    lost_created: Option<k8s_openapi::jiff::Timestamp>,
) -> String {
    if lost == FrontendKind::NodePort && won != lost {
        format!("kube-proxy matches {} before a NodePort", a_kind(won))
    } else if won != lost {
        format!(
            "{} comes before {} (ClusterIP, LoadBalancer IP, externalIP)",
            a_kind(won),
            a_kind(lost)
        )
    } else if let (Some(t), true) = (won_created, won_created != lost_created) {
        match lost_created {
            Some(_) => format!("it is older (created {t})"),
            None => format!("it has a creationTimestamp ({t}), this Service none"),
        }
    } else {
        "it sorts first by namespace/name".to_owned()
    }
}

/// The Service an EndpointSlice belongs to (same namespace), by its label.
/// `None` for a slice carrying a label of another proxy or of a headless
/// Service: kube-proxy's watch never sees it.
fn service_of_slice(key: &ObjectKey, slice: &Slice) -> Option<ObjectKey> {
    if slice.proxy_labels {
        return None;
    }
    let service = slice.service.as_deref()?;
    (!service.is_empty()).then(|| ObjectKey::new(key.namespace.clone(), service))
}

/// Collects the rejections of one object.
struct Report {
    /// The object's kind and key, written out only for a rejection (most
    /// objects have none).
    kind: &'static str,
    key: ObjectKey,
    rejections: Vec<Rejection>,
}

impl Report {
    fn new(kind: &'static str, key: &ObjectKey) -> Self {
        Report {
            kind,
            key: key.clone(),
            rejections: Vec::new(),
        }
    }

    /// Reports once: the External and Internal copies of a frontend hit the
    /// same problems and the caller logs every rejection.
    fn reject(&mut self, field: impl Into<String>, reason: impl Into<String>) {
        let object = format!("{} {}", self.kind, self.key);
        let rejection = Rejection::new(SOURCE, object, field, reason);
        if !self.rejections.contains(&rejection) {
            self.rejections.push(rejection);
        }
    }

    /// `n` as a port number, or a rejection of `field` if it is outside
    /// 1..65535.
    fn port(&mut self, n: i32, field: std::fmt::Arguments) -> Option<u16> {
        let port = u16::try_from(n).ok().filter(|&p| p != 0);
        if port.is_none() {
            self.reject(field.to_string(), format!("{n} is outside 1..65535"));
        }
        port
    }
}

/// Whether this proxy serves `svc`. Like kube-proxy (whose watches select
/// `!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless`),
/// a Service labelled `service-proxy-name` (any value: another proxy's) or
/// `headless` is left alone, with its health-check node port.
pub fn serves(svc: &StoredService) -> bool {
    !svc.metadata.proxy_labels
}

// ---------------------------------------------------------------------------
// Services

/// The IP family of an address, a Service port, or an EndpointSlice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Family {
    V4,
    V6,
}

impl Family {
    fn of(addr: IpAddr) -> Self {
        if addr.is_ipv4() {
            Family::V4
        } else {
            Family::V6
        }
    }

    fn name(self) -> &'static str {
        match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        }
    }
}

/// Which endpoints a frontend may use (`externalTrafficPolicy`,
/// `internalTrafficPolicy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Policy {
    /// Every endpoint, subject to topology.
    Cluster,
    /// Only endpoints on this node, without topology.
    Local,
}

/// One usable entry of `spec.ports`.
struct ServicePortInfo {
    index: usize,
    name: String,
    protocol: Protocol,
    port: u16,
    node_port: Option<u16>,
}

/// Service-wide settings shared by all its frontends.
struct Settings {
    service: ServiceName,
    internal_policy: Policy,
    external_policy: Policy,
    affinity_timeout: Option<u32>,
    algorithm: Algorithm,
    outlier: OutlierMode,
}

/// An address of the Service together with the field it came from.
type Addr = (IpAddr, String);

fn translate_service(
    ctx: &Context<'_>,
    key: &ObjectKey,
    svc: &StoredService,
    slices: Option<&Vec<(&ObjectKey, &Slice)>>,
    report: &mut Report,
    out: &mut ServiceOut,
) {
    let (node, opts) = (ctx.node, ctx.opts);
    let Some(spec) = &svc.spec else {
        return report.reject("spec", "missing");
    };
    match spec.type_.as_deref().unwrap_or("ClusterIP") {
        // A DNS alias: nothing to load-balance.
        "ExternalName" => return,
        "ClusterIP" | "NodePort" | "LoadBalancer" => {}
        other => return report.reject("spec.type", format!("unknown Service type {other:?}")),
    }
    // Headless: DNS returns the endpoints themselves.
    if is_headless(spec) {
        return;
    }
    let cluster_ips = cluster_ips(spec, report);
    for (ip, _) in &cluster_ips {
        out.vips.push((*ip, Scope::Internal));
    }
    // A Service exists once per IP family of its cluster IPs (kube-proxy runs
    // one proxier per family): north-south addresses of another family have
    // no Service to reach.
    let families: BTreeSet<Family> = cluster_ips.iter().map(|(ip, _)| Family::of(*ip)).collect();
    if families.is_empty() {
        return;
    }

    let settings = Settings {
        service: ServiceName {
            namespace: key.namespace.clone(),
            name: key.name.clone(),
        },
        internal_policy: traffic_policy(
            spec.internal_traffic_policy.as_deref(),
            "spec.internalTrafficPolicy",
            report,
        ),
        external_policy: traffic_policy(
            spec.external_traffic_policy.as_deref(),
            "spec.externalTrafficPolicy",
            report,
        ),
        affinity_timeout: affinity_timeout(spec, report),
        algorithm: algorithm(svc, opts.default_algorithm, report),
        outlier: outlier(svc, opts.default_outlier, report),
    };
    let ports = service_ports(spec, report);
    let node_addresses: Vec<IpAddr> = opts
        .node_addresses
        .iter()
        .copied()
        .filter(|a| families.contains(&Family::of(*a)))
        .collect();
    let external_ips = external_ips(spec, &families, &opts.allowed_external_ips, report);
    let lb_ips = load_balancer_ips(svc, &families, report);
    // Which families `loadBalancerSourceRanges` restrict (malformed ranges
    // are reported by `northsouth::source_ranges`, which writes them).
    let ranged_families: BTreeSet<Family> = spec
        .load_balancer_source_ranges
        .iter()
        .flatten()
        .filter_map(|r| r.parse::<Cidr>().ok())
        .map(|c| Family::of(c.addr))
        .collect();
    // Only now: the endpoints of headless and broken Services do not matter.
    let groups = endpoint_groups(ctx.store, key, slices, &mut out.endpoint_rejections);

    for port in &ports {
        let candidates = candidates(&groups, port, node);
        let not_served_before = out.not_served.len();
        let mut emit = |addr: IpAddr, frontend_port: u16, kind, scope, policy, field: String| {
            let frontend = Frontend {
                addr,
                port: frontend_port,
                protocol: port.protocol,
                scope,
            };
            if port.protocol == Protocol::Sctp {
                out.not_served.push(NotServed {
                    frontend,
                    service: settings.service.clone(),
                    port_name: port.name.clone(),
                    kind,
                    field,
                });
                return;
            }
            let (active, terminating) = select(&candidates, Family::of(addr), policy, node);
            let serving = match port.protocol {
                Protocol::Udp => serving(&candidates, Family::of(addr)),
                Protocol::Tcp | Protocol::Sctp => Vec::new(),
            };
            // kube-proxy REJECTs when the Service has no endpoint at all,
            // and DROPs when only the traffic policy leaves none here.
            let reject =
                scope == Scope::External && active.is_empty() && terminating.is_empty() && {
                    let (a, t) = select(&candidates, Family::of(addr), Policy::Cluster, node);
                    a.is_empty() && t.is_empty()
                };
            let state = FrontendState {
                service: settings.service.clone(),
                port_name: port.name.clone(),
                kind,
                active,
                terminating,
                serving,
                affinity_timeout: settings.affinity_timeout,
                selection: match policy {
                    Policy::Cluster => Selection::Cluster,
                    Policy::Local => Selection::NodeLocal,
                },
                algorithm: settings.algorithm,
                reject,
                source_ranges: kind == FrontendKind::LoadBalancer
                    && ranged_families.contains(&Family::of(addr)),
                outlier: settings.outlier,
            };
            let state = match ctx.previous.and_then(|p| p.get(&frontend)) {
                Some(old) if **old == state => Arc::clone(old),
                _ => Arc::new(state),
            };
            out.claims.push((frontend, state, field));
        };

        // A ClusterIP follows internalTrafficPolicy whoever the client:
        // kube-proxy sends all ClusterIP traffic through the internal
        // policy chain and masquerades the sources from outside the cluster
        // ("you can establish a static route for your Service range,
        // routing to any node", `pkg/proxy/nftables/proxier.go`). The tc
        // path masquerades towards other nodes only, as for NodePorts.
        let cluster_scopes: &[Scope] = if opts.external_cluster_ip {
            &[Scope::Internal, Scope::External]
        } else {
            &[Scope::Internal]
        };
        for (ip, field) in &cluster_ips {
            for scope in cluster_scopes {
                emit(
                    *ip,
                    port.port,
                    FrontendKind::ClusterIp,
                    *scope,
                    settings.internal_policy,
                    field.clone(),
                );
            }
        }
        // North-south frontends exist twice: the External one (tc path)
        // follows externalTrafficPolicy; the Internal one serves pods that
        // reach the same address through the socket hooks, which kube-proxy
        // short-circuits to the cluster-wide endpoints.
        let mut north_south = |addr: IpAddr, frontend_port: u16, kind, field: String| {
            let policy = settings.external_policy;
            emit(
                addr,
                frontend_port,
                kind,
                Scope::External,
                policy,
                field.clone(),
            );
            emit(
                addr,
                frontend_port,
                kind,
                Scope::Internal,
                Policy::Cluster,
                field,
            );
        };
        if let Some(node_port) = port.node_port {
            let field = format!("spec.ports[{}].nodePort", port.index);
            for addr in &node_addresses {
                north_south(*addr, node_port, FrontendKind::NodePort, field.clone());
            }
        }
        for (ip, field) in &lb_ips {
            north_south(*ip, port.port, FrontendKind::LoadBalancer, field.clone());
        }
        for (ip, field) in &external_ips {
            north_south(*ip, port.port, FrontendKind::ExternalIp, field.clone());
        }
        if port.protocol == Protocol::Sctp {
            report_not_served(port, &out.not_served[not_served_before..], report);
        }
    }
}

/// One rejection per SCTP port, naming the frontends it leaves alone (each
/// once, whatever its scopes).
fn report_not_served(port: &ServicePortInfo, not_served: &[NotServed], report: &mut Report) {
    let mut named: Vec<String> = Vec::new();
    for n in not_served {
        let what = format!("{} {}", n.kind.name(), n.frontend);
        if !named.contains(&what) {
            named.push(what);
        }
    }
    if named.is_empty() {
        return;
    }
    report.reject(
        format!("spec.ports[{}].protocol", port.index),
        format!(
            "SCTP is not served (Linux runs no connect or sendmsg hook for SCTP sockets, \
             and the tc path does not rewrite SCTP): {} left alone",
            named.join(", ")
        ),
    );
}

fn is_headless(spec: &StoredSpec) -> bool {
    let none = |ip: Option<&IpField>| ip.and_then(IpField::text) == Some("None");
    none(spec.cluster_ip.as_ref()) || none(spec.cluster_ips.as_deref().and_then(<[_]>::first))
}

/// `spec.clusterIPs`, falling back to the older single `spec.clusterIP`.
fn cluster_ips(spec: &StoredSpec, report: &mut Report) -> Vec<Addr> {
    let listed: Vec<(&IpField, String)> = match spec.cluster_ips.as_deref() {
        Some(ips) if !ips.is_empty() => ips
            .iter()
            .enumerate()
            .map(|(i, ip)| (ip, format!("spec.clusterIPs[{i}]")))
            .collect(),
        _ => match &spec.cluster_ip {
            Some(ip) if ip.text() != Some("") => vec![(ip, "spec.clusterIP".to_owned())],
            _ => {
                report.reject("spec.clusterIP", "missing: the Service has no cluster IP");
                return Vec::new();
            }
        },
    };
    listed
        .into_iter()
        .filter_map(|(ip, field)| match ip.ip() {
            Ok(ip) => Some((ip, field)),
            // Which reports it.
            Err(raw) => parse_ip(raw, field, report),
        })
        .collect()
}

fn parse_ip(raw: &str, field: String, report: &mut Report) -> Option<Addr> {
    match raw.parse() {
        Ok(ip) => Some((ip, field)),
        Err(_) => {
            report.reject(field, format!("{raw:?} is not an IP address"));
            None
        }
    }
}

/// Keeps the addresses of a family the Service has a cluster IP of.
fn of_service_families(
    addrs: Vec<Addr>,
    families: &BTreeSet<Family>,
    report: &mut Report,
) -> Vec<Addr> {
    addrs
        .into_iter()
        .filter(|(ip, field)| {
            let family = Family::of(*ip);
            let ok = families.contains(&family);
            if !ok {
                report.reject(
                    field.clone(),
                    format!(
                        "{ip} ignored: the Service has no {} cluster IP",
                        family.name()
                    ),
                );
            }
            ok
        })
        .collect()
}

/// `spec.externalIPs` of the Service's families, without those outside
/// `allowed` (when given).
fn external_ips(
    spec: &StoredSpec,
    families: &BTreeSet<Family>,
    allowed: &[Cidr],
    report: &mut Report,
) -> Vec<Addr> {
    let parsed = spec
        .external_ips
        .iter()
        .flatten()
        .enumerate()
        .filter_map(|(i, raw)| parse_ip(raw, format!("spec.externalIPs[{i}]"), report))
        .collect();
    let mut ips = of_service_families(parsed, families, report);
    if !allowed.is_empty() {
        ips.retain(|(ip, field)| {
            let ok = allowed.iter().any(|c| c.contains(*ip));
            if !ok {
                report.reject(
                    field.clone(),
                    format!("externalIP {ip} refused: outside --allowed-external-ip-cidrs"),
                );
            }
            ok
        });
    }
    ips
}

/// `status.loadBalancer.ingress[].ip` of VIP-mode entries: a `Proxy`-mode
/// load balancer delivers to the nodes itself, kube-proxy leaves it alone.
fn load_balancer_ips(
    svc: &StoredService,
    families: &BTreeSet<Family>,
    report: &mut Report,
) -> Vec<Addr> {
    let parsed = svc
        .status
        .load_balancer_ingress
        .iter()
        .enumerate()
        .filter(|(_, ing)| ing.ip_mode.as_deref().is_none_or(|mode| mode == "VIP"))
        .filter_map(|(i, ing)| {
            let raw = ing.ip.as_deref().filter(|ip| !ip.is_empty())?;
            parse_ip(raw, format!("status.loadBalancer.ingress[{i}].ip"), report)
        })
        .collect();
    of_service_families(parsed, families, report)
}

/// The entries of `spec.ports` with a known protocol and a valid port
/// number (SCTP ones only to be reported: see [`NotServed`]).
fn service_ports(spec: &StoredSpec, report: &mut Report) -> Vec<ServicePortInfo> {
    let mut ports = Vec::new();
    for (index, p) in spec.ports.iter().flatten().enumerate() {
        let protocol = match p.protocol.as_deref() {
            None | Some("TCP") => Protocol::Tcp,
            Some("UDP") => Protocol::Udp,
            Some("SCTP") => Protocol::Sctp,
            Some(other) => {
                report.reject(
                    format!("spec.ports[{index}].protocol"),
                    format!("unknown protocol {other:?} (TCP, UDP or SCTP); port skipped"),
                );
                continue;
            }
        };
        let Some(port) = report.port(p.port, format_args!("spec.ports[{index}].port")) else {
            continue;
        };
        // The endpoints' ports are what is used, but an API server would
        // not have taken a Service with this number.
        if let Some(n) = p.target_port {
            if report
                .port(n, format_args!("spec.ports[{index}].targetPort"))
                .is_none()
            {
                continue;
            }
        }
        // 0 is what an unallocated nodePort looks like.
        let node_port = match p.node_port {
            None | Some(0) => None,
            Some(n) => report.port(n, format_args!("spec.ports[{index}].nodePort")),
        };
        ports.push(ServicePortInfo {
            index,
            name: p.name.as_deref().unwrap_or_default().to_owned(),
            protocol,
            port,
            node_port,
        });
    }
    ports
}

fn traffic_policy(value: Option<&str>, field: &str, report: &mut Report) -> Policy {
    match value {
        None | Some("Cluster") => Policy::Cluster,
        Some("Local") => Policy::Local,
        Some(other) => {
            report.reject(
                field,
                format!("unknown policy {other:?}, expected Cluster or Local; using Cluster"),
            );
            Policy::Cluster
        }
    }
}

/// `sessionAffinity: ClientIP` and its timeout, defaulted like the API server.
fn affinity_timeout(spec: &StoredSpec, report: &mut Report) -> Option<u32> {
    match spec.session_affinity.as_deref() {
        None | Some("None") => None,
        Some("ClientIP") => match spec.session_affinity_timeout {
            None => Some(DEFAULT_AFFINITY_TIMEOUT),
            Some(t) => match u32::try_from(t) {
                Ok(t) if (1..=MAX_AFFINITY_TIMEOUT).contains(&t) => Some(t),
                _ => {
                    report.reject(
                            "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
                            format!(
                                "{t} is outside 1..{MAX_AFFINITY_TIMEOUT}; using {DEFAULT_AFFINITY_TIMEOUT}"
                            ),
                        );
                    Some(DEFAULT_AFFINITY_TIMEOUT)
                }
            },
        },
        Some(other) => {
            report.reject(
                "spec.sessionAffinity",
                format!("unknown session affinity {other:?}, expected None or ClientIP; none used"),
            );
            None
        }
    }
}

fn algorithm(svc: &StoredService, default: Algorithm, report: &mut Report) -> Algorithm {
    match svc.metadata.algorithm.as_deref() {
        None => default,
        Some(name) => match Algorithm::from_name(name) {
            Some(a) => a,
            None => {
                report.reject(
                    format!("metadata.annotations[{ANNOTATION_ALGORITHM}]"),
                    format!(
                        "unknown algorithm {name:?}, expected one of {}; using the default, {}",
                        lb_common::algorithm::NAMES.join(", "),
                        default.name()
                    ),
                );
                default
            }
        },
    }
}

/// The outlier detection of `svc`'s frontends: the lesser of the node's
/// (`node`, `--outlier-detection`) and the Service's annotation, which can
/// turn detection down but never up past the node's.
fn outlier(svc: &StoredService, node: OutlierMode, report: &mut Report) -> OutlierMode {
    match svc.metadata.outlier_detection.as_deref() {
        None => node,
        Some(v) => match OutlierMode::from_name(v) {
            Some(m) => m.min(node),
            None => {
                report.reject(
                    format!("metadata.annotations[{ANNOTATION_OUTLIER_DETECTION}]"),
                    format!(
                        "unknown outlier detection mode {v:?}, expected one of {}; using the node's, {}",
                        OutlierMode::ALL.map(OutlierMode::name).join(", "),
                        node.name()
                    ),
                );
                node
            }
        },
    }
}

// ---------------------------------------------------------------------------
// Endpoints

/// Endpoints sharing one port list: an EndpointSlice, or one subset of a
/// v1 Endpoints object.
#[derive(Debug)]
struct EndpointGroup {
    ports: Vec<GroupPort>,
    endpoints: Vec<Endpoint>,
}

#[derive(Debug)]
struct GroupPort {
    name: String,
    protocol: Protocol,
    port: u16,
}

/// One endpoint address with what decides whether and where it is used.
#[derive(Debug, Clone)]
struct Endpoint {
    addr: IpAddr,
    node_name: Option<String>,
    ready: bool,
    serving: bool,
    terminating: bool,
    zone_hints: BTreeSet<String>,
    node_hints: BTreeSet<String>,
}

impl Endpoint {
    fn is_local(&self, node: &NodeInfo) -> bool {
        !node.name.is_empty() && self.node_name.as_deref() == Some(node.name.as_str())
    }

    /// KEP-1669: still serving while terminating, the fallback when nothing
    /// is ready. Disjoint from ready so that `active` and `terminating` are.
    fn is_serving_terminating(&self) -> bool {
        !self.ready && self.serving && self.terminating
    }

    /// kube-proxy's `IsServing` (the `serving` condition, terminating or
    /// not), and every ready endpoint: a backend the datapath selects is
    /// never one whose UDP sockets are destroyed.
    fn is_serving(&self) -> bool {
        self.serving || self.ready
    }

    /// How good a duplicate is: ready beats serving-terminating beats
    /// unusable.
    fn usability(&self) -> u8 {
        if self.ready {
            2
        } else if self.is_serving_terminating() {
            1
        } else {
            0
        }
    }
}

/// The endpoints of Service `key`: its EndpointSlices, or, for a Service
/// without any (a selectorless Service on a cluster without mirroring, or a
/// hand-written manifest), the v1 Endpoints of the same name.
fn endpoint_groups(
    store: &Store,
    key: &ObjectKey,
    slices: Option<&Vec<(&ObjectKey, &Slice)>>,
    rejections: &mut Vec<Rejection>,
) -> Vec<EndpointGroup> {
    match slices {
        Some(slices) => slices
            .iter()
            .filter_map(|(slice_key, slice)| {
                let mut report = Report::new("EndpointSlice", slice_key);
                let group = slice_group(slice, &mut report);
                rejections.extend(report.rejections);
                group
            })
            .collect(),
        None => match store.endpoints.get(key) {
            Some(endpoints) => {
                let mut report = Report::new("Endpoints", key);
                let groups = endpoints_groups(endpoints, &mut report);
                rejections.extend(report.rejections);
                groups
            }
            None => Vec::new(),
        },
    }
}

fn slice_group(slice: &Slice, report: &mut Report) -> Option<EndpointGroup> {
    let family = match &*slice.address_type {
        "IPv4" => Family::V4,
        "IPv6" => Family::V6,
        // Names, not addresses: nothing a datapath can send to.
        "FQDN" => return None,
        other => {
            report.reject(
                "addressType",
                format!("unknown address type {other:?}; slice ignored"),
            );
            return None;
        }
    };
    let mut ports = Vec::new();
    for (j, p) in slice.ports.iter().enumerate() {
        // SCTP (never programmed) and unknown protocols: the Service side
        // reports them.
        let Some(protocol) = endpoint_protocol(p.protocol.as_deref()) else {
            continue;
        };
        // A missing port means "all ports", which kube-proxy does not
        // implement either.
        let Some(number) = p.port else { continue };
        let Some(port) = report.port(number, format_args!("ports[{j}].port")) else {
            continue;
        };
        ports.push(GroupPort {
            // The API server defaults a missing name to "".
            name: p.name.as_deref().unwrap_or_default().to_owned(),
            protocol,
            port,
        });
    }

    let mut endpoints = Vec::new();
    for (i, ep) in slice.endpoints.iter().enumerate() {
        // Like kube-proxy, only the first address is used: the API allows
        // exactly one.
        let Some(address) = &ep.address else {
            report.reject(format!("endpoints[{i}].addresses"), "no address");
            continue;
        };
        let field = || format!("endpoints[{i}].addresses[0]");
        let addr = match address.ip() {
            Ok(addr) => addr,
            Err(raw) => {
                report.reject(field(), format!("{raw:?} is not an IP address"));
                continue;
            }
        };
        if Family::of(addr) != family {
            report.reject(
                field(),
                format!(
                    "{addr} is not an {} address as the slice's addressType says",
                    family.name()
                ),
            );
            continue;
        }
        let hints = ep.hints.as_deref();
        let names = |list: &[Box<str>]| list.iter().map(|n| n.to_string()).collect();
        endpoints.push(Endpoint {
            addr,
            node_name: ep.node_name.as_deref().map(str::to_owned),
            // Unknown readiness and serving count as true, unknown
            // terminating as false (the API's own defaults).
            ready: ep.ready.unwrap_or(true),
            serving: ep.serving.unwrap_or(true),
            terminating: ep.terminating.unwrap_or(false),
            zone_hints: hints.map(|h| names(&h.zones)).unwrap_or_default(),
            node_hints: hints.map(|h| names(&h.nodes)).unwrap_or_default(),
        });
    }
    Some(EndpointGroup { ports, endpoints })
}

fn endpoints_groups(endpoints: &Endpoints, report: &mut Report) -> Vec<EndpointGroup> {
    let mut groups = Vec::new();
    for (i, subset) in endpoints.subsets.iter().flatten().enumerate() {
        let mut ports = Vec::new();
        for (k, p) in subset.ports.iter().flatten().enumerate() {
            let Some(protocol) = endpoint_protocol(p.protocol.as_deref()) else {
                continue;
            };
            let Some(port) = report.port(p.port, format_args!("subsets[{i}].ports[{k}].port"))
            else {
                continue;
            };
            ports.push(GroupPort {
                name: p.name.as_deref().unwrap_or_default().to_owned(),
                protocol,
                port,
            });
        }
        let mut group_endpoints = Vec::new();
        let lists = [
            ("addresses", true, &subset.addresses),
            ("notReadyAddresses", false, &subset.not_ready_addresses),
        ];
        for (list, ready, addresses) in lists {
            for (j, a) in addresses.iter().flatten().enumerate() {
                let Ok(addr) = a.ip.parse::<IpAddr>() else {
                    report.reject(
                        format!("subsets[{i}].{list}[{j}].ip"),
                        format!("{:?} is not an IP address", a.ip),
                    );
                    continue;
                };
                // v1 Endpoints know nothing of terminating: not ready means
                // not used at all.
                group_endpoints.push(Endpoint {
                    addr,
                    node_name: a.node_name.clone(),
                    ready,
                    serving: ready,
                    terminating: false,
                    zone_hints: BTreeSet::new(),
                    node_hints: BTreeSet::new(),
                });
            }
        }
        groups.push(EndpointGroup {
            ports,
            endpoints: group_endpoints,
        });
    }
    groups
}

/// Protocol of an endpoint port, TCP by default; `None` for the ones we do
/// not balance.
fn endpoint_protocol(value: Option<&str>) -> Option<Protocol> {
    match value {
        None | Some("TCP") => Some(Protocol::Tcp),
        Some("UDP") => Some(Protocol::Udp),
        _ => None,
    }
}

/// The endpoints of one Service port, with their target port resolved.
///
/// Endpoint ports carry resolved numbers and the Service port's name, which
/// is how a named `targetPort` reaches us. Duplicates across slices collapse
/// to one entry: the most usable one, and a local one on a tie (kube-proxy
/// also favours the local copy).
fn candidates(
    groups: &[EndpointGroup],
    port: &ServicePortInfo,
    node: &NodeInfo,
) -> Vec<(BackendAddr, Endpoint)> {
    let mut merged: BTreeMap<BackendAddr, Endpoint> = BTreeMap::new();
    for group in groups {
        let Some(target) = group
            .ports
            .iter()
            .find(|p| p.name == port.name && p.protocol == port.protocol)
        else {
            continue;
        };
        for ep in &group.endpoints {
            let backend = BackendAddr {
                addr: ep.addr,
                port: target.port,
                protocol: port.protocol,
            };
            let rank = |e: &Endpoint| (e.usability(), e.is_local(node));
            match merged.get(&backend) {
                Some(kept) if rank(kept) >= rank(ep) => {}
                _ => {
                    merged.insert(backend, ep.clone());
                }
            }
        }
    }
    merged.into_iter().collect()
}

/// How topology narrows the cluster-wide endpoints (`topologyModeFromHints`).
enum Topology<'a> {
    /// Every endpoint.
    Any,
    /// Endpoints hinted for this node.
    SameNode(&'a str),
    /// Endpoints hinted for this node's zone.
    SameZone(&'a str),
}

impl Topology<'_> {
    fn allows(&self, ep: &Endpoint) -> bool {
        match self {
            Topology::Any => true,
            Topology::SameNode(node) => ep.node_hints.contains(*node),
            Topology::SameZone(zone) => ep.zone_hints.contains(*zone),
        }
    }
}

/// As current kube-proxy (`topology.go`), hints are used whenever they are
/// there, whatever the Service's `trafficDistribution` or topology
/// annotations say (the EndpointSlice controller writes hints only when
/// they ask for them): only when every ready endpoint has one (a partially
/// hinted slice set is mid-update) and some endpoint is hinted for us (or
/// we would send nowhere). Node hints (`forNodes`, `PreferSameNode`) win
/// over zone hints (`forZones`).
fn topology_mode<'a>(endpoints: &[&Endpoint], node: &'a NodeInfo) -> Topology<'a> {
    let ready: Vec<&Endpoint> = endpoints.iter().copied().filter(|e| e.ready).collect();
    if ready.is_empty() {
        return Topology::Any;
    }
    if !node.name.is_empty()
        && ready.iter().all(|e| !e.node_hints.is_empty())
        && ready.iter().any(|e| e.node_hints.contains(&node.name))
    {
        return Topology::SameNode(&node.name);
    }
    if let Some(zone) = node.zone.as_deref() {
        if ready.iter().all(|e| !e.zone_hints.is_empty())
            && ready.iter().any(|e| e.zone_hints.contains(zone))
        {
            return Topology::SameZone(zone);
        }
    }
    Topology::Any
}

/// The serving endpoints of `family` among `candidates`, before any traffic
/// policy or topology: what kube-proxy's UDP conntrack cleanup keeps
/// (`FrontendState::serving`). Sorted and unique, as `candidates` is.
fn serving(candidates: &[(BackendAddr, Endpoint)], family: Family) -> Vec<BackendAddr> {
    candidates
        .iter()
        .filter(|(_, ep)| Family::of(ep.addr) == family && ep.is_serving())
        .map(|(backend, _)| *backend)
        .collect()
}

/// The `(active, terminating)` backends of a frontend of `family` under
/// `policy` (kube-proxy's `CategorizeEndpoints`).
fn select(
    candidates: &[(BackendAddr, Endpoint)],
    family: Family,
    policy: Policy,
    node: &NodeInfo,
) -> (Vec<BackendRef>, Vec<BackendRef>) {
    // Endpoints of the other family belong to the other family's Service.
    let eligible: Vec<&(BackendAddr, Endpoint)> = candidates
        .iter()
        .filter(|(_, ep)| Family::of(ep.addr) == family)
        .filter(|(_, ep)| policy == Policy::Cluster || ep.is_local(node))
        .collect();
    // Topology only narrows the cluster-wide set; the terminating fallback
    // ignores it, as a topology is only chosen when it has ready endpoints.
    let topology = match policy {
        Policy::Cluster => {
            let endpoints: Vec<&Endpoint> = eligible.iter().map(|(_, ep)| ep).collect();
            topology_mode(&endpoints, node)
        }
        _ => Topology::Any,
    };
    // `candidates` is sorted and unique by backend, so these are too.
    let pick = |keep: &dyn Fn(&Endpoint) -> bool| -> Vec<BackendRef> {
        let mut list: Vec<BackendRef> = eligible
            .iter()
            .filter(|(_, ep)| keep(ep))
            .map(|(backend, ep)| BackendRef {
                backend: *backend,
                local: ep.is_local(node),
            })
            .collect();
        // Kept in the desired state for as long as the Service is: no
        // room for more than it holds.
        list.shrink_to_fit();
        list
    };
    let active = pick(&|ep| ep.ready && topology.allows(ep));
    let terminating = pick(&Endpoint::is_serving_terminating);
    (active, terminating)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::input::manifest::{load_str, Format};
    use crate::input::store::Changes;

    fn node(name: &str, zone: Option<&str>) -> NodeInfo {
        NodeInfo {
            name: name.into(),
            zone: zone.map(Into::into),
        }
    }

    /// The node every case runs on unless it says otherwise.
    fn node_a() -> NodeInfo {
        node("node-a", Some("zone-a"))
    }

    /// Each case's documents are one-line flow-style YAML, joined with `---`.
    fn store(docs: &[&str]) -> Store {
        let (store, rejections) = load_str("test.yaml", &docs.join("\n---\n"), Format::Yaml);
        assert!(rejections.is_empty(), "test input: {rejections:#?}");
        store
    }

    fn backends(list: &[BackendRef]) -> String {
        let names: Vec<String> = list
            .iter()
            .map(|b| match b.local {
                true => format!("{}(local)", b.backend),
                false => b.backend.to_string(),
            })
            .collect();
        names.join(" ")
    }

    /// One line per frontend:
    /// `int 10.96.0.10:80/TCP ClusterIp default/web:http => 10.1.0.1:8080(local) | terminating ... | affinity 60 | Maglev | outlier dry-run`
    /// (outlier detection shown unless `on`).
    fn render(state: &DesiredState) -> Vec<String> {
        state
            .frontends
            .iter()
            .map(|(frontend, st)| {
                let scope = match frontend.scope {
                    Scope::Internal => "int",
                    Scope::External => "ext",
                };
                let mut line = format!("{scope} {frontend} {:?} {}", st.kind, st.service);
                if !st.port_name.is_empty() {
                    line += &format!(":{}", st.port_name);
                }
                match st.active.is_empty() {
                    true => line += " => none",
                    false => line += &format!(" => {}", backends(&st.active)),
                }
                if !st.terminating.is_empty() {
                    line += &format!(" | terminating {}", backends(&st.terminating));
                }
                // Shown only where it differs from the selected backends
                // of a UDP frontend.
                let mut selected: Vec<BackendAddr> = st
                    .active
                    .iter()
                    .chain(&st.terminating)
                    .map(|r| r.backend)
                    .collect();
                selected.sort();
                if frontend.protocol == Protocol::Udp && st.serving != selected {
                    let serving: Vec<String> = st.serving.iter().map(|b| b.to_string()).collect();
                    line += &format!(" | serving {}", serving.join(" "));
                }
                if let Some(timeout) = st.affinity_timeout {
                    line += &format!(" | affinity {timeout}");
                }
                if st.algorithm != Algorithm::Random {
                    line += &format!(" | {:?}", st.algorithm);
                }
                if st.outlier != OutlierMode::On {
                    line += &format!(" | outlier {}", st.outlier.name());
                }
                if st.reject {
                    line += " | reject";
                }
                if st.source_ranges {
                    line += " | source ranges";
                }
                line
            })
            .collect()
    }

    /// One line per frontend not served, in the order the Service asks
    /// for them: `int 10.96.0.10:80/SCTP ClusterIp default/web:s spec.clusterIP`.
    fn render_not_served<'a>(not_served: impl Iterator<Item = &'a NotServed>) -> Vec<String> {
        not_served
            .map(|n| {
                let scope = match n.frontend.scope {
                    Scope::Internal => "int",
                    Scope::External => "ext",
                };
                let mut line = format!("{scope} {} {:?} {}", n.frontend, n.kind, n.service);
                if !n.port_name.is_empty() {
                    line += &format!(":{}", n.port_name);
                }
                line + " " + &n.field
            })
            .collect()
    }

    /// `frontends` of a [`Case`] that has none.
    const NONE: &[&str] = &[];

    struct Case<'a> {
        name: &'a str,
        docs: &'a [&'a str],
        /// `None`: `node_a()`.
        node: Option<NodeInfo>,
        /// `node_addresses` are 192.168.1.10 and fd00::10 unless a case
        /// says otherwise.
        opts: TranslateOptions,
        frontends: Vec<String>,
        /// `object field` of each rejection, in order.
        rejected: &'a [&'a str],
        /// See [`render_not_served`]; none unless a case says otherwise.
        not_served: &'a [&'a str],
    }

    impl<'a> Case<'a> {
        /// The case `name`: translating `docs` (see [`store`]) gives
        /// `frontends` (see [`render`]), on `node_a()` with the random
        /// default algorithm, and rejects nothing.
        fn new(name: &'a str, docs: &'a [&'a str], frontends: &[impl AsRef<str>]) -> Self {
            Case {
                name,
                docs,
                node: None,
                opts: TranslateOptions {
                    node_addresses: vec![
                        "192.168.1.10".parse().unwrap(),
                        "fd00::10".parse().unwrap(),
                    ],
                    ..Default::default()
                },
                frontends: frontends.iter().map(|f| f.as_ref().to_owned()).collect(),
                rejected: &[],
                not_served: &[],
            }
        }

        /// Expects these rejections (`object field`, in order).
        fn rejected(self, rejected: &'a [&'a str]) -> Self {
            Case { rejected, ..self }
        }

        /// Expects these frontends not served (see [`render_not_served`]).
        fn not_served(self, not_served: &'a [&'a str]) -> Self {
            Case { not_served, ..self }
        }

        /// Runs on `node` instead of `node_a()`.
        fn on(self, node: NodeInfo) -> Self {
            Case {
                node: Some(node),
                ..self
            }
        }

        fn default_algorithm(mut self, default_algorithm: Algorithm) -> Self {
            self.opts.default_algorithm = default_algorithm;
            self
        }

        /// With `--outlier-detection` at `mode` (`on` otherwise).
        fn default_outlier(mut self, mode: OutlierMode) -> Self {
            self.opts.default_outlier = mode;
            self
        }

        /// With `--allowed-external-ip-cidrs`.
        fn allowed_external_ips(mut self, cidrs: &[&str]) -> Self {
            self.opts.allowed_external_ips = cidrs.iter().map(|c| c.parse().unwrap()).collect();
            self
        }

        /// With `--external-clusterip`.
        fn external_cluster_ip(mut self) -> Self {
            self.opts.external_cluster_ip = true;
            self
        }
    }

    const WEB: &str =
        "{apiVersion: v1, kind: Service, metadata: {name: web}, spec: {clusterIP: 10.96.0.10, ports: [{name: http, port: 80}]}}";
    /// 10.1.0.1 on this node, 10.1.0.2 elsewhere, both ready.
    const WEB_SLICE: &str = "{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, \
        metadata: {name: web-1, labels: {kubernetes.io/service-name: web}}, addressType: IPv4, ports: [{name: http, port: 8080}], \
        endpoints: [{addresses: [10.1.0.2], nodeName: node-b}, {addresses: [10.1.0.1], nodeName: node-a}]}";
    const WEB_FRONTEND: &str =
        "int 10.96.0.10:80/TCP ClusterIp default/web:http => 10.1.0.1:8080(local) 10.1.0.2:8080";

    /// Slice `web-1` of Service `web`, port `http` 8080, with `endpoints` (a
    /// flow-style list).
    fn web_slice(endpoints: &str) -> String {
        format!(
            "{{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, metadata: {{name: web-1, labels: {{kubernetes.io/service-name: web}}}}, \
             addressType: IPv4, ports: [{{name: http, port: 8080}}], endpoints: {endpoints}}}"
        )
    }

    fn run(cases: Vec<Case<'_>>) {
        for case in cases {
            let node = case.node.clone().unwrap_or_else(node_a);
            let mut translator = Translator::default();
            translator.full(&store(case.docs), &node, &case.opts);
            let (state, rejections) = (translator.state(), translator.rejections());
            assert_eq!(render(state), case.frontends, "{}: frontends", case.name);
            assert_eq!(
                render_not_served(translator.not_served()),
                case.not_served,
                "{}: not served",
                case.name
            );
            let got: Vec<String> = rejections
                .iter()
                .map(|r| format!("{} {}", r.object, r.field))
                .collect();
            assert_eq!(
                got, case.rejected,
                "{}: rejections {rejections:#?}",
                case.name
            );
            assert!(
                rejections.iter().all(|r| r.source == "translate"),
                "{}",
                case.name
            );
            for (frontend, st) in &state.frontends {
                assert!(
                    st.active.windows(2).all(|w| w[0] < w[1]),
                    "{}: {frontend} active sorted",
                    case.name
                );
                assert!(
                    st.terminating.windows(2).all(|w| w[0] < w[1]),
                    "{}: {frontend} sorted",
                    case.name
                );
                assert!(
                    st.active.iter().all(|b| !st.terminating.contains(b)),
                    "{}: {frontend} disjoint",
                    case.name
                );
            }
        }
    }

    #[test]
    fn services_and_ports() {
        run(vec![
            Case::new("cluster IP with ready endpoints, the local one marked", &[WEB, WEB_SLICE], &[WEB_FRONTEND]),
            Case::new(
                "no endpoints at all: a frontend without backends (refused)",
                &[WEB],
                &["int 10.96.0.10:80/TCP ClusterIp default/web:http => none"],
            ),
            Case::new(
                "clusterIPs preferred over clusterIP; protocol defaults to TCP, unnamed port",
                &["{apiVersion: v1, kind: Service, metadata: {name: web}, \
                    spec: {clusterIP: 10.96.0.10, clusterIPs: [10.96.0.10], ports: [{port: 80}, {port: 53, protocol: UDP}]}}"],
                &[
                    "int 10.96.0.10:53/UDP ClusterIp default/web => none",
                    "int 10.96.0.10:80/TCP ClusterIp default/web => none",
                ],
            ),
            Case::new(
                "headless (clusterIP and clusterIPs) and ExternalName: nothing, their slices unread",
                &[
                    "{apiVersion: v1, kind: Service, metadata: {name: h1}, spec: {clusterIP: None, ports: [{port: 80}]}}",
                    "{apiVersion: v1, kind: Service, metadata: {name: h2}, spec: {clusterIPs: [None], ports: [{port: 80}]}}",
                    "{apiVersion: v1, kind: Service, metadata: {name: x}, spec: {type: ExternalName, externalName: example.com, ports: [{port: 80}]}}",
                    "{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, metadata: {name: h1-1, labels: {kubernetes.io/service-name: h1}}, \
                     addressType: IPv4, ports: [{port: 80}], endpoints: [{addresses: [not-looked-at]}]}",
                ],
                NONE,
            ),
            Case::new(
                "service-proxy-name label: another proxy's Service, skipped silently",
                &[
                    "{apiVersion: v1, kind: Service, metadata: {name: web, labels: {service.kubernetes.io/service-proxy-name: other}}, \
                     spec: {clusterIP: 10.96.0.10, clusterIPs: [bogus], ports: [{port: 80, protocol: SCTP}]}}",
                    WEB_SLICE,
                ],
                NONE,
            ),
            Case::new(
                "headless label (any value): skipped silently, like service-proxy-name",
                &[
                    "{apiVersion: v1, kind: Service, metadata: {name: web, labels: {service.kubernetes.io/headless: ''}}, \
                     spec: {clusterIP: 10.96.0.10, clusterIPs: [bogus], ports: [{port: 80, protocol: SCTP}]}}",
                    WEB_SLICE,
                ],
                NONE,
            ),
            Case::new(
                "slices labelled headless or service-proxy-name: left out, as kube-proxy's watch never sees them",
                &[
                    WEB,
                    "{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, \
                     metadata: {name: web-1, labels: {kubernetes.io/service-name: web, service.kubernetes.io/headless: ''}}, \
                     addressType: IPv4, ports: [{name: http, port: 8080}], endpoints: [{addresses: [10.1.0.1], nodeName: node-a}]}",
                    "{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, \
                     metadata: {name: web-2, labels: {kubernetes.io/service-name: web, service.kubernetes.io/service-proxy-name: other}}, \
                     addressType: IPv4, ports: [{name: http, port: 8080}], endpoints: [{addresses: [10.1.0.2], nodeName: node-b}]}",
                    "{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, \
                     metadata: {name: web-3, labels: {kubernetes.io/service-name: web}}, \
                     addressType: IPv4, ports: [{name: http, port: 8080}], endpoints: [{addresses: [10.1.0.3], nodeName: node-c}]}",
                ],
                &["int 10.96.0.10:80/TCP ClusterIp default/web:http => 10.1.0.3:8080"],
            ),
            Case::new(
                "SCTP reported not served, the TCP port kept",
                &["{apiVersion: v1, kind: Service, metadata: {name: web}, \
                    spec: {clusterIP: 10.96.0.10, ports: [{name: http, port: 80}, {name: s, port: 9999, protocol: SCTP}]}}"],
                &["int 10.96.0.10:80/TCP ClusterIp default/web:http => none"],
            )
            .rejected(&["Service default/web spec.ports[1].protocol"])
            .not_served(&["int 10.96.0.10:9999/SCTP ClusterIp default/web:s spec.clusterIP"]),
            Case::new(
                "an unknown protocol rejected, the port skipped",
                &["{apiVersion: v1, kind: Service, metadata: {name: web}, \
                    spec: {clusterIP: 10.96.0.10, ports: [{name: http, port: 80}, {name: s, port: 9999, protocol: QUIC}]}}"],
                &["int 10.96.0.10:80/TCP ClusterIp default/web:http => none"],
            )
            .rejected(&["Service default/web spec.ports[1].protocol"]),
            Case::new(
                "ports outside 1..65535 rejected, the others kept",
                &["{apiVersion: v1, kind: Service, metadata: {name: web}, \
                    spec: {clusterIP: 10.96.0.10, ports: [{name: a, port: 70000}, {name: b, port: 81}, {name: c, port: 0}]}}"],
                &["int 10.96.0.10:81/TCP ClusterIp default/web:b => none"],
            )
            .rejected(&["Service default/web spec.ports[0].port", "Service default/web spec.ports[2].port"]),
            Case::new(
                "numeric targetPorts outside 1..65535 rejected with their port, named ones kept",
                &["{apiVersion: v1, kind: Service, metadata: {name: web}, \
                    spec: {clusterIP: 10.96.0.10, ports: [{name: a, port: 80, targetPort: -5}, \
                    {name: b, port: 81, targetPort: 8081}, {name: c, port: 82, targetPort: 70000}, {name: d, port: 83, targetPort: web}]}}"],
                &[
                    "int 10.96.0.10:81/TCP ClusterIp default/web:b => none",
                    "int 10.96.0.10:83/TCP ClusterIp default/web:d => none",
                ],
            )
            .rejected(&["Service default/web spec.ports[0].targetPort", "Service default/web spec.ports[2].targetPort"]),
            Case::new(
                "bad cluster IP rejected, the other family still served",
                &["{apiVersion: v1, kind: Service, metadata: {name: web}, \
                    spec: {clusterIPs: [10.96.0.300, \"fd00:96::10\"], ports: [{name: http, port: 80}]}}"],
                &["int [fd00:96::10]:80/TCP ClusterIp default/web:http => none"],
            )
            .rejected(&["Service default/web spec.clusterIPs[0]"]),
            Case::new(
                "missing cluster IP, bad single clusterIP, unknown type",
                &[
                    "{apiVersion: v1, kind: Service, metadata: {name: a}, spec: {ports: [{port: 80}]}}",
                    "{apiVersion: v1, kind: Service, metadata: {name: b}, spec: {clusterIP: nope, ports: [{port: 80}]}}",
                    "{apiVersion: v1, kind: Service, metadata: {name: c}, spec: {type: Weird, clusterIP: 10.96.0.12}}",
                    "{apiVersion: v1, kind: Service, metadata: {name: d}}",
                    "{apiVersion: v1, kind: Service, metadata: {name: e}, spec: {clusterIP: '', ports: [{port: 80}]}}",
                    "{apiVersion: v1, kind: Service, metadata: {name: f}, spec: {clusterIP: '010.96.0.16', ports: [{port: 80}]}}",
                ],
                NONE,
            )
            .rejected(&[
                "Service default/a spec.clusterIP",
                "Service default/b spec.clusterIP",
                "Service default/c spec.type",
                "Service default/d spec",
                "Service default/e spec.clusterIP",
                "Service default/f spec.clusterIP",
            ]),
            Case::new(
                "session affinity: default timeout, explicit, out of range, unknown type",
                &[
                    "{apiVersion: v1, kind: Service, metadata: {name: a}, spec: {clusterIP: 10.96.0.1, ports: [{port: 80}], sessionAffinity: ClientIP}}",
                    "{apiVersion: v1, kind: Service, metadata: {name: b}, spec: {clusterIP: 10.96.0.2, ports: [{port: 80}], sessionAffinity: ClientIP, \
                     sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}}}",
                    "{apiVersion: v1, kind: Service, metadata: {name: c}, spec: {clusterIP: 10.96.0.3, ports: [{port: 80}], sessionAffinity: ClientIP, \
                     sessionAffinityConfig: {clientIP: {timeoutSeconds: 86401}}}}",
                    "{apiVersion: v1, kind: Service, metadata: {name: d}, spec: {clusterIP: 10.96.0.4, ports: [{port: 80}], sessionAffinity: ClientIP, \
                     sessionAffinityConfig: {clientIP: {timeoutSeconds: 0}}}}",
                    "{apiVersion: v1, kind: Service, metadata: {name: e}, spec: {clusterIP: 10.96.0.5, ports: [{port: 80}], sessionAffinity: None, \
                     sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}}}",
                    "{apiVersion: v1, kind: Service, metadata: {name: f}, spec: {clusterIP: 10.96.0.6, ports: [{port: 80}], sessionAffinity: Cookie}}",
                ],
                &[
                    "int 10.96.0.1:80/TCP ClusterIp default/a => none | affinity 10800",
                    "int 10.96.0.2:80/TCP ClusterIp default/b => none | affinity 60",
                    "int 10.96.0.3:80/TCP ClusterIp default/c => none | affinity 10800",
                    "int 10.96.0.4:80/TCP ClusterIp default/d => none | affinity 10800",
                    "int 10.96.0.5:80/TCP ClusterIp default/e => none",
                    "int 10.96.0.6:80/TCP ClusterIp default/f => none",
                ],
            )
            .rejected(&[
                "Service default/c spec.sessionAffinityConfig.clientIP.timeoutSeconds",
                "Service default/d spec.sessionAffinityConfig.clientIP.timeoutSeconds",
                "Service default/f spec.sessionAffinity",
            ]),
            Case::new(
                "algorithm annotation overrides the default; bad value rejected",
                &[
                    "{apiVersion: v1, kind: Service, metadata: {name: a, annotations: {lb-agent.dev/lb-algorithm: random}}, \
                     spec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}}",
                    "{apiVersion: v1, kind: Service, metadata: {name: b}, spec: {clusterIP: 10.96.0.2, ports: [{port: 80}]}}",
                    "{apiVersion: v1, kind: Service, metadata: {name: c, annotations: {lb-agent.dev/lb-algorithm: ring}}, \
                     spec: {clusterIP: 10.96.0.3, ports: [{port: 80}]}}",
                ],
                &[
                    "int 10.96.0.1:80/TCP ClusterIp default/a => none",
                    "int 10.96.0.2:80/TCP ClusterIp default/b => none | Maglev",
                    "int 10.96.0.3:80/TCP ClusterIp default/c => none | Maglev",
                ],
            )
            .rejected(&["Service default/c metadata.annotations[lb-agent.dev/lb-algorithm]"])
            .default_algorithm(Algorithm::Maglev),
            Case::new(
                "maglev annotation over the random default",
                &[
                    "{apiVersion: v1, kind: Service, metadata: {name: web, annotations: {lb-agent.dev/lb-algorithm: maglev}}, \
                     spec: {clusterIP: 10.96.0.10, ports: [{name: http, port: 80}]}}",
                    WEB_SLICE,
                ],
                &["int 10.96.0.10:80/TCP ClusterIp default/web:http => 10.1.0.1:8080(local) 10.1.0.2:8080 | Maglev"],
            ),
            Case::new(
                "outlier detection: the node's by default, an annotation turns it down; bad value rejected",
                &[
                    "{apiVersion: v1, kind: Service, metadata: {name: a}, spec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}}",
                    "{apiVersion: v1, kind: Service, metadata: {name: b, annotations: {lb-agent.dev/outlier-detection: 'off'}}, \
                     spec: {clusterIP: 10.96.0.2, ports: [{port: 80}]}}",
                    "{apiVersion: v1, kind: Service, metadata: {name: c, annotations: {lb-agent.dev/outlier-detection: dry-run}}, \
                     spec: {clusterIP: 10.96.0.3, ports: [{port: 80}]}}",
                    "{apiVersion: v1, kind: Service, metadata: {name: d, annotations: {lb-agent.dev/outlier-detection: 'on'}}, \
                     spec: {clusterIP: 10.96.0.4, ports: [{port: 80}]}}",
                    "{apiVersion: v1, kind: Service, metadata: {name: e, annotations: {lb-agent.dev/outlier-detection: sometimes}}, \
                     spec: {clusterIP: 10.96.0.5, ports: [{port: 80}]}}",
                ],
                &[
                    "int 10.96.0.1:80/TCP ClusterIp default/a => none",
                    "int 10.96.0.2:80/TCP ClusterIp default/b => none | outlier off",
                    "int 10.96.0.3:80/TCP ClusterIp default/c => none | outlier dry-run",
                    "int 10.96.0.4:80/TCP ClusterIp default/d => none",
                    "int 10.96.0.5:80/TCP ClusterIp default/e => none",
                ],
            )
            .rejected(&["Service default/e metadata.annotations[lb-agent.dev/outlier-detection]"]),
            Case::new(
                "outlier detection: an annotation never raises the node's mode",
                &[
                    "{apiVersion: v1, kind: Service, metadata: {name: a}, spec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}}",
                    "{apiVersion: v1, kind: Service, metadata: {name: b, annotations: {lb-agent.dev/outlier-detection: 'off'}}, \
                     spec: {clusterIP: 10.96.0.2, ports: [{port: 80}]}}",
                    "{apiVersion: v1, kind: Service, metadata: {name: d, annotations: {lb-agent.dev/outlier-detection: 'on'}}, \
                     spec: {clusterIP: 10.96.0.4, ports: [{port: 80}]}}",
                    "{apiVersion: v1, kind: Service, metadata: {name: e, annotations: {lb-agent.dev/outlier-detection: 'ON'}}, \
                     spec: {clusterIP: 10.96.0.5, ports: [{port: 80}]}}",
                ],
                &[
                    "int 10.96.0.1:80/TCP ClusterIp default/a => none | outlier dry-run",
                    "int 10.96.0.2:80/TCP ClusterIp default/b => none | outlier off",
                    "int 10.96.0.4:80/TCP ClusterIp default/d => none | outlier dry-run",
                    "int 10.96.0.5:80/TCP ClusterIp default/e => none | outlier dry-run",
                ],
            )
            .rejected(&["Service default/e metadata.annotations[lb-agent.dev/outlier-detection]"])
            .default_outlier(OutlierMode::DryRun),
            Case::new(
                "outlier detection off on the node: off whatever the annotation",
                &[
                    "{apiVersion: v1, kind: Service, metadata: {name: a}, spec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}}",
                    "{apiVersion: v1, kind: Service, metadata: {name: d, annotations: {lb-agent.dev/outlier-detection: 'on'}}, \
                     spec: {clusterIP: 10.96.0.4, ports: [{port: 80}]}}",
                ],
                &[
                    "int 10.96.0.1:80/TCP ClusterIp default/a => none | outlier off",
                    "int 10.96.0.4:80/TCP ClusterIp default/d => none | outlier off",
                ],
            )
            .default_outlier(OutlierMode::Off),
            Case::new(
                "outlier detection: every frontend of the Service carries its mode",
                &[
                    "{apiVersion: v1, kind: Service, metadata: {name: web, annotations: {lb-agent.dev/outlier-detection: dry-run}}, \
                     spec: {type: LoadBalancer, clusterIP: 10.96.0.10, externalIPs: [203.0.113.5], ports: [{name: http, port: 80, nodePort: 30080}]}, \
                     status: {loadBalancer: {ingress: [{ip: 198.51.100.1}]}}}",
                    WEB_SLICE,
                ],
                &[
                    "int 10.96.0.10:80/TCP ClusterIp default/web:http => 10.1.0.1:8080(local) 10.1.0.2:8080 | outlier dry-run",
                    "int 192.168.1.10:30080/TCP NodePort default/web:http => 10.1.0.1:8080(local) 10.1.0.2:8080 | outlier dry-run",
                    "ext 192.168.1.10:30080/TCP NodePort default/web:http => 10.1.0.1:8080(local) 10.1.0.2:8080 | outlier dry-run",
                    "int 198.51.100.1:80/TCP LoadBalancer default/web:http => 10.1.0.1:8080(local) 10.1.0.2:8080 | outlier dry-run",
                    "ext 198.51.100.1:80/TCP LoadBalancer default/web:http => 10.1.0.1:8080(local) 10.1.0.2:8080 | outlier dry-run",
                    "int 203.0.113.5:80/TCP ExternalIp default/web:http => 10.1.0.1:8080(local) 10.1.0.2:8080 | outlier dry-run",
                    "ext 203.0.113.5:80/TCP ExternalIp default/web:http => 10.1.0.1:8080(local) 10.1.0.2:8080 | outlier dry-run",
                ],
            ),
            Case::new(
                "duplicate frontends of one kind, no creationTimestamp: the first Service by namespace/name keeps them",
                &[
                    "{apiVersion: v1, kind: Service, metadata: {name: b}, spec: {clusterIP: 10.96.0.10, ports: [{port: 80}, {port: 81}]}}",
                    "{apiVersion: v1, kind: Service, metadata: {name: a}, spec: {clusterIP: 10.96.0.10, ports: [{port: 80}], externalIPs: [203.0.113.5]}}",
                    "{apiVersion: v1, kind: Service, metadata: {name: c}, spec: {clusterIP: 10.96.0.12, ports: [{port: 80}], externalIPs: [203.0.113.5]}}",
                ],
                &[
                    "int 10.96.0.10:80/TCP ClusterIp default/a => none",
                    "int 10.96.0.10:81/TCP ClusterIp default/b => none",
                    "int 10.96.0.12:80/TCP ClusterIp default/c => none",
                    "int 203.0.113.5:80/TCP ExternalIp default/a => none",
                    "ext 203.0.113.5:80/TCP ExternalIp default/a => none | reject",
                ],
            )
            .rejected(&["Service default/b spec.clusterIP", "Service default/c spec.externalIPs[0]"]),
        ]);
    }

    /// `--external-clusterip` (issue 11, item 12): the ClusterIP gets an
    /// `External` copy with the backends of `internalTrafficPolicy`.
    #[test]
    fn external_cluster_ips() {
        let local_web = "{apiVersion: v1, kind: Service, metadata: {name: web}, \
            spec: {type: NodePort, clusterIP: 10.96.0.10, internalTrafficPolicy: Local, externalTrafficPolicy: Cluster, \
            ports: [{name: http, port: 80, nodePort: 30080}]}}";
        let elsewhere = web_slice("[{addresses: [10.1.0.2], nodeName: node-b}]");
        run(vec![
            Case::new("off: only the Internal frontend", &[WEB, WEB_SLICE], &[WEB_FRONTEND]),
            Case::new(
                "on: an External copy, every endpoint (internalTrafficPolicy Cluster)",
                &[WEB, WEB_SLICE],
                &[
                    WEB_FRONTEND,
                    "ext 10.96.0.10:80/TCP ClusterIp default/web:http => 10.1.0.1:8080(local) 10.1.0.2:8080",
                ],
            )
            .external_cluster_ip(),
            Case::new(
                "internalTrafficPolicy Local: the External copy too, whatever externalTrafficPolicy says",
                &[local_web, WEB_SLICE],
                &[
                    "int 10.96.0.10:80/TCP ClusterIp default/web:http => 10.1.0.1:8080(local)",
                    "ext 10.96.0.10:80/TCP ClusterIp default/web:http => 10.1.0.1:8080(local)",
                    "int 192.168.1.10:30080/TCP NodePort default/web:http => 10.1.0.1:8080(local) 10.1.0.2:8080",
                    "ext 192.168.1.10:30080/TCP NodePort default/web:http => 10.1.0.1:8080(local) 10.1.0.2:8080",
                ],
            )
            .external_cluster_ip(),
            Case::new(
                "internalTrafficPolicy Local, endpoints elsewhere only: dropped, not rejected",
                &[local_web, &elsewhere],
                &[
                    "int 10.96.0.10:80/TCP ClusterIp default/web:http => none",
                    "ext 10.96.0.10:80/TCP ClusterIp default/web:http => none",
                    "int 192.168.1.10:30080/TCP NodePort default/web:http => 10.1.0.2:8080",
                    "ext 192.168.1.10:30080/TCP NodePort default/web:http => 10.1.0.2:8080",
                ],
            )
            .external_cluster_ip(),
            Case::new(
                "no endpoints: rejected from outside too; both families",
                &["{apiVersion: v1, kind: Service, metadata: {name: web}, \
                    spec: {clusterIPs: [10.96.0.10, \"fd00:96::10\"], ports: [{name: http, port: 80}]}}"],
                &[
                    "int 10.96.0.10:80/TCP ClusterIp default/web:http => none",
                    "ext 10.96.0.10:80/TCP ClusterIp default/web:http => none | reject",
                    "int [fd00:96::10]:80/TCP ClusterIp default/web:http => none",
                    "ext [fd00:96::10]:80/TCP ClusterIp default/web:http => none | reject",
                ],
            )
            .external_cluster_ip(),
        ]);
    }

    /// Services claiming one frontend (issue 11, item 8): see `Rank`.
    #[test]
    fn contested_frontends() {
        const A_NODEPORT: &str = "{apiVersion: v1, kind: Service, metadata: {name: a-np}, \
            spec: {type: NodePort, clusterIP: 10.96.0.30, ports: [{port: 80, nodePort: 30090}]}}";
        const A_NODEPORT_CLUSTER_IP: &str = "int 10.96.0.30:80/TCP ClusterIp default/a-np => none";
        const EXTERNAL_IP_ON_A_CLUSTER_IP: &[&str] = &[
            "{apiVersion: v1, kind: Service, metadata: {name: a-ext}, \
             spec: {clusterIP: 10.96.0.33, ports: [{port: 80}], externalIPs: [10.96.0.34]}}",
            "{apiVersion: v1, kind: Service, metadata: {name: b-cip}, spec: {clusterIP: 10.96.0.34, ports: [{port: 80}]}}",
        ];
        run(vec![
            Case::new(
                "a NodePort yields to another Service's externalIP on the node address, both scopes",
                &[
                    A_NODEPORT,
                    "{apiVersion: v1, kind: Service, metadata: {name: b-ext}, \
                     spec: {clusterIP: 10.96.0.31, ports: [{port: 30090}], externalIPs: [192.168.1.10]}}",
                ],
                &[
                    A_NODEPORT_CLUSTER_IP,
                    "int 10.96.0.31:30090/TCP ClusterIp default/b-ext => none",
                    "int 192.168.1.10:30090/TCP ExternalIp default/b-ext => none",
                    "ext 192.168.1.10:30090/TCP ExternalIp default/b-ext => none | reject",
                ],
            )
            .rejected(&["Service default/a-np spec.ports[0].nodePort"]),
            Case::new(
                "a NodePort yields to a LoadBalancer IP on the node address (k3s' ServiceLB), even an older NodePort",
                &[
                    "{apiVersion: v1, kind: Service, metadata: {name: a-np, creationTimestamp: '2020-01-01T00:00:00Z'}, \
                     spec: {type: NodePort, clusterIP: 10.96.0.30, ports: [{port: 80, nodePort: 30090}]}}",
                    "{apiVersion: v1, kind: Service, metadata: {name: b-lb, creationTimestamp: '2024-01-01T00:00:00Z'}, \
                     spec: {type: LoadBalancer, clusterIP: 10.96.0.32, ports: [{port: 30090, nodePort: 31000}]}, \
                     status: {loadBalancer: {ingress: [{ip: 192.168.1.10}]}}}",
                ],
                &[
                    A_NODEPORT_CLUSTER_IP,
                    "int 10.96.0.32:30090/TCP ClusterIp default/b-lb => none",
                    "int 192.168.1.10:30090/TCP LoadBalancer default/b-lb => none",
                    "ext 192.168.1.10:30090/TCP LoadBalancer default/b-lb => none | reject",
                    "int 192.168.1.10:31000/TCP NodePort default/b-lb => none",
                    "ext 192.168.1.10:31000/TCP NodePort default/b-lb => none | reject",
                ],
            )
            .rejected(&["Service default/a-np spec.ports[0].nodePort"]),
            Case::new(
                "a ClusterIP before an externalIP; the externalIP keeps the External scope, where the ClusterIP is not served",
                EXTERNAL_IP_ON_A_CLUSTER_IP,
                &[
                    "int 10.96.0.33:80/TCP ClusterIp default/a-ext => none",
                    "int 10.96.0.34:80/TCP ClusterIp default/b-cip => none",
                    "ext 10.96.0.34:80/TCP ExternalIp default/a-ext => none | reject",
                ],
            )
            .rejected(&["Service default/a-ext spec.externalIPs[0]"]),
            Case::new(
                "with --external-clusterip the ClusterIP wins both scopes",
                EXTERNAL_IP_ON_A_CLUSTER_IP,
                &[
                    "int 10.96.0.33:80/TCP ClusterIp default/a-ext => none",
                    "ext 10.96.0.33:80/TCP ClusterIp default/a-ext => none | reject",
                    "int 10.96.0.34:80/TCP ClusterIp default/b-cip => none",
                    "ext 10.96.0.34:80/TCP ClusterIp default/b-cip => none | reject",
                ],
            )
            .rejected(&["Service default/a-ext spec.externalIPs[0]"])
            .external_cluster_ip(),
            Case::new(
                "a LoadBalancer IP before an externalIP",
                &[
                    "{apiVersion: v1, kind: Service, metadata: {name: a-ext}, \
                     spec: {clusterIP: 10.96.0.35, ports: [{port: 80}], externalIPs: [203.0.113.7]}}",
                    "{apiVersion: v1, kind: Service, metadata: {name: b-lb}, \
                     spec: {type: LoadBalancer, clusterIP: 10.96.0.36, ports: [{port: 80}]}, \
                     status: {loadBalancer: {ingress: [{ip: 203.0.113.7}]}}}",
                ],
                &[
                    "int 10.96.0.35:80/TCP ClusterIp default/a-ext => none",
                    "int 10.96.0.36:80/TCP ClusterIp default/b-lb => none",
                    "int 203.0.113.7:80/TCP LoadBalancer default/b-lb => none",
                    "ext 203.0.113.7:80/TCP LoadBalancer default/b-lb => none | reject",
                ],
            )
            .rejected(&["Service default/a-ext spec.externalIPs[0]"]),
            Case::new(
                "one kind: the older Service keeps it, one without creationTimestamp comes last",
                &[
                    "{apiVersion: v1, kind: Service, metadata: {name: a-new, creationTimestamp: '2024-02-01T00:00:00Z'}, \
                     spec: {clusterIP: 10.96.0.37, ports: [{port: 80}], externalIPs: [203.0.113.8]}}",
                    "{apiVersion: v1, kind: Service, metadata: {name: b-old, creationTimestamp: '2024-01-01T00:00:00Z'}, \
                     spec: {clusterIP: 10.96.0.38, ports: [{port: 80}], externalIPs: [203.0.113.8]}}",
                    "{apiVersion: v1, kind: Service, metadata: {name: a-none, namespace: a}, \
                     spec: {clusterIP: 10.96.0.39, ports: [{port: 80}], externalIPs: [203.0.113.8]}}",
                ],
                &[
                    "int 10.96.0.37:80/TCP ClusterIp default/a-new => none",
                    "int 10.96.0.38:80/TCP ClusterIp default/b-old => none",
                    "int 10.96.0.39:80/TCP ClusterIp a/a-none => none",
                    "int 203.0.113.8:80/TCP ExternalIp default/b-old => none",
                    "ext 203.0.113.8:80/TCP ExternalIp default/b-old => none | reject",
                ],
            )
            .rejected(&["Service a/a-none spec.externalIPs[0]", "Service default/a-new spec.externalIPs[0]"]),
            Case::new(
                "within one Service its first claim",
                &["{apiVersion: v1, kind: Service, metadata: {name: web}, \
                    spec: {clusterIP: 10.96.0.40, ports: [{port: 80}], externalIPs: [203.0.113.9, 203.0.113.9]}}"],
                &[
                    "int 10.96.0.40:80/TCP ClusterIp default/web => none",
                    "int 203.0.113.9:80/TCP ExternalIp default/web => none",
                    "ext 203.0.113.9:80/TCP ExternalIp default/web => none | reject",
                ],
            )
            .rejected(&["Service default/web spec.externalIPs[1]"]),
            Case::new(
                "an externalIP refused by --allowed-external-ip-cidrs claims nothing: the NodePort serves",
                &[
                    A_NODEPORT,
                    "{apiVersion: v1, kind: Service, metadata: {name: b-ext}, \
                     spec: {clusterIP: 10.96.0.31, ports: [{port: 30090}], externalIPs: [192.168.1.10, 203.0.113.10]}}",
                ],
                &[
                    A_NODEPORT_CLUSTER_IP,
                    "int 10.96.0.31:30090/TCP ClusterIp default/b-ext => none",
                    "int 192.168.1.10:30090/TCP NodePort default/a-np => none",
                    "ext 192.168.1.10:30090/TCP NodePort default/a-np => none | reject",
                    "int 203.0.113.10:30090/TCP ExternalIp default/b-ext => none",
                    "ext 203.0.113.10:30090/TCP ExternalIp default/b-ext => none | reject",
                ],
            )
            .rejected(&["Service default/b-ext spec.externalIPs[0]"])
            .allowed_external_ips(&["203.0.113.0/24"]),
        ]);
    }

    /// A lost claim names the address, both Services and why.
    #[test]
    fn contested_frontends_say_who_keeps_them_and_why() {
        let docs = [
            "{apiVersion: v1, kind: Service, metadata: {name: a-np}, \
             spec: {type: NodePort, clusterIP: 10.96.0.30, ports: [{port: 80, nodePort: 30090}]}}",
            "{apiVersion: v1, kind: Service, metadata: {name: b-ext, namespace: shop}, \
             spec: {clusterIP: 10.96.0.31, ports: [{port: 30090}], externalIPs: [192.168.1.10]}}",
            "{apiVersion: v1, kind: Service, metadata: {name: c-old, creationTimestamp: '2024-01-01T00:00:00Z'}, \
             spec: {clusterIP: 10.96.0.32, ports: [{port: 81}], externalIPs: [203.0.113.5, 203.0.113.6]}}",
            "{apiVersion: v1, kind: Service, metadata: {name: d-new, creationTimestamp: '2024-03-01T00:00:00Z'}, \
             spec: {clusterIP: 10.96.0.33, ports: [{port: 81}], externalIPs: [203.0.113.5]}}",
            "{apiVersion: v1, kind: Service, metadata: {name: e-none}, \
             spec: {clusterIP: 10.96.0.34, ports: [{port: 81}], externalIPs: [203.0.113.6]}}",
            "{apiVersion: v1, kind: Service, metadata: {name: a-lb}, \
             spec: {type: LoadBalancer, clusterIP: 10.96.0.35, ports: [{port: 80, nodePort: 31000}]}, \
             status: {loadBalancer: {ingress: [{ip: 10.96.0.30}]}}}",
        ];
        let opts = TranslateOptions {
            node_addresses: vec!["192.168.1.10".parse().unwrap()],
            ..Default::default()
        };
        let (_, rejections) = translate(&store(&docs), &node_a(), &opts);
        let got: Vec<String> = rejections.iter().map(ToString::to_string).collect();
        assert_eq!(
            got,
            [
                "translate: Service default/a-lb: status.loadBalancer.ingress[0].ip: frontend 10.96.0.30:80/TCP is also \
                 claimed by Service default/a-np (spec.clusterIP), which keeps it: a ClusterIP comes before a \
                 LoadBalancer IP (ClusterIP, LoadBalancer IP, externalIP); ignored",
                "translate: Service default/a-np: spec.ports[0].nodePort: frontend 192.168.1.10:30090/TCP is also \
                 claimed by Service shop/b-ext (spec.externalIPs[0]), which keeps it: kube-proxy matches an \
                 externalIP before a NodePort; ignored",
                "translate: Service default/d-new: spec.externalIPs[0]: frontend 203.0.113.5:81/TCP is also claimed by \
                 Service default/c-old (spec.externalIPs[0]), which keeps it: it is older (created 2024-01-01T00:00:00Z); ignored",
                "translate: Service default/e-none: spec.externalIPs[0]: frontend 203.0.113.6:81/TCP is also claimed by \
                 Service default/c-old (spec.externalIPs[1]), which keeps it: it has a creationTimestamp \
                 (2024-01-01T00:00:00Z), this Service none; ignored",
            ]
        );
    }

    #[test]
    fn endpoints() {
        run(vec![
            Case::new(
                "several slices merged; a duplicate address counts once, ready wins; other namespaces and Services ignored",
                &[
                    WEB,
                    "{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, metadata: {name: web-1, labels: {kubernetes.io/service-name: web}}, \
                     addressType: IPv4, ports: [{name: http, port: 8080}], \
                     endpoints: [{addresses: [10.1.0.1]}, {addresses: [10.1.0.2], conditions: {ready: false}}]}",
                    "{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, metadata: {name: web-2, labels: {kubernetes.io/service-name: web}}, \
                     addressType: IPv4, ports: [{name: http, port: 8080}], \
                     endpoints: [{addresses: [10.1.0.2]}, {addresses: [10.1.0.3]}, {addresses: [10.1.0.1]}]}",
                    "{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, metadata: {name: web-3, labels: {kubernetes.io/service-name: web}}, \
                     addressType: IPv4, ports: [{name: http, port: 8081}], endpoints: [{addresses: [10.1.0.4]}]}",
                    "{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, metadata: {name: web-x, namespace: shop, labels: {kubernetes.io/service-name: web}}, \
                     addressType: IPv4, ports: [{name: http, port: 8080}], endpoints: [{addresses: [10.9.0.1]}]}",
                    "{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, metadata: {name: other-1, labels: {kubernetes.io/service-name: other}}, \
                     addressType: IPv4, ports: [{name: http, port: 8080}], endpoints: [{addresses: [10.9.0.2]}]}",
                    "{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, metadata: {name: nolabel}, \
                     addressType: IPv4, ports: [{name: http, port: 8080}], endpoints: [{addresses: [10.9.0.3]}]}",
                ],
                &["int 10.96.0.10:80/TCP ClusterIp default/web:http => 10.1.0.1:8080 10.1.0.2:8080 10.1.0.3:8080 10.1.0.4:8081"],
            ),
            Case::new(
                "named targetPort on a multi-port Service resolved by slice port name and protocol",
                &[
                    "{apiVersion: v1, kind: Service, metadata: {name: web}, spec: {clusterIP: 10.96.0.10, ports: [\
                     {name: http, port: 80, targetPort: web}, {name: metrics, port: 9090, targetPort: 9100}, \
                     {name: dns, port: 53, protocol: UDP, targetPort: dns}, {name: nomatch, port: 81}]}}",
                    "{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, metadata: {name: web-1, labels: {kubernetes.io/service-name: web}}, \
                     addressType: IPv4, ports: [{name: metrics, port: 9100}, {name: http, port: 8080}, \
                     {name: dns, port: 5353, protocol: UDP}, {name: dns, port: 5454, protocol: TCP}, {name: nomatch, port: 81, protocol: UDP}], \
                     endpoints: [{addresses: [10.1.0.1]}]}",
                ],
                &[
                    "int 10.96.0.10:53/UDP ClusterIp default/web:dns => 10.1.0.1:5353",
                    "int 10.96.0.10:80/TCP ClusterIp default/web:http => 10.1.0.1:8080",
                    "int 10.96.0.10:81/TCP ClusterIp default/web:nomatch => none",
                    "int 10.96.0.10:9090/TCP ClusterIp default/web:metrics => 10.1.0.1:9100",
                ],
            ),
            Case::new(
                "conditions: unready excluded; ready present, so terminating ones are kept aside only",
                &[
                    WEB,
                    &web_slice(
                        "[{addresses: [10.1.0.1]}, \
                         {addresses: [10.1.0.2], conditions: {ready: true}}, \
                         {addresses: [10.1.0.3], conditions: {ready: false, serving: true, terminating: false}}, \
                         {addresses: [10.1.0.4], conditions: {ready: false, serving: false}}, \
                         {addresses: [10.1.0.5], conditions: {ready: false, serving: true, terminating: true}}, \
                         {addresses: [10.1.0.6], conditions: {ready: false, serving: false, terminating: true}}]",
                    ),
                ],
                &["int 10.96.0.10:80/TCP ClusterIp default/web:http => 10.1.0.1:8080 10.1.0.2:8080 | terminating 10.1.0.5:8080"],
            ),
            Case::new(
                "KEP-1669: nothing ready, serving-terminating endpoints are the fallback",
                &[
                    WEB,
                    &web_slice(
                        "[{addresses: [10.1.0.5], nodeName: node-a, conditions: {ready: false, serving: true, terminating: true}}, \
                         {addresses: [10.1.0.6], conditions: {ready: false, serving: false, terminating: true}}]",
                    ),
                ],
                &["int 10.96.0.10:80/TCP ClusterIp default/web:http => none | terminating 10.1.0.5:8080(local)"],
            ),
            Case::new(
                "KEP-1669: neither ready nor serving, nothing at all",
                &[
                    WEB,
                    &web_slice(
                        "[{addresses: [10.1.0.6], conditions: {ready: false, serving: false, terminating: true}}, \
                         {addresses: [10.1.0.7], conditions: {ready: false, serving: false}}]",
                    ),
                ],
                &["int 10.96.0.10:80/TCP ClusterIp default/web:http => none"],
            ),
            Case::new(
                "selectorless Service: v1 Endpoints used when there is no slice at all",
                &[
                    WEB,
                    "{apiVersion: v1, kind: Endpoints, metadata: {name: web}, subsets: [\
                     {addresses: [{ip: 10.1.0.1, nodeName: node-a}, {ip: 10.1.0.2}], notReadyAddresses: [{ip: 10.1.0.3}], \
                      ports: [{name: http, port: 8080}, {name: other, port: 9}]}, \
                     {addresses: [{ip: 10.1.0.4}, {ip: bogus}], ports: [{name: http, port: 8081}]}]}",
                ],
                &["int 10.96.0.10:80/TCP ClusterIp default/web:http => 10.1.0.1:8080(local) 10.1.0.2:8080 10.1.0.4:8081"],
            )
            .rejected(&["Endpoints default/web subsets[1].addresses[1].ip"]),
            Case::new(
                "v1 Endpoints ignored when the Service has slices",
                &[
                    WEB,
                    WEB_SLICE,
                    "{apiVersion: v1, kind: Endpoints, metadata: {name: web}, subsets: [{addresses: [{ip: 10.9.9.9}], ports: [{name: http, port: 8080}]}]}",
                ],
                &[WEB_FRONTEND],
            ),
            Case::new(
                "wrong-family and FQDN slices ignored; bad slice entries rejected",
                &[
                    WEB,
                    WEB_SLICE,
                    "{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, metadata: {name: web-v6, labels: {kubernetes.io/service-name: web}}, \
                     addressType: IPv6, ports: [{name: http, port: 8080}], endpoints: [{addresses: [\"fd00:1::1\"]}]}",
                    "{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, metadata: {name: web-fqdn, labels: {kubernetes.io/service-name: web}}, \
                     addressType: FQDN, ports: [{name: http, port: 8080}], endpoints: [{addresses: [example.com]}]}",
                    "{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, metadata: {name: web-zbad, labels: {kubernetes.io/service-name: web}}, \
                     addressType: IPv4, ports: [{name: http, port: 8080}], \
                     endpoints: [{addresses: [\"fd00:1::2\"]}, {addresses: [nope]}, {addresses: []}]}",
                ],
                &[WEB_FRONTEND],
            )
            .rejected(&[
                "EndpointSlice default/web-zbad endpoints[0].addresses[0]",
                "EndpointSlice default/web-zbad endpoints[1].addresses[0]",
                "EndpointSlice default/web-zbad endpoints[2].addresses",
            ]),
            Case::new(
                "dual stack: each family's frontends get that family's slice",
                &[
                    "{apiVersion: v1, kind: Service, metadata: {name: web}, \
                     spec: {type: NodePort, clusterIPs: [10.96.0.10, \"fd00:96::10\"], ports: [{name: http, port: 80, nodePort: 30080}]}}",
                    "{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, metadata: {name: web-v4, labels: {kubernetes.io/service-name: web}}, \
                     addressType: IPv4, ports: [{name: http, port: 8080}], endpoints: [{addresses: [10.1.0.1]}]}",
                    "{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, metadata: {name: web-v6, labels: {kubernetes.io/service-name: web}}, \
                     addressType: IPv6, ports: [{name: http, port: 8080}], endpoints: [{addresses: [\"fd00:1::1\"], nodeName: node-a}]}",
                ],
                &[
                    "int 10.96.0.10:80/TCP ClusterIp default/web:http => 10.1.0.1:8080",
                    "int 192.168.1.10:30080/TCP NodePort default/web:http => 10.1.0.1:8080",
                    "ext 192.168.1.10:30080/TCP NodePort default/web:http => 10.1.0.1:8080",
                    "int [fd00::10]:30080/TCP NodePort default/web:http => [fd00:1::1]:8080(local)",
                    "ext [fd00::10]:30080/TCP NodePort default/web:http => [fd00:1::1]:8080(local)",
                    "int [fd00:96::10]:80/TCP ClusterIp default/web:http => [fd00:1::1]:8080(local)",
                ],
            ),
        ]);
    }

    /// 10.1.0.1 local, 10.1.0.2 remote, 10.1.0.3 local and terminating.
    const POLICY_SLICE: &str = "{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, \
        metadata: {name: web-1, labels: {kubernetes.io/service-name: web}}, addressType: IPv4, ports: [{name: http, port: 8080}], \
        endpoints: [{addresses: [10.1.0.1], nodeName: node-a}, {addresses: [10.1.0.2], nodeName: node-b}, \
        {addresses: [10.1.0.3], nodeName: node-a, conditions: {ready: false, serving: true, terminating: true}}]}";

    const ITP_LOCAL_WEB: &str = "{apiVersion: v1, kind: Service, metadata: {name: web}, \
        spec: {clusterIP: 10.96.0.10, internalTrafficPolicy: Local, ports: [{name: http, port: 80}]}}";

    /// The frontends of `docs` (on `node_a()`, node addresses 192.168.1.10
    /// and fd00::10) grouped by the sessionAffinity decision they share:
    /// one line per group, `scope addr:port/proto` joined by `, `; the
    /// frontends without affinity left out.
    fn affinity_groups(docs: &[&str]) -> Vec<String> {
        let opts = TranslateOptions {
            node_addresses: vec!["192.168.1.10".parse().unwrap(), "fd00::10".parse().unwrap()],
            ..Default::default()
        };
        let (state, _) = translate(&store(docs), &node_a(), &opts);
        let mut groups: BTreeMap<crate::semantics::model::AffinityGroup, Vec<String>> =
            BTreeMap::new();
        for (f, st) in &state.frontends {
            if let Some(g) = st.affinity_group(f) {
                let scope = match f.scope {
                    Scope::Internal => "int",
                    Scope::External => "ext",
                };
                groups.entry(g).or_default().push(format!("{scope} {f}"));
            }
        }
        // Frontends that share a decision have the same backends: the
        // kernel trusts a live entry's backend through any of them.
        for (f, st) in &state.frontends {
            for (g, st2) in &state.frontends {
                if st.affinity_group(f).is_some() && st.affinity_group(f) == st2.affinity_group(g) {
                    assert_eq!(
                        (&st.active, &st.terminating),
                        (&st2.active, &st2.terminating),
                        "{f} and {g} share an affinity decision"
                    );
                }
            }
        }
        let mut out: Vec<String> = groups.into_values().map(|l| l.join(", ")).collect();
        out.sort();
        out
    }

    /// kube-proxy keeps one affinity decision per Service port "without
    /// regard to which service IP was used": every frontend of a port whose
    /// backends come from the same selection shares it.
    #[test]
    fn affinity_is_shared_by_the_frontends_of_one_service_port() {
        const SLICE: &str = "{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, \
            metadata: {name: web-1, labels: {kubernetes.io/service-name: web}}, addressType: IPv4, \
            ports: [{name: http, port: 8080}, {name: admin, port: 9090}], \
            endpoints: [{addresses: [10.1.0.2], nodeName: node-b}, {addresses: [10.1.0.1], nodeName: node-a}]}";
        const SLICE_V6: &str = "{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, \
            metadata: {name: web-6, labels: {kubernetes.io/service-name: web}}, addressType: IPv6, \
            ports: [{name: http, port: 8080}], endpoints: [{addresses: [\"fd00:1::1\"], nodeName: node-a}]}";
        let web = |extra: &str| {
            format!(
                "{{apiVersion: v1, kind: Service, metadata: {{name: web}}, spec: {{type: LoadBalancer, \
                 clusterIP: 10.96.0.10, externalIPs: [203.0.113.5], sessionAffinity: ClientIP, \
                 ports: [{{name: http, port: 80, nodePort: 30080}}]{extra}}}, \
                 status: {{loadBalancer: {{ingress: [{{ip: 198.51.100.1}}]}}}}}}"
            )
        };
        let cluster = web("");
        let etp_local = web(", externalTrafficPolicy: Local");
        let itp_local = web(", internalTrafficPolicy: Local");
        let two_ports =
            "{apiVersion: v1, kind: Service, metadata: {name: web}, spec: {clusterIP: 10.96.0.10, \
            sessionAffinity: ClientIP, ports: [{name: http, port: 80}, {name: admin, port: 81}, \
            {name: dns, port: 53, protocol: UDP}]}}";
        let other = "{apiVersion: v1, kind: Service, metadata: {name: other}, spec: {clusterIP: 10.96.0.11, \
            externalIPs: [203.0.113.6], sessionAffinity: ClientIP, ports: [{name: http, port: 80}]}}";
        let other_slice = "{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, \
            metadata: {name: other-1, labels: {kubernetes.io/service-name: other}}, addressType: IPv4, \
            ports: [{name: http, port: 8080}], endpoints: [{addresses: [10.1.0.1], nodeName: node-a}]}";
        let dual = "{apiVersion: v1, kind: Service, metadata: {name: web}, spec: {clusterIPs: [10.96.0.10, \"fd00:96::10\"], \
            ipFamilyPolicy: PreferDualStack, sessionAffinity: ClientIP, ports: [{name: http, port: 80}]}}";
        let no_affinity =
            "{apiVersion: v1, kind: Service, metadata: {name: web}, spec: {clusterIP: 10.96.0.10, \
            externalIPs: [203.0.113.5], ports: [{name: http, port: 80}]}}";
        let cases: Vec<(&str, Vec<&str>, Vec<&str>)> = vec![
            (
                "Cluster policies: ClusterIP, externalIP, LB IP and NodePort share, in both scopes",
                vec![&cluster, SLICE],
                vec!["int 10.96.0.10:80/TCP, int 192.168.1.10:30080/TCP, ext 192.168.1.10:30080/TCP, \
                      int 198.51.100.1:80/TCP, ext 198.51.100.1:80/TCP, int 203.0.113.5:80/TCP, ext 203.0.113.5:80/TCP"],
            ),
            (
                "externalTrafficPolicy Local: the External frontends (node-local set) apart from the ClusterIP",
                vec![&etp_local, SLICE],
                vec![
                    "ext 192.168.1.10:30080/TCP, ext 198.51.100.1:80/TCP, ext 203.0.113.5:80/TCP",
                    "int 10.96.0.10:80/TCP, int 192.168.1.10:30080/TCP, int 198.51.100.1:80/TCP, int 203.0.113.5:80/TCP",
                ],
            ),
            (
                "internalTrafficPolicy Local: the ClusterIP (node-local set) apart from the north-south frontends",
                vec![&itp_local, SLICE],
                vec![
                    "int 10.96.0.10:80/TCP",
                    "int 192.168.1.10:30080/TCP, ext 192.168.1.10:30080/TCP, int 198.51.100.1:80/TCP, \
                     ext 198.51.100.1:80/TCP, int 203.0.113.5:80/TCP, ext 203.0.113.5:80/TCP",
                ],
            ),
            (
                "two ports (and two protocols) of one Service never share",
                vec![two_ports, SLICE],
                vec!["int 10.96.0.10:53/UDP", "int 10.96.0.10:80/TCP", "int 10.96.0.10:81/TCP"],
            ),
            (
                "two Services never share",
                vec![&cluster, SLICE, other, other_slice],
                vec![
                    "int 10.96.0.10:80/TCP, int 192.168.1.10:30080/TCP, ext 192.168.1.10:30080/TCP, \
                     int 198.51.100.1:80/TCP, ext 198.51.100.1:80/TCP, int 203.0.113.5:80/TCP, ext 203.0.113.5:80/TCP",
                    "int 10.96.0.11:80/TCP, int 203.0.113.6:80/TCP, ext 203.0.113.6:80/TCP",
                ],
            ),
            (
                "the two families of a dual-stack Service decide apart",
                vec![dual, SLICE, SLICE_V6],
                vec!["int 10.96.0.10:80/TCP", "int [fd00:96::10]:80/TCP"],
            ),
            ("without affinity: no group", vec![no_affinity, SLICE], vec![]),
        ];
        for (name, docs, want) in cases {
            let want: Vec<String> = want
                .iter()
                .map(|w| w.split_whitespace().collect::<Vec<_>>().join(" "))
                .collect();
            assert_eq!(affinity_groups(&docs), want, "{name}");
        }
    }

    #[test]
    fn traffic_policies_and_north_south() {
        run(vec![
            Case::new(
                "internalTrafficPolicy Local with local endpoints",
                &[ITP_LOCAL_WEB, POLICY_SLICE],
                &["int 10.96.0.10:80/TCP ClusterIp default/web:http => 10.1.0.1:8080(local) | terminating 10.1.0.3:8080(local)"],
            ),
            Case::new(
                "internalTrafficPolicy Local without local endpoints: none (refused)",
                &[ITP_LOCAL_WEB, POLICY_SLICE],
                &["int 10.96.0.10:80/TCP ClusterIp default/web:http => none"],
            )
            .on(node("node-c", None)),
            Case::new(
                "externalTrafficPolicy Local on an external IP: External copy local only, Internal copy cluster-wide",
                &[
                    "{apiVersion: v1, kind: Service, metadata: {name: web}, \
                     spec: {clusterIP: 10.96.0.10, externalIPs: [203.0.113.5], externalTrafficPolicy: Local, ports: [{name: http, port: 80}]}}",
                    POLICY_SLICE,
                ],
                &[
                    "int 10.96.0.10:80/TCP ClusterIp default/web:http => 10.1.0.1:8080(local) 10.1.0.2:8080 | terminating 10.1.0.3:8080(local)",
                    "int 203.0.113.5:80/TCP ExternalIp default/web:http => 10.1.0.1:8080(local) 10.1.0.2:8080 | terminating 10.1.0.3:8080(local)",
                    "ext 203.0.113.5:80/TCP ExternalIp default/web:http => 10.1.0.1:8080(local) | terminating 10.1.0.3:8080(local)",
                ],
            ),
            Case::new(
                "externalTrafficPolicy Local on a NodePort without local endpoint; node addresses of the Service's family only",
                &[
                    "{apiVersion: v1, kind: Service, metadata: {name: web}, \
                     spec: {type: NodePort, clusterIP: 10.96.0.10, externalTrafficPolicy: Local, ports: [{name: http, port: 80, nodePort: 30080}]}}",
                    POLICY_SLICE,
                ],
                &[
                    "int 10.96.0.10:80/TCP ClusterIp default/web:http => 10.1.0.1:8080 10.1.0.2:8080 | terminating 10.1.0.3:8080",
                    "int 192.168.1.10:30080/TCP NodePort default/web:http => 10.1.0.1:8080 10.1.0.2:8080 | terminating 10.1.0.3:8080",
                    "ext 192.168.1.10:30080/TCP NodePort default/web:http => none",
                ],
            )
            .on(node("node-c", None)),
            Case::new(
                "externalTrafficPolicy Local without any endpoint: the External copy rejects",
                &[
                    "{apiVersion: v1, kind: Service, metadata: {name: web}, \
                     spec: {type: NodePort, clusterIP: 10.96.0.10, externalTrafficPolicy: Local, ports: [{name: http, port: 80, nodePort: 30080}]}}",
                ],
                &[
                    "int 10.96.0.10:80/TCP ClusterIp default/web:http => none",
                    "int 192.168.1.10:30080/TCP NodePort default/web:http => none",
                    "ext 192.168.1.10:30080/TCP NodePort default/web:http => none | reject",
                ],
            ),
            Case::new(
                "LoadBalancer: VIP-mode ingress IPs, Proxy mode and hostnames skipped, bad and other-family IPs rejected",
                &[
                    "{apiVersion: v1, kind: Service, metadata: {name: web}, \
                     spec: {type: LoadBalancer, clusterIP: 10.96.0.10, ports: [{name: http, port: 80, nodePort: 30080}]}, \
                     status: {loadBalancer: {ingress: [{ip: 198.51.100.1, ipMode: VIP}, {ip: 198.51.100.2, ipMode: Proxy}, \
                     {hostname: lb.example.com}, {ip: not-an-ip}, {ip: \"2001:db8::1\"}]}}}",
                    WEB_SLICE,
                ],
                &[
                    WEB_FRONTEND,
                    "int 192.168.1.10:30080/TCP NodePort default/web:http => 10.1.0.1:8080(local) 10.1.0.2:8080",
                    "ext 192.168.1.10:30080/TCP NodePort default/web:http => 10.1.0.1:8080(local) 10.1.0.2:8080",
                    "int 198.51.100.1:80/TCP LoadBalancer default/web:http => 10.1.0.1:8080(local) 10.1.0.2:8080",
                    "ext 198.51.100.1:80/TCP LoadBalancer default/web:http => 10.1.0.1:8080(local) 10.1.0.2:8080",
                ],
            )
            .rejected(&[
                "Service default/web status.loadBalancer.ingress[3].ip",
                "Service default/web status.loadBalancer.ingress[4].ip",
            ]),
            Case::new(
                "loadBalancerSourceRanges restrict the LoadBalancer IPs of their family, in both scopes; \
                 ClusterIP, NodePort and externalIPs stay open",
                &[
                    "{apiVersion: v1, kind: Service, metadata: {name: web}, \
                     spec: {type: LoadBalancer, clusterIPs: [10.96.0.10, \"fd00:96::10\"], ipFamilyPolicy: PreferDualStack, \
                     externalIPs: [203.0.113.5], loadBalancerSourceRanges: [10.0.0.0/8, bogus], \
                     ports: [{name: http, port: 80, nodePort: 30080}]}, \
                     status: {loadBalancer: {ingress: [{ip: 198.51.100.1}, {ip: \"2001:db8::1\"}]}}}",
                    WEB_SLICE,
                ],
                &[
                    WEB_FRONTEND,
                    "int 192.168.1.10:30080/TCP NodePort default/web:http => 10.1.0.1:8080(local) 10.1.0.2:8080",
                    "ext 192.168.1.10:30080/TCP NodePort default/web:http => 10.1.0.1:8080(local) 10.1.0.2:8080",
                    "int 198.51.100.1:80/TCP LoadBalancer default/web:http => 10.1.0.1:8080(local) 10.1.0.2:8080 | source ranges",
                    "ext 198.51.100.1:80/TCP LoadBalancer default/web:http => 10.1.0.1:8080(local) 10.1.0.2:8080 | source ranges",
                    "int 203.0.113.5:80/TCP ExternalIp default/web:http => 10.1.0.1:8080(local) 10.1.0.2:8080",
                    "ext 203.0.113.5:80/TCP ExternalIp default/web:http => 10.1.0.1:8080(local) 10.1.0.2:8080",
                    "int [2001:db8::1]:80/TCP LoadBalancer default/web:http => none",
                    "ext [2001:db8::1]:80/TCP LoadBalancer default/web:http => none | reject",
                    "int [fd00::10]:30080/TCP NodePort default/web:http => none",
                    "ext [fd00::10]:30080/TCP NodePort default/web:http => none | reject",
                    "int [fd00:96::10]:80/TCP ClusterIp default/web:http => none",
                ],
            ),
            Case::new(
                "bad external IPs and traffic policy values rejected",
                &[
                    "{apiVersion: v1, kind: Service, metadata: {name: web}, \
                     spec: {clusterIP: 10.96.0.10, externalIPs: [bogus, \"2001:db8::5\"], externalTrafficPolicy: local, ports: [{name: http, port: 80}]}}",
                ],
                &["int 10.96.0.10:80/TCP ClusterIp default/web:http => none"],
            )
            .rejected(&[
                "Service default/web spec.externalTrafficPolicy",
                "Service default/web spec.externalIPs[0]",
                "Service default/web spec.externalIPs[1]",
            ]),
        ]);
    }

    /// The serving endpoints of a UDP frontend (rendered `| serving ...`
    /// where they differ from the selected ones) are what kube-proxy's UDP
    /// conntrack cleanup keeps: neither traffic policies nor topology hints
    /// narrow them, serving-terminating endpoints are in, endpoints neither
    /// ready nor serving and those of the other family are out.
    #[test]
    fn udp_frontends_keep_every_serving_endpoint() {
        let udp_slice = |address_type: &str, endpoints: &str| {
            format!(
                "{{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, metadata: {{name: dns-{address_type}, labels: {{kubernetes.io/service-name: dns}}}}, \
                 addressType: {address_type}, ports: [{{name: dns, port: 5353, protocol: UDP}}], endpoints: {endpoints}}}"
            )
        };
        let dns = |spec_extra: &str| {
            format!(
                "{{apiVersion: v1, kind: Service, metadata: {{name: dns}}, \
                 spec: {{clusterIP: 10.96.0.53, ports: [{{name: dns, port: 53, protocol: UDP}}]{spec_extra}}}}}"
            )
        };
        // 10.1.0.1 here, 10.1.0.2 elsewhere, 10.1.0.3 serving and
        // terminating, 10.1.0.4 neither ready nor serving.
        let conditions = udp_slice(
            "IPv4",
            "[{addresses: [10.1.0.1], nodeName: node-a}, {addresses: [10.1.0.2], nodeName: node-b}, \
             {addresses: [10.1.0.3], nodeName: node-b, conditions: {ready: false, serving: true, terminating: true}}, \
             {addresses: [10.1.0.4], nodeName: node-b, conditions: {ready: false, serving: false}}]",
        );
        let hinted = udp_slice(
            "IPv4",
            "[{addresses: [10.1.0.1], nodeName: node-a, hints: {forZones: [{name: zone-a}]}}, \
             {addresses: [10.1.0.2], nodeName: node-b, hints: {forZones: [{name: zone-b}]}}]",
        );
        let v6 = udp_slice("IPv6", "[{addresses: [fd00:1::1], nodeName: node-b}]");
        let (cluster, local) = (dns(""), dns(", internalTrafficPolicy: Local"));
        run(vec![
            Case::new(
                "policy Cluster: every serving endpoint is selected",
                &[&cluster, &conditions, &v6],
                &["int 10.96.0.53:53/UDP ClusterIp default/dns:dns => 10.1.0.1:5353(local) 10.1.0.2:5353 | terminating 10.1.0.3:5353"],
            ),
            Case::new(
                "internalTrafficPolicy Local narrows the selection, not the serving ones",
                &[&local, &conditions],
                &["int 10.96.0.53:53/UDP ClusterIp default/dns:dns => 10.1.0.1:5353(local) | serving 10.1.0.1:5353 10.1.0.2:5353 10.1.0.3:5353"],
            ),
            Case::new(
                "internalTrafficPolicy Local with no endpoint here: none selected, all still serving",
                &[&local, &conditions],
                &["int 10.96.0.53:53/UDP ClusterIp default/dns:dns => none | serving 10.1.0.1:5353 10.1.0.2:5353 10.1.0.3:5353"],
            )
            .on(node("node-c", None)),
            Case::new(
                "topology hints narrow the selection, not the serving ones",
                &[&cluster, &hinted],
                &["int 10.96.0.53:53/UDP ClusterIp default/dns:dns => 10.1.0.1:5353(local) | serving 10.1.0.1:5353 10.1.0.2:5353"],
            ),
        ]);
    }

    fn topology_service(metadata_extra: &str, spec_extra: &str) -> String {
        format!(
            "{{apiVersion: v1, kind: Service, metadata: {{name: web{metadata_extra}}}, \
             spec: {{clusterIP: 10.96.0.10, ports: [{{name: http, port: 80}}]{spec_extra}}}}}"
        )
    }

    #[test]
    fn topology() {
        let prefer_close = topology_service("", ", trafficDistribution: PreferClose");
        // 10.1.0.1 (here) and 10.1.0.2 are hinted for zone-a, 10.1.0.3 for
        // zone-b; 10.1.0.4 is not ready, so it needs no hint.
        let zone_hinted = web_slice(
            "[{addresses: [10.1.0.1], nodeName: node-a, hints: {forZones: [{name: zone-a}]}}, \
             {addresses: [10.1.0.2], nodeName: node-b, hints: {forZones: [{name: zone-a}]}}, \
             {addresses: [10.1.0.3], nodeName: node-c, hints: {forZones: [{name: zone-b}]}}, \
             {addresses: [10.1.0.4], nodeName: node-c, conditions: {ready: false}}]",
        );
        let one_unhinted = web_slice(
            "[{addresses: [10.1.0.1], nodeName: node-a, hints: {forZones: [{name: zone-a}]}}, \
             {addresses: [10.1.0.2], nodeName: node-b, hints: {forZones: [{name: zone-a}]}}, \
             {addresses: [10.1.0.3], nodeName: node-c}]",
        );
        let other_zones = web_slice(
            "[{addresses: [10.1.0.1], nodeName: node-a, hints: {forZones: [{name: zone-b}]}}, \
             {addresses: [10.1.0.2], nodeName: node-b, hints: {forZones: [{name: zone-c}]}}, \
             {addresses: [10.1.0.3], nodeName: node-c, hints: {forZones: [{name: zone-b}]}}]",
        );
        // Node hints (PreferSameNode) win over zone hints.
        let node_hinted = web_slice(
            "[{addresses: [10.1.0.1], nodeName: node-a, hints: {forNodes: [{name: node-a}], forZones: [{name: zone-b}]}}, \
             {addresses: [10.1.0.2], nodeName: node-b, hints: {forNodes: [{name: node-b}], forZones: [{name: zone-a}]}}, \
             {addresses: [10.1.0.3], nodeName: node-c, hints: {forNodes: [{name: node-c}], forZones: [{name: zone-a}]}}]",
        );
        // A node hint missing on a ready endpoint: node hints unusable, zone
        // hints still complete.
        let one_without_node_hint = web_slice(
            "[{addresses: [10.1.0.1], nodeName: node-a, hints: {forNodes: [{name: node-a}], forZones: [{name: zone-b}]}}, \
             {addresses: [10.1.0.2], nodeName: node-b, hints: {forNodes: [{name: node-b}], forZones: [{name: zone-a}]}}, \
             {addresses: [10.1.0.3], nodeName: node-c, hints: {forZones: [{name: zone-a}]}}]",
        );
        let no_distribution = topology_service("", "");
        let same_node = topology_service("", ", trafficDistribution: PreferSameNode");
        let mode_disabled_only = topology_service(
            ", annotations: {service.kubernetes.io/topology-mode: Disabled}",
            "",
        );
        let mode_auto = topology_service(
            ", annotations: {service.kubernetes.io/topology-mode: Auto}",
            "",
        );
        let hints_auto = topology_service(
            ", annotations: {service.kubernetes.io/topology-aware-hints: auto}",
            "",
        );
        let mode_disabled = topology_service(", annotations: {service.kubernetes.io/topology-mode: Disabled, service.kubernetes.io/topology-aware-hints: auto}", "");
        let same_zone = topology_service("", ", trafficDistribution: PreferSameZone");
        let itp_local = topology_service(
            "",
            ", trafficDistribution: PreferClose, internalTrafficPolicy: Local",
        );
        let etp_local = topology_service("", ", trafficDistribution: PreferClose, externalIPs: [203.0.113.5], externalTrafficPolicy: Local");
        let etp_cluster = topology_service(
            "",
            ", trafficDistribution: PreferClose, externalIPs: [203.0.113.5]",
        );

        let all = "int 10.96.0.10:80/TCP ClusterIp default/web:http => 10.1.0.1:8080(local) 10.1.0.2:8080 10.1.0.3:8080";
        let zone_a = "int 10.96.0.10:80/TCP ClusterIp default/web:http => 10.1.0.1:8080(local) 10.1.0.2:8080";
        let here = "int 10.96.0.10:80/TCP ClusterIp default/web:http => 10.1.0.1:8080(local)";
        // The frontends of etp_local and etp_cluster: the cluster IP's, then
        // the external IP's Internal and External copies.
        let etp = |internal: &str, external: &str| {
            [
                format!("int 10.96.0.10:80/TCP ClusterIp default/web:http => {internal}"),
                format!("int 203.0.113.5:80/TCP ExternalIp default/web:http => {internal}"),
                format!("ext 203.0.113.5:80/TCP ExternalIp default/web:http => {external}"),
            ]
        };
        run(vec![
            Case::new("trafficDistribution PreferClose: zone hints used", &[&prefer_close, &zone_hinted], &[zone_a]),
            Case::new("trafficDistribution PreferSameZone: zone hints used", &[&same_zone, &zone_hinted], &[zone_a]),
            Case::new("annotation topology-mode Auto: zone hints used", &[&mode_auto, &zone_hinted], &[zone_a]),
            Case::new("deprecated annotation topology-aware-hints auto: zone hints used", &[&hints_auto, &zone_hinted], &[zone_a]),
            // Current kube-proxy reads hints, not the Service: the
            // EndpointSlice controller writes them only when asked to, and
            // removes them on an opt-out.
            Case::new("no trafficDistribution nor annotation: zone hints used", &[&no_distribution, &zone_hinted], &[zone_a]),
            Case::new("topology-mode Disabled: zone hints used all the same", &[&mode_disabled_only, &zone_hinted], &[zone_a]),
            Case::new("topology-mode Disabled over the deprecated annotation: zone hints used", &[&mode_disabled, &zone_hinted], &[zone_a]),
            Case::new("trafficDistribution PreferSameNode: node hints used", &[&same_node, &node_hinted], &[here]),
            Case::new("no trafficDistribution: node hints used", &[&no_distribution, &node_hinted], &[here]),
            Case::new("topology-mode Disabled: node hints used all the same", &[&mode_disabled_only, &node_hinted], &[here]),
            Case::new(
                "PreferSameNode, a ready endpoint without node hint: zone hints used",
                &[&same_node, &one_without_node_hint],
                &["int 10.96.0.10:80/TCP ClusterIp default/web:http => 10.1.0.2:8080 10.1.0.3:8080"],
            ),
            Case::new(
                "PreferSameNode, no node hint for this node: zone hints used",
                &[&same_node, &node_hinted],
                &["int 10.96.0.10:80/TCP ClusterIp default/web:http => 10.1.0.2:8080 10.1.0.3:8080"],
            )
            .on(node("node-z", Some("zone-a"))),
            Case::new("PreferSameNode on a node without name or zone: hints ignored", &[&same_node, &node_hinted], &[
                "int 10.96.0.10:80/TCP ClusterIp default/web:http => 10.1.0.1:8080 10.1.0.2:8080 10.1.0.3:8080",
            ])
            .on(node("", None)),
            Case::new("a ready endpoint without hint: hints ignored", &[&prefer_close, &one_unhinted], &[all]),
            Case::new("no endpoint for our zone: hints ignored", &[&prefer_close, &other_zones], &[all]),
            Case::new("node without zone: hints ignored", &[&prefer_close, &zone_hinted], &[all]).on(node("node-a", None)),
            Case::new("node hints for this node win over zone hints", &[&prefer_close, &node_hinted], &[here]),
            Case::new(
                "node hints without one for this node: zone hints used",
                &[&prefer_close, &node_hinted],
                &["int 10.96.0.10:80/TCP ClusterIp default/web:http => 10.1.0.2:8080 10.1.0.3:8080"],
            )
            .on(node("node-z", Some("zone-a"))),
            Case::new("internalTrafficPolicy Local: topology not applied", &[&itp_local, &other_zones], &[here]),
            Case::new(
                "externalTrafficPolicy Local: topology on the cluster-wide frontends only",
                &[&etp_local, &node_hinted],
                &etp("10.1.0.2:8080(local)", "10.1.0.2:8080(local)"),
            )
            .on(node("node-b", Some("zone-b"))),
            Case::new(
                "externalTrafficPolicy Cluster: topology on the External frontend too",
                &[&etp_cluster, &zone_hinted],
                &etp("10.1.0.1:8080(local) 10.1.0.2:8080", "10.1.0.1:8080(local) 10.1.0.2:8080"),
            ),
            Case::new(
                "externalTrafficPolicy Local keeps a local endpoint hinted for another zone",
                &[&etp_local, &other_zones],
                &etp("10.1.0.1:8080 10.1.0.3:8080", "10.1.0.2:8080(local)"),
            )
            .on(node("node-b", Some("zone-b"))),
        ]);
    }

    #[test]
    fn vips() {
        let store = store(&[
            WEB,
            "{apiVersion: v1, kind: Service, metadata: {name: dual}, spec: {clusterIPs: [10.96.0.11, \"fd00:96::11\"]}}",
            "{apiVersion: v1, kind: Service, metadata: {name: lb}, spec: {type: LoadBalancer, clusterIP: 10.96.0.12, \
             externalIPs: [203.0.113.5], ports: [{port: 80, nodePort: 30080}]}, status: {loadBalancer: {ingress: [{ip: 198.51.100.1}]}}}",
            "{apiVersion: v1, kind: Service, metadata: {name: headless}, spec: {clusterIP: None}}",
            "{apiVersion: v1, kind: Service, metadata: {name: b, labels: {service.kubernetes.io/service-proxy-name: x}}, spec: {clusterIP: 10.96.0.13}}",
        ]);
        let opts = TranslateOptions {
            node_addresses: vec!["192.168.1.10".parse().unwrap()],
            ..Default::default()
        };
        let (state, rejections) = translate(&store, &node_a(), &opts);
        assert!(rejections.is_empty(), "{rejections:?}");
        let want: BTreeSet<(IpAddr, Scope)> =
            ["10.96.0.10", "10.96.0.11", "fd00:96::11", "10.96.0.12"]
                .iter()
                .map(|ip| (ip.parse().unwrap(), Scope::Internal))
                .collect();
        assert_eq!(state.vips, want);
    }

    #[test]
    fn frontend_state_fields() {
        let store = store(&[
            "{apiVersion: v1, kind: Service, metadata: {name: web, namespace: shop, \
             annotations: {lb-agent.dev/lb-algorithm: maglev, lb-agent.dev/outlier-detection: dry-run}}, \
             spec: {clusterIP: 10.96.0.10, ports: [{name: http, port: 80, protocol: UDP}], sessionAffinity: ClientIP}}",
            "{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, metadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}, \
             addressType: IPv4, ports: [{name: http, port: 8080, protocol: UDP}], endpoints: [{addresses: [10.1.0.1], nodeName: node-a}]}",
        ]);
        let (state, _) = translate(&store, &node_a(), &TranslateOptions::default());
        let frontend = Frontend {
            addr: "10.96.0.10".parse().unwrap(),
            port: 80,
            protocol: Protocol::Udp,
            scope: Scope::Internal,
        };
        let backend = BackendRef {
            backend: BackendAddr {
                addr: "10.1.0.1".parse().unwrap(),
                port: 8080,
                protocol: Protocol::Udp,
            },
            local: true,
        };
        assert_eq!(
            *state.frontends[&frontend],
            FrontendState {
                service: ServiceName {
                    namespace: "shop".into(),
                    name: "web".into(),
                },
                port_name: "http".into(),
                kind: FrontendKind::ClusterIp,
                active: vec![backend],
                terminating: vec![],
                serving: vec![backend.backend],
                affinity_timeout: Some(DEFAULT_AFFINITY_TIMEOUT),
                selection: Selection::Cluster,
                algorithm: Algorithm::Maglev,
                reject: false,
                source_ranges: false,
                outlier: OutlierMode::DryRun,
            }
        );
    }

    /// SCTP: nothing is served (no socket hook runs for SCTP sockets, the
    /// tc path does not rewrite SCTP), every frontend a port asks for is
    /// reported, once per scope it would have, with the field it comes
    /// from; one rejection per port names them.
    #[test]
    fn sctp_ports_are_reported_never_served() {
        const SIG_SLICE: &str = "{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, \
            metadata: {name: sig-1, labels: {kubernetes.io/service-name: sig}}, addressType: IPv4, \
            ports: [{name: sig, port: 8080, protocol: SCTP}, {name: http, port: 8080}], \
            endpoints: [{addresses: [10.1.0.1], nodeName: node-a}]}";
        run(vec![
            Case::new(
                "ClusterIP: the SCTP port reported, the TCP port of the same number served",
                &[
                    "{apiVersion: v1, kind: Service, metadata: {name: sig}, spec: {clusterIP: 10.96.0.30, \
                     ports: [{name: sig, port: 80, protocol: SCTP, targetPort: 8080}, {name: http, port: 80, targetPort: 8080}]}}",
                    SIG_SLICE,
                ],
                &["int 10.96.0.30:80/TCP ClusterIp default/sig:http => 10.1.0.1:8080(local)"],
            )
            .rejected(&["Service default/sig spec.ports[0].protocol"])
            .not_served(&["int 10.96.0.30:80/SCTP ClusterIp default/sig:sig spec.clusterIP"]),
            Case::new(
                "an SCTP-only Service: no frontend programmed, the SCTP one reported",
                &["{apiVersion: v1, kind: Service, metadata: {name: sig}, spec: {clusterIP: 10.96.0.30, \
                   ports: [{name: sig, port: 80, protocol: SCTP}]}}"],
                NONE,
            )
            .rejected(&["Service default/sig spec.ports[0].protocol"])
            .not_served(&["int 10.96.0.30:80/SCTP ClusterIp default/sig:sig spec.clusterIP"]),
            Case::new(
                "dual-stack, NodePort, LoadBalancer IP and externalIP: each address, both scopes where it has two",
                &[
                    "{apiVersion: v1, kind: Service, metadata: {name: sig}, spec: {type: LoadBalancer, \
                     clusterIPs: [10.96.0.30, 'fd00::30'], externalIPs: [192.0.2.50], \
                     ports: [{name: sig, port: 80, protocol: SCTP, nodePort: 30080}]}, \
                     status: {loadBalancer: {ingress: [{ip: 203.0.113.7}]}}}",
                    SIG_SLICE,
                ],
                NONE,
            )
            .rejected(&["Service default/sig spec.ports[0].protocol"])
            .not_served(&[
                "int 10.96.0.30:80/SCTP ClusterIp default/sig:sig spec.clusterIPs[0]",
                "int [fd00::30]:80/SCTP ClusterIp default/sig:sig spec.clusterIPs[1]",
                "ext 192.168.1.10:30080/SCTP NodePort default/sig:sig spec.ports[0].nodePort",
                "int 192.168.1.10:30080/SCTP NodePort default/sig:sig spec.ports[0].nodePort",
                "ext [fd00::10]:30080/SCTP NodePort default/sig:sig spec.ports[0].nodePort",
                "int [fd00::10]:30080/SCTP NodePort default/sig:sig spec.ports[0].nodePort",
                "ext 203.0.113.7:80/SCTP LoadBalancer default/sig:sig status.loadBalancer.ingress[0].ip",
                "int 203.0.113.7:80/SCTP LoadBalancer default/sig:sig status.loadBalancer.ingress[0].ip",
                "ext 192.0.2.50:80/SCTP ExternalIp default/sig:sig spec.externalIPs[0]",
                "int 192.0.2.50:80/SCTP ExternalIp default/sig:sig spec.externalIPs[0]",
            ]),
            Case::new(
                "--external-clusterip: the ClusterIP's external scope too",
                &["{apiVersion: v1, kind: Service, metadata: {name: sig}, spec: {clusterIP: 10.96.0.30, \
                   ports: [{name: sig, port: 80, protocol: SCTP}]}}"],
                NONE,
            )
            .external_cluster_ip()
            .rejected(&["Service default/sig spec.ports[0].protocol"])
            .not_served(&[
                "int 10.96.0.30:80/SCTP ClusterIp default/sig:sig spec.clusterIP",
                "ext 10.96.0.30:80/SCTP ClusterIp default/sig:sig spec.clusterIP",
            ]),
            Case::new(
                "an externalIP refused by --allowed-external-ip-cidrs is not reported as not served",
                &["{apiVersion: v1, kind: Service, metadata: {name: sig}, spec: {clusterIP: 10.96.0.30, \
                   externalIPs: [192.0.2.50], ports: [{name: sig, port: 80, protocol: SCTP}]}}"],
                NONE,
            )
            .allowed_external_ips(&["10.0.0.0/8"])
            .rejected(&[
                "Service default/sig spec.externalIPs[0]",
                "Service default/sig spec.ports[0].protocol",
            ])
            .not_served(&["int 10.96.0.30:80/SCTP ClusterIp default/sig:sig spec.clusterIP"]),
            Case::new(
                "an SCTP port with an invalid number: rejected for it, nothing reported",
                &["{apiVersion: v1, kind: Service, metadata: {name: sig}, spec: {clusterIP: 10.96.0.30, \
                   ports: [{name: sig, port: 70000, protocol: SCTP}]}}"],
                NONE,
            )
            .rejected(&["Service default/sig spec.ports[0].port"]),
            Case::new(
                "headless, ExternalName and another proxy's: nothing reported",
                &[
                    "{apiVersion: v1, kind: Service, metadata: {name: h}, spec: {clusterIP: None, \
                     ports: [{port: 80, protocol: SCTP}]}}",
                    "{apiVersion: v1, kind: Service, metadata: {name: x}, spec: {type: ExternalName, \
                     externalName: example.com, ports: [{port: 80, protocol: SCTP}]}}",
                    "{apiVersion: v1, kind: Service, metadata: {name: o, labels: {service.kubernetes.io/service-proxy-name: other}}, \
                     spec: {clusterIP: 10.96.0.31, ports: [{port: 80, protocol: SCTP}]}}",
                ],
                NONE,
            ),
        ]);
    }

    #[test]
    fn outlier_annotation_rejection_names_the_service_and_field() {
        let store = store(&[
            "{apiVersion: v1, kind: Service, metadata: {name: web, namespace: shop, \
             annotations: {lb-agent.dev/outlier-detection: dryrun}}, spec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}}",
        ]);
        let opts = TranslateOptions {
            default_outlier: OutlierMode::DryRun,
            ..Default::default()
        };
        let (state, rejections) = translate(&store, &node_a(), &opts);
        let got: Vec<String> = rejections.iter().map(ToString::to_string).collect();
        assert_eq!(
            got,
            [
                "translate: Service shop/web: metadata.annotations[lb-agent.dev/outlier-detection]: \
                 unknown outlier detection mode \"dryrun\", expected one of off, dry-run, on; using the node's, dry-run"
            ]
        );
        let modes: Vec<OutlierMode> = state.frontends.values().map(|s| s.outlier).collect();
        assert_eq!(modes, [OutlierMode::DryRun]);
    }

    #[test]
    fn rejection_messages() {
        let store = store(&[
            "{apiVersion: v1, kind: Service, metadata: {name: web}, spec: {clusterIP: 10.96.0.10, \
             ports: [{name: a, port: 70000}, {name: s, port: 9, protocol: SCTP}]}}",
        ]);
        let (_, rejections) = translate(&store, &node_a(), &TranslateOptions::default());
        let got: Vec<String> = rejections.iter().map(ToString::to_string).collect();
        assert_eq!(
            got,
            [
                "translate: Service default/web: spec.ports[0].port: 70000 is outside 1..65535",
                "translate: Service default/web: spec.ports[1].protocol: SCTP is not served (Linux runs no connect or sendmsg hook \
                 for SCTP sockets, and the tc path does not rewrite SCTP): ClusterIP 10.96.0.10:9/SCTP left alone",
            ]
        );
    }

    /// A small deterministic generator (xorshift64*), so that a failure
    /// replays.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: usize) -> usize {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n
        }

        fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
            items[self.below(items.len())]
        }
    }

    /// One random object as a YAML document, from a small pool of names and
    /// addresses so that edits collide: shared cluster IPs, slices moving
    /// between Services, Endpoints and slices for the same Service.
    fn random_object(rng: &mut Rng) -> (u8, String, Option<String>) {
        let kind = rng.below(3) as u8;
        let ns = rng.pick(&["a", "b"]);
        let name = rng.pick(&["s0", "s1", "s2", "s3"]);
        if rng.below(5) == 0 {
            return (kind, format!("{ns}/{name}"), None);
        }
        let doc = match kind {
            0 => {
                let ip = rng.pick(&["10.96.0.1", "10.96.0.2", "10.96.0.3", "None", "fd00::1"]);
                let port = rng.pick(&["80", "81"]);
                let proto = rng.pick(&["TCP", "UDP", "SCTP"]);
                let extra = rng.pick(&[
                    "",
                    ", type: NodePort",
                    ", externalIPs: [192.0.2.1]",
                    // Contested with another's ClusterIP or NodePort.
                    ", externalIPs: [10.96.0.2]",
                    ", externalIPs: [192.168.1.10]",
                    ", internalTrafficPolicy: Local",
                    ", sessionAffinity: ClientIP",
                ]);
                let node_port = if extra.contains("NodePort") {
                    rng.pick(&[", nodePort: 30080", ", nodePort: 80"])
                } else {
                    ""
                };
                let labels = rng.pick(&[
                    "",
                    ", labels: {service.kubernetes.io/service-proxy-name: other}",
                ]);
                let created = rng.pick(&[
                    "",
                    ", creationTimestamp: '2024-01-01T00:00:00Z'",
                    ", creationTimestamp: '2024-01-02T00:00:00Z'",
                ]);
                format!(
                    "{{apiVersion: v1, kind: Service, metadata: {{name: {name}, namespace: {ns}{labels}{created}}}, \
                     spec: {{clusterIP: '{ip}'{extra}, ports: [{{name: p, port: {port}, protocol: {proto}{node_port}}}]}}}}"
                )
            }
            1 => {
                let service = rng.pick(&["s0", "s1", "s2", "s3", ""]);
                let addr = rng.pick(&["10.1.0.1", "10.1.0.2", "bad"]);
                let node = rng.pick(&["node-a", "node-b"]);
                let ready = rng.pick(&["true", "false"]);
                format!(
                    "{{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, \
                     metadata: {{name: {name}-x, namespace: {ns}, labels: {{kubernetes.io/service-name: '{service}'}}}}, \
                     addressType: IPv4, ports: [{{name: p, port: 8080, protocol: TCP}}, {{name: p, port: 8080, protocol: UDP}}], \
                     endpoints: [{{addresses: [{addr}], nodeName: {node}, conditions: {{ready: {ready}, serving: true, terminating: true}}}}]}}"
                )
            }
            _ => {
                let addr = rng.pick(&["10.2.0.1", "10.2.0.2"]);
                format!(
                    "{{apiVersion: v1, kind: Endpoints, metadata: {{name: {name}, namespace: {ns}}}, \
                     subsets: [{{addresses: [{{ip: {addr}}}], ports: [{{name: p, port: 9090, protocol: TCP}}]}}]}}"
                )
            }
        };
        (kind, format!("{ns}/{name}"), Some(doc))
    }

    /// Split over threads, the translation is the same as on one, conflicts
    /// across the parts included.
    #[test]
    fn parallel_translation_equals_sequential() {
        let mut docs = Vec::new();
        for i in 0..1000 {
            // Every 7th Service takes the cluster IP of one far before it.
            let ip = if i % 7 == 0 { i / 3 } else { i };
            docs.push(format!(
                "{{apiVersion: v1, kind: Service, metadata: {{name: s{i:04}}}, \
                 spec: {{clusterIP: 10.96.{}.{}, ports: [{{name: p, port: 80}}]}}}}",
                ip / 256,
                ip % 256
            ));
            docs.push(format!(
                "{{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, \
                 metadata: {{name: s{i:04}-1, labels: {{kubernetes.io/service-name: s{i:04}}}}}, \
                 addressType: IPv4, ports: [{{name: p, port: 8080}}], endpoints: [{{addresses: [10.1.{}.{}]}}]}}",
                i / 256,
                i % 256
            ));
        }
        let docs: Vec<&str> = docs.iter().map(String::as_str).collect();
        let store = store(&docs);
        let opts = TranslateOptions::default();
        let (mut one, mut four) = (Translator::default(), Translator::default());
        one.full_on(&store, &node_a(), &opts, 1);
        four.full_on(&store, &node_a(), &opts, 4);
        assert_eq!(one.state(), four.state());
        assert_eq!(one.rejections(), four.rejections());
        // Some Services lost their cluster IP to an earlier one.
        assert!(one.state().frontends.len() < 1000);
        assert!(!one.rejections().is_empty());
    }

    /// A full translation again (the periodic resync) takes the previous
    /// state of every unchanged frontend, which the reconciler still holds,
    /// rather than a second copy; a changed frontend gets a new one.
    #[test]
    fn full_translation_again_shares_unchanged_states() {
        let web = |ip: &str| {
            store(&[
                "{apiVersion: v1, kind: Service, metadata: {name: web}, spec: {clusterIP: 10.96.0.10, ports: [{name: http, port: 80}]}}",
                "{apiVersion: v1, kind: Service, metadata: {name: api}, spec: {clusterIP: 10.96.0.11, ports: [{name: http, port: 80}]}}",
                &format!(
                    "{{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, \
                     metadata: {{name: web-1, labels: {{kubernetes.io/service-name: web}}}}, \
                     addressType: IPv4, ports: [{{name: http, port: 8080}}], endpoints: [{{addresses: [{ip}]}}]}}"
                ),
                "{apiVersion: discovery.k8s.io/v1, kind: EndpointSlice, \
                 metadata: {name: api-1, labels: {kubernetes.io/service-name: api}}, \
                 addressType: IPv4, ports: [{name: http, port: 8080}], endpoints: [{addresses: [10.1.0.2]}]}",
            ])
        };
        let opts = TranslateOptions::default();
        let frontend = |ip: &str| Frontend {
            addr: ip.parse().unwrap(),
            port: 80,
            protocol: Protocol::Tcp,
            scope: Scope::Internal,
        };
        let (web_f, api_f) = (frontend("10.96.0.10"), frontend("10.96.0.11"));
        let mut translator = Translator::default();
        translator.full(&web("10.1.0.1"), &node_a(), &opts);
        // What the reconciler keeps of the first sync.
        let programmed = translator.state().clone();
        assert_eq!(programmed.frontends.len(), 2);

        translator.full(&web("10.1.0.1"), &node_a(), &opts);
        assert_eq!(*translator.state(), programmed);
        for f in [web_f, api_f] {
            assert!(
                Arc::ptr_eq(&translator.state().frontends[&f], &programmed.frontends[&f]),
                "{f}: a second copy of an unchanged state"
            );
        }

        translator.full(&web("10.1.0.9"), &node_a(), &opts);
        let now = &translator.state().frontends;
        assert!(Arc::ptr_eq(&now[&api_f], &programmed.frontends[&api_f]));
        assert_ne!(now[&web_f], programmed.frontends[&web_f]);
    }

    /// Random edit sequences: after each, the incremental translation
    /// equals a full one, and every frontend that changed was reported.
    #[test]
    fn incremental_equals_full() {
        let opts = TranslateOptions {
            node_addresses: vec!["192.168.1.10".parse().unwrap()],
            ..Default::default()
        };
        let (mut partial, mut conflicts) = (0, 0);
        for seed in 1..=40u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
            let mut store = Store::default();
            let mut translator = Translator::default();
            let mut node = node_a();
            translator.full(&store, &node, &opts);
            for step in 0..60 {
                let mut changes = Changes::default();
                for _ in 0..=rng.below(3) {
                    let (kind, key, doc) = random_object(&mut rng);
                    let (ns, name) = key.split_once('/').unwrap();
                    let key = ObjectKey::new(ns, name);
                    let object = doc.map(|doc| load_str("t.yaml", &doc, Format::Yaml).0);
                    match kind {
                        0 => {
                            store.services.remove(&key);
                            if let Some(o) = object {
                                store.services.extend(o.services);
                            }
                            changes.services.insert(key);
                        }
                        1 => {
                            let key = ObjectKey::new(ns, format!("{name}-x"));
                            store.slices.remove(&key);
                            if let Some(o) = object {
                                store.slices.extend(o.slices);
                            }
                            changes.slices.insert(key);
                        }
                        _ => {
                            store.endpoints.remove(&key);
                            if let Some(o) = object {
                                store.endpoints.extend(o.endpoints);
                            }
                            changes.endpoints.insert(key);
                        }
                    }
                }
                if rng.below(20) == 0 {
                    node.name = rng.pick(&["node-a", "node-b"]).into();
                }
                let before = translator.state().clone();
                let update = translator.update(&store, &changes, &node, &opts);
                let mut full = Translator::default();
                full.full(&store, &node, &opts);
                let (want, want_rejections) = (full.state(), full.rejections());
                let at = format!("seed {seed} step {step}");
                assert_eq!(translator.state(), want, "{at}: state");
                assert_eq!(translator.rejections(), want_rejections, "{at}: rejections");
                assert_eq!(
                    translator.not_served().collect::<Vec<_>>(),
                    full.not_served().collect::<Vec<_>>(),
                    "{at}: not served"
                );
                if want_rejections
                    .iter()
                    .any(|r| r.reason.contains("claimed by"))
                {
                    conflicts += 1;
                }
                if !update.full {
                    partial += 1;
                    let frontends: BTreeSet<&Frontend> = before
                        .frontends
                        .keys()
                        .chain(want.frontends.keys())
                        .collect();
                    for f in frontends {
                        if before.frontends.get(f) != want.frontends.get(f) {
                            assert!(update.touched.contains(f), "{at}: {f} changed unreported");
                        }
                    }
                }
            }
        }
        // Both paths and conflicts were exercised.
        assert!(partial > 1000 && conflicts > 100, "{partial} {conflicts}");
    }
}
