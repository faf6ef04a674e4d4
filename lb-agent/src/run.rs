//! `lb-agent run`: load (or adopt) the datapath, then keep the maps in sync
//! with the manifests directory or the Kubernetes API until a signal.
use std::{
    collections::{BTreeSet, HashMap},
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::{bail, Context as _};
use notify::{RecommendedWatcher, RecursiveMode, Watcher as _};
use prometheus_client::metrics::{counter::Counter, gauge::Gauge};
use tokio::{signal::unix::SignalKind, sync::mpsc, time::Instant};

use crate::{
    base::metrics::{MapLabel, Metrics, NotServedLabel, ReasonLabel, RejectLabel},
    cli::{NorthSouthArgs, RunArgs},
    datapath::features::KernelFeatures,
    datapath::loader::Capacity,
    datapath::loader::{self, Datapath, Refusal},
    datapath::reconcile::Reconciler,
    input::manifest,
    input::store::{Changes, Rejection, Store},
    input::watch::{self, ApiAccess, SharedState},
    semantics::health::node_eligible,
    semantics::model::{Algorithm, Cidr, Frontend},
    semantics::northsouth,
    semantics::service_cidr,
    semantics::translate::{TranslateOptions, Translator},
    serve::health::{self, ProxyHealthHandle, Readiness},
    serve::healthcheck::{Bind, HealthCheckServers},
};

/// How long a replaced backend set stays readable after the switch. A
/// program holds a `ServiceValue` for well under a microsecond; this is
/// margin, not a guess at that time.
const RETIRE_DELAY: Duration = Duration::from_millis(50);
/// A full re-translation even without events, in case one was missed.
const RESYNC_PERIOD: Duration = Duration::from_secs(30);

fn hostname() -> anyhow::Result<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .context("reading the hostname; pass --node-name")?;
    Ok(name.trim().to_owned())
}

/// Raises the soft open-file limit to the hard one. 1 024, a common
/// default, runs out with a few hundred health probes and manifest files
/// open; what then fails to open is reported and retried, never taken for
/// "no objects", but better it does not fail.
fn raise_open_file_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => tracing::info!(from = soft, to = hard, "open-file limit raised"),
            Err(e) => tracing::warn!(soft, hard, "raising the open-file limit: {e}"),
        },
        Ok(_) => {}
        Err(e) => tracing::warn!("reading the open-file limit: {e}"),
    }
}

/// `LB_BACKEND_STATE` mapped, for the flow counts' corrections; `None`
/// (and a warning) where it cannot be.
fn open_backend_states(
    pin_dir: &std::path::Path,
) -> Option<crate::datapath::backend_state::BackendStates> {
    let why = match aya::maps::MapData::from_pin(pin_dir.join(lb_common::map_names::BACKEND_STATE))
    {
        Ok(map) => match crate::datapath::backend_state::BackendStates::map(&map) {
            Ok(Some(states)) => return Some(states),
            Ok(None) => "it was created without BPF_F_MMAPABLE".to_string(),
            Err(e) => e.to_string(),
        },
        Err(e) => e.to_string(),
    };
    tracing::warn!(
        "mapping LB_BACKEND_STATE: {why}; flows (the tc path's, UDP sockets') are not taken back from lc, sed and nq's counts"
    );
    None
}

/// Warns once of each Service that dh (destination hashing) serves: it
/// sends every connection to a frontend to one backend, which is what
/// the ipvs mode did but rarely what a Service wants; says when one no
/// longer is.
fn warn_of_dh(
    warned: &mut BTreeSet<crate::semantics::model::ServiceName>,
    desired: &crate::semantics::model::DesiredState,
) {
    let now: BTreeSet<_> = desired
        .frontends
        .values()
        .filter(|f| f.algorithm == Algorithm::Dh)
        .map(|f| f.service.clone())
        .collect();
    if now == *warned {
        return;
    }
    for s in now.difference(warned) {
        tracing::warn!(
            service = %s,
            "Service {s} is served with dh (destination hashing): every connection to one of its frontends goes to one backend"
        );
    }
    for s in warned.difference(&now) {
        tracing::info!(service = %s, "Service {s} is no longer served with dh");
    }
    *warned = now;
}

/// Where a rejection was found: the input (manifest files), translation,
/// or the north-south inputs (source ranges).
const ORIGINS: usize = 3;
const FROM_INPUT: usize = 0;
const FROM_TRANSLATION: usize = 1;
const FROM_NORTH_SOUTH: usize = 2;

/// Logs each distinct problem once, and when it goes away. An origin's
/// problems are looked at only when its version moved: many rejected
/// objects cost nothing in a sync that changes none of them.
#[derive(Default)]
struct ProblemLog {
    origins: [SeenProblems; ORIGINS],
}

#[derive(Default)]
struct SeenProblems {
    version: Option<u64>,
    /// Each problem, and how many times it was reported.
    seen: HashMap<Rejection, u32>,
    /// How many per metric label.
    by_field: HashMap<RejectLabel, i64>,
}

impl ProblemLog {
    /// Takes the problems of `origin` at `version`, if that moved (`now`
    /// is not called otherwise); `show` says how a new one is logged.
    /// Whether they changed.
    fn update<'a, I: Iterator<Item = &'a Rejection>>(
        &mut self,
        origin: usize,
        version: u64,
        now: impl FnOnce() -> I,
        show: impl Fn(&Rejection) -> String,
    ) -> bool {
        let o = &mut self.origins[origin];
        if o.version == Some(version) {
            return false;
        }
        o.version = Some(version);
        let mut seen: HashMap<Rejection, u32> = HashMap::with_capacity(o.seen.len());
        for r in now() {
            match seen.get_mut(r) {
                Some(n) => *n += 1,
                None => {
                    if !o.seen.contains_key(r) {
                        tracing::warn!("skipped: {}", show(r));
                    }
                    seen.insert(r.clone(), 1);
                }
            }
        }
        for r in o.seen.keys().filter(|r| !seen.contains_key(*r)) {
            tracing::info!("resolved: {}", show(r));
        }
        let changed = seen != o.seen;
        if changed {
            o.by_field.clear();
            for (r, n) in &seen {
                *o.by_field.entry(RejectLabel::of(&r.field)).or_default() += i64::from(*n);
            }
        }
        o.seen = seen;
        changed
    }

    /// How many problems, repeats counted.
    fn total(&self) -> usize {
        self.origins
            .iter()
            .flat_map(|o| o.seen.values())
            .map(|n| *n as usize)
            .sum()
    }

