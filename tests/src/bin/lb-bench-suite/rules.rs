//! The Services of one scale point, and the same Services in each arm's
//! language: manifests for our agent, an `iptables-restore` file in the shape
//! of kube-proxy's iptables mode, an `nft -f` file in the shape of its
//! nftables mode. Generated once and cached under `target/bench-cache/`.
use std::{
    fmt::Write as _,
    net::{Ipv4Addr, SocketAddrV4},
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result};
use serde_json::{json, Value};

/// The Service every arm measures: `10.96.0.10:80` TCP and UDP.
pub const TARGET_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
pub const TARGET_PORT: u16 = 80;
pub const BACKEND_PORT: u16 = 8080;
/// kube-proxy's `--cluster-cidr`: pod sources are not masqueraded.
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
/// The Service CIDR; clients get a route for it (never a default route).
pub const SERVICE_CIDR: &str = "10.96.0.0/12";

/// The target's endpoints: addresses of the one backend namespace.
pub fn target_endpoints(n: u8) -> Vec<Ipv4Addr> {
    (1..=n).map(|i| Ipv4Addr::new(10, 244, 1, i)).collect()
}

/// `services` Services (the target plus `services - 1` fillers), each filler
/// with `endpoints` endpoints on addresses nothing answers (never reached).
#[derive(Clone, Debug)]
pub struct Scenario {
    pub services: usize,
    pub endpoints: usize,
    pub target: Vec<Ipv4Addr>,
}

impl Scenario {
    /// The target's endpoints, at the backend port.
    pub fn backends(&self) -> Vec<SocketAddrV4> {
        self.target
            .iter()
            .map(|a| SocketAddrV4::new(*a, BACKEND_PORT))
            .collect()
    }
}

/// The EndpointSlice of the target Service with endpoints `eps`.
fn target_slice(eps: Vec<Value>) -> Value {
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"name": "target-abcde", "namespace": "bench",
                        "labels": {"kubernetes.io/service-name": "target"}},
           "addressType": "IPv4",
           "ports": [{"name": "tcp", "port": BACKEND_PORT, "protocol": "TCP"},
                     {"name": "udp", "port": BACKEND_PORT, "protocol": "UDP"}],
           "endpoints": eps})
}

fn filler_vip(i: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 97, 0, 0)) + i as u32)
}

fn filler_endpoint(i: usize, j: usize, per: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 128, 0, 0)) + (i * per + j) as u32)
}

/// A stable 16-character name hash, as kube-proxy's chain names carry.
fn hash16(s: &str) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let mut h: u64 = 0xcbf29ce484222325;
    for b in s.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x100000001b3);
    }
    let mut h2 = h.rotate_left(31).wrapping_mul(0x9E3779B97F4A7C15);
    let mut out = String::with_capacity(16);
    for i in 0..16 {
        let v = if i < 12 { h } else { h2 };
        out.push(ALPHABET[(v & 31) as usize] as char);
        if i < 12 {
            h >>= 5;
        } else {
            h2 >>= 5;
        }
    }
    out
}

/// One Service port as the generators see it.
struct Port {
    /// `ns/name:port`
    name: String,
    vip: Ipv4Addr,
    port: u16,
    proto: &'static str,
    endpoints: Vec<(Ipv4Addr, u16)>,
    /// The target's node port, in the NodePort shapes.
    node_port: Option<u16>,
}

impl Scenario {
    pub fn new(services: usize, endpoints: usize, target: Vec<Ipv4Addr>) -> Self {
        Self {
            services,
            endpoints,
            target,
        }
    }

    /// Cache key.
    pub fn tag(&self) -> String {
        format!(
            "{}x{}-t{}",
            self.services,
            self.endpoints,
            self.target
                .iter()
                .map(|a| a.octets()[3].to_string())
                .collect::<Vec<_>>()
                .join(".")
        )
    }

