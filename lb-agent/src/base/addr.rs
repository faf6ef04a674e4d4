//! Addresses as the maps hold them: 16 bytes, IPv4 as IPv4-mapped IPv6
//! (`::ffff:a.b.c.d`), so one key type serves both families.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use lb_common::is_ipv4_mapped;

/// An address in the maps' 16-byte form.
pub fn addr_bytes(addr: IpAddr) -> [u8; 16] {
    match addr {
        IpAddr::V4(a) => lb_common::ipv4_mapped(a.octets()),
        // Already mapped (as a dual-stack socket reports it) or native v6.
        IpAddr::V6(a) => a.octets(),
    }
}

/// The address a map's 16 bytes stand for (IPv4 when IPv4-mapped).
pub fn ip_from_bytes(b: &[u8; 16]) -> IpAddr {
    if is_ipv4_mapped(b) {
        IpAddr::V4(Ipv4Addr::new(b[12], b[13], b[14], b[15]))
    } else {
        IpAddr::V6(Ipv6Addr::from(*b))
    }
}
