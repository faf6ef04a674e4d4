//! A multi-node topology for the north-south (tc) path, built from network
//! namespaces:
//!
//! ```text
//!   client (192.168.77.100, fd00:77::100, no default route)
//!     |
//!   switch namespace: bridge br0 = the nodes' network 192.168.77.0/24, fd00:77::/64
//!     |                 |                 |
//!   n1 eth0 .1        n2 eth0 .2        n3 eth0 .3      (forwarding on,
//!   n1 cbr0 10.244.1.1 ...                               routes to the other
//!     |                                                  nodes' pod CIDRs)
//!   pods 10.244.1.10, .11 (default route via 10.244.1.1)
//! ```
//!
//! Each node has its own agent ([`Cluster::start_agents`]: `nsenter --net`
//! into the node namespace, its own pins and child cgroup), attaching the tc
//! programs to the node's `eth0`. Nothing has a route off the machine: the
//! client and the nodes have none, the pods' default route leads to their
//! node. Everything is torn down on drop, also on panic.
use std::{
    net::{Ipv4Addr, Ipv6Addr},
    path::Path,
    process::{Command, Stdio},
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::{anyhow, Context as _, Result};
use serde_json::{json, Value};

use crate::{
    agent::{http_get_in, Agent, AgentOpts},
    cgroup::CgroupGuard,
    cleanup::{self, CleanupHandle},
    cmd,
    netns::{add_addrs, add_routes, add_switch, lock, wire_eth0},
    probe::{parse_attempts, Attempt},
};

/// The port every pod serves on (TCP and UDP).
pub const POD_PORT: u16 = 8080;

pub fn node_v4(i: u8) -> Ipv4Addr {
    Ipv4Addr::new(192, 168, 77, i)
}

pub fn node_v6(i: u8) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, i as u16)
}

/// `eth0`'s MAC address in `netns` (a node's, the client's).
pub fn eth0_mac(netns: &str) -> Result<String> {
    let out = ip(&["-n", netns, "-br", "link", "show", "eth0"])?;
    out.split_whitespace()
        .nth(2)
        .map(str::to_string)
        .ok_or_else(|| anyhow!("no MAC in {out:?}"))
}

pub const CLIENT_INDEX: u8 = 100;

/// A pod: `10.244.{node}.{10+k}`, `fd00:244:{node}::{10+k}`.
#[derive(Debug, Clone)]
pub struct Pod {
    pub name: String,
    pub node: u8,
    pub netns: String,
    pub ipv4: Ipv4Addr,
    pub ipv6: Ipv6Addr,
}

#[derive(Debug, Clone)]
pub struct Node {
    pub name: String,
    pub index: u8,
    pub netns: String,
}

#[derive(Default)]
struct State {
    netns: Vec<String>,
    /// Servers, by pod name.
    children: Vec<(String, std::process::Child)>,
}

fn teardown(state: &Mutex<State>) {
    let mut st = lock(state);
    for (_, c) in st.children.iter_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
    st.children.clear();
    while let Some(ns) = st.netns.pop() {
        crate::netns::delete_netns(&ns);
    }
}

/// Nodes, their pods, an external client, and (once started) one agent
/// per node. Dropped in a safe order: agents, namespaces, cgroups.
pub struct Cluster {
    pub prefix: String,
    pub nodes: Vec<Node>,
    pub pods: Vec<Pod>,
    pub client_netns: String,
    /// A second external client, 192.168.77.101 (source ranges).
    pub client2_netns: String,
    pub agents: Vec<Agent>,
    cgroups: Vec<CgroupGuard>,
    pub manifests: crate::manifests::Manifests,
    switch: String,
    /// Made ready for the XDP stage ([`accelerate`](Self::accelerate)):
    /// the pass program on the nodes' switch ports.
    xdp_pass: Option<crate::xdp_pass::XdpPass>,
    state: Arc<Mutex<State>>,
    _cleanup: CleanupHandle,
    pub dir: tempfile::TempDir,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Agents first (they detach), then namespaces, then cgroups.
        self.agents.clear();
        teardown(&self.state);
        self.cgroups.clear();
    }
}

