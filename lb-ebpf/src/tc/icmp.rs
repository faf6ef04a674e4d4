//! Answers the tc path sends itself, back out of the device a packet came
//! in on (MACs swapped, `bpf_redirect` to the ingress ifindex), and the
//! translation of ICMPv6 errors.
//!
//! - REJECT (kube-proxy's rule for a Service without endpoints): a TCP SYN
//!   gets an RST|ACK acknowledging it; UDP gets ICMP port unreachable /
//!   ICMPv6 port unreachable.
//! - Too big for the next hop: ICMP fragmentation needed (with the next-hop
//!   MTU) / ICMPv6 packet too big, from the address the sender addressed,
//!   quoting the packet as the sender sent it.
//!
//! An ICMP error quotes the packet from its IP header on, as much as fits
//! in 576 bytes (IPv4, RFC 1812 4.3.2.3) or 1280 (IPv6, RFC 4443 2.4),
//! rounded down to 4 bytes; always at least the IP header and 8 bytes (RFC
//! 792) for any packet we answer. The packet itself is reshaped into the
//! answer: trimmed (`bpf_skb_change_tail`), room made for the new headers
//! after the Ethernet header (`bpf_skb_adjust_room`, MAC mode), checksums
//! computed over the whole answer.
use aya_ebpf::{
    bindings::{__sk_buff, BPF_F_PSEUDO_HDR},
    btf_maps::PerCpuArray,
    helpers::{
        bpf_csum_diff, bpf_redirect, bpf_skb_adjust_room, bpf_skb_change_tail, bpf_skb_load_bytes,
        bpf_skb_store_bytes,
    },
    macros::btf_map,
    programs::TcContext,
    EbpfContext,
};
use lb_common::{proto, stat, CtEntry, CtKey};

use super::{
    nat_tuple, quoted_flow, rewrite_tuple, Pkt, ETH_HLEN, ETH_P_IPV6, TCP_ACK, TCP_RST, TCP_SYN,
    TC_ACT_OK, TC_ACT_SHOT, TC_ACT_UNSPEC,
};
use crate::maps::{count, this_cpu};

const IPPROTO_ICMP: u8 = 1;
const IPPROTO_ICMPV6: u8 = 58;
const BPF_ADJ_ROOM_MAC: u32 = 1;
/// Room for the quote's checksum, 64 bytes at a time.
const CHUNK: usize = 64;
/// Enough chunks for the longest quote (IPv6: 1280 - 40 - 8 bytes).
const CHUNKS: usize = 20;

/// Headers being built and packet bytes being summed: the BPF stack is
/// 512 bytes.
#[repr(C)]
pub struct Work {
    hdr: [u8; 64],
    chunk: [u8; CHUNK],
    pseudo: [u8; 40],
    old: [u8; 52],
    new: [u8; 52],
}

#[btf_map]
static LB_TC_ICMP_SCRATCH: PerCpuArray<Work, 1> = PerCpuArray::new();

#[inline(always)]
fn work() -> Option<&'static mut Work> {
    this_cpu(&LB_TC_ICMP_SCRATCH)
}

/// A ones' complement sum of `len` bytes at `buf` (a multiple of 4) on top of `seed`.
#[inline(always)]
fn sum(buf: *const u8, len: u32, seed: u32) -> u32 {
    // SAFETY: `buf` points into this CPU's scratch element, `len` bytes long.
    unsafe { bpf_csum_diff(core::ptr::null_mut(), 0, buf as *mut u32, len, seed) as u32 }
}

/// The 16-bit checksum field for a sum, in memory order.
#[inline(always)]
fn fold(sum: u32) -> [u8; 2] {
    let s = (sum & 0xffff) + (sum >> 16);
    let s = (s & 0xffff) + (s >> 16);
    (!(s as u16)).to_ne_bytes()
}

#[inline(always)]
fn skb(ctx: &TcContext) -> *mut __sk_buff {
    ctx.skb.skb
}

/// Sends the (rewritten) frame back to where it came from.
#[inline(always)]
fn bounce(ctx: &TcContext) -> i32 {
    let Ok(macs) = ctx.load::<[u8; 12]>(0) else {
        return TC_ACT_SHOT;
    };
    let mut swapped = [0u8; 12];
    swapped[..6].copy_from_slice(&macs[6..]);
    swapped[6..].copy_from_slice(&macs[..6]);
    if ctx.store(0, &swapped, 0).is_err() {
        return TC_ACT_SHOT;
    }
    // SAFETY: the context pointer is valid for the program's run.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: plain helper call.
    unsafe { bpf_redirect(ifindex, 0) as i32 }
}

