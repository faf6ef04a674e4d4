//! Datagram flows of the socket path (`LB_DGRAM_FLOWS`): the agent's half.
//! The kernel creates and refreshes a flow per UDP socket and frontend and
//! honours `--conntrack-udp-timeout` itself; the agent deletes flows that
//! can no longer bind (expired, frontend gone or now with sessionAffinity,
//! backend no longer serving in it), so that a socket whose backend left
//! moves on at its next datagram and the map stays bounded under churn.
use std::collections::{BTreeMap, BTreeSet};

use lb_common::{DatagramFlow, DatagramFlowKey};

use crate::datapath::sweep::Stale;

/// A frontend as a `DatagramFlowKey` names it: address (16-byte form),
/// port, protocol.
pub type FlowFrontend = ([u8; 16], u16, u8);

/// The frontend of the flow under `key`.
pub fn frontend_of(key: &DatagramFlowKey) -> FlowFrontend {
    (key.addr, key.port, key.proto)
}

/// What a frontend allows the flows to it: its service id (the kernel
/// reads flows of that id only) and the backends a flow may stay on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DatagramPolicy {
    pub service_id: u32,
    pub serving: BTreeSet<u32>,
    /// The frontend's scheduler counts flows (lc, sed, nq): its live flows
    /// count for their backends (`BackendState::flows`).
    pub counts: bool,
}

/// The backends a flow may stay on, of a frontend whose slots are `slots`
/// (active, then terminating, then any Maglev table): every serving one,
/// terminating included. kube-proxy likewise keeps a UDP flow's conntrack
/// entry until its endpoint stops serving, and the tc path keeps its UDP
/// flows so: a terminating pod drains its flows, while new flows go to
/// the active backends only.
pub fn serving_backends(slots: &[u32], active: u16, terminating: u16) -> BTreeSet<u32> {
    let serving = (active as usize + terminating as usize).min(slots.len());
    slots[..serving].iter().copied().collect()
}

/// Whether the flow `flow` under `key` can no longer bind, given the
/// policies of the frontends whose flows the kernel keeps, and the UDP
/// timeout in seconds (as the kernel reads it).
pub fn stale(
    key: &DatagramFlowKey,
    flow: &DatagramFlow,
    policies: &BTreeMap<FlowFrontend, DatagramPolicy>,
    timeout_s: u32,
    now_ns: u64,
) -> Option<Stale> {
    match policies.get(&frontend_of(key)) {
        None => Some(Stale::NoPolicy),
        // The frontend was removed and created again: the kernel ignores it.
        Some(p) if p.service_id != flow.service_id => Some(Stale::NoPolicy),
        Some(p) if !p.serving.contains(&flow.backend_id) => Some(Stale::BackendLeft),
        Some(_) if !flow.live(now_ns, timeout_s) => Some(Stale::Expired),
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VIP: [u8; 16] = lb_common::ipv4_mapped([10, 96, 0, 10]);

    fn key(cookie: u64, port: u16) -> DatagramFlowKey {
        DatagramFlowKey {
            cookie,
            addr: VIP,
            port,
            proto: lb_common::proto::UDP,
            _pad: [0; 5],
        }
    }

    fn flow(backend_id: u32, service_id: u32, last_used_s: u64) -> DatagramFlow {
        DatagramFlow {
            backend_id,
            service_id,
            last_used_ns: last_used_s * 1_000_000_000,
        }
    }

    #[test]
    fn serving_includes_the_terminating_backends() {
        // 2 active, 1 terminating, then a Maglev table.
        let slots = [1, 2, 3, 1, 2, 2, 1];
        assert_eq!(serving_backends(&slots, 2, 1), BTreeSet::from([1, 2, 3]));
        assert_eq!(serving_backends(&[3, 4], 0, 2), BTreeSet::from([3, 4]));
        assert!(serving_backends(&[], 0, 0).is_empty());
        // Counts larger than the slots (a broken adopted entry) clamp.
        assert_eq!(serving_backends(&[5], 0, 3), BTreeSet::from([5]));
    }

    #[test]
    fn table() {
        let policies = BTreeMap::from([(
            (VIP, 53, lb_common::proto::UDP),
            DatagramPolicy {
                service_id: 4,
                serving: BTreeSet::from([7, 8]),
                counts: false,
            },
        )]);
        let now = 100 * 1_000_000_000;
        let cases = [
            ("active flow stays", key(1, 53), flow(7, 4, 95), None),
            (
                "exactly at the timeout stays",
                key(2, 53),
                flow(8, 4, 70),
                None,
            ),
            (
                "used on another CPU after the clock was read",
                key(3, 53),
                flow(8, 4, 101),
                None,
            ),
            (
                "idle past the timeout goes",
                key(4, 53),
                flow(7, 4, 69),
                Some(Stale::Expired),
            ),
            (
                "backend left the frontend",
                key(5, 53),
                flow(9, 4, 99),
                Some(Stale::BackendLeft),
            ),
            (
                "frontend removed and created again",
                key(6, 53),
                flow(7, 3, 99),
                Some(Stale::NoPolicy),
            ),
            (
                "frontend gone (or with sessionAffinity now)",
                key(7, 54),
                flow(7, 4, 99),
                Some(Stale::NoPolicy),
            ),
        ];
        for (name, k, f, want) in cases {
            assert_eq!(stale(&k, &f, &policies, 30, now), want, "{name}");
        }
    }
}