fn ip(args: &[&str]) -> Result<String> {
    cmd::ip(args)
}

fn ethtool(netns: &str, args: &[&str]) -> Result<()> {
    let mut c = Command::new("nsenter");
    c.arg(format!("--net=/run/netns/{netns}"))
        .arg("ethtool")
        .args(args);
    cmd::run(&mut c).map(|_| ())
}

/// A node's port on the switch, made ready for the XDP stage on its
/// `eth0` (see [`Cluster::accelerate`]).
fn switch_port_for_xdp(switch: &str, node: &str, pass: &crate::xdp_pass::XdpPass) -> Result<()> {
    let port = format!("v{node}");
    pass.attach(switch, &port)?;
    ethtool(switch, &["-K", &port, "tx", "off", "gso", "off"])
}

/// `LB_TEST_ACCELERATION` (`native`, `best-effort`): every agent of a
/// [`Cluster`] starts with `--acceleration` that, on a test bed made ready
/// for it; unset or `off`: as asked by the test.
pub fn acceleration_from_env() -> Option<String> {
    std::env::var("LB_TEST_ACCELERATION")
        .ok()
        .filter(|v| !v.is_empty() && v != "off")
}

fn sysctl(netns: &str, settings: &[&str]) -> Result<()> {
    let mut c = Command::new("nsenter");
    c.arg(format!("--net=/run/netns/{netns}"))
        .args(["sysctl", "-q", "-w"])
        .args(settings);
    cmd::run(&mut c).map(|_| ())
}

impl Cluster {
    /// `pods_per_node[i]` pods on node `n{i+1}`.
    pub fn new(tag: &str, pods_per_node: &[u8]) -> Result<Self> {
        cleanup::sweep_stale();
        let prefix = crate::unique_name(tag);
        let state = Arc::new(Mutex::new(State::default()));
        let st = state.clone();
        let handle =
            cleanup::register(format!("delete network namespaces {prefix}-*"), move || {
                teardown(&st)
            });
        let dir = tempfile::Builder::new()
            .prefix(&format!("{prefix}-"))
            .tempdir()?;
        let manifests = crate::manifests::Manifests::new(dir.path().join("manifests"))?;
        let mut c = Cluster {
            switch: format!("{prefix}-sw"),
            xdp_pass: None,
            prefix,
            nodes: Vec::new(),
            pods: Vec::new(),
            client_netns: String::new(),
            client2_netns: String::new(),
            agents: Vec::new(),
            cgroups: Vec::new(),
            manifests,
            state,
            _cleanup: handle,
            dir,
        };
        let sw = c.switch.clone();
        c.add_netns(&sw)?;
        add_switch(&sw)?;
        let n = pods_per_node.len() as u8;
        for i in 1..=n {
            c.add_node(i, n)?;
        }
        for (i, pods) in pods_per_node.iter().enumerate() {
            for k in 0..*pods {
                c.add_pod(i as u8 + 1, k)?;
            }
        }
        c.client_netns = format!("{}-client", c.prefix);
        let client = c.client_netns.clone();
        c.add_netns(&client)?;
        c.wire_to_switch(&client, "vc", node_v4(CLIENT_INDEX), node_v6(CLIENT_INDEX))?;
        c.client2_netns = format!("{}-client2", c.prefix);
        let client2 = c.client2_netns.clone();
        c.add_netns(&client2)?;
        c.wire_to_switch(
            &client2,
            "vc2",
            node_v4(CLIENT_INDEX + 1),
            node_v6(CLIENT_INDEX + 1),
        )?;
        c.wait_settled()?;
        Ok(c)
    }