    /// How many per metric label, over every origin.
    fn by_field(&self) -> HashMap<&RejectLabel, i64> {
        let mut out: HashMap<&RejectLabel, i64> = HashMap::new();
        for (label, n) in self.origins.iter().flat_map(|o| o.by_field.iter()) {
            *out.entry(label).or_default() += n;
        }
        out
    }
}

/// Where the objects come from. Both feed the same translation.
enum Source {
    Manifests {
        /// The files as last read; a sync re-reads only those that changed.
        dir: Box<manifest::ManifestDir>,
        /// Kept alive for its events.
        _watcher: RecommendedWatcher,
    },
    Cluster(SharedState),
}

impl Source {
    /// Runs `f` on the current objects and which of them changed since the
    /// last call (`None`: not known).
    fn with_store<R>(&mut self, f: impl FnOnce(&Store, Option<Changes>) -> R) -> R {
        match self {
            Source::Manifests { dir, .. } => {
                let changes = dir.refresh();
                f(dir.store(), Some(changes))
            }
            Source::Cluster(state) => {
                let mut state = state.lock().expect("cluster state lock");
                let changes = state.take_changes();
                f(&state.store, changes)
            }
        }
    }

    /// Whether a sync now would program a complete picture.
    fn complete(&self) -> bool {
        match self {
            Source::Manifests { .. } => true,
            Source::Cluster(state) => state.lock().expect("cluster state lock").all_listed(),
        }
    }
}

struct Syncer {
    source: Source,
    /// Where the programs are attached: the pods whose sockets we serve.
    cgroup: PathBuf,
    node_name: String,
    algorithm: Algorithm,
    /// `--outlier-detection`: the most a Service's annotation may ask for.
    outlier_mode: crate::semantics::model::OutlierMode,
    /// The other `--outlier-*` options, written to `LB_TC_CONFIG`.
    outlier: crate::datapath::tc::OutlierSettings,
    capacity: Capacity,
    datapath: Datapath,
    reconciler: Reconciler,
    /// The translation, kept so that a change re-translates only the
    /// Services it touches.
    translator: Translator,
    /// The north-south inputs of the last sync, reused while nothing changed:
    /// they look at every Service.
    north_south_cache: Option<NorthSouthInputs>,
    problems: ProblemLog,
    /// The Services served with dh now, each warned about once.
    dh_services: BTreeSet<crate::semantics::model::ServiceName>,
    /// The backends' flow counts (`BackendState::flows`), corrected after
    /// each sweep; `None` where `LB_BACKEND_STATE` cannot be mapped.
    backend_states: Option<crate::datapath::backend_state::BackendStates>,
    /// Outlier detection's quarantines, as last reported.
    quarantines: crate::datapath::outlier::QuarantineWatch,
    metrics: Metrics,
    north_south: NorthSouthArgs,
    /// `--service-cluster-ip-range`, joined with the `ServiceCIDR`s.
    service_cluster_ip_range: Vec<Cidr>,
    /// The guarded Service CIDRs and their problems as last logged, so
    /// that a change is logged once, not at every sync.
    service_cidrs_logged: service_cidr::Guarded,
    /// The tc maps; `None` when they could not be opened (logged).
    tc: Option<crate::datapath::tc::TcMaps>,
    /// How the tc programs attach; `None` with `--no-tc`.
    tc_attach: Option<crate::datapath::devices::AttachMode>,
    /// `--acceleration`: the XDP stage on the same devices.
    acceleration: crate::datapath::devices::Acceleration,
    /// Devices the tc programs are asked for; `None` before the first sync.
    tc_devices: Option<Vec<String>>,
    /// Each of them as the last attach left it (at a change of them, or a
    /// sweep's check).
    tc_status: std::collections::BTreeMap<String, crate::datapath::devices::DeviceStatus>,
    /// What the tc path lacks, as last told to `/readyz`.
    tc_lack: Option<String>,
    ready: Readiness,
    health_checks: HealthCheckServers,
    /// As last told to `health`.
    node_eligible: bool,
    /// Told when a sync succeeds, and whether the Node is being deleted.
    health: ProxyHealthHandle,
    /// Cluster mode: when the watches started, until the first sync of a
    /// complete picture says how long the API's objects took to reach the
    /// maps (lists, decoding, translation and writes).
    watching_since: Option<Instant>,
}

/// Source ranges (with their rejections) and health checks, as of a sync.
struct NorthSouthInputs {
    net: NodeNet,
    ranges: std::collections::BTreeMap<Frontend, Vec<Cidr>>,
    rejections: Vec<Rejection>,
    /// Moves when `rejections` change.
    rejections_version: u64,
    checks: Vec<northsouth::HealthCheck>,
}

/// What the tc path and NodePorts need to know about this node.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct NodeNet {
    /// Devices that get the tc programs.
    devices: Vec<String>,
    /// The Node object's addresses, which select the devices without
    /// `--devices`.
    node_ips: Vec<std::net::IpAddr>,
    /// Addresses NodePorts are served on (after `--nodeport-addresses`).
    node_addresses: Vec<std::net::IpAddr>,
    snat_v4: Option<std::net::Ipv4Addr>,
    snat_v6: Option<std::net::Ipv6Addr>,
}

/// Devices: `--devices`, else those carrying the Node's InternalIP or
/// ExternalIP. Node addresses: the Node's, else the devices'.
fn node_net(
    store: &Store,
    node_name: &str,
    interfaces: &std::collections::BTreeMap<String, Vec<std::net::IpAddr>>,
    args: &NorthSouthArgs,
) -> NodeNet {
    let node_ips = store
        .nodes
        .get(node_name)
        .map(northsouth::node_object_addresses)
        .unwrap_or_default();
    let devices = select_devices(&args.devices, &node_ips, interfaces);
    let device_addrs: Vec<std::net::IpAddr> = devices
        .iter()
        .flat_map(|d| interfaces.get(d).into_iter().flatten().copied())
        .collect();
    let all = northsouth::node_addresses(store, node_name, &device_addrs, &[]);
    NodeNet {
        node_addresses: northsouth::node_addresses(
            store,
            node_name,
            &device_addrs,
            &args.nodeport_addresses,
        ),
        snat_v4: all.iter().find_map(|a| match a {
            std::net::IpAddr::V4(v4) => Some(*v4),
            _ => None,
        }),
        snat_v6: all.iter().find_map(|a| match a {
            std::net::IpAddr::V6(v6) => Some(*v6),
            _ => None,
        }),
        devices,
        node_ips,
    }
}

