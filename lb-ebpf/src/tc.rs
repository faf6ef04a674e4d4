//! North-south translation at tc (clsact/TCX) on the node's external devices.
//!
//! `ingress`: packets arriving at the node. A packet of a known flow
//! (`LB_CONNTRACK`) is rewritten as its entry says. Otherwise, a packet to an
//! `EXTERNAL` frontend (NodePort on a node address, LoadBalancer ingress IP,
//! externalIP) starts a flow: a backend is chosen as the socket path does
//! (Maglev over the 5-tuple or random, affinity by source address), the
//! destination is rewritten to it, and for a backend on another node the
//! source is masqueraded to the node's address and a free port. Both
//! directions are recorded, so the flow keeps its backend for its life.
//! Local deliveries go up the stack; masqueraded packets and the replies of
//! remote backends are sent out after a FIB lookup (`route`; their source
//! is a local address, which the stack would drop as martian).
//!
//! `egress`: replies of local backends leaving towards the client get their
//! frontend back as source.
//!
//! ICMP and ICMPv6 errors about a flow's replies (fragmentation needed /
//! packet too big, from the client or a router) are translated to the
//! backend, quoted header included (`icmp4_error`, `icmp::icmp6_error`).
//! Not translated, passed untouched: ICMP errors from the backend side
//! (they reach the node's own stack, which finds no socket: never
//! mis-delivered).
//!
//! In modules: `icmp` (answers sent from here: REJECT of Services without
//! endpoints, fragmentation needed / packet too big; ICMPv6 errors),
//! `frag` (IPv6 extension headers, fragments), `route` (the FIB lookup),
//! `guard` (the guarded Service CIDRs: unallocated ClusterIPs dropped).
use aya_ebpf::{
    bindings::{
        __sk_buff, bpf_fib_lookup, BPF_ANY, BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, BPF_NOEXIST,
    },
    btf_maps::PerCpuArray,
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns},
    macros::btf_map,
    programs::TcContext,
};
use lb_common::{
    algorithm, clock, conntrack, ct_flags, ct_state, is_ipv4_mapped, proto, scope, select,
    service_flags, source_range, stat, AffinityKey, Backend, CtEntry, CtKey, ServiceKey,
    ServiceValue, SourceRangeData, TcConfig,
};

use crate::{
    lb::{self, Frontend, HashOf},
    maps::{
        count, port_marked, this_cpu, CtMap, LB_CONNTRACK, LB_CT_SYN, LB_FRONTEND_PORTS,
        LB_LOCAL_PORTS, LB_SOURCE_RANGES, LB_TC_CONFIG,
    },
    outlier,
};

mod frag;
mod guard;
mod icmp;
mod route;
pub mod xdp;

/// Not ours: let the next program (or the stack) decide.
pub const TC_ACT_UNSPEC: i32 = -1;
pub const TC_ACT_OK: i32 = 0;
pub const TC_ACT_SHOT: i32 = 2;

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;
const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
const FIB_SUCCESS: i64 = 0;
const FIB_NO_NEIGH: i64 = 7;

/// The parts of a packet the translation needs.
#[repr(C)]
struct Pkt {
    v6: bool,
    l4: usize,
    proto: u8,
    tcp_flags: u8,
    /// TCP sequence and acknowledgment numbers, host order (0 for UDP).
    seq: u32,
    ack: u32,
    sport: u16,
    dport: u16,
    src: [u8; 16],
    dst: [u8; 16],
}

/// Reads a header field: straight from the packet when the bytes are in its
/// linear part (the usual case, and several times cheaper than a helper
/// call per field), else through `bpf_skb_load_bytes`.
#[inline(always)]
fn at<T: Copy>(ctx: &TcContext, off: usize) -> Option<T> {
    let start = ctx.data();
    if start + off + core::mem::size_of::<T>() <= ctx.data_end() {
        // SAFETY: bounds checked against data_end just above (the verifier
        // checks it too); packet bytes have no alignment.
        return Some(unsafe { core::ptr::read_unaligned((start + off) as *const T) });
    }
    ctx.load::<T>(off).ok()
}

/// The start of the transport header. Direct reads need an offset the
/// verifier can bound exactly, so the two usual places (IPv4 without
/// options, IPv6 without extension headers) are read at constant offsets
/// and only anything else goes through the helper.
#[inline(always)]
fn l4_head<T: Copy>(ctx: &TcContext, l4: usize) -> Option<T> {
    match l4 {
        L4_V4 => at(ctx, L4_V4),
        L4_V6 => at(ctx, L4_V6),
        _ => ctx.load::<T>(l4).ok(),
    }
}

const L4_V4: usize = ETH_HLEN + 20;
const L4_V6: usize = ETH_HLEN + 40;

/// This CPU's parsed packet (`parse`).
#[btf_map]
static LB_TC_PKT: PerCpuArray<Pkt, 1> = PerCpuArray::new();

/// The packet's parts, kept in map memory rather than on the stack: held
/// in registers, its two addresses were spilled one 8-byte stack slot per
/// byte, and the stack (512 bytes for a whole chain of calls) ran out.
/// Valid until the next `parse` on this CPU.
#[inline(always)]
fn parse(ctx: &TcContext) -> Option<&'static Pkt> {
    let p = this_cpu(&LB_TC_PKT)?;
    parse_into(ctx, p)?;
    Some(p)
}

/// Writes each field into `p` as it is read (`p` is left partly written
/// when it returns None).
#[inline(always)]
fn parse_into(ctx: &TcContext, p: &mut Pkt) -> Option<()> {
    let ethertype = u16::from_be(at::<u16>(ctx, 12)?);
    match ethertype {
        ETH_P_IP => {
            let vihl: u8 = at(ctx, ETH_HLEN)?;
            let ihl = (vihl & 0x0f) as usize * 4;
            if vihl >> 4 != 4 || ihl < 20 {
                return None;
            }
            // A later fragment has no ports: `frag::later` handles it.
            let frag = u16::from_be(at::<u16>(ctx, ETH_HLEN + 6)?);
            if frag & 0x1fff != 0 {
                return None;
            }
            p.proto = at(ctx, ETH_HLEN + 9)?;
            let s: [u8; 4] = at(ctx, ETH_HLEN + 12)?;
            let d: [u8; 4] = at(ctx, ETH_HLEN + 16)?;
            p.src = lb_common::ipv4_mapped(s);
            p.dst = lb_common::ipv4_mapped(d);
            p.v6 = false;
            p.l4 = ETH_HLEN + ihl;
        }
        ETH_P_IPV6 => {
            let next: u8 = at(ctx, ETH_HLEN + 6)?;
            p.src = at(ctx, ETH_HLEN + 8)?;
            p.dst = at(ctx, ETH_HLEN + 24)?;
            (p.l4, p.proto) = frag::ipv6_l4(ctx, next)?;
            p.v6 = true;
        }
        _ => return None,
    }
    if p.proto != proto::TCP && p.proto != proto::UDP {
        return None;
    }
    // Ports, sequence numbers and flags in one read: the first 14 bytes of
    // TCP, 4 of UDP.
    let head: [u8; 14] = if p.proto == proto::TCP {
        l4_head(ctx, p.l4)?
    } else {
        Pkt::udp_head(l4_head(ctx, p.l4)?)
    };
    p.set_l4_head(head);
    Some(())
}

impl Pkt {
    /// A UDP header's ports as the first bytes of a TCP header's (no
    /// sequence numbers, no flags).
    #[inline(always)]
    fn udp_head(h: [u8; 4]) -> [u8; 14] {
        [h[0], h[1], h[2], h[3], 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    }

    /// The ports, sequence numbers and flags from the transport header's
    /// first 14 bytes (`udp_head` for UDP).
    #[inline(always)]
    fn set_l4_head(&mut self, head: [u8; 14]) {
        self.sport = u16::from_be_bytes([head[0], head[1]]);
        self.dport = u16::from_be_bytes([head[2], head[3]]);
        self.seq = u32::from_be_bytes([head[4], head[5], head[6], head[7]]);
        self.ack = u32::from_be_bytes([head[8], head[9], head[10], head[11]]);
        self.tcp_flags = head[13];
    }
}

#[inline(always)]
fn is_loopback(p: &Pkt) -> bool {
    if p.v6 {
        p.dst[..15].iter().all(|b| *b == 0) && p.dst[15] == 1
    } else {
        p.dst[12] == 127
    }
}

/// The agent's settings (an array element always exists; the agent writes
/// it before it attaches the programs).
#[inline(always)]
fn config() -> Option<&'static TcConfig> {
    LB_TC_CONFIG.get(0)
}

/// Room for the large values of a new flow: the BPF stack is 512 bytes.
#[repr(C)]
pub struct Scratch {
    /// The backend `new_flow` chose (in map memory, as `parse`'s packet).
    backend: Backend,
    forward: CtEntry,
    reply: CtEntry,
    reply_key: CtKey,
    /// The forward key of an unfinished handshake whose SNAT port a new
    /// flow takes (`reclaim_snat`).
    stale_key: CtKey,
    fib: bpf_fib_lookup,
}