    /// Waits until no namespace has a tentative IPv6 address (link-local
    /// DAD): until then the first IPv6 packets may be lost.
    fn wait_settled(&self) -> Result<()> {
        let all = lock(&self.state).netns.clone();
        let settled =
            crate::wait_until(Duration::from_secs(10), Duration::from_millis(100), || {
                all.iter().all(|ns| {
                    ip(&["-n", ns, "-6", "addr", "show", "tentative"])
                        .map(|out| out.trim().is_empty())
                        .unwrap_or(false)
                })
            });
        if !settled {
            return Err(anyhow!("IPv6 addresses still tentative after 10 s"));
        }
        Ok(())
    }

    fn add_netns(&self, ns: &str) -> Result<()> {
        ip(&["netns", "add", ns])?;
        lock(&self.state).netns.push(ns.to_string());
        Ok(())
    }

    fn wire_to_switch(&self, ns: &str, port: &str, v4: Ipv4Addr, v6: Ipv6Addr) -> Result<()> {
        wire_eth0(&self.switch, "br0", port, ns, v4, v6, None)
    }

    fn add_node(&mut self, i: u8, total: u8) -> Result<()> {
        let name = format!("n{i}");
        let ns = format!("{}-{name}", self.prefix);
        self.add_netns(&ns)?;
        self.wire_to_switch(&ns, &format!("v{name}"), node_v4(i), node_v6(i))?;
        ip(&["-n", &ns, "link", "add", "cbr0", "type", "bridge"])?;
        add_addrs(
            &ns,
            "cbr0",
            &format!("10.244.{i}.1/24"),
            &format!("fd00:244:{i}::1/64"),
        )?;
        ip(&["-n", &ns, "link", "set", "cbr0", "up"])?;
        sysctl(
            &ns,
            &[
                "net.ipv4.ip_forward=1",
                "net.ipv6.conf.all.forwarding=1",
                "net.ipv4.conf.all.rp_filter=0",
                "net.ipv4.conf.default.rp_filter=0",
            ],
        )?;
        self.nodes.push(Node {
            name,
            index: i,
            netns: ns,
        });
        self.add_node_routes(i, total)
    }

    /// Node `i`'s routes to the other nodes' pod CIDRs, through `eth0`.
    fn add_node_routes(&self, i: u8, total: u8) -> Result<()> {
        let ns = &self.nodes[i as usize - 1].netns;
        for j in 1..=total {
            if j == i {
                continue;
            }
            add_routes(
                ns,
                &format!("10.244.{j}.0/24"),
                &node_v4(j).to_string(),
                &format!("fd00:244:{j}::/64"),
                &node_v6(j).to_string(),
            )?;
        }
        Ok(())
    }

    /// Makes the veths carry what the XDP stage sends, and deliver to it
    /// what a NIC would:
    /// - a node's `eth0` sends with `XDP_TX` into its switch port, which
    ///   receives such frames at once only when it runs an XDP program
    ///   itself (with GRO alone they wait in its ring until the next
    ///   packet sent the ordinary way): a pass program
    ///   ([`XdpPass`](crate::xdp_pass::XdpPass));
    /// - what GRO merges there must not reach the other node's `eth0` as
    ///   one large frame (a NIC delivers none over the MTU to XDP, and
    ///   veth drops one over a page when the program takes no fragments):
    ///   the switch ports segment what they send (`gso off`);
    /// - XDP cannot tell a partial checksum (a veth's sender offloads it)
    ///   from a complete one and updates it as complete, as a NIC
    ///   delivers it: every sender computes it in full (`tx off`: the
    ///   clients, the pods and the switch ports).
    pub fn accelerate(&mut self) -> Result<()> {
        if self.xdp_pass.is_some() {
            return Ok(());
        }
        crate::agent::ensure_bpffs()?;
        let pin = Path::new(crate::agent::BPFFS_ROOT).join(format!("{}-xdp-pass", self.prefix));
        let pass = crate::xdp_pass::XdpPass::load(&pin)?;
        for n in &self.nodes {
            switch_port_for_xdp(&self.switch, &n.name, &pass)?;
        }
        self.xdp_pass = Some(pass);
        let senders = self
            .pods
            .iter()
            .map(|p| p.netns.clone())
            .chain([self.client_netns.clone(), self.client2_netns.clone()]);
        for ns in senders {
            ethtool(&ns, &["-K", "eth0", "tx", "off"])?;
        }
        Ok(())
    }

