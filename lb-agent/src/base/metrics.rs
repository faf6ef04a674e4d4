//! Prometheus metrics, served on `/metrics` of the metrics address.
use std::sync::{atomic::AtomicU64, Arc};

use prometheus_client::{
    encoding::{text::encode, EncodeLabelSet},
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{exponential_buckets, Histogram},
    },
    registry::Registry,
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: String,
}

/// A kernel counter of `LB_STATS`, by its `lb_common::stat::NAMES` name.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EventLabel {
    pub event: String,
}

/// A scheduler, by its `lb_common::algorithm::NAMES` name.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AlgorithmLabel {
    pub algorithm: String,
}

/// A kernel feature the agent probed at start (`datapath::features`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FeatureLabel {
    pub feature: String,
}

/// A network device the agent attaches programs to.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DeviceLabel {
    pub device: String,
}

impl DeviceLabel {
    pub fn of(device: &str) -> Self {
        Self {
            device: device.to_owned(),
        }
    }
}

/// A hook of a device, named by the program attached there (`tc_ingress`,
/// `tc_egress`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DeviceHookLabel {
    pub device: String,
    pub hook: String,
}

impl DeviceHookLabel {
    pub fn of(device: &str, hook: &str) -> Self {
        Self {
            device: device.to_owned(),
            hook: hook.to_owned(),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MapLabel {
    pub map: String,
}

/// Why a frontend is not programmed (`reconcile::reason_label`): the map
/// whose write failed and whether it was full, e.g. `slots_full`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: String,
}

/// A frontend no datapath serves: its protocol (`SCTP`) and kind
/// (`ClusterIP`, `NodePort`, `LoadBalancer IP`, `externalIP`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct NotServedLabel {
    pub protocol: String,
    pub kind: String,
}

/// The field a rejected object was rejected for, indices removed
/// (`spec.ports[1].port` → `spec.ports.port`) to keep cardinality bounded.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RejectLabel {
    pub field: String,
}

impl RejectLabel {
    pub fn of(field: &str) -> Self {
        let mut out = String::with_capacity(field.len());
        let mut depth = 0;
        for c in field.chars() {
            match c {
                '[' => depth += 1,
                ']' => depth -= 1,
                _ if depth == 0 => out.push(c),
                _ => {}
            }
        }
        Self {
            field: if out.is_empty() { "object".into() } else { out },
        }
    }
}

type GaugeF64 = Gauge<f64, AtomicU64>;

