//! Long-lived TCP flows for the tc path's flow tests (`tests/flows.rs`):
//! the protocol and both ends (run by `lb-probe tcp-serve`, `tcp-client`,
//! `tcp-flows`), raw TCP packets (an out-of-window RST on a flow's exact
//! tuple, spoofed SYNs: `lb-probe syn-flood`), and the test side: servers
//! in every pod whose per-connection reports are collected, client
//! processes with a deadline, and the join of both.
//!
//! Protocol: the client sends one JSON [`Request`] line; the server answers
//! `NAME\n` (its identity) and then, depending on the request, echoes, or
//! sends a byte pattern (exactly `down_bytes`, or continuously for
//! `down_ms`, or `after_fin_chunks` chunks after the client's FIN) while it
//! reads and verifies the client's pattern until EOF. Both ends report per
//! connection how many bytes went each way and whether the pattern held,
//! so that a test can check that every connection id reached exactly one
//! backend, that every byte arrived, and that nothing was reset.
//!
//! The pattern is `byte(i) = i mod 251`, counted from the first byte after
//! the request line (up) or after the greeting (down): a missing, repeated
//! or foreign byte shows as a mismatch.
use std::{
    io::{self, BufRead as _, BufReader, Read as _, Write as _},
    net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream},
    sync::{mpsc, Arc, Mutex, OnceLock},
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context as _, Result};
use serde::{Deserialize, Serialize};

/// What the client asks of the server.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Request {
    pub id: String,
    /// Echo every byte back (no pattern check).
    #[serde(default)]
    pub echo: bool,
    /// Send exactly this many bytes.
    #[serde(default)]
    pub down_bytes: u64,
    /// Send continuously for this long (from the request).
    #[serde(default)]
    pub down_ms: u64,
    /// Half-close: once the client's FIN arrived, send this many chunks of
    /// `chunk` bytes, `gap_ms` apart.
    #[serde(default)]
    pub after_fin_chunks: u32,
    #[serde(default)]
    pub chunk: u64,
    #[serde(default)]
    pub gap_ms: u64,
}

/// The server's account of one connection (one JSON line on its stdout).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ServerReport {
    pub id: String,
    pub name: String,
    pub peer: String,
    /// Bytes read after the request line.
    pub recv: u64,
    /// They followed the pattern (always true for echo).
    pub recv_ok: bool,
    /// Bytes written after the greeting.
    pub sent: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub ms: u64,
}

/// The client's account of one connection.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ClientReport {
    pub id: String,
    /// The greeting: which backend answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    pub sent: u64,
    pub recv: u64,
    pub recv_ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage: Option<String>,
    /// When the connection started, since the client process started.
    pub start_ms: u64,
    pub ms: u64,
}

const CHUNK: usize = 64 * 1024;
const PERIOD: usize = 251;

fn table() -> &'static [u8] {
    static T: OnceLock<Vec<u8>> = OnceLock::new();
    T.get_or_init(|| (0..CHUNK + PERIOD).map(|i| (i % PERIOD) as u8).collect())
}

/// `len` (≤ 64 KiB) bytes of the pattern from offset `off`.
pub fn pattern(off: u64, len: usize) -> &'static [u8] {
    let s = (off % PERIOD as u64) as usize;
    &table()[s..s + len.min(CHUNK)]
}

/// An errno-style name for an I/O error (`ETIMEDOUT` for socket timeouts).
pub fn err_name(e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::ECONNRESET) => "ECONNRESET".into(),
        Some(libc::EPIPE) => "EPIPE".into(),
        Some(libc::ECONNREFUSED) => "ECONNREFUSED".into(),
        Some(libc::ETIMEDOUT) | Some(libc::EAGAIN) => "ETIMEDOUT".into(),
        Some(libc::ENETUNREACH) => "ENETUNREACH".into(),
        Some(libc::EHOSTUNREACH) => "EHOSTUNREACH".into(),
        Some(n) => format!("E{n}"),
        None => match e.kind() {
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => "ETIMEDOUT".into(),
            io::ErrorKind::UnexpectedEof => "EOF".into(),
            k => format!("{k:?}"),
        },
    }
}