#[btf_map]
static LB_TC_SCRATCH: PerCpuArray<Scratch, 1> = PerCpuArray::new();

#[inline(always)]
fn csum_off(p: &Pkt) -> usize {
    if p.proto == proto::TCP {
        p.l4 + 16
    } else {
        p.l4 + 6
    }
}

#[inline(always)]
fn l4_flags(p: &Pkt) -> u64 {
    // UDP: a computed checksum of 0 is written as 0xffff (0 means "none"),
    // and an IPv4 datagram sent without checksum is left without.
    let udp = if p.proto == proto::UDP {
        BPF_F_MARK_MANGLED_0 as u64
    } else {
        0
    };
    // IPv6 packets need BPF_F_IPV6 where the kernel knows it (the agent
    // probes it into the config), for CHECKSUM_COMPLETE packets.
    let v6 = match config() {
        Some(cfg) if p.v6 => cfg.l4_csum_v6_flags as u64,
        _ => 0,
    };
    udp | v6
}

/// An incremental checksum update (RFC 1624): the ones'-complement sum of
/// `!old + new` over the 32-bit words that change, each read from the
/// packet's bytes in native order, as the kernel's csum helpers read them.
/// Computed in the program: a helper call per field cost more than the
/// field's arithmetic (the kernel's calls return through the SRSO thunk).
#[derive(Clone, Copy)]
struct CsumDiff(u64);

impl CsumDiff {
    #[inline(always)]
    fn word(self, old: u32, new: u32) -> Self {
        CsumDiff(self.0 + (!old) as u64 + new as u64)
    }

    /// The words of an address as the packet carries it: IPv4's one word,
    /// IPv6's four.
    #[inline(always)]
    fn addr(self, v6: bool, old: Words, new: Words) -> Self {
        let d = self.word(old.v4(), new.v4());
        if !v6 {
            return d;
        }
        d.word(old.0[0], new.0[0])
            .word(old.0[1], new.0[1])
            .word(old.0[2], new.0[2])
    }

    /// The 32-bit partial sum (`__wsum`) the csum helpers take as a diff.
    #[inline(always)]
    fn wsum(self) -> u32 {
        let s = (self.0 & 0xffff_ffff) + (self.0 >> 32);
        ((s & 0xffff_ffff) + (s >> 32)) as u32
    }

    /// A 16-bit checksum field, as read from the packet, updated.
    #[inline(always)]
    fn apply(self, field: u16) -> u16 {
        let s = (!field) as u64 + self.wsum() as u64;
        let s = (s & 0xffff) + (s >> 16);
        let s = (s & 0xffff) + (s >> 16);
        let s = (s & 0xffff) + (s >> 16);
        !(s as u16)
    }
}

/// Writes `v` at `off`: straight into the packet when the bytes are in its
/// linear part (the verifier has the program unclone the packet first),
/// else through `bpf_skb_store_bytes`.
#[inline(always)]
pub(crate) fn put<T: Copy>(ctx: &TcContext, off: usize, v: &T) -> bool {
    let start = ctx.data();
    if start + off + core::mem::size_of::<T>() <= ctx.data_end() {
        // SAFETY: bounds checked against data_end just above (the verifier
        // checks it too); packet bytes have no alignment.
        unsafe { core::ptr::write_unaligned((start + off) as *mut T, *v) };
        return true;
    }
    ctx.store(off, v, 0).is_ok()
}

/// `put` at the transport header, at a constant offset where it can be
/// (see `l4_head`).
#[inline(always)]
fn put_l4<T: Copy>(ctx: &TcContext, l4: usize, v: &T) -> bool {
    match l4 {
        L4_V4 => put(ctx, L4_V4, v),
        L4_V6 => put(ctx, L4_V6, v),
        _ => ctx.store(l4, v, 0).is_ok(),
    }
}

/// An address in `lb-common`'s 16-byte form as four 32-bit words, each
/// holding its four bytes in memory order (network order, as the packet
/// and the csum helpers have them). The BPF target has no unaligned loads,
/// so comparing, summing or copying a `[u8; 16]` of unknown alignment is
/// sixteen byte loads; these words are read whole from the places known
/// to be 4-aligned (`CtEntry`'s and `Pkt`'s addresses).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct Words(pub [u32; 4]);

impl Words {
    /// # Safety
    /// `a` is 4-aligned.
    #[inline(always)]
    unsafe fn read_aligned(a: &[u8; 16]) -> Self {
        // SAFETY: 16 readable bytes, 4-aligned (the caller's promise).
        Words(unsafe { core::ptr::read(a.as_ptr() as *const [u32; 4]) })
    }

    /// From an address of unknown alignment, a byte at a time.
    #[inline(always)]
    pub(crate) fn from_bytes(a: &[u8; 16]) -> Self {
        let w = |i: usize| u32::from_ne_bytes([a[i], a[i + 1], a[i + 2], a[i + 3]]);
        Words([w(0), w(4), w(8), w(12)])
    }

    #[inline(always)]
    pub(crate) fn bytes(self) -> [u8; 16] {
        // SAFETY: [u32; 4] and [u8; 16] have the same size; memory order kept.
        unsafe { core::mem::transmute::<[u32; 4], [u8; 16]>(self.0) }
    }

    /// An IPv4-mapped address's IPv4 address.
    #[inline(always)]
    pub(crate) fn v4(self) -> u32 {
        self.0[3]
    }
}

// The places `Words::read_aligned` reads: 4-aligned fields of types aligned
// to at least 4.
const _: () = {
    use core::mem::{align_of, offset_of};
    assert!(align_of::<CtEntry>() >= 4 && align_of::<Pkt>() >= 4);
    assert!(offset_of!(CtEntry, nat_src) % 4 == 0 && offset_of!(CtEntry, nat_dst) % 4 == 0);
    assert!(offset_of!(Pkt, src) % 4 == 0 && offset_of!(Pkt, dst) % 4 == 0);
};

/// A packet's addresses and ports (host order), as it is or as it is to be.
pub(crate) struct Tuple {
    pub src: Words,
    pub dst: Words,
    pub sport: u16,
    pub dport: u16,
}

/// What a flow's entry rewrites a packet to.
#[inline(always)]
pub(crate) fn nat_tuple(e: &CtEntry) -> Tuple {
    // SAFETY: 4-aligned fields of a 4-aligned type (asserted above).
    let (src, dst) = unsafe {
        (
            Words::read_aligned(&e.nat_src),
            Words::read_aligned(&e.nat_dst),
        )
    };
    Tuple {
        src,
        dst,
        sport: e.nat_sport,
        dport: e.nat_dport,
    }
}

impl Pkt {
    #[inline(always)]
    pub(crate) fn tuple(&self) -> Tuple {
        // SAFETY: 4-aligned fields of a 4-aligned type (asserted above).
        let (src, dst) = unsafe {
            (
                Words::read_aligned(&self.src),
                Words::read_aligned(&self.dst),
            )
        };
        Tuple {
            src,
            dst,
            sport: self.sport,
            dport: self.dport,
        }
    }
}

/// Rewrites packet `p` from tuple `old` to tuple `new`, checksums
/// included: the addresses and ports are stored, the IPv4 header checksum
/// is computed here, and the transport checksum takes two differences, one
/// for the addresses (its pseudo-header) and one for the ports. They stay
/// two helper calls: for a packet whose checksum the device is still to
/// compute (CHECKSUM_PARTIAL, as from a veth) the field holds only the
/// pseudo-header's sum, and only the helper knows which kind of packet it
/// is.
#[inline(always)]
fn rewrite_tuple(ctx: &TcContext, p: &Pkt, old: &Tuple, new: &Tuple) -> bool {
    let addrs = CsumDiff(0)
        .addr(p.v6, old.src, new.src)
        .addr(p.v6, old.dst, new.dst);
    let addrs_change = old.src != new.src || old.dst != new.dst;
    let ports_change = old.sport != new.sport || old.dport != new.dport;
    if addrs_change {
        let stored = if p.v6 {
            put(ctx, ETH_HLEN + 8, &new.src.bytes()) && put(ctx, ETH_HLEN + 24, &new.dst.bytes())
        } else {
            let Some(check) = at::<u16>(ctx, ETH_HLEN + 10) else {
                return false;
            };
            put(ctx, ETH_HLEN + 10, &addrs.apply(check))
                && put(ctx, ETH_HLEN + 12, &new.src.v4())
                && put(ctx, ETH_HLEN + 16, &new.dst.v4())
        };
        if !stored {
            return false;
        }
    }
    let ports = |sport: u16, dport: u16| {
        let (s, d) = (sport.to_be_bytes(), dport.to_be_bytes());
        [s[0], s[1], d[0], d[1]]
    };
    let (old_ports, new_ports) = (ports(old.sport, old.dport), ports(new.sport, new.dport));
    if ports_change && !put_l4(ctx, p.l4, &new_ports) {
        return false;
    }
    let flags = l4_flags(p);
    // The stores come first: a csum helper moves the packet's data.
    (!addrs_change
        || ctx
            .l4_csum_replace(
                csum_off(p),
                0,
                addrs.wsum() as u64,
                flags | BPF_F_PSEUDO_HDR as u64,
            )
            .is_ok())
        && (!ports_change
            || ctx
                .l4_csum_replace(
                    csum_off(p),
                    0,
                    CsumDiff(0)
                        .word(u32::from_ne_bytes(old_ports), u32::from_ne_bytes(new_ports))
                        .wsum() as u64,
                    flags,
                )
                .is_ok())
}