/// Writes an IP header for an answer from `p.dst` to `p.src` carrying
/// `payload` bytes of `l4proto` into `w.hdr`, and the pseudo-header sum of
/// the answer's transport checksum (IPv6 always; IPv4 for TCP). Returns the
/// header's length.
#[inline(always)]
fn ip_header(w: &mut Work, p: &Pkt, l4proto: u8, payload: u16, tos: u8) -> (usize, u32) {
    let h = &mut w.hdr;
    if !p.v6 {
        h[0] = 0x45;
        h[1] = tos;
        h[2..4].copy_from_slice(&(20 + payload).to_be_bytes());
        h[4..10].copy_from_slice(&[0, 0, 0, 0, 64, l4proto]);
        h[10] = 0;
        h[11] = 0;
        h[12..16].copy_from_slice(&p.dst[12..]);
        h[16..20].copy_from_slice(&p.src[12..]);
        let c = fold(sum(h.as_ptr(), 20, 0));
        h[10..12].copy_from_slice(&c);
        let ps = &mut w.pseudo;
        ps[..4].copy_from_slice(&p.dst[12..]);
        ps[4..8].copy_from_slice(&p.src[12..]);
        ps[8..12].copy_from_slice(&[0, l4proto, (payload >> 8) as u8, payload as u8]);
        (20, sum(ps.as_ptr(), 12, 0))
    } else {
        h[0..4].copy_from_slice(&[0x60, 0, 0, 0]);
        h[4..6].copy_from_slice(&payload.to_be_bytes());
        h[6] = l4proto;
        h[7] = 64;
        h[8..24].copy_from_slice(&p.dst);
        h[24..40].copy_from_slice(&p.src);
        let ps = &mut w.pseudo;
        ps[..16].copy_from_slice(&p.dst);
        ps[16..32].copy_from_slice(&p.src);
        ps[32..40].copy_from_slice(&[0, 0, (payload >> 8) as u8, payload as u8, 0, 0, 0, l4proto]);
        (40, sum(ps.as_ptr(), 40, 0))
    }
}

#[inline(always)]
fn store(ctx: &TcContext, off: usize, buf: &[u8; 64], len: usize) -> bool {
    if len > 64 {
        return false;
    }
    // SAFETY: `len` bytes of `buf` are initialised and the helper bounds the write.
    unsafe {
        bpf_skb_store_bytes(
            ctx.as_ptr() as *mut _,
            off as u32,
            buf.as_ptr() as *const _,
            len as u32,
            0,
        ) == 0
    }
}

#[inline(always)]
fn set_len(ctx: &TcContext, len: u32) -> bool {
    // SAFETY: plain helper call on this program's packet.
    ctx.len() == len || unsafe { bpf_skb_change_tail(skb(ctx), len, 0) } == 0
}

/// REJECT for a Service without endpoints: a TCP SYN gets an RST|ACK
/// (ack = seq + 1) and UDP an ICMP port unreachable, counted
/// `TC_REJECTED`. Any other TCP packet is dropped, as without the flag.
#[inline(always)]
pub fn reject(ctx: &TcContext, p: &Pkt) -> i32 {
    let verdict = if p.proto == proto::UDP {
        if p.v6 {
            error(ctx, p, 1, 4, 0)
        } else {
            error(ctx, p, 3, 3, 0)
        }
    } else if p.tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST) == TCP_SYN {
        rst(ctx, p)
    } else {
        TC_ACT_SHOT
    };
    if verdict == TC_ACT_SHOT {
        count(stat::TC_DROP_NO_BACKEND);
    } else {
        count(stat::TC_REJECTED);
    }
    verdict
}

#[inline(always)]
fn rst(ctx: &TcContext, p: &Pkt) -> i32 {
    let Ok(seq) = ctx.load::<u32>(p.l4 + 4) else {
        return TC_ACT_SHOT;
    };
    let Some(w) = work() else {
        return TC_ACT_SHOT;
    };
    let (ip_len, pseudo) = ip_header(w, p, proto::TCP, 20, 0);
    let t = &mut w.chunk;
    t[0..2].copy_from_slice(&p.dport.to_be_bytes());
    t[2..4].copy_from_slice(&p.sport.to_be_bytes());
    t[4..8].copy_from_slice(&[0, 0, 0, 0]);
    t[8..12].copy_from_slice(&u32::from_be(seq).wrapping_add(1).to_be_bytes());
    t[12..20].copy_from_slice(&[5 << 4, TCP_RST | TCP_ACK, 0, 0, 0, 0, 0, 0]);
    let c = fold(sum(t.as_ptr(), 20, pseudo));
    t[16..18].copy_from_slice(&c);
    let tcp = ETH_HLEN + ip_len;
    let tcp_hdr: [u8; 20] = {
        let mut b = [0u8; 20];
        b.copy_from_slice(&t[..20]);
        b
    };
    if !set_len(ctx, (tcp + 20) as u32)
        || !store(ctx, ETH_HLEN, &w.hdr, ip_len)
        || ctx.store(tcp, &tcp_hdr, 0).is_err()
    {
        return TC_ACT_SHOT;
    }
    bounce(ctx)
}