/// Pins the calling thread (and threads it starts later) to `cpu`.
pub fn pin_to_cpu(cpu: usize) -> io::Result<()> {
    // SAFETY: a zeroed cpu_set_t is empty; CPU_SET stays within it for
    // cpu < CPU_SETSIZE (checked by the kernel call's result otherwise).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

fn ms(t: Instant) -> u64 {
    t.elapsed().as_millis() as u64
}

/// Writes `n` pattern bytes from offset `*off`.
fn write_pattern(s: &mut TcpStream, off: &mut u64, n: u64) -> io::Result<()> {
    let end = *off + n;
    while *off < end {
        let len = ((end - *off) as usize).min(CHUNK);
        s.write_all(pattern(*off, len))?;
        *off += len as u64;
    }
    Ok(())
}

/// Reads until EOF, checking the pattern: (bytes, pattern held, error).
fn read_pattern(r: &mut impl io::Read) -> (u64, bool, Option<io::Error>) {
    let mut buf = vec![0u8; CHUNK];
    let (mut n, mut ok) = (0u64, true);
    loop {
        match r.read(&mut buf) {
            Ok(0) => return (n, ok, None),
            Ok(k) => {
                if ok && buf[..k] != *pattern(n, k) {
                    ok = false;
                }
                n += k as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return (n, ok, Some(e)),
        }
    }
}

// ---------------------------------------------------------------- server

/// `lb-probe tcp-serve`: accepts on `[::]:port` (dual-stack), one thread
/// per connection (pinned round-robin to `cpus`), one [`ServerReport`]
/// line per connection on stdout.
pub fn serve(name: &str, port: u16, cpus: &[usize]) -> Result<()> {
    let l = TcpListener::bind(("::", port)).with_context(|| format!("TCP [::]:{port}"))?;
    // UDP on the same port answers every datagram with the name (the
    // flows of `udp_fill`).
    let u = std::net::UdpSocket::bind(("::", port)).with_context(|| format!("UDP [::]:{port}"))?;
    let reply = name.to_string();
    std::thread::spawn(move || {
        let mut buf = [0u8; 2048];
        while let Ok((_, src)) = u.recv_from(&mut buf) {
            let _ = u.send_to(reply.as_bytes(), src);
        }
    });
    let out = Arc::new(Mutex::new(io::stdout()));
    {
        let mut o = out.lock().unwrap();
        writeln!(
            o,
            "{}",
            serde_json::json!({"listening": true, "name": name, "port": port})
        )?;
        o.flush()?;
    }
    for (n, conn) in l.incoming().enumerate() {
        let s = match conn {
            Ok(s) => s,
            Err(e) => {
                eprintln!("lb-probe tcp-serve: accept: {e}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let (name, out) = (name.to_string(), out.clone());
        let cpu = (!cpus.is_empty()).then(|| cpus[n % cpus.len()]);
        std::thread::spawn(move || {
            if let Some(c) = cpu {
                let _ = pin_to_cpu(c);
            }
            let r = serve_conn(s, &name);
            let mut o = out.lock().unwrap_or_else(|e| e.into_inner());
            let _ = writeln!(o, "{}", serde_json::to_string(&r).unwrap_or_default());
            let _ = o.flush();
        });
    }
    Ok(())
}

fn serve_conn(s: TcpStream, name: &str) -> ServerReport {
    let began = Instant::now();
    let mut rep = ServerReport {
        name: name.into(),
        peer: s.peer_addr().map(|p| p.to_string()).unwrap_or_default(),
        recv_ok: true,
        ..Default::default()
    };
    let fail = |rep: &mut ServerReport, what: &str, e: &io::Error| {
        if rep.error.is_none() {
            rep.error = Some(format!("{what}: {}", err_name(e)));
        }
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(60)));
    let _ = s.set_write_timeout(Some(Duration::from_secs(60)));
    let mut w = match s.try_clone() {
        Ok(w) => w,
        Err(e) => {
            fail(&mut rep, "clone", &e);
            return rep;
        }
    };
    let mut r = BufReader::with_capacity(CHUNK, s);
    let mut line = String::new();
    let req: Request = match r.read_line(&mut line) {
        Ok(_) => match serde_json::from_str(line.trim()) {
            Ok(q) => q,
            Err(e) => {
                rep.error = Some(format!("bad request {line:?}: {e}"));
                return rep;
            }
        },
        Err(e) => {
            fail(&mut rep, "request", &e);
            return rep;
        }
    };
    rep.id = req.id.clone();
    if let Err(e) = w.write_all(format!("{name}\n").as_bytes()) {
        fail(&mut rep, "greeting", &e);
        return rep;
    }
    if req.echo {
        let mut buf = vec![0u8; CHUNK];
        loop {
            match r.read(&mut buf) {
                Ok(0) => break,
                Ok(k) => {
                    rep.recv += k as u64;
                    if let Err(e) = w.write_all(&buf[..k]) {
                        fail(&mut rep, "write", &e);
                        break;
                    }
                    rep.sent += k as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    fail(&mut rep, "read", &e);
                    break;
                }
            }
        }
        let _ = w.shutdown(Shutdown::Write);
        rep.ms = ms(began);
        return rep;
    }
    let (eof_tx, eof_rx) = mpsc::channel::<()>();
    let reader = std::thread::spawn(move || {
        let res = read_pattern(&mut r);
        let _ = eof_tx.send(());
        res
    });
    let mut off = 0u64;
    let wres: io::Result<()> = (|| {
        if req.after_fin_chunks > 0 {
            // Wait for the client's FIN (the reader's EOF), then send late.
            if eof_rx.recv_timeout(Duration::from_secs(120)).is_err() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no FIN from the client",
                ));
            }
            for k in 0..req.after_fin_chunks.min(1000) {
                if k > 0 {
                    std::thread::sleep(Duration::from_millis(req.gap_ms.min(60_000)));
                }
                write_pattern(&mut w, &mut off, req.chunk.min(1 << 24))?;
            }
        } else if req.down_ms > 0 {
            let end = began + Duration::from_millis(req.down_ms.min(120_000));
            while Instant::now() < end {
                write_pattern(&mut w, &mut off, CHUNK as u64)?;
            }
        } else {
            write_pattern(&mut w, &mut off, req.down_bytes.min(1 << 32))?;
        }
        Ok(())
    })();
    rep.sent = off;
    if let Err(e) = &wres {
        fail(&mut rep, "write", e);
    }
    let _ = w.shutdown(Shutdown::Write);
    match reader.join() {
        Ok((n, ok, err)) => {
            rep.recv = n;
            rep.recv_ok = ok;
            if let Some(e) = err {
                fail(&mut rep, "read", &e);
            }
        }
        Err(_) => rep.error = Some("reader panicked".into()),
    }
    rep.ms = ms(began);
    rep
}

// ---------------------------------------------------------------- client

/// What the client sends before its FIN.
#[derive(Debug, Clone, Copy)]
pub enum Up {
    Bytes(u64),
    /// Continuously for this long.
    ForMs(u64),
}

/// One connection: request, upload (then FIN) while reading the greeting
/// and the server's pattern until EOF. `stall` bounds every read and
/// write: a flow that makes no progress for that long is broken.
pub fn client_conn(
    target: SocketAddr,
    req: &Request,
    up: Up,
    connect_timeout: Duration,
    stall: Duration,
    t0: Instant,
) -> ClientReport {
    let began = Instant::now();
    let mut rep = ClientReport {
        id: req.id.clone(),
        start_ms: began.duration_since(t0).as_millis() as u64,
        recv_ok: true,
        ..Default::default()
    };
    let set_err = |rep: &mut ClientReport, stage: &str, e: String| {
        if rep.error.is_none() {
            rep.error = Some(e);
            rep.stage = Some(stage.into());
        }
    };
    let s = match TcpStream::connect_timeout(&target, connect_timeout) {
        Ok(s) => s,
        Err(e) => {
            set_err(&mut rep, "connect", err_name(&e));
            rep.ms = ms(began);
            return rep;
        }
    };
    let _ = s.set_read_timeout(Some(stall));
    let _ = s.set_write_timeout(Some(stall));
    let mut w = match s.try_clone() {
        Ok(w) => w,
        Err(e) => {
            set_err(&mut rep, "socket", err_name(&e));
            return rep;
        }
    };
    let line = format!("{}\n", serde_json::to_string(req).unwrap_or_default());
    let writer = std::thread::spawn(move || -> (u64, Option<io::Error>) {
        if let Err(e) = w.write_all(line.as_bytes()) {
            return (0, Some(e));
        }
        let mut off = 0u64;
        let r = match up {
            Up::Bytes(n) => write_pattern(&mut w, &mut off, n),
            Up::ForMs(d) => {
                let end = Instant::now() + Duration::from_millis(d);
                let mut r = Ok(());
                while r.is_ok() && Instant::now() < end {
                    r = write_pattern(&mut w, &mut off, CHUNK as u64);
                }
                r
            }
        };
        if r.is_ok() {
            let _ = w.shutdown(Shutdown::Write);
        }
        (off, r.err())
    });
    let mut r = BufReader::with_capacity(CHUNK, s);
    let mut greeting = String::new();
    match r.read_line(&mut greeting) {
        Ok(_) if greeting.ends_with('\n') => {
            rep.backend = Some(greeting.trim().to_string());
            let (n, ok, err) = read_pattern(&mut r);
            rep.recv = n;
            rep.recv_ok = ok;
            if let Some(e) = err {
                set_err(&mut rep, "read", err_name(&e));
            }
        }
        Ok(_) => set_err(&mut rep, "greeting", "EOF".into()),
        Err(e) => set_err(&mut rep, "greeting", err_name(&e)),
    }
    if rep.error.is_some() {
        // Unblock the writer.
        let _ = r.get_ref().shutdown(Shutdown::Both);
    }
    match writer.join() {
        Ok((n, err)) => {
            rep.sent = n;
            if let Some(e) = err {
                set_err(&mut rep, "write", err_name(&e));
            }
        }
        Err(_) => set_err(&mut rep, "write", "writer panicked".into()),
    }
    rep.ms = ms(began);
    rep
}

/// One datagram from each of `count` UDP source ports `first_port..` to
/// `target`, each socket closed after its answer (or 50 ms): that many
/// idle UDP flows in the tc path's conntrack, for its full UDP timeout.
/// (sent, answered).
pub fn udp_fill(target: SocketAddr, first_port: u16, count: u16) -> Result<(u32, u32)> {
    let (mut sent, mut answered) = (0, 0);
    let mut buf = [0u8; 256];
    for k in 0..count {
        let port = first_port.checked_add(k).context("port range")?;
        let local: SocketAddr = match target {
            SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, port).into(),
            SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, port).into(),
        };
        let Ok(s) = std::net::UdpSocket::bind(local) else {
            continue;
        };
        s.set_read_timeout(Some(Duration::from_millis(50)))?;
        if s.send_to(b"fill", target).is_ok() {
            sent += 1;
            if s.recv_from(&mut buf).is_ok() {
                answered += 1;
            }
        }
    }
    Ok((sent, answered))
}

