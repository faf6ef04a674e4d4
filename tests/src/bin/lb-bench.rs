//! `lb-bench`: the benchmark's own load client and echo server (no netperf
//! here). Raw std sockets and a few `setsockopt`s, one connection at a time,
//! each run bounded in time and in count.
//!
//! ```text
//! lb-bench server --netns NS --cpu 1 --port 8080
//!     TCP: per connection, echo every read back until EOF/RST; a request
//!     starting with `WHO` is answered with the local address it reached.
//!     UDP: echo every datagram.
//!     TCP on port + 1: greets every connection with the local address it
//!     reached and holds it open (the schedulers' spread runs).
//! lb-bench client --netns NS [--cgroup DIR] --cpu 0 --target IP:PORT \
//!     --mode cc|crr|rr|udp --duration-ms 2000 [--max-ops N] [--timeout-ms 1000]
//!     One JSON line: {"mode":..,"ops":..,"errors":..,"elapsed_s":..,"rate":..,
//!     "p50_us":..,"p99_us":..,"p999_us":..,"first_error":..}
//! lb-bench client ... --mode until --expect IP:PORT
//!     Repeats WHO transactions; prints `{"ready":T}` (CLOCK_MONOTONIC ns)
//!     after the first reply, then `{"changed":T,"attempts":N}` at the first
//!     reply naming --expect.
//! lb-bench client ... --mode hold --open N --backends B --max-ops STEPS
//!     Opens N connections to the first target (a greeting server: the
//!     server's port + 1), then per step closes one at random and opens
//!     another (STEPS steps, bounded by the duration); each connection's
//!     backend is what the greeting names. One JSON line:
//!     {"steps":..,"open":..,"backends":{ADDR:open at the end},
//!      "mean_ratio":..,"p99_ratio":..,"max_ratio":..,"errors":..}
//!     where a ratio is the largest backend's open connections over the
//!     mean (N / B), after every open of the steps.
//! ```
//!
//! Modes: `cc` connect then close with SO_LINGER 0 (RST, no TIME_WAIT; the
//! latency is connect()'s); `crr` connect, 64-byte request, response, close
//! (TCP_CRR); `rr` request/response on one connection (a control); `udp`
//! request/response on one unconnected UDP socket, `sendto` the target each
//! time.
use std::{
    io::{self, Read as _, Write as _},
    mem,
    net::{SocketAddr, SocketAddrV4, TcpListener, TcpStream, UdpSocket},
    os::fd::{AsRawFd as _, FromRawFd as _, RawFd},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use clap::{Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(about = "Benchmark load client and echo server")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    Server {
        #[arg(long)]
        netns: Option<String>,
        #[arg(long)]
        cpu: Option<usize>,
        #[arg(long, default_value_t = 8080)]
        port: u16,
    },
    Client {
        #[arg(long)]
        netns: Option<String>,
        #[arg(long)]
        cgroup: Option<PathBuf>,
        #[arg(long)]
        cpu: Option<usize>,
        /// Repeatable: cc and crr pick one at random for every connection
        /// (the direct arm spreads over the endpoints as a load balancer
        /// would); rr, udp and until use the first.
        #[arg(long, required = true)]
        target: Vec<SocketAddrV4>,
        #[arg(long, value_enum)]
        mode: Mode,
        #[arg(long, default_value_t = 2000)]
        duration_ms: u64,
        #[arg(long, default_value_t = 2_000_000)]
        max_ops: u64,
        #[arg(long, default_value_t = 1000)]
        timeout_ms: u64,
        /// `until` mode: the backend address whose reply ends the run.
        #[arg(long)]
        expect: Option<SocketAddrV4>,
        /// `hold` mode: connections held open at once.
        #[arg(long, default_value_t = 100)]
        open: usize,
        /// `hold` mode: the Service's backends (the mean's divisor).
        #[arg(long, default_value_t = 1)]
        backends: usize,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
enum Mode {
    Cc,
    Crr,
    Rr,
    Udp,
    Until,
    Hold,
    /// Opens `--open` connections, prints which backends hold them, and
    /// keeps them open for the duration (the schedulers' cost runs, with
    /// every backend busy).
    Keep,
}

const REQUEST: [u8; 64] = [b'x'; 64];

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Server { netns, cpu, port } => {
            enter(None, netns.as_deref(), cpu)?;
            server(port)
        }
        Cmd::Client {
            netns,
            cgroup,
            cpu,
            target,
            mode,
            duration_ms,
            max_ops,
            timeout_ms,
            expect,
            open,
            backends,
        } => {
            enter(cgroup.as_deref(), netns.as_deref(), cpu)?;
            let limits = Limits {
                duration: Duration::from_millis(duration_ms),
                max_ops,
                timeout: Duration::from_millis(timeout_ms),
            };
            if mode == Mode::Until {
                let expect = expect.context("--mode until needs --expect")?;
                return until(target[0], expect, &limits);
            }
            if mode == Mode::Keep {
                return keep(target[0], open, &limits);
            }
            if mode == Mode::Hold {
                let r = hold(target[0], open, backends, &limits);
                println!("{}", serde_json::to_string(&r)?);
                return Ok(());
            }
            let r = client(mode, &target, &limits);
            println!("{}", serde_json::to_string(&r)?);
            Ok(())
        }
    }
}

/// Joins the cgroup (before anything else, so every socket is subject to its
/// programs), enters the network namespace, pins the process to one core.
fn enter(cgroup: Option<&Path>, netns: Option<&str>, cpu: Option<usize>) -> Result<()> {
    // Only this thread moves, and the server starts its threads after this.
    integration_tests::netns::enter(cgroup, netns)?;
    if let Some(cpu) = cpu {
        // SAFETY: a zeroed cpu_set_t is valid; CPU_SET writes inside it.
        unsafe {
            let mut set: libc::cpu_set_t = mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            if libc::sched_setaffinity(0, mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                bail!(
                    "sched_setaffinity(cpu {cpu}): {}",
                    io::Error::last_os_error()
                );
            }
        }
    }
    Ok(())
}

fn server(port: u16) -> Result<()> {
    let tcp = TcpListener::bind(("0.0.0.0", port)).with_context(|| format!("TCP :{port}"))?;
    // std's backlog is 128; a connect+close burst wants the kernel maximum.
    // SAFETY: listen on a socket we own.
    unsafe { libc::listen(tcp.as_raw_fd(), 4096) };
    let udp = UdpSocket::bind(("0.0.0.0", port)).with_context(|| format!("UDP :{port}"))?;
    let greet =
        TcpListener::bind(("0.0.0.0", port + 1)).with_context(|| format!("TCP :{}", port + 1))?;
    // SAFETY: listen on a socket we own.
    unsafe { libc::listen(greet.as_raw_fd(), 4096) };
    std::thread::spawn(move || greeter(greet));
    println!("{{\"listening\":{port}}}");
    io::stdout().flush()?;
    std::thread::spawn(move || {
        let mut buf = [0u8; 2048];
        loop {
            if let Ok((n, from)) = udp.recv_from(&mut buf) {
                let _ = udp.send_to(&buf[..n], from);
            }
        }
    });
    let mut buf = [0u8; 4096];
    loop {
        let Ok((mut s, _)) = tcp.accept() else {
            continue;
        };
        // A client that vanished must not wedge the (single) accept loop.
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let _ = s.set_nodelay(true);
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let reply: Vec<u8>;
                    let out = if buf[..n].starts_with(b"WHO") {
                        reply = match s.local_addr() {
                            Ok(a) => a.to_string().into_bytes(),
                            Err(_) => b"?".to_vec(),
                        };
                        &reply[..]
                    } else {
                        &buf[..n]
                    };
                    if s.write_all(out).is_err() {
                        break;
                    }
                }
            }
        }
    }
}