/// Rewrites the source and destination of the IPv4 header at `hdr`, each
/// as (old, new) in network order, with the header checksum; the transport
/// checksum is the caller's.
#[inline(always)]
pub(crate) fn set_ipv4_addrs(
    ctx: &TcContext,
    hdr: usize,
    (old_src, new_src): (u32, u32),
    (old_dst, new_dst): (u32, u32),
) -> bool {
    ctx.l3_csum_replace(hdr + 10, old_src as u64, new_src as u64, 4)
        .is_ok()
        && ctx
            .l3_csum_replace(hdr + 10, old_dst as u64, new_dst as u64, 4)
            .is_ok()
        && ctx.store(hdr + 12, &new_src, 0).is_ok()
        && ctx.store(hdr + 16, &new_dst, 0).is_ok()
}

/// Rewrites the packet to the entry's tuple.
#[inline(always)]
fn rewrite(ctx: &TcContext, p: &Pkt, e: &CtEntry) -> bool {
    rewrite_tuple(ctx, p, &p.tuple(), &nat_tuple(e))
}

/// Sends a rewritten packet out of the device the FIB says, resolving the
/// neighbour; the stack would drop it as martian (its source is local) or
/// would not forward it back out of the device it came in.
#[inline(always)]
fn redirect(ctx: &TcContext, p: &Pkt, e: &CtEntry, ptr: *mut CtEntry, now: u64) -> i32 {
    let nat = nat_tuple(e);
    let target = route::Target {
        v6: p.v6,
        proto: p.proto,
        l4: p.l4,
        src: nat.src,
        dst: nat.dst,
        sport: nat.sport,
        dport: nat.dport,
    };
    let flow = route::Flow { entry: e, ptr, now };
    match route::redirect(ctx, &target, Some(&flow)) {
        route::Fib::Sent(verdict) => verdict,
        route::Fib::TooBig(mtu) => icmp::too_big(ctx, p, e, mtu),
        route::Fib::NoRoute => {
            count(stat::TC_DROP_NO_ROUTE);
            TC_ACT_SHOT
        }
    }
}

/// The conntrack table an entry is in.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
enum Table {
    /// `LB_CONNTRACK`: established TCP flows and UDP flows.
    Main,
    /// `LB_CT_SYN`: TCP flows whose handshake is not complete.
    Syn,
}

impl Table {
    #[inline(always)]
    fn map(self) -> &'static CtMap {
        match self {
            Table::Main => &LB_CONNTRACK,
            Table::Syn => &LB_CT_SYN,
        }
    }
}

/// How long after the client's SYN its SYN again means no answer came: a
/// client retransmits at its RTO, 1 s first (RFC 6298); less, and a
/// duplicate SYN would count.
const SYN_UNANSWERED_NS: u64 = 800_000_000;

/// Whether the client's SYN on forward entry `e` of an unfinished
/// handshake is the first one sent again for want of an answer: the
/// backend has not answered and the last SYN is [`SYN_UNANSWERED_NS`]
/// old (once per flow: `syn_timed_out`).
#[inline(always)]
fn syn_timed_out(e: &CtEntry, now: u64) -> bool {
    e.flags & ct_flags::WATCHED != 0
        && e.answered == 0
        && e.ack_seq == 0
        && e.syn_timed_out == 0
        && clock::age_ns(now, e.last_seen_ns) >= SYN_UNANSWERED_NS
}

/// How far past the sequence number the other end acknowledged an RST may
/// be and still belong to the flow: data this end sent that is not yet
/// acknowledged (bounded by the window; 4 MiB covers a fast LAN's
/// bandwidth-delay product). A blind spoofer hits it once in a thousand.
const RST_AHEAD: u32 = 1 << 22;
/// ... and how far behind (a retransmission, reordering).
const RST_BEHIND: u32 = 1 << 16;

/// Whether an RST ends the flow of entry `e`. Checked: the RST comes from
/// one of the flow's two ends (its tuple is an entry's key); once the flow
/// is established, its sequence number is where the other end expects
/// this end's next byte (the last ACK the other end sent, within
/// [`RST_BEHIND`] and [`RST_AHEAD`]). During the handshake any RST of the
/// tuple is taken: it answers or aborts the SYN.
#[inline(always)]
fn rst_belongs(table: Table, e: &CtEntry, p: &Pkt) -> bool {
    if e.state[ct_state::SEEN_REPLY] == 0 {
        return true;
    }
    let Some(other) = table.map().get_ptr(&CtKey::partner(e, p.proto)) else {
        return true;
    };
    // SAFETY: valid for this run; a torn read of a u32 cannot happen.
    let expected = unsafe { (*other).ack_seq };
    // Nothing acknowledged yet: nothing to compare with.
    expected == 0
        || p.seq.wrapping_sub(expected) < RST_AHEAD
        || expected.wrapping_sub(p.seq) < RST_BEHIND
}

/// Marks one state byte of the partner entry (the other direction).
#[inline(always)]
fn mark_partner(table: Table, e: &CtEntry, l4proto: u8, state: usize) {
    if let Some(other) = table.map().get_ptr_mut(&CtKey::partner(e, l4proto)) {
        // SAFETY: valid for this run; one byte, written whole.
        unsafe { (*other).state[state] = 1 };
    }
}

/// The backend's SYN-ACK, on a flow still in `LB_CT_SYN` (netfilter's
/// SYN_RECV): the forward entry learns the acknowledgement that completes
/// the handshake (the backend's initial sequence number + 1). The flow
/// stays where it is, under its SYN timeout: a backend answers every SYN,
/// spoofed ones too, so its answer alone must not make a flow established.
#[inline(always)]
fn answered(e: &CtEntry, p: &Pkt) {
    if let Some(fwd) = LB_CT_SYN.get_ptr_mut(&CtKey::partner(e, p.proto)) {
        // SAFETY: valid for this run; two whole fields written, `ack_seq`
        // first (a CPU that saw `answered` before it would drop one ACK,
        // which the client sends again).
        unsafe { core::ptr::write_volatile(&mut (*fwd).ack_seq, p.seq.wrapping_add(1)) };
        unsafe { core::ptr::write_volatile(&mut (*fwd).answered, 1) };
    }
}

/// How far past the backend's initial sequence number + 1 the ACK that
/// completes a handshake may be: it may acknowledge data the backend sent
/// before the client's ACK (a TCP Fast Open server answers the SYN's
/// request at once), which its initial window bounds (10 segments, RFC
/// 6928, ~14.6 KB); netfilter allows 66 000 (`MAXACKWINDOW_CONST`).
const HANDSHAKE_ACK_AHEAD: u32 = 1 << 16;

/// Whether the client's packet `p`, on forward entry `e` in `LB_CT_SYN`,
/// acknowledges the backend's answer (its ACK number within
/// [`HANDSHAKE_ACK_AHEAD`] past the backend's initial sequence number + 1).
/// A blind spoofer, who never saw the SYN-ACK, hits it once in 65 536
/// tries; a flow it completed would hold `LB_CONNTRACK` room for the
/// established timeout.
#[inline(always)]
fn completes_handshake(e: &CtEntry, p: &Pkt) -> bool {
    p.tcp_flags & TCP_ACK != 0
        && (e.answered != 0 || e.ack_seq != 0)
        && p.ack.wrapping_sub(e.ack_seq) < HANDSHAKE_ACK_AHEAD
}

