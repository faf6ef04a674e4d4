//! The test bed of the chaos run: two nodes with four pods each, one agent
//! per node in cluster mode against an API server fixture inside that
//! node's namespace (both fixtures hold the same objects: one control
//! plane), Service `demo/web` on half of the pods, and the record of its
//! backend set over time.
use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, Instant},
};

use anyhow::{anyhow, Context as _, Result};
use integration_tests::{
    apiserver::{ApiServer, Kind},
    cluster::frontend_backends,
    netns::{enter_netns, in_netns},
    nodes::{node_v4, Cluster, Pod, POD_PORT},
    probe::monotonic_ns,
    tcpflow::StreamServers,
};
use serde_json::{json, Value};

/// Service `demo/web`: ClusterIP and NodePort, three ports.
pub const WEB_VIP: &str = "10.96.0.10";
pub const HTTP_PORT: u16 = 80;
pub const DNS_PORT: u16 = 53;
pub const STREAM_PORT: u16 = 90;
pub const HTTP_NODEPORT: u16 = 30080;
pub const DNS_NODEPORT: u16 = 30053;
pub const STREAM_NODEPORT: u16 = 30090;
/// Where the pods' `lb-probe tcp-serve` (long-lived echo streams) listens.
pub const STREAM_POD_PORT: u16 = 9090;

/// Pods per node; `web` uses half of them at a time (`p0`,`p1` or `p2`,`p3`
/// of each node), a rollout moves it to the other half.
const PODS_PER_NODE: u8 = 4;

/// An endpoint's state in the slice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cond {
    Ready,
    /// `ready: false, serving: true, terminating: true`: a pod shutting
    /// down gracefully.
    Terminating,
    /// `ready: false, serving: false, terminating: false`: a pod whose node
    /// the node controller marked NotReady. Not one of web's backends.
    NotReady,
}

/// One published backend set of `web`: when it was written to the API
/// servers and when every running agent had it in its maps.
#[derive(Debug, Clone)]
pub struct Change {
    pub set: BTreeSet<String>,
    pub written: u64,
    pub synced: u64,
}

/// `web`'s backend sets over time.
#[derive(Debug, Clone, Default)]
pub struct Timeline(pub Vec<Change>);

impl Timeline {
    /// The pods that may answer `web` in `[start, end]`: those of every set
    /// current at some moment of it. A set is current from (at the
    /// earliest) its write until (at the latest) the next one is synced.
    pub fn allowed(&self, start: u64, end: u64) -> BTreeSet<String> {
        let c = &self.0;
        c.iter()
            .enumerate()
            .filter(|(i, ch)| ch.written <= end && c.get(i + 1).is_none_or(|n| n.synced >= start))
            .flat_map(|(_, ch)| ch.set.iter().cloned())
            .collect()
    }

    /// Whether a change that took a backend out was being published during
    /// `[start, end]` (or up to a second before: the agent destroys the
    /// sockets right after it programmed the change). A connected UDP
    /// socket on that backend is then destroyed by design and its `recv`
    /// fails with `ECONNABORTED` (as `tests/sock_stress.rs` allows too).
    pub fn removing(&self, start: u64, end: u64) -> bool {
        self.0.windows(2).any(|w| {
            w[1].written <= end
                && w[1].synced + 1_000_000_000 >= start
                && !w[0].set.is_subset(&w[1].set)
        })
    }
}

pub struct Bed {
    /// The pods' stream servers, killed on drop.
    _streams: StreamServers,
    pub c: Cluster,
    pub apis: Vec<ApiServer>,
    /// `web`'s endpoints now, by pod name.
    pub web: BTreeMap<String, Cond>,
    pub timeline: Timeline,
    /// The agents' memory cgroups (the memory phase): removed after the
    /// agents stopped.
    pub memory: Vec<crate::phases::MemoryCgroup>,
}

fn service(name: &str, vip: &str, node_ports: bool) -> Value {
    let mut ports =
        vec![json!({"name": "http", "port": HTTP_PORT, "targetPort": POD_PORT, "protocol": "TCP"})];
    if node_ports {
        ports[0]["nodePort"] = json!(HTTP_NODEPORT);
        ports.push(
            json!({"name": "dns", "port": DNS_PORT, "targetPort": POD_PORT,
            "protocol": "UDP", "nodePort": DNS_NODEPORT}),
        );
        ports.push(
            json!({"name": "stream", "port": STREAM_PORT, "targetPort": STREAM_POD_PORT,
            "protocol": "TCP", "nodePort": STREAM_NODEPORT}),
        );
    }
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "demo"},
        "spec": {"type": if node_ports {"NodePort"} else {"ClusterIP"},
            "clusterIP": vip, "clusterIPs": [vip], "ipFamilies": ["IPv4"], "ports": ports},
    })
}