    /// Deletes node `node`'s `eth0` (and its switch end, the other end of
    /// the veth pair), as a NIC reset or a re-created bond does: its MAC
    /// address, for [`replug_node`](Self::replug_node).
    pub fn unplug_node(&self, node: u8) -> Result<String> {
        let ns = self.nodes[node as usize - 1].netns.clone();
        let mac = eth0_mac(&ns)?;
        ip(&["-n", &ns, "link", "del", "eth0"])?;
        Ok(mac)
    }

    /// Creates node `node`'s `eth0` again as it was: the same name, MAC
    /// address (so that the neighbours' caches still hold), addresses and
    /// routes, a new ifindex.
    pub fn replug_node(&self, node: u8, mac: &str) -> Result<()> {
        let n = self.nodes[node as usize - 1].clone();
        wire_eth0(
            &self.switch,
            "br0",
            &format!("v{}", n.name),
            &n.netns,
            node_v4(node),
            node_v6(node),
            Some(mac),
        )?;
        if let Some(pass) = &self.xdp_pass {
            switch_port_for_xdp(&self.switch, &n.name, pass)?;
        }
        self.add_node_routes(node, self.nodes.len() as u8)
    }

    fn add_pod(&mut self, node: u8, k: u8) -> Result<()> {
        let name = format!("n{node}p{k}");
        let ns = format!("{}-{name}", self.prefix);
        let node_ns = self.nodes[node as usize - 1].netns.clone();
        self.add_netns(&ns)?;
        let host_end = format!("vp{k}");
        let v4 = Ipv4Addr::new(10, 244, node, 10 + k);
        let v6 = Ipv6Addr::new(0xfd00, 0x244, node as u16, 0, 0, 0, 0, 0x10 + k as u16);
        wire_eth0(&node_ns, "cbr0", &host_end, &ns, v4, v6, None)?;
        // Towards the node only; the node has no route out.
        add_routes(
            &ns,
            "default",
            &format!("10.244.{node}.1"),
            "default",
            &format!("fd00:244:{node}::1"),
        )?;
        self.pods.push(Pod {
            name,
            node,
            netns: ns,
            ipv4: v4,
            ipv6: v6,
        });
        Ok(())
    }

    /// A route in an external client's namespace for `prefix` via node
    /// `node` (how a load balancer or a router would deliver LoadBalancer
    /// IPs and externalIPs). Never a default route.
    pub fn route_via(&self, netns: &str, prefix: &str, node: u8) -> Result<()> {
        let via = if prefix.contains(':') {
            node_v6(node).to_string()
        } else {
            node_v4(node).to_string()
        };
        ip(&["-n", netns, "route", "replace", prefix, "via", &via]).map(|_| ())
    }

