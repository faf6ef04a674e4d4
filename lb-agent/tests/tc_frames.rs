//! Table-driven tests of the tc programs on crafted frames, through
//! `BPF_PROG_TEST_RUN`: headers, checksums (verified by recomputation), NAT
//! and conntrack transitions, IPv4 and IPv6. They need root (loading BPF
//! programs) and print a loud SKIPPED without it.
use std::{net::IpAddr, time::Duration};

/// The fuzz target of these programs (`cargo xtask fuzz`).
#[path = "tc_frames/fuzz.rs"]
mod fuzz;
#[path = "../fuzz/mutate.rs"]
mod mutate;

use aya::{
    maps::{Array, HashMap, HashOfMaps, MapData, PerCpuArray},
    programs::{SchedClassifier, TestRun, TestRunOptions},
    Ebpf, EbpfLoader,
};
use lb_common::{
    backend_flags, ct_flags, ct_state, map_names, proto, scope, stat, Backend, BackendId,
    BackendSlot, BackendSlotKey, CtEntry, CtKey, KeyCheck, PortBits, ServiceKey, ServiceValue,
    TcConfig,
};

use lb_agent::{
    base::addr::addr_bytes,
    datapath::{
        loader::{self, EBPF_OBJECT},
        tc,
    },
    semantics::{maglev, model},
};

const UNSPEC: u32 = u32::MAX;
const OK: u32 = 0;
const SHOT: u32 = 2;
const REDIRECT: u32 = 7;

const TCP_SYN: u8 = 0x02;
const TCP_ACK: u8 = 0x10;
const TCP_FIN: u8 = 0x01;
const TCP_RST: u8 = 0x04;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

// ------------------------------------------------------------------ frames

fn fold(mut sum: u32) -> u16 {
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

fn sum16(data: &[u8]) -> u32 {
    data.chunks(2)
        .map(|c| u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]) as u32)
        .sum()
}

/// Ethernet + IPv4/IPv6 + TCP/UDP with correct checksums.
#[derive(Clone, Debug)]
struct Frame {
    src: IpAddr,
    dst: IpAddr,
    sport: u16,
    dport: u16,
    proto: u8,
    tcp_flags: u8,
    /// TCP sequence and acknowledgment numbers.
    seq: u32,
    ack: u32,
    /// IPv4 flags+fragment offset field.
    frag: u16,
    /// IPv4 UDP without a checksum.
    no_udp_csum: bool,
    /// Zero bytes after the payload.
    extra: usize,
}

const PAYLOAD: &[u8] = b"hello";

impl Frame {
    fn seq_ack(mut self, seq: u32, ack: u32) -> Self {
        self.seq = seq;
        self.ack = ack;
        self
    }

    fn tcp(src: &str, sport: u16, dst: &str, dport: u16, flags: u8) -> Self {
        Frame {
            src: ip(src),
            dst: ip(dst),
            sport,
            dport,
            proto: proto::TCP,
            tcp_flags: flags,
            // A handshake whose SYN-ACK has sequence number 1 completes
            // with the client's ACK of 2 (the tc path checks it).
            seq: 1,
            ack: if flags & TCP_ACK != 0 { 2 } else { 0 },
            frag: 0,
            no_udp_csum: false,
            extra: 0,
        }
    }

    fn udp(src: &str, sport: u16, dst: &str, dport: u16) -> Self {
        Frame {
            proto: proto::UDP,
            tcp_flags: 0,
            ..Self::tcp(src, sport, dst, dport, 0)
        }
    }

    fn bytes(&self) -> Vec<u8> {
        let mut l4 = Vec::new();
        l4.extend(self.sport.to_be_bytes());
        l4.extend(self.dport.to_be_bytes());
        if self.proto == proto::TCP {
            l4.extend(self.seq.to_be_bytes());
            l4.extend(self.ack.to_be_bytes());
            l4.push(5 << 4);
            l4.push(self.tcp_flags);
            l4.extend(65535u16.to_be_bytes());
            l4.extend([0, 0, 0, 0]); // csum, urg
        } else {
            l4.extend(((8 + PAYLOAD.len() + self.extra) as u16).to_be_bytes());
            l4.extend([0, 0]);
        }
        l4.extend(PAYLOAD);
        l4.extend(std::iter::repeat_n(0u8, self.extra));
        let csum_at = if self.proto == proto::TCP { 16 } else { 6 };
        let pseudo = pseudo_header(self.src, self.dst, self.proto, l4.len());
        let mut c = fold(sum16(&pseudo) + sum16(&l4));
        if self.proto == proto::UDP && c == 0 {
            c = 0xffff;
        }
        if !(self.proto == proto::UDP && self.no_udp_csum) {
            l4[csum_at..csum_at + 2].copy_from_slice(&c.to_be_bytes());
        }
        let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2];
        match (self.src, self.dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                f.extend(0x0800u16.to_be_bytes());
                let mut h = vec![0x45, 0];
                h.extend(((20 + l4.len()) as u16).to_be_bytes());
                h.extend([0, 1]);
                h.extend(self.frag.to_be_bytes());
                h.extend([64, self.proto, 0, 0]);
                h.extend(s.octets());
                h.extend(d.octets());
                let c = fold(sum16(&h));
                h[10..12].copy_from_slice(&c.to_be_bytes());
                f.extend(h);
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                f.extend(0x86ddu16.to_be_bytes());
                f.extend([0x60, 0, 0, 0]);
                f.extend((l4.len() as u16).to_be_bytes());
                f.extend([self.proto, 64]);
                f.extend(s.octets());
                f.extend(d.octets());
            }
            _ => panic!("mixed families"),
        }
        f.extend(l4);
        f
    }
}

fn pseudo_header(src: IpAddr, dst: IpAddr, proto: u8, len: usize) -> Vec<u8> {
    let mut p = Vec::new();
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            p.extend(s.octets());
            p.extend(d.octets());
            p.extend([0, proto]);
            p.extend((len as u16).to_be_bytes());
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            p.extend(s.octets());
            p.extend(d.octets());
            p.extend((len as u32).to_be_bytes());
            p.extend([0, 0, 0, proto]);
        }
        _ => panic!("mixed families"),
    }
    p
}

/// What a frame says, with its checksums verified.
#[derive(Debug, PartialEq, Eq)]
struct Parsed {
    src: IpAddr,
    dst: IpAddr,
    sport: u16,
    dport: u16,
    udp_csum: Option<u16>,
}

fn parse(f: &[u8]) -> Parsed {
    let ethertype = u16::from_be_bytes([f[12], f[13]]);
    let (src, dst, proto, l4): (IpAddr, IpAddr, u8, &[u8]) = if ethertype == 0x0800 {
        let h = &f[14..34];
        assert_eq!(fold(sum16(h)), 0, "IPv4 header checksum of {f:02x?}");
        let s: [u8; 4] = h[12..16].try_into().unwrap();
        let d: [u8; 4] = h[16..20].try_into().unwrap();
        (s.into(), d.into(), h[9], &f[34..])
    } else {
        assert_eq!(ethertype, 0x86dd);
        let s: [u8; 16] = f[22..38].try_into().unwrap();
        let d: [u8; 16] = f[38..54].try_into().unwrap();
        (s.into(), d.into(), f[20], &f[54..])
    };
    let csum_at = if proto == proto::TCP { 16 } else { 6 };
    let stored = u16::from_be_bytes([l4[csum_at], l4[csum_at + 1]]);
    if !(proto == proto::UDP && stored == 0) {
        let pseudo = pseudo_header(src, dst, proto, l4.len());
        assert_eq!(
            fold(sum16(&pseudo) + sum16(l4)),
            0,
            "L4 checksum of {f:02x?}"
        );
    }
    Parsed {
        src,
        dst,
        sport: u16::from_be_bytes([l4[0], l4[1]]),
        dport: u16::from_be_bytes([l4[2], l4[3]]),
        udp_csum: (proto == proto::UDP).then_some(stored),
    }
}

// ------------------------------------------------------------------ fixture

struct Fixture {
    ebpf: Ebpf,
    services: HashMap<MapData, ServiceKey, ServiceValue>,
    slots: Array<MapData, BackendSlot>,
    backends: Array<MapData, Backend>,
    conntrack: HashMap<MapData, CtKey, CtEntry>,
    conntrack_syn: HashMap<MapData, CtKey, CtEntry>,
    stats: PerCpuArray<MapData, u64>,
    config: Array<MapData, TcConfig>,
    local_ports: Array<MapData, PortBits>,
    frontend_ports: Array<MapData, PortBits>,
    next_set: u32,
    /// The `LB_SLOTS` index of the next set's first slot.
    next_slot: u32,
}

const NODE4: &str = "192.168.77.1";
const NODE6: &str = "fd00:77::1";

/// Moves this test's thread into a network namespace of its own, where
/// FIB lookups of the test runs find routes: forwarding on, a veth pair
/// with the node's addresses on one end, the pod networks routed through it, and one
/// pod network (`10.244.9.0/24`, `fd00:244:9::/64`) behind an MTU of 1300
/// (locked: `bpf_fib_lookup` honours a route MTU only then, or for IPv4
/// with `ip_forward_use_pmtu`, as forwarding does).
/// Nothing is sent anywhere: test runs do not transmit, and the veth pair
/// leads only to itself. The namespace goes with the thread.
fn private_netns() {
    // SAFETY: plain syscall; affects this thread only.
    assert_eq!(
        unsafe { libc::unshare(libc::CLONE_NEWNET) },
        0,
        "unshare(CLONE_NEWNET)"
    );
    for args in [
        "link add d0 type veth peer name d1",
        "link set d1 up",
        "link set d0 up",
        "link set lo up",
        "addr add 192.168.77.1/24 dev d0",
        "-6 addr add fd00:77::1/64 dev d0 nodad",
        "route add 10.244.0.0/16 dev d0",
        "-6 route add fd00:244::/32 dev d0",
        "route add 10.244.9.0/24 dev d0 mtu lock 1300",
        "-6 route add fd00:244:9::/64 dev d0 mtu lock 1300",
    ] {
        let st = std::process::Command::new("ip")
            .args(args.split(' '))
            .status()
            .expect("ip");
        assert!(st.success(), "ip {args}");
    }
    for (path, v) in [
        ("/proc/sys/net/ipv4/ip_forward", "1"),
        ("/proc/sys/net/ipv6/conf/all/forwarding", "1"),
    ] {
        std::fs::write(path, v).unwrap_or_else(|e| panic!("{path}: {e}"));
    }
}

/// The object with maps just large enough for a test.
fn load_with_small_maps() -> Ebpf {
    load_with_conntrack(256, 256)
}

/// Small service maps, conntrack tables of these sizes.
fn load_with_conntrack(conntrack: u32, conntrack_syn: u32) -> Ebpf {
    EbpfLoader::new()
        .map_max_entries(map_names::SERVICES, 64)
        .map_max_entries(map_names::SLOTS, 512)
        .map_max_entries(map_names::BACKENDS, 64)
        .map_max_entries(map_names::REV_SOCK, 64)
        .map_max_entries(map_names::AFFINITY, 64)
        .map_max_entries(map_names::CONNTRACK, conntrack)
        .map_max_entries(map_names::CONNTRACK_SYN, conntrack_syn)
        .map_max_entries(map_names::SOURCE_RANGES, 64)
        .load(EBPF_OBJECT)
        .expect("loading the object")
}

impl Fixture {
    fn new() -> Self {
        Self::with(load_with_small_maps())
    }

    fn with(mut ebpf: Ebpf) -> Self {
        private_netns();
        for name in [tc::INGRESS, tc::EGRESS] {
            let p: &mut SchedClassifier = ebpf.program_mut(name).unwrap().try_into().unwrap();
            loader::verify(|| p.load()).unwrap_or_else(|e| panic!("verifying {name}: {e:?}"));
        }
        let mut config: Array<MapData, TcConfig> =
            Array::try_from(ebpf.take_map(map_names::TC_CONFIG).unwrap()).unwrap();
        config.set(0, Self::config(61_000, 65_535), 0).unwrap();
        let take = |e: &mut Ebpf, n| e.take_map(n).unwrap();
        Fixture {
            services: HashMap::try_from(take(&mut ebpf, map_names::SERVICES)).unwrap(),
            slots: Array::try_from(take(&mut ebpf, map_names::SLOTS)).unwrap(),
            backends: Array::try_from(take(&mut ebpf, map_names::BACKENDS)).unwrap(),
            conntrack: HashMap::try_from(take(&mut ebpf, map_names::CONNTRACK)).unwrap(),
            conntrack_syn: HashMap::try_from(take(&mut ebpf, map_names::CONNTRACK_SYN)).unwrap(),
            stats: PerCpuArray::try_from(take(&mut ebpf, map_names::STATS)).unwrap(),
            config,
            local_ports: Array::try_from(take(&mut ebpf, map_names::LOCAL_PORTS)).unwrap(),
            frontend_ports: Array::try_from(take(&mut ebpf, map_names::FRONTEND_PORTS)).unwrap(),
            ebpf,
            next_set: 1,
            next_slot: 0,
        }
    }

    fn config(snat_port_min: u16, snat_port_max: u16) -> TcConfig {
        TcConfig {
            snat_v4: addr_bytes(ip(NODE4)),
            snat_v6: addr_bytes(ip(NODE6)),
            tcp_timeout_s: 3600,
            tcp_close_timeout_s: 10,
            udp_timeout_s: 30,
            snat_port_min,
            snat_port_max,
            tcp_syn_timeout_s: 60,
            l4_csum_v6_flags: 0,
            tcp_time_wait_timeout_s: 60,
            source_ranges: 0,
            outlier_failures: 3,
            outlier_base_ms: 10_000,
            outlier_max_ms: 300_000,
            outlier_max_percent: 50,
            service_ranges: Default::default(),
        }
    }

    fn snat_ports(&mut self, min: u16, max: u16) {
        self.config.set(0, Self::config(min, max), 0).unwrap();
    }

    /// Established TCP flows expire after `s` seconds. A test that expires
    /// an entry by backdating it to the clock's start (CLOCK_MONOTONIC, from
    /// boot) needs a timeout shorter than the machine's uptime.
    fn tcp_timeout(&mut self, s: u32) {
        let mut c = self.config.get(&0, 0).unwrap();
        c.tcp_timeout_s = s;
        self.config.set(0, c, 0).unwrap();
    }

    fn backend(&mut self, id: u32, addr: &str, port: u16, proto: u8, local: bool) {
        let b = Backend {
            addr: addr_bytes(ip(addr)),
            port,
            proto,
            flags: if local { backend_flags::LOCAL } else { 0 },
            key_check: BackendId { id }.key_check(),
        };
        self.backends.set(id, b, 0).unwrap();
        // As the agent does before it publishes a local backend.
        if local {
            mark_port(&mut self.local_ports, port, proto);
        }
    }

    /// An EXTERNAL frontend with these backend ids (a fresh set each time).
    fn frontend(&mut self, addr: &str, port: u16, proto: u8, service_id: u32, ids: &[u32]) {
        let set = self.next_set;
        self.next_set += 1;
        // Sets placed one after another, as the agent's first sync does.
        let base = self.next_slot;
        self.next_slot += ids.len() as u32;
        for (i, id) in ids.iter().enumerate() {
            let key = BackendSlotKey {
                backend_set: set,
                slot: i as u32,
            };
            let slot = BackendSlot {
                backend_id: *id,
                key_check: key.key_check(),
            };
            self.slots.set(base + i as u32, slot, 0).unwrap();
        }
        let key = ServiceKey {
            addr: addr_bytes(ip(addr)),
            port,
            proto,
            scope: scope::EXTERNAL,
        };
        let value = ServiceValue {
            id: service_id,
            backend_set: set,
            active: ids.len() as u16,
            terminating: 0,
            flags: 0,
            maglev_size: 0,
            affinity_timeout: 0,
            affinity_id: service_id,
            key_check: 0,
            slot_base: base,
        };
        let value = ServiceValue {
            key_check: value.check_for(&key),
            ..value
        };
        // As the agent does before it publishes a frontend.
        self.mark_frontend_port(port, proto);
        self.services.insert(key, value, 0).unwrap();
    }

    fn mark_frontend_port(&mut self, port: u16, proto: u8) {
        mark_port(&mut self.frontend_ports, port, proto);
    }

    /// Sets `flags` on the EXTERNAL frontend.
    fn flag(&mut self, addr: &str, port: u16, proto: u8, flags: u16) {
        let key = ServiceKey {
            addr: addr_bytes(ip(addr)),
            port,
            proto,
            scope: scope::EXTERNAL,
        };
        let mut v = self.services.get(&key, 0).unwrap();
        v.flags |= flags;
        v.key_check = v.check_for(&key);
        self.services.insert(key, v, 0).unwrap();
    }

    fn run(&mut self, program: &str, frame: &Frame) -> (u32, Vec<u8>) {
        self.run_bytes(program, &frame.bytes())
    }

    fn run_bytes(&mut self, program: &str, input: &[u8]) -> (u32, Vec<u8>) {
        let (rc, out, _) = self.run_timed(program, input);
        (rc, out)
    }

    /// One run of `program` on `input`: its verdict, the frame it left and
    /// how long the run took (the kernel's measure).
    fn run_timed(&mut self, program: &str, input: &[u8]) -> (u32, Vec<u8>, u128) {
        self.test_run(program, input).expect("BPF_PROG_TEST_RUN")
    }