/// The client acknowledged the backend's answer (netfilter's SYN_RECV to
/// ESTABLISHED): both entries become established and move from
/// `LB_CT_SYN` to `LB_CONNTRACK` (inserted there before they are removed
/// here, so a lookup always finds the flow somewhere). `e` is the forward
/// entry as read before this packet; what the packet changed is applied
/// to the copy, as the element itself may be reused once removed.
#[inline(always)]
fn established(key: &CtKey, e: &CtEntry, p: &Pkt, now: u64) {
    let Some(scratch) = this_cpu(&LB_TC_SCRATCH) else {
        return;
    };
    scratch.reply_key = CtKey::partner(e, p.proto);
    let Some(rev) = LB_CT_SYN.get_ptr(&scratch.reply_key) else {
        return;
    };
    // SAFETY: copied out at once.
    scratch.reply = unsafe { core::ptr::read(rev) };
    scratch.forward = *e;
    scratch.forward.last_seen_ns = now;
    scratch.forward.ack_seq = p.ack;
    if p.tcp_flags & TCP_FIN != 0 {
        scratch.forward.state[ct_state::FIN] = 1;
    }
    // What `track` just wrote into both entries if this FIN closed the flow.
    if scratch.reply.state[ct_state::CLOSING] != 0
        || scratch.forward.state[ct_state::FIN] & scratch.reply.state[ct_state::FIN] != 0
    {
        scratch.forward.state[ct_state::CLOSING] = 1;
        scratch.reply.state[ct_state::CLOSING] = 1;
    }
    scratch.forward.state[ct_state::SEEN_REPLY] = 1;
    scratch.reply.state[ct_state::SEEN_REPLY] = 1;
    if LB_CONNTRACK
        .insert(key, &scratch.forward, BPF_ANY as u64)
        .is_err()
        || LB_CONNTRACK
            .insert(&scratch.reply_key, &scratch.reply, BPF_ANY as u64)
            .is_err()
    {
        // Stays in LB_CT_SYN, where it keeps working until its SYN
        // timeout; the next packet of the client tries again.
        count(stat::TC_DROP_CT_FULL);
        return;
    }
    let _ = LB_CT_SYN.remove(&scratch.reply_key);
    let _ = LB_CT_SYN.remove(key);
}

/// Records what packet `p` tells of its flow (entry `e` at `ptr` under
/// `key` in `table`) and refreshes it. Returns whether it noted a failed
/// connect (`outlier::note_tc_failure`), or None for a packet to drop: an
/// RST that does not belong to the flow, or a client's packet during the
/// handshake that neither is a SYN nor acknowledges the backend's answer
/// (netfilter's INVALID).
///
/// TCP states, as netfilter keeps them: a flow is established once the
/// client acknowledges its backend's answer (SYN_SENT, SYN_RECV, then
/// ESTABLISHED: until then it lives in `LB_CT_SYN` under the SYN
/// timeout); it closes (close timeout) once both ends sent a FIN, or at an
/// RST that belongs to it, whose entries stay for the close timeout so
/// that late packets still translate. A half-closed flow (one FIN) keeps
/// its established timeout.
///
/// Connects' outcomes are counted for outlier detection (`outlier`): a
/// backend's answer or RST (a remote backend's at ingress, a local one's
/// at egress), the client's SYN sent again (at ingress, for both).
#[inline(always)]
fn track(
    table: Table,
    key: &CtKey,
    ptr: *mut CtEntry,
    e: &CtEntry,
    p: &Pkt,
    now: u64,
) -> Option<bool> {
    let mut failed = false;
    // SAFETY (every write below): the entry stays valid for this run; each
    // write is of one whole field, so concurrent writers of other fields
    // or state bytes are never undone, and two writers of one field only
    // lose a refresh.
    if p.proto == proto::TCP {
        if p.tcp_flags & TCP_RST != 0 {
            if !rst_belongs(table, e, p) {
                count(stat::TC_DROP_BAD_RST);
                return None;
            }
            // The backend's first RST in the handshake: it refused the
            // connect (outlier detection; its frontend is where the reply
            // comes from).
            if table == Table::Syn
                && e.flags & (ct_flags::REPLY | ct_flags::WATCHED)
                    == ct_flags::REPLY | ct_flags::WATCHED
                && e.state[ct_state::CLOSING] == 0
            {
                failed = outlier::note_tc_failure(
                    &e.nat_src,
                    e.nat_sport,
                    p.proto,
                    e.backend_id,
                    lb_common::outlier::REFUSED,
                );
            }
            unsafe { (*ptr).state[ct_state::CLOSING] = 1 };
            mark_partner(table, e, p.proto, ct_state::CLOSING);
        } else {
            // During the handshake a client's packet is a SYN again or
            // completes it; its ACK number is the one `answered` set.
            let handshake = table == Table::Syn && e.flags & ct_flags::REPLY == 0;
            if handshake && p.tcp_flags & TCP_SYN == 0 && !completes_handshake(e, p) {
                count(stat::TC_DROP_INVALID);
                return None;
            }
            if handshake && p.tcp_flags & TCP_SYN != 0 && syn_timed_out(e, now) {
                unsafe { (*ptr).syn_timed_out = 1 };
                failed = outlier::note_tc_failure(
                    &p.dst,
                    p.dport,
                    p.proto,
                    e.backend_id,
                    lb_common::outlier::TIMEOUT,
                );
            }
            if p.tcp_flags & TCP_ACK != 0 && !handshake {
                unsafe { (*ptr).ack_seq = p.ack };
            }
            if p.tcp_flags & TCP_FIN != 0 && e.state[ct_state::FIN] == 0 {
                unsafe { (*ptr).state[ct_state::FIN] = 1 };
            }
            // After this end's FIN, until the flow closes: did the other
            // end send one too? Checked on every packet of this direction
            // from then on, so that two FINs crossing on two CPUs (each
            // missing the other's write) still close the flow at the next
            // ACK.
            let fin = p.tcp_flags & TCP_FIN != 0 || e.state[ct_state::FIN] != 0;
            if fin && e.state[ct_state::CLOSING] == 0 {
                if let Some(other) = table.map().get_ptr_mut(&CtKey::partner(e, p.proto)) {
                    if unsafe { (*other).state[ct_state::FIN] } != 0 {
                        unsafe { (*ptr).state[ct_state::CLOSING] = 1 };
                        unsafe { (*other).state[ct_state::CLOSING] = 1 };
                    } else if e.flags & ct_flags::REPLY != 0 && e.backend_time_wait == 0 {
                        // The backend's FIN, the client's not seen yet: the
                        // backend closes first, into TIME_WAIT.
                        unsafe { (*ptr).backend_time_wait = 1 };
                        unsafe { (*other).backend_time_wait = 1 };
                    }
                }
            }
        }
    }
    unsafe { (*ptr).last_seen_ns = now };
    let reply = e.flags & ct_flags::REPLY != 0;
    match table {
        // A UDP flow's first answer (TCP flows arrive here established).
        Table::Main => {
            if reply && e.state[ct_state::SEEN_REPLY] == 0 {
                unsafe { (*ptr).state[ct_state::SEEN_REPLY] = 1 };
                mark_partner(table, e, p.proto, ct_state::SEEN_REPLY);
            }
        }
        Table::Syn if reply => {
            if p.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN | TCP_ACK {
                answered(e, p);
                if e.flags & ct_flags::WATCHED != 0 {
                    outlier::succeeded(e.backend_id);
                }
            }
        }
        // A client's packet that is not a SYN completes the handshake
        // (checked above).
        Table::Syn => {
            if p.tcp_flags & (TCP_SYN | TCP_RST) == 0 {
                established(key, e, p, now);
            }
        }
    }
    Some(failed)
}

/// `loadBalancerSourceRanges`: the longest match of (frontend, source).
#[inline(always)]
fn source_allowed(p: &Pkt) -> bool {
    let key = aya_ebpf::maps::lpm_trie::Key::new(
        source_range::FRONTEND_BITS + 128,
        SourceRangeData {
            addr: p.dst,
            port: p.dport,
            proto: p.proto,
            _pad: 0,
            src: p.src,
        },
    );
    match LB_SOURCE_RANGES.get(&key) {
        None => true,
        Some(v) => *v != source_range::DENY,
    }
}

/// The tc path's hashes of a new flow (`lb::FlowHashes`): the 5-tuple,
/// the client's address, the frontend.
#[derive(Clone, Copy)]
struct TcHashes<'a>(&'a Pkt);

impl lb::FlowHashes for TcHashes<'_> {
    #[inline(always)]
    fn hash(&self, of: HashOf) -> u32 {
        let p = self.0;
        match of {
            HashOf::Flow => select::tuple_hash(&p.src, &p.dst, p.sport, p.dport, p.proto),
            HashOf::Client => select::address_hash(&p.src),
            HashOf::Destination => select::destination_hash(&p.dst, p.dport),
        }
    }
}

/// The id of a backend for a new flow: the tc path hashes the 5-tuple,
/// and its client is the packet's source address (unsalted, so that a
/// client reaches one backend through any node under sh). The backend itself is
/// copied out by the caller, straight into map memory (see `parse`).
#[inline(always)]
fn choose(p: &Pkt, svc: &ServiceValue, now: u64) -> Option<u32> {
    let hash = TcHashes(p);
    // SAFETY: plain helper call.
    let random = || unsafe { bpf_get_prandom_u32() };
    if svc.flags & service_flags::AFFINITY == 0 {
        return lb::choose_id::<true>(svc, hash, random);
    }
    let key = AffinityKey {
        client: p.src,
        affinity_id: svc.affinity_id,
        kind: lb_common::affinity_client::SOURCE_IP,
        _pad: [0; 3],
    };
    let exists = lb::backend_exists;
    let fresh = || lb::choose_id::<true>(svc, hash, random).map(|id| (id, ()));
    lb::with_affinity(&key, svc, now, exists, fresh).map(|(id, ())| id)
}

