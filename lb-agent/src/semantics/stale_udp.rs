//! Which connected UDP flows are stale after a change: kube-proxy's rule for
//! clearing UDP conntrack entries, applied to sockets.
//!
//! kube-proxy (`pkg/proxy/conntrack/cleanup.go`, `CleanStaleEntries`, which
//! reconciles the whole conntrack table after every sync) works per UDP
//! Service port and IP family:
//! - it collects the IPs of the port's *serving* endpoints (`IsServing()`:
//!   the EndpointSlice condition `serving`, so serving-terminating endpoints
//!   count); "changes to the service should not affect existing flows, so we
//!   do not take traffic policies, topology, or terminating status of the
//!   service into account";
//! - a port without serving endpoints is left alone ("a Service without
//!   endpoints does not require to clean the conntrack entries associated"),
//!   and so is a Service that is gone (its addresses are in no map);
//! - otherwise it deletes every entry addressed to the ClusterIP, an
//!   externalIP or a LoadBalancer IP on the port, or to the NodePort on any
//!   address, whose reply does not come from a serving endpoint's IP. That
//!   is two cases: entries DNATed to an endpoint that was removed or stopped
//!   serving, and entries to the Service address itself that were never
//!   DNATed (made while nothing served it, or before it was programmed).
//!
//! The socket path has no conntrack: a connected UDP socket keeps the backend
//! the connect hook chose, and the equivalent of deleting its entry is
//! destroying the socket, so that the application reconnects through the
//! hook (`datapath::sockets`). The same rule, applied on each programmed
//! change of a UDP frontend against its previous state ([`frontend_change`]):
//! - backends that were serving and are not any more are stale, once the
//!   frontend has a serving endpoint; while it has none they are kept in
//!   mind until it gets one, as kube-proxy leaves the entries alone until
//!   then (the application then reconnects to a live backend rather than
//!   to a refusal);
//! - when the frontend gets serving endpoints (new, or none before), sockets
//!   connected to its own address and port are stale: they never went
//!   through the hook, which rewrites every connect to a frontend it knows.
//!
//! Finding those sockets needs no `LB_REV_SOCK` entry (an LRU, which may have
//! evicted the socket's): the sockets are found by their peer, which the
//! kernel reports as the backend (or the frontend's own address). A backend
//! address names no Service, though, where kube-proxy's entry carries the
//! Service IP. So a socket whose peer is a stale backend is destroyed
//! ([`StaleUdp::is_stale`]) when its `LB_REV_SOCK` entry names a frontend the
//! backend is stale for, or, with or without an entry, when the backend
//! serves no UDP frontend at all any more. A backend that left one Service
//! but still serves another at the same address and port keeps the sockets
//! whose entry is gone: they may be the other Service's.
use std::{
    collections::BTreeSet,
    net::{IpAddr, SocketAddr},
};

use crate::semantics::model::{BackendAddr, DesiredState, Frontend, Protocol};

/// What one programmed change of a UDP frontend makes stale.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct FrontendChange {
    /// Backends that stopped serving: flows through the frontend to them.
    pub stale: Vec<BackendAddr>,
    /// The frontend got serving endpoints: flows addressed to the frontend
    /// itself, which went around the hook.
    pub newly_serving: bool,
    /// Backends that stopped serving while nothing served the frontend, to
    /// be made stale once something does; kept for the next change.
    pub stopped: Vec<BackendAddr>,
}

/// The change of a UDP frontend from serving `before` (`None`: it is new;
/// `stopped`: what stopped serving while nothing served it) to serving
/// `after` (`FrontendState::serving`). A frontend that goes away is no
/// change at all: kube-proxy leaves the flows of a deleted Service alone.
pub fn frontend_change(
    before: Option<&[BackendAddr]>,
    stopped: &[BackendAddr],
    after: &[BackendAddr],
) -> FrontendChange {
    let was: BTreeSet<BackendAddr> = before
        .into_iter()
        .flatten()
        .chain(stopped)
        .copied()
        .collect();
    let gone: Vec<BackendAddr> = was.into_iter().filter(|b| !after.contains(b)).collect();
    if after.is_empty() {
        return FrontendChange {
            stopped: gone,
            ..Default::default()
        };
    }
    FrontendChange {
        stale: gone,
        newly_serving: before.is_none_or(<[BackendAddr]>::is_empty),
        stopped: Vec::new(),
    }
}

/// The stale UDP flows of one sync, over every frontend it changed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct StaleUdp {
    /// `(frontend, backend)`: the backend stopped serving the frontend.
    pub stale: BTreeSet<(Frontend, BackendAddr)>,
    /// Frontends that got serving endpoints.
    pub newly_serving: BTreeSet<Frontend>,
    /// The stale backends that serve no UDP frontend now (see
    /// [`find_orphans`](Self::find_orphans)).
    pub orphaned: BTreeSet<BackendAddr>,
}