/// The EndpointSlice `NAME-1` of Service `name` with `eps` (pod, state).
fn slice(name: &str, pods: &[(&Pod, Cond)], all_ports: bool) -> Value {
    let mut ports = vec![json!({"name": "http", "port": POD_PORT, "protocol": "TCP"})];
    if all_ports {
        ports.push(json!({"name": "dns", "port": POD_PORT, "protocol": "UDP"}));
        ports.push(json!({"name": "stream", "port": STREAM_POD_PORT, "protocol": "TCP"}));
    }
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{name}-1"), "namespace": "demo",
            "labels": {"kubernetes.io/service-name": name}},
        "addressType": "IPv4",
        "ports": ports,
        "endpoints": pods.iter().map(|(p, cond)| {
            let (ready, serving, terminating) = match cond {
                Cond::Ready => (true, true, false),
                Cond::Terminating => (false, true, true),
                Cond::NotReady => (false, false, false),
            };
            json!({
                "addresses": [p.ipv4.to_string()],
                "nodeName": format!("n{}", p.node),
                "conditions": {"ready": ready, "serving": serving, "terminating": terminating},
            })
        }).collect::<Vec<_>>(),
    })
}

impl Bed {
    /// Builds the topology, starts the servers, the fixtures with `web` on
    /// the first half of the pods, and the agents (with `agent_args`).
    pub fn new(agent_args: &[&str]) -> Result<Self> {
        let c = Cluster::new("chaos", &[PODS_PER_NODE, PODS_PER_NODE]).context("topology")?;
        c.serve_all()?;
        let streams = StreamServers::start(&c.pods, STREAM_POD_PORT, &[])?;
        // ClusterIP clients run in the external client's namespace (no
        // default route) with a route to the pod network via node 1.
        let client = c.client_netns.clone();
        c.route_via(&client, "10.244.0.0/16", 1)?;
        let mut apis = Vec::new();
        for n in &c.nodes {
            apis.push(in_netns(&n.netns, ApiServer::try_start)??);
        }
        let mut bed = Bed {
            _streams: streams,
            c,
            apis,
            web: BTreeMap::new(),
            timeline: Timeline::default(),
            memory: Vec::new(),
        };
        for node in bed.c.node_objects() {
            bed.apply(&node)?;
        }
        bed.apply(&service("web", WEB_VIP, true))?;
        let first: BTreeMap<String, Cond> = Self::group(0)
            .into_iter()
            .map(|p| (p, Cond::Ready))
            .collect();
        bed.web = first.clone();
        bed.apply(&bed.web_slice())?;
        let urls: Vec<String> = bed.apis.iter().map(|a| a.url()).collect();
        bed.c.start_agents_cluster_each(&urls, agent_args)?;
        let now = monotonic_ns();
        bed.wait_web_synced(Duration::from_secs(20))?;
        bed.timeline.0.push(Change {
            set: first.into_keys().collect(),
            written: now,
            synced: monotonic_ns(),
        });
        Ok(bed)
    }

    /// Pod names of half `half` (0 or 1) of every node: `p0`,`p1` or `p2`,`p3`.
    pub fn group(half: u8) -> Vec<String> {
        let mut v = Vec::new();
        for node in 1..=2 {
            for k in [2 * half, 2 * half + 1] {
                v.push(format!("n{node}p{k}"));
            }
        }
        v
    }

    /// Writes `obj` to every fixture.
    pub fn apply(&self, obj: &Value) -> Result<()> {
        for api in &self.apis {
            api.apply(obj)
                .with_context(|| format!("applying {}", obj["metadata"]["name"]))?;
        }
        Ok(())
    }

    /// Ends an outage of every fixture: each binds its port again inside
    /// its node's namespace (a listener is bound in the namespace of the
    /// thread that binds it).
    pub fn apis_come_back(&self) -> Result<()> {
        std::thread::scope(|s| {
            let threads: Vec<_> = self
                .apis
                .iter()
                .zip(&self.c.nodes)
                .map(|(api, n)| {
                    s.spawn(move || -> Result<()> {
                        enter_netns(&n.netns)?;
                        api.come_back();
                        Ok(())
                    })
                })
                .collect();
            for t in threads {
                t.join()
                    .map_err(|_| anyhow!("an API server fixture panicked coming back"))??;
            }
            Ok(())
        })
    }

    /// Deletes an object from every fixture.
    pub fn delete(&self, kind: Kind, name: &str) {
        for api in &self.apis {
            api.delete(kind, "demo", name);
        }
    }

    fn web_slice(&self) -> Value {
        let pods: Vec<(&Pod, Cond)> = self
            .web
            .iter()
            .map(|(name, cond)| (self.c.pod(name), *cond))
            .collect();
        slice("web", &pods, true)
    }

    /// A ClusterIP-only Service `name` at `vip` (port 80) on `pods`.
    pub fn plain_service(&self, name: &str, vip: &str, pods: &[String]) -> Result<()> {
        self.apply(&service(name, vip, false))?;
        self.plain_slice(name, pods)
    }

    pub fn plain_slice(&self, name: &str, pods: &[String]) -> Result<()> {
        let eps: Vec<(&Pod, Cond)> = pods.iter().map(|p| (self.c.pod(p), Cond::Ready)).collect();
        self.apply(&slice(name, &eps, false))
    }