/// SNAT ports tried for a new flow before it is dropped, linearly from a
/// random start (as Cilium probes); each costs a lookup and an insert, and
/// only while the range is crowded. Twice the eight random tries before;
/// Cilium's 32 take tc_ingress past the verifier's million instructions
/// together with the rest of the program.
const SNAT_TRIES: u32 = 16;

/// Whether `key` is the key of a live entry of `map`.
#[inline(always)]
fn taken(map: &CtMap, key: &CtKey, now: u64, cfg: &TcConfig) -> bool {
    match map.get_ptr(key) {
        None => false,
        // SAFETY: read in place for this run.
        Some(e) => conntrack::live(unsafe { &*e }, key.proto, now, cfg),
    }
}

/// Reserves a SNAT port for the flow in `scratch`: its reply entry is
/// inserted into `table` with `BPF_NOEXIST`, so two CPUs can never take one
/// port. A port whose reply key is live in `LB_CONNTRACK` (when `table`
/// is `LB_CT_SYN`) is taken too; it is checked before the insert and again
/// after it, which closes the window of a flow being moved there at that
/// moment. Sets `scratch.forward.nat_sport`; false if every try failed.
///
/// A global function (verified once, on its own): its loop walked along
/// every path of `new_flow` that reaches it cost the verifier more than
/// the rest of the program. So it takes scalars only (`table` as
/// `Table::Syn as u32` or `Table::Main as u32`) and finds the flow in this
/// CPU's `LB_TC_SCRATCH`; 1 if a port was reserved.
#[no_mangle]
#[inline(never)]
pub extern "C" fn tc_reserve_snat(table: u32, now: u64) -> u32 {
    let (Some(cfg), Some(scratch)) = (config(), this_cpu(&LB_TC_SCRATCH)) else {
        return 0;
    };
    let table = if table == Table::Syn as u32 {
        Table::Syn
    } else {
        Table::Main
    };
    reserve_snat(cfg, scratch, table, now) as u32
}

#[inline(always)]
fn reserve_snat(cfg: &TcConfig, scratch: &mut Scratch, table: Table, now: u64) -> bool {
    let min = cfg.snat_port_min as u32;
    let span = (cfg.snat_port_max as u32).saturating_sub(min) + 1;
    // SAFETY: plain helper call.
    let start = unsafe { bpf_get_prandom_u32() } % span;
    let syn_table = table == Table::Syn;
    // The first port tried that an idle unfinished handshake holds.
    let mut stale: u16 = 0;
    for i in 0..SNAT_TRIES {
        let port = (min + (start + i) % span) as u16;
        scratch.reply_key.dport = port;
        let free = port != 0
            && !(syn_table && taken(&LB_CONNTRACK, &scratch.reply_key, now, cfg))
            && table
                .map()
                .insert(&scratch.reply_key, &scratch.reply, BPF_NOEXIST as u64)
                .is_ok();
        if free {
            if syn_table && taken(&LB_CONNTRACK, &scratch.reply_key, now, cfg) {
                let _ = table.map().remove(&scratch.reply_key);
            } else {
                scratch.forward.nat_sport = port;
                return true;
            }
        } else if syn_table
            && stale == 0
            && port != 0
            && idle_handshake(&scratch.reply_key, now, cfg)
        {
            stale = port;
        }
        count(stat::TC_SNAT_RETRY);
    }
    stale != 0 && reclaim_snat(cfg, scratch, stale, now)
}

/// How long an unfinished handshake must have sent nothing, either way,
/// before a new flow that found no free SNAT port takes its port. A
/// handshake on its way completes within a round trip of the SYN-ACK; one
/// that waits sends again, its client its SYN at 1, 3, 7 and 15 s, its
/// backend its SYN-ACK at 1, 3, 7, 15 and 31 s. What is idle both ways
/// this long is mostly a spoofed SYN's; a real client that loses its port
/// so gets a new flow and port with its next SYN.
const HANDSHAKE_IDLE_S: u32 = 3;

/// Whether entry `e` of an unfinished handshake (in `LB_CT_SYN`) is over
/// or idle for [`HANDSHAKE_IDLE_S`] at least.
#[inline(always)]
fn idle(e: &CtEntry, l4proto: u8, now: u64, cfg: &TcConfig) -> bool {
    !conntrack::live(e, l4proto, now, cfg) || !clock::within(now, e.last_seen_ns, HANDSHAKE_IDLE_S)
}

/// Whether the reply entry under `reply_key` in `LB_CT_SYN` (a SNAT port
/// taken) is [`idle`]: as far as it tells, its handshake is.
#[inline(always)]
fn idle_handshake(reply_key: &CtKey, now: u64, cfg: &TcConfig) -> bool {
    // SAFETY: read in place for this run.
    LB_CT_SYN
        .get_ptr(reply_key)
        .is_some_and(|e| idle(unsafe { &*e }, reply_key.proto, now, cfg))
}

/// Takes SNAT port `port` from the unfinished handshake that holds it in
/// `LB_CT_SYN` (as netfilter's early drop takes a full table's unassured
/// entries): both its entries go, the forward one only if it is idle too
/// and translates to this port, then the port is reserved as in the loop
/// of `reserve_snat`. Under a SYN flood the crowded ports are mostly
/// spoofed handshakes that never complete; without this, a legitimate SYN
/// was dropped until they expired. The handshake's client, if there is
/// one, starts again with its next SYN.
#[inline(always)]
fn reclaim_snat(cfg: &TcConfig, scratch: &mut Scratch, port: u16, now: u64) -> bool {
    scratch.reply_key.dport = port;
    let Some(old) = LB_CT_SYN.get_ptr(&scratch.reply_key) else {
        return false;
    };
    // Its forward key (`CtKey::partner`), field by field: a whole key
    // built on the stack would not fit beside the callers' frames.
    // SAFETY: read in place for this run.
    let old = unsafe { &*old };
    let stale = &mut scratch.stale_key;
    stale.src = old.nat_dst;
    stale.dst = old.nat_src;
    stale.sport = old.nat_dport;
    stale.dport = old.nat_sport;
    stale.proto = scratch.reply_key.proto;
    stale._pad = [0; 3];
    if !idle(old, stale.proto, now, cfg) {
        return false;
    }
    if let Some(fwd) = LB_CT_SYN.get_ptr(&scratch.stale_key) {
        // SAFETY: read in place for this run.
        let fwd = unsafe { &*fwd };
        if !idle(fwd, scratch.reply_key.proto, now, cfg) {
            return false;
        }
        if fwd.nat_sport == port {
            let _ = LB_CT_SYN.remove(&scratch.stale_key);
        }
    }
    let _ = LB_CT_SYN.remove(&scratch.reply_key);
    if LB_CT_SYN
        .insert(&scratch.reply_key, &scratch.reply, BPF_NOEXIST as u64)
        .is_err()
    {
        return false;
    }
    if taken(&LB_CONNTRACK, &scratch.reply_key, now, cfg) {
        let _ = LB_CT_SYN.remove(&scratch.reply_key);
        return false;
    }
    scratch.forward.nat_sport = port;
    count(stat::TC_SNAT_RECLAIMED);
    true
}