/// Greets each connection with the local address it reached and keeps it
/// open, the newest 8192 at most (a client's close ends its own side).
fn greeter(l: TcpListener) {
    let mut held = std::collections::VecDeque::new();
    loop {
        let Ok((mut s, _)) = l.accept() else {
            continue;
        };
        let who = s.local_addr().map_or("?".into(), |a| a.to_string());
        let _ = s.set_write_timeout(Some(Duration::from_millis(200)));
        if s.write_all(who.as_bytes()).is_ok() {
            held.push_back(s);
            if held.len() > 8192 {
                held.pop_front();
            }
        }
    }
}

struct Limits {
    duration: Duration,
    max_ops: u64,
    timeout: Duration,
}

#[derive(serde::Serialize, Default)]
struct Report {
    mode: String,
    ops: u64,
    errors: u64,
    elapsed_s: f64,
    /// Successful operations per second.
    rate: f64,
    p50_us: f64,
    p99_us: f64,
    p999_us: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    first_error: Option<String>,
}

fn sockaddr(a: SocketAddrV4) -> libc::sockaddr_in {
    // SAFETY: all-zero is a valid sockaddr_in.
    let mut sa: libc::sockaddr_in = unsafe { mem::zeroed() };
    sa.sin_family = libc::AF_INET as libc::sa_family_t;
    sa.sin_port = a.port().to_be();
    sa.sin_addr.s_addr = u32::from_ne_bytes(a.ip().octets());
    sa
}

