//! `loadBalancerSourceRanges` for pods and host processes.
//!
//! kube-proxy checks the ranges of a LoadBalancer IP on PREROUTING and on
//! OUTPUT, so they bind clients on the node too. The socket path rewrites
//! at connect, before the kernel has chosen the source address, so
//! `sock::forward` only marks the socket (`LB_SOCK_CHECK`) and this
//! program, at the cgroup's egress, checks the source of its packets once
//! it is known: a source outside the ranges is dropped, as kube-proxy's
//! `KUBE-FW` / `firewall-check` drop it. Packets of unmarked sockets (all
//! but those to restricted frontends) cost one failed storage lookup, and
//! nothing while no frontend has ranges (`TcConfig::source_ranges`).
use core::ptr;

use aya_ebpf::{
    bindings::bpf_sock,
    helpers::generated::{bpf_get_socket_cookie, bpf_sk_fullsock, bpf_sk_storage_get},
    programs::SkBuffContext,
};
use lb_common::{
    ipv4_mapped, proto, source_check, source_range, stat, SockSourceCheck, SourceRangeData,
};

use crate::maps::{count, LB_SOCK_CHECK, LB_SOURCE_RANGES, LB_TC_CONFIG};

const PASS: i32 = 1;
const DROP: i32 = 0;

/// The fields of an outgoing packet the check needs.
struct Packet {
    src: [u8; 16],
    dst: [u8; 16],
    dport: u16,
    proto: u8,
}

/// Socket storage of `sk` in `map` (a `SkStorage` static), or null.
///
/// # Safety
/// `sk` must be a full socket the verifier knows as such.
#[inline(always)]
unsafe fn storage<M, T>(map: &'static M, sk: *mut bpf_sock) -> *mut T {
    let map = ptr::from_ref(map).cast_mut().cast();
    // SAFETY: `map` is a socket storage map definition; no value, no flags:
    // look up only.
    unsafe { bpf_sk_storage_get(map, sk.cast(), ptr::null_mut(), 0) }.cast()
}

pub fn egress(ctx: &SkBuffContext) -> i32 {
    // No frontend has ranges: no socket is checked. One marked while some
    // had them is let through, as its frontend's ranges are gone. An array
    // lookup the verifier inlines, where the mark costs two helper calls
    // on every packet of the cgroup.
    if !LB_TC_CONFIG.get(0).is_some_and(|c| c.source_ranges != 0) {
        return PASS;
    }
    // SAFETY: the context is valid for the run; `sk` may be null.
    let sk = unsafe { (*ctx.skb.skb).__bindgen_anon_2.sk };
    if sk.is_null() {
        return PASS;
    }
    // SAFETY: helper on the packet's own socket pointer.
    let sk = unsafe { bpf_sk_fullsock(sk) };
    if sk.is_null() {
        return PASS;
    }
    // SAFETY: `sk` is a full socket.
    let check: *mut SockSourceCheck = unsafe { storage(&LB_SOCK_CHECK, sk) };
    if check.is_null() {
        return PASS;
    }
    // SAFETY: non-null storage of this socket.
    if unsafe { (*check).verdict } == source_check::ALLOWED {
        return PASS;
    }
    // A marked socket's packet that cannot be read is not let through
    // unchecked.
    let Some(p) = parse(ctx) else {
        count(stat::SOCK_DROP_SOURCE_RANGE);
        return DROP;
    };
    let Some((addr, port)) = frontend(ctx, &p) else {
        // Not to the backend of a translated frontend (a socket reconnected
        // past the hooks, say): not ours to filter.
        return PASS;
    };
    let key = aya_ebpf::maps::lpm_trie::Key::new(
        source_range::FRONTEND_BITS + 128,
        SourceRangeData {
            addr,
            port,
            proto: p.proto,
            _pad: 0,
            src: p.src,
        },
    );
    if LB_SOURCE_RANGES.get(&key) == Some(&source_range::DENY) {
        count(stat::SOCK_DROP_SOURCE_RANGE);
        return DROP;
    }
    if p.proto == proto::TCP {
        // SAFETY: as above; a TCP socket's source is fixed once it sends.
        unsafe { (*check).verdict = source_check::ALLOWED };
    }
    PASS
}

/// The frontend the socket addressed for this packet's destination.
#[inline(always)]
fn frontend(ctx: &SkBuffContext, p: &Packet) -> Option<([u8; 16], u16)> {
    // SAFETY: helper on the program's own context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.skb.skb.cast()) };
    if p.proto == proto::TCP {
        let peer = crate::sock::tcp_peer(cookie)?;
        return (peer.backend_addr == p.dst && peer.backend_port == p.dport)
            .then_some((peer.frontend_addr, peer.frontend_port));
    }
    if p.proto != proto::UDP {
        return None;
    }
    crate::sock::frontend_of_datagram_peer(cookie, p.dst, p.dport)
}

/// Addresses, protocol and destination port; cgroup skb programs see the
/// packet from its network header.
#[inline(always)]
fn parse(ctx: &SkBuffContext) -> Option<Packet> {
    let first: u8 = ctx.load(0).ok()?;
    let (src, dst, proto, l4) = match first >> 4 {
        4 => {
            let h: [u8; 20] = ctx.load(0).ok()?;
            let src = ipv4_mapped([h[12], h[13], h[14], h[15]]);
            let dst = ipv4_mapped([h[16], h[17], h[18], h[19]]);
            (src, dst, h[9], ((h[0] & 0x0f) as usize) * 4)
        }
        6 => {
            let h: [u8; 40] = ctx.load(0).ok()?;
            let mut src = [0u8; 16];
            let mut dst = [0u8; 16];
            src.copy_from_slice(&h[8..24]);
            dst.copy_from_slice(&h[24..40]);
            // Extension headers are not walked: a local socket's TCP or UDP
            // follows the fixed header unless it set options itself, and
            // such a packet of a marked socket is dropped, not let through.
            (src, dst, h[6], 40)
        }
        _ => return None,
    };
    if proto != proto::TCP && proto != proto::UDP {
        return None;
    }
    let ports: [u8; 4] = ctx.load(l4).ok()?;
    Some(Packet {
        src,
        dst,
        dport: u16::from_be_bytes([ports[2], ports[3]]),
        proto,
    })
}
