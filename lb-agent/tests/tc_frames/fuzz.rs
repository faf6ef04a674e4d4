//! Fuzz target of the tc programs through `BPF_PROG_TEST_RUN`: short runs
//! of frames through `tc_ingress` and `tc_egress` of one fixture (NodePort
//! frontends with local and remote backends, IPv4 and IPv6, TCP and UDP, a
//! Service without endpoints, a backend behind a small MTU), each frame
//! generated (any flags, fragments, IPv6 extension chains, ICMP errors
//! quoting any of them) or a seed of `fuzz/corpus/frames/` mutated (bytes
//! and header fields: truncated headers, odd IHL, lengths), some with
//! their checksums made right again so that they get past the checks. The
//! reply to each rewritten frame goes back through both programs.
//!
//! Properties: every run returns a TC action and never fails; a frame
//! left to others (`TC_ACT_UNSPEC`) is untouched; a frame that had valid
//! checksums and is not dropped leaves with valid checksums (IPv4 header,
//! TCP/UDP/ICMP over the pseudo header, the quoted IPv4 header of an ICMP
//! error); one run adds at most a flow's two conntrack entries, and only
//! when it handled the frame.
use std::cell::RefCell;

use etherparse::{NetSlice, SlicedPacket};
use proptest::{
    prelude::*,
    sample::{select, Index},
    test_runner::{FileFailurePersistence, TestCaseError, TestRunner},
};

use super::*;
use crate::mutate::{self, Grammar};

/// Cases (short runs of frames) in the bounded run of `cargo xtask test`.
const SHORT: u32 = 512;

const CLIENT4: &str = "192.168.77.100";
const CLIENT6: &str = "fd00:77::100";

/// (family is IPv6, address) of every address a generated frame uses.
const ADDRS: [(bool, &str); 12] = [
    (false, CLIENT4),
    (false, NODE4),
    (false, "10.244.1.10"),
    (false, "10.244.2.10"),
    (false, "10.244.9.10"),
    (false, "10.96.0.10"),
    (true, CLIENT6),
    (true, NODE6),
    (true, "fd00:244:1::10"),
    (true, "fd00:244:2::10"),
    (true, "fd00:244:9::10"),
    (true, "fd00:96::10"),
];
const PORTS: [u16; 10] = [
    30080, 30053, 30090, 30099, 8080, 5353, 40000, 40001, 61000, 65535,
];

/// The fixture's backends and frontends (see the module's doc).
fn fixture() -> Fixture {
    let mut fx = Fixture::new();
    fx.backend(1, "10.244.1.10", 8080, proto::TCP, true);
    fx.backend(2, "10.244.2.10", 8080, proto::TCP, false);
    fx.backend(3, "10.244.1.10", 5353, proto::UDP, true);
    fx.backend(4, "10.244.2.10", 5353, proto::UDP, false);
    fx.backend(5, "fd00:244:1::10", 8080, proto::TCP, true);
    fx.backend(6, "fd00:244:2::10", 8080, proto::TCP, false);
    fx.backend(7, "10.244.9.10", 8080, proto::TCP, false);
    fx.backend(8, "fd00:244:9::10", 5353, proto::UDP, false);
    fx.frontend(NODE4, 30080, proto::TCP, 1, &[1, 2]);
    fx.frontend(NODE4, 30053, proto::UDP, 2, &[3, 4]);
    fx.frontend(NODE6, 30080, proto::TCP, 3, &[5, 6]);
    fx.frontend(NODE4, 30090, proto::TCP, 4, &[7]);
    fx.frontend(NODE6, 30053, proto::UDP, 5, &[8]);
    fx.frontend(NODE4, 30099, proto::TCP, 6, &[]);
    fx.frontend(NODE6, 30099, proto::UDP, 7, &[]);
    fx
}

// ------------------------------------------------------------ checksums

