//! `lb-probe`: the traffic ends of the integration tests.
//!
//! - `serve --name NAME --port P [--port Q ...] [--with-port]`: on each port,
//!   TCP and UDP on `[::]` (dual-stack), and SCTP (one-to-one) when the
//!   kernel has it. TCP and SCTP: on accept, write `NAME\n` and close. UDP:
//!   answer each datagram with `NAME`. With `--with-port` the answer is
//!   `NAME:PORT`, PORT being the local port that was hit. Prints one line
//!   `{"listening":true,"sctp":BOOL,...}` once every socket is bound.
//! - `client --cgroup DIR --netns NS --target IP:PORT --proto tcp|udp|udp-connected|sctp
//!   --count N [--family v4|v6|v4mapped] [--timeout-ms 2000]`: first joins the
//!   cgroup (writes its pid to `DIR/cgroup.procs`), then enters the network
//!   namespace `/run/netns/NS`, then makes N independent attempts, printing
//!   one JSON line for each:
//!   `{"ok":true,"backend":"b1","reply":"b1","peer":"10.96.0.10:80","elapsed_ms":0.2}` or
//!   `{"ok":false,"error":"ECONNREFUSED","stage":"connect","elapsed_ms":0.1}`.
//!   `--interval-us N` paces the attempts (one every N µs); `--source-port P`
//!   binds each TCP attempt to source port P.
//! - `hold-udp --cgroup DIR --netns NS --target IP:PORT [--interval-ms 100]
//!   [--duration-ms 10000]`: one connected UDP socket that sends every
//!   interval and waits in recv() in between; one JSON line (flushed) per
//!   reply or error, `elapsed_ms` counted from the start; after an error
//!   (e.g. `ECONNABORTED` when the load balancer destroyed the socket) it
//!   connects a new socket.
//! - `flows --cgroup DIR --netns NS --target IP:PORT --sockets N`: N
//!   unconnected UDP sockets; each line on stdin starts a round in which
//!   every socket sends one datagram and waits for its answer; prints
//!   `{"round":0,"backends":["b1",null,...]}` per round.
//! - `tcp-serve`, `tcp-client`, `tcp-flows`, `syn-flood`: long-lived TCP
//!   flows with byte accounting at both ends, out-of-window RSTs and a
//!   bounded spoofed SYN flood, for the tc path's flow tests (see
//!   `integration_tests::tcpflow` and `--help` of each).
use std::{
    cell::Cell,
    io::{self, BufWriter, IoSliceMut, Read as _, Write as _},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use integration_tests::probe::Attempt;
use nix::sys::socket::{
    recvmsg, setsockopt, sockopt, ControlMessageOwned, MsgFlags, SockaddrStorage,
};

#[derive(Debug, Parser)]
#[command(
    name = "lb-probe",
    about = "Test server and client for the load balancer's integration tests"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Answer TCP connections and UDP datagrams with a name.
    Serve(ServeArgs),
    /// Connect or send N times and report, one JSON line per attempt.
    Client(ClientArgs),
    /// Keep one connected UDP socket, send on it periodically and report
    /// every reply and error; reconnect (a new socket) after an error.
    HoldUdp(HoldUdpArgs),
    /// Keep N unconnected UDP sockets; for each line read on stdin, send one
    /// datagram from each and print which backend answered each.
    Flows(FlowsArgs),
    /// TCP server of the flow tests: greeting, pattern or echo, one JSON
    /// report per connection (see `integration_tests::tcpflow`).
    TcpServe(TcpServeArgs),
    /// TCP client of the flow tests: bulk, stream, half-close or
    /// connect-request-close rounds; one JSON report per connection.
    TcpClient(TcpClientArgs),
    /// N long-lived echo connections driven by stdin commands: `ping`,
    /// `rst` (inject out-of-window RSTs on each flow's tuple), `close`.
    TcpFlows(TcpFlowsArgs),
    /// A bounded flood of spoofed TCP SYNs (raw IPv4), from a namespace
    /// without a default route only.
    SynFlood(SynFloodArgs),
    /// One datagram from each of N UDP source ports: N idle UDP flows in
    /// the tc path's conntrack.
    UdpFill(UdpFillArgs),
    /// Open N TCP connections and keep them: one JSON line with each
    /// one's `getpeername` (or error) and, with `--read-name`, the name
    /// its backend wrote; then at `close-to NAME` on stdin close those to
    /// backend NAME and print `{"closed": N}`, and at any other line (or
    /// EOF) close them all and print `{"closed": N}`.
    HoldTcp(HoldTcpArgs),
    /// Watch the RSTs a namespace sends on a device (a filtered
    /// `AF_PACKET` socket: SYN, FIN and RST segments only): prints
    /// `{"ready": true}`, then at a line on stdin (or EOF)
    /// `{"after_close": N, "other": [...]}` (see `tcpflow::RstClassifier`).
    RstWatch(RstWatchArgs),
}

#[derive(Debug, Args)]
struct RstWatchArgs {
    /// Network namespace (`ip netns` name).
    #[arg(long)]
    netns: String,
    #[arg(long, default_value = "eth0")]
    dev: String,
}

#[derive(Debug, Args)]
struct HoldTcpArgs {
    #[command(flatten)]
    at: Place,
    #[arg(long, default_value_t = 10)]
    sockets: usize,
    /// Read each connection's first line (`serve` writes its name) and
    /// report it as `backend`.
    #[arg(long)]
    read_name: bool,
}

#[derive(Debug, Args)]
struct UdpFillArgs {
    #[command(flatten)]
    at: Place,
    #[arg(long, default_value_t = 20_000)]
    first_port: u16,
    #[arg(long, default_value_t = 1000)]
    count: u16,
}

