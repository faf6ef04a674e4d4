//! Destroying connected UDP sockets by their peer address.
//!
//! The socket-layer load balancer rewrites `connect()` to a Service VIP into a
//! backend address once, at connect time. A *connected* UDP socket (the usual
//! DNS client) then keeps sending to that backend forever, even after the pod
//! stopped serving the Service — the long-standing kube-proxy/Cilium bug. The
//! cure is to destroy such sockets with `SOCK_DESTROY` (sock_diag,
//! `CONFIG_INET_DIAG_DESTROY`): the kernel aborts the socket, its pending or
//! next `recv()` fails with `ECONNABORTED`, the application reconnects, and
//! the connect hook picks a live backend. Which sockets are stale is decided
//! by the caller (`semantics::stale_udp`); this module finds every connected
//! UDP socket whose peer is one of the given addresses, in every network
//! namespace of the cgroup's processes (the host's, too, for host-network
//! pods in it), without any map lookup.
//!
//! Sockets live in the network namespaces of the pods, so for every process of
//! a cgroup subtree we open `/proc/PID/ns/net`, dedupe by its inode, and on a
//! dedicated short-lived thread `setns(2)` into it just long enough to open a
//! `NETLINK_SOCK_DIAG` socket there. A netlink socket stays bound to the
//! namespace it was created in, so the dump and destroy requests are then sent
//! from the calling thread (which never changes namespace), and the caller's
//! predicate needs no `Send` bound.
use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    fs::File,
    io,
    net::{IpAddr, SocketAddr, SocketAddrV4, SocketAddrV6},
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    time::Duration,
};

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST,
};
use netlink_packet_sock_diag::{
    constants::{AF_INET, AF_INET6, IPPROTO_UDP},
    inet::{ExtensionFlags, InetRequest, InetResponseHeader, SocketId, StateFlags},
    SockDiagDestroy, SockDiagMessage,
};
use netlink_sys::{protocols::NETLINK_SOCK_DIAG, Socket};

/// `TCP_ESTABLISHED`: the state a UDP socket reports once `connect()`ed.
const TCP_ESTABLISHED: u8 = 1;

/// With more distinct destination ports than this per family, one unfiltered
/// dump per family is cheaper than one port-filtered dump per port (each dump
/// walks the whole UDP hash table).
const MAX_PORT_FILTERED_DUMPS: usize = 8;

/// Bound on any single netlink receive, so a misbehaving kernel cannot hang
/// the agent.
const NETLINK_RECV_TIMEOUT: Duration = Duration::from_secs(5);

/// Receive buffer; netlink dump datagrams are at most 32 KiB.
const RECV_BUF_LEN: usize = 64 * 1024;

/// What to do with one connected UDP socket found in some network namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UdpSocket {
    /// The socket cookie exactly as the kernel reports it (`idiag_cookie`),
    /// the same value `bpf_get_socket_cookie()` returns for the socket.
    pub cookie: u64,
    /// Local address (IPv6 for `AF_INET6` sockets, IPv4-mapped if the socket
    /// talks IPv4 through a dual-stack socket).
    pub src: SocketAddr,
    /// Peer address as the kernel reports it (`[::ffff:a.b.c.d]:port` for an
    /// `AF_INET6` socket connected to an IPv4 peer).
    pub dst: SocketAddr,
}

/// The outcome of one [`destroy_udp_sockets`] run.
#[derive(Debug, Default)]
pub struct DestroyReport {
    /// Distinct network namespaces entered and scanned.
    pub namespaces: usize,
    /// Connected UDP sockets whose destination is one of the targets (each
    /// was offered to the predicate).
    pub examined: usize,
    /// Sockets the kernel acknowledged destroying.
    pub destroyed: usize,
    /// Everything that went wrong; the run carries on past each.
    pub errors: Vec<String>,
}

