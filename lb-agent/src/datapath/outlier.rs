//! What outlier detection decided in the kernel (`LB_BACKEND_HEALTH`),
//! told to the operator: a log line per quarantine and per release naming
//! the backend, its Services, the reason and the length, and the number
//! of backends in quarantine for `/metrics`. The kernel decides alone;
//! this only watches, cheaply: a full look at the watched backends only
//! when the kernel's ejection counters moved, else only at the known
//! quarantines' ends.
use std::collections::{BTreeMap, BTreeSet};

use lb_common::{outlier, BackendHealth};

use crate::{datapath::reconcile::OutlierBackend, semantics::model::BackendAddr};

/// A quarantine the agent has reported and not yet seen end.
#[derive(Debug, Clone)]
struct Known {
    until_ns: u64,
    addr: BackendAddr,
    services: BTreeSet<String>,
}

#[derive(Debug, Default)]
pub struct QuarantineWatch {
    /// The kernel's ejection counters' sum at the last full look.
    ejections_seen: Option<u64>,
    known: BTreeMap<u32, Known>,
}

/// What one `check` found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// Backend ids newly quarantined.
    pub quarantined: Vec<u32>,
    /// Backend ids whose quarantine ended (or that left their Services).
    pub released: Vec<u32>,
    /// Backends in quarantine now.
    pub in_quarantine: usize,
}

impl QuarantineWatch {
    /// Looks at the kernel's record at `now` (monotonic ns), given the
    /// kernel's ejection total; `backends` lists what is watched, only
    /// called when the total moved; `health` reads one backend's record.
    pub fn check(
        &mut self,
        ejections: u64,
        now: u64,
        backends: impl FnOnce() -> BTreeMap<u32, OutlierBackend>,
        health: impl Fn(u32) -> Option<BackendHealth>,
    ) -> Changes {
        let mut changes = Changes::default();
        if self.ejections_seen != Some(ejections) {
            self.ejections_seen = Some(ejections);
            let watched = backends();
            for (id, b) in &watched {
                let Some(h) = health(*id) else { continue };
                if !h.quarantined(now) {
                    continue;
                }
                let fresh = self.known.get(id).is_none_or(|k| k.until_ns != h.until_ns);
                if fresh {
                    log_quarantine(b, &h, now);
                    changes.quarantined.push(*id);
                }
                self.known.insert(
                    *id,
                    Known {
                        until_ns: h.until_ns,
                        addr: b.addr,
                        services: b.services.clone(),
                    },
                );
            }
            // Backends no longer watched (gone from their Services, which
            // resets their record) leave quarantine too.
            let gone: Vec<u32> = self
                .known
                .keys()
                .filter(|id| !watched.contains_key(id))
                .copied()
                .collect();
            for id in gone {
                if let Some(k) = self.known.remove(&id) {
                    log_release(&k, "its Services no longer list it");
                    changes.released.push(id);
                }
            }
        }
        let due: Vec<u32> = self
            .known
            .iter()
            .filter(|(_, k)| k.until_ns <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in due {
            // Quarantined again meanwhile: the ejection counters moved, and
            // the next full look reports it.
            if let Some(k) = self.known.remove(&id) {
                log_release(&k, "its time is up: new connections may choose it again");
                changes.released.push(id);
            }
        }
        changes.in_quarantine = self.known.len();
        changes
    }
}

fn log_quarantine(b: &OutlierBackend, h: &BackendHealth, now: u64) {
    let reason = outlier::NAMES
        .get(h.reason as usize)
        .copied()
        .unwrap_or("unknown");
    let services: Vec<&str> = b.services.iter().map(String::as_str).collect();
    let seconds = (h.until_ns - now) as f64 / 1e9;
    if b.avoided {
        tracing::warn!(
            backend = %b.addr,
            services = ?services,
            reason,
            seconds = format_args!("{seconds:.1}"),
            in_a_row = h.ejections,
            "backend quarantined by outlier detection: new connections from this node avoid it"
        );
    } else {
        tracing::warn!(
            backend = %b.addr,
            services = ?services,
            reason,
            seconds = format_args!("{seconds:.1}"),
            in_a_row = h.ejections,
            "backend would be quarantined by outlier detection (dry-run: still chosen)"
        );
    }
}

fn log_release(k: &Known, why: &str) {
    let services: Vec<&str> = k.services.iter().map(String::as_str).collect();
    tracing::info!(
        backend = %k.addr,
        services = ?services,
        "backend released from quarantine: {why}"
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::semantics::model::Protocol;

    fn backend(port: u16) -> OutlierBackend {
        OutlierBackend {
            addr: BackendAddr {
                addr: "10.0.0.1".parse().unwrap(),
                port,
                protocol: Protocol::Tcp,
            },
            services: ["shop/web".to_string()].into(),
            avoided: true,
        }
    }

    fn quarantined(until_ns: u64) -> BackendHealth {
        BackendHealth {
            until_ns,
            ejections: 1,
            reason: outlier::REFUSED,
            ..Default::default()
        }
    }

    #[test]
    fn reports_a_quarantine_once_and_its_end_when_due() {
        let mut w = QuarantineWatch::default();
        let watched = || BTreeMap::from([(7, backend(80)), (8, backend(81))]);
        let health = |id: u32| {
            Some(if id == 7 {
                quarantined(100)
            } else {
                BackendHealth::default()
            })
        };
        let c = w.check(1, 50, watched, health);
        assert_eq!(
            (c.quarantined, c.released, c.in_quarantine),
            (vec![7], vec![], 1)
        );
        // The counters did not move: no full look, nothing new.
        let c = w.check(1, 60, || panic!("no full look"), health);
        assert_eq!(
            (c.quarantined, c.released, c.in_quarantine),
            (vec![], vec![], 1)
        );
        let c = w.check(1, 100, || panic!("no full look"), health);
        assert_eq!(
            (c.quarantined, c.released, c.in_quarantine),
            (vec![], vec![7], 0)
        );
    }

    #[test]
    fn a_new_quarantine_of_a_known_backend_is_reported_again() {
        let mut w = QuarantineWatch::default();
        let watched = || BTreeMap::from([(7, backend(80))]);
        w.check(1, 50, watched, |_| Some(quarantined(100)));
        let c = w.check(2, 150, watched, |_| Some(quarantined(300)));
        assert_eq!((c.quarantined, c.in_quarantine), (vec![7], 1));
    }

    #[test]
    fn a_backend_that_leaves_its_services_leaves_quarantine() {
        let mut w = QuarantineWatch::default();
        w.check(
            1,
            50,
            || BTreeMap::from([(7, backend(80))]),
            |_| Some(quarantined(100)),
        );
        let c = w.check(2, 60, BTreeMap::new, |_| None);
        assert_eq!((c.released, c.in_quarantine), (vec![7], 0));
    }
}