#[derive(Debug, Args)]
struct TcpServeArgs {
    #[arg(long)]
    name: String,
    #[arg(long)]
    port: u16,
    /// Pin connection threads round-robin to these CPUs (comma-separated).
    #[arg(long, value_delimiter = ',')]
    cpus: Vec<usize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum TcpMode {
    /// Send --up-bytes while receiving --down-bytes.
    Bulk,
    /// Send and receive continuously for --duration-ms.
    Stream,
    /// Send --up-bytes, FIN, then receive --chunks chunks of --chunk bytes
    /// that the server sends --gap-ms apart after the FIN.
    HalfClose,
    /// Connect, request --down-bytes, FIN, read to EOF, close.
    Crr,
}

#[derive(Debug, Args)]
struct TcpClientArgs {
    #[command(flatten)]
    at: Place,
    /// Connection id (round R of several: `ID.R`).
    #[arg(long)]
    id: String,
    #[arg(long, value_enum)]
    mode: TcpMode,
    #[arg(long, default_value_t = 0)]
    up_bytes: u64,
    #[arg(long, default_value_t = 0)]
    down_bytes: u64,
    #[arg(long, default_value_t = 0)]
    duration_ms: u64,
    #[arg(long, default_value_t = 3)]
    chunks: u32,
    #[arg(long, default_value_t = 65_536)]
    chunk: u64,
    #[arg(long, default_value_t = 3000)]
    gap_ms: u64,
    /// Connections one after the other (at most).
    #[arg(long, default_value_t = 1)]
    rounds: u32,
    /// Start no new round after this long (0: no limit).
    #[arg(long, default_value_t = 0)]
    until_ms: u64,
    /// Start a round every this many ms (0: back to back).
    #[arg(long, default_value_t = 0)]
    interval_ms: u64,
    /// Pin the process to this CPU.
    #[arg(long)]
    cpu: Option<usize>,
    #[arg(long, default_value_t = 3000)]
    connect_timeout_ms: u64,
    /// A read or write making no progress for this long fails the flow.
    #[arg(long, default_value_t = 20_000)]
    stall_ms: u64,
}

#[derive(Debug, Args)]
struct TcpFlowsArgs {
    #[command(flatten)]
    at: Place,
    #[arg(long, default_value_t = 4)]
    sockets: usize,
    /// Flow ids are `PREFIX-K`.
    #[arg(long)]
    id: String,
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
    /// RSTs per flow and `rst` command.
    #[arg(long, default_value_t = 3)]
    rst_copies: u32,
    /// Bind every socket to this source port first (SO_REUSEADDR), as a
    /// client reusing one port for several destinations does.
    #[arg(long)]
    from_port: Option<u16>,
}

#[derive(Debug, Args)]
struct SynFloodArgs {
    #[command(flatten)]
    at: Place,
    /// Spoofed sources: random addresses of this prefix (e.g. 198.18.0.0/16).
    #[arg(long)]
    sources: String,
    #[arg(long, default_value_t = 30_000)]
    count: u64,
    #[arg(long, default_value_t = 10_000)]
    duration_ms: u64,
}

/// Where a client runs (joined in this order) and what it talks to.
#[derive(Debug, Args)]
struct Place {
    /// cgroup v2 directory to join first.
    #[arg(long)]
    cgroup: Option<PathBuf>,
    /// Network namespace (`ip netns` name) to enter after joining the cgroup.
    #[arg(long)]
    netns: Option<String>,
    /// `IP:PORT` or `[IPv6]:PORT`.
    #[arg(long)]
    target: String,
}

impl Place {
    /// Joins the cgroup, then the network namespace (in that order: the
    /// cgroup file is reachable from any namespace, and every socket made
    /// afterwards belongs to both).
    fn enter(&self) -> Result<()> {
        integration_tests::netns::enter(self.cgroup.as_deref(), self.netns.as_deref())
    }
}

#[derive(Debug, Args)]
struct HoldUdpArgs {
    #[command(flatten)]
    at: Place,
    /// Time between sends; the socket waits in recv() in between.
    #[arg(long, default_value_t = 100)]
    interval_ms: u64,
    /// Stop after this long.
    #[arg(long, default_value_t = 10_000)]
    duration_ms: u64,
}

#[derive(Debug, Args)]
struct FlowsArgs {
    #[command(flatten)]
    at: Place,
    /// How many sockets (flows).
    #[arg(long, default_value_t = 100)]
    sockets: usize,
    /// Per datagram: receive timeout.
    #[arg(long, default_value_t = 1000)]
    timeout_ms: u64,
}

#[derive(Debug, Args)]
struct ServeArgs {
    /// What to answer.
    #[arg(long)]
    name: String,
    /// Port to serve TCP and UDP on (repeatable).
    #[arg(long = "port", required = true)]
    ports: Vec<u16>,
    /// Answer `NAME:PORT` (the local port that was hit) instead of `NAME`.
    #[arg(long)]
    with_port: bool,
    /// Append ` from IP`: the client address this server sees (the client
    /// reports it as `seen_from`), to tell preserved from masqueraded.
    #[arg(long)]
    with_peer: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Proto {
    Tcp,
    Udp,
    UdpConnected,
    /// A one-to-one (`SOCK_STREAM`) SCTP socket, read like TCP.
    Sctp,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Family {
    V4,
    V6,
    /// An AF_INET6 socket addressing the IPv4 target as `::ffff:a.b.c.d`.
    V4mapped,
}

#[derive(Debug, Args)]
struct ClientArgs {
    #[command(flatten)]
    at: Place,
    #[arg(long, value_enum, default_value = "tcp")]
    proto: Proto,
    #[arg(long, default_value_t = 1)]
    count: usize,
    /// Socket family; default: the target's.
    #[arg(long, value_enum)]
    family: Option<Family>,
    /// Per attempt: connect, read and receive timeout.
    #[arg(long, default_value_t = 2000)]
    timeout_ms: u64,
    /// Start an attempt every this many microseconds (0: back to back).
    #[arg(long, default_value_t = 0)]
    interval_us: u64,
    /// Start no attempt after this long (0: no limit); --count stays the
    /// most.
    #[arg(long, default_value_t = 0)]
    duration_ms: u64,
    /// Pin the process to this CPU.
    #[arg(long)]
    cpu: Option<usize>,
    /// Report each attempt's start and end (`start_ns`, `end_ns`,
    /// CLOCK_MONOTONIC).
    #[arg(long)]
    timestamps: bool,
    /// TCP: bind every attempt's socket to this source port
    /// (`SO_REUSEADDR`), so that two runs can share a tuple.
    #[arg(long)]
    source_port: Option<u16>,
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Cmd::Serve(a) => serve(a),
        Cmd::Client(a) => client(a),
        Cmd::HoldUdp(a) => hold_udp(a),
        Cmd::Flows(a) => flows(a),
        Cmd::TcpServe(a) => integration_tests::tcpflow::serve(&a.name, a.port, &a.cpus),
        Cmd::TcpClient(a) => tcp_client(a),
        Cmd::TcpFlows(a) => tcp_flows(a),
        Cmd::HoldTcp(a) => hold_tcp(a),
        Cmd::RstWatch(a) => rst_watch(a),
        Cmd::SynFlood(a) => syn_flood(a),
        Cmd::UdpFill(a) => {
            let target = resolve_target(&a.at.target, None)?;
            a.at.enter()?;
            let (sent, answered) =
                integration_tests::tcpflow::udp_fill(target, a.first_port, a.count)?;
            println!(
                "{}",
                serde_json::json!({"sent": sent, "answered": answered})
            );
            Ok(())
        }
    }
}

// ---------------------------------------------------------------- serve

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// An AF_INET6 socket on `[::]:port` that also accepts IPv4 (V6ONLY off);
/// `protocol` 0 is the type's default.
fn dual_stack_socket(ty: libc::c_int, protocol: libc::c_int, port: u16) -> io::Result<OwnedFd> {
    // SAFETY: plain socket calls on a descriptor we own; the sockaddr is a
    // zeroed, fully initialised sockaddr_in6 of the size passed.
    unsafe {
        let fd = cvt(libc::socket(
            libc::AF_INET6,
            ty | libc::SOCK_CLOEXEC,
            protocol,
        ))?;
        let fd = OwnedFd::from_raw_fd(fd);
        let zero: libc::c_int = 0;
        let one: libc::c_int = 1;
        let len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        cvt(libc::setsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_IPV6,
            libc::IPV6_V6ONLY,
            &zero as *const _ as *const libc::c_void,
            len,
        ))?;
        cvt(libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_REUSEADDR,
            &one as *const _ as *const libc::c_void,
            len,
        ))?;
        let mut sa: libc::sockaddr_in6 = std::mem::zeroed();
        sa.sin6_family = libc::AF_INET6 as libc::sa_family_t;
        sa.sin6_port = port.to_be();
        cvt(libc::bind(
            fd.as_raw_fd(),
            &sa as *const _ as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
        ))?;
        if ty == libc::SOCK_STREAM {
            cvt(libc::listen(fd.as_raw_fd(), 1024))?;
        }
        Ok(fd)
    }
}

