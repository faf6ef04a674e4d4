//! The route epoch (`LB_ROUTE_EPOCH`), which a flow's cached next hop
//! (`lb_common::NextHop`) is only good within: moved once when the agent
//! starts (whatever changed while none ran) and after every batch of
//! rtnetlink notifications of this network namespace's links, addresses,
//! neighbours, routes, rules and next-hop objects, so that the flows' next
//! packets look their next hop up again.
use std::{io, path::Path, time::Duration};

use anyhow::Context;
use aya::maps::{Array, MapData};
use lb_common::map_names;
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};

use super::tc::open;

/// What a next hop depends on. `RTNLGRP_NEXTHOP` (5.3) is optional.
const GROUPS: [(u32, &str); 9] = [
    (libc::RTNLGRP_LINK, "links"),
    (libc::RTNLGRP_NEIGH, "neighbours"),
    (libc::RTNLGRP_IPV4_IFADDR, "IPv4 addresses"),
    (libc::RTNLGRP_IPV6_IFADDR, "IPv6 addresses"),
    (libc::RTNLGRP_IPV4_ROUTE, "IPv4 routes"),
    (libc::RTNLGRP_IPV6_ROUTE, "IPv6 routes"),
    (libc::RTNLGRP_IPV4_RULE, "IPv4 rules"),
    (libc::RTNLGRP_IPV6_RULE, "IPv6 rules"),
    (libc::RTNLGRP_NEXTHOP, "next-hop objects"),
];

/// The map, written by this process alone (one writer, so a move is never
/// undone by another's stale write).
pub struct RouteEpoch {
    map: Array<MapData, u32>,
}

impl RouteEpoch {
    pub fn open(pin_dir: &Path) -> anyhow::Result<Self> {
        Ok(Self {
            map: Array::try_from(open(pin_dir, map_names::ROUTE_EPOCH)?)?,
        })
    }

    fn get(&self) -> anyhow::Result<u32> {
        self.map
            .get(&0, 0)
            .with_context(|| format!("reading {}", map_names::ROUTE_EPOCH))
    }

    /// Moves the epoch: every cached next hop is looked up again.
    pub fn advance(&mut self) -> anyhow::Result<u32> {
        let next = self.get()?.wrapping_add(1);
        self.map
            .set(0, next, 0)
            .with_context(|| format!("writing {}", map_names::ROUTE_EPOCH))?;
        Ok(next)
    }

    /// Subscribes to the notifications, moves the epoch, and moves it
    /// again after each batch of them on a thread of its own, for the
    /// rest of the process. Subscribed before the first move, so that no
    /// change falls between the two.
    pub fn watch(mut self) -> anyhow::Result<()> {
        let mut socket = Socket::new(NETLINK_ROUTE).context("opening an rtnetlink socket")?;
        socket
            .bind(&SocketAddr::new(0, 0))
            .context("binding the rtnetlink socket")?;
        for (group, what) in GROUPS {
            if let Err(e) = socket.add_membership(group) {
                if group == libc::RTNLGRP_NEXTHOP {
                    tracing::info!(
                        "no notifications of {what} ({e}): next-hop objects not followed"
                    );
                } else {
                    return Err(e).with_context(|| format!("subscribing to changes of {what}"));
                }
            }
        }
        self.advance()?;
        std::thread::Builder::new()
            .name("route-epoch".into())
            .spawn(move || self.follow(socket))
            .context("starting the route epoch thread")?;
        Ok(())
    }

    fn follow(mut self, socket: Socket) {
        let mut buf: Vec<u8> = Vec::with_capacity(64 << 10);
        loop {
            buf.clear();
            match socket.recv(&mut buf, 0) {
                // ENOBUFS: notifications were lost, so something changed.
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::error!("reading rtnetlink notifications: {e}; next hops are looked up again every second");
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
            // One move for what is queued now (a bounded drain: under a
            // flood of changes the epoch still moves).
            for _ in 0..256 {
                buf.clear();
                match socket.recv(&mut buf, libc::MSG_DONTWAIT) {
                    Ok(_) => {}
                    Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {}
                    Err(_) => break,
                }
            }
            if let Err(e) = self.advance() {
                tracing::error!("{e:#}");
            }
        }
    }
}