// ---------------------------------------------------------------- raw packets

/// The Internet checksum of `data`.
pub fn csum(data: &[u8]) -> u16 {
    let mut sum: u32 = data
        .chunks(2)
        .map(|c| u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]) as u32)
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An IPv4 packet with a 20-byte TCP header (no options, no payload).
#[allow(clippy::too_many_arguments)]
pub fn tcp4_packet(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    sport: u16,
    dport: u16,
    seq: u32,
    ack: u32,
    flags: u8,
    window: u16,
) -> Vec<u8> {
    let mut tcp = Vec::with_capacity(20);
    tcp.extend(sport.to_be_bytes());
    tcp.extend(dport.to_be_bytes());
    tcp.extend(seq.to_be_bytes());
    tcp.extend(ack.to_be_bytes());
    tcp.extend([5 << 4, flags]);
    tcp.extend(window.to_be_bytes());
    tcp.extend([0, 0, 0, 0]);
    let mut pseudo = Vec::with_capacity(32);
    pseudo.extend(src.octets());
    pseudo.extend(dst.octets());
    pseudo.extend([0, 6, 0, tcp.len() as u8]);
    pseudo.extend(&tcp);
    let c = csum(&pseudo);
    tcp[16..18].copy_from_slice(&c.to_be_bytes());
    let mut ip = vec![0x45, 0];
    ip.extend(((20 + tcp.len()) as u16).to_be_bytes());
    ip.extend([0, 0, 0x40, 0, 64, 6, 0, 0]);
    ip.extend(src.octets());
    ip.extend(dst.octets());
    let c = csum(&ip);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    ip.extend(&tcp);
    ip
}

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;

/// A raw IPv4 socket that sends whole packets (`IPPROTO_RAW`: header
/// included), routed by the kernel from the calling thread's namespace.
pub struct RawSender(std::os::fd::OwnedFd);

impl RawSender {
    pub fn new() -> io::Result<Self> {
        use std::os::fd::FromRawFd as _;
        // SAFETY: plain socket call; the descriptor is owned at once.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh descriptor.
        Ok(Self(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }))
    }

    pub fn send(&self, pkt: &[u8], dst: Ipv4Addr) -> io::Result<()> {
        use std::os::fd::AsRawFd as _;
        // SAFETY: a zeroed sockaddr_in, filled; buffers sized as passed.
        unsafe {
            let mut sa: libc::sockaddr_in = std::mem::zeroed();
            sa.sin_family = libc::AF_INET as libc::sa_family_t;
            sa.sin_addr.s_addr = u32::from_ne_bytes(dst.octets());
            let n = libc::sendto(
                self.0.as_raw_fd(),
                pkt.as_ptr() as *const libc::c_void,
                pkt.len(),
                0,
                &sa as *const _ as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            );
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    }
}

/// An `AF_PACKET` socket on one device, seeing the packets this namespace
/// sends (and receives) there.
pub struct Sniffer(std::os::fd::OwnedFd);