/// What the checksums of a frame say.
#[derive(Debug, PartialEq, Eq)]
enum Csum {
    /// Every checksum present is right (a fragment's L4 checksum, which
    /// covers the whole datagram, is not looked at).
    Valid,
    Invalid(&'static str),
    /// Not an IP frame etherparse can take apart.
    Unparsed,
}

/// Where `part` (a subslice of `frame`) starts.
fn offset_in(frame: &[u8], part: &[u8]) -> usize {
    part.as_ptr() as usize - frame.as_ptr() as usize
}

/// The parts whose checksums count: (IPv4 header, pseudo header source,
/// destination, L4 protocol, L4 bytes, fragmented).
struct Parts<'a> {
    ipv4_header: Option<&'a [u8]>,
    src: IpAddr,
    dst: IpAddr,
    proto: u8,
    l4: &'a [u8],
    fragmented: bool,
}

fn parts(frame: &[u8]) -> Option<Parts<'_>> {
    let p = SlicedPacket::from_ethernet(frame).ok()?;
    match p.net? {
        NetSlice::Ipv4(ip) => {
            let h = ip.header();
            // The header's slice borrows `ip`; the same bytes of `frame`.
            let at = offset_in(frame, h.slice());
            Some(Parts {
                ipv4_header: Some(&frame[at..at + h.slice().len()]),
                src: IpAddr::from(h.source()),
                dst: IpAddr::from(h.destination()),
                proto: ip.payload().ip_number.0,
                l4: ip.payload().payload,
                fragmented: ip.is_payload_fragmented(),
            })
        }
        NetSlice::Ipv6(ip) => {
            let h = ip.header();
            Some(Parts {
                ipv4_header: None,
                src: IpAddr::from(h.source()),
                dst: IpAddr::from(h.destination()),
                proto: ip.payload().ip_number.0,
                l4: ip.payload().payload,
                fragmented: ip.is_payload_fragmented(),
            })
        }
        NetSlice::Arp(_) => None,
    }
}

/// The IPv4 header quoted by an ICMP error (`l4` = the ICMP message), when
/// it is there whole.
fn quoted_ipv4_header(l4: &[u8]) -> Option<std::ops::Range<usize>> {
    let kind = *l4.first()?;
    if ![3, 4, 5, 11, 12].contains(&kind) || l4.len() < 8 + 20 || l4[8] >> 4 != 4 {
        return None;
    }
    let len = usize::from(l4[8] & 0x0f) * 4;
    (len >= 20 && l4.len() >= 8 + len).then_some(8..8 + len)
}

fn checksums(frame: &[u8]) -> Csum {
    let Some(p) = parts(frame) else {
        return Csum::Unparsed;
    };
    if let Some(h) = p.ipv4_header {
        if fold(sum16(h)) != 0 {
            return Csum::Invalid("IPv4 header");
        }
    }
    if p.fragmented {
        return Csum::Valid;
    }
    let l4 = p.l4;
    let v4 = p.ipv4_header.is_some();
    match p.proto {
        proto::TCP | proto::UDP | 58 => {
            let no_udp_csum = p.proto == proto::UDP && v4 && l4.get(6..8) == Some(&[0u8, 0][..]);
            let pseudo = pseudo_header(p.src, p.dst, p.proto, l4.len());
            if !no_udp_csum && fold(sum16(&pseudo) + sum16(l4)) != 0 {
                return Csum::Invalid("L4 (TCP, UDP or ICMPv6)");
            }
        }
        1 if v4 => {
            if fold(sum16(l4)) != 0 {
                return Csum::Invalid("ICMP");
            }
            if let Some(q) = quoted_ipv4_header(l4) {
                if fold(sum16(&l4[q])) != 0 {
                    return Csum::Invalid("quoted IPv4 header");
                }
            }
        }
        _ => {}
    }
    Csum::Valid
}