/// `--devices`, else the devices carrying one of `node_ips`.
fn select_devices(
    flag: &[String],
    node_ips: &[std::net::IpAddr],
    interfaces: &std::collections::BTreeMap<String, Vec<std::net::IpAddr>>,
) -> Vec<String> {
    if !flag.is_empty() {
        return flag.to_vec();
    }
    interfaces
        .iter()
        .filter(|(_, addrs)| addrs.iter().any(|a| node_ips.contains(a)))
        .map(|(name, _)| name.clone())
        .collect()
}

impl Syncer {
    /// Translates the current objects and programs the difference. Bad
    /// objects are reported and skipped; the rest is programmed. With
    /// `full`, every Service is translated and every frontend compared (the
    /// periodic resync); otherwise, when the source says what changed, only
    /// the Services that touches.
    fn sync(&mut self, full: bool) {
        let started = Instant::now();
        let node_name = self.node_name.clone();
        let interfaces = crate::datapath::tc::interface_addresses().unwrap_or_else(|e| {
            tracing::warn!("listing the network devices: {e:#}");
            Default::default()
        });
        let ns = self.north_south.clone();
        let algorithm = self.algorithm;
        let outlier_mode = self.outlier_mode;
        let translator = &mut self.translator;
        let cache = &mut self.north_south_cache;
        let flag_cidrs = &self.service_cluster_ip_range;
        let mut guarded = None;
        let (update, net, ranges, checks, eligible) = self.source.with_store(|store, changes| {
            // A handful of objects: joined afresh at every sync.
            guarded = Some(service_cidr::guarded(flag_cidrs, &store.service_cidrs));
            // A wake-up for a file that is not a manifest (an editor's
            // temporary file, say) changes nothing.
            let unchanged = !full && changes.as_ref().is_some_and(Changes::is_empty);
            let node = store.node_info(&node_name);
            let net = node_net(store, &node_name, &interfaces, &ns);
            let opts = TranslateOptions {
                default_algorithm: algorithm,
                default_outlier: outlier_mode,
                node_addresses: net.node_addresses.clone(),
                allowed_external_ips: ns.allowed_external_ip_cidrs.clone(),
                external_cluster_ip: ns.external_clusterip,
            };
            let update = match changes {
                Some(changes) if !full => translator.update(store, &changes, &node, &opts),
                _ => translator.full(store, &node, &opts),
            };
            let desired = translator.state();
            let inputs = match cache.take() {
                Some(c) if unchanged && !update.full && c.net == net => c,
                previous => {
                    let (ranges, rejections) = northsouth::source_ranges(store, desired);
                    let rejections_version = match previous {
                        Some(p) if p.rejections == rejections => p.rejections_version,
                        Some(p) => p.rejections_version + 1,
                        None => 0,
                    };
                    NorthSouthInputs {
                        net: net.clone(),
                        ranges,
                        rejections,
                        rejections_version,
                        checks: northsouth::health_checks(store, &node_name),
                    }
                }
            };
            let (ranges, checks) = (inputs.ranges.clone(), inputs.checks.clone());
            *cache = Some(inputs);
            let eligible = node_eligible(store.nodes.get(&node_name));
            (update, net, ranges, checks, eligible)
        });
        let rejections_changed = self.log_problems();
        let guarded = guarded.unwrap_or_default();
        if guarded != self.service_cidrs_logged {
            for p in guarded.problems.iter() {
                if !self.service_cidrs_logged.problems.contains(p) {
                    tracing::warn!("guarded Service CIDRs: {p}");
                }
            }
            if guarded.ranges != self.service_cidrs_logged.ranges {
                let cidrs: Vec<String> = guarded.cidrs().iter().map(ToString::to_string).collect();
                tracing::info!(cidrs = %cidrs.join(","), "guarded Service CIDRs");
            }
            self.service_cidrs_logged = guarded.clone();
        }
        self.set_node_eligible(eligible);
        let read_translate = started.elapsed();
        let applying = Instant::now();
        // Source ranges before the frontends that carry them: a socket a
        // connect marks for the check meets its frontend's DENY marker and
        // a cgroup_egress that looks (fail-closed); ranges taken away go
        // first as well, which only opens the frontend a moment sooner.
        self.sync_source_ranges(&net, &ranges, &guarded.cidrs());
        let desired = self.translator.state();
        warn_of_dh(&mut self.dh_services, desired);
        // Before a frontend can send a flow to a local backend, tc_egress
        // must know the backend's port to translate its replies, and
        // tc_ingress the frontend's port to look its packets up at all.
        if let Some(tc) = &mut self.tc {
            let touched = (!update.full).then_some(&update.touched);
            let local = crate::datapath::tc::local_backend_ports(desired, touched);
            let frontends = crate::datapath::tc::frontend_ports(desired, touched);
            let errors = tc
                .local_ports
                .mark(local)
                .into_iter()
                .chain(tc.frontend_ports.mark(frontends));
            for e in errors {
                tracing::error!("{e}");
            }
        }
        let maps = self.datapath.maps();
        let mut report = if update.full {
            self.reconciler.apply(desired, maps)
        } else {
            self.reconciler
                .apply_touched(desired, &update.touched, maps)
        };
        let frontends = desired.frontends.len();
        let mut stale_udp = std::mem::take(&mut report.stale_udp);
        if !stale_udp.is_empty() {
            stale_udp.find_orphans(desired);
        }
        let apply = applying.elapsed();
        for e in &report.errors {
            tracing::error!("map write failed, will retry on the next sync: {e}");
        }
        self.record_unprogrammed();
        // Before the old sets retire: a client, or an unconnected socket's
        // flow, must not stick to a backend that just left its Service.
        if report.frontends_written + report.frontends_removed > 0 {
            self.sweep_affinity();
            self.sweep_datagram_flows();
        }
        if !stale_udp.is_empty() {
            self.destroy_stale_udp(&stale_udp);
        }
        // The tc path's flows carry their frontend's service id.
        let stale_flows: BTreeSet<(u32, crate::semantics::model::BackendAddr)> = stale_udp
            .stale
            .iter()
            .filter_map(|(f, b)| Some((self.reconciler.service_id(f)?, *b)))
            .collect();
        self.sync_tc(&net, &stale_flows);
        // kube-proxy's: every address, unless --nodeport-addresses limits
        // them to the node's own within those prefixes.
        let bind = if self.north_south.nodeport_addresses.is_empty() {
            Bind::All
        } else {
            Bind::Addresses(net.node_addresses.clone())
        };
        for p in self.health_checks.update(&checks, &bind) {
            tracing::warn!("{p}");
        }
        self.record(&report, rejections_changed, started.elapsed());
        // What was pending is programmed; after a failed write it stays
        // pending, and /healthz goes 503 if no later sync succeeds in time.
        if report.errors.is_empty() {
            self.health.updated();
        }
        tracing::info!(
            frontends,
            full = update.full,
            written = report.frontends_written,
            adopted = report.frontends_adopted,
            removed = report.frontends_removed,
            backends_written = report.backends_written,
            rejected = self.problems.total(),
            read_translate_ms = read_translate.as_secs_f64() * 1e3,
            apply_ms = apply.as_secs_f64() * 1e3,
            elapsed_ms = started.elapsed().as_secs_f64() * 1e3,
            "synced"
        );
        if let Some(since) = self.watching_since.take() {
            tracing::info!(
                frontends,
                input_to_maps_ms = since.elapsed().as_secs_f64() * 1e3,
                "first complete picture programmed"
            );
        }
    }

