//! A small pod network in network namespaces.
//!
//! One "switch" namespace holds a Linux bridge; every host (pod) is a
//! namespace whose `eth0` is one end of a veth pair, the other end being a
//! port of the bridge. Hosts have an IPv4 /24 and an IPv6 /64 on `eth0` and
//! `lo` up, and NO default route: only their connected subnets are
//! reachable, so a connect to a Service VIP that the load balancer did not
//! rewrite fails with `ENETUNREACH` instead of leaving the machine.
//!
//! Everything lives in namespaces named `lbt{pid}x{n}-...`; dropping the
//! [`Topology`] (also while unwinding from a panic) kills the processes in
//! them and deletes them.
use std::{
    io::{BufRead as _, BufReader},
    net::{Ipv4Addr, Ipv6Addr},
    process::{Child, Command, Stdio},
    sync::{mpsc, Arc, Mutex},
    time::Duration,
};

use anyhow::{anyhow, bail, Context as _, Result};

use crate::{
    cleanup::{self, CleanupHandle},
    cmd,
};

/// In namespace `netns`: `lo` up and a bridge `br0` (no multicast
/// snooping), up: the switch of a topology.
pub(crate) fn add_switch(netns: &str) -> Result<()> {
    cmd::ip(&["-n", netns, "link", "set", "lo", "up"])?;
    cmd::ip(&[
        "-n",
        netns,
        "link",
        "add",
        "br0",
        "type",
        "bridge",
        "mcast_snooping",
        "0",
    ])?;
    cmd::ip(&["-n", netns, "link", "set", "br0", "up"])?;
    Ok(())
}

/// `ipv4` (CIDR) and `ipv6` (CIDR, no DAD) on `dev` in `netns`.
pub(crate) fn add_addrs(netns: &str, dev: &str, ipv4: &str, ipv6: &str) -> Result<()> {
    cmd::ip(&["-n", netns, "addr", "add", ipv4, "dev", dev])?;
    cmd::ip(&["-n", netns, "-6", "addr", "add", ipv6, "dev", dev, "nodad"])?;
    Ok(())
}

/// Routes in `netns` to `v4` via `v4_via` and to `v6` via `v6_via`.
pub(crate) fn add_routes(
    netns: &str,
    v4: &str,
    v4_via: &str,
    v6: &str,
    v6_via: &str,
) -> Result<()> {
    cmd::ip(&["-n", netns, "route", "add", v4, "via", v4_via])?;
    cmd::ip(&["-n", netns, "-6", "route", "add", v6, "via", v6_via])?;
    Ok(())
}

/// A veth pair from bridge `bridge` of namespace `at` (its end `port`, up)
/// to `eth0` in `netns`, with `lo` up and `eth0` = `ipv4`/24 and
/// `ipv6`/64, up; with MAC address `mac` when given (a device created
/// again as it was).
pub(crate) fn wire_eth0(
    at: &str,
    bridge: &str,
    port: &str,
    netns: &str,
    ipv4: Ipv4Addr,
    ipv6: Ipv6Addr,
    mac: Option<&str>,
) -> Result<()> {
    let mut args = vec![
        "-n", at, "link", "add", port, "type", "veth", "peer", "name", "eth0",
    ];
    if let Some(mac) = mac {
        args.extend(["address", mac]);
    }
    args.extend(["netns", netns]);
    cmd::ip(&args)?;
    cmd::ip(&["-n", at, "link", "set", port, "master", bridge, "up"])?;
    cmd::ip(&["-n", netns, "link", "set", "lo", "up"])?;
    add_addrs(netns, "eth0", &format!("{ipv4}/24"), &format!("{ipv6}/64"))?;
    cmd::ip(&["-n", netns, "link", "set", "eth0", "up"])?;
    Ok(())
}

/// Locks `m`, also when a thread panicked holding it (teardown state must
/// stay usable while unwinding).
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Moves the calling thread (only) into network namespace `netns`
/// (`/run/netns/NAME`).
pub fn enter_netns(netns: &str) -> Result<()> {
    use std::os::fd::AsRawFd as _;
    let path = std::path::Path::new("/run/netns").join(netns);
    let f = std::fs::File::open(&path).with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: setns on a descriptor we hold open; affects this (only) thread.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        bail!(
            "setns({}): {}",
            path.display(),
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

/// Moves this process into cgroup `cgroup` (first: the cgroup file is
/// reachable from any namespace, and every socket made afterwards belongs
/// to it), then the calling thread into network namespace `netns`.
pub fn enter(cgroup: Option<&std::path::Path>, netns: Option<&str>) -> Result<()> {
    if let Some(cg) = cgroup {
        let procs = cg.join("cgroup.procs");
        std::fs::write(&procs, format!("{}\n", std::process::id()))
            .with_context(|| format!("joining the cgroup: writing {}", procs.display()))?;
    }
    if let Some(ns) = netns {
        enter_netns(ns)?;
    }
    Ok(())
}

/// Runs `f` on a thread of its own in network namespace `netns` (threads
/// it starts are there too); its result, or why the thread could not enter
/// or panicked.
pub fn in_netns<R: Send + 'static>(
    netns: &str,
    f: impl FnOnce() -> R + Send + 'static,
) -> Result<R> {
    let ns = netns.to_string();
    std::thread::spawn(move || -> Result<R> {
        enter_netns(&ns)?;
        Ok(f())
    })
    .join()
    .map_err(|_| anyhow!("the thread in network namespace {netns} panicked"))?
}

/// Pod address `10.244.1.{i}`.
pub fn pod_v4(i: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 244, 1, i)
}