    /// [`run_timed`](Self::run_timed), or the error of BPF_PROG_TEST_RUN.
    fn test_run(
        &mut self,
        program: &str,
        input: &[u8],
    ) -> Result<(u32, Vec<u8>, u128), aya::programs::ProgramError> {
        let p: &mut SchedClassifier = self.ebpf.program_mut(program).unwrap().try_into().unwrap();
        let mut out = vec![0u8; input.len() + 1024];
        let r = p.test_run(TestRunOptions {
            data_in: Some(input),
            data_out: Some(&mut out),
            repeat: 1,
            ..Default::default()
        })?;
        out.truncate(r.data_size_out as usize);
        Ok((r.return_value, out, r.duration.as_nanos()))
    }

    /// The entry of this tuple, in whichever table it is.
    fn entry(&self, src: &str, sport: u16, dst: &str, dport: u16, proto: u8) -> Option<CtEntry> {
        let key = ct_key(src, sport, dst, dport, proto);
        self.conntrack
            .get(&key, 0)
            .or_else(|_| self.conntrack_syn.get(&key, 0))
            .ok()
    }

    /// Whether this tuple's entry is in LB_CT_SYN (the handshake is not
    /// complete).
    fn in_syn_table(&self, src: &str, sport: u16, dst: &str, dport: u16, proto: u8) -> bool {
        let key = ct_key(src, sport, dst, dport, proto);
        self.conntrack_syn.get(&key, 0).is_ok()
    }

    /// The client's ACK of its backend's SYN-ACK (sequence number 1, the
    /// frames' default), which makes the flow established.
    fn ack(&mut self, client: &str, sport: u16, frontend: &str, dport: u16) {
        let (rc, _) = self.run(
            "tc_ingress",
            &Frame::tcp(client, sport, frontend, dport, TCP_ACK),
        );
        assert!(rc == OK || rc == REDIRECT, "handshake ACK: {rc}");
        assert!(
            !self.in_syn_table(client, sport, frontend, dport, proto::TCP),
            "established"
        );
    }

    /// `LB_STATS[index]`, summed over CPUs.
    fn stat(&self, index: u32) -> u64 {
        self.stats.get(&index, 0).unwrap().iter().sum()
    }

    /// A resolved neighbour on the fixture's device, as a node has for the
    /// hosts it talks to (a permanent entry: it never goes stale here).
    fn neighbour(&mut self, addr: &str, mac: [u8; 6]) {
        let mac = mac.map(|b| format!("{b:02x}")).join(":");
        let args = format!("neigh replace {addr} lladdr {mac} dev d0 nud permanent");
        let st = std::process::Command::new("ip")
            .args(args.split(' '))
            .status()
            .expect("ip");
        assert!(st.success(), "ip {args}");
    }

    /// Moves `LB_ROUTE_EPOCH`, as the agent does at a route change.
    fn route_epoch(&mut self, epoch: u32) {
        let mut m: Array<&mut MapData, u32> =
            Array::try_from(self.ebpf.map_mut(map_names::ROUTE_EPOCH).unwrap()).unwrap();
        m.set(0, epoch, 0).unwrap();
    }
}

fn ct_key(src: &str, sport: u16, dst: &str, dport: u16, proto: u8) -> CtKey {
    CtKey {
        src: addr_bytes(ip(src)),
        dst: addr_bytes(ip(dst)),
        sport,
        dport,
        proto,
        _pad: [0; 3],
    }
}

fn skip() -> bool {
    // SAFETY: trivial libc call.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIPPED: needs root to load and test-run BPF programs");
        return true;
    }
    false
}

// ------------------------------------------------------------------ tests

/// The verifier walks every path of a program and gives up past a million
/// instructions; tc_ingress is the largest, and a branch added anywhere can
/// take it over (every frame test then fails at load). This keeps a
/// quarter in reserve, for the next change and for older kernels, whose
/// verifiers prune less.
#[test]
fn tc_programs_leave_a_quarter_of_the_verifier_budget() {
    if skip() {
        return;
    }
    const LIMIT: u32 = 1_000_000;
    let mut ebpf = load_with_small_maps();
    for name in [tc::INGRESS, tc::EGRESS] {
        let p: &mut SchedClassifier = ebpf.program_mut(name).unwrap().try_into().unwrap();
        loader::verify(|| p.load()).unwrap_or_else(|e| panic!("verifying {name}: {e:?}"));
        let n = p
            .info()
            .unwrap()
            .verified_instruction_count()
            .expect("the kernel reports verified instructions (5.16+)");
        eprintln!("{name}: {n} instructions verified of {LIMIT}");
        assert!(
            n <= LIMIT / 4 * 3,
            "{name}: {n} verified instructions, over 3/4 of {LIMIT}"
        );
    }
}

/// The BPF stack is 512 bytes for a whole chain of calls (a program and
/// the functions it calls, down to the deepest), and the verifiers of
/// older kernels (5.10 and 6.1 at least) round every frame up to 32
/// bytes; the 6.18 here rounds to 16 when it JITs, so it accepts chains
/// those refuse ("combined stack size of 3 calls is 544. Too large").
/// This computes every chain of every program from the object as the
/// older verifiers do; the tc programs keep 32 bytes in reserve (the
/// socket programs may use all 512). The reserve was 64 until outlier
/// detection's quarantine check took 32 of it in the new flow's frame.
/// No kernel needed.
#[test]
fn every_call_chain_fits_the_stack_of_older_kernels() {
    const MAX_BPF_STACK: u32 = 512;
    const TC_LIMIT: u32 = MAX_BPF_STACK - 32;
    let chains = stack::deepest_chains(EBPF_OBJECT);
    assert!(
        chains.iter().any(|(p, _, _)| p == tc::INGRESS),
        "{chains:?}"
    );
    let mut over = Vec::new();
    for (program, chain, bytes) in &chains {
        let chain = format!("{program}: {bytes} bytes: {}", chain.join(" -> "));
        eprintln!("{chain}");
        let tc = program == tc::INGRESS || program == tc::EGRESS;
        if *bytes > if tc { TC_LIMIT } else { MAX_BPF_STACK } {
            over.push(chain);
        }
    }
    assert!(
        over.is_empty(),
        "over {MAX_BPF_STACK} bytes of stack ({TC_LIMIT} for the tc programs): {over:#?}"
    );
}

/// No program calls the C library's memory functions: the object defines
/// them (bpf-linker exports them for what LLVM cannot expand), but each is
/// a subprogram that moves a byte per iteration, and a call costs more
/// than the stores it replaces. bpf-linker's default
/// `--bpf-expand-memcpy-in-order` turned every constant-sized memset and
/// memmove into such a call (lb-ebpf/build.rs turns it off).
#[test]
fn no_program_calls_a_memory_function() {
    const BYTE_LOOPS: [&str; 5] = ["memset", "memcpy", "memmove", "memcmp", "bcmp"];
    let programs = stack::linked(EBPF_OBJECT);
    assert!(programs.iter().any(|p| p.program == tc::INGRESS));
    let calls: Vec<String> = programs
        .iter()
        .flat_map(|p| {
            p.starts
                .iter()
                .filter(|(_, f)| BYTE_LOOPS.contains(&f.as_str()))
                .map(move |(_, f)| format!("{} calls {f}", p.program))
        })
        .collect();
    assert!(calls.is_empty(), "{calls:#?}");
}

/// Stack use read from the object's instructions, as the verifier counts
/// it: a function's depth is the deepest byte below its frame pointer
/// (r10) that it touches or points a helper at.
mod stack {
    use std::collections::{HashMap, HashSet};

    use aya_obj::{btf::BtfKind, generated::bpf_insn, Object};

    const BPF_PSEUDO_CALL: u8 = 1;
    const FP: u8 = 10;

    /// Per program: its deepest chain of calls (function names) and the
    /// stack that chain takes on a kernel that rounds frames to 32 bytes.
    pub fn deepest_chains(object: &[u8]) -> Vec<(String, Vec<String>, u32)> {
        let mut chains = Vec::new();
        for Linked {
            program,
            insns,
            starts,
        } in linked(object)
        {
            let ends: Vec<usize> = starts
                .iter()
                .skip(1)
                .map(|(s, _)| *s)
                .chain([insns.len()])
                .collect();
            let frames: Vec<Frame> = starts
                .iter()
                .zip(&ends)
                .map(|((start, _), end)| frame(&insns, *start, *end, &starts))
                .collect();
            let (bytes, chain) = deepest(&frames, 0);
            let chain = chain.iter().map(|i| starts[*i].1.clone()).collect();
            chains.push((program, chain, bytes));
        }
        chains.sort();
        chains
    }

    /// A program as the loader links it: its instructions and those of
    /// every function it calls, each function's first instruction and name.
    pub struct Linked {
        pub program: String,
        insns: Vec<bpf_insn>,
        pub starts: Vec<(usize, String)>,
    }

    pub fn linked(object: &[u8]) -> Vec<Linked> {
        let mut obj = Object::parse(object).expect("parsing the object");
        let btf = obj.btf.clone().expect("the object has BTF");
        let names: HashMap<u32, String> = obj
            .functions
            .values()
            .filter_map(|f| {
                let id = btf.id_by_type_name_kind(&f.name, BtfKind::Func).ok()?;
                Some((id, f.name.clone()))
            })
            .collect();
        let text: HashSet<usize> = obj.functions.keys().map(|(section, _)| *section).collect();
        obj.relocate_calls(&text).expect("linking the calls");
        obj.programs
            .iter()
            .map(|(name, program)| {
                let linked = &obj.functions[&program.function_key()];
                let mut starts: Vec<(usize, String)> = linked
                    .func_info
                    .func_info
                    .iter()
                    .map(|i| {
                        let off = i.insn_off as usize;
                        let name = names.get(&i.type_id).cloned();
                        (
                            off,
                            name.unwrap_or_else(|| format!("(function at insn {off})")),
                        )
                    })
                    .collect();
                starts.sort();
                Linked {
                    program: name.clone(),
                    insns: linked.instructions.clone(),
                    starts,
                }
            })
            .collect()
    }

    struct Frame {
        depth: u32,
        /// Indexes of the functions it calls.
        calls: Vec<usize>,
    }

    /// The stack of the deepest chain from function `i` down, and the chain.
    fn deepest(frames: &[Frame], i: usize) -> (u32, Vec<usize>) {
        let (below, mut chain) = frames[i]
            .calls
            .iter()
            .map(|c| deepest(frames, *c))
            .max_by_key(|(bytes, _)| *bytes)
            .unwrap_or_default();
        chain.insert(0, i);
        // As `check_max_stack_depth` of 5.10 to 6.1 (at least) counts a frame.
        (frames[i].depth.max(1).div_ceil(32) * 32 + below, chain)
    }

    /// Function `start..end`: its depth and the functions it calls.
    fn frame(insns: &[bpf_insn], start: usize, end: usize, starts: &[(usize, String)]) -> Frame {
        let mut depth = 0i64;
        // Registers holding r10 plus an offset.
        let mut fp: HashMap<u8, i64> = HashMap::new();
        let mut calls = Vec::new();
        let mut pc = start;
        while pc < end {
            let i = &insns[pc];
            let (class, dst, src) = (i.code & 0x07, i.dst_reg(), i.src_reg());
            let base = |r: u8| {
                if r == FP {
                    Some(0)
                } else {
                    fp.get(&r).copied()
                }
            };
            match class {
                // LDX: through src; ST, STX: through dst.
                0x01..=0x03 => {
                    let through = if class == 0x01 { src } else { dst };
                    if let Some(b) = base(through) {
                        depth = depth.max(-(b + i.off as i64));
                    }
                    if class == 0x01 {
                        fp.remove(&dst);
                    }
                }
                // ALU64: mov rX, r10 (or a copy of such), add rX, imm.
                0x07 => match i.code {
                    0xbf => match base(src) {
                        Some(b) => {
                            fp.insert(dst, b);
                        }
                        None => {
                            fp.remove(&dst);
                        }
                    },
                    0x07 if fp.contains_key(&dst) => {
                        let b = fp[&dst] + i.imm as i64;
                        fp.insert(dst, b);
                        depth = depth.max(-b);
                    }
                    _ => {
                        fp.remove(&dst);
                    }
                },
                0x04 => {
                    fp.remove(&dst);
                }
                // LD: the 64-bit immediate takes two slots.
                0x00 => {
                    fp.remove(&dst);
                    pc += 1;
                }
                // JMP: a call clobbers r0-r5.
                0x05 if i.code == 0x85 => {
                    if src == BPF_PSEUDO_CALL {
                        let target = (pc as i64 + 1 + i.imm as i64) as usize;
                        let callee = starts
                            .iter()
                            .position(|(s, _)| *s == target)
                            .unwrap_or_else(|| panic!("call at {pc} to {target}: no function"));
                        calls.push(callee);
                    }
                    for r in 0..=5 {
                        fp.remove(&r);
                    }
                }
                _ => {}
            }
            pc += 1;
        }
        Frame {
            depth: depth as u32,
            calls,
        }
    }
}

/// During the handshake only an ACK of the backend's SYN-ACK completes it:
/// its ACK number is the backend's initial sequence number + 1, or up to
/// 64 KiB past it (data a TCP Fast Open backend sent at once), 0 included.
/// A guess outside that is dropped, however near, and the flow stays
/// unfinished.
#[test]
fn only_an_ack_of_the_backends_answer_completes_a_handshake() {
    if skip() {
        return;
    }
    let cases = [
        ("192.168.77.100", NODE4, "10.244.1.10"),
        ("fd00:77::100", NODE6, "fd00:244:1::10"),
    ];
    for (client, node, pod) in cases {
        let mut fx = Fixture::new();
        fx.backend(1, pod, 8080, proto::TCP, true);
        fx.frontend(node, 30080, proto::TCP, 7, &[1]);
        fx.run(
            "tc_ingress",
            &Frame::tcp(client, 40000, node, 30080, TCP_SYN),
        );
        let synack = Frame::tcp(pod, 8080, client, 40000, TCP_SYN | TCP_ACK).seq_ack(7000, 2);
        assert_eq!(fx.run("tc_egress", &synack).0, OK);
        let isn1 = 7001u32;
        for ack in [
            isn1 + (1 << 16),
            isn1 + (1 << 20),
            isn1 + (1 << 22) - 1,
            isn1 - 1,
            isn1.wrapping_sub(1 << 16),
        ] {
            let invalid = fx.stat(stat::TC_DROP_INVALID);
            let guess = Frame::tcp(client, 40000, node, 30080, TCP_ACK).seq_ack(2, ack);
            assert_eq!(fx.run("tc_ingress", &guess).0, SHOT, "{client}: ACK {ack}");
            assert_eq!(fx.stat(stat::TC_DROP_INVALID), invalid + 1);
            assert!(
                fx.in_syn_table(client, 40000, node, 30080, proto::TCP),
                "{client}: ACK {ack} completed the handshake"
            );
        }
        // The last ACK number allowed: established.
        let ack = Frame::tcp(client, 40000, node, 30080, TCP_ACK).seq_ack(2, isn1 + (1 << 16) - 1);
        assert_eq!(fx.run("tc_ingress", &ack).0, OK, "{client}");
        assert!(!fx.in_syn_table(client, 40000, node, 30080, proto::TCP));
        let fwd = fx.entry(client, 40000, node, 30080, proto::TCP).unwrap();
        assert_eq!(fwd.state[ct_state::SEEN_REPLY], 1, "{client}: established");

        // A backend whose initial sequence number is 2^32 - 1 (once in 2^32
        // flows): the ACK that completes its handshake is 0; before its
        // SYN-ACK, an ACK of 0 completes nothing.
        fx.run(
            "tc_ingress",
            &Frame::tcp(client, 40001, node, 30080, TCP_SYN),
        );
        let early = Frame::tcp(client, 40001, node, 30080, TCP_ACK).seq_ack(2, 0);
        assert_eq!(
            fx.run("tc_ingress", &early).0,
            SHOT,
            "{client}: not answered yet"
        );
        let synack = Frame::tcp(pod, 8080, client, 40001, TCP_SYN | TCP_ACK).seq_ack(u32::MAX, 2);
        assert_eq!(fx.run("tc_egress", &synack).0, OK);
        let ack = Frame::tcp(client, 40001, node, 30080, TCP_ACK).seq_ack(2, 0);
        assert_eq!(fx.run("tc_ingress", &ack).0, OK, "{client}: ACK 0");
        assert!(
            !fx.in_syn_table(client, 40001, node, 30080, proto::TCP),
            "{client}: ACK 0 completed the handshake"
        );
    }
}