/// A packet to an EXTERNAL frontend without a flow yet. Only a TCP SYN
/// opens a TCP flow, into `LB_CT_SYN` until its handshake completes; a UDP
/// datagram opens one in `LB_CONNTRACK`. Returns [`FLOW_OPENED`] once both
/// entries are in, else the packet's verdict; the packet itself is
/// translated afterwards as one of the flow (see `ingress`).
#[inline(always)]
fn new_flow(ctx: &TcContext, p: &Pkt, scratch: &mut Scratch, key: &CtKey, cfg: &TcConfig) -> i32 {
    let skey = ServiceKey {
        addr: p.dst,
        port: p.dport,
        proto: p.proto,
        scope: scope::EXTERNAL,
    };
    // Only a SYN's miss is checked against the VIP's marker: passed to
    // the node it would meet an RST, while another packet without a flow
    // is not ours anyway (most of them: every packet to the node's own
    // ports), and a datagram lost so is one of UDP's.
    let syn = p.proto == proto::TCP && p.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN;
    let Frontend::Served(svc) = lb::lookup_frontend(&skey, syn) else {
        return TC_ACT_UNSPEC;
    };
    if svc.flags & service_flags::WILDCARD != 0 {
        return TC_ACT_UNSPEC;
    }
    // SAFETY: plain helper call (only for a frontend: most packets are not).
    let now = unsafe { bpf_ktime_get_ns() };
    if !source_allowed(p) {
        count(stat::TC_DROP_SOURCE_RANGE);
        return TC_ACT_SHOT;
    }
    // Mid-flow TCP without a flow (netfilter's INVALID): its flow expired,
    // was evicted, was NATed by netfilter (kube-proxy's rules, before the
    // agent attached), or never was. Giving it a backend now would only
    // make that backend answer with an RST. To a node address the stack
    // may still know it (see `service_flags::NODE_ADDRESS`).
    if p.proto == proto::TCP && p.tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST | TCP_FIN) != TCP_SYN {
        if svc.flags & service_flags::NODE_ADDRESS != 0 {
            count(stat::TC_PASS_NO_FLOW);
            return TC_ACT_UNSPEC;
        }
        count(stat::TC_DROP_INVALID);
        return TC_ACT_SHOT;
    }
    // The backend is copied straight into map memory, as the packet is
    // (see `parse`).
    let chosen = choose(p, &svc, now).and_then(|id| {
        scratch.backend = lb::backend_by_id(id)?;
        Some(id)
    });
    // No backend (externalTrafficPolicy Local without local endpoints):
    // dropped, as kube-proxy does.
    let Some(backend_id) = chosen else {
        // No endpoint anywhere: REJECT, as kube-proxy does.
        if svc.flags & service_flags::REJECT != 0 {
            return icmp::reject(ctx, p);
        }
        count(stat::TC_DROP_NO_BACKEND);
        return TC_ACT_SHOT;
    };
    let b = &scratch.backend;
    if is_ipv4_mapped(&b.addr) == p.v6 {
        count(stat::TC_DROP_FAMILY);
        return TC_ACT_SHOT;
    }
    let table = if p.proto == proto::TCP {
        Table::Syn
    } else {
        Table::Main
    };
    let local = b.flags & lb_common::backend_flags::LOCAL != 0;
    let fwd = &mut scratch.forward;
    fwd.nat_dst = b.addr;
    fwd.nat_dport = b.port;
    fwd.backend_id = backend_id;
    fwd.service_id = svc.id;
    fwd.state = [0; ct_state::COUNT];
    fwd.last_seen_ns = now;
    fwd.ack_seq = 0;
    fwd.backend_time_wait = 0;
    fwd.answered = 0;
    fwd.syn_timed_out = 0;
    fwd.syn_seq = CtEntry::syn_seq_mark(p.seq);
    // SAFETY: all zeros is "no next hop".
    fwd.hop = unsafe { core::mem::zeroed() };
    if local {
        fwd.nat_src = p.src;
        fwd.nat_sport = p.sport;
        fwd.flags = ct_flags::LOCAL;
    } else {
        fwd.nat_src = if p.v6 { cfg.snat_v6 } else { cfg.snat_v4 };
        if fwd.nat_src == [0u8; 16] {
            count(stat::TC_DROP_SNAT_NO_ADDRESS);
            return TC_ACT_SHOT;
        }
        fwd.flags = ct_flags::SNAT;
    }
    // Both without a branch (see `algorithm::counts_bit`).
    let counted = algorithm::counts_bit(svc.algorithm()) as u8 * ct_flags::COUNTED;
    fwd.flags |= (svc.flags & service_flags::OUTLIER_DETECT != 0) as u8 * ct_flags::WATCHED;
    let rkey = &mut scratch.reply_key;
    rkey.src = b.addr;
    rkey.dst = fwd.nat_src;
    rkey.sport = b.port;
    rkey.dport = fwd.nat_sport;
    rkey.proto = p.proto;
    rkey._pad = [0; 3];
    let reply = &mut scratch.reply;
    reply.nat_src = p.dst;
    reply.nat_dst = p.src;
    reply.nat_sport = p.dport;
    reply.nat_dport = p.sport;
    reply.backend_id = backend_id;
    reply.service_id = svc.id;
    reply.flags = fwd.flags | ct_flags::REPLY;
    fwd.flags |= counted;
    reply.state = [0; ct_state::COUNT];
    reply.last_seen_ns = now;
    reply.ack_seq = 0;
    reply.backend_time_wait = 0;
    reply.answered = 0;
    reply.syn_timed_out = 0;
    reply.syn_seq = 0;
    // SAFETY: as above.
    reply.hop = unsafe { core::mem::zeroed() };
    if local && !reply_key_held(table, &scratch.reply_key, p, now, cfg) {
        // The reply key is the client's own tuple reversed: only this
        // client can hold it, and a flow it held through this frontend
        // is over.
        if table
            .map()
            .insert(&scratch.reply_key, &scratch.reply, BPF_ANY as u64)
            .is_err()
        {
            count(stat::TC_DROP_CT_FULL);
            return TC_ACT_SHOT;
        }
    } else if tc_reserve_snat(table as u32, now) == 0 {
        count(stat::TC_DROP_SNAT_EXHAUSTED);
        return TC_ACT_SHOT;
    }
    if table
        .map()
        .insert(key, &scratch.forward, BPF_ANY as u64)
        .is_err()
    {
        let _ = table.map().remove(&scratch.reply_key);
        count(stat::TC_DROP_CT_FULL);
        return TC_ACT_SHOT;
    }
    if local && scratch.forward.nat_sport != p.sport {
        count(stat::TC_SOURCE_PORT_REMAPPED);
    }
    if scratch.forward.flags & ct_flags::COUNTED != 0 {
        lb::flow_counted(backend_id);
    }
    FLOW_OPENED
}

/// Whether a live flow through another frontend holds `reply_key`, the
/// reply key a new flow to a node-local backend would take (its client's
/// tuple reversed): the client used one source port for two frontends of
/// one backend. Both flows would reach the backend as one connection (an
/// RST or a challenge ACK for the second, replies of the first leaving
/// from the second's frontend), so the new flow takes another source port
/// toward the backend (`tc_reserve_snat`, the client's address kept), as
/// netfilter's NAT remaps the source port of a connection whose reply
/// tuple is taken. A flow through the same frontend is this client's
/// earlier one on that tuple, whose entry the new one replaces.
#[inline(always)]
fn reply_key_held(table: Table, reply_key: &CtKey, p: &Pkt, now: u64, cfg: &TcConfig) -> bool {
    let frontend = p.tuple().dst;
    let other_flow = |map: &CtMap| match map.get_ptr(reply_key) {
        None => false,
        Some(e) => {
            // SAFETY: read in place for this run.
            let e = unsafe { &*e };
            let nat = nat_tuple(e);
            conntrack::live(e, p.proto, now, cfg) && (nat.src != frontend || nat.sport != p.dport)
        }
    };
    other_flow(table.map()) || (table == Table::Syn && other_flow(&LB_CONNTRACK))
}

#[inline(always)]
fn finish(
    ctx: &TcContext,
    p: &Pkt,
    (e, ptr): (&CtEntry, *mut CtEntry),
    now: u64,
    at_ingress: bool,
) -> i32 {
    if !rewrite(ctx, p, e) {
        count(stat::TC_DROP_REWRITE);
        return TC_ACT_SHOT;
    }
    count(stat::TC_TRANSLATED);
    frag::record(ctx, p, e, at_ingress);
    if at_ingress && e.flags & (ct_flags::SNAT | ct_flags::REPLY) != 0 {
        redirect(ctx, p, e, ptr, now)
    } else {
        TC_ACT_OK
    }
}

#[inline(always)]
fn key_of(p: &Pkt) -> CtKey {
    CtKey {
        src: p.src,
        dst: p.dst,
        sport: p.sport,
        dport: p.dport,
        proto: p.proto,
        _pad: [0; 3],
    }
}

const IPPROTO_ICMP: u8 = 1;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_PARAMETERPROB: u8 = 12;

/// An IPv4 ICMP error about a reply of a translated flow (the client, or a
/// router on the way to it, answering the frontend; "fragmentation needed"
/// is the one that matters): the quoted packet is frontend -> client, the
/// flow's forward entry says where it really came from. The error goes to
/// the backend with the quoted header as the backend sent it. Anything
/// else is passed on untouched.
#[inline(always)]
fn icmp4_error(ctx: &TcContext) -> i32 {
    let Some(v) = icmp4_error_inner(ctx) else {
        return TC_ACT_UNSPEC;
    };
    v
}