    /// Every Service port, fillers first and the target's last (as
    /// kube-proxy would order a Service that sorts last).
    fn ports(&self, node_port: Option<u16>) -> impl Iterator<Item = Port> + '_ {
        let fillers = (0..self.services.saturating_sub(1)).map(move |i| Port {
            name: format!("bench/svc-{i}:http"),
            vip: filler_vip(i),
            port: 80,
            proto: "tcp",
            endpoints: (0..self.endpoints)
                .map(|j| (filler_endpoint(i, j, self.endpoints), 8080))
                .collect(),
            node_port: None,
        });
        let target = ["tcp", "udp"].into_iter().map(move |proto| Port {
            name: format!("bench/target:{proto}"),
            vip: TARGET_VIP,
            port: TARGET_PORT,
            proto,
            endpoints: self.target.iter().map(|a| (*a, BACKEND_PORT)).collect(),
            node_port,
        });
        fillers.chain(target)
    }

    /// The filler Services and their slices, as one JSON `List`.
    pub fn filler_manifests(&self) -> Value {
        let mut items = Vec::with_capacity(2 * self.services);
        for i in 0..self.services.saturating_sub(1) {
            items.push(json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": format!("svc-{i}"), "namespace": "bench"},
                "spec": {"type": "ClusterIP", "clusterIP": filler_vip(i).to_string(),
                         "clusterIPs": [filler_vip(i).to_string()],
                         "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]},
            }));
            let eps: Vec<Value> = (0..self.endpoints)
                .map(|j| {
                    json!({"addresses": [filler_endpoint(i, j, self.endpoints).to_string()],
                                "conditions": {"ready": true}})
                })
                .collect();
            items.push(json!({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": format!("svc-{i}-abcde"), "namespace": "bench",
                             "labels": {"kubernetes.io/service-name": format!("svc-{i}")}},
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
                "endpoints": eps,
            }));
        }
        json!({"apiVersion": "v1", "kind": "List", "items": items})
    }

    /// The target Service and its slice, with endpoints `target`.
    pub fn target_manifests(target: &[Ipv4Addr]) -> Value {
        let eps: Vec<Value> = target
            .iter()
            .map(|a| json!({"addresses": [a.to_string()], "conditions": {"ready": true}}))
            .collect();
        json!({"apiVersion": "v1", "kind": "List", "items": [
            {"apiVersion": "v1", "kind": "Service",
             "metadata": {"name": "target", "namespace": "bench"},
             "spec": {"type": "ClusterIP", "clusterIP": TARGET_VIP.to_string(),
                      "clusterIPs": [TARGET_VIP.to_string()],
                      "ports": [{"name": "tcp", "port": TARGET_PORT, "protocol": "TCP", "targetPort": BACKEND_PORT},
                                {"name": "udp", "port": TARGET_PORT, "protocol": "UDP", "targetPort": BACKEND_PORT}]}},
            target_slice(eps)
        ]})
    }

    /// The target as a NodePort Service (`externalTrafficPolicy: Cluster`,
    /// node port `node_port` on both ports) and its slice, every endpoint
    /// on node `node_name`.
    pub fn target_nodeport_manifests(
        target: &[Ipv4Addr],
        node_port: u16,
        node_name: &str,
    ) -> Value {
        let eps: Vec<Value> = target
            .iter()
            .map(|a| json!({"addresses": [a.to_string()], "nodeName": node_name, "conditions": {"ready": true}}))
            .collect();
        json!({"apiVersion": "v1", "kind": "List", "items": [
            {"apiVersion": "v1", "kind": "Service",
             "metadata": {"name": "target", "namespace": "bench"},
             "spec": {"type": "NodePort", "externalTrafficPolicy": "Cluster",
                      "clusterIP": TARGET_VIP.to_string(), "clusterIPs": [TARGET_VIP.to_string()],
                      "ports": [{"name": "tcp", "port": TARGET_PORT, "protocol": "TCP", "targetPort": BACKEND_PORT, "nodePort": node_port},
                                {"name": "udp", "port": TARGET_PORT, "protocol": "UDP", "targetPort": BACKEND_PORT, "nodePort": node_port}]}},
            target_slice(eps)
        ]})
    }

    /// `iptables-restore` input in the shape kube-proxy's iptables mode
    /// writes (pkg/proxy/iptables/proxier.go): filter and nat tables,
    /// `KUBE-SERVICES` → `KUBE-SVC-*` (masquerade mark for off-cluster
    /// sources, `statistic --mode random --probability 1/n` per endpoint) →
    /// `KUBE-SEP-*` (hairpin mark, DNAT), `KUBE-POSTROUTING` masquerading
    /// marked packets, and the nodeports rule last in `KUBE-SERVICES`.
    pub fn iptables(&self) -> String {
        self.iptables_with(None)
    }

    /// The same in the NodePort experiment's shape, for the node namespace:
    /// the target's ports also have node port `node_port`. Adds what
    /// kube-proxy adds for traffic arriving at a node: `PREROUTING` →
    /// `KUBE-SERVICES`, whose last rule (`-m addrtype --dst-type LOCAL`)
    /// jumps to `KUBE-NODEPORTS` → `KUBE-EXT-*` (masquerade mark, then the
    /// Service's `KUBE-SVC-*`), and the filter table's `INPUT`/`FORWARD`
    /// jumps with `KUBE-FORWARD` (drop invalid, accept marked and
    /// established).
    pub fn iptables_nodeport(&self, node_port: u16) -> String {
        self.iptables_with(Some(node_port))
    }

    fn iptables_with(&self, node_port: Option<u16>) -> String {
        let mut chains = String::new();
        let mut services = String::new();
        let mut rules = String::new();
        let mut nodeports = String::new();
        for p in self.ports(node_port) {
            let key = format!("{}{}", p.name, p.proto);
            let svc = format!("KUBE-SVC-{}", hash16(&key));
            let _ = writeln!(chains, ":{svc} - [0:0]");
            if let Some(np) = p.node_port {
                let ext = format!("KUBE-EXT-{}", hash16(&key));
                let _ = writeln!(chains, ":{ext} - [0:0]");
                let _ = writeln!(
                    nodeports,
                    "-A KUBE-NODEPORTS -p {} -m comment --comment \"{}\" -m {} --dport {np} -j {ext}",
                    p.proto, p.name, p.proto
                );
                let _ = writeln!(
                    rules,
                    "-A {ext} -m comment --comment \"masquerade traffic for {} external destinations\" -j KUBE-MARK-MASQ",
                    p.name
                );
                let _ = writeln!(rules, "-A {ext} -j {svc}");
            }
            let _ = writeln!(
                services,
                "-A KUBE-SERVICES -d {}/32 -p {} -m comment --comment \"{} cluster IP\" -m {} --dport {} -j {svc}",
                p.vip, p.proto, p.name, p.proto, p.port
            );
            let _ = writeln!(
                rules,
                "-A {svc} ! -s {CLUSTER_CIDR} -d {}/32 -p {} -m comment --comment \"{} cluster IP\" -m {} --dport {} -j KUBE-MARK-MASQ",
                p.vip, p.proto, p.name, p.proto, p.port
            );
            let n = p.endpoints.len();
            let mut seps = String::new();
            for (j, (addr, port)) in p.endpoints.iter().enumerate() {
                let sep = format!("KUBE-SEP-{}", hash16(&format!("{key}{addr}:{port}")));
                let _ = writeln!(chains, ":{sep} - [0:0]");
                if j + 1 < n {
                    let prob = 1.0 / (n - j) as f64;
                    let _ = writeln!(
                        rules,
                        "-A {svc} -m comment --comment \"{} -> {addr}:{port}\" -m statistic --mode random --probability {prob:.10} -j {sep}",
                        p.name
                    );
                } else {
                    let _ = writeln!(
                        rules,
                        "-A {svc} -m comment --comment \"{} -> {addr}:{port}\" -j {sep}",
                        p.name
                    );
                }
                let _ = writeln!(
                    seps,
                    "-A {sep} -s {addr}/32 -m comment --comment \"{}\" -j KUBE-MARK-MASQ",
                    p.name
                );
                let _ = writeln!(
                    seps,
                    "-A {sep} -p {} -m comment --comment \"{}\" -m {} -j DNAT --to-destination {addr}:{port}",
                    p.proto, p.name, p.proto
                );
            }
            rules.push_str(&seps);
        }
        let mut out = String::with_capacity(chains.len() + services.len() + rules.len() + 4096);
        out.push_str(
            "*filter\n\
             :KUBE-SERVICES - [0:0]\n\
             :KUBE-EXTERNAL-SERVICES - [0:0]\n\
             :KUBE-FIREWALL - [0:0]\n\
             :KUBE-PROXY-FIREWALL - [0:0]\n",
        );
        if node_port.is_some() {
            out.push_str(
                ":KUBE-NODEPORTS - [0:0]\n\
                 :KUBE-FORWARD - [0:0]\n\
                 -A INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL\n\
                 -A INPUT -m comment --comment \"kubernetes health check service ports\" -j KUBE-NODEPORTS\n\
                 -A INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES\n\
                 -A INPUT -j KUBE-FIREWALL\n\
                 -A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL\n\
                 -A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD\n\
                 -A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
                 -A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES\n\
                 -A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\n\
                 -A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" -m mark --mark 0x4000/0x4000 -j ACCEPT\n\
                 -A KUBE-FORWARD -m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT\n",
            );
        }
        out.push_str(
            "-A OUTPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL\n\
             -A OUTPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
             -A OUTPUT -j KUBE-FIREWALL\n\
             -A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment \"block incoming localnet connections\" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP\n\
             COMMIT\n\
             *nat\n\
             :KUBE-SERVICES - [0:0]\n\
             :KUBE-NODEPORTS - [0:0]\n\
             :KUBE-POSTROUTING - [0:0]\n\
             :KUBE-MARK-MASQ - [0:0]\n",
        );
        out.push_str(&chains);
        if node_port.is_some() {
            out.push_str(
                "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n",
            );
        }
        out.push_str(
            "-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
             -A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING\n\
             -A KUBE-MARK-MASQ -j MARK --or-mark 0x4000\n\
             -A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN\n\
             -A KUBE-POSTROUTING -j MARK --xor-mark 0x4000\n\
             -A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully\n",
        );
        out.push_str(&services);
        out.push_str(
            "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS\n",
        );
        out.push_str(&nodeports);
        out.push_str(&rules);
        out.push_str("COMMIT\n");
        out
    }

    /// `nft -f` input in the shape of kube-proxy's nftables mode
    /// (pkg/proxy/nftables/proxier.go): one `ip kube-proxy` table, the
    /// `service-ips` verdict map from `daddr . l4proto . dport` to a
    /// per-Service chain, `numgen random mod N vmap` over per-endpoint
    /// chains that DNAT, masquerade marks, and the filter-side lookups of
    /// `no-endpoint-services` and `firewall-ips`.
    pub fn nft(&self) -> String {
        self.nft_with(None)
    }

    /// The same in the NodePort experiment's shape, for the node namespace:
    /// the target's ports also have node port `node_port`. As kube-proxy
    /// with the default `--nodeport-addresses`: `nat-prerouting` → `services`,
    /// whose second rule sends `fib daddr type local` traffic through the
    /// `service-nodeports` verdict map to an `external-*` chain (masquerade
    /// mark, then the Service's chain); `filter-prerouting-pre-dnat`,
    /// `filter-input` and `filter-forward` run the firewall and
    /// no-endpoint checks on new connections.
    pub fn nft_nodeport(&self, node_port: u16) -> String {
        self.nft_with(Some(node_port))
    }

    fn nft_with(&self, node_port: Option<u16>) -> String {
        let nodeport_rule = if node_port.is_some() {
            "\t\tfib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @service-nodeports\n"
        } else {
            "\t\tip daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports\n"
        };
        let mut out = String::new();
        out.push_str(
            "table ip kube-proxy {\n\
             \tcomment \"rules for kube-proxy\"\n\
             \tmap no-endpoint-services { type ipv4_addr . inet_proto . inet_service : verdict ; }\n\
             \tmap firewall-ips { type ipv4_addr . inet_proto . inet_service : verdict ; }\n\
             \tmap service-ips { type ipv4_addr . inet_proto . inet_service : verdict ; comment \"ClusterIP, ExternalIP and LoadBalancer IP traffic\" ; }\n\
             \tset nodeport-ips { type ipv4_addr ; }\n\
             \tmap service-nodeports { type inet_proto . inet_service : verdict ; }\n\
             \tchain mark-for-masquerade {\n\t\tmark set mark or 0x4000\n\t}\n\
             \tchain masquerading {\n\t\tmark and 0x4000 == 0 return\n\t\tmark set mark xor 0x4000\n\t\tmasquerade fully-random\n\t}\n\
             \tchain services {\n\
             \t\tip daddr . meta l4proto . th dport vmap @service-ips\n",
        );
        out.push_str(nodeport_rule);
        out.push_str(
            "\t}\n\
             \tchain service-endpoints-check {\n\t\tip daddr . meta l4proto . th dport vmap @no-endpoint-services\n\t}\n\
             \tchain firewall-check {\n\t\tip daddr . meta l4proto . th dport vmap @firewall-ips\n\t}\n\
             \tchain filter-output {\n\t\ttype filter hook output priority -110 ; policy accept ;\n\
             \t\tct state new jump service-endpoints-check\n\t\tct state new jump firewall-check\n\t}\n\
             \tchain nat-output {\n\t\ttype nat hook output priority -100 ; policy accept ;\n\t\tjump services\n\t}\n\
             \tchain nat-postrouting {\n\t\ttype nat hook postrouting priority 100 ; policy accept ;\n\t\tjump masquerading\n\t}\n",
        );
        if node_port.is_some() {
            out.push_str(
                "\tmap no-endpoint-nodeports { type inet_proto . inet_service : verdict ; }\n\
                 \tchain nodeport-endpoints-check {\n\t\tfib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @no-endpoint-nodeports\n\t}\n\
                 \tchain nat-prerouting {\n\t\ttype nat hook prerouting priority -100 ; policy accept ;\n\t\tjump services\n\t}\n\
                 \tchain filter-prerouting-pre-dnat {\n\t\ttype filter hook prerouting priority -110 ; policy accept ;\n\t\tct state new jump firewall-check\n\t}\n\
                 \tchain filter-input {\n\t\ttype filter hook input priority 0 ; policy accept ;\n\
                 \t\tct state new jump nodeport-endpoints-check\n\t\tct state new jump service-endpoints-check\n\t}\n\
                 \tchain filter-forward {\n\t\ttype filter hook forward priority 0 ; policy accept ;\n\t\tct state new jump service-endpoints-check\n\t}\n",
            );
        }
        let mut elements = Vec::new();
        let mut nodeport_elements = Vec::new();
        for p in self.ports(node_port) {
            let id = p.name.replace(':', "/");
            let svc = format!(
                "service-{}-{id}/{}/p{}",
                &hash16(&p.name)[..8],
                p.proto,
                p.port
            );
            let mut eps = Vec::new();
            for (addr, port) in &p.endpoints {
                let ep = format!(
                    "endpoint-{}-{id}/{}/p{}__{addr}/{port}",
                    &hash16(&format!("{}{addr}", p.name))[..8],
                    p.proto,
                    p.port
                );
                let _ = writeln!(
                    out,
                    "\tchain {ep} {{\n\t\tip saddr {addr} jump mark-for-masquerade\n\t\tmeta l4proto {} dnat to {addr}:{port}\n\t}}",
                    p.proto
                );
                eps.push(ep);
            }
            let vmap: Vec<String> = eps
                .iter()
                .enumerate()
                .map(|(i, ep)| format!("{i} : goto {ep}"))
                .collect();
            let _ = writeln!(
                out,
                "\tchain {svc} {{\n\t\tip daddr {} {} dport {} ip saddr != {CLUSTER_CIDR} jump mark-for-masquerade\n\t\tnumgen random mod {} vmap {{ {} }}\n\t}}",
                p.vip,
                p.proto,
                p.port,
                eps.len(),
                vmap.join(", ")
            );
            elements.push(format!("{} . {} . {} : goto {svc}", p.vip, p.proto, p.port));
            if let Some(np) = p.node_port {
                let ext = format!(
                    "external-{}-{id}/{}/p{}",
                    &hash16(&p.name)[..8],
                    p.proto,
                    p.port
                );
                let _ = writeln!(
                    out,
                    "\tchain {ext} {{\n\t\tjump mark-for-masquerade\n\t\tgoto {svc}\n\t}}"
                );
                nodeport_elements.push(format!("{} . {np} : goto {ext}", p.proto));
            }
        }
        out.push_str("}\n");
        // Elements in chunks, as kube-proxy's transactions add them.
        for chunk in elements.chunks(1000) {
            let _ = writeln!(
                out,
                "add element ip kube-proxy service-ips {{ {} }}",
                chunk.join(", ")
            );
        }
        if !nodeport_elements.is_empty() {
            let _ = writeln!(
                out,
                "add element ip kube-proxy service-nodeports {{ {} }}",
                nodeport_elements.join(", ")
            );
        }
        out
    }

    /// Writes (once) `<cache>/<tag>.<ext>` with `make`'s output.
    pub fn cached(
        &self,
        cache: &Path,
        ext: &str,
        make: impl FnOnce(&Self) -> Result<String>,
    ) -> Result<PathBuf> {
        let path = cache.join(format!("{}.{ext}", self.tag()));
        if path.is_file() {
            return Ok(path);
        }
        std::fs::create_dir_all(cache).with_context(|| format!("creating {}", cache.display()))?;
        let text = make(self)?;
        let tmp = path.with_extension(format!("{ext}.tmp"));
        std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &path)?;
        Ok(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_is_last_and_probabilities_add_up() {
        let s = Scenario::new(3, 3, target_endpoints(2));
        let ipt = s.iptables();
        let svc_rules: Vec<&str> = ipt
            .lines()
            .filter(|l| l.starts_with("-A KUBE-SERVICES -d"))
            .collect();
        assert_eq!(svc_rules.len(), 4);
        assert!(svc_rules[3].contains("10.96.0.10/32 -p udp"));
        assert!(ipt.contains("--probability 0.3333333333"));
        let nft = s.nft();
        assert!(nft.contains("numgen random mod 3 vmap"));
        assert!(nft.contains("10.96.0.10 . udp . 80 : goto"));
        assert!(!ipt.contains("KUBE-EXT-") && !nft.contains("external-"));
    }

    #[test]
    fn nodeport_shapes() {
        let s = Scenario::new(3, 2, target_endpoints(2));
        let ipt = s.iptables_nodeport(30080);
        assert!(ipt.contains(
            "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES"
        ));
        let np: Vec<&str> = ipt
            .lines()
            .filter(|l| l.starts_with("-A KUBE-NODEPORTS"))
            .collect();
        assert_eq!(np.len(), 2);
        assert!(np[0].contains("-p tcp") && np[0].contains("--dport 30080 -j KUBE-EXT-"));
        let ext = np[0].rsplit(' ').next().unwrap();
        assert!(ipt.contains(&format!(":{ext} - [0:0]")));
        assert!(ipt.contains(&format!("-A {ext} -m comment")));
        // The nodeports jump is still the last rule of KUBE-SERVICES.
        let last = ipt
            .lines()
            .rfind(|l| l.starts_with("-A KUBE-SERVICES"))
            .unwrap();
        assert!(last.contains("--dst-type LOCAL -j KUBE-NODEPORTS"));
        let nft = s.nft_nodeport(30080);
        assert!(nft.contains("fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @service-nodeports"));
        assert!(nft.contains(
            "add element ip kube-proxy service-nodeports { tcp . 30080 : goto external-"
        ));
        assert!(nft.contains("type nat hook prerouting"));
    }
}
