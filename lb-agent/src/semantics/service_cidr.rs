//! The guarded Service CIDRs: the union of `--service-cluster-ip-range`
//! and the `networking.k8s.io/v1` `ServiceCIDR` objects' `spec.cidrs`. An
//! address in them that no Service holds is an unallocated ClusterIP,
//! which kube-proxy's nftables mode drops (its `cluster-ips-check`
//! chain); the programs refuse it on the socket path and drop it on the
//! tc path. The programs compare with a fixed array of
//! `lb_common::SERVICE_RANGES` prefixes, so the union is made as small as
//! it can be without changing what it covers (contained prefixes dropped,
//! sibling halves joined); what still does not fit is left unguarded and
//! reported, naming its objects.
use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv6Addr},
};

use crate::semantics::model::Cidr;

/// The flag, as the sources of a guarded prefix name it.
pub const FLAG: &str = "--service-cluster-ip-range";

/// How many prefixes the programs compare with (`TcConfig::service_ranges`).
pub const CAPACITY: usize = lb_common::SERVICE_RANGES;

/// One Service CIDR: an address prefix with its host bits cleared.
/// Rejected: a bare address (no `/`), a prefix length past the family's,
/// an IPv4-mapped IPv6 address, and an IPv6 prefix that covers the
/// IPv4-mapped addresses (`::ffff:0:0/96`, where the programs keep IPv4):
/// it would guard every IPv4 address.
pub fn parse_range(text: &str) -> Result<Cidr, String> {
    let t = text.trim();
    if !t.contains('/') {
        return Err(format!("{t:?} is not a CIDR (address/prefix length)"));
    }
    let cidr: Cidr = t.parse()?;
    if let IpAddr::V6(v6) = cidr.addr {
        if v6.to_ipv4_mapped().is_some() {
            return Err(format!(
                "{t:?}: an IPv4-mapped IPv6 prefix; write the IPv4 CIDR"
            ));
        }
        let mapped = Cidr {
            addr: IpAddr::V6(Ipv6Addr::new(0, 0, 0, 0, 0, 0xffff, 0, 0)),
            prefix: 96,
        };
        if cidr.prefix <= 96 && cidr.contains_cidr(&mapped) {
            return Err(format!(
                "{t:?} covers the IPv4-mapped addresses (::ffff:0:0/96), so every IPv4 address"
            ));
        }
    }
    Ok(cidr.network())
}

/// The guarded prefixes and what could not be guarded.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Guarded {
    /// At most [`CAPACITY`], each with the sources that asked for what it
    /// covers ([`FLAG`], `ServiceCIDR <name>`), in priority order: the
    /// flag's first, then the objects by name.
    pub ranges: Vec<(Cidr, Vec<String>)>,
    /// Problems, each naming its source: a bad `spec.cidrs` entry (left
    /// out, the rest kept), or a prefix that did not fit (not guarded).
    pub problems: Vec<String>,
}

impl Guarded {
    pub fn cidrs(&self) -> Vec<Cidr> {
        self.ranges.iter().map(|(c, _)| *c).collect()
    }
}

/// The union of the flag's prefixes (already valid: parsed by
/// [`parse_range`]) and the objects' (`name` → `spec.cidrs`), made as
/// small as it can be without changing what it covers, and cut to
/// [`CAPACITY`]. A bad entry of an object is reported and skipped; the
/// object's other entries and the other objects still count.
pub fn guarded(flag: &[Cidr], objects: &BTreeMap<String, Vec<String>>) -> Guarded {
    let mut problems = Vec::new();
    // (prefix, source), in priority order.
    let mut wanted: Vec<(Cidr, String)> = flag.iter().map(|c| (c.network(), FLAG.into())).collect();
    for (name, cidrs) in objects {
        for (i, text) in cidrs.iter().enumerate() {
            match parse_range(text) {
                Ok(c) => wanted.push((c, format!("ServiceCIDR {name}"))),
                Err(e) => problems.push(format!(
                    "ServiceCIDR {name}: spec.cidrs[{i}]: {e}; not guarded"
                )),
            }
        }
    }
    // Each prefix with its sources and its priority (the first index that
    // wanted it), then joined until nothing changes.
    let mut merged: Vec<(Cidr, Vec<String>, usize)> = Vec::new();
    for (i, (c, source)) in wanted.into_iter().enumerate() {
        add(&mut merged, c, vec![source], i);
    }
    loop {
        let Some((a, b)) = siblings(&merged) else {
            break;
        };
        let (_, sb, pb) = merged.remove(b);
        let (ca, sa, pa) = merged.remove(a);
        let parent = Cidr {
            addr: ca.addr,
            prefix: ca.prefix - 1,
        }
        .network();
        add(&mut merged, parent, [sa, sb].concat(), pa.min(pb));
    }
    merged.sort_by_key(|(c, _, p)| (*p, *c));
    let unfit = merged.split_off(merged.len().min(CAPACITY));
    for (c, sources, _) in unfit {
        problems.push(format!(
            "{c} ({}) not guarded: more than {CAPACITY} Service CIDRs after joining those that \
             touch; traffic to its unallocated addresses is not refused",
            sources.join(", ")
        ));
    }
    Guarded {
        // Sources in priority order too: the flag ("--…") sorts before
        // "ServiceCIDR <name>", and those by name.
        ranges: merged
            .into_iter()
            .map(|(c, mut s, _)| {
                s.sort();
                (c, s)
            })
            .collect(),
        problems,
    }
}