impl StaleUdp {
    /// Records what `change` of `frontend` made stale.
    pub fn add(&mut self, frontend: Frontend, change: &FrontendChange) {
        self.stale
            .extend(change.stale.iter().map(|b| (frontend, *b)));
        if change.newly_serving {
            self.newly_serving.insert(frontend);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.stale.is_empty() && self.newly_serving.is_empty()
    }

    /// Finds the stale backends that no UDP frontend of `desired` (the
    /// state just programmed) counts as serving: sockets to those are stale
    /// whichever frontend they went through. Looks at every UDP frontend,
    /// so only when something is stale.
    pub fn find_orphans(&mut self, desired: &DesiredState) {
        let mut orphaned: BTreeSet<BackendAddr> = self.stale.iter().map(|(_, b)| *b).collect();
        if !orphaned.is_empty() {
            for (frontend, state) in &desired.frontends {
                if frontend.protocol == Protocol::Udp {
                    for b in &state.serving {
                        orphaned.remove(b);
                    }
                }
            }
        }
        self.orphaned = orphaned;
    }

    /// The socket peers to look for: stale backends and the frontends that
    /// got serving endpoints.
    pub fn peers(&self) -> BTreeSet<SocketAddr> {
        let backends = self
            .stale
            .iter()
            .map(|(_, b)| SocketAddr::new(b.addr, b.port));
        let frontends = self
            .newly_serving
            .iter()
            .map(|f| SocketAddr::new(f.addr, f.port));
        backends.chain(frontends).collect()
    }

    /// Whether a connected UDP socket whose peer is `peer` is stale, given
    /// the frontend its `LB_REV_SOCK` entry names (`None`: no entry, or one
    /// naming no frontend this sync changed).
    pub fn is_stale(&self, peer: SocketAddr, via: Option<&Frontend>) -> bool {
        let ip: IpAddr = peer.ip().to_canonical();
        if self
            .newly_serving
            .iter()
            .any(|f| f.addr == ip && f.port == peer.port())
        {
            return true;
        }
        let backend = BackendAddr {
            addr: ip,
            port: peer.port(),
            protocol: Protocol::Udp,
        };
        self.orphaned.contains(&backend) || via.is_some_and(|f| self.stale.contains(&(*f, backend)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::semantics::model::{FrontendKind, FrontendState, Scope, ServiceName};

    fn b(n: u8) -> BackendAddr {
        BackendAddr {
            addr: IpAddr::from([10, 244, 1, n]),
            port: 53,
            protocol: Protocol::Udp,
        }
    }

    fn list(ns: &[u8]) -> Vec<BackendAddr> {
        ns.iter().map(|&n| b(n)).collect()
    }

    fn fe(ip: &str) -> Frontend {
        Frontend {
            addr: ip.parse().unwrap(),
            port: 53,
            protocol: Protocol::Udp,
            scope: Scope::Internal,
        }
    }

    #[test]
    fn frontend_changes() {
        struct Case {
            name: &'static str,
            before: Option<&'static [u8]>,
            stopped: &'static [u8],
            after: &'static [u8],
            stale: &'static [u8],
            newly_serving: bool,
            remembered: &'static [u8],
        }
        let cases = [
            Case {
                name: "new frontend with serving endpoints: sockets to its own address are stale",
                before: None,
                stopped: &[],
                after: &[1, 2],
                stale: &[],
                newly_serving: true,
                remembered: &[],
            },
            Case {
                name: "new frontend without serving endpoints: nothing",
                before: None,
                stopped: &[],
                after: &[],
                stale: &[],
                newly_serving: false,
                remembered: &[],
            },
            Case {
                name: "unchanged: nothing",
                before: Some(&[1, 2]),
                stopped: &[],
                after: &[1, 2],
                stale: &[],
                newly_serving: false,
                remembered: &[],
            },
            Case {
                name: "an endpoint stops serving (removed or not serving) while others serve",
                before: Some(&[1, 2, 3]),
                stopped: &[],
                after: &[1, 3],
                stale: &[2],
                newly_serving: false,
                remembered: &[],
            },
            Case {
                name: "an endpoint added: nothing",
                before: Some(&[1]),
                stopped: &[],
                after: &[1, 2],
                stale: &[],
                newly_serving: false,
                remembered: &[],
            },
            Case {
                name: "the last one stops serving: kept in mind, nothing stale yet",
                before: Some(&[1, 2]),
                stopped: &[],
                after: &[],
                stale: &[],
                newly_serving: false,
                remembered: &[1, 2],
            },
            Case {
                name: "still nothing serving: what stopped is still kept",
                before: Some(&[]),
                stopped: &[1, 2],
                after: &[],
                stale: &[],
                newly_serving: false,
                remembered: &[1, 2],
            },
            Case {
                name: "something serves again: what stopped meanwhile is stale, and sockets to the address",
                before: Some(&[]),
                stopped: &[1, 2],
                after: &[3],
                stale: &[1, 2],
                newly_serving: true,
                remembered: &[],
            },
            Case {
                name: "one that stopped serves again: not stale",
                before: Some(&[]),
                stopped: &[1, 2],
                after: &[2, 3],
                stale: &[1],
                newly_serving: true,
                remembered: &[],
            },
        ];
        for c in cases {
            let before = c.before.map(list);
            let got = frontend_change(before.as_deref(), &list(c.stopped), &list(c.after));
            let want = FrontendChange {
                stale: list(c.stale),
                newly_serving: c.newly_serving,
                stopped: list(c.remembered),
            };
            assert_eq!(got, want, "{}", c.name);
        }
    }

    fn udp_state(serving: &[u8]) -> FrontendState {
        FrontendState {
            service: ServiceName {
                namespace: "demo".into(),
                name: "dns".into(),
            },
            port_name: "dns".into(),
            kind: FrontendKind::ClusterIp,
            active: Vec::new(),
            terminating: Vec::new(),
            serving: list(serving),
            affinity_timeout: None,
            selection: Default::default(),
            algorithm: Default::default(),
            reject: false,
            source_ranges: false,
            outlier: Default::default(),
        }
    }

    /// Backend 2 leaves `dns` (10.96.0.10) but still serves `other`
    /// (10.96.0.11) at the same address and port; backend 3 leaves `dns`
    /// and serves nothing; `new` (10.96.0.12) just got serving endpoints.
    #[test]
    fn which_sockets_are_stale() {
        let (dns, other, new) = (fe("10.96.0.10"), fe("10.96.0.11"), fe("10.96.0.12"));
        let mut stale = StaleUdp::default();
        stale.add(
            dns,
            &frontend_change(Some(&list(&[1, 2, 3])), &[], &list(&[1])),
        );
        stale.add(other, &frontend_change(Some(&list(&[2])), &[], &list(&[2])));
        stale.add(new, &frontend_change(None, &[], &list(&[4])));
        let mut desired = DesiredState::default();
        desired.frontends.insert(dns, udp_state(&[1]).into());
        desired.frontends.insert(other, udp_state(&[2]).into());
        desired.frontends.insert(new, udp_state(&[4]).into());
        // A TCP frontend on backend 3's address and port serves nothing
        // UDP: it does not keep backend 3's UDP sockets.
        desired.frontends.insert(
            Frontend {
                protocol: Protocol::Tcp,
                ..dns
            },
            udp_state(&[3]).into(),
        );
        stale.find_orphans(&desired);
        assert_eq!(stale.orphaned, BTreeSet::from([b(3)]));
        let sa = |s: &str| -> SocketAddr { s.parse().unwrap() };
        assert_eq!(
            stale.peers(),
            BTreeSet::from([
                sa("10.244.1.2:53"),
                sa("10.244.1.3:53"),
                sa("10.96.0.12:53")
            ])
        );
        let cases: &[(&str, &str, Option<Frontend>, bool)] = &[
            (
                "left dns, sent through dns",
                "10.244.1.2:53",
                Some(dns),
                true,
            ),
            (
                "left dns, sent through other",
                "10.244.1.2:53",
                Some(other),
                false,
            ),
            (
                "left dns, serves other, no entry",
                "10.244.1.2:53",
                None,
                false,
            ),
            ("serves nothing, no entry", "10.244.1.3:53", None, true),
            (
                "serves nothing, an entry naming another",
                "10.244.1.3:53",
                Some(other),
                true,
            ),
            (
                "IPv4-mapped peer of an AF_INET6 socket",
                "[::ffff:10.244.1.3]:53",
                None,
                true,
            ),
            ("still serving", "10.244.1.1:53", Some(dns), false),
            (
                "another port of a stale address",
                "10.244.1.3:54",
                None,
                false,
            ),
            (
                "connected to a newly serving frontend",
                "10.96.0.12:53",
                None,
                true,
            ),
            (
                "connected to a frontend that served before",
                "10.96.0.10:53",
                None,
                false,
            ),
        ];
        for (name, peer, via, want) in cases {
            assert_eq!(stale.is_stale(sa(peer), via.as_ref()), *want, "{name}");
        }
    }

    #[test]
    fn nothing_stale_is_empty() {
        let mut stale = StaleUdp::default();
        stale.add(
            fe("10.96.0.10"),
            &frontend_change(Some(&list(&[1])), &[], &[]),
        );
        assert!(stale.is_empty());
        stale.find_orphans(&DesiredState::default());
        assert!(stale.orphaned.is_empty());
        assert!(stale.peers().is_empty());
    }
}