    /// Logs the problems that are new or gone since the last sync, naming
    /// the file of an object translation rejected; whether any changed.
    fn log_problems(&mut self) -> bool {
        let dir = match &self.source {
            Source::Manifests { dir, .. } => Some(&**dir),
            Source::Cluster(_) => None,
        };
        // Those of the input name their file already (a duplicate names the
        // one that loses, not the one that defines the object).
        let as_found = |r: &Rejection| r.to_string();
        let show = |r: &Rejection| {
            let mut named = [r.clone()];
            if let Some(dir) = dir {
                dir.name_files(&mut named);
            }
            named[0].to_string()
        };
        let mut changed = false;
        if let Some(dir) = dir {
            let version = dir.rejections_version();
            changed |=
                self.problems
                    .update(FROM_INPUT, version, || dir.rejections_iter(), as_found);
        }
        let t = &self.translator;
        changed |= self.problems.update(
            FROM_TRANSLATION,
            t.rejections_version(),
            || t.rejections_iter(),
            show,
        );
        if let Some(ns) = &self.north_south_cache {
            changed |= self.problems.update(
                FROM_NORTH_SOUTH,
                ns.rejections_version,
                || ns.rejections.iter(),
                show,
            );
        }
        changed
    }

    fn set_node_eligible(&mut self, eligible: bool) {
        if eligible != self.node_eligible {
            if eligible {
                tracing::info!(node = %self.node_name, "the Node is no longer being deleted: /healthz answers 200 again");
            } else {
                tracing::warn!(node = %self.node_name, "the Node is being deleted (deletionTimestamp or the ToBeDeletedByClusterAutoscaler taint): /healthz answers 503");
            }
            self.node_eligible = eligible;
        }
        self.health.set_node_eligible(eligible);
    }

    fn record(
        &self,
        report: &crate::datapath::reconcile::SyncReport,
        rejections_changed: bool,
        took: Duration,
    ) {
        let m = &self.metrics;
        m.sync_duration.observe(took.as_secs_f64());
        m.sync_errors.inc_by(report.errors.len() as u64);
        if report.errors.is_empty() {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default();
            m.last_sync.set(now.as_secs_f64());
        }
        let usage = self.reconciler.usage();
        m.frontends.set(usage.frontends as i64);
        m.backends.set(usage.backends as i64);
        for (map, used, cap) in [
            (
                lb_common::map_names::SERVICES,
                usage.frontends + usage.vips,
                self.capacity.max_services,
            ),
            (
                lb_common::map_names::BACKENDS,
                usage.backends,
                self.capacity.max_backends,
            ),
            (
                lb_common::map_names::SLOTS,
                usage.slots,
                self.capacity.max_slots,
            ),
            (
                lb_common::map_names::MAGLEV,
                usage.maglev_tables,
                self.capacity.max_maglev_tables,
            ),
        ] {
            m.map_fill
                .get_or_create(&MapLabel {
                    map: map.to_owned(),
                })
                .set(used as f64 / cap.max(1) as f64);
        }
        if rejections_changed {
            m.rejected.clear();
            for (label, n) in self.problems.by_field() {
                m.rejected.get_or_create(label).set(n);
            }
        }
    }

    /// What the reconciler could not program, and the frontends no
    /// datapath serves (SCTP): into `LB_UNPROGRAMMED` (for `inspect`) and
    /// `/metrics`, by reason and by kind. Only the former degrade `/readyz`:
    /// the latter are what this agent does, not a failure.
    fn record_unprogrammed(&mut self) {
        let mut want = std::collections::BTreeMap::new();
        let mut not_served: std::collections::BTreeMap<NotServedLabel, i64> = Default::default();
        for n in self.translator.not_served() {
            let key = crate::datapath::reconcile::service_key(&n.frontend);
            want.insert(key, not_served_entry(n));
            let label = NotServedLabel {
                protocol: n.frontend.protocol.to_string(),
                kind: n.kind.name().to_owned(),
            };
            *not_served.entry(label).or_default() += 1;
        }
        let m = &self.metrics.not_served;
        m.clear();
        for (label, n) in not_served {
            m.get_or_create(&label).set(n);
        }
        let mut by_reason: std::collections::BTreeMap<String, i64> = Default::default();
        for u in self.reconciler.unprogrammed() {
            want.insert(u.target.key(), unprogrammed_entry(u));
            *by_reason.entry(u.reason()).or_default() += 1;
        }
        for e in self.datapath.maps().sync_unprogrammed(&want) {
            tracing::warn!("{e}");
        }
        let failed: i64 = by_reason.values().sum();
        self.ready.set_degraded((failed > 0).then(|| {
            let reasons: Vec<String> = by_reason.iter().map(|(r, n)| format!("{n} {r}")).collect();
            format!(
                "{failed} frontends not programmed ({}); see `lb-agent inspect services`",
                reasons.join(", ")
            )
        }));
        let m = &self.metrics.unprogrammed;
        m.clear();
        for (reason, n) in by_reason {
            m.get_or_create(&ReasonLabel { reason }).set(n);
        }
    }