/// Makes the checksums of `frame` right again after a mutation, where it
/// parses: quoted IPv4 header, L4, IPv4 header, in that order.
fn fix_checksums(frame: &mut [u8]) {
    let Some(p) = parts(frame) else {
        return;
    };
    let (l4_at, l4_len, ip_at) = (
        offset_in(frame, p.l4),
        p.l4.len(),
        p.ipv4_header.map(|h| (offset_in(frame, h), h.len())),
    );
    let (src, dst, proto, v4, fragmented) =
        (p.src, p.dst, p.proto, p.ipv4_header.is_some(), p.fragmented);
    let l4 = &mut frame[l4_at..l4_at + l4_len];
    let put = |b: &mut [u8], at: usize, sum: u32| {
        b[at..at + 2].copy_from_slice(&[0, 0]);
        let c = fold(sum);
        b[at..at + 2].copy_from_slice(&c.to_be_bytes());
    };
    if !fragmented {
        let csum_at = match proto {
            proto::TCP if l4.len() >= 20 => Some(16),
            proto::UDP if l4.len() >= 8 => Some(6),
            58 | 1 if l4.len() >= 4 => Some(2),
            _ => None,
        };
        if proto == 1 && v4 {
            if let Some(q) = quoted_ipv4_header(l4) {
                let sum = {
                    let h = &mut l4[q.clone()];
                    h[10..12].copy_from_slice(&[0, 0]);
                    sum16(h)
                };
                put(&mut l4[q], 10, sum);
            }
        }
        if let Some(at) = csum_at {
            l4[at..at + 2].copy_from_slice(&[0, 0]);
            let pseudo = if proto == 1 && v4 {
                0
            } else {
                sum16(&pseudo_header(src, dst, proto, l4.len()))
            };
            let sum = pseudo + sum16(l4);
            put(l4, at, sum);
        }
    }
    if let Some((at, len)) = ip_at {
        let h = &mut frame[at..at + len];
        h[10..12].copy_from_slice(&[0, 0]);
        let sum = sum16(h);
        put(h, 10, sum);
    }
}

// --------------------------------------------------------------- frames

/// A frame made from parameters.
#[derive(Clone, Debug)]
enum Made {
    Plain(Frame),
    /// IPv6 with these extension headers (next header, 8-byte body) before
    /// the L4 header.
    Extensions(Frame, Vec<u8>),
    /// The first or the later one of two fragments of a UDP datagram.
    Fragment(Frame, bool, u32),
    /// An ICMP error from `.1` (client or router) quoting the frame,
    /// type and code for IPv4.
    IcmpError(Frame, &'static str, u8, u8),
}

fn frame() -> impl Strategy<Value = Frame> {
    (
        any::<bool>(),
        any::<Index>(),
        any::<Index>(),
        prop_oneof![select(&PORTS[..]), any::<u16>()],
        prop_oneof![select(&PORTS[..]), any::<u16>()],
        any::<bool>(),
        prop_oneof![
            select(
                &[
                    TCP_SYN,
                    TCP_ACK,
                    TCP_SYN | TCP_ACK,
                    TCP_FIN | TCP_ACK,
                    TCP_RST
                ][..]
            ),
            any::<u8>()
        ],
        (any::<u32>(), any::<u32>()),
        select(&[0u16, 0x4000, 0x2000, 0x0003, 0x2003][..]),
        (any::<bool>(), 0usize..1600),
    )
        .prop_map(
            |(v6, s, d, sport, dport, udp, flags, (seq, ack), frag, (no_csum, extra))| {
                let family: Vec<&str> = ADDRS
                    .iter()
                    .filter(|(six, _)| *six == v6)
                    .map(|(_, a)| *a)
                    .collect();
                let (src, dst) = (family[s.index(family.len())], family[d.index(family.len())]);
                let mut f = if udp {
                    Frame::udp(src, sport, dst, dport)
                } else {
                    Frame::tcp(src, sport, dst, dport, flags).seq_ack(seq, ack)
                };
                f.frag = if v6 { 0 } else { frag };
                f.no_udp_csum = no_csum && !v6;
                // Mostly small; sometimes past the small MTU.
                f.extra = if extra > 1200 { extra } else { extra % 64 };
                f
            },
        )
}

/// IPv6 extension headers: hop-by-hop, routing, destination options,
/// fragment (atomic), and an unknown one, each 8 bytes.
fn extensions() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(select(&[0u8, 43, 60, 44, 253][..]), 1..6).prop_map(|kinds| {
        kinds
            .iter()
            .flat_map(|k| {
                let mut h = [*k, 0, 0, 0, 0, 0, 0, 0];
                if *k == 43 {
                    h[2] = 4; // routing type 4 (SRH), segments left 0
                } else if *k != 44 {
                    h[2] = 1; // PadN
                    h[3] = 4;
                }
                h
            })
            .collect()
    })
}