    /// `lb-probe serve --name POD --port 8080 --with-peer` in every pod.
    pub fn serve_all(&self) -> Result<()> {
        let probe = crate::probe_bin()?;
        for pod in &self.pods {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", &pod.netns])
                .arg(&probe)
                .args(["serve", "--name", &pod.name, "--port"])
                .arg(POD_PORT.to_string())
                .arg("--with-peer");
            let mut child = cmd::die_with_parent(&mut c, libc::SIGKILL)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .with_context(|| format!("serving in {}", pod.name))?;
            let stdout = child.stdout.take().expect("piped");
            lock(&self.state).children.push((pod.name.clone(), child));
            let mut line = String::new();
            std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line)?;
            if !line.contains("\"listening\"") {
                return Err(anyhow!("lb-probe serve in {} said {line:?}", pod.name));
            }
        }
        Ok(())
    }

    /// Kills pod `name`'s server: its connects are refused from then on
    /// (the pod's namespace stays).
    pub fn stop_server(&self, name: &str) -> Result<()> {
        let mut st = lock(&self.state);
        let before = st.children.len();
        st.children.retain_mut(|(n, c)| {
            if n != name {
                return true;
            }
            let _ = c.kill();
            let _ = c.wait();
            false
        });
        if st.children.len() == before {
            return Err(anyhow!("no server in pod {name}"));
        }
        Ok(())
    }

    /// The `v1 Node` objects, with their InternalIPs.
    pub fn node_objects(&self) -> Vec<Value> {
        self.nodes
            .iter()
            .map(|n| {
                json!({
                    "apiVersion": "v1", "kind": "Node",
                    "metadata": {"name": n.name},
                    "status": {"addresses": [
                        {"type": "Hostname", "address": n.name},
                        {"type": "InternalIP", "address": node_v4(n.index).to_string()},
                        {"type": "InternalIP", "address": node_v6(n.index).to_string()},
                    ]}
                })
            })
            .collect()
    }

    /// NodePort Service `demo/{name}` at ClusterIP `cluster_ip`: port
    /// `http` 80/TCP to the pods' 8080, on node port `node_port`.
    pub fn node_port_service(name: &str, cluster_ip: &str, node_port: u16) -> Value {
        json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": "demo"},
            "spec": {"type": "NodePort", "clusterIP": cluster_ip,
                "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": POD_PORT,
                    "nodePort": node_port}]},
        })
    }

    /// An EndpointSlice of `service` (namespace `demo`) with `pods`, port
    /// 8080 named `http`, of one family.
    pub fn slice(&self, service: &str, pods: &[&Pod], v6: bool, proto: &str) -> Value {
        json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": format!("{service}-{}", if v6 {"v6"} else {"v4"}), "namespace": "demo",
                "labels": {"kubernetes.io/service-name": service}},
            "addressType": if v6 {"IPv6"} else {"IPv4"},
            "ports": [{"name": "http", "port": POD_PORT, "protocol": proto}],
            "endpoints": pods.iter().map(|p| json!({
                "addresses": [if v6 { p.ipv6.to_string() } else { p.ipv4.to_string() }],
                "nodeName": format!("n{}", p.node),
                "conditions": {"ready": true},
            })).collect::<Vec<_>>(),
        })
    }

    pub fn pod(&self, name: &str) -> &Pod {
        self.pods
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no pod {name}"))
    }

    /// One agent per node, in the node's namespace, with its own pins and
    /// child cgroup; `extra` arguments for all of them.
    pub fn start_agents(&mut self, extra: &[&str]) -> Result<()> {
        let manifests = self.manifests.path().to_path_buf();
        for n in self.nodes.clone() {
            let opts = AgentOpts {
                extra_args: extra.iter().map(|s| s.to_string()).collect(),
                ..Default::default()
            };
            self.start_node_agent(&n, opts, |cg, opts| Agent::start(&manifests, cg, opts))?;
        }
        Ok(())
    }

    /// One agent, on node `node` only (the others run none), waiting up to
    /// `ready_timeout` for `/readyz`. For a topology where only the entry
    /// node balances (the benchmark). [`cgroup`](Self::cgroup) indexes the
    /// agents by start order, so it is right here only for node 1.
    pub fn start_agent_on(
        &mut self,
        node: u8,
        extra: &[String],
        ready_timeout: Duration,
    ) -> Result<()> {
        let n = self.nodes[node as usize - 1].clone();
        let manifests = self.manifests.path().to_path_buf();
        let opts = AgentOpts {
            extra_args: extra.to_vec(),
            ready_timeout,
            ..Default::default()
        };
        self.start_node_agent(&n, opts, |cg, opts| Agent::start(&manifests, cg, opts))
    }

    /// Adds `addr/24` to pod `pod`'s `eth0` (a pod namespace that answers
    /// on several addresses).
    pub fn add_pod_address(&self, pod: &str, addr: Ipv4Addr) -> Result<()> {
        let ns = self.pod(pod).netns.clone();
        ip(&[
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{addr}/24"),
            "dev",
            "eth0",
        ])
        .map(|_| ())
    }

    /// Another namespace on the nodes' network, `192.168.77.{index}` and
    /// `fd00:77::{index}` on its `eth0`, no default route (more external
    /// clients, an attacker): its name, torn down with the cluster.
    pub fn add_external(&self, tag: &str, index: u8) -> Result<String> {
        let ns = format!("{}-{tag}", self.prefix);
        self.add_netns(&ns)?;
        self.wire_to_switch(&ns, &format!("v{tag}"), node_v4(index), node_v6(index))?;
        if self.xdp_pass.is_some() {
            ethtool(&ns, &["-K", "eth0", "tx", "off"])?;
        }
        Ok(ns)
    }

    /// Every network namespace of the cluster (switch, nodes, pods,
    /// clients, and those of [`add_external`](Self::add_external)).
    pub fn namespaces(&self) -> Vec<String> {
        lock(&self.state).netns.clone()
    }

    /// The namespaces that have a default route (IPv4 or IPv6): none may,
    /// but the pods, whose default route leads to their node (which has
    /// none).
    pub fn with_default_route(&self) -> Vec<String> {
        let pods: Vec<&str> = self.pods.iter().map(|p| p.netns.as_str()).collect();
        self.namespaces()
            .into_iter()
            .filter(|ns| !pods.contains(&ns.as_str()))
            .filter(|ns| {
                ["-4", "-6"].iter().any(|fam| {
                    ip(&["-n", ns, fam, "route", "show", "default"])
                        .map(|o| !o.trim().is_empty())
                        .unwrap_or(true)
                })
            })
            .collect()
    }

    /// `sysctl -w` settings inside network namespace `netns`.
    pub fn sysctl(&self, netns: &str, settings: &[&str]) -> Result<()> {
        sysctl(netns, settings)
    }

    /// Like [`start_agents`](Self::start_agents), in cluster mode against
    /// the API server at `url` (reachable from the node namespaces).
    pub fn start_agents_cluster(&mut self, url: &str, extra: &[&str]) -> Result<()> {
        let urls = vec![url.to_string(); self.nodes.len()];
        self.start_agents_cluster_each(&urls, extra)
    }

    /// Like [`start_agents_cluster`](Self::start_agents_cluster), node
    /// `n{i+1}`'s agent against `urls[i]`: one API server fixture inside
    /// each node's namespace, where the agent's `127.0.0.1` is.
    pub fn start_agents_cluster_each(&mut self, urls: &[String], extra: &[&str]) -> Result<()> {
        for (n, url) in self.nodes.clone().iter().zip(urls) {
            let opts = AgentOpts {
                extra_args: extra.iter().map(|s| s.to_string()).collect(),
                ..Default::default()
            };
            self.start_node_agent(n, opts, |cg, opts| {
                Agent::start_cluster(crate::agent::Source::ApiServer(url), cg, opts)
            })?;
        }
        Ok(())
    }

    /// Starts node `n`'s agent with `start(cgroup, opts)`: in its own child
    /// cgroup and the node's namespace, logging to `agent-NODE.log`.
    fn start_node_agent(
        &mut self,
        n: &Node,
        mut opts: AgentOpts,
        start: impl FnOnce(&Path, AgentOpts) -> Result<Agent>,
    ) -> Result<()> {
        // One argument, `--acceleration=MODE`, so that a test can drop it
        // for a restart (`Agent::remove_arg`); first, so that a test that
        // swaps the value of a flag at the end (`remove_arg`, `add_args`)
        // keeps the pair together.
        let asked = |a: &String| a.starts_with("--acceleration");
        if !opts.extra_args.iter().any(asked) {
            if let Some(mode) = acceleration_from_env() {
                opts.extra_args.insert(0, format!("--acceleration={mode}"));
            }
        }
        if opts
            .extra_args
            .iter()
            .any(|a| asked(a) && a != "--acceleration=off")
        {
            self.accelerate()?;
        }
        let cg = CgroupGuard::create(&format!("{}-{}", self.prefix, n.name))?;
        opts.node_name = n.name.clone();
        opts.netns = Some(n.netns.clone());
        opts.log_file = Some(self.dir.path().join(format!("agent-{}.log", n.name)));
        let agent = start(cg.path(), opts).with_context(|| format!("agent of {}", n.name))?;
        self.cgroups.push(cg);
        self.agents.push(agent);
        Ok(())
    }

    /// The child cgroup of node `node`'s agent (after `start_agents`).
    pub fn cgroup(&self, node: u8) -> &Path {
        self.cgroups[node as usize - 1].path()
    }

    /// `count` attempts from `netns` as a member of node `node`'s cgroup:
    /// a pod (or a host process) whose sockets the socket hooks translate.
    pub fn from_pod(
        &self,
        node: u8,
        netns: &str,
        proto: &str,
        target: &str,
        count: usize,
    ) -> Vec<Attempt> {
        self.from_pod_with(node, netns, proto, target, count, &[])
    }

    /// [`from_pod`](Self::from_pod), with `extra` arguments for the client
    /// (which may set its own `--timeout-ms`).
    pub fn from_pod_with(
        &self,
        node: u8,
        netns: &str,
        proto: &str,
        target: &str,
        count: usize,
        extra: &[&str],
    ) -> Vec<Attempt> {
        let probe = crate::probe_bin().expect("lb-probe");
        let mut c = Command::new(probe);
        c.args(["client", "--cgroup"])
            .arg(self.cgroup(node))
            .args(["--netns", netns, "--target", target, "--proto", proto])
            .args(["--count", &count.to_string()])
            .args(extra);
        if !extra.contains(&"--timeout-ms") {
            c.args(["--timeout-ms", "1000"]);
        }
        let out = cmd::run(&mut c).unwrap_or_else(|e| panic!("{e:#}"));
        parse_attempts(&out).unwrap_or_else(|e| panic!("{e:#}"))
    }

    /// `count` attempts from the external client at `target`.
    pub fn from_client(&self, proto: &str, target: &str, count: usize) -> Vec<Attempt> {
        self.from_netns(&self.client_netns.clone(), proto, target, count)
    }

    /// `count` attempts from network namespace `netns` (no cgroup: the
    /// socket hooks do not apply), 1 s timeout each.
    pub fn from_netns(&self, netns: &str, proto: &str, target: &str, count: usize) -> Vec<Attempt> {
        self.from_netns_with(netns, proto, target, count, &[])
    }

    /// [`from_netns`](Self::from_netns), with `extra` arguments for the
    /// client (which may set its own `--timeout-ms`).
    pub fn from_netns_with(
        &self,
        netns: &str,
        proto: &str,
        target: &str,
        count: usize,
        extra: &[&str],
    ) -> Vec<Attempt> {
        let probe = crate::probe_bin().expect("lb-probe");
        let mut c = Command::new(probe);
        c.args([
            "client", "--netns", netns, "--target", target, "--proto", proto,
        ])
        .args(["--count", &count.to_string()])
        .args(extra);
        if !extra.contains(&"--timeout-ms") {
            c.args(["--timeout-ms", "1000"]);
        }
        let out = cmd::run(&mut c).unwrap_or_else(|e| panic!("{e:#}"));
        parse_attempts(&out).unwrap_or_else(|e| panic!("{e:#}"))
    }

    /// GET on a node's health-check node port, from the client namespace.
    pub fn health_check(&self, node: u8, port: u16) -> Result<(u16, String)> {
        http_get_in(Some(&self.client_netns), (node_v4(node), port).into(), "/")
    }

    /// Runs `f` until it is true, for up to `timeout`.
    pub fn eventually(timeout: Duration, f: impl FnMut() -> bool) -> bool {
        crate::wait_until(timeout, Duration::from_millis(100), f)
    }

    pub fn agent_logs(&self) -> String {
        self.agents
            .iter()
            .map(|a| a.log())
            .collect::<Vec<_>>()
            .join("\n----\n")
    }

    pub fn manifests_dir(&self) -> &Path {
        self.manifests.path()
    }
}