/// For every network namespace used by a process in `cgroup` (its
/// `cgroup.procs` and those of all descendant cgroups; namespaces deduped by
/// the inode of `/proc/PID/ns/net`), dump the connected UDP sockets (IPv4 and
/// IPv6) whose destination is one of `targets` (an IPv4 target also matches
/// the IPv4-mapped destination of an `AF_INET6` socket), call
/// `should_destroy(&sock)`, and destroy those for which it returns true.
///
/// Processes that exit meanwhile are skipped silently; a namespace that cannot
/// be entered or scanned, and a socket that cannot be destroyed, add a line to
/// [`DestroyReport::errors`] and the run carries on.
pub fn destroy_udp_sockets(
    cgroup: &Path,
    targets: &BTreeSet<SocketAddr>,
    mut should_destroy: impl FnMut(&UdpSocket) -> bool,
) -> DestroyReport {
    let mut report = DestroyReport::default();
    let targets = Targets::new(targets);
    if targets.is_empty() {
        return report;
    }
    let pids = cgroup_pids(cgroup, &mut report.errors);
    for ns in open_namespaces(&pids, &mut report.errors) {
        let dumped = sock_diag_socket_in(ns.file)
            .map_err(|e| format!("enter: {e}"))
            .and_then(|sock| {
                let mut diag = SockDiag { sock, seq: 0 };
                let found = diag
                    .connected_udp_to(&targets)
                    .map_err(|e| format!("dump: {e}"))?;
                Ok((diag, found))
            });
        let (mut diag, found) = match dumped {
            Ok(dumped) => dumped,
            Err(e) => {
                report
                    .errors
                    .push(format!("netns {} (pid {}): {e}", ns.inode, ns.pid));
                continue;
            }
        };
        report.namespaces += 1;
        for (family, id) in found.into_values() {
            let sock = UdpSocket {
                cookie: cookie_u64(id.cookie),
                src: socket_addr(id.source_address, id.source_port),
                dst: socket_addr(id.destination_address, id.destination_port),
            };
            report.examined += 1;
            if !should_destroy(&sock) {
                continue;
            }
            match diag.destroy(family, id) {
                Ok(()) => {
                    tracing::debug!(
                        netns = ns.inode,
                        cookie = sock.cookie,
                        src = %sock.src,
                        dst = %sock.dst,
                        "destroyed connected UDP socket"
                    );
                    report.destroyed += 1;
                }
                // Closed or disconnected by its owner since the dump: gone
                // already, which is all we wanted.
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => report.errors.push(format!(
                    "netns {} (pid {}): destroy {} -> {} (cookie {}): {e}",
                    ns.inode, ns.pid, sock.src, sock.dst, sock.cookie
                )),
            }
        }
    }
    report
}

/// The destinations to look for, canonicalized so that `a.b.c.d` and
/// `::ffff:a.b.c.d` compare equal.
struct Targets(BTreeSet<SocketAddr>);

impl Targets {
    fn new(targets: &BTreeSet<SocketAddr>) -> Self {
        Self(
            targets
                .iter()
                .map(|t| canonical(t.ip(), t.port()))
                .collect(),
        )
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn contains(&self, ip: IpAddr, port: u16) -> bool {
        self.0.contains(&canonical(ip, port))
    }

    /// The port filters of the dumps to run for `family`: `0` is "any port".
    /// An `AF_INET` socket can only have an IPv4 peer; an `AF_INET6` one can
    /// have either (IPv4-mapped).
    fn dump_ports(&self, family: u8) -> Vec<u16> {
        let ports: BTreeSet<u16> = self
            .0
            .iter()
            .filter(|t| family == AF_INET6 || t.is_ipv4())
            .map(|t| t.port())
            .collect();
        if ports.len() > MAX_PORT_FILTERED_DUMPS || ports.contains(&0) {
            vec![0]
        } else {
            ports.into_iter().collect()
        }
    }
}

fn canonical(ip: IpAddr, port: u16) -> SocketAddr {
    SocketAddr::new(ip.to_canonical(), port)
}

fn socket_addr(ip: IpAddr, port: u16) -> SocketAddr {
    match ip {
        IpAddr::V4(ip) => SocketAddr::V4(SocketAddrV4::new(ip, port)),
        IpAddr::V6(ip) => SocketAddr::V6(SocketAddrV6::new(ip, port, 0, 0)),
    }
}

/// `idiag_cookie` is `__u32[2]` in host byte order, low word first
/// (`sock_diag_save_cookie`).
fn cookie_u64(raw: [u8; 8]) -> u64 {
    let lo = u32::from_ne_bytes([raw[0], raw[1], raw[2], raw[3]]);
    let hi = u32::from_ne_bytes([raw[4], raw[5], raw[6], raw[7]]);
    (u64::from(hi) << 32) | u64::from(lo)
}

fn vanished(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESRCH)
}