fn made() -> impl Strategy<Value = Made> {
    prop_oneof![
        4 => frame().prop_map(Made::Plain),
        1 => (frame(), extensions()).prop_map(|(f, e)| Made::Extensions(f, e)),
        1 => (frame(), any::<bool>(), any::<u32>()).prop_map(|(f, first, id)| Made::Fragment(f, first, id)),
        2 => (
            frame(),
            select(&[CLIENT4, "10.244.1.1"][..]),
            select(&[(3u8, 4u8), (3, 3), (11, 0), (12, 0), (3, 1), (0, 0)][..]),
        )
            .prop_map(|(f, from, (kind, code))| Made::IcmpError(f, from, kind, code)),
    ]
}

/// `f`'s bytes with the IPv6 extension headers `ext` (chained in the given
/// order, the L4 protocol last) after the fixed header.
fn with_extensions(f: &Frame, ext: &[u8]) -> Vec<u8> {
    let plain = f.bytes();
    if plain[12] != 0x86 {
        return plain;
    }
    let mut ext = ext.to_vec();
    let n = ext.len() / 8;
    let l4 = plain[20];
    let first = ext[0];
    for i in 0..n {
        ext[i * 8] = if i + 1 < n { ext[(i + 1) * 8] } else { l4 };
    }
    // The chain's kinds were in the next-header bytes: shift them.
    let mut out = plain[..54].to_vec();
    out[20] = first;
    let len = u16::from_be_bytes([out[18], out[19]]) + ext.len() as u16;
    out[18..20].copy_from_slice(&len.to_be_bytes());
    out.extend(ext);
    out.extend(&plain[54..]);
    out
}

fn bytes_of(m: &Made) -> Vec<u8> {
    let addr = |f: &Frame| f.src.to_string();
    match m {
        Made::Plain(f) => f.bytes(),
        Made::Extensions(f, ext) => with_extensions(f, ext),
        Made::Fragment(f, first, id) => {
            let (src, dst) = (addr(f), f.dst.to_string());
            let (a, b) = fragments(&src, f.sport, &dst, f.dport, *id);
            if *first {
                a
            } else {
                b
            }
        }
        Made::IcmpError(f, from, kind, code) => {
            // The error travels back towards the quoted frame's source.
            let quoted = f.bytes();
            if f.src.is_ipv4() {
                icmp4_error(from, &addr(f), *kind, *code, &quoted)
            } else {
                let from = if *from == CLIENT4 {
                    CLIENT6
                } else {
                    "fd00:244:1::1"
                };
                icmp6_error(from, &addr(f), 2, &quoted)
            }
        }
    }
}