/// Pod address `fd00:244:1::{i}` (hexadecimal digits of `i` as written, so
/// `pod_v6(100)` is `fd00:244:1::100`).
pub fn pod_v6(i: u8) -> Ipv6Addr {
    let hex_as_decimal =
        u16::from_str_radix(&i.to_string(), 16).expect("decimal digits are hex digits");
    Ipv6Addr::new(0xfd00, 0x244, 1, 0, 0, 0, 0, hex_as_decimal)
}

/// The index of the client host in [`Topology::pods`].
pub const CLIENT_INDEX: u8 = 100;

/// One network namespace attached to the bridge.
#[derive(Debug, Clone)]
pub struct Host {
    /// The name given to `add_host` (`b1`, `client`).
    pub name: String,
    /// The network namespace (`ip netns` name).
    pub netns: String,
    pub ipv4: Ipv4Addr,
    pub ipv6: Ipv6Addr,
}

#[derive(Default)]
struct State {
    /// In creation order; deleted in reverse.
    netns: Vec<String>,
    /// `lb-probe serve` processes.
    children: Vec<(String, Child)>,
}

/// Kills every process in `netns` and deletes it. Best effort.
pub fn delete_netns(netns: &str) {
    if let Ok(out) = cmd::ip(&["netns", "pids", netns]) {
        for pid in out.split_whitespace().filter_map(|p| p.parse::<u32>().ok()) {
            cmd::signal(pid, libc::SIGKILL);
        }
    }
    for attempt in 0..10 {
        match cmd::ip(&["netns", "del", netns]) {
            Ok(_) => return,
            Err(e) => {
                if !std::path::Path::new("/run/netns").join(netns).exists() {
                    return;
                }
                if attempt == 9 {
                    eprintln!("warning: {e:#}");
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

fn teardown(state: &Mutex<State>) {
    let mut st = lock(state);
    for (_, child) in st.children.iter_mut() {
        let _ = child.kill();
        let _ = child.wait();
    }
    st.children.clear();
    while let Some(ns) = st.netns.pop() {
        delete_netns(&ns);
    }
}

/// A bridge and the hosts on it; all torn down on drop.
pub struct Topology {
    name: String,
    switch: String,
    hosts: Vec<Host>,
    state: Arc<Mutex<State>>,
    _cleanup: CleanupHandle,
}

impl Topology {
    /// The switch namespace with its bridge; hosts come with [`add_host`](Self::add_host).
    pub fn new(prefix: &str) -> Result<Self> {
        cleanup::sweep_stale();
        let name = crate::unique_name(prefix);
        let switch = format!("{name}-sw");
        let state = Arc::new(Mutex::new(State::default()));
        let st = state.clone();
        let handle = cleanup::register(format!("delete network namespaces {name}-*"), move || {
            teardown(&st)
        });
        let topo = Self {
            name,
            switch: switch.clone(),
            hosts: Vec::new(),
            state,
            _cleanup: handle,
        };
        topo.add_netns(&switch)?;
        add_switch(&switch)?;
        Ok(topo)
    }

    /// `n` backend hosts `b1..bn` at [`pod_v4`]`(i)`/[`pod_v6`]`(i)` and a
    /// host `client` at index [`CLIENT_INDEX`].
    pub fn pods(prefix: &str, n: u8) -> Result<Self> {
        let mut topo = Self::new(prefix)?;
        for i in 1..=n {
            topo.add_host(&format!("b{i}"), pod_v4(i), pod_v6(i))?;
        }
        topo.add_host("client", pod_v4(CLIENT_INDEX), pod_v6(CLIENT_INDEX))?;
        Ok(topo)
    }

    fn add_netns(&self, netns: &str) -> Result<()> {
        cmd::ip(&["netns", "add", netns])?;
        lock(&self.state).netns.push(netns.to_string());
        Ok(())
    }

    /// A host namespace with `eth0` = `ipv4`/24 and `ipv6`/64 on the bridge.
    pub fn add_host(&mut self, name: &str, ipv4: Ipv4Addr, ipv6: Ipv6Addr) -> Result<&Host> {
        if self.hosts.iter().any(|h| h.name == name) {
            bail!("host {name} exists already");
        }
        let netns = format!("{}-{name}", self.name);
        self.add_netns(&netns)?;
        let port = format!("v{}", self.hosts.len() + 1);
        wire_eth0(&self.switch, "br0", &port, &netns, ipv4, ipv6, None)?;
        self.hosts.push(Host {
            name: name.to_string(),
            netns,
            ipv4,
            ipv6,
        });
        Ok(self.hosts.last().expect("just pushed"))
    }

    /// The host named `name`; panics if there is none.
    pub fn host(&self, name: &str) -> &Host {
        self.try_host(name)
            .unwrap_or_else(|| panic!("topology {} has no host {name}", self.name))
    }

    pub fn try_host(&self, name: &str) -> Option<&Host> {
        self.hosts.iter().find(|h| h.name == name)
    }

    pub fn hosts(&self) -> &[Host] {
        &self.hosts
    }

    /// The hosts other than `client`.
    pub fn backends(&self) -> impl Iterator<Item = &Host> {
        self.hosts.iter().filter(|h| h.name != "client")
    }

    /// The namespace of the host named `client`.
    pub fn client_netns(&self) -> &str {
        &self.host("client").netns
    }

    /// Every namespace this topology made (switch included).
    pub fn netns_names(&self) -> Vec<String> {
        lock(&self.state).netns.clone()
    }

    /// `ip netns exec <host's netns> ARGS...`
    pub fn exec(&self, host: &str, args: &[&str]) -> Result<String> {
        cmd::netns_exec(&self.host(host).netns, args)
    }

    /// Starts `lb-probe serve --name NAME --port P...` in `host`'s namespace
    /// and waits until it listens. With `with_port` it answers `NAME:PORT`
    /// (the local port that was hit) instead of `NAME`.
    pub fn serve(&self, host: &str, name: &str, ports: &[u16], with_port: bool) -> Result<u32> {
        let netns = self.host(host).netns.clone();
        let probe = crate::probe_bin()?;
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &netns])
            .arg(&probe)
            .args(["serve", "--name", name]);
        for p in ports {
            c.args(["--port", &p.to_string()]);
        }
        if with_port {
            c.arg("--with-port");
        }
        let (mut child, line) = cmd::spawn_piped(&mut c, Stdio::null(), Stdio::inherit())?;
        let pid = child.id();
        let stdout = child.stdout.take().expect("piped");
        // Keep the child before waiting, so that a failure below still kills it.
        lock(&self.state).children.push((name.to_string(), child));
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut first = String::new();
            let r = BufReader::new(stdout).read_line(&mut first).map(|_| first);
            let _ = tx.send(r);
        });
        match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(Ok(l)) if l.contains("\"listening\"") => Ok(pid),
            Ok(Ok(l)) => Err(anyhow!("`{line}` did not start (said {:?})", l.trim())),
            Ok(Err(e)) => Err(anyhow!("`{line}`: reading its output: {e}")),
            Err(_) => Err(anyhow!("`{line}` did not report listening within 10 s")),
        }
    }

    /// Starts [`serve`](Self::serve) on every backend host, answering with
    /// the host's name.
    pub fn serve_all(&self, ports: &[u16], with_port: bool) -> Result<()> {
        let names: Vec<String> = self.backends().map(|h| h.name.clone()).collect();
        for n in names {
            self.serve(&n, &n, ports, with_port)?;
        }
        Ok(())
    }

    /// Kills the serve process(es) named `name` (SIGKILL, then reaped):
    /// its host lives on, so connects to it are refused with an RST.
    pub fn stop_server(&self, name: &str) -> Result<()> {
        let mut st = lock(&self.state);
        let mut found = false;
        st.children.retain_mut(|(n, c)| {
            if n != name {
                return true;
            }
            found = true;
            let _ = c.kill();
            let _ = c.wait();
            false
        });
        if !found {
            bail!("no server named {name}");
        }
        Ok(())
    }

    /// Pids of the serve processes that are still running.
    pub fn server_pids(&self) -> Vec<u32> {
        let mut st = lock(&self.state);
        st.children
            .iter_mut()
            .filter_map(|(_, c)| matches!(c.try_wait(), Ok(None)).then(|| c.id()))
            .collect()
    }

    /// The unique prefix of this topology's names.
    pub fn name(&self) -> &str {
        &self.name
    }
}