/// Local backend, per family: DNAT only, the client address kept; the
/// reply leaves through egress with the frontend as source; later packets
/// follow conntrack even after the backend set changed; FIN closes both
/// directions.
#[test]
fn local_backend_dnat_reply_and_conntrack() {
    if skip() {
        return;
    }
    let cases = [
        ("192.168.77.100", NODE4, "10.244.1.10", "10.244.1.11"),
        ("fd00:77::100", NODE6, "fd00:244:1::10", "fd00:244:1::11"),
    ];
    for (client, node, pod, other_pod) in cases {
        let mut fx = Fixture::new();
        fx.backend(1, pod, 8080, proto::TCP, true);
        fx.backend(2, other_pod, 8080, proto::TCP, true);
        fx.frontend(node, 30080, proto::TCP, 7, &[1]);

        let syn = Frame::tcp(client, 40000, node, 30080, TCP_SYN);
        let (rc, out) = fx.run("tc_ingress", &syn);
        assert_eq!(rc, OK, "{client}: local delivery goes up the stack");
        let p = parse(&out);
        assert_eq!((p.src, p.sport), (ip(client), 40000), "client kept");
        assert_eq!((p.dst, p.dport), (ip(pod), 8080), "DNAT to the pod");

        let fwd = fx.entry(client, 40000, node, 30080, proto::TCP).unwrap();
        assert_eq!(fwd.flags, ct_flags::LOCAL);
        assert_eq!((fwd.backend_id, fwd.service_id), (1, 7));
        let rev = fx.entry(pod, 8080, client, 40000, proto::TCP).unwrap();
        assert_eq!(rev.flags, ct_flags::LOCAL | ct_flags::REPLY);
        assert!(fx.in_syn_table(client, 40000, node, 30080, proto::TCP));

        // The reply on egress gets the frontend back; the flow stays in
        // LB_CT_SYN until the client acknowledges it (SYN_RECV).
        let reply = Frame::tcp(pod, 8080, client, 40000, TCP_SYN | TCP_ACK).seq_ack(7000, 2);
        let (rc, out) = fx.run("tc_egress", &reply);
        assert_eq!(rc, OK);
        let p = parse(&out);
        assert_eq!((p.src, p.sport), (ip(node), 30080));
        assert_eq!((p.dst, p.dport), (ip(client), 40000));
        assert!(fx.in_syn_table(client, 40000, node, 30080, proto::TCP));
        assert!(fx.in_syn_table(pod, 8080, client, 40000, proto::TCP));
        let fwd = fx.entry(client, 40000, node, 30080, proto::TCP).unwrap();
        assert_eq!(fwd.ack_seq, 7001, "the ACK that completes the handshake");
        assert_eq!(fwd.state[ct_state::SEEN_REPLY], 0);
        // Unrelated traffic on egress is not touched.
        let (rc, _) = fx.run("tc_egress", &Frame::tcp(pod, 8080, client, 999, TCP_ACK));
        assert_eq!(rc, UNSPEC);

        // The Service now has only the other pod: the flow stays.
        fx.frontend(node, 30080, proto::TCP, 7, &[2]);
        // An ACK that does not acknowledge the SYN-ACK (a blind spoofer's)
        // is dropped, and the flow stays as it was.
        let invalid = fx.stat(stat::TC_DROP_INVALID);
        let blind = Frame::tcp(client, 40000, node, 30080, TCP_ACK).seq_ack(2, 0x4000_0000);
        assert_eq!(fx.run("tc_ingress", &blind).0, SHOT);
        assert_eq!(fx.stat(stat::TC_DROP_INVALID), invalid + 1);
        assert!(fx.in_syn_table(client, 40000, node, 30080, proto::TCP));
        assert_eq!(
            fx.entry(client, 40000, node, 30080, proto::TCP)
                .unwrap()
                .ack_seq,
            7001,
            "a dropped ACK changes nothing"
        );
        // The client's ACK: established, both entries move to LB_CONNTRACK.
        let ack = Frame::tcp(client, 40000, node, 30080, TCP_ACK).seq_ack(2, 7001);
        let (rc, out) = fx.run("tc_ingress", &ack);
        assert_eq!(rc, OK);
        assert_eq!(parse(&out).dst, ip(pod), "existing flow keeps its backend");
        assert!(!fx.in_syn_table(client, 40000, node, 30080, proto::TCP));
        assert!(!fx.in_syn_table(pod, 8080, client, 40000, proto::TCP));
        for e in [
            fx.entry(client, 40000, node, 30080, proto::TCP).unwrap(),
            fx.entry(pod, 8080, client, 40000, proto::TCP).unwrap(),
        ] {
            assert_eq!(e.state[ct_state::SEEN_REPLY], 1, "established");
        }
        let (rc, out) = fx.run("tc_ingress", &ack);
        assert_eq!(rc, OK);
        assert_eq!(parse(&out).dst, ip(pod));
        // A new flow goes to the new backend.
        let (_, out) = fx.run(
            "tc_ingress",
            &Frame::tcp(client, 40001, node, 30080, TCP_SYN),
        );
        assert_eq!(parse(&out).dst, ip(other_pod));

        // FIN from the client: half-closed, still established; the
        // backend's FIN closes both directions.
        fx.run(
            "tc_ingress",
            &Frame::tcp(client, 40000, node, 30080, TCP_FIN | TCP_ACK),
        );
        let fwd = fx.entry(client, 40000, node, 30080, proto::TCP).unwrap();
        assert_eq!(
            (fwd.state[ct_state::FIN], fwd.state[ct_state::CLOSING]),
            (1, 0)
        );
        let (rc, out) = fx.run(
            "tc_egress",
            &Frame::tcp(pod, 8080, client, 40000, TCP_FIN | TCP_ACK),
        );
        assert_eq!((rc, parse(&out).src), (OK, ip(node)));
        let fwd = fx.entry(client, 40000, node, 30080, proto::TCP).unwrap();
        let rev = fx.entry(pod, 8080, client, 40000, proto::TCP).unwrap();
        assert_eq!(fwd.state[ct_state::CLOSING], 1);
        assert_eq!(rev.state[ct_state::CLOSING], 1);
        // A new SYN from the same client port is a new connection.
        let (_, out) = fx.run("tc_ingress", &syn);
        assert_eq!(parse(&out).dst, ip(other_pod), "reused port re-selects");
        assert!(fx.in_syn_table(client, 40000, node, 30080, proto::TCP));
    }
}

/// A closed flow's entries stay for the close timeout, so that late
/// packets still translate. A SYN-ACK from its backend then answers a new
/// connection on the same tuple that came around the frontend (straight
/// to the pod, or translated at connect by a socket hook): it leaves as
/// the pod sent it, and the stale entries go. During the handshake a
/// SYN-ACK sent again is the flow's own.
#[test]
fn a_syn_ack_after_the_close_answers_another_connection() {
    if skip() {
        return;
    }
    let cases = [
        ("192.168.77.100", NODE4, "10.244.1.10"),
        ("fd00:77::100", NODE6, "fd00:244:1::10"),
    ];
    // Who sends a FIN before the SYN-ACK: both ends (closed), or the
    // backend alone (its TIME_WAIT, the client's FIN not seen yet).
    for both_fins in [true, false] {
        for (client, node, pod) in cases {
            let mut fx = Fixture::new();
            fx.backend(1, pod, 8080, proto::TCP, true);
            fx.frontend(node, 30080, proto::TCP, 7, &[1]);
            let syn_ack = Frame::tcp(pod, 8080, client, 40000, TCP_SYN | TCP_ACK);
            fx.run(
                "tc_ingress",
                &Frame::tcp(client, 40000, node, 30080, TCP_SYN),
            );
            for _ in 0..2 {
                let (rc, out) = fx.run("tc_egress", &syn_ack);
                assert_eq!(rc, OK);
                assert_eq!(parse(&out).src, ip(node), "{client}: the flow's SYN-ACK");
            }
            fx.run(
                "tc_egress",
                &Frame::tcp(pod, 8080, client, 40000, TCP_FIN | TCP_ACK),
            );
            if both_fins {
                fx.run(
                    "tc_ingress",
                    &Frame::tcp(client, 40000, node, 30080, TCP_FIN | TCP_ACK),
                );
            }
            // A late packet of the flow still translates.
            let (rc, out) = fx.run("tc_egress", &Frame::tcp(pod, 8080, client, 40000, TCP_ACK));
            assert_eq!((rc, parse(&out).src), (OK, ip(node)), "{client}: late ACK");

            let (rc, out) = fx.run("tc_egress", &syn_ack);
            assert_eq!(rc, UNSPEC, "{client}, both FINs {both_fins}");
            let p = parse(&out);
            assert_eq!(
                (p.src, p.sport, p.dst, p.dport),
                (ip(pod), 8080, ip(client), 40000),
                "{client}, both FINs {both_fins}: untranslated"
            );
            assert!(fx.entry(pod, 8080, client, 40000, proto::TCP).is_none());
            assert!(fx.entry(client, 40000, node, 30080, proto::TCP).is_none());
            // The new connection's later packets pass as well.
            let (rc, out) = fx.run("tc_egress", &Frame::tcp(pod, 8080, client, 40000, TCP_ACK));
            assert_eq!((rc, parse(&out).src), (UNSPEC, ip(pod)));
        }
    }
}

/// One client port through two frontends of one local backend (a client
/// may use a port again for another destination): the second flow's reply
/// tuple would be the first's, so its backend would take its SYN for the
/// first connection (a challenge ACK or an RST) and the first flow's
/// replies would leave from the second frontend. As netfilter's NAT does
/// for a clashing reply tuple, the second flow gets another source port
/// toward the backend; both flows then translate both ways, each with its
/// own frontend. A flow through the same frontend again, or past an
/// expired flow of another frontend, keeps the client's port.
#[test]
fn one_client_port_through_two_frontends_of_one_local_backend() {
    if skip() {
        return;
    }
    let cases = [
        ("192.168.77.100", NODE4, "10.244.1.10"),
        ("fd00:77::100", NODE6, "fd00:244:1::10"),
    ];
    for (client, node, pod) in cases {
        let mut fx = Fixture::new();
        fx.snat_ports(61_000, 61_999);
        fx.tcp_timeout(5);
        fx.backend(1, pod, 8080, proto::TCP, true);
        fx.frontend(node, 30080, proto::TCP, 7, &[1]);
        fx.frontend(node, 30081, proto::TCP, 8, &[1]);

        let (rc, out) = fx.run(
            "tc_ingress",
            &Frame::tcp(client, 40000, node, 30080, TCP_SYN),
        );
        assert_eq!(rc, OK);
        let a = parse(&out);
        assert_eq!(
            (a.src, a.sport, a.dst, a.dport),
            (ip(client), 40000, ip(pod), 8080)
        );
        let (rc, out) = fx.run(
            "tc_ingress",
            &Frame::tcp(client, 40000, node, 30081, TCP_SYN),
        );
        assert_eq!(rc, OK);
        let b = parse(&out);
        assert_eq!(
            (b.src, b.dst, b.dport),
            (ip(client), ip(pod), 8080),
            "{client}"
        );
        assert!(
            (61_000..=61_999).contains(&b.sport),
            "{client}: the second flow's port toward the backend is {} (not remapped)",
            b.sport
        );
        assert_eq!(fx.stat(stat::TC_SOURCE_PORT_REMAPPED), 1);
        let fwd = fx.entry(client, 40000, node, 30081, proto::TCP).unwrap();
        assert_eq!((fwd.flags, fwd.nat_sport), (ct_flags::LOCAL, b.sport));

        // Each flow's replies leave from its own frontend, to the client's port.
        for (port, frontend) in [(40000, 30080), (b.sport, 30081)] {
            let (rc, out) = fx.run(
                "tc_egress",
                &Frame::tcp(pod, 8080, client, port, TCP_SYN | TCP_ACK),
            );
            assert_eq!(rc, OK, "{client}: reply to port {port}");
            let r = parse(&out);
            assert_eq!(
                (r.src, r.sport, r.dst, r.dport),
                (ip(node), frontend, ip(client), 40000),
                "{client}: reply to port {port}"
            );
        }
        // And each flow's later packets keep their own port.
        for (frontend, port) in [(30080, 40000), (30081, b.sport)] {
            let (rc, out) = fx.run(
                "tc_ingress",
                &Frame::tcp(client, 40000, node, frontend, TCP_ACK),
            );
            assert_eq!(rc, OK);
            assert_eq!(parse(&out).sport, port, "{client}: ACK through {frontend}");
        }

        // Through the first frontend again, on its own reply tuple (the
        // forward entry gone, as after an eviction): the client's port.
        fx.conntrack
            .remove(&ct_key(client, 40000, node, 30080, proto::TCP))
            .unwrap();
        let (_, out) = fx.run(
            "tc_ingress",
            &Frame::tcp(client, 40000, node, 30080, TCP_SYN),
        );
        assert_eq!(
            parse(&out).sport,
            40000,
            "{client}: same frontend, same tuple"
        );
        assert_eq!(fx.stat(stat::TC_SOURCE_PORT_REMAPPED), 1);

        // Past an expired flow of another frontend: the client's port.
        let reply_key = ct_key(pod, 8080, client, 40001, proto::TCP);
        fx.run(
            "tc_ingress",
            &Frame::tcp(client, 40001, node, 30080, TCP_SYN),
        );
        fx.run(
            "tc_egress",
            &Frame::tcp(pod, 8080, client, 40001, TCP_SYN | TCP_ACK),
        );
        fx.ack(client, 40001, node, 30080);
        let mut e = fx.conntrack.get(&reply_key, 0).unwrap();
        e.last_seen_ns = 1;
        fx.conntrack.insert(reply_key, e, 0).unwrap();
        let (_, out) = fx.run(
            "tc_ingress",
            &Frame::tcp(client, 40001, node, 30081, TCP_SYN),
        );
        assert_eq!(parse(&out).sport, 40001, "{client}: the other flow expired");
        assert_eq!(fx.stat(stat::TC_SOURCE_PORT_REMAPPED), 1);

        // UDP alike: one socket's datagrams to two frontends of one pod.
        fx.backend(2, pod, 53, proto::UDP, true);
        fx.frontend(node, 30053, proto::UDP, 9, &[2]);
        fx.frontend(node, 30054, proto::UDP, 10, &[2]);
        let (_, out) = fx.run("tc_ingress", &Frame::udp(client, 5353, node, 30053));
        assert_eq!(parse(&out).sport, 5353);
        let (rc, out) = fx.run("tc_ingress", &Frame::udp(client, 5353, node, 30054));
        assert_eq!(rc, OK);
        let remapped = parse(&out).sport;
        assert!(
            (61_000..=61_999).contains(&remapped),
            "{client}: UDP {remapped}"
        );
        assert_eq!(fx.stat(stat::TC_SOURCE_PORT_REMAPPED), 2);
        for (port, frontend) in [(5353, 30053), (remapped, 30054)] {
            let (rc, out) = fx.run("tc_egress", &Frame::udp(pod, 53, client, port));
            assert_eq!(rc, OK, "{client}: UDP reply to port {port}");
            let r = parse(&out);
            assert_eq!(
                (r.src, r.sport, r.dport),
                (ip(node), frontend, 5353),
                "{client}: UDP reply to port {port}"
            );
        }
    }
}

/// A preallocated hash map reuses a replaced element for the next update
/// on the writer's CPU at once, so a program that looked a key up just
/// before can copy another key's value (docs/maps.md, "Recycled
/// elements"); `sock_stress` saw a connect to one Service answered by
/// another's pod. Each value carries its key's `KeyCheck`: a value
/// written for another key, in any of the three maps, is never used
/// (counted as `foreign_value`), and the right one is used again once it
/// is back.
#[test]
fn a_value_written_for_another_key_is_never_used() {
    if skip() {
        return;
    }
    let (client, node, pod1, pod2) = ("192.168.77.100", NODE4, "10.244.1.10", "10.244.1.11");
    let mut fx = Fixture::new();
    fx.backend(1, pod1, 8080, proto::TCP, true);
    fx.backend(2, pod2, 8080, proto::TCP, true);
    fx.frontend(node, 30080, proto::TCP, 7, &[1]);
    fx.frontend(node, 30081, proto::TCP, 8, &[2]);
    let key = |port| ServiceKey {
        addr: addr_bytes(ip(node)),
        port,
        proto: proto::TCP,
        scope: scope::EXTERNAL,
    };
    let (a, b) = (key(30080), key(30081));
    let a_value = fx.services.get(&a, 0).unwrap();
    let b_value = fx.services.get(&b, 0).unwrap();
    let a_slot = a_value.slot_base;
    let (a_slot_value, b_slot_value) = (
        fx.slots.get(&a_slot, 0).unwrap(),
        fx.slots.get(&b_value.slot_base, 0).unwrap(),
    );
    let (backend1, backend2) = (
        fx.backends.get(&1, 0).unwrap(),
        fx.backends.get(&2, 0).unwrap(),
    );
    let mut port = 41000;
    let mut connect = |fx: &mut Fixture| {
        port += 1;
        let (rc, out) = fx.run(
            "tc_ingress",
            &Frame::tcp(client, port, node, 30080, TCP_SYN),
        );
        (rc == OK).then(|| parse(&out).dst)
    };
    assert_eq!(connect(&mut fx), Some(ip(pod1)), "the fixture serves pod1");
    // (what, write another key's value, write the right one back)
    type Edit = Box<dyn Fn(&mut Fixture)>;
    let foreign: [(&str, Edit, Edit); 3] = [
        (
            "LB_SERVICES: the other frontend's value",
            Box::new(move |fx| fx.services.insert(a, b_value, 0).unwrap()),
            Box::new(move |fx| fx.services.insert(a, a_value, 0).unwrap()),
        ),
        (
            "LB_SLOTS: the other set's slot",
            Box::new(move |fx| fx.slots.set(a_slot, b_slot_value, 0).unwrap()),
            Box::new(move |fx| fx.slots.set(a_slot, a_slot_value, 0).unwrap()),
        ),
        (
            "LB_BACKENDS: the other backend",
            Box::new(move |fx| fx.backends.set(1, backend2, 0).unwrap()),
            Box::new(move |fx| fx.backends.set(1, backend1, 0).unwrap()),
        ),
    ];
    for (what, spoil, mend) in foreign {
        let before = fx.stat(stat::FOREIGN_VALUE);
        spoil(&mut fx);
        let got = connect(&mut fx);
        assert_ne!(got, Some(ip(pod2)), "{what}: used for the wrong key");
        // Counted once (a hash value is looked up twice first).
        assert_eq!(fx.stat(stat::FOREIGN_VALUE), before + 1, "{what}");
        mend(&mut fx);
        assert_eq!(connect(&mut fx), Some(ip(pod1)), "{what}: mended");
    }
}