const GRAMMAR: Grammar = Grammar {
    tokens: &[
        &[0x45],
        &[0x46, 0, 0, 0],
        &[0x4f],
        &[0x44],
        &[0x60, 0, 0, 0],
        &[0, 0, 1, 4, 0, 0, 0, 0],
        &[60, 0, 1, 4, 0, 0, 0, 0],
        &[44, 0, 0, 1, 0, 0, 0, 1],
        &[0x08, 0x00],
        &[0x86, 0xdd],
        &[0x81, 0x00, 0x00, 0x01],
        &[0xff, 0xff],
        &[0, 0],
        &[3, 4, 0, 0, 0, 0, 0x05, 0xdc],
        &[2, 0, 0, 0, 0, 0, 0x05, 0x00],
    ],
    // Ethertype; IPv4 version/IHL, lengths, id, flags/offset, TTL,
    // protocol; IPv6 payload length, next header; the L4 header right
    // after IPv4 (ports, TCP data offset and flags, UDP length) and IPv6.
    offsets: &[
        12, 13, 14, 16, 17, 19, 20, 21, 22, 23, 18, 34, 35, 36, 37, 38, 39, 46, 47, 54, 55, 56, 57,
        58, 59, 62, 66, 67, 42, 43,
    ],
};

/// One frame of a case and the program it goes through.
#[derive(Clone, Debug)]
struct Step {
    egress: bool,
    frame: Vec<u8>,
    what: String,
}

fn step() -> impl Strategy<Value = Step> {
    let mutated = (
        mutate::mutated(mutate::corpus("frames"), GRAMMAR, 4),
        any::<bool>(),
    )
        .prop_map(|((name, mut bytes), fix)| {
            if fix {
                fix_checksums(&mut bytes);
            }
            (format!("mutated {name}, checksums fixed: {fix}"), bytes)
        });
    let made = made().prop_map(|m| (format!("{m:?}"), bytes_of(&m)));
    (
        prop_oneof![3 => made, 2 => mutated],
        prop::bool::weighted(0.2),
    )
        .prop_map(|((what, frame), egress)| Step {
            egress,
            frame,
            what,
        })
}

/// The reply a peer sends to `frame` (addresses and ports swapped, a SYN
/// answered with a SYN-ACK), built anew with valid checksums.
fn reply_to(frame: &[u8]) -> Option<Vec<u8>> {
    let p = parts(frame)?;
    if p.fragmented || p.l4.len() < 8 || ![proto::TCP, proto::UDP].contains(&p.proto) {
        return None;
    }
    let port = |at: usize| u16::from_be_bytes([p.l4[at], p.l4[at + 1]]);
    let (src, dst) = (p.dst.to_string(), p.src.to_string());
    Some(if p.proto == proto::TCP {
        if p.l4.len() < 20 {
            return None;
        }
        let seq = u32::from_be_bytes(p.l4[4..8].try_into().unwrap());
        let flags = if p.l4[13] & TCP_SYN != 0 {
            TCP_SYN | TCP_ACK
        } else {
            TCP_ACK
        };
        Frame::tcp(&src, port(2), &dst, port(0), flags)
            .seq_ack(7, seq.wrapping_add(1))
            .bytes()
    } else {
        Frame::udp(&src, port(2), &dst, port(0)).bytes()
    })
}

/// Whether `frame` is IPv4 or IPv6 by its ethertype but shorter than the
/// fixed header.
fn runt(frame: &[u8]) -> bool {
    match (frame.get(12), frame.get(13)) {
        (Some(0x08), Some(0x00)) => frame.len() < 14 + 20,
        (Some(0x86), Some(0xdd)) => frame.len() < 14 + 40,
        _ => false,
    }
}

const ACTIONS: [u32; 4] = [UNSPEC, OK, SHOT, REDIRECT];

fn entries(fx: &Fixture) -> usize {
    fx.conntrack.keys().count() + fx.conntrack_syn.keys().count()
}

