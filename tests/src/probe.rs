//! The test side of `lb-probe client`: run it, parse its JSON lines, count
//! where the attempts went.
use std::{
    collections::BTreeMap,
    fmt,
    net::{IpAddr, SocketAddr},
    process::{Command, Stdio},
};

use anyhow::{bail, Context as _, Result};
use serde::{Deserialize, Serialize};

use crate::{cgroup::CgroupGuard, cmd, netns::Topology};

/// One attempt of `lb-probe client`, one JSON line.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Attempt {
    pub ok: bool,
    /// The backend's name (the reply up to a `:`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// The local port the backend was reached on, when it answers `NAME:PORT`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend_port: Option<u16>,
    /// The client address the backend saw, when it runs `serve --with-peer`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seen_from: Option<String>,
    /// The whole reply, trimmed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reply: Option<String>,
    /// Who the socket API says the other side is: `getpeername` for TCP and
    /// connected UDP, the `recvfrom` source for unconnected UDP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<String>,
    /// Connected UDP: the `recvfrom` source of the reply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// Errno name (`ECONNREFUSED`, `ENETUNREACH`, `ETIMEDOUT`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The step that failed: socket, connect, getpeername, send, recv, read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage: Option<String>,
    /// What more is known of the error: for connected UDP, the ICMP error
    /// behind it (who sent it, for a datagram to where).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    #[serde(default)]
    pub elapsed_ms: f64,
    /// With `--timestamps`: when the attempt started and ended,
    /// [`monotonic_ns`] (one clock for every process of the machine).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_ns: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_ns: Option<u64>,
}

/// `CLOCK_MONOTONIC` in nanoseconds: comparable between the test and the
/// `lb-probe` processes it starts, unlike an `Instant`.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to fill; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

impl Attempt {
    /// `peer` parsed, with an IPv4-mapped IPv6 address turned into IPv4.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.peer.as_deref()?.parse().ok().map(unmap)
    }

    /// A reply that did not come within the interval (`recv` `ETIMEDOUT`):
    /// a lost or late datagram, not an error of the socket.
    pub fn is_lost_reply(&self) -> bool {
        !self.ok
            && self.stage.as_deref() == Some("recv")
            && self.error.as_deref() == Some("ETIMEDOUT")
    }

    /// `source` parsed and unmapped like [`peer_addr`](Self::peer_addr).
    pub fn source_addr(&self) -> Option<SocketAddr> {
        self.source.as_deref()?.parse().ok().map(unmap)
    }
}

/// `[::ffff:a.b.c.d]:p` -> `a.b.c.d:p`; anything else unchanged.
pub fn unmap(sa: SocketAddr) -> SocketAddr {
    match sa {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), v6.port()),
            None => sa,
        },
        v4 => v4,
    }
}

/// `--proto` of `lb-probe client`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proto {
    Tcp,
    Udp,
    UdpConnected,
    /// A one-to-one SCTP socket (the kernel must have SCTP).
    Sctp,
}

impl Proto {
    pub fn as_str(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
            Proto::UdpConnected => "udp-connected",
            Proto::Sctp => "sctp",
        }
    }

    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "tcp" => Proto::Tcp,
            "udp" => Proto::Udp,
            "udp-connected" => Proto::UdpConnected,
            "sctp" => Proto::Sctp,
            _ => bail!("unknown protocol {s:?} (tcp, udp, udp-connected, sctp)"),
        })
    }
}

/// `--family` of `lb-probe client`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
    /// An AF_INET6 socket addressing `::ffff:a.b.c.d`.
    V4Mapped,
}

impl Family {
    pub fn as_str(self) -> &'static str {
        match self {
            Family::V4 => "v4",
            Family::V6 => "v6",
            Family::V4Mapped => "v4mapped",
        }
    }
}

/// A run of `lb-probe client`: enters `cgroup`, then `netns`, then makes
/// `count` independent attempts at `target`.
#[derive(Debug, Clone)]
pub struct Client {
    pub cgroup: Option<std::path::PathBuf>,
    pub netns: String,
    pub proto: Proto,
    pub family: Option<Family>,
    pub timeout_ms: u64,
}

impl Client {
    /// A client in the topology's `client` host, inside `cgroup`.
    pub fn new(topo: &Topology, cgroup: &CgroupGuard) -> Self {
        Self {
            cgroup: Some(cgroup.path().to_path_buf()),
            netns: topo.client_netns().to_string(),
            proto: Proto::Tcp,
            family: None,
            timeout_ms: 2000,
        }
    }

    pub fn proto(mut self, proto: Proto) -> Self {
        self.proto = proto;
        self
    }