/// Remote backend, per family and protocol: DNAT + SNAT to the node's
/// address and a port from the SNAT range; the backend's reply arriving at
/// ingress is translated back to frontend -> client.
#[test]
fn remote_backend_masquerade_and_reply() {
    if skip() {
        return;
    }
    let cases = [
        ("192.168.77.100", NODE4, "10.244.2.10", proto::TCP),
        ("192.168.77.100", NODE4, "10.244.2.10", proto::UDP),
        ("fd00:77::100", NODE6, "fd00:244:2::10", proto::TCP),
        ("fd00:77::100", NODE6, "fd00:244:2::10", proto::UDP),
    ];
    for (client, node, pod, l4) in cases {
        let mut fx = Fixture::new();
        fx.backend(1, pod, 8080, l4, false);
        fx.frontend(node, 30080, l4, 9, &[1]);
        let first = if l4 == proto::TCP {
            Frame::tcp(client, 40000, node, 30080, TCP_SYN)
        } else {
            Frame::udp(client, 40000, node, 30080)
        };
        let (rc, out) = fx.run("tc_ingress", &first);
        // Redirected when the FIB can forward; test runs happen on the
        // loopback device, where it cannot: passed on.
        assert!(rc == OK || rc == REDIRECT, "{rc}");
        let p = parse(&out);
        assert_eq!(p.src, ip(node), "masqueraded");
        assert!(
            (61_000..=65_535).contains(&p.sport),
            "SNAT port {}",
            p.sport
        );
        assert_eq!((p.dst, p.dport), (ip(pod), 8080));
        let snat_port = p.sport;
        let fwd = fx.entry(client, 40000, node, 30080, l4).unwrap();
        assert_eq!(fwd.flags, ct_flags::SNAT);
        let rev = fx.entry(pod, 8080, node, snat_port, l4).unwrap();
        assert_eq!(rev.flags, ct_flags::SNAT | ct_flags::REPLY);

        let reply = if l4 == proto::TCP {
            Frame::tcp(pod, 8080, node, snat_port, TCP_SYN | TCP_ACK)
        } else {
            Frame::udp(pod, 8080, node, snat_port)
        };
        let (rc, out) = fx.run("tc_ingress", &reply);
        assert!(rc == OK || rc == REDIRECT, "{rc}");
        let p = parse(&out);
        assert_eq!((p.src, p.sport), (ip(node), 30080));
        assert_eq!((p.dst, p.dport), (ip(client), 40000));

        // A second client flow gets its own port.
        let mut second = first.clone();
        second.sport = 40001;
        let (_, out) = fx.run("tc_ingress", &second);
        assert_ne!(parse(&out).sport, snat_port);
    }
}

/// SNAT ports are reserved with BPF_NOEXIST: a taken port is never given
/// to a second flow (the second one is dropped, its tries counted); the
/// client reopening its port after its flow closed gets a new flow on the
/// port; once the flow's entries are gone (the agent's sweep, after the
/// close timeout) another client gets it.
#[test]
fn snat_ports_are_reused_only_when_the_flow_is_over() {
    if skip() {
        return;
    }
    let (client, pod) = ("192.168.77.100", "10.244.2.10");
    let mut fx = Fixture::new();
    fx.snat_ports(61_000, 61_000);
    fx.backend(1, pod, 8080, proto::TCP, false);
    fx.frontend(NODE4, 30080, proto::TCP, 9, &[1]);
    let syn = |port| Frame::tcp(client, port, NODE4, 30080, TCP_SYN);

    let (_, out) = fx.run("tc_ingress", &syn(40000));
    assert_eq!(parse(&out).sport, 61_000);
    let (rc, _) = fx.run("tc_ingress", &syn(40001));
    assert_eq!(rc, SHOT, "the only port is taken by a live flow");
    assert_eq!(fx.stat(stat::TC_DROP_SNAT_EXHAUSTED), 1);
    assert_eq!(fx.stat(stat::TC_SNAT_RETRY), 16, "every try counted");

    // Established, then half-closed: the port stays taken.
    let (rc, _) = fx.run(
        "tc_ingress",
        &Frame::tcp(pod, 8080, NODE4, 61_000, TCP_SYN | TCP_ACK).seq_ack(500, 2),
    );
    assert!(rc == OK || rc == REDIRECT, "{rc}");
    fx.run(
        "tc_ingress",
        &Frame::tcp(client, 40000, NODE4, 30080, TCP_FIN | TCP_ACK).seq_ack(2, 501),
    );
    let (rc, _) = fx.run("tc_ingress", &syn(40001));
    assert_eq!(rc, SHOT, "a half-closed flow keeps its port");

    // An RST of the flow: translated, closing, its entries kept.
    let rst = Frame::tcp(client, 40000, NODE4, 30080, TCP_RST | TCP_ACK).seq_ack(3, 501);
    let (rc, out) = fx.run("tc_ingress", &rst);
    assert!(rc == OK || rc == REDIRECT, "{rc}");
    assert_eq!((parse(&out).dst, parse(&out).sport), (ip(pod), 61_000));
    let rev = fx.entry(pod, 8080, NODE4, 61_000, proto::TCP).unwrap();
    assert_eq!(rev.state[ct_state::CLOSING], 1);

    // The client reopens its port: the old flow is over, its port is free.
    let (rc, out) = fx.run("tc_ingress", &syn(40000));
    assert!(rc == OK || rc == REDIRECT, "{rc}");
    assert_eq!(parse(&out).sport, 61_000);
    let rev = fx.entry(pod, 8080, NODE4, 61_000, proto::TCP).unwrap();
    assert_eq!(rev.state, [0; ct_state::COUNT], "a new flow");

    // Its entries removed (as the sweep does after the close timeout): the
    // port answers another client.
    for key in [
        ct_key(client, 40000, NODE4, 30080, proto::TCP),
        ct_key(pod, 8080, NODE4, 61_000, proto::TCP),
    ] {
        let _ = fx.conntrack.remove(&key);
        let _ = fx.conntrack_syn.remove(&key);
    }
    let (rc, out) = fx.run("tc_ingress", &syn(40001));
    assert!(rc == OK || rc == REDIRECT, "{rc}");
    assert_eq!(parse(&out).sport, 61_000);
    let reply = fx.entry(pod, 8080, NODE4, 61_000, proto::TCP).unwrap();
    assert_eq!(
        reply.nat_dport, 40001,
        "the port now answers the new client"
    );
}

/// CLOCK_MONOTONIC, the clock of `bpf_ktime_get_ns`, `back` ago.
fn monotonic_ns_ago(back: Duration) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to fill in.
    assert_eq!(
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) },
        0
    );
    let now = ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64;
    now.checked_sub(back.as_nanos() as u64)
        .expect("the machine has been up longer than the test backdates")
}

/// A backend that closes first holds the tuple in TIME_WAIT for 60 s
/// (Linux's TCP_TIMEWAIT_LEN): a SYN from another client on the same SNAT
/// port meanwhile meets it, and is dropped when its timestamp is older
/// (another client's clock: half the time). So a flow the backend closed
/// first keeps its SNAT port for 60 s, past the 10 s close timeout; one the
/// client closed first gives it back after the close timeout, as before.
#[test]
fn a_snat_port_stays_taken_while_the_backend_is_in_time_wait() {
    if skip() {
        return;
    }
    let (pod, node) = ("10.244.2.10", NODE4);
    for backend_first in [true, false] {
        let mut fx = Fixture::new();
        fx.snat_ports(61_000, 61_000);
        fx.backend(1, pod, 8080, proto::TCP, false);
        fx.frontend(node, 30080, proto::TCP, 9, &[1]);
        let (first, second) = ("192.168.77.100", "192.168.77.101");
        let (_, out) = fx.run(
            "tc_ingress",
            &Frame::tcp(first, 40000, node, 30080, TCP_SYN),
        );
        assert_eq!(parse(&out).sport, 61_000);
        fx.run(
            "tc_ingress",
            &Frame::tcp(pod, 8080, node, 61_000, TCP_SYN | TCP_ACK).seq_ack(500, 2),
        );
        fx.run(
            "tc_ingress",
            &Frame::tcp(first, 40000, node, 30080, TCP_ACK).seq_ack(2, 501),
        );
        let client_fin = Frame::tcp(first, 40000, node, 30080, TCP_FIN | TCP_ACK).seq_ack(2, 501);
        let backend_fin = Frame::tcp(pod, 8080, node, 61_000, TCP_FIN | TCP_ACK).seq_ack(501, 3);
        let order = if backend_first {
            [("tc_ingress", &backend_fin), ("tc_ingress", &client_fin)]
        } else {
            [("tc_ingress", &client_fin), ("tc_ingress", &backend_fin)]
        };
        for (prog, frame) in order {
            let (rc, _) = fx.run(prog, frame);
            assert!(rc == OK || rc == REDIRECT, "{rc}");
        }
        let keys = [
            ct_key(first, 40000, node, 30080, proto::TCP),
            ct_key(pod, 8080, node, 61_000, proto::TCP),
        ];
        for k in &keys {
            let e = fx.conntrack.get(k, 0).unwrap();
            assert_eq!(e.state[ct_state::CLOSING], 1);
            assert_eq!(
                e.backend_time_wait, backend_first as u8,
                "backend first: {backend_first}"
            );
        }
        // 20 s after the close: past the close timeout (10 s), within the
        // backend's TIME_WAIT.
        let backdate = |fx: &mut Fixture, ago: u64| {
            for k in &keys {
                let mut e = fx.conntrack.get(k, 0).unwrap();
                e.last_seen_ns = monotonic_ns_ago(Duration::from_secs(ago));
                fx.conntrack.insert(*k, e, 0).unwrap();
            }
        };
        backdate(&mut fx, 20);
        let (rc, out) = fx.run(
            "tc_ingress",
            &Frame::tcp(second, 40000, node, 30080, TCP_SYN),
        );
        if backend_first {
            assert_eq!(rc, SHOT, "the port is the backend's TIME_WAIT tuple");
            assert_eq!(fx.stat(stat::TC_DROP_SNAT_EXHAUSTED), 1);
            // Past its TIME_WAIT: the port is free.
            backdate(&mut fx, 61);
            let (rc, out) = fx.run(
                "tc_ingress",
                &Frame::tcp(second, 40000, node, 30080, TCP_SYN),
            );
            assert!(rc == OK || rc == REDIRECT, "{rc}");
            assert_eq!(parse(&out).sport, 61_000);
        } else {
            assert!(rc == OK || rc == REDIRECT, "client closed first: {rc}");
            assert_eq!(parse(&out).sport, 61_000);
        }
    }
}

/// Only a SYN opens a TCP flow: a mid-flow packet without one (its flow
/// expired, was evicted, never was) is dropped as netfilter's INVALID,
/// never given a backend.
#[test]
fn only_a_syn_opens_a_flow() {
    if skip() {
        return;
    }
    let mut fx = Fixture::new();
    fx.backend(1, "10.244.1.10", 8080, proto::TCP, true);
    // A LoadBalancer IP, and a NodePort on the node's address.
    let lb_ip = "203.0.113.10";
    fx.frontend(lb_ip, 80, proto::TCP, 1, &[1]);
    fx.frontend(NODE4, 30080, proto::TCP, 2, &[1]);
    fx.flag(
        NODE4,
        30080,
        proto::TCP,
        lb_common::service_flags::NODE_ADDRESS,
    );
    let client = "192.168.77.100";
    let mid_flow = [
        TCP_ACK,
        TCP_ACK | TCP_FIN,
        TCP_RST,
        TCP_RST | TCP_ACK,
        TCP_SYN | TCP_ACK,
        TCP_SYN | TCP_FIN,
        0,
    ];
    for (i, flags) in mid_flow.into_iter().enumerate() {
        let (rc, _) = fx.run("tc_ingress", &Frame::tcp(client, 40000, lb_ip, 80, flags));
        assert_eq!(rc, SHOT, "flags {flags:#x}");
        assert_eq!(fx.stat(stat::TC_DROP_INVALID), i as u64 + 1);
    }
    // To a node address: left to the stack, untouched (netfilter's
    // conntrack may know the flow; else the node answers with an RST).
    for (i, flags) in mid_flow.into_iter().enumerate() {
        let frame = Frame::tcp(client, 40000, NODE4, 30080, flags);
        let (rc, out) = fx.run("tc_ingress", &frame);
        assert_eq!(rc, UNSPEC, "flags {flags:#x}");
        assert_eq!(out, frame.bytes(), "flags {flags:#x}: rewritten");
        assert_eq!(fx.stat(stat::TC_PASS_NO_FLOW), i as u64 + 1);
    }
    assert_eq!(fx.stat(stat::TC_DROP_INVALID), mid_flow.len() as u64);
    assert!(fx.conntrack.keys().next().is_none());
    assert!(fx.conntrack_syn.keys().next().is_none(), "no flow recorded");
    for (dst, port) in [(lb_ip, 80), (NODE4, 30080)] {
        let (rc, _) = fx.run("tc_ingress", &Frame::tcp(client, 40000, dst, port, TCP_SYN));
        assert_eq!(rc, OK);
    }
}

/// An RST ends a flow only if it belongs to it: once established, its
/// sequence number must be where the other end expects this end's next
/// byte. One that does not is dropped and counted; the flow goes on.
#[test]
fn an_rst_must_belong_to_its_flow() {
    if skip() {
        return;
    }
    let (client, pod) = ("192.168.77.100", "10.244.1.10");
    let mut fx = Fixture::new();
    fx.backend(1, pod, 8080, proto::TCP, true);
    fx.frontend(NODE4, 30080, proto::TCP, 1, &[1]);
    let to_node = |flags| Frame::tcp(client, 40000, NODE4, 30080, flags);
    let from_pod = |flags| Frame::tcp(pod, 8080, client, 40000, flags);
    // Handshake: client ISN 1000, backend ISN 5000.
    fx.run("tc_ingress", &to_node(TCP_SYN).seq_ack(1000, 0));
    fx.run(
        "tc_egress",
        &from_pod(TCP_SYN | TCP_ACK).seq_ack(5000, 1001),
    );
    fx.run("tc_ingress", &to_node(TCP_ACK).seq_ack(1001, 5001));
    // The backend sent 100 bytes, the client acknowledged them.
    fx.run("tc_egress", &from_pod(TCP_ACK).seq_ack(5001, 1001));
    fx.run("tc_ingress", &to_node(TCP_ACK).seq_ack(1001, 5101));

    for (what, seq) in [
        ("far ahead", 1001u32.wrapping_add(1 << 30)),
        ("far behind", 1001u32.wrapping_sub(1 << 20)),
    ] {
        let (rc, _) = fx.run("tc_ingress", &to_node(TCP_RST).seq_ack(seq, 0));
        assert_eq!(rc, SHOT, "{what}: dropped");
        let fwd = fx.entry(client, 40000, NODE4, 30080, proto::TCP).unwrap();
        assert_eq!(fwd.state[ct_state::CLOSING], 0, "{what}: the flow goes on");
    }
    // From the backend's side too.
    let (rc, _) = fx.run("tc_egress", &from_pod(TCP_RST).seq_ack(9_000_000, 0));
    assert_eq!(rc, SHOT);
    assert_eq!(fx.stat(stat::TC_DROP_BAD_RST), 3);
    let (rc, out) = fx.run("tc_ingress", &to_node(TCP_ACK).seq_ack(1001, 5101));
    assert_eq!((rc, parse(&out).dst), (OK, ip(pod)), "still translated");

    // The backend's own RST, at its next sequence number: the flow closes,
    // its entries stay for the close timeout, and late packets translate.
    let (rc, out) = fx.run("tc_egress", &from_pod(TCP_RST).seq_ack(5101, 0));
    assert_eq!((rc, parse(&out).src), (OK, ip(NODE4)));
    for e in [
        fx.entry(client, 40000, NODE4, 30080, proto::TCP).unwrap(),
        fx.entry(pod, 8080, client, 40000, proto::TCP).unwrap(),
    ] {
        assert_eq!(e.state[ct_state::CLOSING], 1);
    }
    let (rc, out) = fx.run("tc_ingress", &to_node(TCP_ACK).seq_ack(1001, 5101));
    assert_eq!((rc, parse(&out).dst), (OK, ip(pod)), "a late packet");
}

/// A SYN with another sequence number on an established flow's tuple
/// (spoofed, or a stray) leaves the flow as it is: only an unfinished
/// handshake is reopened by a new SYN (`CtEntry::another_syn`).
#[test]
fn a_new_syn_on_an_established_flow_leaves_it() {
    if skip() {
        return;
    }
    let (client, pod) = ("192.168.77.100", "10.244.1.10");
    let mut fx = Fixture::new();
    fx.backend(1, pod, 8080, proto::TCP, true);
    fx.frontend(NODE4, 30080, proto::TCP, 1, &[1]);
    let to_node = |flags| Frame::tcp(client, 40000, NODE4, 30080, flags);
    let from_pod = |flags| Frame::tcp(pod, 8080, client, 40000, flags);
    fx.run("tc_ingress", &to_node(TCP_SYN).seq_ack(1000, 0));
    fx.run(
        "tc_egress",
        &from_pod(TCP_SYN | TCP_ACK).seq_ack(5000, 1001),
    );
    fx.run("tc_ingress", &to_node(TCP_ACK).seq_ack(1001, 5001));
    assert!(!fx.in_syn_table(client, 40000, NODE4, 30080, proto::TCP));

    fx.run("tc_ingress", &to_node(TCP_SYN).seq_ack(777_777, 0));
    assert!(
        !fx.in_syn_table(client, 40000, NODE4, 30080, proto::TCP),
        "the SYN opened a new flow in place of the established one"
    );
    for e in [
        fx.entry(client, 40000, NODE4, 30080, proto::TCP).unwrap(),
        fx.entry(pod, 8080, client, 40000, proto::TCP).unwrap(),
    ] {
        assert_eq!(e.state[ct_state::SEEN_REPLY], 1, "still established");
        assert_eq!(e.state[ct_state::CLOSING], 0);
    }
    let (rc, out) = fx.run("tc_ingress", &to_node(TCP_ACK).seq_ack(1001, 5001));
    assert_eq!((rc, parse(&out).dst), (OK, ip(pod)), "still translated");
}