/// One run and its properties; the frame it left, unless dropped.
fn run_one(fx: &mut Fixture, egress: bool, input: &[u8]) -> Result<Option<Vec<u8>>, TestCaseError> {
    // What BPF_PROG_TEST_RUN takes as an skb (EINVAL otherwise): an
    // Ethernet header at least, a page less head- and tailroom at most.
    if !(14..=3000).contains(&input.len()) {
        return Ok(None);
    }
    let program = if egress { tc::EGRESS } else { tc::INGRESS };
    let before = entries(fx);
    let (rc, out) = match fx.test_run(program, input) {
        Ok((rc, out, _)) => (rc, out),
        // The kernel takes no IPv4 or IPv6 frame shorter than the fixed
        // header (a device may still deliver one: the programs check
        // lengths themselves, which the shorter seeds' cuts exercise up to
        // there). Any other error is a failure.
        Err(_) if runt(input) => return Ok(None),
        Err(e) => return Err(TestCaseError::fail(format!("{program}: {e:?}"))),
    };
    let added = entries(fx).saturating_sub(before);
    prop_assert!(ACTIONS.contains(&rc), "{program}: returned {rc}");
    prop_assert!(
        added <= 2,
        "{program}: {added} conntrack entries from one frame"
    );
    if rc == UNSPEC {
        prop_assert!(out == input, "{program}: changed a frame it left to others");
        prop_assert_eq!(added, 0, "{}: recorded a frame it left to others", program);
    }
    if rc == SHOT {
        return Ok(None);
    }
    if checksums(input) == Csum::Valid {
        if out != input {
            REWRITES_CHECKED.with(|n| n.set(n.get() + 1));
        }
        let got = checksums(&out);
        prop_assert_eq!(
            got,
            Csum::Valid,
            "{}: returned {} with bad checksums: {:02x?}",
            program,
            rc,
            out
        );
    }
    Ok((out != input).then_some(out))
}