/// An ICMP (IPv4) or ICMPv6 error of `kind`/`code` about this packet, sent
/// to its source from its destination; `info` is the 4 bytes after the
/// checksum (the MTU). The packet must be as the sender sent it.
#[inline(always)]
pub fn error(ctx: &TcContext, p: &Pkt, kind: u8, code: u8, info: u32) -> i32 {
    let Some(w) = work() else {
        return TC_ACT_SHOT;
    };
    let limit: u32 = if p.v6 { 1280 - 48 } else { 576 - 28 };
    let orig = ctx.len().saturating_sub(ETH_HLEN as u32);
    let quote = (if orig < limit { orig } else { limit }) & !3;
    if quote < 28 {
        return TC_ACT_SHOT;
    }
    // The quote's sum, before anything moves.
    let mut acc = 0u32;
    for i in 0..CHUNKS {
        let off = (i * CHUNK) as u32;
        if off >= quote {
            break;
        }
        let rest = quote - off;
        let n = if rest > CHUNK as u32 {
            CHUNK as u32
        } else {
            rest
        };
        // The verifier must see 1 <= n <= 64. `((n - 1) & 63) + 1` is `n`
        // itself here, in a form whose bounds every verifier sees: before
        // Linux 6.8 it learns nothing from `n != 0`, and refuses a length
        // that may be 0. Hidden from LLVM, which would fold it back to `n`.
        // SAFETY: a read of a local.
        let n = unsafe { core::ptr::read_volatile(&n) };
        let n = (n.wrapping_sub(1) & (CHUNK as u32 - 1)) + 1;
        // SAFETY: `n` (1..=64) bytes into this CPU's 64-byte chunk.
        let rc = unsafe {
            bpf_skb_load_bytes(
                ctx.as_ptr(),
                ETH_HLEN as u32 + off,
                w.chunk.as_mut_ptr() as *mut _,
                n,
            )
        };
        if rc != 0 {
            return TC_ACT_SHOT;
        }
        acc = sum(w.chunk.as_ptr(), n, acc);
    }
    let (l4proto, hdr_len) = if p.v6 {
        (IPPROTO_ICMPV6, 48u32)
    } else {
        (IPPROTO_ICMP, 28)
    };
    let payload = (8 + quote) as u16;
    let (ip_len, pseudo) = ip_header(w, p, l4proto, payload, if p.v6 { 0 } else { 0xc0 });
    let icmp = [kind, code, 0, 0];
    let info = info.to_be_bytes();
    let i = ip_len;
    w.hdr[i..i + 4].copy_from_slice(&icmp);
    w.hdr[i + 4..i + 8].copy_from_slice(&info);
    // ICMPv6 sums a pseudo-header, ICMP does not.
    let seed = if p.v6 { pseudo } else { 0 };
    let total = fold(add(sum(w.hdr[i..].as_ptr(), 8, acc), seed));
    w.hdr[i + 2..i + 4].copy_from_slice(&total);
    // SAFETY: plain helper calls on this program's packet.
    let grown = set_len(ctx, ETH_HLEN as u32 + quote)
        && unsafe { bpf_skb_adjust_room(skb(ctx), hdr_len as i32, BPF_ADJ_ROOM_MAC, 0) } == 0;
    if !grown || !store(ctx, ETH_HLEN, &w.hdr, hdr_len as usize) {
        return TC_ACT_SHOT;
    }
    bounce(ctx)
}

/// Ones' complement addition of two 32-bit partial sums.
#[inline(always)]
fn add(a: u32, b: u32) -> u32 {
    let (s, carry) = a.overflowing_add(b);
    s + carry as u32
}

/// The translated packet is too big for the next hop towards its target:
/// count it, and unless it is IPv4 without DF, undo the translation and
/// answer the sender (ICMP fragmentation needed / ICMPv6 packet too big).
#[inline(always)]
pub fn too_big(ctx: &TcContext, p: &Pkt, e: &CtEntry, mtu: u16) -> i32 {
    count(stat::TC_FRAG_NEEDED);
    if !p.v6 {
        let Ok(frag) = ctx.load::<u16>(ETH_HLEN + 6) else {
            return TC_ACT_SHOT;
        };
        // Without DF the sender wants it fragmented, which a tc program
        // cannot do: dropped.
        if u16::from_be(frag) & 0x4000 == 0 {
            return TC_ACT_SHOT;
        }
    }
    if !rewrite_tuple(ctx, p, &nat_tuple(e), &p.tuple()) {
        return TC_ACT_SHOT;
    }
    if p.v6 {
        error(ctx, p, 2, 0, mtu as u32)
    } else {
        error(ctx, p, 3, 4, mtu as u32)
    }
}