fn setopt<T>(fd: RawFd, level: i32, name: i32, v: &T) -> io::Result<()> {
    // SAFETY: `v` is a live value of the option's type and size.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            v as *const T as *const libc::c_void,
            mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn timeval(d: Duration) -> libc::timeval {
    libc::timeval {
        tv_sec: d.as_secs() as libc::time_t,
        tv_usec: d.subsec_micros() as libc::suseconds_t,
    }
}

/// A TCP socket with SO_LINGER 0 (close sends RST) and send/receive
/// timeouts (SO_SNDTIMEO also bounds connect), connected to `target`.
fn connect(target: &libc::sockaddr_in, timeout: Duration) -> io::Result<TcpStream> {
    // SAFETY: plain socket(2); the fd is owned by the TcpStream below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh socket we own.
    let stream = unsafe { TcpStream::from_raw_fd(fd) };
    setopt(
        fd,
        libc::SOL_SOCKET,
        libc::SO_LINGER,
        &libc::linger {
            l_onoff: 1,
            l_linger: 0,
        },
    )?;
    let tv = timeval(timeout);
    setopt(fd, libc::SOL_SOCKET, libc::SO_SNDTIMEO, &tv)?;
    setopt(fd, libc::SOL_SOCKET, libc::SO_RCVTIMEO, &tv)?;
    setopt(fd, libc::IPPROTO_TCP, libc::TCP_NODELAY, &1i32)?;
    // SAFETY: target is a valid sockaddr_in of the size given.
    let rc = unsafe {
        libc::connect(
            fd,
            target as *const libc::sockaddr_in as *const libc::sockaddr,
            mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(stream)
}

fn transact(s: &mut TcpStream, req: &[u8], buf: &mut [u8]) -> io::Result<usize> {
    s.write_all(req)?;
    let n = s.read(buf)?;
    if n == 0 {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed"));
    }
    Ok(n)
}

fn percentile(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i] as f64 / 1e3
}

/// Counts error `e` of `stage`; the first one is kept.
fn fail(report: &mut Report, e: io::Error, stage: &str) {
    report.errors += 1;
    if report.first_error.is_none() {
        report.first_error = Some(format!("{stage}: {e}"));
    }
}

/// One operation begun at `t0`: its latency, or its error (of `stage`);
/// whether it succeeded.
fn record<T>(
    r: io::Result<T>,
    t0: Instant,
    stage: &str,
    lat: &mut Vec<u32>,
    report: &mut Report,
) -> bool {
    match r {
        Ok(_) => {
            lat.push(t0.elapsed().as_nanos() as u32);
            true
        }
        Err(e) => {
            fail(report, e, stage);
            false
        }
    }
}

fn client(mode: Mode, targets: &[SocketAddrV4], lim: &Limits) -> Report {
    let target = targets[0];
    let addrs: Vec<libc::sockaddr_in> = targets.iter().map(|t| sockaddr(*t)).collect();
    let mut rng: u32 = 0x9E37_79B9 ^ std::process::id();
    let mut pick = move || {
        rng ^= rng << 13;
        rng ^= rng >> 17;
        rng ^= rng << 5;
        addrs[rng as usize % addrs.len()]
    };
    let sa = sockaddr(target);
    let mut lat: Vec<u32> = Vec::with_capacity(lim.max_ops.min(1 << 21) as usize);
    let mut report = Report {
        mode: format!("{mode:?}").to_lowercase(),
        ..Default::default()
    };
    let mut buf = [0u8; 2048];
    // rr and udp keep one socket for the whole run.
    let mut rr = None;
    let mut udp = None;
    match mode {
        Mode::Rr => match connect(&sa, lim.timeout) {
            Ok(s) => rr = Some(s),
            Err(e) => fail(&mut report, e, "connect"),
        },
        Mode::Udp => match UdpSocket::bind("0.0.0.0:0") {
            Ok(s) => {
                let _ = s.set_read_timeout(Some(lim.timeout.min(Duration::from_millis(200))));
                udp = Some(s);
            }
            Err(e) => fail(&mut report, e, "socket"),
        },
        _ => {}
    }
    let start = Instant::now();
    let deadline = start + lim.duration;
    let mut n: u64 = 0;
    while n < lim.max_ops {
        let t0 = Instant::now();
        if t0 >= deadline || report.errors > 1000 {
            break;
        }
        n += 1;
        let ok = match mode {
            Mode::Cc => match connect(&pick(), lim.timeout) {
                Ok(s) => {
                    lat.push(t0.elapsed().as_nanos() as u32);
                    drop(s);
                    true
                }
                Err(e) => {
                    fail(&mut report, e, "connect");
                    false
                }
            },
            Mode::Crr => record(
                connect(&pick(), lim.timeout)
                    .and_then(|mut s| transact(&mut s, &REQUEST, &mut buf)),
                t0,
                "crr",
                &mut lat,
                &mut report,
            ),
            Mode::Rr => {
                let Some(s) = rr.as_mut() else { break };
                let r = transact(s, &REQUEST, &mut buf);
                if !record(r, t0, "rr", &mut lat, &mut report) {
                    break;
                }
                true
            }
            Mode::Udp => {
                let Some(s) = udp.as_ref() else { break };
                let r = s
                    .send_to(&REQUEST, SocketAddr::V4(target))
                    .and_then(|_| s.recv_from(&mut buf));
                record(r, t0, "udp", &mut lat, &mut report)
            }
            Mode::Until | Mode::Hold | Mode::Keep => unreachable!(),
        };
        if ok {
            report.ops += 1;
        }
    }
    report.elapsed_s = start.elapsed().as_secs_f64();
    report.rate = report.ops as f64 / report.elapsed_s.max(1e-9);
    lat.sort_unstable();
    report.p50_us = percentile(&lat, 0.50);
    report.p99_us = percentile(&lat, 0.99);
    report.p999_us = percentile(&lat, 0.999);
    report
}

fn monotonic_ns() -> u64 {
    // SAFETY: clock_gettime writes the timespec we pass.
    let mut ts: libc::timespec = unsafe { mem::zeroed() };
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// WHO transactions, each on a fresh connection, until one is answered by
/// `expect`; bounded by the duration and the count.
fn until(target: SocketAddrV4, expect: SocketAddrV4, lim: &Limits) -> Result<()> {
    let sa = sockaddr(target);
    let want = expect.to_string();
    let mut buf = [0u8; 256];
    let start = Instant::now();
    let mut announced = false;
    let mut attempts = 0u64;
    while start.elapsed() < lim.duration && attempts < lim.max_ops {
        attempts += 1;
        let reply = connect(&sa, lim.timeout)
            .and_then(|mut s| transact(&mut s, b"WHO", &mut buf).map(|n| buf[..n].to_vec()));
        let now = monotonic_ns();
        let Ok(reply) = reply else { continue };
        if String::from_utf8_lossy(&reply) == want {
            if !announced {
                println!("{{\"ready\":{now}}}");
            }
            println!("{{\"changed\":{now},\"attempts\":{attempts}}}");
            return Ok(());
        }
        if !announced {
            announced = true;
            println!("{{\"ready\":{now}}}");
            io::stdout().flush()?;
        }
    }
    bail!(
        "no reply from {want} within {:?} ({attempts} attempts)",
        lim.duration
    )
}

#[derive(serde::Serialize, Default)]
struct HoldReport {
    steps: u64,
    open: usize,
    /// Open connections per backend at the end.
    backends: std::collections::BTreeMap<String, usize>,
    /// The largest backend's open connections over the mean, after each
    /// open of the steps: their mean, 99th percentile and largest.
    mean_ratio: f64,
    p99_ratio: f64,
    max_ratio: f64,
    errors: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    first_error: Option<String>,
}

/// A connection to `sa` and the backend its greeting names (getpeername
/// would answer the Service address).
fn greeted(sa: &libc::sockaddr_in, timeout: Duration) -> io::Result<(TcpStream, SocketAddrV4)> {
    let mut s = connect(sa, timeout)?;
    let mut buf = [0u8; 64];
    let n = s.read(&mut buf)?;
    let backend = std::str::from_utf8(&buf[..n])
        .ok()
        .and_then(|t| t.parse::<SocketAddrV4>().ok())
        .ok_or_else(|| io::Error::other(format!("greeting {:?}", &buf[..n])))?;
    Ok((s, backend))
}

/// `hold` mode: `open` connections held to `target`, then each step closes
/// one at random (RST) and opens another; the balance of open connections
/// over `backends` after each open.
/// `keep` mode: `open` connections to `target`, then one JSON line (the
/// connections per backend, by greeting), then held for the duration.
fn keep(target: SocketAddrV4, open: usize, lim: &Limits) -> Result<()> {
    let sa = sockaddr(target);
    let mut held = Vec::with_capacity(open);
    let mut per: std::collections::BTreeMap<String, usize> = Default::default();
    for _ in 0..open {
        let (s, b) = greeted(&sa, lim.timeout).context("keep: connect")?;
        *per.entry(b.to_string()).or_default() += 1;
        held.push(s);
    }
    println!("{}", serde_json::to_string(&per)?);
    io::Write::flush(&mut io::stdout())?;
    std::thread::sleep(lim.duration);
    drop(held);
    Ok(())
}

fn hold(target: SocketAddrV4, open: usize, backends: usize, lim: &Limits) -> HoldReport {
    let sa = sockaddr(target);
    let mut rng: u64 = 0x9E37_79B9_7F4A_7C15 ^ monotonic_ns();
    let mut report = HoldReport {
        open,
        ..Default::default()
    };
    let mut held: Vec<(TcpStream, SocketAddrV4)> = Vec::with_capacity(open);
    let mut per: std::collections::BTreeMap<SocketAddrV4, usize> = Default::default();
    let mut ratios: Vec<f64> = Vec::new();
    let start = Instant::now();
    let going = |r: &HoldReport| r.errors < 100 && start.elapsed() < lim.duration;
    while report.steps < lim.max_ops && going(&report) {
        let filling = held.len() < open;
        if !filling {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let (s, b) = held.swap_remove((rng % held.len() as u64) as usize);
            drop(s);
            if let Some(n) = per.get_mut(&b) {
                *n -= 1;
            }
            report.steps += 1;
        }
        match greeted(&sa, lim.timeout) {
            Ok((s, b)) => {
                *per.entry(b).or_default() += 1;
                held.push((s, b));
                if !filling {
                    // Every backend counts, also one never chosen.
                    let mean = held.len() as f64 / per.len().max(backends) as f64;
                    let max = per.values().copied().max().unwrap_or(0) as f64;
                    ratios.push(max / mean);
                }
            }
            Err(e) => {
                report.errors += 1;
                report
                    .first_error
                    .get_or_insert_with(|| format!("connect: {e}"));
            }
        }
    }
    ratios.sort_by(f64::total_cmp);
    let at = |q: f64| {
        let i = ((ratios.len() as f64 * q) as usize).min(ratios.len().saturating_sub(1));
        ratios.get(i).copied().unwrap_or(f64::NAN)
    };
    report.mean_ratio = ratios.iter().sum::<f64>() / ratios.len().max(1) as f64;
    report.p99_ratio = at(0.99);
    report.max_ratio = ratios.last().copied().unwrap_or(f64::NAN);
    report.backends = per.iter().map(|(b, n)| (b.to_string(), *n)).collect();
    report
}