/// The PIDs in `cgroup.procs` of `root` and of all its descendants. Cgroups
/// removed while we walk are skipped silently.
fn cgroup_pids(root: &Path, errors: &mut Vec<String>) -> Vec<u32> {
    let mut pids = Vec::new();
    let mut stack: Vec<PathBuf> = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let is_root = dir == root;
        match std::fs::read_to_string(dir.join("cgroup.procs")) {
            Ok(procs) => pids.extend(procs.lines().filter_map(|l| l.trim().parse::<u32>().ok())),
            Err(e) if !is_root && vanished(&e) => continue,
            Err(e) => {
                errors.push(format!("cgroup {}: read cgroup.procs: {e}", dir.display()));
                continue;
            }
        }
        match std::fs::read_dir(&dir) {
            Ok(entries) => {
                for entry in entries.flatten() {
                    if entry.file_type().is_ok_and(|t| t.is_dir()) {
                        stack.push(entry.path());
                    }
                }
            }
            Err(e) if !is_root && vanished(&e) => {}
            Err(e) => errors.push(format!("cgroup {}: list: {e}", dir.display())),
        }
    }
    pids
}

/// An open network namespace (the open file keeps it alive even if every
/// process in it exits meanwhile).
struct Netns {
    file: File,
    inode: u64,
    /// The first process seen in it, for error messages.
    pid: u32,
}

/// One open `/proc/PID/ns/net` per distinct namespace. Processes that exited
/// (or are zombies, which have no namespaces left) are skipped silently.
fn open_namespaces(pids: &[u32], errors: &mut Vec<String>) -> Vec<Netns> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for &pid in pids {
        let file = match File::open(format!("/proc/{pid}/ns/net")) {
            Ok(f) => f,
            Err(e) if vanished(&e) => continue,
            Err(e) => {
                errors.push(format!("pid {pid}: open /proc/{pid}/ns/net: {e}"));
                continue;
            }
        };
        // fstat on the opened file, not stat on the path: no race with PID
        // reuse between the two.
        let meta = match file.metadata() {
            Ok(m) => m,
            Err(e) => {
                errors.push(format!("pid {pid}: stat /proc/{pid}/ns/net: {e}"));
                continue;
            }
        };
        if seen.insert((meta.dev(), meta.ino())) {
            out.push(Netns {
                file,
                inode: meta.ino(),
                pid,
            });
        }
    }
    out
}

/// Opens a `NETLINK_SOCK_DIAG` socket inside the network namespace `ns`.
///
/// `setns(2)` only moves the calling thread, so it runs on a dedicated thread
/// that ends right after creating the socket: none of the agent's own threads
/// ever changes namespace. The socket keeps the namespace it was created in,
/// so it can be used from any thread afterwards.
fn sock_diag_socket_in(ns: File) -> io::Result<Socket> {
    std::thread::Builder::new()
        .name("lb-sockdiag-ns".into())
        .spawn(move || -> io::Result<Socket> {
            nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(|e| io::Error::other(format!("setns: {e}")))?;
            let mut sock = Socket::new(NETLINK_SOCK_DIAG)?;
            sock.bind_auto()?;
            sock.connect(&netlink_sys::SocketAddr::new(0, 0))?;
            nix::sys::socket::setsockopt(
                &sock,
                nix::sys::socket::sockopt::ReceiveTimeout,
                &nix::sys::time::TimeVal::from(libc::timeval {
                    tv_sec: NETLINK_RECV_TIMEOUT.as_secs() as libc::time_t,
                    tv_usec: 0,
                }),
            )?;
            Ok(sock)
        })?
        .join()
        .map_err(|_| io::Error::other("namespace thread panicked"))?
}

/// A sock_diag netlink socket bound to one network namespace.
struct SockDiag {
    sock: Socket,
    seq: u32,
}

impl SockDiag {
    fn send<I>(&mut self, flags: u16, payload: I) -> io::Result<u32>
    where
        I: netlink_packet_core::NetlinkSerializable,
        NetlinkPayload<I>: From<I>,
    {
        self.seq = self.seq.wrapping_add(1);
        let mut header = NetlinkHeader::default();
        header.flags = flags;
        header.sequence_number = self.seq;
        let mut msg = NetlinkMessage::new(header, NetlinkPayload::from(payload));
        msg.finalize();
        let mut buf = vec![0; msg.buffer_len()];
        msg.serialize(&mut buf);
        self.sock.send(&buf, 0)?;
        Ok(self.seq)
    }