/// Entries are refreshed on many CPUs: one stamped later than this CPU's
/// clock (refreshed after it read the clock) is live, not 2^64 ns old.
#[test]
fn an_entry_refreshed_on_another_cpu_is_live() {
    if skip() {
        return;
    }
    let (client, pod, other) = ("192.168.77.100", "10.244.1.10", "10.244.1.11");
    let mut fx = Fixture::new();
    fx.backend(1, pod, 8080, proto::TCP, true);
    fx.backend(2, other, 8080, proto::TCP, true);
    fx.frontend(NODE4, 30080, proto::TCP, 1, &[1]);
    fx.run(
        "tc_ingress",
        &Frame::tcp(client, 40000, NODE4, 30080, TCP_SYN),
    );
    fx.run(
        "tc_egress",
        &Frame::tcp(pod, 8080, client, 40000, TCP_SYN | TCP_ACK),
    );
    fx.ack(client, 40000, NODE4, 30080);
    fx.frontend(NODE4, 30080, proto::TCP, 1, &[2]);
    // Stamp both entries ahead of the clock, as another CPU's refresh
    // racing this CPU's read of the clock leaves them.
    let ahead = lb_agent::base::clock::monotonic_now_ns() + 5_000_000_000;
    for key in [
        ct_key(client, 40000, NODE4, 30080, proto::TCP),
        ct_key(pod, 8080, client, 40000, proto::TCP),
    ] {
        let mut e = fx.conntrack.get(&key, 0).unwrap();
        e.last_seen_ns = ahead;
        fx.conntrack.insert(key, e, 0).unwrap();
    }
    let (rc, out) = fx.run(
        "tc_ingress",
        &Frame::tcp(client, 40000, NODE4, 30080, TCP_ACK),
    );
    assert_eq!(rc, OK);
    assert_eq!(parse(&out).dst, ip(pod), "the flow keeps its backend");
}

/// A SYN flood fills LB_CT_SYN only: an established flow in LB_CONNTRACK is
/// never evicted by it, and a new client still connects. The backend
/// answers every spoofed SYN, as a real one does: its SYN-ACK alone does
/// not make a flow established (the spoofed client never acknowledges it),
/// so the flood's flows stay in LB_CT_SYN under the SYN timeout.
#[test]
fn a_syn_flood_evicts_no_established_flow() {
    if skip() {
        return;
    }
    let (client, pod) = ("192.168.77.100", "10.244.2.10");
    let mut fx = Fixture::new();
    fx.backend(1, pod, 8080, proto::TCP, false);
    fx.frontend(NODE4, 30080, proto::TCP, 1, &[1]);
    fx.run(
        "tc_ingress",
        &Frame::tcp(client, 40000, NODE4, 30080, TCP_SYN),
    );
    let snat = fx
        .entry(client, 40000, NODE4, 30080, proto::TCP)
        .unwrap()
        .nat_sport;
    fx.run(
        "tc_ingress",
        &Frame::tcp(pod, 8080, NODE4, snat, TCP_SYN | TCP_ACK),
    );
    fx.ack(client, 40000, NODE4, 30080);
    // Ten times the size of either table, from spoofed sources, each
    // answered by the backend.
    let mut answered = 0;
    for i in 0..2560u32 {
        let src = format!("198.18.{}.{}", i / 250, 1 + i % 250);
        let sport = 1024 + (i % 60_000) as u16;
        let (rc, out) = fx.run(
            "tc_ingress",
            &Frame::tcp(&src, sport, NODE4, 30080, TCP_SYN),
        );
        if rc != OK && rc != REDIRECT {
            continue;
        }
        let nat_sport = parse(&out).sport;
        // Dropped after it is tracked: the spoofed sources have no route.
        fx.run(
            "tc_ingress",
            &Frame::tcp(pod, 8080, NODE4, nat_sport, TCP_SYN | TCP_ACK).seq_ack(9000 + i, 1),
        );
        let fwd = fx.entry(&src, sport, NODE4, 30080, proto::TCP).unwrap();
        assert_eq!(fwd.ack_seq, 9001 + i, "the SYN-ACK was tracked");
        assert!(
            fx.in_syn_table(pod, 8080, NODE4, nat_sport, proto::TCP),
            "a SYN-ACK alone leaves the flow in LB_CT_SYN"
        );
        answered += 1;
    }
    assert!(answered > 2000, "the backend answered {answered} SYNs");
    assert!(
        fx.conntrack
            .get(&ct_key(client, 40000, NODE4, 30080, proto::TCP), 0)
            .is_ok()
            && fx
                .conntrack
                .get(&ct_key(pod, 8080, NODE4, snat, proto::TCP), 0)
                .is_ok(),
        "the established flow survived the flood"
    );
    let (rc, out) = fx.run(
        "tc_ingress",
        &Frame::tcp(client, 40000, NODE4, 30080, TCP_ACK),
    );
    assert!(rc == OK || rc == REDIRECT, "{rc}");
    assert_eq!(parse(&out).dst, ip(pod));
    let (rc, _) = fx.run(
        "tc_ingress",
        &Frame::tcp(client, 40001, NODE4, 30080, TCP_SYN),
    );
    assert!(rc == OK || rc == REDIRECT, "a new client connects: {rc}");
}

/// A new flow that finds every SNAT port it tries taken takes the port of
/// an unfinished handshake idle for 3 s both ways (a spoofed SYN's, which
/// its backend answered): never of a handshake that is still moving, nor
/// of an established flow.
#[test]
fn an_idle_unfinished_handshake_gives_up_its_snat_port() {
    if skip() {
        return;
    }
    let (pod, spoofed, client) = ("10.244.2.10", "198.18.0.1", "192.168.77.100");
    let mut fx = Fixture::new();
    // One port, so that every try meets the same holder.
    fx.snat_ports(61_000, 61_000);
    fx.backend(1, pod, 8080, proto::TCP, false);
    fx.frontend(NODE4, 30080, proto::TCP, 1, &[1]);
    let syn = |src: &str, sport: u16| Frame::tcp(src, sport, NODE4, 30080, TCP_SYN);
    let (_, out) = fx.run("tc_ingress", &syn(spoofed, 1000));
    assert_eq!(parse(&out).sport, 61_000);
    fx.run(
        "tc_ingress",
        &Frame::tcp(pod, 8080, NODE4, 61_000, TCP_SYN | TCP_ACK).seq_ack(5000, 1),
    );
    let fwd_key = ct_key(spoofed, 1000, NODE4, 30080, proto::TCP);
    let rev_key = ct_key(pod, 8080, NODE4, 61_000, proto::TCP);
    let age = |fx: &mut Fixture, key: &CtKey, secs: u64| {
        let mut e = fx.conntrack_syn.get(key, 0).unwrap();
        e.last_seen_ns = monotonic_ns_ago(Duration::from_secs(secs));
        fx.conntrack_syn.insert(*key, e, 0).unwrap();
    };
    let exhausted = fx.stat(stat::TC_DROP_SNAT_EXHAUSTED);
    let reclaimed = fx.stat(stat::TC_SNAT_RECLAIMED);

    // Fresh, then idle on one side only: the port stays taken.
    for (fwd_ago, rev_ago) in [(0, 0), (10, 0), (0, 10)] {
        age(&mut fx, &fwd_key, fwd_ago);
        age(&mut fx, &rev_key, rev_ago);
        let (rc, _) = fx.run("tc_ingress", &syn(client, 40000));
        assert_eq!(rc, SHOT, "idle {fwd_ago} s / {rev_ago} s: kept");
        assert!(fx.in_syn_table(spoofed, 1000, NODE4, 30080, proto::TCP));
    }
    assert_eq!(fx.stat(stat::TC_DROP_SNAT_EXHAUSTED), exhausted + 3);

    // Idle both ways: the new flow takes the port, the old entries go.
    age(&mut fx, &fwd_key, 4);
    age(&mut fx, &rev_key, 4);
    let (rc, out) = fx.run("tc_ingress", &syn(client, 40000));
    assert!(rc == OK || rc == REDIRECT, "{rc}");
    assert_eq!(parse(&out).sport, 61_000);
    assert_eq!(fx.stat(stat::TC_SNAT_RECLAIMED), reclaimed + 1);
    assert!(!fx.in_syn_table(spoofed, 1000, NODE4, 30080, proto::TCP));
    let rev = fx.conntrack_syn.get(&rev_key, 0).unwrap();
    assert_eq!(rev.nat_dst, addr_bytes(ip(client)), "the new flow's reply");
    // Its handshake completes and its replies reach it.
    let (_, out) = fx.run(
        "tc_ingress",
        &Frame::tcp(pod, 8080, NODE4, 61_000, TCP_SYN | TCP_ACK),
    );
    assert_eq!((parse(&out).dst, parse(&out).dport), (ip(client), 40000));
    fx.ack(client, 40000, NODE4, 30080);

    // An established flow keeps its port, however idle.
    let mut e = fx.conntrack.get(&rev_key, 0).unwrap();
    e.last_seen_ns = monotonic_ns_ago(Duration::from_secs(10));
    fx.conntrack.insert(rev_key, e, 0).unwrap();
    let (rc, _) = fx.run("tc_ingress", &syn(spoofed, 1001));
    assert_eq!(rc, SHOT);
    assert_eq!(fx.stat(stat::TC_SNAT_RECLAIMED), reclaimed + 1);
    assert!(fx.conntrack.get(&rev_key, 0).is_ok());
}

/// What must not be translated, and what must be dropped.
#[test]
fn drops_and_pass_throughs() {
    if skip() {
        return;
    }
    let mut fx = Fixture::new();
    fx.backend(1, "10.244.1.10", 8080, proto::TCP, true);
    fx.frontend(NODE4, 30080, proto::TCP, 1, &[1]);
    // externalTrafficPolicy Local on a node without local endpoints.
    fx.frontend(NODE4, 30081, proto::TCP, 2, &[]);
    let client = "192.168.77.100";
    let cases: [(&str, Frame, u32); 4] = [
        (
            "CVE-2020-8558: NodePort on 127.0.0.1",
            Frame::tcp(client, 40000, "127.0.0.1", 30080, TCP_SYN),
            SHOT,
        ),
        (
            "IPv6 loopback",
            Frame::tcp("fd00:77::100", 40000, "::1", 30080, TCP_SYN),
            SHOT,
        ),
        (
            "no backend",
            Frame::tcp(client, 40000, NODE4, 30081, TCP_SYN),
            SHOT,
        ),
        (
            "not a frontend",
            Frame::tcp(client, 40000, NODE4, 22, TCP_SYN),
            UNSPEC,
        ),
    ];
    for (what, frame, want) in cases {
        let input = frame.bytes();
        let (rc, out) = fx.run_bytes("tc_ingress", &input);
        assert_eq!(rc, want, "{what}");
        if want == UNSPEC {
            assert_eq!(out, input, "{what}: untouched");
        }
    }
    assert!(fx.conntrack.keys().next().is_none(), "no flow recorded");
    // ARP and other non-IP frames pass.
    let mut arp = Frame::tcp(client, 1, NODE4, 2, 0).bytes();
    arp[12..14].copy_from_slice(&0x0806u16.to_be_bytes());
    assert_eq!(fx.run_bytes("tc_ingress", &arp).0, UNSPEC);
    // ICMP (an error about a flow, say) and IPv6 with an extension header
    // in front of TCP are passed on untouched, never translated.
    let mut icmp = Frame::tcp(client, 40000, NODE4, 30080, TCP_SYN).bytes();
    icmp[14 + 9] = 1;
    let mut hop_by_hop = Frame::tcp("fd00:77::100", 40000, NODE6, 30080, TCP_SYN).bytes();
    hop_by_hop[14 + 6] = 0;
    for (what, input) in [("ICMP", icmp), ("IPv6 extension header", hop_by_hop)] {
        let (rc, out) = fx.run_bytes("tc_ingress", &input);
        assert_eq!(rc, UNSPEC, "{what}");
        assert_eq!(out, input, "{what}: untouched");
        let (rc, out) = fx.run_bytes("tc_egress", &input);
        assert_eq!((rc, &out), (UNSPEC, &input), "{what} on egress");
    }
}

/// An IPv4 UDP datagram without a checksum keeps none.
#[test]
fn udp_without_checksum_stays_without() {
    if skip() {
        return;
    }
    let mut fx = Fixture::new();
    fx.backend(1, "10.244.1.10", 5353, proto::UDP, true);
    fx.frontend(NODE4, 30053, proto::UDP, 1, &[1]);
    let mut f = Frame::udp("192.168.77.100", 40000, NODE4, 30053);
    f.no_udp_csum = true;
    let (rc, out) = fx.run("tc_ingress", &f);
    assert_eq!(rc, OK);
    let p = parse(&out);
    assert_eq!(p.dst, ip("10.244.1.10"));
    assert_eq!(p.udp_csum, Some(0));
}

/// loadBalancerSourceRanges: a DENY marker for the frontend, ALLOW ranges.
#[test]
fn source_ranges() {
    if skip() {
        return;
    }
    let mut fx = Fixture::new();
    fx.backend(1, "10.244.1.10", 8080, proto::TCP, true);
    fx.frontend("203.0.113.10", 80, proto::TCP, 1, &[1]);
    let mut maps = tc::SourceRangeWriter::from_ebpf(&mut fx.ebpf);
    let f = model::Frontend {
        addr: ip("203.0.113.10"),
        port: 80,
        protocol: model::Protocol::Tcp,
        scope: model::Scope::External,
    };
    let wanted = std::collections::BTreeMap::from([(f, vec!["192.168.77.0/25".parse().unwrap()])]);
    assert!(maps.sync(&wanted).is_empty());
    let cases = [
        ("192.168.77.100", OK),
        ("192.168.77.200", SHOT),
        ("10.0.0.1", SHOT),
    ];
    for (client, want) in cases {
        let (rc, _) = fx.run(
            "tc_ingress",
            &Frame::tcp(client, 40000, "203.0.113.10", 80, TCP_SYN),
        );
        assert_eq!(rc, want, "{client}");
    }
    // Ranges removed: everyone again.
    assert!(maps.sync(&Default::default()).is_empty());
    let (rc, _) = fx.run(
        "tc_ingress",
        &Frame::tcp("10.0.0.1", 40001, "203.0.113.10", 80, TCP_SYN),
    );
    assert_eq!(rc, OK);
}

/// A writer that takes over `LB_SOURCE_RANGES` from an earlier one (a
/// restarted agent on the pinned map) starts from what the map holds: the
/// earlier writer's entries that are no longer wanted go.
#[test]
fn source_ranges_taken_over_from_an_earlier_writer() {
    if skip() {
        return;
    }
    use std::os::fd::AsFd as _;
    let mut fx = Fixture::new();
    fx.backend(1, "10.244.1.10", 8080, proto::TCP, true);
    fx.frontend("203.0.113.10", 80, proto::TCP, 1, &[1]);
    let aya::maps::Map::LpmTrie(data) = fx.ebpf.take_map(map_names::SOURCE_RANGES).unwrap() else {
        panic!("LB_SOURCE_RANGES is not an LPM trie")
    };
    // Another handle on the same map, as a new process opening the pin gets.
    let reopen = |data: &MapData| {
        let fd = data.fd().as_fd().try_clone_to_owned().unwrap();
        let trie = aya::maps::lpm_trie::LpmTrie::try_from(aya::maps::Map::LpmTrie(
            MapData::from_fd(fd).unwrap(),
        ))
        .unwrap();
        tc::SourceRangeWriter::adopt(trie).unwrap()
    };
    let f = model::Frontend {
        addr: ip("203.0.113.10"),
        port: 80,
        protocol: model::Protocol::Tcp,
        scope: model::Scope::External,
    };
    let only = |range: &str| std::collections::BTreeMap::from([(f, vec![range.parse().unwrap()])]);
    let mut port = 40000;
    let mut verdict = |fx: &mut Fixture, client: &str| {
        port += 1;
        fx.run(
            "tc_ingress",
            &Frame::tcp(client, port, "203.0.113.10", 80, TCP_SYN),
        )
        .0
    };
    let (a, b) = ("192.168.77.100", "192.168.77.101");

    let mut first = reopen(&data);
    assert!(first.sync(&only("192.168.77.100/32")).is_empty());
    drop(first);
    assert_eq!((verdict(&mut fx, a), verdict(&mut fx, b)), (OK, SHOT));

    // The objects changed while no writer ran.
    let mut second = reopen(&data);
    assert!(second.sync(&only("192.168.77.101/32")).is_empty());
    drop(second);
    assert_eq!(
        (verdict(&mut fx, a), verdict(&mut fx, b)),
        (SHOT, OK),
        "A's range written by the earlier writer is gone"
    );

    let mut third = reopen(&data);
    assert!(third.sync(&Default::default()).is_empty());
    assert_eq!((verdict(&mut fx, a), verdict(&mut fx, b)), (OK, OK));
    let trie = aya::maps::lpm_trie::LpmTrie::<_, lb_common::SourceRangeData, u32>::try_from(
        aya::maps::Map::LpmTrie(data),
    )
    .unwrap();
    assert_eq!(trie.keys().count(), 0, "no marker, no range left");
}