    /// Connected UDP sockets keep talking to the backend they were sent to
    /// (or, connected before their frontend was programmed, to the
    /// frontend's address, around the hook); when that is stale by
    /// kube-proxy's rule (`stale_udp`), destroy them so that the
    /// application sees an error and reconnects through the hook.
    fn destroy_stale_udp(&mut self, stale: &crate::semantics::stale_udp::StaleUdp) {
        let peers = stale.peers();
        // `LB_REV_SOCK` names a socket's frontend by service id; only the
        // frontends something is stale for matter.
        let frontends: std::collections::BTreeMap<u32, Frontend> = stale
            .stale
            .iter()
            .filter_map(|(f, _)| Some((self.reconciler.service_id(f)?, *f)))
            .collect();
        let maps = self.datapath.maps();
        let cgroup = self.cgroup.clone();
        let report = tokio::task::block_in_place(|| {
            crate::datapath::sockets::destroy_udp_sockets(&cgroup, &peers, |sock| {
                // An entry may have been evicted (an LRU): it is extra
                // knowledge, not a condition.
                let via = maps
                    .service_of_socket(sock.cookie, sock.dst)
                    .and_then(|id| frontends.get(&id));
                stale.is_stale(sock.dst, via)
            })
        });
        self.metrics
            .udp_sockets_destroyed
            .inc_by(report.destroyed as u64);
        for e in &report.errors {
            tracing::warn!("destroying stale UDP sockets: {e}");
        }
        tracing::info!(
            peers = peers.len(),
            namespaces = report.namespaces,
            examined = report.examined,
            destroyed = report.destroyed,
            "stale connected UDP sockets destroyed"
        );
    }

    /// The tc path's settings (`LB_TC_CONFIG`) and the source ranges
    /// (`LB_SOURCE_RANGES`), which the socket path's `cgroup_egress` reads
    /// too.
    fn sync_source_ranges(
        &mut self,
        net: &NodeNet,
        ranges: &std::collections::BTreeMap<Frontend, Vec<Cidr>>,
        service_ranges: &[Cidr],
    ) {
        let timeouts = self.north_south.timeouts();
        let Some(tc) = &mut self.tc else {
            return;
        };
        for e in tc.ranges.sync(ranges) {
            tracing::error!("{e}");
        }
        let any = ranges.values().any(|r| !r.is_empty());
        if let Err(e) = tc.write_config(
            net.snat_v4,
            net.snat_v6,
            &timeouts,
            &self.outlier,
            any,
            service_ranges,
        ) {
            tracing::error!("{e:#}");
        }
        if let Err(e) = self.datapath.set_source_check(any) {
            // Attaching failed: pods and host processes are not held to
            // the ranges (the tc path still holds external clients).
            tracing::error!(
                wanted = any,
                "cgroup_egress (loadBalancerSourceRanges for pods and host processes) \
                 could not be attached or detached, tried again at the next sync: {e:#}"
            );
        }
    }

    /// The tc path's stale UDP flows (by service id and backend), and the
    /// devices its programs are attached to.
    fn sync_tc(
        &mut self,
        net: &NodeNet,
        stale_flows: &BTreeSet<(u32, crate::semantics::model::BackendAddr)>,
    ) {
        if let Some(tc) = &mut self.tc {
            if !net.devices.is_empty() && self.tc_attach.is_some() {
                tc.reserve_snat_ports();
            }
            if !stale_flows.is_empty() {
                let n = tc.purge_udp(stale_flows);
                self.metrics.conntrack_udp_purged.inc_by(n as u64);
                if n > 0 {
                    tracing::info!(
                        entries = n,
                        "UDP conntrack entries of backends that stopped serving removed"
                    );
                }
            }
        }
        if self.tc_devices.as_ref() != Some(&net.devices) {
            self.attach_tc(&net.devices, Some(&net.node_addresses));
        }
    }

    /// Attaches the tc programs to `devices`, at a change of them
    /// (`changed`: the node addresses, logged) or at a sweep's check
    /// (`None`), and reports each device: a re-attach in the log and
    /// `lb_device_reattachments`; what a device lacks in `/readyz` (503:
    /// its NodePorts, LoadBalancer IPs and externalIPs are not served from
    /// outside), the log and `lb_device_attach_failing`; all of it in
    /// `lb-agent inspect tc`.
    fn attach_tc(&mut self, devices: &[String], changed: Option<&[std::net::IpAddr]>) {
        use crate::base::metrics::{DeviceHookLabel, DeviceLabel};
        use crate::datapath::devices::{self as dev, HookState};
        let pin_dir = self.datapath.pin_dir().to_path_buf();
        // With --no-tc, no device: what an earlier run attached, of either
        // kind, is removed.
        let (wanted, mode) = match self.tc_attach {
            Some(mode) => (devices, mode),
            None => (&[][..], dev::AttachMode::Tcx),
        };
        let report = dev::attach(
            self.datapath.ebpf_mut(),
            &pin_dir,
            wanted,
            mode,
            self.acceleration,
        );
        if let Some(node_addresses) = changed {
            tracing::info!(
                devices = ?wanted,
                mode = mode.name(),
                node_addresses = ?node_addresses,
                replaced_links = report.replaced,
                "tc programs attached"
            );
        }
        let mut status = std::collections::BTreeMap::new();
        for st in &report.devices {
            let before = self.tc_status.get(&st.device);
            if let Some(why) = before.and_then(|b| st.reattached_because(b, mode)) {
                let hooks: Vec<&str> = st.attached_now().map(dev::Hook::name).collect();
                tracing::warn!(
                    device = %st.device,
                    ifindex = ?st.ifindex,
                    hooks = %hooks.join(","),
                    why = %why,
                    "tc programs re-attached"
                );
                self.metrics
                    .device_reattachments
                    .get_or_create(&DeviceLabel::of(&st.device))
                    .inc();
            }
            let lack = st.lack();
            if lack.is_some() && lack != before.and_then(dev::DeviceStatus::lack) {
                tracing::error!("{}; retried every sweep", lack.unwrap_or_default());
            }
            for (hook, state) in &st.hooks {
                let HookState::Unaccelerated(why) = state else {
                    continue;
                };
                let logged = before.is_some_and(|b| b.hooks.contains(&(*hook, state.clone())));
                if !logged {
                    tracing::warn!(
                        device = %st.device,
                        "--acceleration best-effort: no XDP on this device, the tc programs \
                         serve it alone: {why}"
                    );
                }
            }
            for (hook, state) in &st.hooks {
                self.metrics
                    .device_attach_failing
                    .get_or_create(&DeviceHookLabel::of(&st.device, hook.name()))
                    .set(i64::from(matches!(state, HookState::Failed(_))));
            }
            status.insert(st.device.clone(), st.clone());
        }
        for (gone, before) in &self.tc_status {
            if !status.contains_key(gone) {
                for (hook, _) in &before.hooks {
                    self.metrics
                        .device_attach_failing
                        .remove(&DeviceHookLabel::of(gone, hook.name()));
                }
            }
        }
        let lack = report.lack();
        if let (Some(e), true) = (&report.cleanup_error, lack != self.tc_lack) {
            tracing::error!("removing earlier tc attachments: {e}; retried every sweep");
        }
        let shown = |s: &std::collections::BTreeMap<String, dev::DeviceStatus>| -> Vec<_> {
            s.values().map(|d| (d.ifindex, d.lack())).collect()
        };
        if changed.is_some() || shown(&status) != shown(&self.tc_status) {
            dev::record_status(&pin_dir, mode, &report);
        }
        self.metrics
            .tc_attach_failing
            .set(i64::from(lack.is_some()));
        self.ready.set_unattached(lack.clone());
        self.tc_lack = lack;
        self.tc_status = status;
        self.tc_devices = Some(devices.to_vec());
    }