thread_local! {
    /// Rewritten frames whose checksums were checked: a target that
    /// checks none (a fixture no frame reaches) would pass vacuously.
    static REWRITES_CHECKED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

fn clear_conntrack(fx: &mut Fixture) {
    for map in [&mut fx.conntrack, &mut fx.conntrack_syn] {
        let keys: Vec<CtKey> = map.keys().map(Result::unwrap).collect();
        for k in keys {
            let _ = map.remove(&k);
        }
    }
}

fn run_case(fx: &mut Fixture, steps: &[Step]) -> Result<(), TestCaseError> {
    clear_conntrack(fx);
    for (i, s) in steps.iter().enumerate() {
        let fail = |e: TestCaseError, what: &str| {
            TestCaseError::fail(format!("step {i} ({}, {what}): {e}", s.what))
        };
        let emitted = run_one(fx, s.egress, &s.frame).map_err(|e| fail(e, "the frame"))?;
        // What a rewrite emitted is answered; the answer comes back
        // through egress (a local backend) or ingress (a remote one).
        if let Some(reply) = emitted.as_deref().and_then(reply_to) {
            for egress in [true, false] {
                run_one(fx, egress, &reply).map_err(|e| fail(e, "its reply"))?;
            }
        }
    }
    Ok(())
}

#[test]
fn fuzz_tc_programs() {
    if skip() {
        return;
    }
    let fx = RefCell::new(fixture());
    let mut config = mutate::config(SHORT);
    // Beside the unit tests' (this file is no crate root proptest finds).
    config.failure_persistence = Some(Box::new(FileFailurePersistence::Direct(
        "proptest-regressions/tc_frames/fuzz.txt",
    )));
    let mut runner = TestRunner::new(config);
    let result = runner.run(&prop::collection::vec(step(), 1..6), |steps| {
        run_case(&mut fx.borrow_mut(), &steps)
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let checked = REWRITES_CHECKED.with(|n| n.get());
    eprintln!("{checked} rewritten frames had their checksums checked");
    assert!(checked > 0, "no case reached a rewrite");
}

/// The seeds in `fuzz/corpus/frames/` parse and have valid checksums:
/// they are what the mutations start from.
#[test]
fn fuzz_frame_seeds_are_valid() {
    for seed in mutate::corpus("frames") {
        assert_eq!(checksums(&seed.bytes), Csum::Valid, "{}", seed.name);
        let mut fixed = seed.bytes.clone();
        fix_checksums(&mut fixed);
        assert_eq!(fixed, seed.bytes, "{}: fix_checksums changed it", seed.name);
    }
}

/// Writes the seeds of `fuzz/corpus/frames/` from the builders above:
/// `cargo test --release -p lb-agent --test tc_frames -- --ignored write_frame_seeds`.
#[test]
#[ignore = "regenerates the checked-in seeds"]
fn write_frame_seeds() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/frames");
    std::fs::create_dir_all(&dir).unwrap();
    let syn4 = Frame::tcp(CLIENT4, 40000, NODE4, 30080, TCP_SYN);
    let syn6 = Frame::tcp(CLIENT6, 40000, NODE6, 30080, TCP_SYN);
    let reply4 = Frame::tcp("10.244.1.10", 8080, CLIENT4, 40000, TCP_SYN | TCP_ACK);
    let reply6 = Frame::tcp("fd00:244:1::10", 8080, CLIENT6, 40000, TCP_SYN | TCP_ACK);
    let mut big = Frame::tcp(CLIENT4, 40000, NODE4, 30090, TCP_ACK);
    big.extra = 1400;
    big.frag = 0x4000;
    let (first4, later4) = fragments(CLIENT4, 40000, NODE4, 30053, 0x1234);
    let (first6, later6) = fragments(CLIENT6, 40000, NODE6, 30053, 0x1234);
    let seeds: Vec<(&str, Vec<u8>)> = vec![
        ("syn4.bin", syn4.bytes()),
        ("syn6.bin", syn6.bytes()),
        (
            "ack4.bin",
            Frame::tcp(CLIENT4, 40000, NODE4, 30080, TCP_ACK).bytes(),
        ),
        (
            "fin-ack4.bin",
            Frame::tcp(CLIENT4, 40000, NODE4, 30080, TCP_FIN | TCP_ACK).bytes(),
        ),
        (
            "rst6.bin",
            Frame::tcp(CLIENT6, 40000, NODE6, 30080, TCP_RST).bytes(),
        ),
        (
            "syn-no-endpoints4.bin",
            Frame::tcp(CLIENT4, 40000, NODE4, 30099, TCP_SYN).bytes(),
        ),
        ("udp4.bin", Frame::udp(CLIENT4, 40000, NODE4, 30053).bytes()),
        ("udp6.bin", Frame::udp(CLIENT6, 40000, NODE6, 30053).bytes()),
        (
            "udp-no-endpoints6.bin",
            Frame::udp(CLIENT6, 40000, NODE6, 30099).bytes(),
        ),
        ("syn-ack-reply4.bin", reply4.bytes()),
        ("syn-ack-reply6.bin", reply6.bytes()),
        ("df-past-mtu4.bin", big.bytes()),
        ("frag-first4.bin", first4),
        ("frag-later4.bin", later4),
        ("frag-first6.bin", first6),
        ("frag-later6.bin", later6),
        (
            "ext-hop-dst-routing6.bin",
            with_extensions(
                &syn6,
                &[
                    0, 0, 1, 4, 0, 0, 0, 0, 60, 0, 1, 4, 0, 0, 0, 0, 43, 0, 4, 0, 0, 0, 0, 0,
                ],
            ),
        ),
        (
            "icmp-frag-needed4.bin",
            icmp4_error(
                CLIENT4,
                NODE4,
                3,
                4,
                &Frame::tcp(NODE4, 30080, CLIENT4, 40000, TCP_ACK).bytes(),
            ),
        ),
        (
            "icmp-port-unreach4.bin",
            icmp4_error("10.244.1.1", CLIENT4, 3, 3, &syn4.bytes()),
        ),
        (
            "icmp6-packet-too-big.bin",
            icmp6_error(
                CLIENT6,
                NODE6,
                2,
                &Frame::tcp(NODE6, 30080, CLIENT6, 40000, TCP_ACK).bytes(),
            ),
        ),
    ];
    for (name, bytes) in seeds {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}