    /// Receives replies to request `seq` and hands each message to `each`
    /// until it returns `Some`.
    fn recv_until<T>(
        &self,
        seq: u32,
        mut each: impl FnMut(NetlinkPayload<SockDiagMessage>) -> Option<io::Result<T>>,
    ) -> io::Result<T> {
        let mut buf = vec![0u8; RECV_BUF_LEN];
        loop {
            // MSG_TRUNC: the return value is the datagram's real length, so a
            // truncated one is detected instead of misparsed.
            let len = self.sock.recv(&mut &mut buf[..], libc::MSG_TRUNC)?;
            if len > buf.len() {
                return Err(io::Error::other(format!(
                    "netlink datagram of {len} bytes truncated"
                )));
            }
            let mut rest = &buf[..len];
            while !rest.is_empty() {
                let msg = NetlinkMessage::<SockDiagMessage>::deserialize(rest)
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
                let msg_len = msg.header.length as usize;
                let aligned = (msg_len + 3) & !3;
                rest = rest.get(aligned..).unwrap_or(&[]);
                if msg.header.sequence_number != seq || msg_len == 0 {
                    if msg_len == 0 {
                        break;
                    }
                    continue;
                }
                if let Some(result) = each(msg.payload) {
                    return result;
                }
            }
        }
    }

    /// Dumps the connected UDP sockets of this namespace whose destination is
    /// one of `targets`, keyed by cookie. The kernel filters on family, state
    /// (`ESTABLISHED`) and destination port (it ignores addresses in a dump
    /// request's `id`); addresses and everything else are re-checked here.
    fn connected_udp_to(&mut self, targets: &Targets) -> io::Result<BTreeMap<u64, (u8, SocketId)>> {
        let mut found = BTreeMap::new();
        for family in [AF_INET, AF_INET6] {
            for port in targets.dump_ports(family) {
                for header in self.dump(family, port)? {
                    let id = &header.socket_id;
                    if header.family == family
                        && header.state == TCP_ESTABLISHED
                        && targets.contains(id.destination_address, id.destination_port)
                    {
                        found.insert(cookie_u64(id.cookie), (family, header.socket_id));
                    }
                }
            }
        }
        Ok(found)
    }