/// An IPv4 ICMP error from `src` to `dst` quoting the first 28 bytes of the
/// IP packet in `quoted` (a frame).
fn icmp4_error(src: &str, dst: &str, kind: u8, code: u8, quoted: &[u8]) -> Vec<u8> {
    let (IpAddr::V4(s), IpAddr::V4(d)) = (ip(src), ip(dst)) else {
        panic!("IPv4 only")
    };
    let mut icmp = vec![kind, code, 0, 0, 0, 0, 0x05, 0xdc];
    icmp.extend(&quoted[14..14 + 28]);
    let c = fold(sum16(&icmp));
    icmp[2..4].copy_from_slice(&c.to_be_bytes());
    let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2, 0x08, 0x00];
    let mut h = vec![0x45, 0];
    h.extend(((20 + icmp.len()) as u16).to_be_bytes());
    h.extend([0, 1, 0, 0, 64, 1, 0, 0]);
    h.extend(s.octets());
    h.extend(d.octets());
    let c = fold(sum16(&h));
    h[10..12].copy_from_slice(&c.to_be_bytes());
    f.extend(h);
    f.extend(icmp);
    f
}

/// The outer destination and the quoted tuple of an ICMP error, with the
/// outer, ICMP and quoted IP checksums verified.
fn parse_icmp4(f: &[u8]) -> (IpAddr, (IpAddr, u16), (IpAddr, u16)) {
    assert_eq!(fold(sum16(&f[14..34])), 0, "outer IP checksum");
    let icmp = &f[34..];
    assert_eq!(fold(sum16(icmp)), 0, "ICMP checksum of {f:02x?}");
    let inner = &icmp[8..];
    assert_eq!(fold(sum16(&inner[..20])), 0, "quoted IP checksum");
    let addr = |b: &[u8]| IpAddr::from(<[u8; 4]>::try_from(b).unwrap());
    let port = |b: &[u8]| u16::from_be_bytes([b[0], b[1]]);
    (
        addr(&f[30..34]),
        (addr(&inner[12..16]), port(&inner[20..22])),
        (addr(&inner[16..20]), port(&inner[22..24])),
    )
}

/// ICMP errors about a translated flow's replies (fragmentation needed from
/// the client or a router) reach the backend, quoting the packet as the
/// backend sent it; errors about nothing we translated pass untouched.
#[test]
fn icmp_errors_of_tracked_flows_reach_the_backend() {
    if skip() {
        return;
    }
    let client = "192.168.77.100";
    let router = "192.168.77.254";
    // (backend local?, what the backend's reply looked like before NAT)
    for local in [true, false] {
        let mut fx = Fixture::new();
        let pod = if local { "10.244.1.10" } else { "10.244.2.10" };
        fx.backend(1, pod, 8080, proto::TCP, local);
        fx.frontend(NODE4, 30080, proto::TCP, 3, &[1]);
        let (_, out) = fx.run(
            "tc_ingress",
            &Frame::tcp(client, 40000, NODE4, 30080, TCP_SYN),
        );
        let fwd = parse(&out);
        // The reply the client saw: frontend -> client.
        let seen = Frame::tcp(NODE4, 30080, client, 40000, TCP_SYN | TCP_ACK).bytes();
        for from in [client, router] {
            let err = icmp4_error(from, NODE4, 3, 4, &seen);
            let (rc, out) = fx.run_bytes("tc_ingress", &err);
            assert_eq!(rc, OK, "local={local} from {from}");
            let (outer_dst, q_src, q_dst) = parse_icmp4(&out);
            assert_eq!(outer_dst, ip(pod), "to the backend");
            assert_eq!(q_src, (ip(pod), 8080), "quoted as the backend sent it");
            assert_eq!(
                q_dst,
                (fwd.src, fwd.sport),
                "to the client or the SNAT port"
            );
            assert_eq!(&out[26..30], &err[26..30], "outer source kept");
        }
        // An error quoting an unknown flow is not ours.
        let other = Frame::tcp(NODE4, 30080, client, 40999, TCP_ACK).bytes();
        let err = icmp4_error(client, NODE4, 3, 4, &other);
        let (rc, out) = fx.run_bytes("tc_ingress", &err);
        assert_eq!((rc, &out), (UNSPEC, &err));
    }
}

/// sessionAffinity ClientIP on the tc path: every new flow of a client
/// address goes to the same backend while the entry lives, through every
/// frontend of the same `affinity_id` (a NodePort and an LB IP of one
/// Service port); another client address is chosen for independently.
#[test]
fn affinity_by_source_address() {
    if skip() {
        return;
    }
    let mut fx = Fixture::new();
    for id in 1..=4 {
        fx.backend(id, &format!("10.244.1.{}", 9 + id), 8080, proto::TCP, true);
    }
    const LB_IP: &str = "203.0.113.10";
    fx.frontend(NODE4, 30080, proto::TCP, 5, &[1, 2, 3, 4]);
    fx.frontend(LB_IP, 80, proto::TCP, 6, &[1, 2, 3, 4]);
    for (addr, port) in [(NODE4, 30080), (LB_IP, 80)] {
        let key = ServiceKey {
            addr: addr_bytes(ip(addr)),
            port,
            proto: proto::TCP,
            scope: scope::EXTERNAL,
        };
        let mut v = fx.services.get(&key, 0).unwrap();
        v.flags |= lb_common::service_flags::AFFINITY;
        v.affinity_timeout = 60;
        // One Service port: both frontends share the decision.
        v.affinity_id = 9;
        v.key_check = v.check_for(&key);
        fx.services.insert(key, v, 0).unwrap();
    }
    for client in ["192.168.77.100", "192.168.77.101"] {
        let mut seen = std::collections::BTreeSet::new();
        for sport in 40000..40020 {
            let (dst, dport) = if sport % 2 == 0 {
                (NODE4, 30080)
            } else {
                (LB_IP, 80)
            };
            let (rc, out) = fx.run(
                "tc_ingress",
                &Frame::tcp(client, sport, dst, dport, TCP_SYN),
            );
            assert_eq!(rc, OK);
            seen.insert(parse(&out).dst);
        }
        assert_eq!(seen.len(), 1, "{client}: {seen:?}");
    }
}

/// Maglev on the tc path: a flow's backend follows from its 5-tuple, so the
/// same tuple lands on the same backend even after its conntrack entries
/// are gone (another node, or an LRU eviction, picks the same): the one at
/// the tuple's position of the frontend's table in `LB_MAGLEV`. Without a
/// table (a frontend programmed by hand) the flow still gets an active
/// backend.
#[test]
fn maglev_selection_is_a_function_of_the_tuple() {
    if skip() {
        return;
    }
    let mut fx = Fixture::new();
    let names: Vec<String> = (1..=3).map(|i| format!("10.244.1.{}", 9 + i)).collect();
    for (i, n) in names.iter().enumerate() {
        fx.backend(i as u32 + 1, n, 8080, proto::TCP, true);
    }
    fx.frontend(NODE4, 30080, proto::TCP, 5, &[1, 2, 3]);
    let size = 251u16;
    let table = maglev::build(&names, size);
    let key = ServiceKey {
        addr: addr_bytes(ip(NODE4)),
        port: 30080,
        proto: proto::TCP,
        scope: scope::EXTERNAL,
    };
    let mut v = fx.services.get(&key, 0).unwrap();
    v.flags |= lb_common::service_flags::MAGLEV;
    v.maglev_size = size;
    v.key_check = v.check_for(&key);
    fx.services.insert(key, v, 0).unwrap();
    let forget = |fx: &mut Fixture| {
        let keys: Vec<CtKey> = fx.conntrack.keys().filter_map(Result::ok).collect();
        for k in keys {
            fx.conntrack.remove(&k).unwrap();
        }
    };
    let syn = |sport| Frame::tcp("192.168.77.100", sport, NODE4, 30080, TCP_SYN);
    let (_, out) = fx.run("tc_ingress", &syn(39999));
    assert!(
        names.contains(&parse(&out).dst.to_string()),
        "no table: {:?}",
        parse(&out).dst
    );
    forget(&mut fx);

    let ids: Vec<u32> = table.iter().map(|b| b + 1).collect();
    let mut tables: HashOfMaps<MapData, u32> =
        HashOfMaps::try_from(fx.ebpf.take_map(map_names::MAGLEV).unwrap()).unwrap();
    let inner = loader::new_maglev_table(&ids).unwrap();
    tables.insert(v.backend_set, &inner, 0).unwrap();
    let mut spread = std::collections::BTreeMap::new();
    for sport in 40000..40060 {
        let (_, out) = fx.run("tc_ingress", &syn(sport));
        let first = parse(&out).dst;
        let hash = lb_common::select::tuple_hash(
            &addr_bytes(ip("192.168.77.100")),
            &addr_bytes(ip(NODE4)),
            sport,
            30080,
            proto::TCP,
        );
        let position = lb_common::select::maglev_position(&v, hash);
        assert_eq!(
            first.to_string(),
            names[table[position as usize] as usize],
            "port {sport}: not the table's backend"
        );
        // Forget the flow: the same tuple chooses the same backend.
        forget(&mut fx);
        let (_, out) = fx.run("tc_ingress", &syn(sport));
        assert_eq!(parse(&out).dst, first, "port {sport}");
        *spread.entry(first).or_insert(0) += 1;
    }
    assert_eq!(spread.len(), 3, "{spread:?}");
}

// ------------------------------------------------ answers, PMTU, fragments

const REDIRECT_OUT: u32 = REDIRECT;

/// The IP header length and the upper-layer protocol of a frame without
/// extension headers, its outer checksums verified where IPv4 has one.
fn l3(f: &[u8]) -> (usize, u8, IpAddr, IpAddr) {
    if u16::from_be_bytes([f[12], f[13]]) == 0x0800 {
        assert_eq!(fold(sum16(&f[14..34])), 0, "IPv4 header checksum");
        let s: [u8; 4] = f[26..30].try_into().unwrap();
        let d: [u8; 4] = f[30..34].try_into().unwrap();
        (20, f[23], s.into(), d.into())
    } else {
        let s: [u8; 16] = f[22..38].try_into().unwrap();
        let d: [u8; 16] = f[38..54].try_into().unwrap();
        (40, f[20], s.into(), d.into())
    }
}

/// An ICMP or ICMPv6 error frame: (type, code, the 4 bytes after the
/// checksum, the quote), lengths and checksums verified.
fn parse_error(f: &[u8]) -> (u8, u8, u32, Vec<u8>) {
    let (hl, p, src, dst) = l3(f);
    let icmp = &f[14 + hl..];
    if hl == 20 {
        assert_eq!(p, 1);
        assert_eq!(
            u16::from_be_bytes([f[16], f[17]]) as usize,
            f.len() - 14,
            "IP length"
        );
        assert_eq!(fold(sum16(icmp)), 0, "ICMP checksum of {f:02x?}");
        assert!(f.len() - 14 <= 576);
    } else {
        assert_eq!(p, 58);
        assert_eq!(
            u16::from_be_bytes([f[18], f[19]]) as usize,
            icmp.len(),
            "payload length"
        );
        let pseudo = pseudo_header(src, dst, 58, icmp.len());
        assert_eq!(
            fold(sum16(&pseudo) + sum16(icmp)),
            0,
            "ICMPv6 checksum of {f:02x?}"
        );
        assert!(f.len() - 14 <= 1280);
    }
    let info = u32::from_be_bytes(icmp[4..8].try_into().unwrap());
    (icmp[0], icmp[1], info, icmp[8..].to_vec())
}

/// REJECT on a Service without endpoints anywhere: a SYN gets RST|ACK
/// acknowledging it, UDP a port unreachable quoting the datagram, both
/// sent back out of the ingress device with the MACs swapped. Without the
/// flag (externalTrafficPolicy Local, endpoints elsewhere) both drop, and
/// a TCP packet that is not a SYN is never answered.
#[test]
fn reject_answers_syn_with_rst_and_udp_with_port_unreachable() {
    if skip() {
        return;
    }
    for (client, node) in [("192.168.77.100", NODE4), ("fd00:77::100", NODE6)] {
        let mut fx = Fixture::new();
        fx.frontend(node, 30090, proto::TCP, 1, &[]);
        fx.frontend(node, 30090, proto::UDP, 2, &[]);
        let syn = Frame::tcp(client, 40000, node, 30090, TCP_SYN);
        let udp = Frame::udp(client, 40000, node, 30090);
        // Without the flag: dropped.
        assert_eq!(fx.run("tc_ingress", &syn).0, SHOT);
        assert_eq!(fx.run("tc_ingress", &udp).0, SHOT);
        fx.flag(node, 30090, proto::TCP, lb_common::service_flags::REJECT);
        fx.flag(node, 30090, proto::UDP, lb_common::service_flags::REJECT);

        let input = syn.bytes();
        let (rc, out) = fx.run_bytes("tc_ingress", &input);
        assert_eq!(rc, REDIRECT_OUT, "{client}: sent back");
        assert_eq!(
            (&out[..6], &out[6..12]),
            (&input[6..12], &input[..6]),
            "MACs swapped"
        );
        let (hl, _, _, _) = l3(&out);
        assert_eq!(out.len(), 14 + hl + 20, "IP and TCP headers only");
        let p = parse(&out);
        assert_eq!((p.src, p.sport), (ip(node), 30090));
        assert_eq!((p.dst, p.dport), (ip(client), 40000));
        let tcp = &out[14 + hl..];
        assert_eq!(tcp[13], TCP_RST | TCP_ACK);
        assert_eq!(
            u32::from_be_bytes(tcp[8..12].try_into().unwrap()),
            2,
            "ack = seq + 1"
        );
        assert!(fx.conntrack.keys().next().is_none(), "no flow");
        // Not a SYN: dropped.
        let ack = Frame::tcp(client, 40000, node, 30090, TCP_ACK);
        assert_eq!(fx.run("tc_ingress", &ack).0, SHOT);

        let input = udp.bytes();
        let (rc, out) = fx.run_bytes("tc_ingress", &input);
        assert_eq!(rc, REDIRECT_OUT);
        assert_eq!((&out[..6], &out[6..12]), (&input[6..12], &input[..6]));
        let (_, _, src, dst) = l3(&out);
        assert_eq!((src, dst), (ip(node), ip(client)));
        let (kind, code, _, quote) = parse_error(&out);
        let want = if node == NODE4 { (3, 3) } else { (1, 4) };
        assert_eq!((kind, code), want, "port unreachable");
        let n = (input.len() - 14) & !3;
        assert_eq!(quote, input[14..14 + n], "the datagram quoted as sent");
    }
}

/// A translated packet too big for the route to its backend: the client
/// gets ICMP fragmentation needed / ICMPv6 packet too big with the route's
/// MTU, from the frontend, quoting its packet as it sent it; the packet is
/// dropped. IPv4 without DF is only dropped.
#[test]
fn too_big_for_the_next_hop_answers_frag_needed_and_packet_too_big() {
    if skip() {
        return;
    }
    // 10.244.9.0/24 and fd00:244:9::/64 lie behind an MTU of 1300.
    let cases = [
        ("192.168.77.100", NODE4, "10.244.9.10"),
        ("fd00:77::100", NODE6, "fd00:244:9::10"),
    ];
    for (client, node, pod) in cases {
        let mut fx = Fixture::new();
        fx.backend(1, pod, 8080, proto::TCP, false);
        fx.frontend(node, 30080, proto::TCP, 4, &[1]);
        let mut syn = Frame::tcp(client, 40000, node, 30080, TCP_SYN);
        syn.frag = 0x4000;
        assert_eq!(fx.run("tc_ingress", &syn).0, REDIRECT, "small: forwarded");
        // The backend answers: established.
        let snat = fx
            .entry(client, 40000, node, 30080, proto::TCP)
            .unwrap()
            .nat_sport;
        fx.run(
            "tc_ingress",
            &Frame::tcp(pod, 8080, node, snat, TCP_SYN | TCP_ACK),
        );
        let mut big = Frame::tcp(client, 40000, node, 30080, TCP_ACK);
        big.frag = 0x4000; // DF
        big.extra = 1400;
        let input = big.bytes();
        let (rc, out) = fx.run_bytes("tc_ingress", &input);
        assert_eq!(rc, REDIRECT_OUT, "{client}: answered");
        assert_eq!(
            (&out[..6], &out[6..12], out.len()),
            (&input[6..12], &input[..6], out.len()),
            "{client}: {:02x?}",
            &out[..64]
        );
        let (_, _, src, dst) = l3(&out);
        assert_eq!((src, dst), (ip(node), ip(client)), "from the frontend");
        let (kind, code, info, quote) = parse_error(&out);
        if node == NODE4 {
            assert_eq!(
                (kind, code, info & 0xffff),
                (3, 4, 1300),
                "frag needed, MTU"
            );
            assert_eq!(quote.len(), 576 - 28);
        } else {
            assert_eq!((kind, code, info), (2, 0, 1300), "packet too big, MTU");
            assert_eq!(quote.len(), 1280 - 48);
        }
        assert_eq!(
            quote,
            input[14..14 + quote.len()],
            "quoted as the client sent it"
        );
        if node == NODE4 {
            big.frag = 0;
            assert_eq!(fx.run("tc_ingress", &big).0, SHOT, "no DF: dropped");
        }
    }
}

/// An ICMPv6 error (packet too big) from `src` to `dst` quoting the start
/// of the IPv6 packet in `quoted` (a frame).
fn icmp6_error(src: &str, dst: &str, kind: u8, quoted: &[u8]) -> Vec<u8> {
    let mut icmp = vec![kind, 0, 0, 0, 0, 0, 0x05, 0x00];
    icmp.extend(&quoted[14..14 + 48]);
    let pseudo = pseudo_header(ip(src), ip(dst), 58, icmp.len());
    let c = fold(sum16(&pseudo) + sum16(&icmp));
    icmp[2..4].copy_from_slice(&c.to_be_bytes());
    let (IpAddr::V6(s), IpAddr::V6(d)) = (ip(src), ip(dst)) else {
        panic!("IPv6 only")
    };
    let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2, 0x86, 0xdd];
    f.extend([0x60, 0, 0, 0]);
    f.extend((icmp.len() as u16).to_be_bytes());
    f.extend([58, 64]);
    f.extend(s.octets());
    f.extend(d.octets());
    f.extend(icmp);
    f
}