    pub fn delete_service(&self, name: &str) {
        self.delete(Kind::EndpointSlice, &format!("{name}-1"));
        self.delete(Kind::Service, name);
    }

    /// Publishes `web`'s endpoints `eps`, waits until every running agent
    /// has them in its maps and records the change; how long that took.
    pub fn publish_web(&mut self, eps: BTreeMap<String, Cond>) -> Result<Duration> {
        self.web = eps;
        let written = monotonic_ns();
        let t = Instant::now();
        self.apply(&self.web_slice())?;
        let r = self.wait_web_synced(Duration::from_secs(15));
        self.timeline.0.push(Change {
            set: self.web_pods(),
            written,
            synced: monotonic_ns(),
        });
        r.map(|()| t.elapsed())
    }

    /// The pods that are web's backends now (not those marked not ready).
    fn web_pods(&self) -> BTreeSet<String> {
        self.web
            .iter()
            .filter(|(_, c)| **c != Cond::NotReady)
            .map(|(p, _)| p.clone())
            .collect()
    }

    /// The backends (`IP:PORT`) `web`'s ClusterIP frontend should have.
    fn web_backends(&self) -> BTreeSet<String> {
        self.web_pods()
            .iter()
            .map(|p| format!("{}:{POD_PORT}", self.c.pod(p).ipv4))
            .collect()
    }

    /// Writes `web`'s Service with `annotations` (none: `{}`) and waits
    /// until every running agent reports outlier detection `detection`
    /// (`inspect services`) for its ClusterIP frontend.
    pub fn annotate_web(&self, annotations: Value, detection: &str) -> Result<()> {
        let mut svc = service("web", WEB_VIP, true);
        svc["metadata"]["annotations"] = annotations;
        self.apply(&svc)?;
        for (i, agent) in self.c.agents.iter().enumerate() {
            if !agent.is_running() {
                continue;
            }
            let deadline = Instant::now() + Duration::from_secs(15);
            loop {
                let v = agent.inspect_services()?;
                let have = v.as_array().into_iter().flatten().find(|f| {
                    f["addr"].as_str() == Some(WEB_VIP)
                        && f["port"].as_u64() == Some(HTTP_PORT as u64)
                });
                if have.is_some_and(|f| f["outlier_detection"].as_str() == Some(detection)) {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(anyhow!(
                        "the agent of n{} did not turn web's outlier detection {detection} \
                         within 15 s",
                        i + 1
                    ));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(())
    }

    /// Takes pod `pod`'s link down or up at its node (the node's end of its
    /// veth, a port of the node's bridge): down, nothing reaches the pod
    /// and nothing answers for it, as when its node loses power; the pod's
    /// own routes stay (they go only with an interface taken down there).
    pub fn pod_link(&self, pod: &str, up: bool) -> Result<()> {
        let p = self.c.pod(pod);
        let k = pod
            .rsplit_once('p')
            .and_then(|(_, k)| k.parse::<u8>().ok())
            .ok_or_else(|| anyhow!("pod name {pod}: no index"))?;
        let node = &self.c.nodes[p.node as usize - 1].netns;
        let port = format!("vp{k}");
        let state = if up { "up" } else { "down" };
        integration_tests::cmd::ip(&["-n", node, "link", "set", "dev", &port, state])?;
        Ok(())
    }

    /// Polls `inspect services` of every running agent until `web`'s
    /// ClusterIP frontend has exactly the current endpoints.
    pub fn wait_web_synced(&self, timeout: Duration) -> Result<()> {
        let want = self.web_backends();
        for (i, agent) in self.c.agents.iter().enumerate() {
            if !agent.is_running() {
                continue;
            }
            let deadline = Instant::now() + timeout;
            loop {
                let have = frontend_backends(agent, WEB_VIP, HTTP_PORT, Some("TCP"))?
                    .map(|b| b.into_iter().collect::<BTreeSet<_>>());
                if have.as_ref() == Some(&want) {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(anyhow!(
                        "the agent of n{} did not publish web's endpoints {want:?} within \
                         {timeout:?} (has {have:?})",
                        i + 1
                    ));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        Ok(())
    }

    /// Every agent's `lb_datapath_events_total` samples (kernel counters in
    /// the pinned `LB_STATS`: they outlive restarts), by node and sample.
    pub fn datapath_events(&self) -> BTreeMap<(u8, String), f64> {
        let mut m = BTreeMap::new();
        for (i, agent) in self.c.agents.iter().enumerate() {
            let Ok((_, text)) = agent.metrics() else {
                continue;
            };
            for l in text.lines().filter(|l| l.starts_with("lb_datapath_events")) {
                if let Some((name, v)) = l.rsplit_once(' ') {
                    if let Ok(v) = v.parse() {
                        m.insert((i as u8 + 1, name.to_string()), v);
                    }
                }
            }
        }
        m
    }

    /// `IP:PORT` of node `node`'s NodePort `port`.
    pub fn node_port(node: u8, port: u16) -> String {
        format!("{}:{port}", node_v4(node))
    }
}