/// An ICMPv6 error about a reply of a translated flow, from the client or
/// a router on the way (packet too big matters most): as `icmp4_error`,
/// the error goes to the backend quoting the packet as the backend sent
/// it. Anything else is passed on untouched.
#[inline(always)]
pub fn icmp6_error(ctx: &TcContext) -> i32 {
    icmp6_error_inner(ctx).unwrap_or(TC_ACT_UNSPEC)
}

#[inline(always)]
fn icmp6_error_inner(ctx: &TcContext) -> Option<i32> {
    if u16::from_be(ctx.load::<u16>(12).ok()?) != ETH_P_IPV6
        || ctx.load::<u8>(ETH_HLEN + 6).ok()? != IPPROTO_ICMPV6
    {
        return None;
    }
    let icmp = ETH_HLEN + 40;
    let kind: u8 = ctx.load(icmp).ok()?;
    // Destination unreachable, packet too big, time exceeded, parameter problem.
    if !(1..=4).contains(&kind) {
        return None;
    }
    let inner = icmp + 8;
    let iproto: u8 = ctx.load(inner + 6).ok()?;
    if iproto != proto::TCP && iproto != proto::UDP {
        return None;
    }
    let isrc: [u8; 16] = ctx.load(inner + 8).ok()?;
    let idst: [u8; 16] = ctx.load(inner + 24).ok()?;
    let ports: [u8; 4] = ctx.load(inner + 40).ok()?;
    let outer_dst: [u8; 16] = ctx.load(ETH_HLEN + 24).ok()?;
    if outer_dst != isrc {
        return None;
    }
    let key = CtKey {
        src: idst,
        dst: isrc,
        sport: u16::from_be_bytes([ports[2], ports[3]]),
        dport: u16::from_be_bytes([ports[0], ports[1]]),
        proto: iproto,
        _pad: [0; 3],
    };
    let e = quoted_flow(&key)?;
    let w = work()?;
    // The quoted packet becomes backend -> client (or node address and
    // SNAT port); the outer destination the backend. One checksum diff
    // over the quoted bytes, one over the pseudo-header's destination.
    w.old[..16].copy_from_slice(&isrc);
    w.old[16..32].copy_from_slice(&idst);
    w.old[32..36].copy_from_slice(&ports);
    w.old[36..52].copy_from_slice(&outer_dst);
    w.new[..16].copy_from_slice(&e.nat_dst);
    w.new[16..32].copy_from_slice(&e.nat_src);
    w.new[32..34].copy_from_slice(&e.nat_dport.to_be_bytes());
    w.new[34..36].copy_from_slice(&e.nat_sport.to_be_bytes());
    w.new[36..52].copy_from_slice(&e.nat_dst);
    // SAFETY: both buffers are this CPU's scratch, of the sizes passed.
    let (quoted, pseudo) = unsafe {
        (
            bpf_csum_diff(
                w.old.as_mut_ptr() as *mut u32,
                36,
                w.new.as_mut_ptr() as *mut u32,
                36,
                0,
            ),
            bpf_csum_diff(
                w.old[36..].as_mut_ptr() as *mut u32,
                16,
                w.new[36..].as_mut_ptr() as *mut u32,
                16,
                0,
            ),
        )
    };
    let mut addrs = [0u8; 32];
    addrs.copy_from_slice(&w.new[..32]);
    let mut new_ports = [0u8; 4];
    new_ports.copy_from_slice(&w.new[32..36]);
    let csum = icmp + 2;
    let ok = ctx.store(inner + 8, &addrs, 0).is_ok()
        && ctx.store(inner + 40, &new_ports, 0).is_ok()
        && ctx.store(ETH_HLEN + 24, &e.nat_dst, 0).is_ok()
        && ctx
            .l4_csum_replace(csum, 0, quoted as u32 as u64, 0)
            .is_ok()
        && ctx
            .l4_csum_replace(csum, 0, pseudo as u32 as u64, BPF_F_PSEUDO_HDR as u64)
            .is_ok();
    if !ok {
        count(stat::TC_DROP_REWRITE);
        return Some(TC_ACT_SHOT);
    }
    count(stat::TC_TRANSLATED);
    Some(TC_ACT_OK)
}
