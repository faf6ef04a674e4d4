//! The proxy's health as kube-proxy defines it
//! (`pkg/proxy/healthcheck/proxy_health.go`): unhealthy once a received
//! change has waited longer than the timeout for a successful sync, and,
//! for `/healthz` only, while the Node is being deleted. The clock is
//! passed in, so the rules are table-tested without waiting.
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::core::v1::Node;

/// The taint the Cluster Autoscaler puts on a Node it is about to delete.
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// Whether load balancers should still send traffic to this node: not when
/// its Node object has a `deletionTimestamp` or the
/// [`TO_BE_DELETED_TAINT`]. Without a Node object (standalone mode, or not
/// listed yet) it is eligible, as kube-proxy's starts out.
pub fn node_eligible(node: Option<&Node>) -> bool {
    let Some(node) = node else {
        return true;
    };
    if node.metadata.deletion_timestamp.is_some() {
        return false;
    }
    !node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|taints| taints.iter().any(|t| t.key == TO_BE_DELETED_TAINT))
}

/// A moment on both clocks: the monotonic one decides how long an update
/// has waited, the wall clock is what the answers report.
#[derive(Debug, Clone, Copy)]
pub struct Now {
    pub mono: Instant,
    pub wall: SystemTime,
}

impl Now {
    pub fn real() -> Self {
        Self {
            mono: Instant::now(),
            wall: SystemTime::now(),
        }
    }
}

/// kube-proxy's `ProxyHealthServer` state, for our single proxier (one
/// program set serves both IP families).
#[derive(Debug, Clone)]
pub struct ProxyHealth {
    timeout: Duration,
    /// When the oldest change not yet programmed was received.
    oldest_pending: Option<Instant>,
    /// The end of the last successful sync (`None`: none yet).
    last_updated: Option<SystemTime>,
    node_eligible: bool,
}

/// What `/healthz` or `/livez` answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub healthy: bool,
    /// The JSON body, byte for byte in kube-proxy's layout, times in
    /// RFC 3339.
    pub body: String,
}

/// Go's zero `time.Time`, which kube-proxy reports before the first sync.
const ZERO_TIME: &str = "0001-01-01T00:00:00Z";

fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