    /// Every sweep: without `--devices`, which devices carry the Node's
    /// addresses now; then each device's programs, re-attached where they
    /// went (the device deleted and created again, its link or filter
    /// removed) and attached where it appeared.
    fn check_tc(&mut self) {
        let Some(devices) = self.tc_devices.clone() else {
            return;
        };
        if self.tc_attach.is_none() {
            return;
        }
        let Some(net) = self.north_south_cache.as_ref().map(|c| c.net.clone()) else {
            return;
        };
        if self.north_south.devices.is_empty() {
            match crate::datapath::tc::interface_addresses() {
                Ok(interfaces) => {
                    let now = select_devices(&[], &net.node_ips, &interfaces);
                    if now != devices {
                        return self.attach_tc(&now, Some(&net.node_addresses));
                    }
                }
                Err(e) => tracing::debug!("listing the network devices: {e:#}"),
            }
        }
        self.attach_tc(&devices, None);
    }

    /// Reports outlier detection's new quarantines and releases (log) and
    /// how many backends are quarantined (`lb_backends_quarantined`).
    fn watch_quarantines(&mut self) {
        let totals = match loader::read_stats(self.datapath.pin_dir()) {
            Ok(t) => t,
            Err(e) => return tracing::debug!("reading LB_STATS: {e:#}"),
        };
        let ejections = [
            lb_common::stat::EJECTED_REFUSED,
            lb_common::stat::EJECTED_TIMEOUT,
            lb_common::stat::EJECTED_UNREACHABLE,
        ]
        .iter()
        .map(|&i| totals.get(i as usize).copied().unwrap_or(0))
        .sum();
        // The kernel's counters too: ejections show in /metrics as soon.
        self.metrics.record_datapath_events(&totals);
        let now = crate::base::clock::monotonic_now_ns();
        let (reconciler, maps) = (&self.reconciler, self.datapath.maps());
        let changes = self.quarantines.check(
            ejections,
            now,
            || reconciler.outlier_backends(),
            |id| maps.backend_health(id),
        );
        self.metrics
            .backends_quarantined
            .set(changes.in_quarantine as i64);
    }

    fn record_datapath_events(&mut self) {
        match loader::read_stats(self.datapath.pin_dir()) {
            Ok(totals) => self.metrics.record_datapath_events(&totals),
            Err(e) => tracing::debug!("reading LB_STATS: {e:#}"),
        }
    }

    /// Sweeps the UDP sockets' flows and the tc path's conntrack, then
    /// sets each backend's flow count (`BackendState::flows`) to the
    /// counted flows left in both: a flow that expired, was replaced or
    /// evicted stops counting for lc, sed and nq.
    fn sweep_flows(&mut self) {
        let before = self.backend_states.as_ref().map(|s| s.flow_counts());
        self.sweep_datagram_flows();
        let mut counted = std::collections::HashMap::new();
        let policies = self.reconciler.datagram_flow_policies();
        let timeout_s = self.north_south.timeouts().config().udp_timeout_s;
        self.datapath
            .maps()
            .count_datagram_flows(&policies, timeout_s, &mut counted);
        self.sweep_conntrack(&mut counted);
        if let (Some(states), Some(before)) = (&self.backend_states, before) {
            states.correct_flows(&before, &counted);
        }
    }

    fn sweep_conntrack(&mut self, counted: &mut std::collections::HashMap<u32, i32>) {
        let timeouts = self.north_south.timeouts();
        if let Some(tc) = &mut self.tc {
            let (left, n) = tc.sweep(&timeouts, counted);
            self.metrics.conntrack_entries.set(left as i64);
            self.metrics.conntrack_expired.inc_by(n as u64);
            if n > 0 {
                tracing::debug!(entries = n, "expired conntrack entries removed");
            }
        }
    }

    fn sweep_affinity(&mut self) {
        let policies = self.reconciler.affinity_policies();
        let r = self.datapath.maps().sweep_affinity(&policies);
        let m = &self.metrics;
        record_sweep(
            lb_common::map_names::AFFINITY,
            &r,
            (&m.affinity_entries, &m.affinity_expired, &m.affinity_swept),
        );
    }

    fn sweep_datagram_flows(&mut self) {
        let policies = self.reconciler.datagram_flow_policies();
        // The timeout exactly as the kernel reads it from LB_TC_CONFIG.
        let timeout_s = self.north_south.timeouts().config().udp_timeout_s;
        let r = self
            .datapath
            .maps()
            .sweep_datagram_flows(&policies, timeout_s);
        let m = &self.metrics;
        record_sweep(
            lb_common::map_names::DGRAM_FLOWS,
            &r,
            (
                &m.datagram_flows,
                &m.datagram_flows_expired,
                &m.datagram_flows_swept,
            ),
        );
    }

    fn retire(&mut self) {
        for e in self.reconciler.retire(self.datapath.maps()) {
            tracing::error!("cleanup failed, will retry: {e}");
        }
    }
}

/// A sweep of `map`: its entries left, and those deleted because they
/// expired or their Service (frontend) or backend left, into the metrics
/// (entries, expired, swept) and the log.
fn record_sweep(
    map: &str,
    r: &crate::datapath::sweep::SweepReport,
    (entries, expired, swept): (&Gauge, &Counter, &Counter),
) {
    entries.set(r.entries as i64);
    expired.inc_by(r.expired as u64);
    swept.inc_by(r.swept() as u64);
    if r.expired + r.swept() > 0 {
        tracing::debug!(
            map,
            entries = r.entries,
            expired = r.expired,
            service_gone = r.no_policy,
            backend_left = r.backend_left,
            "swept"
        );
    }
}

/// `u` as `LB_UNPROGRAMMED` stores it (names cut to their fields' size:
/// Kubernetes names fit, a namespace and a Service name being 63 bytes at
/// most).
fn unprogrammed_entry(u: &crate::datapath::reconcile::Unprogrammed) -> lb_common::Unprogrammed {
    entry(&u.service, &u.port_name, u.map, u.errno)
}