    /// One `SOCK_DIAG_BY_FAMILY` dump of `family` UDP sockets in state
    /// `ESTABLISHED` with destination port `dport` (0: any).
    fn dump(&mut self, family: u8, dport: u16) -> io::Result<Vec<InetResponseHeader>> {
        let mut socket_id = if family == AF_INET {
            SocketId::new_v4()
        } else {
            SocketId::new_v6()
        };
        socket_id.destination_port = dport;
        // The kernel ignores the cookie in dump requests; all-ones is the
        // documented "no cookie" value anyway.
        socket_id.cookie = [0xff; 8];
        let request = SockDiagMessage::InetRequest(InetRequest {
            family,
            protocol: IPPROTO_UDP,
            extensions: ExtensionFlags::empty(),
            states: StateFlags::ESTABLISHED,
            socket_id,
        });
        let seq = self.send(NLM_F_REQUEST | NLM_F_DUMP, request)?;
        let mut out = Vec::new();
        self.recv_until(seq, |payload| match payload {
            NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(resp)) => {
                out.push(resp.header);
                None
            }
            NetlinkPayload::Done(_) => Some(Ok(())),
            NetlinkPayload::Error(e) => Some(Err(e.to_io())),
            _ => None,
        })?;
        Ok(out)
    }

    /// `SOCK_DESTROY` of the socket with exactly this `id` (addresses, ports,
    /// interface and cookie as dumped), waiting for the kernel's ack.
    fn destroy(&mut self, family: u8, id: SocketId) -> io::Result<()> {
        // netlink-packet-sock-diag's `SockDiagDestroy` is the request with
        // message type SOCK_DESTROY (21) and an inet_diag_req_v2 payload.
        let request = SockDiagDestroy::new(SockDiagMessage::InetRequest(InetRequest {
            family,
            protocol: IPPROTO_UDP,
            extensions: ExtensionFlags::empty(),
            states: StateFlags::all(),
            socket_id: id,
        }));
        let seq = self.send(NLM_F_REQUEST | NLM_F_ACK, request)?;
        self.recv_until(seq, |payload| match payload {
            // NLMSG_ERROR with error 0 is the ack; anything else is the errno.
            NetlinkPayload::Error(e) => Some(match e.code {
                None => Ok(()),
                Some(_) => Err(e.to_io()),
            }),
            NetlinkPayload::Done(_) => Some(Err(io::Error::other("unexpected NLMSG_DONE"))),
            _ => None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cookie_is_low_word_first() {
        let mut raw = [0u8; 8];
        raw[..4].copy_from_slice(&0x89ab_cdefu32.to_ne_bytes());
        raw[4..].copy_from_slice(&0x0123_4567u32.to_ne_bytes());
        assert_eq!(cookie_u64(raw), 0x0123_4567_89ab_cdef);
    }

    #[test]
    fn ipv4_targets_match_mapped_destinations() {
        let t = Targets::new(&["127.0.0.2:5353".parse().unwrap()].into());
        assert!(t.contains("127.0.0.2".parse().unwrap(), 5353));
        assert!(t.contains("::ffff:127.0.0.2".parse().unwrap(), 5353));
        assert!(!t.contains("127.0.0.2".parse().unwrap(), 5354));
        assert!(!t.contains("::2".parse().unwrap(), 5353));
        assert_eq!(t.dump_ports(AF_INET), vec![5353]);
        assert_eq!(t.dump_ports(AF_INET6), vec![5353]);
        let t = Targets::new(&["[fd00::1]:53".parse().unwrap()].into());
        assert!(t.dump_ports(AF_INET).is_empty());
        assert_eq!(t.dump_ports(AF_INET6), vec![53]);
        let many: BTreeSet<SocketAddr> = (1..=20)
            .map(|p| SocketAddr::from(([10, 0, 0, 1], p)))
            .collect();
        assert_eq!(Targets::new(&many).dump_ports(AF_INET), vec![0]);
    }

    #[test]
    fn missing_cgroup_is_an_error_not_a_panic() {
        let report = destroy_udp_sockets(
            Path::new("/nonexistent/lbsk-cgroup"),
            &["127.0.0.2:5353".parse().unwrap()].into(),
            |_| true,
        );
        assert_eq!(report.namespaces, 0);
        assert_eq!(report.errors.len(), 1, "{report:?}");
    }

    mod netns {
        //! Root-only end-to-end test in a network namespace of its own.
        use std::{
            io::{BufRead, BufReader, Write},
            process::{Child, Command, Stdio},
            sync::mpsc,
            time::Instant,
        };

        use super::*;

        fn run(cmd: &mut Command) {
            let out = cmd.output().expect("spawn");
            assert!(out.status.success(), "{cmd:?}: {out:?}");
        }

        /// `ip netns add` on creation, `ip netns del` on drop.
        struct NetnsGuard(String);
        impl NetnsGuard {
            fn new(name: String) -> Self {
                // A leftover of a crashed earlier run with the same pid.
                let _ = Command::new("ip").args(["netns", "del", &name]).output();
                run(Command::new("ip").args(["netns", "add", &name]));
                let guard = Self(name);
                run(Command::new("ip").args(["-n", &guard.0, "link", "set", "lo", "up"]));
                guard
            }
        }
        impl Drop for NetnsGuard {
            fn drop(&mut self) {
                let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
            }
        }

        /// A cgroup (with a child cgroup `leaf`) removed on drop, after
        /// killing whatever is left in it.
        struct CgroupGuard(PathBuf);
        impl CgroupGuard {
            fn new(path: PathBuf) -> Self {
                let guard = Self(path);
                std::fs::create_dir_all(guard.leaf()).expect("mkdir cgroup");
                guard
            }
            fn leaf(&self) -> PathBuf {
                self.0.join("leaf")
            }
        }
        impl Drop for CgroupGuard {
            fn drop(&mut self) {
                for dir in [self.leaf(), self.0.clone()] {
                    if !dir.exists() {
                        continue;
                    }
                    let _ = std::fs::write(dir.join("cgroup.kill"), "1");
                    let deadline = Instant::now() + Duration::from_secs(5);
                    while std::fs::remove_dir(&dir).is_err() && Instant::now() < deadline {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
            }
        }

        /// The socket-holding client, killed and reaped on drop.
        struct ChildGuard(Child);
        impl Drop for ChildGuard {
            fn drop(&mut self) {
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }

        fn cgroup2_mount() -> Option<PathBuf> {
            let mounts = std::fs::read_to_string("/proc/mounts").ok()?;
            mounts.lines().find_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                (f.len() > 2 && f[2] == "cgroup2").then(|| PathBuf::from(f[1]))
            })
        }

        /// The real interpreter behind a `python3` that may be a shim needing
        /// the caller's environment.
        fn python3() -> Option<String> {
            let out = Command::new("python3")
                .args(["-c", "import sys; print(sys.executable)"])
                .output()
                .ok()?;
            out.status
                .success()
                .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
        }

        /// Binds a "backend" at 127.0.0.2:5353 and connects client sockets:
        /// a -> 127.0.0.2:5353, b -> 127.0.0.3:5353, d -> 127.0.0.2:5354 and
        /// (if IPv6 works) c: AF_INET6 -> [::ffff:127.0.0.2]:5353. Prints
        /// each one's SO_COOKIE, then blocks in recv() on all of them (timeout
        /// from argv) and prints what each recv returned. Sends nothing.
        const CLIENT: &str = r#"
import errno, socket, struct, sys, threading
SO_COOKIE = 57
srv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
srv.bind(("127.0.0.2", 5353))
socks = {}
def mk(name, fam, dst):
    s = socket.socket(fam, socket.SOCK_DGRAM)
    s.connect(dst)
    socks[name] = s
mk("a", socket.AF_INET, ("127.0.0.2", 5353))
mk("b", socket.AF_INET, ("127.0.0.3", 5353))
mk("d", socket.AF_INET, ("127.0.0.2", 5354))
try:
    mk("c", socket.AF_INET6, ("::ffff:127.0.0.2", 5353))
except OSError as e:
    print("NOV6", e, flush=True)
def rx(name, s):
    s.settimeout(float(sys.argv[1]))
    try:
        s.recv(512)
        r = "data"
    except socket.timeout:
        r = "timeout"
    except OSError as e:
        r = errno.errorcode.get(e.errno, str(e.errno))
    # One write under a lock: print() from threads interleaves its pieces.
    with out_lock:
        sys.stdout.write(f"RECV {name} {r}\n")
        sys.stdout.flush()
out_lock = threading.Lock()
threads = [threading.Thread(target=rx, args=(n, s)) for n, s in socks.items()]
for t in threads:
    t.start()
for n, s in socks.items():
    cookie = struct.unpack("=Q", s.getsockopt(socket.SOL_SOCKET, SO_COOKIE, 8))[0]
    print("SOCK", n, cookie, s.getsockname()[1], flush=True)
print("READY", flush=True)
for t in threads:
    t.join()
import time
time.sleep(120)  # keep the sockets until the test kills us
"#;

        #[test]
        fn destroys_only_connected_udp_sockets_to_targets() {
            // SAFETY: geteuid has no preconditions and cannot fail.
            if unsafe { libc::geteuid() } != 0 {
                eprintln!("SKIPPED sockets::netns test: needs root (netns, cgroup, SOCK_DESTROY)");
                return;
            }
            let Some(cg2) = cgroup2_mount() else {
                eprintln!("SKIPPED sockets::netns test: no cgroup2 mount in /proc/mounts");
                return;
            };
            let Some(python) = python3() else {
                eprintln!("SKIPPED sockets::netns test: no python3");
                return;
            };
            if Command::new("ip").arg("-V").output().is_err() {
                eprintln!("SKIPPED sockets::netns test: no iproute2 `ip`");
                return;
            }

            let name = format!("lbsk-{}", std::process::id());
            let cgroup = CgroupGuard::new(cg2.join(&name));
            let netns = NetnsGuard::new(name);

            // The shell puts itself into the leaf cgroup (inside the netns it
            // could no longer see /sys/fs/cgroup), then becomes the client.
            const RECV_TIMEOUT_SECS: u64 = 6;
            let script = format!(
                "echo $$ > '{}/cgroup.procs' && exec ip netns exec '{}' '{}' -c \"$0\" {}",
                cgroup.leaf().display(),
                netns.0,
                python,
                RECV_TIMEOUT_SECS
            );
            let mut child = ChildGuard(
                Command::new("sh")
                    .args(["-c", &script, CLIENT])
                    .stdin(Stdio::null())
                    .stdout(Stdio::piped())
                    .spawn()
                    .expect("spawn client"),
            );
            let stdout = child.0.stdout.take().unwrap();
            let (tx, lines) = mpsc::channel::<String>();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    let _ = writeln!(io::stderr(), "client: {line}");
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
            let next = || {
                lines
                    .recv_timeout(Duration::from_secs(RECV_TIMEOUT_SECS + 10))
                    .expect("client output")
            };

            // name -> (cookie, local port)
            let mut socks = BTreeMap::new();
            loop {
                let line = next();
                let f: Vec<&str> = line.split_whitespace().collect();
                match f.as_slice() {
                    ["READY"] => break,
                    ["SOCK", n, cookie, port] => {
                        socks.insert(
                            n.to_string(),
                            (cookie.parse::<u64>().unwrap(), port.parse::<u16>().unwrap()),
                        );
                    }
                    _ => {}
                }
            }
            let has_v6 = socks.contains_key("c");
            let mut expected: BTreeSet<u64> = [socks["a"].0].into();
            if has_v6 {
                expected.insert(socks["c"].0);
            }

            let target: SocketAddr = "127.0.0.2:5353".parse().unwrap();
            let targets: BTreeSet<SocketAddr> = [target].into();

            // A predicate saying no destroys nothing, but sees exactly the
            // sockets connected to the target, with their SO_COOKIE.
            let mut seen = Vec::new();
            let report = destroy_udp_sockets(&cgroup.0, &targets, |s| {
                seen.push(s.clone());
                false
            });
            eprintln!("predicate false: {report:?}\n  offered: {seen:?}");
            assert!(report.errors.is_empty(), "{report:?}");
            assert_eq!(report.namespaces, 1);
            assert_eq!(report.examined, expected.len());
            assert_eq!(report.destroyed, 0);
            assert_eq!(
                seen.iter().map(|s| s.cookie).collect::<BTreeSet<_>>(),
                expected
            );
            for s in &seen {
                if s.cookie == socks["a"].0 {
                    assert_eq!(s.dst, target);
                    assert_eq!(s.src, SocketAddr::from(([127, 0, 0, 1], socks["a"].1)));
                } else {
                    assert_eq!(
                        s.dst,
                        "[::ffff:127.0.0.2]:5353".parse::<SocketAddr>().unwrap()
                    );
                    assert_eq!(s.src.port(), socks["c"].1);
                }
            }

            // Now destroy them.
            let mut seen = Vec::new();
            let report = destroy_udp_sockets(&cgroup.0, &targets, |s| {
                seen.push(s.cookie);
                true
            });
            eprintln!("predicate true: {report:?}");
            assert!(report.errors.is_empty(), "{report:?}");
            assert_eq!(report.namespaces, 1);
            assert_eq!(report.examined, expected.len());
            assert_eq!(report.destroyed, expected.len());
            assert_eq!(seen.into_iter().collect::<BTreeSet<_>>(), expected);

            // Destroyed sockets are no longer connected; the others still are.
            let report = destroy_udp_sockets(&cgroup.0, &targets, |_| true);
            assert_eq!((report.examined, report.destroyed), (0, 0), "{report:?}");
            let others: BTreeSet<SocketAddr> = [
                "127.0.0.3:5353".parse().unwrap(),
                "127.0.0.2:5354".parse().unwrap(),
            ]
            .into();
            let mut seen = BTreeSet::new();
            let report = destroy_udp_sockets(&cgroup.0, &others, |s| {
                seen.insert(s.cookie);
                false
            });
            assert!(report.errors.is_empty(), "{report:?}");
            assert_eq!(seen, [socks["b"].0, socks["d"].0].into());

            // The client's pending recv() on the destroyed sockets fails with
            // ECONNABORTED right away; the others time out untouched.
            let started = Instant::now();
            let mut recv = BTreeMap::new();
            while recv.len() < socks.len() {
                let line = next();
                if let ["RECV", n, r] = line.split_whitespace().collect::<Vec<_>>().as_slice() {
                    recv.insert(n.to_string(), (r.to_string(), started.elapsed()));
                }
            }
            eprintln!("client recv results: {recv:?}");
            assert_eq!(recv["a"].0, "ECONNABORTED");
            assert!(recv["a"].1 < Duration::from_secs(RECV_TIMEOUT_SECS / 2));
            if has_v6 {
                assert_eq!(recv["c"].0, "ECONNABORTED");
            }
            assert_eq!(recv["b"].0, "timeout");
            assert_eq!(recv["d"].0, "timeout");

            // Teardown (also on panic): the guards drop in reverse order:
            // client, netns, cgroup.
            drop(child);
            drop(netns);
            drop(cgroup);
        }
    }
}