/// ICMPv6 errors about a translated flow's replies reach the backend,
/// quoting the packet as the backend sent it, as IPv4 ones do.
#[test]
fn icmpv6_errors_of_tracked_flows_reach_the_backend() {
    if skip() {
        return;
    }
    let client = "fd00:77::100";
    let router = "fd00:77::fe";
    for local in [true, false] {
        let mut fx = Fixture::new();
        let pod = if local {
            "fd00:244:1::10"
        } else {
            "fd00:244:2::10"
        };
        fx.backend(1, pod, 8080, proto::TCP, local);
        fx.frontend(NODE6, 30080, proto::TCP, 3, &[1]);
        let (_, out) = fx.run(
            "tc_ingress",
            &Frame::tcp(client, 40000, NODE6, 30080, TCP_SYN),
        );
        let fwd = parse(&out);
        let seen = Frame::tcp(NODE6, 30080, client, 40000, TCP_SYN | TCP_ACK).bytes();
        for from in [client, router] {
            let err = icmp6_error(from, NODE6, 2, &seen);
            let (rc, out) = fx.run_bytes("tc_ingress", &err);
            assert_eq!(rc, OK, "local={local} from {from}");
            let (kind, _, mtu, quote) = parse_error(&out);
            assert_eq!((kind, mtu), (2, 1280));
            let (_, _, src, dst) = l3(&out);
            assert_eq!((src, dst), (ip(from), ip(pod)), "to the backend");
            let addr = |b: &[u8]| IpAddr::from(<[u8; 16]>::try_from(b).unwrap());
            let port = |b: &[u8]| u16::from_be_bytes([b[0], b[1]]);
            assert_eq!((addr(&quote[8..24]), port(&quote[40..42])), (ip(pod), 8080));
            assert_eq!(
                (addr(&quote[24..40]), port(&quote[42..44])),
                (fwd.src, fwd.sport)
            );
        }
        let other = Frame::tcp(NODE6, 30080, client, 40999, TCP_ACK).bytes();
        let err = icmp6_error(client, NODE6, 2, &other);
        let (rc, out) = fx.run_bytes("tc_ingress", &err);
        assert_eq!((rc, &out), (UNSPEC, &err), "unknown flow: untouched");
    }
}

/// IPv6 with a hop-by-hop and a destination options header before TCP:
/// the headers are skipped and the packet translated.
#[test]
fn ipv6_extension_headers_are_skipped() {
    if skip() {
        return;
    }
    let mut fx = Fixture::new();
    fx.backend(1, "fd00:244:1::10", 8080, proto::TCP, true);
    fx.frontend(NODE6, 30080, proto::TCP, 1, &[1]);
    let plain = Frame::tcp("fd00:77::100", 40000, NODE6, 30080, TCP_SYN).bytes();
    // hop-by-hop -> destination options -> TCP, 8 bytes each (PadN).
    let ext = [60u8, 0, 1, 4, 0, 0, 0, 0, proto::TCP, 0, 1, 4, 0, 0, 0, 0];
    let mut f = plain[..54].to_vec();
    f[20] = 0;
    let len = u16::from_be_bytes([f[18], f[19]]) + ext.len() as u16;
    f[18..20].copy_from_slice(&len.to_be_bytes());
    f.extend(ext);
    f.extend(&plain[54..]);
    let (rc, out) = fx.run_bytes("tc_ingress", &f);
    assert_eq!(rc, OK);
    assert_eq!(&out[54..70], &ext, "extension headers kept");
    // Without them the frame parses (checksums verified) as translated.
    let mut stripped = out[..54].to_vec();
    stripped[20] = proto::TCP;
    stripped[18..20].copy_from_slice(&(len - 16).to_be_bytes());
    stripped.extend(&out[70..]);
    let p = parse(&stripped);
    assert_eq!((p.dst, p.dport), (ip("fd00:244:1::10"), 8080));
    assert!(fx
        .entry("fd00:77::100", 40000, NODE6, 30080, proto::TCP)
        .is_some());
}

/// A UDP datagram split in two fragments, IPv4 or IPv6: (first, later).
/// The first carries the UDP header and 16 bytes, the later the rest.
fn fragments(src: &str, sport: u16, dst: &str, dport: u16, id: u32) -> (Vec<u8>, Vec<u8>) {
    let mut d = Frame::udp(src, sport, dst, dport);
    d.extra = 40;
    let whole = d.bytes();
    let v6 = whole[12] == 0x86;
    let hl = if v6 { 40 } else { 20 };
    let l4 = &whole[14 + hl..];
    let (a, b) = l4.split_at(24);
    let frag = |data: &[u8], offset: usize, more: bool| {
        let mut f = whole[..14 + hl].to_vec();
        if v6 {
            f[20] = 44;
            f.extend([proto::UDP, 0]);
            f.extend((((offset / 8) << 3) as u16 | more as u16).to_be_bytes());
            f.extend(id.to_be_bytes());
            let len = (8 + data.len()) as u16;
            f[18..20].copy_from_slice(&len.to_be_bytes());
        } else {
            f[16..18].copy_from_slice(&((20 + data.len()) as u16).to_be_bytes());
            f[18..20].copy_from_slice(&(id as u16).to_be_bytes());
            let field = (offset / 8) as u16 | if more { 0x2000 } else { 0 };
            f[20..22].copy_from_slice(&field.to_be_bytes());
            f[24..26].copy_from_slice(&[0, 0]);
            let c = fold(sum16(&f[14..34]));
            f[24..26].copy_from_slice(&c.to_be_bytes());
        }
        f.extend(data);
        f
    };
    (frag(a, 0, true), frag(b, 24, false))
}

/// Reassembles two fragments made by `fragments` (translated or not) into
/// one unfragmented frame, so that `parse` verifies the UDP checksum over
/// the whole datagram.
fn reassemble(first: &[u8], later: &[u8]) -> Vec<u8> {
    let v6 = first[12] == 0x86;
    if v6 {
        assert_eq!(&first[8 + 14..54], &later[8 + 14..54], "same addresses");
        let mut f = first[..54].to_vec();
        f[20] = proto::UDP;
        let data: Vec<u8> = first[62..].iter().chain(&later[62..]).copied().collect();
        f[18..20].copy_from_slice(&(data.len() as u16).to_be_bytes());
        f.extend(data);
        f
    } else {
        assert_eq!(
            fold(sum16(&later[14..34])),
            0,
            "later fragment's IP checksum"
        );
        assert_eq!(&first[26..34], &later[26..34], "same addresses");
        let mut f = first[..34].to_vec();
        let data: Vec<u8> = first[34..].iter().chain(&later[34..]).copied().collect();
        f[16..18].copy_from_slice(&((20 + data.len()) as u16).to_be_bytes());
        f[20..22].copy_from_slice(&[0, 0]);
        f[24..26].copy_from_slice(&[0, 0]);
        let c = fold(sum16(&f[14..34]));
        f[24..26].copy_from_slice(&c.to_be_bytes());
        f.extend(data);
        f
    }
}

/// Fragmented UDP to a NodePort, IPv4 and IPv6: the first fragment is
/// translated and recorded, the later one follows it (to a local backend
/// up the stack, to a remote one masqueraded and redirected); a later
/// fragment whose first was never seen drops; the fragments of a datagram
/// that is not ours pass untouched.
#[test]
fn fragments_follow_the_first_fragment() {
    if skip() {
        return;
    }
    let cases = [
        ("192.168.77.100", NODE4, "10.244.1.10", "10.244.2.10"),
        ("fd00:77::100", NODE6, "fd00:244:1::10", "fd00:244:2::10"),
    ];
    for (client, node, local_pod, remote_pod) in cases {
        for local in [true, false] {
            let mut fx = Fixture::new();
            let pod = if local { local_pod } else { remote_pod };
            fx.backend(1, pod, 5353, proto::UDP, local);
            fx.frontend(node, 30053, proto::UDP, 1, &[1]);
            let (first, later) = fragments(client, 40000, node, 30053, 0x1234);
            let want = if local { OK } else { REDIRECT };
            let (rc, out1) = fx.run_bytes("tc_ingress", &first);
            assert_eq!(rc, want, "{client} local={local}: first");
            let (rc, out2) = fx.run_bytes("tc_ingress", &later);
            assert_eq!(rc, want, "{client} local={local}: later");
            let p = parse(&reassemble(&out1, &out2));
            assert_eq!((p.dst, p.dport), (ip(pod), 5353), "local={local}");
            let src = if local { ip(client) } else { ip(node) };
            assert_eq!(p.src, src, "local={local}");

            // A later fragment without its first: dropped.
            let (_, orphan) = fragments(client, 40001, node, 30053, 0x999);
            assert_eq!(fx.run_bytes("tc_ingress", &orphan).0, SHOT, "orphan");
            // Not ours: both fragments untouched.
            let (first, later) = fragments(client, 40000, node, 22, 0x4321);
            for f in [first, later] {
                let (rc, out) = fx.run_bytes("tc_ingress", &f);
                assert_eq!((rc, &out), (UNSPEC, &f), "not a frontend");
            }
        }
    }
}

/// An IPv4 frame with `words` 4-byte words of options (NOPs) after its
/// header, its IHL, total length and header checksum set accordingly (the
/// transport checksum does not cover them).
fn with_ipv4_options(f: &[u8], words: usize) -> Vec<u8> {
    let mut out = f[..34].to_vec();
    out.extend(std::iter::repeat_n(1u8, 4 * words));
    out.extend_from_slice(&f[34..]);
    out[14] = 0x40 | (5 + words) as u8;
    let total = (out.len() - 14) as u16;
    out[16..18].copy_from_slice(&total.to_be_bytes());
    out[24..26].copy_from_slice(&[0, 0]);
    let c = fold(sum16(&out[14..34 + 4 * words]));
    out[24..26].copy_from_slice(&c.to_be_bytes());
    out
}

/// `with_ipv4_options` undone, after checking the header checksum over the
/// whole header, so that `parse` can read the frame.
fn without_ipv4_options(f: &[u8]) -> Vec<u8> {
    let ihl = (f[14] & 0x0f) as usize * 4;
    assert_eq!(fold(sum16(&f[14..14 + ihl])), 0, "IPv4 header checksum");
    let mut out = f[..34].to_vec();
    out.extend_from_slice(&f[14 + ihl..]);
    out[14] = 0x45;
    let total = (out.len() - 14) as u16;
    out[16..18].copy_from_slice(&total.to_be_bytes());
    out[24..26].copy_from_slice(&[0, 0]);
    let c = fold(sum16(&out[14..34]));
    out[24..26].copy_from_slice(&c.to_be_bytes());
    out
}

/// A NodePort frontend (`NODE4`:30080) whose one backend, `pod`:8080, is
/// local, and a flow from `client`:40000 whose SYN tc_ingress has passed
/// (a local backend is reached without translation at ingress).
fn local_backend_flow(client: &str, pod: &str) -> Fixture {
    let mut fx = Fixture::new();
    fx.backend(1, pod, 8080, proto::TCP, true);
    fx.frontend(NODE4, 30080, proto::TCP, 7, &[1]);
    let (rc, _) = fx.run(
        "tc_ingress",
        &Frame::tcp(client, 40000, NODE4, 30080, TCP_SYN),
    );
    assert_eq!(rc, OK);
    fx
}

/// tc_egress decides most packets from their first bytes
/// (`surely_not_a_reply`); a packet it cannot read that way (IPv4 with
/// options) goes the whole way: a local backend's reply with options is
/// translated all the same, checksums included, and one from a port no
/// local backend serves passes untouched.
#[test]
fn egress_reply_with_ipv4_options_is_translated() {
    if skip() {
        return;
    }
    let (client, pod) = ("192.168.77.100", "10.244.1.10");
    let mut fx = local_backend_flow(client, pod);
    for (flags, what) in [(TCP_SYN | TCP_ACK, "SYN-ACK"), (TCP_ACK, "ACK")] {
        let reply = with_ipv4_options(&Frame::tcp(pod, 8080, client, 40000, flags).bytes(), 2);
        let (rc, out) = fx.run_bytes("tc_egress", &reply);
        assert_eq!(rc, OK, "{what}");
        assert_eq!(out.len(), reply.len(), "{what}: options kept");
        assert_eq!(&out[34..42], &reply[34..42], "{what}: options untouched");
        let p = parse(&without_ipv4_options(&out));
        assert_eq!((p.src, p.sport), (ip(NODE4), 30080), "{what}");
        assert_eq!((p.dst, p.dport), (ip(client), 40000), "{what}");
    }
    let other = with_ipv4_options(&Frame::tcp(pod, 9999, client, 40000, TCP_ACK).bytes(), 2);
    assert_eq!(fx.run_bytes("tc_egress", &other), (UNSPEC, other.clone()));
}

/// A flow's entries outlive it until the agent's sweep. A new flow that
/// takes its SNAT port (or, with a local backend, its client port) again
/// lives in LB_CT_SYN; the old, expired entry in LB_CONNTRACK must not
/// hide it: the new flow's SYN-ACK is translated for the new client.
#[test]
fn an_expired_entry_does_not_hide_a_new_flow_of_its_tuple() {
    if skip() {
        return;
    }
    let (pod, local_pod) = ("10.244.2.10", "10.244.1.10");
    let mut fx = Fixture::new();
    fx.snat_ports(61_000, 61_000);
    // The default hour is more than a fresh machine's uptime: an entry
    // stamped 1 ns after boot would still be live.
    fx.tcp_timeout(5);
    fx.backend(1, pod, 8080, proto::TCP, false);
    fx.backend(2, local_pod, 8080, proto::TCP, true);
    fx.frontend(NODE4, 30080, proto::TCP, 1, &[1]);
    fx.frontend(NODE4, 30081, proto::TCP, 2, &[2]);
    let expire = |fx: &mut Fixture, key: CtKey| {
        let mut e = fx.conntrack.get(&key, 0).unwrap();
        e.last_seen_ns = 1;
        fx.conntrack.insert(key, e, 0).unwrap();
    };
    // Remote backend: the old flow held SNAT port 61 000; the new client
    // gets it again once the old flow expired.
    let (old, new) = ("192.168.77.100", "192.168.77.101");
    fx.run("tc_ingress", &Frame::tcp(old, 40000, NODE4, 30080, TCP_SYN));
    fx.run(
        "tc_ingress",
        &Frame::tcp(pod, 8080, NODE4, 61_000, TCP_SYN | TCP_ACK),
    );
    fx.ack(old, 40000, NODE4, 30080);
    expire(&mut fx, ct_key(pod, 8080, NODE4, 61_000, proto::TCP));
    expire(&mut fx, ct_key(old, 40000, NODE4, 30080, proto::TCP));
    let (_, out) = fx.run("tc_ingress", &Frame::tcp(new, 40000, NODE4, 30080, TCP_SYN));
    assert_eq!(parse(&out).sport, 61_000, "the expired flow's port");
    let (rc, out) = fx.run(
        "tc_ingress",
        &Frame::tcp(pod, 8080, NODE4, 61_000, TCP_SYN | TCP_ACK),
    );
    assert!(rc == OK || rc == REDIRECT, "{rc}");
    let p = parse(&out);
    assert_eq!(
        (p.src, p.dst, p.dport),
        (ip(NODE4), ip(new), 40000),
        "to the new client"
    );
    fx.ack(new, 40000, NODE4, 30080);
    assert!(
        !fx.in_syn_table(pod, 8080, NODE4, 61_000, proto::TCP),
        "established"
    );

    // Local backend: the client reopens a port whose flow expired (not
    // closed); the new flow's reply, leaving through egress, must not hit
    // the old expired reply entry.
    let client = "192.168.77.102";
    fx.run(
        "tc_ingress",
        &Frame::tcp(client, 41000, NODE4, 30081, TCP_SYN),
    );
    fx.run(
        "tc_egress",
        &Frame::tcp(local_pod, 8080, client, 41000, TCP_SYN | TCP_ACK),
    );
    fx.ack(client, 41000, NODE4, 30081);
    expire(&mut fx, ct_key(client, 41000, NODE4, 30081, proto::TCP));
    expire(&mut fx, ct_key(local_pod, 8080, client, 41000, proto::TCP));
    let (rc, _) = fx.run(
        "tc_ingress",
        &Frame::tcp(client, 41000, NODE4, 30081, TCP_SYN),
    );
    assert_eq!(rc, OK);
    let (rc, out) = fx.run(
        "tc_egress",
        &Frame::tcp(local_pod, 8080, client, 41000, TCP_SYN | TCP_ACK),
    );
    assert_eq!(rc, OK);
    assert_eq!(
        parse(&out).src,
        ip(NODE4),
        "the reply gets its frontend back"
    );
}