impl Sniffer {
    pub fn new(dev: &str) -> io::Result<Self> {
        use std::os::fd::{AsRawFd as _, FromRawFd as _};
        let cdev = std::ffi::CString::new(dev).map_err(io::Error::other)?;
        // SAFETY: plain socket calls on a descriptor owned at once; the
        // sockaddr_ll is zeroed, then filled, and passed with its size.
        unsafe {
            let ifindex = libc::if_nametoindex(cdev.as_ptr());
            if ifindex == 0 {
                return Err(io::Error::last_os_error());
            }
            // ETH_P_ALL: packets being sent reach only the taps of all
            // protocols; parse_tcp4 picks the IPv4 ones.
            let proto = (libc::ETH_P_ALL as u16).to_be();
            let fd = libc::socket(libc::AF_PACKET, libc::SOCK_DGRAM, proto as i32);
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            let fd = std::os::fd::OwnedFd::from_raw_fd(fd);
            let mut sll: libc::sockaddr_ll = std::mem::zeroed();
            sll.sll_family = libc::AF_PACKET as u16;
            sll.sll_protocol = proto;
            sll.sll_ifindex = ifindex as i32;
            if libc::bind(
                fd.as_raw_fd(),
                &sll as *const _ as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            ) != 0
            {
                return Err(io::Error::last_os_error());
            }
            let tv = libc::timeval {
                tv_sec: 0,
                tv_usec: 100_000,
            };
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                &tv as *const _ as *const libc::c_void,
                std::mem::size_of::<libc::timeval>() as u32,
            );
            Ok(Self(fd))
        }
    }

    /// The next packet (IP header first) and whether it was outgoing;
    /// None after 100 ms without one.
    pub fn next(&self, buf: &mut [u8]) -> Option<(usize, bool)> {
        use std::os::fd::AsRawFd as _;
        // SAFETY: buffers sized as passed; sll is written by the kernel.
        unsafe {
            let mut sll: libc::sockaddr_ll = std::mem::zeroed();
            let mut len = std::mem::size_of::<libc::sockaddr_ll>() as u32;
            let n = libc::recvfrom(
                self.0.as_raw_fd(),
                buf.as_mut_ptr() as *mut libc::c_void,
                buf.len(),
                0,
                &mut sll as *mut _ as *mut libc::sockaddr,
                &mut len,
            );
            if n <= 0 {
                return None;
            }
            if sll.sll_protocol != (libc::ETH_P_IP as u16).to_be() {
                return Some((0, false));
            }
            Some((n as usize, sll.sll_pkttype == libc::PACKET_OUTGOING))
        }
    }
}