#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    pub sync_duration: Histogram,
    pub last_sync: GaugeF64,
    pub sync_errors: Counter,
    pub frontends: Gauge,
    pub backends: Gauge,
    pub map_fill: Family<MapLabel, GaugeF64>,
    pub watch_restarts: Family<KindLabel, Counter>,
    pub watch_errors: Family<KindLabel, Counter>,
    pub rejected: Family<RejectLabel, Gauge>,
    pub unprogrammed: Family<ReasonLabel, Gauge>,
    pub not_served: Family<NotServedLabel, Gauge>,
    pub affinity_entries: Gauge,
    pub affinity_expired: Counter,
    pub affinity_swept: Counter,
    pub datagram_flows: Gauge,
    pub datagram_flows_expired: Counter,
    pub datagram_flows_swept: Counter,
    pub udp_sockets_destroyed: Counter,
    pub conntrack_entries: Gauge,
    pub conntrack_expired: Counter,
    pub conntrack_udp_purged: Counter,
    pub tc_attach_failing: Gauge,
    pub device_attach_failing: Family<DeviceHookLabel, Gauge>,
    pub device_reattachments: Family<DeviceLabel, Counter>,
    pub kernel_features: Family<FeatureLabel, Gauge>,
    pub refusal_errno: Gauge,
    pub datapath_events: Family<EventLabel, Counter>,
    /// Backends chosen for new flows, by scheduler (`LB_STATS`'s
    /// `chosen_*`); no per-backend series, which 100 000 Services would
    /// make millions of.
    pub scheduler_choices: Family<AlgorithmLabel, Counter>,
    /// Backends quarantined by outlier detection, by reason (`LB_STATS`'s
    /// `ejected_*`).
    pub outlier_ejections: Family<ReasonLabel, Counter>,
    /// Backends in quarantine now (counted by the sweep).
    pub backends_quarantined: Gauge,
    /// The `LB_STATS` totals last added to `datapath_events`.
    datapath_seen: Arc<std::sync::Mutex<Vec<u64>>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("lb");
        let sync_duration = Histogram::new(exponential_buckets(0.0001, 2.0, 18));
        let m = Self {
            registry: Arc::new(Registry::default()),
            sync_duration,
            last_sync: GaugeF64::default(),
            sync_errors: Counter::default(),
            frontends: Gauge::default(),
            backends: Gauge::default(),
            map_fill: Family::default(),
            watch_restarts: Family::default(),
            watch_errors: Family::default(),
            rejected: Family::default(),
            unprogrammed: Family::default(),
            not_served: Family::default(),
            affinity_entries: Gauge::default(),
            affinity_expired: Counter::default(),
            affinity_swept: Counter::default(),
            datagram_flows: Gauge::default(),
            datagram_flows_expired: Counter::default(),
            datagram_flows_swept: Counter::default(),
            udp_sockets_destroyed: Counter::default(),
            conntrack_entries: Gauge::default(),
            tc_attach_failing: Gauge::default(),
            device_attach_failing: Family::default(),
            device_reattachments: Family::default(),
            kernel_features: Family::default(),
            refusal_errno: Gauge::default(),
            conntrack_expired: Counter::default(),
            conntrack_udp_purged: Counter::default(),
            datapath_events: Family::default(),
            scheduler_choices: Family::default(),
            outlier_ejections: Family::default(),
            backends_quarantined: Gauge::default(),
            datapath_seen: Arc::default(),
        };
        registry.register(
            "sync_duration_seconds",
            "Time to translate and program one sync",
            m.sync_duration.clone(),
        );
        registry.register(
            "last_successful_sync_timestamp_seconds",
            "Unix time of the last sync that programmed without map errors",
            m.last_sync.clone(),
        );
        registry.register(
            "sync_map_errors",
            "Map writes that failed (retried on the next sync)",
            m.sync_errors.clone(),
        );
        registry.register(
            "frontends_programmed",
            "Service frontends in LB_SERVICES",
            m.frontends.clone(),
        );
        registry.register(
            "backends_programmed",
            "Backends in LB_BACKENDS",
            m.backends.clone(),
        );
        registry.register(
            "map_fill_ratio",
            "Entries over capacity, per map",
            m.map_fill.clone(),
        );
        registry.register(
            "watch_restarts",
            "Relists of a watched kind after the first list",
            m.watch_restarts.clone(),
        );
        registry.register(
            "watch_errors",
            "Errors of a watch (retried with backoff)",
            m.watch_errors.clone(),
        );
        registry.register(
            "objects_rejected",
            "Objects (or parts) skipped in the last sync, by the field at fault",
            m.rejected.clone(),
        );
        registry.register(
            "frontends_unprogrammed",
            "Desired frontends (and VIP markers) the last sync could not program as desired, by why; \
             each keeps its previous state if it had one, and is retried at every sync",
            m.unprogrammed.clone(),
        );
        registry.register(
            "frontends_not_served",
            "Frontends Services ask for that no datapath serves (SCTP: Linux runs no connect or \
             sendmsg hook for SCTP sockets, the tc path does not rewrite SCTP), by protocol and kind; \
             never programmed, listed by `lb-agent inspect services`",
            m.not_served.clone(),
        );
        registry.register(
            "affinity_entries",
            "sessionAffinity entries after the last sweep",
            m.affinity_entries.clone(),
        );
        registry.register(
            "affinity_expired",
            "sessionAffinity entries deleted because their timeout passed",
            m.affinity_expired.clone(),
        );
        registry.register(
            "affinity_swept",
            "sessionAffinity entries deleted because their Service or backend left",
            m.affinity_swept.clone(),
        );
        registry.register(
            "datagram_flows",
            "UDP sockets' flows to frontends (LB_DGRAM_FLOWS) after the last sweep",
            m.datagram_flows.clone(),
        );
        registry.register(
            "datagram_flows_expired",
            "Datagram flows deleted because their socket sent nothing for --conntrack-udp-timeout",
            m.datagram_flows_expired.clone(),
        );
        registry.register(
            "datagram_flows_swept",
            "Datagram flows deleted because their frontend or backend left",
            m.datagram_flows_swept.clone(),
        );
        registry.register(
            "udp_sockets_destroyed",
            "Connected UDP sockets destroyed because their backend left the Service",
            m.udp_sockets_destroyed.clone(),
        );
        registry.register(
            "conntrack_entries",
            "tc path conntrack entries (two per flow) after the last sweep",
            m.conntrack_entries.clone(),
        );
        registry.register(
            "conntrack_expired",
            "tc path conntrack entries deleted because their timeout passed",
            m.conntrack_expired.clone(),
        );
        registry.register(
            "conntrack_udp_purged",
            "tc path UDP conntrack entries deleted because their backend left",
            m.conntrack_udp_purged.clone(),
        );
        registry.register(
            "tc_attach_failing",
            "1 while a device the tc programs are asked for lacks one of them (lb_device_attach_failing says which; the reason is in /readyz and the log; retried every sweep)",
            m.tc_attach_failing.clone(),
        );
        registry.register(
            "device_attach_failing",
            "1 while a device the agent is asked for lacks our program at a hook (absent, or the attach failed; retried every sweep), 0 while it has it",
            m.device_attach_failing.clone(),
        );
        registry.register(
            "device_reattachments",
            "Programs attached again to a device that lacked them after its first attach: the device deleted and created again (a new ifindex), its TCX link or clsact filter removed, or it appeared later",
            m.device_reattachments.clone(),
        );
        registry.register(
            "kernel_feature",
            "1 for each kernel feature probed at start that this kernel has, 0 for each it lacks (see `lb-agent check`)",
            m.kernel_features.clone(),
        );
        registry.register(
            "refusal_errno",
            "The error of a connect or datagram to a Service without endpoints: 111 (ECONNREFUSED), or 1 (EPERM) where the kernel has no bpf_set_retval in sock_addr programs",
            m.refusal_errno.clone(),
        );
        registry.register(
            "datapath_events",
            "Kernel program events by kind (LB_STATS): translations, refusals, and every tc drop by its reason",
            m.datapath_events.clone(),
        );
        registry.register(
            "outlier_ejections",
            "Backends quarantined by outlier detection on this node, by reason: refused (connects answered with an RST), timeout (SYNs unanswered for a second) or unreachable (an ICMP error before any answer)",
            m.outlier_ejections.clone(),
        );
        registry.register(
            "backends_quarantined",
            "Backends in quarantine on this node now (new connections avoid them under --outlier-detection on), as of the last sweep",
            m.backends_quarantined.clone(),
        );
        registry.register(
            "scheduler_choices",
            "Backends chosen for new connections and flows on this node, by scheduler (--algorithm, lb-agent.dev/lb-algorithm); sessionAffinity hits and a flow's later packets are not choices",
            m.scheduler_choices.clone(),
        );
        Self {
            registry: Arc::new(registry),
            ..m
        }
    }

    /// Adds what the kernel counted since the last call; `totals` are the
    /// `LB_STATS` sums over CPUs, by `lb_common::stat` index. Totals that
    /// went down (the maps were recreated) count afresh from zero.
    pub fn record_datapath_events(&self, totals: &[u64]) {
        let mut seen = self.datapath_seen.lock().expect("metrics lock");
        seen.resize(totals.len(), 0);
        for (i, (&now, before)) in totals.iter().zip(seen.iter_mut()).enumerate() {
            let delta = if now >= *before { now - *before } else { now };
            *before = now;
            let name = lb_common::stat::NAMES.get(i).copied().unwrap_or("unknown");
            if let Some(reason) = name.strip_prefix("ejected_") {
                self.outlier_ejections
                    .get_or_create(&ReasonLabel {
                        reason: reason.to_owned(),
                    })
                    .inc_by(delta);
                continue;
            }
            if let Some(algorithm) = name.strip_prefix("chosen_") {
                self.scheduler_choices
                    .get_or_create(&AlgorithmLabel {
                        algorithm: algorithm.to_owned(),
                    })
                    .inc_by(delta);
                continue;
            }
            self.datapath_events
                .get_or_create(&EventLabel {
                    event: name.to_owned(),
                })
                .inc_by(delta);
        }
    }

    /// The kernel's probed features and the refusal chosen for it.
    pub fn record_kernel(&self, features: &[(&str, bool)], refusal_errno: i32) {
        for (name, present) in features {
            self.kernel_features
                .get_or_create(&FeatureLabel {
                    feature: (*name).to_owned(),
                })
                .set(i64::from(*present));
        }
        self.refusal_errno.set(i64::from(refusal_errno));
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_counters_are_added_as_they_grow() {
        let m = Metrics::new();
        let mut totals = vec![0u64; lb_common::stat::COUNT as usize];
        totals[lb_common::stat::TC_DROP_INVALID as usize] = 3;
        m.record_datapath_events(&totals);
        totals[lb_common::stat::TC_DROP_INVALID as usize] = 5;
        m.record_datapath_events(&totals);
        let text = m.encode();
        assert!(
            text.contains("lb_datapath_events_total{event=\"tc_drop_invalid\"} 5"),
            "{text}"
        );
        totals[lb_common::stat::CHOSEN as usize + lb_common::algorithm::LC as usize] = 7;
        m.record_datapath_events(&totals);
        let text = m.encode();
        assert!(
            text.contains("lb_scheduler_choices_total{algorithm=\"lc\"} 7"),
            "{text}"
        );
        assert!(!text.contains("event=\"chosen_"), "{text}");
        // Recreated maps start from zero again.
        totals[lb_common::stat::TC_DROP_INVALID as usize] = 1;
        m.record_datapath_events(&totals);
        assert!(m
            .encode()
            .contains("lb_datapath_events_total{event=\"tc_drop_invalid\"} 6"));
    }

    #[test]
    fn reject_label_drops_indices() {
        assert_eq!(
            RejectLabel::of("spec.ports[1].port").field,
            "spec.ports.port"
        );
        assert_eq!(RejectLabel::of("").field, "object");
    }

    #[test]
    fn encodes_registered_metrics() {
        let m = Metrics::new();
        m.frontends.set(3);
        m.watch_restarts
            .get_or_create(&KindLabel {
                kind: "Service".into(),
            })
            .inc();
        let text = m.encode();
        assert!(text.contains("lb_frontends_programmed 3"), "{text}");
        assert!(
            text.contains("lb_watch_restarts_total{kind=\"Service\"} 1"),
            "{text}"
        );
        assert!(text.contains("lb_sync_duration_seconds_bucket"), "{text}");
    }
}
