//! The guarded Service CIDRs at tc ingress: a packet from outside to an
//! address of them that no Service holds (an unallocated ClusterIP) is
//! dropped, as kube-proxy's `cluster-ips-check` chain does in PREROUTING,
//! whatever its protocol or port; a packet to a Service's address goes on
//! as before (its own lookups decide).
use aya_ebpf::{bindings::__sk_buff, programs::TcContext};
use lb_common::{ipv4_mapped, scope, stat, ServiceKey, ServiceRanges};

use super::{at, ETH_HLEN, ETH_P_IP, ETH_P_IPV6, TC_ACT_SHOT, TC_ACT_UNSPEC};
use crate::maps::{count, guarded_ranges, LB_SERVICES};

/// The guarded CIDRs, `None` when there are none: the one check every
/// packet pays (nothing when the agent loaded the programs without the
/// guard, see `maps::guarded_ranges`).
#[inline(always)]
pub fn ranges() -> Option<&'static ServiceRanges> {
    guarded_ranges()
}

/// A packet to an address of `ranges`: `TC_ACT_SHOT` when no Service
/// holds the address (counted), else `TC_ACT_UNSPEC` (the rest of
/// `ingress` decides). A function of its own, so that its address and
/// key stay off `tc_ingress`'s frame, on which the deepest chain of calls
/// builds.
#[no_mangle]
#[inline(never)]
pub extern "C" fn tc_ingress_guard(skb: *mut __sk_buff) -> i32 {
    let ctx = &TcContext::new(skb);
    let Some(ranges) = guarded_ranges() else {
        return TC_ACT_UNSPEC;
    };
    let Some(dst) = destination(ctx) else {
        return TC_ACT_UNSPEC;
    };
    if !ranges.contains(&dst) || held(dst) {
        return TC_ACT_UNSPEC;
    }
    count(stat::TC_DROP_UNALLOCATED);
    TC_ACT_SHOT
}

/// The packet's destination address (16-byte form), for IPv4 and IPv6.
#[inline(always)]
fn destination(ctx: &TcContext) -> Option<[u8; 16]> {
    match u16::from_be(at::<u16>(ctx, 12)?) {
        ETH_P_IP => Some(ipv4_mapped(at::<[u8; 4]>(ctx, ETH_HLEN + 16)?)),
        ETH_P_IPV6 => at::<[u8; 16]>(ctx, ETH_HLEN + 24),
        _ => None,
    }
}

/// Whether a Service holds `addr`: its VIP marker in either scope (a
/// ClusterIP's is `INTERNAL`; an `EXTERNAL` one is a ClusterIP served from
/// outside, `--external-clusterip`, or an external address inside the
/// range). The agent writes a marker once and never replaces it, so a
/// lookup cannot miss it while it is there (see `lb::lookup_frontend`).
#[inline(always)]
fn held(addr: [u8; 16]) -> bool {
    LB_SERVICES
        .get_ptr(&ServiceKey::wildcard(addr, scope::INTERNAL))
        .is_some()
        || LB_SERVICES
            .get_ptr(&ServiceKey::wildcard(addr, scope::EXTERNAL))
            .is_some()
}