#[inline(always)]
fn icmp4_error_inner(ctx: &TcContext) -> Option<i32> {
    if u16::from_be(ctx.load::<u16>(12).ok()?) != ETH_P_IP {
        return None;
    }
    let vihl: u8 = ctx.load(ETH_HLEN).ok()?;
    let ihl = (vihl & 0x0f) as usize * 4;
    let frag = u16::from_be(ctx.load::<u16>(ETH_HLEN + 6).ok()?);
    if ihl < 20 || frag & 0x3fff != 0 || ctx.load::<u8>(ETH_HLEN + 9).ok()? != IPPROTO_ICMP {
        return None;
    }
    let icmp = ETH_HLEN + ihl;
    let kind: u8 = ctx.load(icmp).ok()?;
    if kind != ICMP_DEST_UNREACH && kind != ICMP_TIME_EXCEEDED && kind != ICMP_PARAMETERPROB {
        return None;
    }
    let inner = icmp + 8;
    let ivihl: u8 = ctx.load(inner).ok()?;
    let iihl = (ivihl & 0x0f) as usize * 4;
    let iproto: u8 = ctx.load(inner + 9).ok()?;
    if iihl < 20 || (iproto != proto::TCP && iproto != proto::UDP) {
        return None;
    }
    let isrc: [u8; 4] = ctx.load(inner + 12).ok()?;
    let idst: [u8; 4] = ctx.load(inner + 16).ok()?;
    let ports = inner + iihl;
    let isport = u16::from_be(ctx.load::<u16>(ports).ok()?);
    let idport = u16::from_be(ctx.load::<u16>(ports + 2).ok()?);
    let outer_dst: [u8; 4] = ctx.load(ETH_HLEN + 16).ok()?;
    // The quoted packet left as frontend -> client: the forward key is
    // client -> frontend. The error must be addressed to the frontend.
    if outer_dst != isrc {
        return None;
    }
    let key = CtKey {
        src: lb_common::ipv4_mapped(idst),
        dst: lb_common::ipv4_mapped(isrc),
        sport: idport,
        dport: isport,
        proto: iproto,
        _pad: [0; 3],
    };
    let e = quoted_flow(&key)?;
    let nat = nat_tuple(e);
    let (backend, peer) = (nat.dst.v4(), nat.src.v4());
    let (old_src, old_dst) = (u32::from_ne_bytes(isrc), u32::from_ne_bytes(idst));
    let icmp_csum = icmp + 2;
    let old_icsum: u16 = ctx.load(inner + 10).ok()?;
    // The quoted header: frontend -> client becomes backend -> client (or
    // node address and SNAT port); its IP checksum, then the ICMP checksum
    // over every changed quoted byte.
    let ok = set_ipv4_addrs(ctx, inner, (old_src, backend), (old_dst, peer))
        && ctx.store(ports, &e.nat_dport.to_be(), 0).is_ok()
        && ctx.store(ports + 2, &e.nat_sport.to_be(), 0).is_ok();
    if !ok {
        count(stat::TC_DROP_REWRITE);
        return Some(TC_ACT_SHOT);
    }
    let new_icsum: u16 = ctx.load(inner + 10).ok()?;
    let ok = ctx.l4_csum_replace(icmp_csum, old_src as u64, backend as u64, 4).is_ok()
        && ctx.l4_csum_replace(icmp_csum, old_dst as u64, peer as u64, 4).is_ok()
        && ctx.l4_csum_replace(icmp_csum, old_icsum as u64, new_icsum as u64, 2).is_ok()
        && ctx.l4_csum_replace(icmp_csum, isport.to_be() as u64, e.nat_dport.to_be() as u64, 2).is_ok()
        && ctx.l4_csum_replace(icmp_csum, idport.to_be() as u64, e.nat_sport.to_be() as u64, 2).is_ok()
        // The outer destination: the backend (ICMP has no pseudo-header).
        && ctx.l3_csum_replace(ETH_HLEN + 10, old_src as u64, backend as u64, 4).is_ok()
        && ctx.store(ETH_HLEN + 16, &backend, 0).is_ok();
    if !ok {
        count(stat::TC_DROP_REWRITE);
        return Some(TC_ACT_SHOT);
    }
    count(stat::TC_TRANSLATED);
    Some(TC_ACT_OK)
}

/// The flow of `key`: `LB_CONNTRACK` first, then `LB_CT_SYN` for TCP
/// (a flow is there until the client acknowledged its backend's answer).
#[inline(always)]
fn lookup(key: &CtKey, p: &Pkt) -> Option<(Table, *mut CtEntry)> {
    if let Some(ptr) = LB_CONNTRACK.get_ptr_mut(key) {
        return Some((Table::Main, ptr));
    }
    lookup_syn(key, p).map(|ptr| (Table::Syn, ptr))
}

#[inline(always)]
fn lookup_syn(key: &CtKey, p: &Pkt) -> Option<*mut CtEntry> {
    if p.proto != proto::TCP {
        return None;
    }
    LB_CT_SYN.get_ptr_mut(key)
}

/// Translates a packet of the flow whose entry for `key` is `ptr` in
/// `table` (at egress, only reply entries are followed). None when the
/// tuple has no live flow: its entry expired (and goes), or a new
/// connection reuses a closing flow's tuple, through the frontend or
/// around it (both its entries go).
#[inline(always)]
fn follow<const AT_INGRESS: bool>(
    ctx: &TcContext,
    p: &Pkt,
    key: &CtKey,
    (mut table, mut ptr): (Table, *mut CtEntry),
    now: u64,
    cfg: &TcConfig,
) -> Option<i32> {
    let at_ingress = AT_INGRESS;
    // SAFETY (both reads): valid for this run; a copy, since a moved
    // entry's memory may be reused by another CPU before this run ends.
    let mut e = unsafe { core::ptr::read(ptr) };
    if !conntrack::live(&e, p.proto, now, cfg) {
        // Alone: its partner's tuple may be a newer flow's by now.
        let _ = table.map().remove(key);
        // An expired LB_CONNTRACK entry must not hide a new flow of the same
        // tuple in LB_CT_SYN: a client port, or a SNAT port, taken again
        // once the old flow ended (until the sweep, the old entry stays).
        if table == Table::Syn {
            return None;
        }
        ptr = lookup_syn(key, p)?;
        table = Table::Syn;
        e = unsafe { core::ptr::read(ptr) };
        if !conntrack::live(&e, p.proto, now, cfg) {
            let _ = LB_CT_SYN.remove(key);
            return None;
        }
    }
    if !at_ingress && e.flags & ct_flags::REPLY == 0 {
        return Some(TC_ACT_UNSPEC);
    }
    // A new SYN on a closing forward entry, or on an unfinished handshake
    // that is not its first SYN sent again (another sequence number), is
    // a new connection that reuses the client port: it gets a fresh
    // choice. Never on an established flow: a SYN there (spoofed with the
    // flow's tuple) must not take the flow's entries away.
    let reopened = p.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN
        && (e.state[ct_state::CLOSING] != 0 || (table == Table::Syn && e.another_syn(p.seq)))
        && e.flags & ct_flags::REPLY == 0;
    // A backend's SYN-ACK once its flow began to close (a FIN or an RST
    // seen) answers a new connection on the same tuple that did not come
    // through the frontend: straight to the pod, or translated at connect
    // by a socket hook. Not this flow's, and its entries are stale.
    let answers_another = p.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN | TCP_ACK
        && e.flags & ct_flags::REPLY != 0
        && (e.state[ct_state::CLOSING] != 0
            || e.state[ct_state::FIN] != 0
            || e.backend_time_wait != 0);
    if reopened || answers_another {
        let _ = table.map().remove(&CtKey::partner(&e, p.proto));
        let _ = table.map().remove(key);
        return None;
    }
    let Some(failed) = track(table, key, ptr, &e, p, now) else {
        return Some(TC_ACT_SHOT);
    };
    let verdict = finish(ctx, p, (&e, ptr), now, at_ingress);
    Some(if failed {
        verdict + FAILED_CONNECT_NOTED
    } else {
        verdict
    })
}

/// The forward entry of the flow an ICMP error is about (`key`: client ->
/// frontend, from the quoted reply), in either table: errors are rare, and
/// one may answer a SYN.
#[inline(always)]
pub(crate) fn quoted_flow(key: &CtKey) -> Option<&'static CtEntry> {
    let e = LB_CONNTRACK
        .get_ptr(key)
        .or_else(|| LB_CT_SYN.get_ptr(key))?;
    // SAFETY: valid for this program run, the only time it is used; read
    // in place.
    let e = unsafe { &*e };
    (e.flags & ct_flags::REPLY == 0).then_some(e)
}

/// tc ingress of an external device, in three parts. Each part is a global
/// function, which the verifier checks once on its own (for any packet)
/// rather than along every path that leads to it: walked as one program,
/// the parts' paths multiplied past the verifier's million instructions.
///
/// A new flow's first packet goes through `tc_ingress_flow` again once
/// `tc_ingress_new_flow` has recorded the flow, and is translated there as
/// any packet of a known flow: so `tc_ingress_new_flow` (the largest
/// stack frame) never holds the translation's frames too. The BPF stack
/// is 512 bytes for a whole chain of calls, and the verifiers of 5.10 and
/// 6.1 round each frame up to 32 bytes: `tc_ingress_new_flow` calling
/// `tc_reserve_snat` while it also translated took 544 there. The cost:
/// that one packet is parsed three times and looked up once more.
#[inline(always)]
pub fn ingress(ctx: &TcContext) -> i32 {
    // Before anything else, as kube-proxy's PREROUTING check: any packet
    // to an unallocated address of the Service CIDRs, whatever its port.
    if guard::ranges().is_some() && guard::tc_ingress_guard(ctx.skb.skb) == TC_ACT_SHOT {
        return TC_ACT_SHOT;
    }
    if surely_not_ours(ctx) {
        return TC_ACT_UNSPEC;
    }
    let verdict = match tc_ingress_flow(ctx.skb.skb) {
        NOT_PARSED => tc_ingress_other(ctx.skb.skb),
        NO_FLOW => match tc_ingress_new_flow(ctx.skb.skb) {
            FLOW_OPENED => match tc_ingress_flow(ctx.skb.skb) {
                // Gone at once: evicted from a full table by another CPU.
                NOT_PARSED | NO_FLOW => {
                    count(stat::TC_DROP_CT_FULL);
                    TC_ACT_SHOT
                }
                verdict => verdict,
            },
            verdict => verdict,
        },
        verdict => verdict,
    };
    // A failed connect noted: acted on here, in the smallest frame.
    if verdict >= FAILED_CONNECT_NOTED / 2 {
        outlier::tc_failed_connect();
        return verdict - FAILED_CONNECT_NOTED;
    }
    verdict
}