impl Sniffer {
    /// A sniffer on `dev` that is handed only IPv4 TCP segments with SYN,
    /// FIN or RST set (a classic BPF filter on the socket): the openings
    /// and endings of every connection, none of the bulk between them.
    pub fn tcp_control(dev: &str) -> io::Result<Self> {
        use std::os::fd::AsRawFd as _;
        let s = Self::new(dev)?;
        const DROP: u8 = 11;
        let op = |code: u32, jt: u8, jf: u8, k: u32| libc::sock_filter {
            code: code as u16,
            jt,
            jf,
            k,
        };
        let prog = [
            op(libc::BPF_LD | libc::BPF_B | libc::BPF_ABS, 0, 0, 0),
            op(libc::BPF_ALU | libc::BPF_AND | libc::BPF_K, 0, 0, 0xf0),
            op(
                libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K,
                0,
                DROP - 3,
                0x40,
            ),
            op(libc::BPF_LD | libc::BPF_B | libc::BPF_ABS, 0, 0, 9),
            op(libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K, 0, DROP - 5, 6),
            op(libc::BPF_LD | libc::BPF_H | libc::BPF_ABS, 0, 0, 6),
            // Fragments after the first carry no TCP header.
            op(
                libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K,
                DROP - 7,
                0,
                0x1fff,
            ),
            op(libc::BPF_LDX | libc::BPF_B | libc::BPF_MSH, 0, 0, 0),
            op(libc::BPF_LD | libc::BPF_B | libc::BPF_IND, 0, 0, 13),
            op(
                libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K,
                0,
                DROP - 10,
                0x07,
            ),
            op(libc::BPF_RET | libc::BPF_K, 0, 0, 0x40000),
            op(libc::BPF_RET | libc::BPF_K, 0, 0, 0),
        ];
        let fprog = libc::sock_fprog {
            len: prog.len() as u16,
            filter: prog.as_ptr() as *mut libc::sock_filter,
        };
        // SAFETY: the program outlives the call, which copies it.
        let rc = unsafe {
            libc::setsockopt(
                s.0.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_ATTACH_FILTER,
                &fprog as *const _ as *const libc::c_void,
                std::mem::size_of::<libc::sock_fprog>() as u32,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        // Packets queued between bind and attach passed no filter.
        let mut buf = [0u8; 256];
        while s.next_nowait(&mut buf) {}
        Ok(s)
    }

    fn next_nowait(&self, buf: &mut [u8]) -> bool {
        use std::os::fd::AsRawFd as _;
        // SAFETY: buffer sized as passed.
        let n = unsafe {
            libc::recv(
                self.0.as_raw_fd(),
                buf.as_mut_ptr() as *mut libc::c_void,
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        n > 0
    }
}

/// The RSTs one end of many TCP connections sends, told apart by what
/// they answer. A passive closer's socket is gone once the ACK of its FIN
/// arrives; a segment of the peer's that comes later meets no socket and
/// is answered with an RST whose sequence number is that segment's ACK
/// (RFC 9293 3.10.7.1): a second copy of the last ACK (the peer re-sends
/// it when this end's FIN was retransmitted, e.g. on a loaded machine)
/// gives the end of this side's FIN, an older ACK overtaken on the way (a
/// window update the peer sent from another CPU) a little before it. Such
/// an RST, on a connection whose FINs both went by, is TCP working after
/// both ends had every byte (`after_close`). Any other RST (a segment of
/// a connection this end never had, an abort) is `other`.
#[derive(Debug, Default)]
pub struct RstClassifier {
    ends: std::collections::HashMap<(Ipv4Addr, u16, Ipv4Addr, u16), Ends>,
    pub after_close: u64,
    pub other: Vec<String>,
}

/// What one connection (by this end's tuple) has shown of its closing.
#[derive(Debug, Default, Clone, Copy)]
struct Ends {
    /// The sequence number just past this end's FIN.
    own_fin_end: Option<u32>,
    peer_fin: bool,
}

impl RstClassifier {
    /// One IPv4 packet (IP header first), sent by this end or received.
    pub fn packet(&mut self, p: &[u8], outgoing: bool) {
        let Some((src, dst, sport, dport, seq, ack, flags, len)) = parse_tcp4(p) else {
            return;
        };
        let key = if outgoing {
            (src, sport, dst, dport)
        } else {
            (dst, dport, src, sport)
        };
        if flags & TCP_SYN != 0 {
            // A new connection on the tuple: its ending starts afresh.
            self.ends.insert(key, Ends::default());
            return;
        }
        let ends = self.ends.entry(key).or_default();
        if flags & TCP_FIN != 0 {
            if outgoing {
                ends.own_fin_end = Some(seq.wrapping_add(len as u32).wrapping_add(1));
            } else {
                ends.peer_fin = true;
            }
        }
        if outgoing && flags & TCP_RST != 0 {
            // Acknowledging this end's data up to its FIN: within the
            // 64 MiB before the FIN's end (more than any window here).
            let late = ends
                .own_fin_end
                .is_some_and(|end| end.wrapping_sub(seq) < 1 << 26);
            if ends.peer_fin && late {
                self.after_close += 1;
            } else {
                self.other.push(format!(
                    "{src}:{sport} -> {dst}:{dport} RST seq {seq} ack {ack} flags {flags:#04x} \
                     (this end's FIN ended at {:?}, peer's FIN seen: {})",
                    ends.own_fin_end, ends.peer_fin
                ));
            }
        }
    }
}

/// The TCP fields of an IPv4 packet: (src, dst, sport, dport, seq, ack,
/// flags, payload length).
#[allow(clippy::type_complexity)]
pub fn parse_tcp4(p: &[u8]) -> Option<(Ipv4Addr, Ipv4Addr, u16, u16, u32, u32, u8, usize)> {
    if p.len() < 40 || p[0] >> 4 != 4 || p[9] != 6 {
        return None;
    }
    let ihl = (p[0] & 0x0f) as usize * 4;
    let total = u16::from_be_bytes([p[2], p[3]]) as usize;
    let t = p.get(ihl..)?;
    if t.len() < 20 {
        return None;
    }
    let doff = (t[12] >> 4) as usize * 4;
    let src = Ipv4Addr::new(p[12], p[13], p[14], p[15]);
    let dst = Ipv4Addr::new(p[16], p[17], p[18], p[19]);
    Some((
        src,
        dst,
        u16::from_be_bytes([t[0], t[1]]),
        u16::from_be_bytes([t[2], t[3]]),
        u32::from_be_bytes([t[4], t[5], t[6], t[7]]),
        u32::from_be_bytes([t[8], t[9], t[10], t[11]]),
        t[13],
        total.saturating_sub(ihl + doff),
    ))
}

/// Whether the calling thread's network namespace has a default route
/// (IPv4 or IPv6): the traffic tools refuse to run there.
pub fn has_default_route() -> Result<bool> {
    let v4 = std::fs::read_to_string("/proc/thread-self/net/route")?;
    let v4_default = v4
        .lines()
        .skip(1)
        .any(|l| l.split_whitespace().nth(1) == Some("00000000"));
    let v6 = std::fs::read_to_string("/proc/thread-self/net/ipv6_route").unwrap_or_default();
    let v6_default = v6.lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        // destination ::/0, not the unreachable/local/multicast defaults of lo
        f.len() >= 10 && f[0] == "00000000000000000000000000000000" && f[1] == "00" && f[9] != "lo"
    });
    Ok(v4_default || v6_default)
}

/// Fails unless the target is an IPv4 address of this namespace's
/// connected subnets' peers (safety: spoofed traffic only to namespaces of
/// the test) and there is no default route.
pub fn refuse_unsafe(target: Ipv4Addr) -> Result<()> {
    if has_default_route()? {
        bail!("this network namespace has a default route: refusing to send raw packets");
    }
    if target.is_loopback()
        || target.is_broadcast()
        || target.is_multicast()
        || target.is_unspecified()
    {
        bail!("refusing to send raw packets to {target}");
    }
    Ok(())
}

/// `count` spoofed SYNs to `target` from random addresses of
/// `base`/`prefix_len` and random ports, spread evenly over `duration`:
/// (sent, send errors).
pub fn syn_flood(
    target: SocketAddr,
    base: Ipv4Addr,
    prefix_len: u8,
    count: u64,
    duration: Duration,
) -> Result<(u64, u64)> {
    let SocketAddr::V4(t) = target else {
        bail!("IPv4 targets only");
    };
    if !(8..=30).contains(&prefix_len) {
        bail!("source prefix /{prefix_len}: use /8 to /30");
    }
    if count > 200_000 || duration > Duration::from_secs(30) {
        bail!("bounded: at most 200000 SYNs over at most 30 s");
    }
    refuse_unsafe(*t.ip())?;
    let raw = RawSender::new().context("raw socket")?;
    let host_bits = 32 - prefix_len as u32;
    let mask = u32::MAX << host_bits;
    let net = u32::from(base) & mask;
    let mut rng = Rng::seeded();
    let began = Instant::now();
    let (mut sent, mut errors) = (0u64, 0u64);
    for i in 0..count {
        let due = began + duration.mul_f64(i as f64 / count.max(1) as f64);
        let now = Instant::now();
        if due > now + Duration::from_micros(200) {
            std::thread::sleep(due - now);
        }
        let host = (rng.next_u64() as u32) & !mask;
        let host = host.clamp(1, (!mask).saturating_sub(1).max(1));
        let src = Ipv4Addr::from(net | host);
        let sport = 1024 + (rng.next_u64() % 64_000) as u16;
        let pkt = tcp4_packet(
            src,
            *t.ip(),
            sport,
            t.port(),
            rng.next_u64() as u32,
            0,
            TCP_SYN,
            64_240,
        );
        match raw.send(&pkt, *t.ip()) {
            Ok(()) => sent += 1,
            Err(_) => errors += 1,
        }
    }
    Ok((sent, errors))
}

/// xorshift64*: cheap, good enough for spreading addresses and ports.
pub struct Rng(u64);

impl Rng {
    pub fn seeded() -> Self {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        Rng(t ^ ((std::process::id() as u64) << 32) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

// ---------------------------------------------------------------- echo flows

/// One long-lived echo connection of `lb-probe tcp-flows`.
pub struct EchoFlow {
    pub id: String,
    pub backend: Option<String>,
    pub local: Option<SocketAddr>,
    pub target: SocketAddr,
    stream: Option<BufReader<TcpStream>>,
    pub sent: u64,
    pub recv: u64,
    pub error: Option<String>,
}

/// A flow's state as `tcp-flows` prints it after each command.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FlowState {
    pub id: String,
    #[serde(default)]
    pub backend: Option<String>,
    #[serde(default)]
    pub local: Option<String>,
    /// This command's step worked.
    pub ok: bool,
    pub sent: u64,
    pub recv: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// `rst`: the flow's next sequence number seen on the wire, and how
    /// many RSTs (sequence number half the space away) went out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snd_nxt: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rst_seq: Option<u32>,
    #[serde(default)]
    pub injected: u32,
}

/// A TCP connection to `target`, from source port `from_port` if given
/// (bound with SO_REUSEADDR, so that sockets to other destinations may
/// share it).
pub fn connect_from(
    from_port: Option<u16>,
    target: SocketAddr,
    timeout: Duration,
) -> io::Result<TcpStream> {
    let Some(port) = from_port else {
        return TcpStream::connect_timeout(&target, timeout);
    };
    let s = socket2::Socket::new(
        socket2::Domain::for_address(target),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    s.set_reuse_address(true)?;
    let any: std::net::IpAddr = match target {
        SocketAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
        SocketAddr::V6(_) => std::net::Ipv6Addr::UNSPECIFIED.into(),
    };
    s.bind(&SocketAddr::new(any, port).into())?;
    s.connect_timeout(&target.into(), timeout)?;
    Ok(s.into())
}

impl EchoFlow {
    pub fn open(target: SocketAddr, from_port: Option<u16>, id: String, timeout: Duration) -> Self {
        let mut f = EchoFlow {
            id,
            backend: None,
            local: None,
            target,
            stream: None,
            sent: 0,
            recv: 0,
            error: None,
        };
        let r: io::Result<()> = (|| {
            let s = connect_from(from_port, target, timeout)?;
            s.set_read_timeout(Some(timeout))?;
            s.set_write_timeout(Some(timeout))?;
            f.local = s.local_addr().ok();
            let req = Request {
                id: f.id.clone(),
                echo: true,
                ..Default::default()
            };
            (&s).write_all(format!("{}\n", serde_json::to_string(&req)?).as_bytes())?;
            let mut r = BufReader::new(s);
            let mut g = String::new();
            r.read_line(&mut g)?;
            if !g.ends_with('\n') {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "EOF"));
            }
            f.backend = Some(g.trim().to_string());
            f.stream = Some(r);
            Ok(())
        })();
        if let Err(e) = r {
            f.error = Some(format!("open: {}", err_name(&e)));
        }
        f
    }

    /// Sends `n` pattern bytes and reads them back.
    pub fn ping(&mut self, n: usize) -> bool {
        let Some(r) = self.stream.as_mut() else {
            return false;
        };
        let res: io::Result<bool> = (|| {
            let msg = pattern(self.sent, n).to_vec();
            r.get_mut().write_all(&msg)?;
            self.sent += n as u64;
            let mut back = vec![0u8; n];
            r.read_exact(&mut back)?;
            self.recv += n as u64;
            Ok(back == msg)
        })();
        match res {
            Ok(true) => true,
            Ok(false) => {
                self.fail("ping: echo differs".into());
                false
            }
            Err(e) => {
                self.fail(format!("ping: {}", err_name(&e)));
                false
            }
        }
    }

    fn fail(&mut self, e: String) {
        if self.error.is_none() {
            self.error = Some(e);
        }
        self.stream = None;
    }

    /// FIN, then reads to EOF (nothing more may come).
    pub fn close(&mut self) -> bool {
        let Some(mut r) = self.stream.take() else {
            return false;
        };
        let _ = r.get_ref().shutdown(Shutdown::Write);
        let mut rest = Vec::new();
        match r.read_to_end(&mut rest) {
            Ok(0) => true,
            Ok(n) => {
                self.fail(format!("close: {n} unexpected bytes"));
                false
            }
            Err(e) => {
                self.fail(format!("close: {}", err_name(&e)));
                false
            }
        }
    }

    /// Learns the flow's next sequence number from the wire (a ping seen by
    /// `sniffer`), then sends `copies` RSTs with the flow's exact tuple and
    /// a sequence number 2^31 away from it: as far outside any window as
    /// can be.
    pub fn bad_rst(&mut self, sniffer: &Sniffer, raw: &RawSender, copies: u32) -> FlowState {
        let mut st = self.state(true);
        let (Some(SocketAddr::V4(local)), SocketAddr::V4(target)) = (self.local, self.target)
        else {
            st.ok = false;
            st.error = Some("IPv4 flows only".into());
            return st;
        };
        if !self.ping(100) {
            return self.state(false);
        }
        let mut buf = [0u8; 65_536];
        let mut snd_nxt = None;
        let deadline = Instant::now() + Duration::from_millis(500);
        while Instant::now() < deadline {
            let Some((n, outgoing)) = sniffer.next(&mut buf) else {
                if snd_nxt.is_some() {
                    break;
                }
                continue;
            };
            let Some((s, d, sp, dp, seq, _ack, flags, len)) = parse_tcp4(&buf[..n]) else {
                continue;
            };
            if outgoing
                && s == *local.ip()
                && sp == local.port()
                && d == *target.ip()
                && dp == target.port()
            {
                let extra = (flags & (TCP_SYN | TCP_FIN) != 0) as u32;
                snd_nxt = Some(seq.wrapping_add(len as u32 + extra));
            }
        }
        let Some(nxt) = snd_nxt else {
            st.ok = false;
            st.error = Some("rst: no packet of the flow seen on eth0".into());
            return st;
        };
        let seq = nxt.wrapping_add(0x8000_0000);
        let pkt = tcp4_packet(
            *local.ip(),
            *target.ip(),
            local.port(),
            target.port(),
            seq,
            0,
            TCP_RST,
            0,
        );
        let mut st = self.state(true);
        st.snd_nxt = Some(nxt);
        st.rst_seq = Some(seq);
        for _ in 0..copies {
            match raw.send(&pkt, *target.ip()) {
                Ok(()) => st.injected += 1,
                Err(e) => st.error = Some(format!("rst: sendto: {}", err_name(&e))),
            }
        }
        st
    }

    pub fn state(&self, ok: bool) -> FlowState {
        FlowState {
            id: self.id.clone(),
            backend: self.backend.clone(),
            local: self.local.map(|l| l.to_string()),
            ok: ok && self.error.is_none(),
            sent: self.sent,
            recv: self.recv,
            error: self.error.clone(),
            ..Default::default()
        }
    }
}

// ---------------------------------------------------------------- test side

/// `lb-probe tcp-serve` in every pod of a cluster; the reports of every
/// connection so far. The servers are killed on drop.
pub struct StreamServers {
    children: Vec<std::process::Child>,
    reports: Arc<Mutex<Vec<ServerReport>>>,
}

impl Drop for StreamServers {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl StreamServers {
    /// Starts a server named after each pod on `port`, its connections
    /// pinned round-robin to `cpus` (none: unpinned).
    pub fn start(pods: &[crate::nodes::Pod], port: u16, cpus: &[usize]) -> Result<Self> {
        let probe = crate::probe_bin()?;
        let reports = Arc::new(Mutex::new(Vec::new()));
        let mut me = StreamServers {
            children: Vec::new(),
            reports: reports.clone(),
        };
        let cpus: Vec<String> = cpus.iter().map(|c| c.to_string()).collect();
        for pod in pods {
            let mut c = std::process::Command::new("ip");
            c.args(["netns", "exec", &pod.netns]).arg(&probe).args([
                "tcp-serve",
                "--name",
                &pod.name,
                "--port",
                &port.to_string(),
            ]);
            if !cpus.is_empty() {
                c.args(["--cpus", &cpus.join(",")]);
            }
            let (mut child, line) = crate::cmd::spawn_piped(
                &mut c,
                std::process::Stdio::null(),
                std::process::Stdio::inherit(),
            )?;
            let stdout = child.stdout.take().expect("piped");
            me.children.push(child);
            let mut lines = BufReader::new(stdout).lines();
            let first = lines.next().transpose()?.unwrap_or_default();
            if !first.contains("\"listening\"") {
                bail!("`{line}` said {first:?}");
            }
            let reports = reports.clone();
            std::thread::spawn(move || {
                for l in lines.map_while(Result::ok) {
                    if let Ok(r) = serde_json::from_str::<ServerReport>(&l) {
                        crate::netns::lock(&reports).push(r);
                    }
                }
            });
        }
        Ok(me)
    }

    pub fn reports(&self) -> Vec<ServerReport> {
        crate::netns::lock(&self.reports).clone()
    }

    /// Waits up to `timeout` until every id in `ids` has a report.
    pub fn wait_for(&self, ids: &[String], timeout: Duration) -> Vec<ServerReport> {
        crate::wait_until(timeout, Duration::from_millis(100), || {
            let r = self.reports();
            ids.iter().all(|id| r.iter().any(|s| &s.id == id))
        });
        self.reports()
    }
}

/// Runs every `lb-probe` command line of `runs` at once and collects the
/// [`ClientReport`] lines they print; a process still running at
/// `deadline` is killed (and the connections it did not report are
/// missing from the result: the join reports them).
pub fn run_clients(runs: &[Vec<String>], deadline: Duration) -> Result<Vec<ClientReport>> {
    let probe = crate::probe_bin()?;
    let (tx, rx) = mpsc::channel::<ClientReport>();
    let mut children = Vec::new();
    for args in runs {
        let mut c = std::process::Command::new(&probe);
        c.args(args);
        let (mut child, line) = crate::cmd::spawn_piped(
            &mut c,
            std::process::Stdio::null(),
            std::process::Stdio::inherit(),
        )?;
        let stdout = child.stdout.take().expect("piped");
        let tx = tx.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(stdout).lines().map_while(Result::ok) {
                match serde_json::from_str::<ClientReport>(&l) {
                    Ok(r) => {
                        let _ = tx.send(r);
                    }
                    Err(e) => eprintln!("`{line}`: bad line {l:?}: {e}"),
                }
            }
        });
        children.push(child);
    }
    drop(tx);
    let end = Instant::now() + deadline;
    for c in &mut children {
        loop {
            match c.try_wait() {
                Ok(Some(_)) => break,
                Ok(None) if Instant::now() < end => std::thread::sleep(Duration::from_millis(50)),
                _ => {
                    let _ = c.kill();
                    let _ = c.wait();
                    break;
                }
            }
        }
    }
    Ok(rx.iter().collect())
}

/// `lb-probe tcp-client` arguments.
#[derive(Debug, Clone)]
pub struct ClientRun {
    pub netns: String,
    pub target: String,
    pub id: String,
    pub mode: &'static str,
    pub cpu: Option<usize>,
    pub extra: Vec<String>,
}

impl ClientRun {
    pub fn new(netns: &str, target: &str, id: &str, mode: &'static str) -> Self {
        ClientRun {
            netns: netns.into(),
            target: target.into(),
            id: id.into(),
            mode,
            cpu: None,
            extra: Vec::new(),
        }
    }

    pub fn cpu(mut self, cpu: Option<usize>) -> Self {
        self.cpu = cpu;
        self
    }

    pub fn arg(mut self, k: &str, v: impl ToString) -> Self {
        self.extra.push(k.into());
        self.extra.push(v.to_string());
        self
    }

    pub fn args(&self) -> Vec<String> {
        let mut a: Vec<String> = [
            "tcp-client",
            "--netns",
            &self.netns,
            "--target",
            &self.target,
            "--id",
            &self.id,
            "--mode",
            self.mode,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if let Some(c) = self.cpu {
            a.extend(["--cpu".to_string(), c.to_string()]);
        }
        a.extend(self.extra.iter().cloned());
        a
    }
}

/// The join of both ends: what went wrong with each connection. A
/// connection is right when the client saw no error, got the greeting of
/// one backend, and exactly one server report has its id, from that
/// backend, without error, with the pattern intact both ways and the same
/// byte counts at both ends.
pub fn problems(
    clients: &[ClientReport],
    servers: &[ServerReport],
    expected_ids: &[String],
) -> Vec<String> {
    let mut out = Vec::new();
    for id in expected_ids {
        if !clients.iter().any(|c| &c.id == id) {
            out.push(format!(
                "{id}: no client report (the client overran its deadline)"
            ));
        }
    }
    for c in clients {
        let mine: Vec<&ServerReport> = servers.iter().filter(|s| s.id == c.id).collect();
        let mut why = Vec::new();
        if let Some(e) = &c.error {
            why.push(format!(
                "client {} at {}",
                e,
                c.stage.as_deref().unwrap_or("?")
            ));
        }
        if !c.recv_ok {
            why.push("client: pattern broken".into());
        }
        match mine.as_slice() {
            [] => why.push("no server report (none accepted it, or it is still stuck)".into()),
            [s] => {
                if c.backend.as_deref() != Some(s.name.as_str()) {
                    why.push(format!("greeting {:?} but served by {}", c.backend, s.name));
                }
                if let Some(e) = &s.error {
                    why.push(format!("server {}: {e}", s.name));
                }
                if !s.recv_ok {
                    why.push(format!("server {}: pattern broken", s.name));
                }
                if s.recv != c.sent {
                    why.push(format!(
                        "client sent {} B, server {} got {} B",
                        c.sent, s.name, s.recv
                    ));
                }
                if s.sent != c.recv {
                    why.push(format!(
                        "server {} sent {} B, client got {} B",
                        s.name, s.sent, c.recv
                    ));
                }
            }
            many => why.push(format!(
                "served by {} connections: {:?}",
                many.len(),
                many.iter().map(|s| &s.name).collect::<Vec<_>>()
            )),
        }
        if !why.is_empty() {
            out.push(format!(
                "{} (backend {:?}, {} B up, {} B down, {} ms from {} ms): {}",
                c.id,
                c.backend,
                c.sent,
                c.recv,
                c.ms,
                c.start_ms,
                why.join("; ")
            ));
        }
    }
    out
}

/// Counts of a set of client reports: (connections, with error, resets,
/// bytes up, bytes down).
pub fn tally(clients: &[ClientReport]) -> (usize, usize, usize, u64, u64) {
    let err = clients.iter().filter(|c| c.error.is_some()).count();
    let rst = clients
        .iter()
        .filter(|c| {
            c.error
                .as_deref()
                .is_some_and(|e| e.contains("ECONNRESET") || e.contains("EPIPE"))
        })
        .count();
    (
        clients.len(),
        err,
        rst,
        clients.iter().map(|c| c.sent).sum(),
        clients.iter().map(|c| c.recv).sum(),
    )
}

/// `Tcp: OutRsts` of network namespace `netns` (`/proc/net/snmp`): RSTs its
/// stack sent, e.g. a backend answering a segment of a flow it never saw.
pub fn out_rsts(netns: &str) -> Result<u64> {
    let text = crate::cmd::netns_exec(netns, &["cat", "/proc/net/snmp"])?;
    let mut tcp = text.lines().filter(|l| l.starts_with("Tcp:"));
    let (Some(names), Some(values)) = (tcp.next(), tcp.next()) else {
        bail!("no Tcp lines in /proc/net/snmp of {netns}");
    };
    names
        .split_whitespace()
        .zip(values.split_whitespace())
        .find(|(n, _)| *n == "OutRsts")
        .and_then(|(_, v)| v.parse().ok())
        .ok_or_else(|| anyhow!("no OutRsts in {netns}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const POD: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 10);
    const PEER: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 1);
    const ACK: u8 = 0x10;

    fn from_pod(seq: u32, ack: u32, flags: u8) -> Seen {
        (
            tcp4_packet(POD, PEER, 8080, 40000, seq, ack, flags, 1000),
            true,
        )
    }

    fn to_pod(seq: u32, ack: u32, flags: u8) -> Seen {
        (
            tcp4_packet(PEER, POD, 40000, 8080, seq, ack, flags, 1000),
            false,
        )
    }

    /// A packet and whether this end sent it.
    type Seen = (Vec<u8>, bool);

    fn classify(packets: &[Seen]) -> RstClassifier {
        let mut c = RstClassifier::default();
        for (p, out) in packets {
            c.packet(p, *out);
        }
        c
    }

    #[test]
    fn rsts_are_told_apart_by_what_they_answer() {
        let open = [to_pod(100, 0, TCP_SYN), from_pod(500, 101, TCP_SYN | ACK)];
        // A passive close, then an RST from the pod with this sequence number.
        let closed = |rst: u32| {
            vec![
                to_pod(900, 700, TCP_FIN | ACK),
                from_pod(700, 901, TCP_FIN | ACK),
                from_pod(rst, 0, TCP_RST),
            ]
        };
        // (what, packets after the opening, RSTs after close, other RSTs)
        let cases: [(&str, Vec<Seen>, u64, usize); 7] = [
            ("closed, then an RST past the FIN's end", closed(702), 0, 1),
            (
                "closed, then an older ACK overtaken on the way",
                closed(650),
                1,
                0,
            ),
            (
                "closed, then an RST far from this connection's data",
                closed(700u32.wrapping_sub(1 << 27)),
                0,
                1,
            ),
            (
                "closed, then the peer's second copy of the last ACK",
                closed(701),
                1,
                0,
            ),
            (
                "mid-flow segment of a connection never seen",
                vec![from_pod(5000, 0, TCP_RST)],
                0,
                1,
            ),
            (
                "abort before any FIN",
                vec![from_pod(650, 300, TCP_RST | ACK)],
                0,
                1,
            ),
            (
                "own FIN, but no FIN from the peer",
                vec![from_pod(700, 300, TCP_FIN | ACK), from_pod(701, 0, TCP_RST)],
                0,
                1,
            ),
        ];
        for (what, rest, after_close, other) in cases {
            let mut all = open.to_vec();
            all.extend(rest);
            let c = classify(&all);
            assert_eq!(c.after_close, after_close, "{what}: {:?}", c.other);
            assert_eq!(c.other.len(), other, "{what}: {:?}", c.other);
        }
    }

    #[test]
    fn a_syn_starts_the_tuples_ending_afresh() {
        let c = classify(&[
            to_pod(900, 700, TCP_FIN | ACK),
            from_pod(700, 901, TCP_FIN | ACK),
            to_pod(5000, 0, TCP_SYN),
            from_pod(701, 0, TCP_RST),
        ]);
        assert_eq!((c.after_close, c.other.len()), (0, 1), "{:?}", c.other);
    }
}