/// Adds `c` to `set`: into a prefix that contains it, or taking in those
/// it contains; sources kept without repeats.
fn add(set: &mut Vec<(Cidr, Vec<String>, usize)>, c: Cidr, sources: Vec<String>, priority: usize) {
    let mut sources = sources;
    let mut priority = priority;
    if let Some(e) = set.iter_mut().find(|(e, _, _)| e.contains_cidr(&c)) {
        for s in sources {
            if !e.1.contains(&s) {
                e.1.push(s);
            }
        }
        e.2 = e.2.min(priority);
        return;
    }
    set.retain(|(e, s, p)| {
        if !c.contains_cidr(e) {
            return true;
        }
        for s in s {
            if !sources.contains(s) {
                sources.push(s.clone());
            }
        }
        priority = priority.min(*p);
        false
    });
    set.push((c, sources, priority));
}

/// Two prefixes that are the halves of one (indices, the smaller first).
fn siblings(set: &[(Cidr, Vec<String>, usize)]) -> Option<(usize, usize)> {
    for (i, (a, _, _)) in set.iter().enumerate() {
        for (j, (b, _, _)) in set.iter().enumerate().skip(i + 1) {
            if a.prefix == b.prefix
                && a.prefix > 0
                && a.addr.is_ipv4() == b.addr.is_ipv4()
                && a != b
            {
                let parent = Cidr {
                    addr: a.addr,
                    prefix: a.prefix - 1,
                };
                if parent.contains_cidr(b) {
                    return Some((i, j));
                }
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(s: &str) -> Cidr {
        s.parse().unwrap()
    }

    fn objects(list: &[(&str, &[&str])]) -> BTreeMap<String, Vec<String>> {
        list.iter()
            .map(|(n, cs)| (n.to_string(), cs.iter().map(|s| s.to_string()).collect()))
            .collect()
    }

    #[test]
    fn ranges_are_validated() {
        let cases: &[(&str, Result<&str, &str>)] = &[
            ("10.96.0.0/16", Ok("10.96.0.0/16")),
            (" 10.96.0.0/12 ", Ok("10.96.0.0/12")),
            ("10.96.3.4/16", Ok("10.96.0.0/16")),
            ("fd00:10:96::/112", Ok("fd00:10:96::/112")),
            ("10.96.0.10", Err("is not a CIDR")),
            ("10.96.0.0/33", Err("prefix length must be 0..=32")),
            ("bogus/8", Err("is not an address prefix")),
            ("", Err("is not a CIDR")),
            ("::ffff:10.96.0.0/112", Err("IPv4-mapped IPv6 prefix")),
            ("::/0", Err("covers the IPv4-mapped addresses")),
            ("::/64", Err("covers the IPv4-mapped addresses")),
            ("fd00::/8", Ok("fd00::/8")),
        ];
        for (text, want) in cases {
            let got = parse_range(text);
            match (want, &got) {
                (Ok(w), Ok(g)) => assert_eq!(g.to_string(), *w, "{text:?}"),
                (Err(w), Err(g)) => assert!(g.contains(w), "{text:?}: {g}"),
                _ => panic!("{text:?}: {got:?}, wanted {want:?}"),
            }
        }
    }

    #[test]
    fn the_union_of_flag_and_objects_made_small() {
        struct Case {
            name: &'static str,
            flag: &'static [&'static str],
            objects: &'static [(&'static str, &'static [&'static str])],
            want: &'static [(&'static str, &'static [&'static str])],
            problems: &'static [&'static str],
        }
        let cases = [
            Case {
                name: "nothing",
                flag: &[],
                objects: &[],
                want: &[],
                problems: &[],
            },
            Case {
                name: "the flag alone, both families",
                flag: &["10.96.0.0/16", "fd00:10:96::/112"],
                objects: &[],
                want: &[("10.96.0.0/16", &[FLAG]), ("fd00:10:96::/112", &[FLAG])],
                problems: &[],
            },
            Case {
                name: "an object repeating the flag shares its prefix",
                flag: &["10.96.0.0/16"],
                objects: &[("kubernetes", &["10.96.0.0/16", "fd00::/108"])],
                want: &[
                    ("10.96.0.0/16", &[FLAG, "ServiceCIDR kubernetes"]),
                    ("fd00::/108", &["ServiceCIDR kubernetes"]),
                ],
                problems: &[],
            },
            Case {
                name: "contained prefixes go into the larger",
                flag: &["10.96.5.0/24"],
                objects: &[("a", &["10.96.0.0/16"])],
                want: &[("10.96.0.0/16", &[FLAG, "ServiceCIDR a"])],
                problems: &[],
            },
            Case {
                name: "sibling halves are joined",
                flag: &[],
                objects: &[("a", &["10.96.0.0/16"]), ("b", &["10.97.0.0/16"])],
                want: &[("10.96.0.0/15", &["ServiceCIDR a", "ServiceCIDR b"])],
                problems: &[],
            },
            Case {
                name: "a bad entry is skipped, the rest kept",
                flag: &[],
                objects: &[
                    ("a", &["bogus", "10.100.0.0/16"]),
                    ("b", &["10.200.0.0/16"]),
                ],
                want: &[
                    ("10.100.0.0/16", &["ServiceCIDR a"]),
                    ("10.200.0.0/16", &["ServiceCIDR b"]),
                ],
                problems: &["ServiceCIDR a: spec.cidrs[0]: \"bogus\" is not a CIDR"],
            },
            Case {
                name: "more than fit: the flag's and the first objects' kept, the rest named",
                flag: &["10.0.0.0/16"],
                objects: &[
                    ("a", &["10.2.0.0/16", "10.4.0.0/16"]),
                    ("b", &["10.6.0.0/16", "10.8.0.0/16"]),
                    ("c", &["10.10.0.0/16", "10.12.0.0/16"]),
                    ("d", &["10.14.0.0/16", "10.16.0.0/16"]),
                ],
                want: &[
                    ("10.0.0.0/16", &[FLAG]),
                    ("10.2.0.0/16", &["ServiceCIDR a"]),
                    ("10.4.0.0/16", &["ServiceCIDR a"]),
                    ("10.6.0.0/16", &["ServiceCIDR b"]),
                    ("10.8.0.0/16", &["ServiceCIDR b"]),
                    ("10.10.0.0/16", &["ServiceCIDR c"]),
                    ("10.12.0.0/16", &["ServiceCIDR c"]),
                    ("10.14.0.0/16", &["ServiceCIDR d"]),
                ],
                problems: &["10.16.0.0/16 (ServiceCIDR d) not guarded"],
            },
        ];
        for case in cases {
            let flag: Vec<Cidr> = case.flag.iter().map(|s| parse_range(s).unwrap()).collect();
            let got = guarded(&flag, &objects(case.objects));
            let want: Vec<(Cidr, Vec<String>)> = case
                .want
                .iter()
                .map(|(p, s)| (c(p), s.iter().map(|s| s.to_string()).collect()))
                .collect();
            assert_eq!(got.ranges, want, "{}", case.name);
            assert_eq!(
                got.problems.len(),
                case.problems.len(),
                "{}: {:?}",
                case.name,
                got.problems
            );
            for (g, w) in got.problems.iter().zip(case.problems) {
                assert!(g.contains(w), "{}: {g:?} lacks {w:?}", case.name);
            }
        }
    }
}