/// Added to `tc_ingress_flow`'s and `tc_egress_flow`'s verdict (a
/// `TC_ACT_*`, -1 to 8) when the packet told of a failed connect
/// (`outlier::note_tc_failure`), for `ingress` and `egress` to act on
/// (`outlier::tc_failed_connect`).
const FAILED_CONNECT_NOTED: i32 = 1 << 20;
/// `tc_ingress_flow`: not a TCP or UDP packet with ports.
const NOT_PARSED: i32 = -1000;
/// `tc_ingress_flow`: no live flow of the packet's tuple.
const NO_FLOW: i32 = -1001;
/// `tc_ingress_new_flow`: the flow's entries are recorded; the packet is
/// to be translated as one of it.
const FLOW_OPENED: i32 = -1002;

/// A packet of a known flow: translated as its entry says.
#[no_mangle]
#[inline(never)]
pub extern "C" fn tc_ingress_flow(skb: *mut __sk_buff) -> i32 {
    let ctx = &TcContext::new(skb);
    let Some(p) = parse(ctx) else {
        return NOT_PARSED;
    };
    frag::mark(ctx, p);
    // CVE-2020-8558: nothing from the wire is served on a loopback address.
    if is_loopback(p) {
        count(stat::TC_DROP_LOOPBACK);
        return TC_ACT_SHOT;
    }
    let Some(cfg) = config() else {
        return TC_ACT_UNSPEC;
    };
    let key = key_of(p);
    let Some(found) = lookup(&key, p) else {
        return NO_FLOW;
    };
    // SAFETY: plain helper call (only for a flow: most packets have none).
    let now = unsafe { bpf_ktime_get_ns() };
    follow::<true>(ctx, p, &key, found, now, cfg).unwrap_or(NO_FLOW)
}

/// A packet to an EXTERNAL frontend without a flow yet (`new_flow`).
#[no_mangle]
#[inline(never)]
pub extern "C" fn tc_ingress_new_flow(skb: *mut __sk_buff) -> i32 {
    let ctx = &TcContext::new(skb);
    let Some(p) = parse(ctx) else {
        return TC_ACT_UNSPEC;
    };
    let (Some(cfg), Some(scratch)) = (config(), this_cpu(&LB_TC_SCRATCH)) else {
        return TC_ACT_UNSPEC;
    };
    new_flow(ctx, p, scratch, &key_of(p), cfg)
}

/// Later fragments, and ICMP errors about a flow's replies.
#[no_mangle]
#[inline(never)]
pub extern "C" fn tc_ingress_other(skb: *mut __sk_buff) -> i32 {
    let ctx = &TcContext::new(skb);
    if let Some(verdict) = frag::later(ctx, true) {
        return verdict;
    }
    match icmp4_error(ctx) {
        TC_ACT_UNSPEC => icmp::icmp6_error(ctx),
        verdict => verdict,
    }
}

/// IPv4 fragment bits (of the flags and offset field) `usual_port` turns
/// away: a later fragment's (the offset), which has no ports; at ingress a
/// first fragment's too (more fragments), which `frag::mark` must see so
/// that its later fragments pass.
const LATER_FRAGMENT: u16 = 0x1fff;
const ANY_FRAGMENT: u16 = 0x3fff;

/// A packet's protocol and one of its ports (at `l4_off` into the
/// transport header: 0 source, 2 destination), read from its bytes where
/// the usual packet has them: IPv4 without options and none of
/// `fragment_bits`, or IPv6 without extension headers, carrying TCP or
/// UDP. None for anything else, which goes the whole way.
#[inline(always)]
fn usual_port(ctx: &TcContext, l4_off: usize, fragment_bits: u16) -> Option<(u8, u16)> {
    let (l4proto, port) = match at::<u16>(ctx, 12).map(u16::from_be)? {
        ETH_P_IP => {
            let h = at::<[u8; 10]>(ctx, ETH_HLEN)?;
            if h[0] != 0x45 || u16::from_be_bytes([h[6], h[7]]) & fragment_bits != 0 {
                return None;
            }
            (h[9], at::<u16>(ctx, L4_V4 + l4_off)?)
        }
        ETH_P_IPV6 => (
            at::<u8>(ctx, ETH_HLEN + 6)?,
            at::<u16>(ctx, L4_V6 + l4_off)?,
        ),
        _ => return None,
    };
    (l4proto == proto::TCP || l4proto == proto::UDP).then_some((l4proto, u16::from_be(port)))
}

/// Most of what arrives on a device is the node's own traffic: a packet
/// to a port no frontend of the tc path listens on for its protocol
/// (`LB_FRONTEND_PORTS`) and outside the SNAT ports (replies of
/// masqueraded flows) is none of ours. Decided from its bytes, before the
/// conntrack and frontend lookups; anything `usual_port` cannot read goes
/// the whole way.
#[inline(always)]
fn surely_not_ours(ctx: &TcContext) -> bool {
    let Some((l4proto, dport)) = usual_port(ctx, 2, ANY_FRAGMENT) else {
        return false;
    };
    let Some(cfg) = config() else {
        return false;
    };
    !(cfg.snat_port_min..=cfg.snat_port_max).contains(&dport)
        && !port_marked(&LB_FRONTEND_PORTS, l4proto, dport)
}

/// Most of what leaves a device is not a local backend's reply, and the
/// usual packet says so in a few bytes: IPv4 without options and not a
/// later fragment, or IPv6 without extension headers, carrying TCP or UDP
/// from a source port no local backend serves for that protocol
/// (`LB_LOCAL_PORTS`). Decided here, before `parse` copies the packet's
/// addresses into map memory; anything else goes the whole way, to the
/// same decision or a translation.
#[inline(always)]
fn surely_not_a_reply(ctx: &TcContext) -> bool {
    usual_port(ctx, 0, LATER_FRAGMENT)
        .is_some_and(|(l4proto, sport)| !port_marked(&LB_LOCAL_PORTS, l4proto, sport))
}

/// tc egress of an external device: replies of local backends.
#[inline(always)]
pub fn egress(ctx: &TcContext) -> i32 {
    if surely_not_a_reply(ctx) {
        return TC_ACT_UNSPEC;
    }
    let verdict = tc_egress_flow(ctx.skb.skb);
    // A local backend's RST to a SYN: acted on here, in the smallest
    // frame, as at ingress.
    if verdict >= FAILED_CONNECT_NOTED / 2 {
        outlier::tc_failed_connect();
        return verdict - FAILED_CONNECT_NOTED;
    }
    verdict
}

/// A packet that may be a local backend's reply: translated as its flow's
/// reply entry says. A global function, so that `egress` can act on a
/// failed connect (`FAILED_CONNECT_NOTED`) beside a small frame rather
/// than this one.
#[no_mangle]
#[inline(never)]
pub extern "C" fn tc_egress_flow(skb: *mut __sk_buff) -> i32 {
    let ctx = &TcContext::new(skb);
    let Some(p) = parse(ctx) else {
        return frag::later(ctx, false).unwrap_or(TC_ACT_UNSPEC);
    };
    // Only a local backend's reply can be ours (as above, for the packets
    // `surely_not_a_reply` does not parse), decided without the conntrack
    // lookup that misses for the rest.
    if !port_marked(&LB_LOCAL_PORTS, p.proto, p.sport) {
        return TC_ACT_UNSPEC;
    }
    let key = key_of(p);
    let Some(found) = lookup(&key, p) else {
        return TC_ACT_UNSPEC;
    };
    // Only reply entries are followed here; a forward entry's key is the
    // client's tuple, which this node's own traffic may share.
    // SAFETY: read in place for this run.
    if unsafe { (*found.1).flags } & ct_flags::REPLY == 0 {
        return TC_ACT_UNSPEC;
    }
    let Some(cfg) = config() else {
        return TC_ACT_UNSPEC;
    };
    // SAFETY: plain helper call.
    let now = unsafe { bpf_ktime_get_ns() };
    follow::<false>(ctx, p, &key, found, now, cfg).unwrap_or(TC_ACT_UNSPEC)
}