impl ProxyHealth {
    /// Healthy, eligible, nothing pending: how kube-proxy starts.
    pub fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            oldest_pending: None,
            last_updated: None,
            node_eligible: true,
        }
    }

    /// A change was received that needs a sync (`QueuedUpdate`): only the
    /// oldest pending one counts.
    pub fn queued_update(&mut self, now: Instant) {
        self.oldest_pending.get_or_insert(now);
    }

    /// A sync programmed everything successfully (`Updated`).
    pub fn updated(&mut self, now: Now) {
        self.oldest_pending = None;
        self.last_updated = Some(now.wall);
    }

    /// From the Node object (`SyncNode`).
    pub fn set_node_eligible(&mut self, eligible: bool) {
        self.node_eligible = eligible;
    }

    pub fn node_eligible(&self) -> bool {
        self.node_eligible
    }

    /// The proxier's own health (`IsHealthy`), ignoring the Node: healthy
    /// unless a change has waited `timeout` or longer. Before the first
    /// successful sync it is healthy whatever is pending, as kube-proxy's
    /// (which only looks at proxiers that have updated once).
    pub fn is_healthy(&self, now: Instant) -> bool {
        match (self.last_updated, self.oldest_pending) {
            (Some(_), Some(pending)) => now.saturating_duration_since(pending) < self.timeout,
            _ => true,
        }
    }

    /// `/healthz`: healthy only while the proxier is healthy and the node
    /// eligible. When healthy, `lastUpdated` is the current time
    /// (kube-proxy keeps that for compatibility).
    pub fn healthz(&self, now: Now) -> Answer {
        let healthy = self.is_healthy(now.mono) && self.node_eligible;
        Answer {
            healthy,
            body: format!(
                r#"{{"lastUpdated": "{}","currentTime": "{}", "nodeEligible": {}}}"#,
                self.last_updated_shown(healthy, now),
                rfc3339(now.wall),
                self.node_eligible
            ),
        }
    }

    /// `/livez`: the proxier's health alone, for a liveness probe that must
    /// not restart a proxy whose node is being drained.
    pub fn livez(&self, now: Now) -> Answer {
        let healthy = self.is_healthy(now.mono);
        Answer {
            healthy,
            body: format!(
                r#"{{"lastUpdated": "{}","currentTime": "{}"}}"#,
                self.last_updated_shown(healthy, now),
                rfc3339(now.wall)
            ),
        }
    }

    fn last_updated_shown(&self, healthy: bool, now: Now) -> String {
        match (healthy, self.last_updated) {
            (true, _) => rfc3339(now.wall),
            (false, Some(t)) => rfc3339(t),
            (false, None) => ZERO_TIME.to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::{
        api::core::v1::{NodeSpec, Taint},
        apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time},
    };

    fn node(deleting: bool, taints: &[&str]) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some("n1".into()),
                deletion_timestamp: deleting.then(|| Time(Default::default())),
                ..Default::default()
            },
            spec: Some(NodeSpec {
                taints: Some(
                    taints
                        .iter()
                        .map(|k| Taint {
                            key: (*k).into(),
                            effect: "NoSchedule".into(),
                            ..Default::default()
                        })
                        .collect(),
                ),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn node_eligibility() {
        let cases: &[(&str, Option<Node>, bool)] = &[
            ("no Node object", None, true),
            ("plain Node", Some(node(false, &[])), true),
            ("Node without spec", Some(Node::default()), true),
            (
                "other taints",
                Some(node(false, &["node.kubernetes.io/unschedulable"])),
                true,
            ),
            ("being deleted", Some(node(true, &[])), false),
            (
                "autoscaler's taint",
                Some(node(false, &["a", TO_BE_DELETED_TAINT])),
                false,
            ),
        ];
        for (what, n, eligible) in cases {
            assert_eq!(node_eligible(n.as_ref()), *eligible, "{what}");
        }
    }

    #[derive(Debug, Clone, Copy)]
    enum Ev {
        Queued,
        Updated,
    }

    /// Events at seconds since the start, then the health asked at `at`,
    /// with a 60 s timeout (kube-proxy's default: twice its sync period).
    #[test]
    fn pending_updates_older_than_the_timeout_are_unhealthy() {
        use Ev::*;
        /// (name, events at their times, the time asked, healthy)
        type Case = (&'static str, &'static [(u64, Ev)], u64, bool);
        let cases: &[Case] = &[
            ("startup", &[], 1000, true),
            (
                "pending but never synced: starting up",
                &[(0, Queued)],
                1000,
                true,
            ),
            ("synced, nothing pending", &[(0, Updated)], 1000, true),
            (
                "pending, not late yet",
                &[(0, Updated), (10, Queued)],
                69,
                true,
            ),
            (
                "pending exactly the timeout",
                &[(0, Updated), (10, Queued)],
                70,
                false,
            ),
            ("pending longer", &[(0, Updated), (10, Queued)], 100, false),
            (
                "later changes do not reset the oldest",
                &[(0, Updated), (10, Queued), (50, Queued), (65, Queued)],
                75,
                false,
            ),
            (
                "a sync clears what was pending",
                &[(0, Updated), (10, Queued), (80, Updated)],
                81,
                true,
            ),
            (
                "then a new change counts from its own time",
                &[(0, Updated), (10, Queued), (80, Updated), (90, Queued)],
                149,
                true,
            ),
            (
                "and goes late in turn",
                &[(0, Updated), (10, Queued), (80, Updated), (90, Queued)],
                150,
                false,
            ),
        ];
        let t0 = Instant::now();
        let w0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let at = |s: u64| Now {
            mono: t0 + Duration::from_secs(s),
            wall: w0 + Duration::from_secs(s),
        };
        for (what, events, when, healthy) in cases {
            let mut h = ProxyHealth::new(Duration::from_secs(60));
            for (s, ev) in *events {
                match ev {
                    Queued => h.queued_update(at(*s).mono),
                    Updated => h.updated(at(*s)),
                }
            }
            assert_eq!(h.is_healthy(at(*when).mono), *healthy, "{what}");
            assert_eq!(h.livez(at(*when)).healthy, *healthy, "{what}: /livez");
            assert_eq!(h.healthz(at(*when)).healthy, *healthy, "{what}: /healthz");
            h.set_node_eligible(false);
            assert!(!h.healthz(at(*when)).healthy, "{what}: not eligible");
            assert_eq!(h.livez(at(*when)).healthy, *healthy, "{what}: /livez");
        }
    }

    #[test]
    fn bodies_in_kube_proxys_layout() {
        let t0 = Instant::now();
        let w0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let at = |s: u64| Now {
            mono: t0 + Duration::from_secs(s),
            wall: w0 + Duration::from_secs(s),
        };
        let mut h = ProxyHealth::new(Duration::from_secs(60));
        // Healthy: lastUpdated is now, whatever the last sync.
        h.updated(at(5));
        assert_eq!(
            h.healthz(at(20)).body,
            r#"{"lastUpdated": "2023-11-14T22:13:40.000Z","currentTime": "2023-11-14T22:13:40.000Z", "nodeEligible": true}"#
        );
        assert_eq!(
            h.livez(at(20)).body,
            r#"{"lastUpdated": "2023-11-14T22:13:40.000Z","currentTime": "2023-11-14T22:13:40.000Z"}"#
        );
        // Unhealthy: the last successful sync.
        h.queued_update(at(10).mono);
        let a = h.healthz(at(70));
        assert!(!a.healthy);
        assert_eq!(
            a.body,
            r#"{"lastUpdated": "2023-11-14T22:13:25.000Z","currentTime": "2023-11-14T22:14:30.000Z", "nodeEligible": true}"#
        );
        // Never synced, node being deleted: Go's zero time.
        let mut h = ProxyHealth::new(Duration::from_secs(60));
        h.set_node_eligible(false);
        let a = h.healthz(at(0));
        assert!(!a.healthy);
        let v: serde_json::Value = serde_json::from_str(&a.body).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"lastUpdated": "0001-01-01T00:00:00Z",
                "currentTime": "2023-11-14T22:13:20.000Z", "nodeEligible": false})
        );
        assert!(h.livez(at(0)).healthy);
    }
}