fn serve(a: ServeArgs) -> Result<()> {
    let mut threads = Vec::new();
    let mut sctp_listening = false;
    for &port in &a.ports {
        let reply = if a.with_port {
            format!("{}:{port}", a.name)
        } else {
            a.name.clone()
        };
        let tcp = TcpListener::from(
            dual_stack_socket(libc::SOCK_STREAM, 0, port)
                .with_context(|| format!("TCP [::]:{port}"))?,
        );
        let udp = UdpSocket::from(
            dual_stack_socket(libc::SOCK_DGRAM, 0, port)
                .with_context(|| format!("UDP [::]:{port}"))?,
        );
        // A one-to-one SCTP socket accepts and writes like a TCP one.
        let sctp = match dual_stack_socket(libc::SOCK_STREAM, libc::IPPROTO_SCTP, port) {
            Ok(fd) => Some(TcpListener::from(fd)),
            Err(e) if no_sctp(&e) => None,
            Err(e) => return Err(e).with_context(|| format!("SCTP [::]:{port}")),
        };
        sctp_listening = sctp.is_some();
        let with_peer = a.with_peer;
        let answer = move |reply: &str, peer: SocketAddr| -> String {
            if with_peer {
                let ip = match peer.ip() {
                    IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
                    v4 => v4,
                };
                format!("{reply} from {ip}")
            } else {
                reply.to_string()
            }
        };
        for (what, listener) in [("TCP", Some(tcp)), ("SCTP", sctp)] {
            let Some(listener) = listener else { continue };
            let line = reply.clone();
            threads.push(std::thread::spawn(move || loop {
                match listener.accept() {
                    Ok((mut s, peer)) => {
                        let _ = s.write_all(format!("{}\n", answer(&line, peer)).as_bytes());
                    }
                    Err(e) => {
                        eprintln!("lb-probe serve: {what} accept on {port}: {e}");
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
            }));
        }
        threads.push(std::thread::spawn(move || {
            let mut buf = [0u8; 2048];
            loop {
                match udp.recv_from(&mut buf) {
                    Ok((_, src)) => {
                        let _ = udp.send_to(answer(&reply, src).as_bytes(), src);
                    }
                    Err(e) => {
                        eprintln!("lb-probe serve: recvfrom on {port}: {e}");
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
            }
        }));
    }
    let ready = serde_json::json!({
        "listening": true, "name": a.name, "ports": a.ports, "sctp": sctp_listening,
    });
    let mut out = io::stdout().lock();
    writeln!(out, "{ready}")?;
    out.flush()?;
    drop(out);
    for t in threads {
        let _ = t.join();
    }
    Ok(())
}

// ---------------------------------------------------------------- client

fn errno_name(e: &io::Error, stage: &str) -> String {
    let Some(code) = e.raw_os_error() else {
        return match e.kind() {
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => "ETIMEDOUT".into(),
            k => format!("{k:?}"),
        };
    };
    let name = match code {
        libc::ECONNREFUSED => "ECONNREFUSED",
        libc::ENETUNREACH => "ENETUNREACH",
        libc::EHOSTUNREACH => "EHOSTUNREACH",
        libc::ETIMEDOUT => "ETIMEDOUT",
        // A receive timeout (SO_RCVTIMEO) is EAGAIN: report it as a timeout.
        libc::EAGAIN if stage == "recv" || stage == "read" => "ETIMEDOUT",
        libc::EAGAIN => "EAGAIN",
        libc::EPERM => "EPERM",
        libc::EACCES => "EACCES",
        libc::ECONNRESET => "ECONNRESET",
        libc::ECONNABORTED => "ECONNABORTED",
        libc::EADDRNOTAVAIL => "EADDRNOTAVAIL",
        libc::EADDRINUSE => "EADDRINUSE",
        libc::EAFNOSUPPORT => "EAFNOSUPPORT",
        libc::EINVAL => "EINVAL",
        libc::ENOTCONN => "ENOTCONN",
        libc::EPIPE => "EPIPE",
        libc::EMFILE => "EMFILE",
        libc::ENOBUFS => "ENOBUFS",
        libc::EINPROGRESS => "EINPROGRESS",
        libc::ENXIO => "ENXIO",
        other => return format!("E{other}"),
    };
    name.to_string()
}

type Step<T> = std::result::Result<T, (&'static str, io::Error)>;

fn at<T>(stage: &'static str, r: io::Result<T>) -> Step<T> {
    r.map_err(|e| (stage, e))
}

struct Answer {
    reply: String,
    peer: SocketAddr,
    source: Option<SocketAddr>,
}

fn tcp_once(target: SocketAddr, timeout: Duration, source_port: Option<u16>) -> Step<Answer> {
    let Some(port) = source_port else {
        return stream_answer(
            at("connect", TcpStream::connect_timeout(&target, timeout))?,
            timeout,
        );
    };
    let s = at(
        "socket",
        socket2::Socket::new(
            socket2::Domain::for_address(target),
            socket2::Type::STREAM,
            None,
        ),
    )?;
    at("bind", s.set_reuse_address(true))?;
    let unspecified: IpAddr = match target {
        SocketAddr::V4(_) => std::net::Ipv4Addr::UNSPECIFIED.into(),
        SocketAddr::V6(_) => std::net::Ipv6Addr::UNSPECIFIED.into(),
    };
    at("bind", s.bind(&SocketAddr::new(unspecified, port).into()))?;
    at("connect", s.connect_timeout(&target.into(), timeout))?;
    stream_answer(s.into(), timeout)
}

/// A connected stream socket's peer and the server's answer, read to EOF.
fn stream_answer(s: TcpStream, timeout: Duration) -> Step<Answer> {
    let peer = at("getpeername", s.peer_addr())?;
    at("read", s.set_read_timeout(Some(timeout)))?;
    let mut reply = String::new();
    at("read", (&s).read_to_string(&mut reply))?;
    if reply.is_empty() {
        return Err(("read", io::Error::new(io::ErrorKind::UnexpectedEof, "EOF")));
    }
    Ok(Answer {
        reply,
        peer,
        source: None,
    })
}

/// A kernel without SCTP (`CONFIG_IP_SCTP` unset, or the module absent).
fn no_sctp(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EPROTONOSUPPORT | libc::ESOCKTNOSUPPORT)
    )
}

/// Like [`tcp_once`] on a one-to-one SCTP socket: connect (within
/// `timeout`, `SO_SNDTIMEO`; SCTP's connect then fails with `EINPROGRESS`),
/// getpeername, read the answer to EOF.
fn sctp_once(target: SocketAddr, timeout: Duration) -> Step<Answer> {
    let family = match target {
        SocketAddr::V4(_) => libc::AF_INET,
        SocketAddr::V6(_) => libc::AF_INET6,
    };
    // SAFETY: a socket call; the descriptor is owned at once.
    let fd = at("socket", unsafe {
        cvt(libc::socket(
            family,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
            libc::IPPROTO_SCTP,
        ))
        .map(|fd| OwnedFd::from_raw_fd(fd))
    })?;
    let tv = libc::timeval {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_usec: timeout.subsec_micros() as libc::suseconds_t,
    };
    let (sa, len) = sockaddr_of(target);
    // SAFETY: setsockopt with a timeval of its size; connect with a
    // sockaddr_storage holding `len` initialised bytes.
    unsafe {
        at(
            "connect",
            cvt(libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_SNDTIMEO,
                &tv as *const _ as *const libc::c_void,
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )),
        )?;
        at(
            "connect",
            cvt(libc::connect(
                fd.as_raw_fd(),
                &sa as *const _ as *const libc::sockaddr,
                len,
            )),
        )?;
    }
    // Reads, writes and getpeername are those of any stream socket.
    stream_answer(TcpStream::from(fd), timeout)
}

/// `addr` as a sockaddr for the syscalls, with its length.
fn sockaddr_of(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero is a valid sockaddr_storage; each arm writes a
    // sockaddr that fits in it.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            unsafe { std::ptr::write(&mut ss as *mut _ as *mut libc::sockaddr_in, sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            unsafe { std::ptr::write(&mut ss as *mut _ as *mut libc::sockaddr_in6, sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

fn unspecified(target: SocketAddr) -> SocketAddr {
    match target {
        SocketAddr::V4(_) => "0.0.0.0:0".parse().expect("literal"),
        SocketAddr::V6(_) => "[::]:0".parse().expect("literal"),
    }
}

fn udp_once(target: SocketAddr, timeout: Duration, connected: bool) -> Step<Answer> {
    let s = at("socket", UdpSocket::bind(unspecified(target)))?;
    at("socket", s.set_read_timeout(Some(timeout)))?;
    let mut peer = None;
    if connected {
        // The ICMP error behind a failure is then kept on the socket's
        // error queue (`icmp_error_detail`); a connected socket reports
        // hard errors (port or host unreachable) either way. An IPv6
        // socket's IPv4-mapped peer answers through the IPv4 option.
        let mut recv_err = setsockopt(&s, sockopt::Ipv4RecvErr, &true);
        if target.is_ipv6() {
            recv_err = setsockopt(&s, sockopt::Ipv6RecvErr, &true);
        }
        at("socket", recv_err.map_err(io::Error::from))?;
        at("connect", s.connect(target))?;
        peer = Some(at("getpeername", peer_connected(&s))?);
        at("send", send_connected(&s, b"ping"))?;
    } else {
        at("send", s.send_to(b"ping", target))?;
    }
    let mut buf = [0u8; 2048];
    let (n, src) = match s.recv_from(&mut buf) {
        Ok(r) => r,
        Err(e) => {
            if connected {
                ERROR_DETAIL.set(icmp_error_detail(&s));
            }
            return Err(("recv", e));
        }
    };
    let reply = String::from_utf8_lossy(&buf[..n]).into_owned();
    Ok(match peer {
        Some(peer) => Answer {
            reply,
            peer,
            source: Some(src),
        },
        None => Answer {
            reply,
            peer: src,
            source: None,
        },
    })
}

/// `send()` on a connected UDP socket. SOCK_DESTROY (`udp_abort`) leaves
/// ECONNABORTED pending and disconnects the socket, so a send that comes
/// after it, before any recv, fails with EDESTADDRREQ: the pending error is
/// the cause, and the one an application reads next.
fn send_connected(s: &UdpSocket, b: &[u8]) -> io::Result<usize> {
    pending_instead_of(s, libc::EDESTADDRREQ, s.send(b))
}

/// `getpeername()` on a connected UDP socket: after SOCK_DESTROY it fails
/// with ENOTCONN (the socket is disconnected), ECONNABORTED pending, as
/// in `send_connected`.
fn peer_connected(s: &UdpSocket) -> io::Result<SocketAddr> {
    pending_instead_of(s, libc::ENOTCONN, s.peer_addr())
}

/// `r`, with `s`'s pending error in place of `errno` when there is one.
fn pending_instead_of<T>(s: &UdpSocket, errno: i32, r: io::Result<T>) -> io::Result<T> {
    match r {
        Err(e) if e.raw_os_error() == Some(errno) => match s.take_error() {
            Ok(Some(pending)) => Err(pending),
            _ => Err(e),
        },
        r => r,
    }
}

thread_local! {
    /// What `udp_once` learnt of its failure beyond the errno
    /// (`Attempt::detail`).
    static ERROR_DETAIL: Cell<Option<String>> = const { Cell::new(None) };
}

/// The ICMP error on `s`'s error queue (with `IP_RECVERR`): its type and
/// code, who sent it, and the destination of the datagram it answers.
fn icmp_error_detail(s: &UdpSocket) -> Option<String> {
    let mut payload = [0u8; 64];
    let mut iov = [IoSliceMut::new(&mut payload)];
    let mut cmsgs = nix::cmsg_space!(libc::sock_extended_err, libc::sockaddr_in6);
    let flags = MsgFlags::MSG_ERRQUEUE | MsgFlags::MSG_DONTWAIT;
    let msg = recvmsg::<SockaddrStorage>(s.as_raw_fd(), &mut iov, Some(&mut cmsgs), flags).ok()?;
    let to = msg.address.map_or("?".to_string(), |a| a.to_string());
    let cmsgs = msg.cmsgs().ok()?;
    for c in cmsgs {
        let (e, from) = match c {
            ControlMessageOwned::Ipv4RecvErr(e, from) => (
                e,
                from.map(|a| Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)).to_string()),
            ),
            ControlMessageOwned::Ipv6RecvErr(e, from) => (
                e,
                from.map(|a| Ipv6Addr::from(a.sin6_addr.s6_addr).to_string()),
            ),
            _ => continue,
        };
        return Some(format!(
            "ICMP type {} code {} (origin {}, errno {}) from {} for a datagram to {to}",
            e.ee_type,
            e.ee_code,
            e.ee_origin,
            e.ee_errno,
            from.as_deref().unwrap_or("?"),
        ));
    }
    None
}

fn resolve_target(target: &str, family: Option<Family>) -> Result<SocketAddr> {
    let sa: SocketAddr = target
        .parse()
        .with_context(|| format!("--target {target:?} is not IP:PORT or [IPv6]:PORT"))?;
    Ok(match (family, sa.ip()) {
        (None, _) | (Some(Family::V4), IpAddr::V4(_)) | (Some(Family::V6), IpAddr::V6(_)) => sa,
        (Some(Family::V4mapped), IpAddr::V4(v4)) => {
            SocketAddr::new(IpAddr::V6(v4.to_ipv6_mapped()), sa.port())
        }
        (Some(f), _) => bail!("--family {f:?} does not fit the target {target}"),
    })
}

fn client(a: ClientArgs) -> Result<()> {
    if a.source_port.is_some() && !matches!(a.proto, Proto::Tcp) {
        bail!("--source-port: TCP only");
    }
    let target = resolve_target(&a.at.target, a.family)?;
    a.at.enter()?;
    if let Some(cpu) = a.cpu {
        integration_tests::tcpflow::pin_to_cpu(cpu).with_context(|| format!("--cpu {cpu}"))?;
    }
    let timeout = Duration::from_millis(a.timeout_ms.max(1));
    let mut out = BufWriter::new(io::stdout().lock());
    let began = Instant::now();
    let stop = (a.duration_ms > 0).then(|| began + Duration::from_millis(a.duration_ms));
    for i in 0..a.count {
        if stop.is_some_and(|t| Instant::now() >= t) {
            break;
        }
        if a.interval_us > 0 {
            let due = began + Duration::from_micros(a.interval_us) * i as u32;
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
        }
        let start = Instant::now();
        let start_ns = a.timestamps.then(integration_tests::probe::monotonic_ns);
        let r = match a.proto {
            Proto::Tcp => tcp_once(target, timeout, a.source_port),
            Proto::Udp => udp_once(target, timeout, false),
            Proto::UdpConnected => udp_once(target, timeout, true),
            Proto::Sctp => sctp_once(target, timeout),
        };
        let end_ns = a.timestamps.then(integration_tests::probe::monotonic_ns);
        let elapsed_ms = (start.elapsed().as_secs_f64() * 1000.0 * 1000.0).round() / 1000.0;
        let mut attempt = match r {
            Ok(ans) => Attempt {
                elapsed_ms,
                ..answered(&ans.reply, ans.peer, ans.source)
            },
            Err((stage, e)) => Attempt {
                ok: false,
                error: Some(errno_name(&e, stage)),
                stage: Some(stage.to_string()),
                detail: ERROR_DETAIL.take(),
                elapsed_ms,
                ..Default::default()
            },
        };
        (attempt.start_ns, attempt.end_ns) = (start_ns, end_ns);
        serde_json::to_writer(&mut out, &attempt)?;
        out.write_all(b"\n")?;
    }
    out.flush()?;
    Ok(())
}

// ---------------------------------------------------------------- hold-udp

/// `NAME[:PORT][ from IP]`: the name, the port and the address the server saw.
fn split_reply(reply: &str) -> (String, Option<u16>, Option<String>) {
    let (main, seen) = match reply.split_once(" from ") {
        Some((m, ip)) => (m, Some(ip.to_string())),
        None => (reply, None),
    };
    match main.rsplit_once(':') {
        Some((name, port)) if port.parse::<u16>().is_ok() => {
            (name.to_string(), port.parse().ok(), seen)
        }
        _ => (main.to_string(), None, seen),
    }
}

/// A reply as an [`Attempt`]: the backend (up to a `:PORT`) and the reply.
fn answered(reply: &str, peer: SocketAddr, source: Option<SocketAddr>) -> Attempt {
    let reply = reply.trim().to_string();
    let (backend, port, seen_from) = split_reply(&reply);
    Attempt {
        ok: true,
        backend: Some(backend),
        backend_port: port,
        seen_from,
        reply: Some(reply),
        peer: Some(peer.to_string()),
        source: source.map(|s| s.to_string()),
        ..Default::default()
    }
}

fn ms_since(t: Instant) -> f64 {
    (t.elapsed().as_secs_f64() * 1000.0 * 1000.0).round() / 1000.0
}

/// One JSON line per event, flushed at once: a reply (`ok`, `backend`,
/// `peer` = getpeername, `source` = recvfrom source) or an error (`stage`
/// `socket`, `connect`, `send` or `recv`; a missing reply is `ETIMEDOUT`).
/// `elapsed_ms` is the time since the start. After an error the socket is
/// replaced by a new one, connected again.
fn hold_udp(a: HoldUdpArgs) -> Result<()> {
    let target = resolve_target(&a.at.target, None)?;
    a.at.enter()?;
    let began = Instant::now();
    let end = began + Duration::from_millis(a.duration_ms);
    let interval = Duration::from_millis(a.interval_ms.max(1));
    let mut out = io::stdout().lock();
    let mut report = |mut at: Attempt| -> Result<()> {
        at.elapsed_ms = ms_since(began);
        serde_json::to_writer(&mut out, &at)?;
        out.write_all(b"\n")?;
        out.flush()?;
        Ok(())
    };
    let fail = |stage: &str, e: &io::Error| Attempt {
        ok: false,
        error: Some(errno_name(e, stage)),
        stage: Some(stage.to_string()),
        ..Default::default()
    };
    let connect = || -> Step<(UdpSocket, SocketAddr)> {
        let s = at("socket", UdpSocket::bind(unspecified(target)))?;
        at("connect", s.connect(target))?;
        let peer = at("connect", peer_connected(&s))?;
        Ok((s, peer))
    };
    let mut sock: Option<(UdpSocket, SocketAddr)> = None;
    let mut buf = [0u8; 2048];
    while Instant::now() < end {
        let (s, peer) = match sock.take() {
            Some(x) => x,
            None => match connect() {
                Ok(x) => x,
                Err((stage, e)) => {
                    report(fail(stage, &e))?;
                    std::thread::sleep(interval);
                    continue;
                }
            },
        };
        let due = Instant::now() + interval;
        if let Err(e) = send_connected(&s, b"ping") {
            report(fail("send", &e))?;
            continue;
        }
        // Wait in recv() until the next send is due, so that an error on
        // the socket shows up there.
        let mut got = false;
        let mut broken = false;
        loop {
            let left = due.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            s.set_read_timeout(Some(left))?;
            match s.recv_from(&mut buf) {
                Ok((n, src)) => {
                    got = true;
                    report(answered(
                        &String::from_utf8_lossy(&buf[..n]),
                        peer,
                        Some(src),
                    ))?;
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    break
                }
                Err(e) => {
                    report(fail("recv", &e))?;
                    broken = true;
                    break;
                }
            }
        }
        if broken {
            continue;
        }
        if !got {
            report(fail("recv", &io::Error::from_raw_os_error(libc::ETIMEDOUT)))?;
        }
        sock = Some((s, peer));
    }
    Ok(())
}

// ---------------------------------------------------------------- flows

/// For each line on stdin, one round: each socket in turn sends a datagram
/// to the target and waits for the answer. Prints
/// `{"round":N,"backends":["b1",null,...]}` (null: no answer).
fn flows(a: FlowsArgs) -> Result<()> {
    let target = resolve_target(&a.at.target, None)?;
    a.at.enter()?;
    let timeout = Duration::from_millis(a.timeout_ms.max(1));
    let socks: Vec<UdpSocket> = (0..a.sockets)
        .map(|_| {
            let s = UdpSocket::bind(unspecified(target))?;
            s.set_read_timeout(Some(timeout))?;
            Ok(s)
        })
        .collect::<io::Result<_>>()
        .context("making the sockets")?;
    let mut buf = [0u8; 2048];
    let mut out = io::stdout().lock();
    for (round, line) in io::stdin().lines().enumerate() {
        line?;
        let mut backends = Vec::with_capacity(socks.len());
        for s in &socks {
            let name = s
                .send_to(b"ping", target)
                .and_then(|_| s.recv_from(&mut buf))
                .ok()
                .map(|(n, _)| {
                    let r = String::from_utf8_lossy(&buf[..n]).trim().to_string();
                    r.split(':').next().unwrap_or("").to_string()
                });
            backends.push(name);
        }
        let line = serde_json::json!({"round": round, "backends": backends});
        writeln!(out, "{line}")?;
        out.flush()?;
    }
    Ok(())
}

// ---------------------------------------------------------------- tcp flows

fn tcp_client(a: TcpClientArgs) -> Result<()> {
    use integration_tests::tcpflow::{client_conn, pin_to_cpu, Request, Up};
    let target = resolve_target(&a.at.target, None)?;
    if let Some(c) = a.cpu {
        pin_to_cpu(c).with_context(|| format!("pinning to CPU {c}"))?;
    }
    a.at.enter()?;
    let t0 = Instant::now();
    let mut out = io::stdout().lock();
    let rounds = a.rounds.clamp(1, 100_000);
    for r in 0..rounds {
        if a.until_ms > 0 && t0.elapsed() >= Duration::from_millis(a.until_ms) {
            break;
        }
        if a.interval_ms > 0 {
            let due = t0 + Duration::from_millis(a.interval_ms) * r;
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
        }
        let id = if rounds > 1 {
            format!("{}.{r}", a.id)
        } else {
            a.id.clone()
        };
        let (req, up) = match a.mode {
            TcpMode::Bulk => (
                Request {
                    id,
                    down_bytes: a.down_bytes,
                    ..Default::default()
                },
                Up::Bytes(a.up_bytes),
            ),
            TcpMode::Stream => (
                Request {
                    id,
                    down_ms: a.duration_ms,
                    ..Default::default()
                },
                Up::ForMs(a.duration_ms),
            ),
            TcpMode::HalfClose => (
                Request {
                    id,
                    after_fin_chunks: a.chunks,
                    chunk: a.chunk,
                    gap_ms: a.gap_ms,
                    ..Default::default()
                },
                Up::Bytes(a.up_bytes),
            ),
            TcpMode::Crr => (
                Request {
                    id,
                    down_bytes: a.down_bytes,
                    ..Default::default()
                },
                Up::Bytes(a.up_bytes),
            ),
        };
        let rep = client_conn(
            target,
            &req,
            up,
            Duration::from_millis(a.connect_timeout_ms.max(1)),
            Duration::from_millis(a.stall_ms.max(1)),
            t0,
        );
        serde_json::to_writer(&mut out, &rep)?;
        out.write_all(b"\n")?;
        out.flush()?;
    }
    Ok(())
}

fn tcp_flows(a: TcpFlowsArgs) -> Result<()> {
    use integration_tests::tcpflow::{EchoFlow, RawSender, Sniffer};
    let target = resolve_target(&a.at.target, None)?;
    a.at.enter()?;
    let timeout = Duration::from_millis(a.timeout_ms.max(1));
    let mut flows: Vec<EchoFlow> = (0..a.sockets.min(1000))
        .map(|k| EchoFlow::open(target, a.from_port, format!("{}-{k}", a.id), timeout))
        .collect();
    let mut out = io::stdout().lock();
    let mut print =
        |event: &str, states: Vec<integration_tests::tcpflow::FlowState>| -> Result<()> {
            writeln!(
                out,
                "{}",
                serde_json::json!({"event": event, "flows": states})
            )?;
            out.flush()?;
            Ok(())
        };
    print("open", flows.iter().map(|f| f.state(true)).collect())?;
    let mut lines = io::stdin().lines();
    loop {
        let cmd = match lines.next() {
            Some(l) => l?.trim().to_string(),
            None => "close".to_string(),
        };
        match cmd.as_str() {
            "ping" => {
                let st = flows
                    .iter_mut()
                    .map(|f| {
                        let ok = f.ping(1000);
                        f.state(ok)
                    })
                    .collect();
                print("ping", st)?;
            }
            "rst" => {
                let sniffer = Sniffer::new("eth0").context("AF_PACKET socket on eth0")?;
                let raw = RawSender::new().context("raw socket")?;
                if let SocketAddr::V4(t) = target {
                    integration_tests::tcpflow::refuse_unsafe(*t.ip())?;
                }
                let st = flows
                    .iter_mut()
                    .map(|f| f.bad_rst(&sniffer, &raw, a.rst_copies))
                    .collect();
                print("rst", st)?;
            }
            "close" => {
                let st = flows
                    .iter_mut()
                    .map(|f| {
                        let ok = f.close();
                        f.state(ok)
                    })
                    .collect();
                print("close", st)?;
                return Ok(());
            }
            other => bail!("unknown command {other:?}: ping, rst or close"),
        }
    }
}

fn hold_tcp(a: HoldTcpArgs) -> Result<()> {
    let target = resolve_target(&a.at.target, None)?;
    a.at.enter()?;
    // Each connection with the backend name it read, if asked to.
    let mut conns: Vec<(io::Result<TcpStream>, Option<String>)> = (0..a.sockets.min(10_000))
        .map(|_| {
            let c = TcpStream::connect_timeout(&target, Duration::from_secs(2));
            let name = match (&c, a.read_name) {
                (Ok(s), true) => read_name(s),
                _ => None,
            };
            (c, name)
        })
        .collect();
    let peers: Vec<serde_json::Value> = conns
        .iter()
        .map(|(c, name)| {
            match c
                .as_ref()
                .map_err(|e| errno_name(e, "connect"))
                .and_then(|s| s.peer_addr().map_err(|e| errno_name(&e, "getpeername")))
            {
                Ok(peer) => serde_json::json!({
                    "peer": integration_tests::probe::unmap(peer).to_string(),
                    "backend": name,
                }),
                Err(e) => serde_json::json!({ "error": e }),
            }
        })
        .collect();
    println!("{}", serde_json::json!({ "sockets": peers }));
    io::stdout().flush()?;
    // `close-to NAME` closes the connections to backend NAME and goes on;
    // anything else (or EOF) closes them all.
    let mut line = String::new();
    loop {
        line.clear();
        let _ = io::stdin().read_line(&mut line);
        let Some(name) = line.trim().strip_prefix("close-to ") else {
            break;
        };
        let before = conns.len();
        conns.retain(|(c, n)| !(c.is_ok() && n.as_deref() == Some(name)));
        println!("{}", serde_json::json!({ "closed": before - conns.len() }));
        io::stdout().flush()?;
    }
    let n = conns.iter().filter(|(c, _)| c.is_ok()).count();
    drop(conns);
    println!("{}", serde_json::json!({ "closed": n }));
    Ok(())
}

/// The first line a connection's server wrote, up to a `:` or space (the
/// name `serve` answers with), within two seconds.
fn read_name(s: &TcpStream) -> Option<String> {
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let mut buf = [0u8; 256];
    let mut got = Vec::new();
    let mut reader = s;
    while !got.contains(&b'\n') {
        match io::Read::read(&mut reader, &mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    let text = String::from_utf8_lossy(&got);
    let name = text.split(['\n', ':', ' ']).next()?.trim();
    (!name.is_empty()).then(|| name.to_string())
}

fn rst_watch(a: RstWatchArgs) -> Result<()> {
    use integration_tests::tcpflow::{RstClassifier, Sniffer};
    use std::sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    };
    integration_tests::netns::enter(None, Some(&a.netns))?;
    let sniffer =
        Sniffer::tcp_control(&a.dev).with_context(|| format!("AF_PACKET socket on {}", a.dev))?;
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = io::stdin().read_line(&mut line);
            stop.store(true, Ordering::Relaxed);
        });
    }
    println!("{}", serde_json::json!({ "ready": true }));
    io::stdout().flush()?;
    let mut rsts = RstClassifier::default();
    let mut buf = vec![0u8; 65_536];
    // Packets already queued when the stop comes are read too: the
    // sniffer's 100 ms timeout ends the loop once it is idle (or 2 s on).
    let mut stopped: Option<Instant> = None;
    loop {
        let got = sniffer.next(&mut buf);
        if let Some((n, outgoing)) = got {
            rsts.packet(&buf[..n], outgoing);
        }
        if stop.load(Ordering::Relaxed) {
            let at = *stopped.get_or_insert_with(Instant::now);
            if got.is_none() || at.elapsed() > Duration::from_secs(2) {
                break;
            }
        }
    }
    println!(
        "{}",
        serde_json::json!({ "after_close": rsts.after_close, "other": rsts.other })
    );
    Ok(())
}

fn syn_flood(a: SynFloodArgs) -> Result<()> {
    let target = resolve_target(&a.at.target, None)?;
    let (base, len) = a.sources.split_once('/').context("--sources: ADDR/LEN")?;
    let base: std::net::Ipv4Addr = base.parse().context("--sources address")?;
    let len: u8 = len.parse().context("--sources length")?;
    a.at.enter()?;
    let began = Instant::now();
    let (sent, errors) = integration_tests::tcpflow::syn_flood(
        target,
        base,
        len,
        a.count,
        Duration::from_millis(a.duration_ms),
    )?;
    println!(
        "{}",
        serde_json::json!({"sent": sent, "errors": errors, "ms": began.elapsed().as_millis() as u64})
    );
    Ok(())
}