/// `n` as `LB_UNPROGRAMMED` stores it.
fn not_served_entry(n: &crate::semantics::model::NotServed) -> lb_common::Unprogrammed {
    entry(
        &n.service,
        &n.port_name,
        lb_common::unprogrammed_map::NOT_SERVED,
        libc::EPROTONOSUPPORT,
    )
}

fn entry(
    service: &crate::semantics::model::ServiceName,
    port_name: &str,
    map: u32,
    errno: i32,
) -> lb_common::Unprogrammed {
    fn bytes<const N: usize>(s: &str) -> [u8; N] {
        let mut out = [0u8; N];
        let n = s.len().min(N);
        out[..n].copy_from_slice(&s.as_bytes()[..n]);
        out
    }
    lb_common::Unprogrammed {
        service: bytes(&service.to_string()),
        port_name: bytes(port_name),
        errno,
        map,
    }
}

/// Wakes `tx` on changes in `dir`, marking an update pending.
fn watch_dir(
    dir: &std::path::Path,
    tx: mpsc::Sender<()>,
    health: ProxyHealthHandle,
) -> anyhow::Result<RecommendedWatcher> {
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        match res {
            Ok(e) if e.kind.is_access() => {}
            // A full channel already holds a pending wake-up.
            Ok(_) => {
                health.queued_update();
                let _ = tx.try_send(());
            }
            Err(e) => tracing::warn!(error = %e, "watching the manifests directory"),
        }
    })
    .context("creating the file watcher")?;
    watcher
        .watch(dir, RecursiveMode::NonRecursive)
        .with_context(|| format!("watching {}", dir.display()))?;
    Ok(watcher)
}

/// Attaches the socket programs if that waited for the first sync.
fn attach_after_sync(
    datapath: &mut Datapath,
    cgroup: &std::path::Path,
    pending: &mut bool,
) -> anyhow::Result<()> {
    if std::mem::take(pending) {
        let replaced = datapath.attach(cgroup)?;
        tracing::info!(
            replaced_links = replaced,
            "programs attached after the first sync into recreated maps"
        );
    }
    Ok(())
}

/// What the kernel offers and what the datapath makes of it, once at start.
fn log_kernel(kernel: &KernelFeatures, refusal: Refusal) {
    tracing::info!(
        kernel = %kernel.release,
        set_retval_sock_addr = kernel.set_retval_sock_addr,
        tcx = kernel.tcx,
        btf = kernel.btf,
        "kernel features probed; connects and datagrams to a Service without endpoints fail with {refusal}"
    );
    if refusal == Refusal::Eperm && kernel.set_retval_sock_addr {
        tracing::info!(
            "EPERM as asked (--refusal eperm); this kernel could refuse with ECONNREFUSED"
        );
    } else if refusal == Refusal::Eperm {
        tracing::warn!(
            "this kernel has no bpf_set_retval in sock_addr programs (Linux 6.1): refusals are EPERM, not kube-proxy's ECONNREFUSED"
        );
    }
}

pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    raise_open_file_limit();
    let node_name = match args.node_name.clone() {
        Some(n) => n,
        None => hostname()?,
    };
    let cgroup = match args.cgroup.clone() {
        Some(c) => c,
        None => loader::cgroup2_root()?,
    };
    let tc_attach = args.north_south.tc_attach_mode();
    match tc_attach {
        Some(mode) => tracing::info!(
            requested = ?args.north_south.tc_attach,
            "the tc programs attach through {}",
            match mode {
                crate::datapath::devices::AttachMode::Tcx => "TCX links",
                crate::datapath::devices::AttachMode::Netlink => "clsact qdisc filters (netlink)",
            }
        ),
        None => tracing::info!("--no-tc: the tc programs are attached to no device"),
    }
    let acceleration = args.north_south.acceleration;
    if tc_attach.is_some() {
        tracing::info!(
            acceleration = acceleration.name(),
            "the XDP stage (established flows of the tc path sent on from the driver)"
        );
    }
    let outlier = args.outlier_settings();
    tracing::info!(
        mode = crate::semantics::model::OutlierMode::from(args.outlier_detection).name(),
        consecutive_failures = outlier.consecutive_failures,
        base_ejection = ?outlier.base_ejection,
        max_ejection = ?outlier.max_ejection,
        max_ejection_percent = outlier.max_ejection_percent,
        "outlier detection"
    );
    if outlier.max_ejection < outlier.base_ejection {
        tracing::warn!(
            "--outlier-max-ejection ({:?}) is shorter than --outlier-base-ejection ({:?}): \
             every quarantine lasts {:?}",
            outlier.max_ejection,
            outlier.base_ejection,
            outlier.max_ejection
        );
    }
    let metrics = Metrics::new();
    let ready = Readiness::default();
    let proxy_health = ProxyHealthHandle::new(args.healthz_timeout);
    // After raise_open_file_limit: the totals follow the raised limit.
    let limits = health::Limits::for_this_process();
    tracing::info!(
        per_source = limits.max_connections_per_source,
        total = limits.max_connections,
        "connection limits of the health, metrics and health-check node port servers, each"
    );
    health::serve(
        args.health_addr,
        ready.clone(),
        proxy_health.clone(),
        limits,
    )
    .await?;
    health::serve_metrics(args.metrics_bind_address, metrics.clone(), limits).await?;

    // Changes wake the loop; one pending wake-up is enough.
    let (wake, mut events) = mpsc::channel::<()>(1);
    let mut watching_since = None;
    let source = match &args.manifests {
        Some(dir) => {
            if !dir.is_dir() {
                bail!("--manifests {}: not a directory", dir.display());
            }
            // Watch before the first read, so no change between the two is lost.
            Source::Manifests {
                dir: Box::new(
                    manifest::ManifestDir::new(dir).with_max_file_bytes(args.max_manifest_bytes),
                ),
                _watcher: watch_dir(dir, wake.clone(), proxy_health.clone())?,
            }
        }
        None => {
            let access = ApiAccess {
                kubeconfig: args.kubeconfig.clone(),
                api_server: args.k8s_api_server.clone(),
            };
            let client = watch::client(&access).await?;
            watching_since = Some(Instant::now());
            let state: SharedState = Arc::new(Mutex::new(Default::default()));
            let (wake, health) = (wake.clone(), proxy_health.clone());
            watch::start(
                client,
                &node_name,
                state.clone(),
                Arc::new(move || {
                    health.queued_update();
                    // A full channel already holds a pending wake-up.
                    let _ = wake.try_send(());
                }),
                metrics.clone(),
            );
            Source::Cluster(state)
        }
    };

    let kernel = KernelFeatures::probe();
    let refusal = args.refusal.resolve(&kernel);
    log_kernel(&kernel, refusal);
    metrics.record_kernel(&kernel.by_name(), refusal.errno());
    let mut capacity = args.capacity.clone();
    // Only a flag or the API's ServiceCIDRs can configure the guard: with
    // neither possible, the programs are loaded without its check.
    capacity.service_range_guard =
        args.manifests.is_none() || !args.service_cluster_ip_range.is_empty();
    let (mut datapath, mut adopted) = Datapath::load_detached(&args.bpffs, &capacity, refusal)?;
    if let Some(logger) = adopted.logger.take() {
        loader::forward_kernel_logs(logger)?;
    }
    for r in &adopted.recreated {
        tracing::warn!("map layout changed since the last run, recreated: {r}");
    }
    // Recreated maps start empty: programs attached now would replace the
    // earlier run's, which still serve from the old maps, with programs that
    // find nothing until the first sync. Attach right after it instead.
    let mut attach_pending = !adopted.recreated.is_empty();
    if !attach_pending {
        adopted.replaced_links = datapath.attach(&cgroup)?;
    }
    tracing::info!(
        cgroup = %cgroup.display(),
        bpffs = %args.bpffs.display(),
        node = %node_name,
        adopted_frontends = adopted.services.len(),
        replaced_links = adopted.replaced_links,
        "{}",
        if attach_pending {
            "programs loaded, attached after the first sync"
        } else {
            "programs attached"
        }
    );
    if tc_attach.is_some() {
        // Without it a flow's cached next hop still lasts at most a second.
        if let Err(e) =
            crate::datapath::route_epoch::RouteEpoch::open(&args.bpffs).and_then(|r| r.watch())
        {
            tracing::error!(
                "following route changes: {e:#}; a flow's next hop is looked up again every second"
            );
        }
    }
    let reconciler = Reconciler::adopt(
        args.maglev_table_size,
        args.capacity.max_slots,
        adopted.services,
        adopted.slots,
        adopted.backends,
        adopted.maglev,
    )
    .with_service_capacity(args.capacity.max_services);
    let mut syncer = Syncer {
        source,
        cgroup: cgroup.clone(),
        node_name,
        algorithm: args.algorithm.into(),
        outlier_mode: args.outlier_detection.into(),
        outlier: args.outlier_settings(),
        capacity,
        service_cluster_ip_range: args.service_cluster_ip_range.clone(),
        service_cidrs_logged: Default::default(),
        datapath,
        reconciler,
        translator: Translator::default(),
        north_south_cache: None,
        problems: ProblemLog::default(),
        dh_services: BTreeSet::new(),
        backend_states: open_backend_states(&args.bpffs),
        quarantines: Default::default(),
        metrics,
        north_south: args.north_south.clone(),
        tc: match crate::datapath::tc::TcMaps::open(&args.bpffs) {
            Ok(m) => Some(m),
            Err(e) => {
                tracing::error!("the tc path is disabled: {e:#}");
                None
            }
        },
        tc_attach,
        acceleration,
        tc_devices: None,
        tc_status: Default::default(),
        tc_lack: None,
        ready: ready.clone(),
        health_checks: HealthCheckServers::new(proxy_health.clone(), limits),
        node_eligible: true,
        health: proxy_health.clone(),
        watching_since,
    };
    // Until the API has been listed completely, the adopted maps stay as
    // they are: an early sync would delete what is not listed yet.
    if syncer.source.complete() {
        syncer.sync(true);
        attach_after_sync(&mut syncer.datapath, &cgroup, &mut attach_pending)?;
        ready.set_ready();
    }

    let mut sigterm = tokio::signal::unix::signal(SignalKind::terminate())?;
    let mut sigint = tokio::signal::unix::signal(SignalKind::interrupt())?;
    let mut retire_at: Option<Instant> = None;
    let mut resync = tokio::time::interval(RESYNC_PERIOD);
    resync.tick().await;
    let mut sweep = tokio::time::interval(
        syncer
            .north_south
            .sweep_interval
            .max(Duration::from_millis(100)),
    );
    sweep.tick().await;
    // Outlier detection's quarantines are reported within this.
    let mut quarantine_watch = tokio::time::interval(Duration::from_millis(250));
    quarantine_watch.tick().await;
    loop {
        if retire_at.is_none() && syncer.reconciler.has_retiring() {
            // That retire takes only what is queued now: a set replaced in
            // the meantime waits for the next one, a whole delay too.
            syncer.reconciler.schedule_retire();
            retire_at = Some(Instant::now() + RETIRE_DELAY);
        }
        let retire_sleep = async {
            match retire_at {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        // `Some(full)`: sync, comparing everything or only what changed.
        let sync_now = tokio::select! {
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
            Some(()) = events.recv() => {
                // Coalesce a burst of changes into one sync.
                tokio::time::sleep(args.sync_debounce).await;
                while events.try_recv().is_ok() {}
                Some(false)
            }
            // Everything again, in case something was missed; pending
            // until it succeeds.
            _ = resync.tick() => {
                proxy_health.queued_update();
                Some(true)
            }
            _ = quarantine_watch.tick() => {
                syncer.watch_quarantines();
                None
            }
            _ = sweep.tick() => {
                syncer.check_tc();
                syncer.sweep_affinity();
                syncer.sweep_flows();
                syncer.record_datapath_events();
                None
            }
            // Retired sets free entries: frontends that did not fit may
            // now, so they are tried again at once.
            _ = retire_sleep => {
                syncer.retire();
                retire_at = None;
                syncer.reconciler.room_made().then_some(false)
            }
        };
        if let Some(full) = sync_now.filter(|_| syncer.source.complete()) {
            syncer.sync(full);
            attach_after_sync(&mut syncer.datapath, &cgroup, &mut attach_pending)?;
            ready.set_ready();
        }
    }
    if args.cleanup_on_exit {
        tracing::info!("signal received: detaching and removing pins");
        let _ = crate::datapath::clsact::detach_filters(syncer.datapath.pin_dir())?;
        syncer.datapath.unload()
    } else {
        tracing::info!(
            bpffs = %args.bpffs.display(),
            "signal received: the datapath stays pinned and keeps serving; `lb-agent cleanup` removes it"
        );
        Ok(())
    }
}