/// A masqueraded packet whose next hop's MAC the FIB lookup knows leaves
/// with both MACs written by the program and a plain `bpf_redirect`, so
/// the kernel does no second route and neighbour lookup after it; with the
/// neighbour unresolved `bpf_redirect_neigh` still does that work (and the
/// frame keeps its MACs until then).
#[test]
fn a_resolved_next_hop_gets_its_macs_from_the_program() {
    if skip() {
        return;
    }
    let (resolved, unresolved) = ("10.244.2.10", "10.244.3.10");
    let mut fx = Fixture::new();
    let (node_mac, pod_mac) = ([0x02, 0, 0, 0, 0x77, 1], [0x02, 0, 0, 0, 0x02, 0x0a]);
    for args in [
        "link set d0 address 02:00:00:00:77:01".to_string(),
        format!("neigh add {resolved} lladdr 02:00:00:00:02:0a dev d0 nud permanent"),
    ] {
        let st = std::process::Command::new("ip")
            .args(args.split(' '))
            .status()
            .expect("ip");
        assert!(st.success(), "ip {args}");
    }
    fx.backend(1, resolved, 8080, proto::TCP, false);
    fx.backend(2, unresolved, 8080, proto::TCP, false);
    fx.frontend(NODE4, 30080, proto::TCP, 1, &[1]);
    fx.frontend(NODE4, 30081, proto::TCP, 2, &[2]);
    let syn = Frame::tcp("192.168.77.100", 40000, NODE4, 30080, TCP_SYN);
    let (rc, out) = fx.run("tc_ingress", &syn);
    assert_eq!(rc, REDIRECT);
    assert_eq!(parse(&out).dst, ip(resolved));
    assert_eq!((&out[..6], &out[6..12]), (&pod_mac[..], &node_mac[..]));
    let syn = Frame::tcp("192.168.77.100", 40001, NODE4, 30081, TCP_SYN);
    let input = syn.bytes();
    let (rc, out) = fx.run("tc_ingress", &syn);
    assert_eq!(rc, REDIRECT);
    assert_eq!(parse(&out).dst, ip(unresolved));
    assert_eq!(&out[..12], &input[..12], "left to bpf_redirect_neigh");
}

/// A flow's packets after the first take the next hop it cached
/// (`CtEntry::hop`) instead of a FIB lookup, while the route epoch and the
/// second stay as they were and the hop's check holds: the neighbour's new
/// MAC shows only once the agent moves `LB_ROUTE_EPOCH` (at the change),
/// or, with no agent, at the next second; a hop altered in the map fails
/// its check and the packet takes the lookup.
#[test]
fn a_flow_keeps_its_next_hop_until_the_route_epoch_moves() {
    if skip() {
        return;
    }
    let (client, pod) = ("192.168.77.100", "10.244.2.10");
    let mut fx = Fixture::new();
    let (mac_a, mac_b, mac_c) = (
        [0x02, 0, 0, 0, 0x02, 0x0a],
        [0x02, 0, 0, 0, 0x02, 0x0b],
        [0x02, 0, 0, 0, 0x02, 0x0c],
    );
    fx.neighbour(pod, mac_a);
    fx.neighbour(client, [0x02, 0, 0, 0, 0x77, 0x64]);
    fx.backend(1, pod, 8080, proto::TCP, false);
    fx.frontend(NODE4, 30080, proto::TCP, 1, &[1]);
    fx.route_epoch(1);
    let dmac = |fx: &mut Fixture| -> [u8; 6] {
        let (rc, out) = fx.run(
            "tc_ingress",
            &Frame::tcp(client, 40000, NODE4, 30080, TCP_ACK),
        );
        assert_eq!(rc, REDIRECT);
        assert_eq!(parse(&out).dst, ip(pod));
        out[..6].try_into().unwrap()
    };
    // The next second's start is far enough: every step below is within
    // one second of the clock (kernel ktime >> 30).
    let second = || lb_agent::base::clock::monotonic_now_ns() >> 30;
    while lb_agent::base::clock::monotonic_now_ns() & ((1 << 30) - 1) > 1 << 28 {
        std::thread::sleep(Duration::from_millis(20));
    }
    let start = second();
    let (rc, out) = fx.run(
        "tc_ingress",
        &Frame::tcp(client, 40000, NODE4, 30080, TCP_SYN),
    );
    assert_eq!(rc, REDIRECT);
    assert_eq!(out[..6], mac_a);
    let snat = parse(&out).sport;
    let (rc, _) = fx.run(
        "tc_ingress",
        &Frame::tcp(pod, 8080, NODE4, snat, TCP_SYN | TCP_ACK),
    );
    assert_eq!(rc, REDIRECT);
    let hop = fx
        .entry(client, 40000, NODE4, 30080, proto::TCP)
        .unwrap()
        .hop;
    assert_eq!((hop.dmac, hop.len > 0), (mac_a, true), "cached at the SYN");
    fx.neighbour(pod, mac_b);
    assert_eq!(dmac(&mut fx), mac_a, "the cached hop, no lookup");
    fx.route_epoch(2);
    assert_eq!(dmac(&mut fx), mac_b, "looked up again in the new epoch");
    assert_eq!(dmac(&mut fx), mac_b);
    // A hop whose check fails (here: altered in the map) is not used.
    let key = ct_key(client, 40000, NODE4, 30080, proto::TCP);
    let mut e = fx.conntrack.get(&key, 0).unwrap();
    e.hop.dmac = mac_c;
    fx.conntrack.insert(key, e, 0).unwrap();
    assert_eq!(dmac(&mut fx), mac_b, "a hop failing its check is looked up");
    assert_eq!(second(), start, "the steps above took under a second");
    // With no agent to move the epoch, a hop lasts until the next second.
    fx.neighbour(pod, mac_c);
    assert_eq!(dmac(&mut fx), mac_b);
    while second() == start {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(dmac(&mut fx), mac_c, "looked up again the next second");
}

/// Marks `proto`'s `port` in `LB_LOCAL_PORTS` or `LB_FRONTEND_PORTS`, as
/// the agent does.
fn mark_port(ports: &mut Array<MapData, PortBits>, port: u16, proto: u8) {
    let i = PortBits::index(proto, port).unwrap();
    let marked = ports.get(&i, 0).unwrap();
    ports.set(i, marked.with(port), 0).unwrap();
}

/// Clears every mark of `ports`, then marks each of `marks`.
fn set_ports(ports: &mut Array<MapData, PortBits>, marks: &[(u16, u8)]) {
    for i in 0..PortBits::ELEMENTS {
        ports.set(i, PortBits::default(), 0).unwrap();
    }
    for (port, proto) in marks {
        mark_port(ports, *port, *proto);
    }
}

/// The marks under which port 8080 (or 30080) must not count as TCP's: no
/// mark, UDP's, and TCP's neighbours in the same element.
fn other_marks(port: u16) -> [Vec<(u16, u8)>; 3] {
    [
        vec![],
        vec![(port, proto::UDP)],
        vec![(port - 1, proto::TCP), (port + 1, proto::TCP)],
    ]
}

/// tc_egress decides "not ours" from the packet's source port before its
/// conntrack lookup: only a port `LB_LOCAL_PORTS` marks for the protocol
/// can carry a local backend's reply. A reply whose port the agent did not
/// mark is passed untranslated even though its flow is tracked; once the
/// port is marked (for that protocol) the same reply is translated.
#[test]
fn egress_looks_up_only_packets_from_local_backend_ports() {
    if skip() {
        return;
    }
    let (client, pod) = ("192.168.77.100", "10.244.1.10");
    let mut fx = local_backend_flow(client, pod);
    let reply = Frame::tcp(pod, 8080, client, 40000, TCP_SYN | TCP_ACK);
    for marked in other_marks(8080) {
        set_ports(&mut fx.local_ports, &marked);
        let (rc, out) = fx.run("tc_egress", &reply);
        assert_eq!(rc, UNSPEC, "{marked:?}");
        assert_eq!(parse(&out).src, ip(pod), "{marked:?}: untouched");
    }
    mark_port(&mut fx.local_ports, 8080, proto::TCP);
    let (rc, out) = fx.run("tc_egress", &reply);
    assert_eq!(rc, OK);
    assert_eq!(
        (parse(&out).src, parse(&out).sport),
        (ip(NODE4), 30080),
        "translated once the port is marked"
    );
}

/// tc_ingress decides "not ours" from the packet's destination port before
/// its conntrack and frontend lookups: only a port `LB_FRONTEND_PORTS`
/// marks for the protocol, or a SNAT port, can carry a packet of ours. A
/// packet of a tracked flow whose frontend port is not marked (for its
/// protocol) passes untranslated; once the port is marked the same packet
/// is translated. A reply to a SNAT port is translated without any mark,
/// and a first fragment goes the whole way (its later fragments must
/// pass), as does anything not TCP or UDP.
#[test]
fn ingress_looks_up_only_packets_to_frontend_or_snat_ports() {
    if skip() {
        return;
    }
    let (client, pod) = ("192.168.77.100", "10.244.1.10");
    let mut fx = local_backend_flow(client, pod);
    // The flow's SYN again (a retransmission).
    let syn = Frame::tcp(client, 40000, NODE4, 30080, TCP_SYN);
    for marked in other_marks(30080) {
        set_ports(&mut fx.frontend_ports, &marked);
        let (rc, out) = fx.run("tc_ingress", &syn);
        assert_eq!((rc, out), (UNSPEC, syn.bytes()), "{marked:?}: untouched");
    }
    // A later fragment of the node's own datagram to such a port passes:
    // its first fragment was seen.
    let (first, later) = fragments(client, 40001, NODE4, 30080, 0x77);
    for f in [first, later] {
        assert_eq!(fx.run_bytes("tc_ingress", &f).0, UNSPEC);
    }
    fx.mark_frontend_port(30080, proto::TCP);
    let (rc, out) = fx.run("tc_ingress", &syn);
    assert_eq!(rc, OK);
    assert_eq!(
        (parse(&out).dst, parse(&out).dport),
        (ip(pod), 8080),
        "translated once the port is marked"
    );

    // Masqueraded: the backend's reply goes to a SNAT port, never marked.
    let mut fx = Fixture::new();
    fx.snat_ports(61_000, 61_000);
    fx.backend(1, "10.244.2.10", 8080, proto::TCP, false);
    fx.frontend(NODE4, 30080, proto::TCP, 9, &[1]);
    let (rc, out) = fx.run(
        "tc_ingress",
        &Frame::tcp(client, 40000, NODE4, 30080, TCP_SYN),
    );
    assert!(rc == OK || rc == REDIRECT, "{rc}");
    assert_eq!(parse(&out).sport, 61_000);
    let (rc, out) = fx.run(
        "tc_ingress",
        &Frame::tcp("10.244.2.10", 8080, NODE4, 61_000, TCP_SYN | TCP_ACK),
    );
    assert!(rc == OK || rc == REDIRECT, "{rc}");
    assert_eq!(
        (parse(&out).src, parse(&out).sport, parse(&out).dport),
        (ip(NODE4), 30080, 40000)
    );
}

/// Cost of tc_ingress per kind of packet of a masqueraded TCP flow, through
/// BPF_PROG_TEST_RUN, for BENCHMARKS.md's account of the tc path's cost
/// (`--ignored --nocapture`; times are printed, never asserted). Every
/// packet must still be translated and redirected.
#[test]
#[ignore]
fn cost_by_packet_kind() {
    if skip() {
        return;
    }
    let mut fx = Fixture::new();
    fx.backend(1, "10.244.2.10", 8080, proto::TCP, false);
    fx.frontend(NODE4, 30080, proto::TCP, 9, &[1]);
    let client = "192.168.77.100";
    // Both ends' neighbours resolved, as under real traffic: each flow
    // direction's packets after its first take the next hop it cached.
    fx.neighbour("10.244.2.10", [0x02, 0, 0, 0, 0x02, 0x0a]);
    fx.neighbour(client, [0x02, 0, 0, 0, 0x77, 0x64]);
    let mut cost: std::collections::BTreeMap<&str, Vec<u128>> = Default::default();
    let mut not_ours = Vec::new();
    let mut timed = |fx: &mut Fixture, kind: &'static str, f: &Frame| -> Vec<u8> {
        let (rc, out, ns) = fx.run_timed("tc_ingress", &f.bytes());
        assert_eq!(rc, REDIRECT, "{kind}");
        cost.entry(kind).or_default().push(ns);
        out
    };
    for i in 0..100u16 {
        let cport = 20_000 + i;
        let out = timed(
            &mut fx,
            "1 SYN (new flow)",
            &Frame::tcp(client, cport, NODE4, 30080, TCP_SYN),
        );
        let snat = parse(&out).sport;
        timed(
            &mut fx,
            "2 SYN-ACK (answered)",
            &Frame::tcp("10.244.2.10", 8080, NODE4, snat, TCP_SYN | TCP_ACK),
        );
        timed(
            &mut fx,
            "3 ACK (completes the handshake: the move)",
            &Frame::tcp(client, cport, NODE4, 30080, TCP_ACK),
        );
        timed(
            &mut fx,
            "4 reply ACK",
            &Frame::tcp("10.244.2.10", 8080, NODE4, snat, TCP_ACK),
        );
        timed(
            &mut fx,
            "5 RST",
            &Frame::tcp(client, cport, NODE4, 30080, TCP_RST | TCP_ACK),
        );
        // The node's own traffic: no flow, no frontend.
        let (rc, _, ns) = fx.run_timed(
            "tc_ingress",
            &Frame::tcp(client, cport, NODE4, 22, TCP_ACK).bytes(),
        );
        assert_eq!(rc, UNSPEC, "not ours");
        not_ours.push(ns);
    }
    cost.insert("6 not ours (no flow, no frontend)", not_ours);
    for (k, mut v) in cost {
        v.sort();
        println!(
            "{k}: median {} ns, p10 {} ns, p90 {} ns",
            v[v.len() / 2],
            v[v.len() / 10],
            v[v.len() * 9 / 10]
        );
    }
}

/// Why tc_ingress costs about twice as much per run under real traffic
/// (BENCHMARKS.md, NodePort) as `cost_by_packet_kind` says: there every
/// run finds the maps in the CPU's caches. Here the conntrack tables have
/// their default sizes and hold `FLOWS` established flows, and the same
/// kind of packet (an established client ACK at tc_ingress, and at
/// tc_egress the translated packet leaving, a conntrack miss as for most
/// packets there) is timed three ways: one flow again and again (hot, as
/// `cost_by_packet_kind`), every flow in turn (each run another bucket and
/// entry), and every flow in turn with 1 MiB or 16 MiB of memory written
/// in between (as the rest of the stack does between two packets).
/// `--ignored --nocapture`; times are printed, never asserted; every
/// packet must still be translated.
#[test]
#[ignore]
fn cost_with_cold_caches() {
    if skip() {
        return;
    }
    const FLOWS: u16 = 20_000;
    let mut fx = Fixture::with(load_with_conntrack(
        lb_common::capacity::CONNTRACK,
        lb_common::capacity::CONNTRACK_SYN,
    ));
    fx.snat_ports(1_024, 65_535);
    fx.backend(1, "10.244.2.10", 8080, proto::TCP, false);
    fx.frontend(NODE4, 30080, proto::TCP, 9, &[1]);
    // Every neighbour resolved, as under real traffic.
    fx.neighbour("10.244.2.10", [0x02, 0, 0, 0, 0x02, 0x0a]);
    for i in 0..100u8 {
        fx.neighbour(&format!("192.168.77.{}", 100 + i), [0x02, 0, 0, 0, 0x77, i]);
    }
    let mut flows = Vec::new();
    for i in 0..FLOWS {
        // Clients on the fixture's one routed subnet, a port each.
        let (client, cport) = (format!("192.168.77.{}", 100 + i % 100), 20_000 + i / 100);
        let (rc, out) = fx.run(
            "tc_ingress",
            &Frame::tcp(&client, cport, NODE4, 30080, TCP_SYN),
        );
        assert_eq!(rc, REDIRECT, "SYN of flow {i} ({client})");
        let snat = parse(&out).sport;
        let reply = Frame::tcp("10.244.2.10", 8080, NODE4, snat, TCP_SYN | TCP_ACK);
        assert_eq!(
            fx.run("tc_ingress", &reply).0,
            REDIRECT,
            "SYN-ACK of flow {i}"
        );
        flows.push((
            Frame::tcp(&client, cport, NODE4, 30080, TCP_ACK).bytes(),
            Frame::tcp(NODE4, snat, "10.244.2.10", 8080, TCP_ACK).bytes(),
        ));
    }
    let mut flush = vec![0u8; 16 << 20];
    let timed = |fx: &mut Fixture, program: &str, data: &[u8], want: u32| -> u128 {
        let (rc, _, ns) = fx.run_timed(program, data);
        assert_eq!(rc, want, "{program}");
        ns
    };
    // A stride through the flows, so neighbours in memory do not follow.
    let order: Vec<usize> = (0..flows.len())
        .map(|i| (i * 7_919) % flows.len())
        .collect();
    for (program, want, pick) in [("tc_ingress", REDIRECT, 0usize), ("tc_egress", UNSPEC, 1)] {
        let frame = |i: usize| -> &[u8] {
            if pick == 0 {
                &flows[i].0
            } else {
                &flows[i].1
            }
        };
        let report = |what: &str, mut v: Vec<u128>| {
            v.sort();
            println!(
                "{program} {what}: median {} ns, p10 {} ns, p90 {} ns ({} runs)",
                v[v.len() / 2],
                v[v.len() / 10],
                v[v.len() * 9 / 10],
                v.len()
            );
        };
        let hot: Vec<u128> = (0..2_000)
            .map(|_| timed(&mut fx, program, frame(0), want))
            .collect();
        report("one flow again and again", hot);
        let each: Vec<u128> = order
            .iter()
            .map(|&i| timed(&mut fx, program, frame(i), want))
            .collect();
        report(&format!("each of {FLOWS} flows in turn"), each);
        // The size of this machine's L2 (as when the stack's own work
        // between two packets evicts it), then more than its L3.
        for mib in [1usize, 16] {
            let cold: Vec<u128> = order
                .iter()
                .take(1_000)
                .map(|&i| {
                    for b in flush[..mib << 20].iter_mut().step_by(64) {
                        *b = b.wrapping_add(1);
                    }
                    timed(&mut fx, program, frame(i), want)
                })
                .collect();
            report(
                &format!("each flow in turn, {mib} MiB written before each run"),
                cold,
            );
        }
    }
    std::hint::black_box(&flush);
}