    pub fn family(mut self, family: Family) -> Self {
        self.family = Some(family);
        self
    }

    pub fn timeout_ms(mut self, ms: u64) -> Self {
        self.timeout_ms = ms;
        self
    }

    pub fn command(&self, target: &str, count: usize) -> Result<Command> {
        let mut c = Command::new(crate::probe_bin()?);
        c.arg("client");
        if let Some(cg) = &self.cgroup {
            c.arg("--cgroup").arg(cg);
        }
        c.args(["--netns", &self.netns, "--target", target])
            .args(["--proto", self.proto.as_str()])
            .args(["--count", &count.to_string()])
            .args(["--timeout-ms", &self.timeout_ms.to_string()]);
        if let Some(f) = self.family {
            c.args(["--family", f.as_str()]);
        }
        Ok(c)
    }

    /// Runs the client; one [`Attempt`] per attempt.
    pub fn run(&self, target: &str, count: usize) -> Result<Vec<Attempt>> {
        let mut c = self.command(target, count)?;
        let line = cmd::display(&c);
        let out = cmd::die_with_parent(&mut c, libc::SIGKILL)
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("cannot run `{line}`"))?;
        if !out.status.success() {
            bail!(
                "`{line}` failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let attempts = parse_attempts(&String::from_utf8_lossy(&out.stdout))
            .with_context(|| format!("output of `{line}`"))?;
        if attempts.len() != count {
            bail!("`{line}` printed {} attempts, not {count}", attempts.len());
        }
        Ok(attempts)
    }
}

/// Parses `lb-probe client` output, one JSON object a line.
pub fn parse_attempts(out: &str) -> Result<Vec<Attempt>> {
    out.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).with_context(|| format!("bad attempt line {l:?}")))
        .collect()
}

/// `count` attempts with `proto` ("tcp", "udp", "udp-connected") from the
/// topology's client host in `cgroup`, at `target` (`IP:PORT`, `[IPv6]:PORT`).
/// Panics if the probe itself cannot run (a failed attempt is not a panic).
pub fn client(
    topo: &Topology,
    cgroup: &CgroupGuard,
    proto: &str,
    target: &str,
    count: usize,
) -> Vec<Attempt> {
    Client::new(topo, cgroup)
        .proto(Proto::parse(proto).expect("protocol"))
        .run(target, count)
        .unwrap_or_else(|e| panic!("{e:#}"))
}

/// Where a batch of attempts went.
#[derive(Debug, Clone, Default)]
pub struct Spread {
    pub total: usize,
    /// Successful attempts per backend name.
    pub backends: BTreeMap<String, usize>,
    /// Failed attempts per error name.
    pub errors: BTreeMap<String, usize>,
    /// Successful attempts per `peer`, as printed.
    pub peers: BTreeMap<String, usize>,
}

impl Spread {
    pub fn of(attempts: &[Attempt]) -> Self {
        let mut s = Spread {
            total: attempts.len(),
            ..Default::default()
        };
        for a in attempts {
            if a.ok {
                *s.backends
                    .entry(a.backend.clone().unwrap_or_else(|| "?".into()))
                    .or_default() += 1;
                *s.peers
                    .entry(a.peer.clone().unwrap_or_else(|| "?".into()))
                    .or_default() += 1;
            } else {
                *s.errors
                    .entry(a.error.clone().unwrap_or_else(|| "?".into()))
                    .or_default() += 1;
            }
        }
        s
    }

    pub fn ok(&self) -> usize {
        self.backends.values().sum()
    }

    pub fn count(&self, backend: &str) -> usize {
        self.backends.get(backend).copied().unwrap_or(0)
    }

    /// The share of all attempts that reached `backend`, 0..=1.
    pub fn share(&self, backend: &str) -> f64 {
        if self.total == 0 {
            0.0
        } else {
            self.count(backend) as f64 / self.total as f64
        }
    }
}

impl fmt::Display for Spread {
    /// A table: backend, count, percentage and a bar.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const WIDTH: f64 = 40.0;
        let rows = self
            .backends
            .iter()
            .map(|(k, v)| (k.as_str(), *v))
            .chain(self.errors.iter().map(|(k, v)| (k.as_str(), *v)));
        writeln!(f, "  {:<14} {:>6} {:>7}", "backend", "count", "share")?;
        for (name, n) in rows {
            let pct = if self.total == 0 {
                0.0
            } else {
                n as f64 * 100.0 / self.total as f64
            };
            let bar = "#".repeat((pct / 100.0 * WIDTH).round() as usize);
            writeln!(f, "  {name:<14} {n:>6} {pct:>6.1}% {bar}")?;
        }
        write!(f, "  {:<14} {:>6}", "total", self.total)
    }
}
