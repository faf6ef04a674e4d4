//! The object store that both modes feed: the manifests directory
//! (`manifest::load_dir`) in standalone mode and a kube-rs reflector in
//! cluster mode. `translate` reads it and nothing else, which keeps the
//! Kubernetes semantics testable without a cluster.
use std::{
    borrow::Cow,
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
    sync::Arc,
};

use k8s_openapi::{
    api::{
        core::v1::{Endpoints, Node, Service, ServicePort, ServiceSpec, ServiceStatus},
        discovery::v1::{Endpoint, EndpointPort, EndpointSlice},
    },
    apimachinery::pkg::{apis::meta::v1::Time, util::intstr::IntOrString},
};

/// `discovery.k8s.io/v1` label joining an EndpointSlice to its Service.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";

/// Services (and their EndpointSlices) carrying this label belong to
/// another proxy.
pub const LABEL_SERVICE_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
/// The label the EndpointSlice controller puts on the slices of headless
/// Services; no proxy serves what carries it.
pub const LABEL_HEADLESS: &str = "service.kubernetes.io/headless";

/// The annotation choosing a Service's selection algorithm (`maglev` or
/// `random`; the agent's `--lb-algorithm` when absent).
pub const ANNOTATION_ALGORITHM: &str = "lb-agent.dev/lb-algorithm";

/// The annotation lowering a Service's outlier detection (`off`,
/// `dry-run` or `on`; the agent's `--outlier-detection` when absent, and
/// never more than it).
pub const ANNOTATION_OUTLIER_DETECTION: &str = "lb-agent.dev/outlier-detection";

/// The well-known label carrying a Node's zone (`v1.LabelTopologyZone`).
pub const LABEL_TOPOLOGY_ZONE: &str = "topology.kubernetes.io/zone";

/// `namespace/name` of a namespaced object.
///
/// Ordered by namespace, then name, so that iteration over the store (and
/// therefore every tie-break in `translate`) is deterministic.
///
/// Shared strings: the translation keeps a Service's key in several
/// indexes (its results, the owner of each frontend, its slices), and a
/// clone is then a count, not two allocations.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey {
    pub namespace: Arc<str>,
    pub name: Arc<str>,
}

impl ObjectKey {
    pub fn new(namespace: impl Into<Arc<str>>, name: impl Into<Arc<str>>) -> Self {
        ObjectKey {
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Every object the translation looks at, keyed for deterministic iteration.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Store {
    /// Boxed: a stored Service is 264 bytes inline, and a map node holds room
    /// for eleven entries, a third of it unused on average.
    pub services: BTreeMap<ObjectKey, Box<StoredService>>,
    /// Kept as [`Slice`], not `EndpointSlice`: slices are most of a large
    /// store, and the API type's endpoints are ~350 bytes each even when
    /// nearly every field is unset.
    pub slices: BTreeMap<ObjectKey, Slice>,
    pub endpoints: BTreeMap<ObjectKey, Endpoints>,
    /// Nodes are cluster-scoped: keyed by name only.
    pub nodes: BTreeMap<String, Node>,
    /// The `ServiceCIDR`s' `spec.cidrs` by name (cluster-scoped), as
    /// given: `semantics::service_cidr` validates them.
    pub service_cidrs: BTreeMap<String, Vec<String>>,
}

/// What translation reads of a Service. The API type (~530 bytes inline,
/// and a string of its own for every field, `"TCP"` and `"Cluster"`
/// included) gives way to the fields read, under the API's names: its
/// metadata to the three things read of it, spec and status to the fields
/// translation validates and names in its messages.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StoredService {
    pub metadata: ServiceMeta,
    pub spec: Option<StoredSpec>,
    pub status: StoredStatus,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct ServiceMeta {
    /// Whether it carries [`LABEL_SERVICE_PROXY_NAME`] or
    /// [`LABEL_HEADLESS`]: no Service of ours.
    pub proxy_labels: bool,
    /// Its [`ANNOTATION_ALGORITHM`] annotation.
    pub algorithm: Option<Box<str>>,
    /// Its [`ANNOTATION_OUTLIER_DETECTION`] annotation.
    pub outlier_detection: Option<Box<str>>,
    /// The older of two Services claiming one frontend wins it.
    pub creation_timestamp: Option<Time>,
}

/// The text of an enumerated field (`type`, `protocol`, the policies):
/// one of the values the API defines is shared, not a string per object;
/// any other is kept for translation to name.
pub type Word = Cow<'static, str>;

/// The values [`Word`] shares.
const WORDS: &[&str] = &[
    "ClusterIP",
    "NodePort",
    "LoadBalancer",
    "ExternalName",
    "TCP",
    "UDP",
    "SCTP",
    "Cluster",
    "Local",
    "None",
    "ClientIP",
    "VIP",
    "Proxy",
];

fn word(text: String) -> Word {
    match WORDS.iter().find(|w| **w == text) {
        Some(w) => Cow::Borrowed(w),
        None => Cow::Owned(text),
    }
}

fn boxed_strs(list: Option<Vec<String>>) -> Option<Box<[Box<str>]>> {
    list.map(|l| l.into_iter().map(String::into_boxed_str).collect())
}

/// What translation reads of `ServiceSpec`; what no proxy reads (selectors
/// are the EndpointSlice controller's, families and names the API
/// server's) is dropped on arrival.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StoredSpec {
    pub type_: Option<Word>,
    pub cluster_ip: Option<IpField>,
    pub cluster_ips: Option<Box<[IpField]>>,
    pub external_ips: Option<Box<[Box<str>]>>,
    pub ports: Option<Box<[StoredPort]>>,
    pub internal_traffic_policy: Option<Word>,
    pub external_traffic_policy: Option<Word>,
    pub health_check_node_port: Option<i32>,
    pub session_affinity: Option<Word>,
    /// `sessionAffinityConfig.clientIP.timeoutSeconds`.
    pub session_affinity_timeout: Option<i32>,
    pub load_balancer_source_ranges: Option<Box<[Box<str>]>>,
}

/// What translation reads of a `ServicePort`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StoredPort {
    pub name: Option<Box<str>>,
    pub protocol: Option<Word>,
    pub port: i32,
    /// `targetPort` when a number, the only form a Service can get wrong
    /// (a name is looked up in the endpoints' ports, which are what is
    /// used either way).
    pub target_port: Option<i32>,
    pub node_port: Option<i32>,
}

/// What translation reads of `ServiceStatus`: `loadBalancer.ingress`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StoredStatus {
    pub load_balancer_ingress: Box<[StoredIngress]>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct StoredIngress {
    pub ip: Option<Box<str>>,
    pub ip_mode: Option<Word>,
}

impl From<Service> for StoredService {
    fn from(svc: Service) -> Self {
        let meta = svc.metadata;
        let proxy_labels = meta.labels.is_some_and(|labels| {
            labels.contains_key(LABEL_SERVICE_PROXY_NAME) || labels.contains_key(LABEL_HEADLESS)
        });
        let mut annotations = meta.annotations.unwrap_or_default();
        let mut annotation = |name: &str| annotations.remove(name).map(String::into_boxed_str);
        let algorithm = annotation(ANNOTATION_ALGORITHM);
        let outlier_detection = annotation(ANNOTATION_OUTLIER_DETECTION);
        StoredService {
            metadata: ServiceMeta {
                proxy_labels,
                algorithm,
                outlier_detection,
                creation_timestamp: meta.creation_timestamp,
            },
            spec: svc.spec.map(StoredSpec::from),
            status: svc.status.map(StoredStatus::from).unwrap_or_default(),
        }
    }
}

impl From<ServiceSpec> for StoredSpec {
    fn from(spec: ServiceSpec) -> Self {
        StoredSpec {
            type_: spec.type_.map(word),
            cluster_ip: spec.cluster_ip.map(IpField::from),
            cluster_ips: spec
                .cluster_ips
                .map(|ips| ips.into_iter().map(IpField::from).collect()),
            external_ips: boxed_strs(spec.external_ips),
            ports: spec
                .ports
                .map(|ports| ports.into_iter().map(StoredPort::from).collect()),
            internal_traffic_policy: spec.internal_traffic_policy.map(word),
            external_traffic_policy: spec.external_traffic_policy.map(word),
            health_check_node_port: spec.health_check_node_port,
            session_affinity: spec.session_affinity.map(word),
            session_affinity_timeout: spec
                .session_affinity_config
                .and_then(|c| c.client_ip)
                .and_then(|c| c.timeout_seconds),
            load_balancer_source_ranges: boxed_strs(spec.load_balancer_source_ranges),
        }
    }
}

impl From<ServicePort> for StoredPort {
    fn from(port: ServicePort) -> Self {
        StoredPort {
            name: port.name.map(String::into_boxed_str),
            protocol: port.protocol.map(word),
            port: port.port,
            target_port: match port.target_port {
                Some(IntOrString::Int(n)) => Some(n),
                Some(IntOrString::String(_)) | None => None,
            },
            node_port: port.node_port,
        }
    }
}

impl From<ServiceStatus> for StoredStatus {
    fn from(status: ServiceStatus) -> Self {
        let ingress = status
            .load_balancer
            .and_then(|lb| lb.ingress)
            .unwrap_or_default();
        StoredStatus {
            load_balancer_ingress: ingress
                .into_iter()
                .map(|ing| StoredIngress {
                    ip: ing.ip.map(String::into_boxed_str),
                    ip_mode: ing.ip_mode.map(word),
                })
                .collect(),
        }
    }
}

/// What translation reads of an EndpointSlice, and nothing else. Raw
/// strings stay unparsed so that `translate` still owns every validation and
/// its messages.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Slice {
    /// The `kubernetes.io/service-name` label.
    pub service: Option<Box<str>>,
    pub address_type: Box<str>,
    pub ports: Box<[SlicePort]>,
    pub endpoints: Box<[SliceEndpoint]>,
    /// Whether the slice carries [`LABEL_SERVICE_PROXY_NAME`] or
    /// [`LABEL_HEADLESS`]; `translate` leaves such slices alone.
    pub proxy_labels: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlicePort {
    pub name: Option<Box<str>>,
    pub protocol: Option<Box<str>>,
    pub port: Option<i32>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SliceEndpoint {
    /// The first address: like kube-proxy, the only one used (the API
    /// allows exactly one).
    pub address: Option<IpField>,
    pub node_name: Option<Box<str>>,
    pub ready: Option<bool>,
    pub serving: Option<bool>,
    pub terminating: Option<bool>,
    /// Boxed: hints are rare and would otherwise cost every endpoint two
    /// list headers.
    pub hints: Option<Box<SliceHints>>,
}

/// An address field (an endpoint's, a cluster IP) as its object gives it:
/// parsed when the text is an IP address written as `IpAddr` writes it back
/// (nearly always), which saves a string per endpoint (a tenth of a large
/// store's allocations); else the text (`None`, empty, malformed), for
/// translation to read or report.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum IpField {
    Ip(IpAddr),
    Text(Box<str>),
}

impl IpField {
    /// The address, or the text that is none.
    pub fn ip(&self) -> Result<IpAddr, &str> {
        match self {
            IpField::Ip(ip) => Ok(*ip),
            IpField::Text(text) => text.parse().map_err(|_| &**text),
        }
    }

    /// The text, when it was kept as such.
    pub fn text(&self) -> Option<&str> {
        match self {
            IpField::Ip(_) => None,
            IpField::Text(text) => Some(text),
        }
    }
}

impl From<String> for IpField {
    fn from(text: String) -> Self {
        match text.parse::<IpAddr>() {
            // The IPv4 parser takes only the dotted decimal form `IpAddr`
            // writes (no leading zeros): nothing to compare.
            Ok(ip @ IpAddr::V4(_)) => IpField::Ip(ip),
            Ok(ip) if writes_as(ip, &text) => IpField::Ip(ip),
            _ => IpField::Text(text.into_boxed_str()),
        }
    }
}

impl From<&str> for IpField {
    fn from(text: &str) -> Self {
        text.to_owned().into()
    }
}

impl fmt::Display for IpField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IpField::Ip(ip) => ip.fmt(f),
            IpField::Text(text) => f.write_str(text),
        }
    }
}

/// Whether `ip` is written back as `text`, so that keeping the address
/// loses nothing of what the object said.
fn writes_as(ip: IpAddr, text: &str) -> bool {
    use std::io::Write as _;
    // The longest form: an IPv4-mapped IPv6 address, 45 bytes.
    let mut buf = [0u8; 48];
    let mut cursor = std::io::Cursor::new(&mut buf[..]);
    if write!(cursor, "{ip}").is_err() {
        return false;
    }
    let len = cursor.position() as usize;
    &buf[..len] == text.as_bytes()
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SliceHints {
    pub zones: Box<[Box<str>]>,
    pub nodes: Box<[Box<str>]>,
}

impl From<EndpointSlice> for Slice {
    fn from(slice: EndpointSlice) -> Self {
        Slice::new(
            slice.metadata.labels,
            slice.address_type,
            slice.ports.unwrap_or_default(),
            slice
                .endpoints
                .unwrap_or_default()
                .into_iter()
                .map(SliceEndpoint::from),
        )
    }
}

impl Slice {
    /// From the parts of an EndpointSlice, which `manifest` may decode
    /// without ever building one.
    pub fn new(
        labels: Option<BTreeMap<String, String>>,
        address_type: String,
        ports: Vec<EndpointPort>,
        endpoints: impl IntoIterator<Item = SliceEndpoint>,
    ) -> Self {
        let mut labels = labels.unwrap_or_default();
        let proxy_labels =
            labels.contains_key(LABEL_SERVICE_PROXY_NAME) || labels.contains_key(LABEL_HEADLESS);
        let service = labels
            .remove(LABEL_SERVICE_NAME)
            .map(String::into_boxed_str);
        Slice {
            service,
            proxy_labels,
            address_type: address_type.into_boxed_str(),
            ports: ports.into_iter().map(SlicePort::from).collect(),
            endpoints: endpoints.into_iter().collect(),
        }
    }
}

impl From<EndpointPort> for SlicePort {
    fn from(p: EndpointPort) -> Self {
        SlicePort {
            name: p.name.map(String::into_boxed_str),
            protocol: p.protocol.map(String::into_boxed_str),
            port: p.port,
        }
    }
}

/// Only the fields translation reads need be set.
impl From<Endpoint> for SliceEndpoint {
    fn from(ep: Endpoint) -> Self {
        let boxed = String::into_boxed_str;
        let conditions = ep.conditions.unwrap_or_default();
        let hints = ep.hints.map(|h| {
            Box::new(SliceHints {
                zones: h
                    .for_zones
                    .unwrap_or_default()
                    .into_iter()
                    .map(|z| boxed(z.name))
                    .collect(),
                nodes: h
                    .for_nodes
                    .unwrap_or_default()
                    .into_iter()
                    .map(|n| boxed(n.name))
                    .collect(),
            })
        });
        SliceEndpoint {
            address: ep.addresses.into_iter().next().map(IpField::from),
            node_name: ep.node_name.map(boxed),
            ready: conditions.ready,
            serving: conditions.serving,
            terminating: conditions.terminating,
            hints,
        }
    }
}

/// Which stored objects a manifests refresh added, replaced or removed. Translation
/// uses it to redo only the Services these touch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    pub services: BTreeSet<ObjectKey>,
    pub slices: BTreeSet<ObjectKey>,
    pub endpoints: BTreeSet<ObjectKey>,
    pub nodes: BTreeSet<String>,
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        self.services.is_empty()
            && self.slices.is_empty()
            && self.endpoints.is_empty()
            && self.nodes.is_empty()
    }
}

/// What the translation needs to know about the node it runs on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeInfo {
    pub name: String,
    /// `topology.kubernetes.io/zone` of the Node, when known.
    pub zone: Option<String>,
}

impl Store {
    /// The identity of node `node_name`; the zone is only known when the
    /// store holds that Node (standalone mode may not have any Node at all).
    pub fn node_info(&self, node_name: &str) -> NodeInfo {
        let zone = self
            .nodes
            .get(node_name)
            .and_then(|node| node.metadata.labels.as_ref())
            .and_then(|labels| labels.get(LABEL_TOPOLOGY_ZONE))
            .filter(|zone| !zone.is_empty())
            .cloned();
        NodeInfo {
            name: node_name.to_owned(),
            zone,
        }
    }
}

/// One problem with the input: the object (or file) it concerns is skipped,
/// everything else still applies. Shared by `manifest` and `translate`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Rejection {
    /// A file path, "api" (cluster mode) or "translate".
    pub source: String,
    /// e.g. "Service default/web", or "document 2" when the object is unknown.
    pub object: String,
    /// A field path within the object, e.g. "spec.ports[1].port"; "" if n/a.
    pub field: String,
    pub reason: String,
}

impl Rejection {
    pub fn new(
        source: impl Into<String>,
        object: impl Into<String>,
        field: impl Into<String>,
        reason: impl Into<String>,
    ) -> Self {
        Rejection {
            source: source.into(),
            object: object.into(),
            field: field.into(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for Rejection {
    /// `source: object: field: reason`, leaving out the empty parts.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for part in [&self.source, &self.object, &self.field] {
            if !part.is_empty() {
                write!(f, "{part}: ")?;
            }
        }
        f.write_str(&self.reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    /// Every field translation reads survives the conversion, enumerated
    /// values of the API shared rather than allocated, any other kept.
    #[test]
    fn stored_services_keep_what_translation_reads() {
        let svc: Service = serde_json::from_str(
            r#"{"metadata": {"name": "web", "labels": {"service.kubernetes.io/headless": ""},
                "annotations": {"lb-agent.dev/lb-algorithm": "maglev", "lb-agent.dev/outlier-detection": "dry-run"}, "creationTimestamp": "2024-01-01T00:00:00Z"},
                "spec": {"type": "LoadBalancer", "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10", "fd00:96::A"],
                         "externalIPs": ["192.0.2.7"], "selector": {"app": "web"},
                         "ports": [{"name": "http", "port": 80, "targetPort": 8080, "nodePort": 30080},
                                   {"port": 53, "protocol": "UDP", "targetPort": "dns"},
                                   {"port": 9, "protocol": "QUIC"}],
                         "internalTrafficPolicy": "Local", "externalTrafficPolicy": "Sideways", "healthCheckNodePort": 32000,
                         "sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 60}},
                         "loadBalancerSourceRanges": ["192.0.2.0/24"]},
                "status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.1", "ipMode": "Proxy"}, {"hostname": "lb"}]}}}"#,
        )
        .unwrap();
        let stored = StoredService::from(svc);
        let shared = |w: &Option<Word>, text: &str| {
            assert_eq!(w.as_deref(), Some(text));
            assert!(matches!(w, Some(Cow::Borrowed(_))), "{text} allocated");
        };
        let meta = &stored.metadata;
        assert!(meta.proxy_labels);
        assert_eq!(meta.algorithm.as_deref(), Some("maglev"));
        assert_eq!(meta.outlier_detection.as_deref(), Some("dry-run"));
        assert!(meta.creation_timestamp.is_some());
        let spec = stored.spec.as_ref().unwrap();
        shared(&spec.type_, "LoadBalancer");
        assert_eq!(spec.cluster_ip, Some(IpField::from("10.96.0.10")));
        assert_eq!(
            spec.cluster_ips.as_deref(),
            Some(
                &[
                    IpField::from("10.96.0.10"),
                    IpField::Text("fd00:96::A".into())
                ][..]
            )
        );
        assert_eq!(
            spec.external_ips.as_deref(),
            Some(&["192.0.2.7".into()][..])
        );
        let ports = spec.ports.as_deref().unwrap();
        assert_eq!(
            (ports[0].name.as_deref(), ports[0].protocol.as_deref()),
            (Some("http"), None)
        );
        assert_eq!(
            (ports[0].port, ports[0].target_port, ports[0].node_port),
            (80, Some(8080), Some(30080))
        );
        shared(&ports[1].protocol, "UDP");
        assert_eq!((ports[1].port, ports[1].target_port), (53, None));
        assert_eq!(ports[2].protocol.as_deref(), Some("QUIC"));
        shared(&spec.internal_traffic_policy, "Local");
        assert_eq!(spec.external_traffic_policy.as_deref(), Some("Sideways"));
        assert_eq!(spec.health_check_node_port, Some(32000));
        shared(&spec.session_affinity, "ClientIP");
        assert_eq!(spec.session_affinity_timeout, Some(60));
        assert_eq!(
            spec.load_balancer_source_ranges.as_deref(),
            Some(&["192.0.2.0/24".into()][..])
        );
        let ingress = &stored.status.load_balancer_ingress;
        assert_eq!(ingress.len(), 2);
        assert_eq!(ingress[0].ip.as_deref(), Some("192.0.2.1"));
        shared(&ingress[0].ip_mode, "Proxy");
        assert_eq!(
            (ingress[1].ip.as_deref(), ingress[1].ip_mode.as_deref()),
            (None, None)
        );
    }

    #[test]
    fn endpoint_addresses_keep_what_the_object_said() {
        let cases: &[(&str, Option<&str>)] = &[
            ("10.244.1.7", Some("10.244.1.7")),
            ("0.0.0.0", Some("0.0.0.0")),
            ("255.255.255.255", Some("255.255.255.255")),
            ("fd00::1", Some("fd00::1")),
            ("::ffff:10.1.2.3", Some("::ffff:10.1.2.3")),
            // Addresses written otherwise than `IpAddr` writes them stay
            // text, and still parse.
            ("FD00::1", Some("fd00::1")),
            ("fd00:0::1", Some("fd00::1")),
            ("10.244.1.07", None),
            ("010.244.1.7", None),
            ("10.244.1", None),
            (" 10.244.1.7", None),
            ("", None),
            ("not-an-ip", None),
        ];
        for (text, ip) in cases {
            let addr = IpField::from(*text);
            assert_eq!(addr.to_string(), *text, "{text:?} written back");
            let parsed = ip.map(|ip| ip.parse::<IpAddr>().unwrap());
            assert_eq!(addr.ip().ok(), parsed, "{text:?}");
            let kept_parsed = matches!(addr, IpField::Ip(_));
            assert_eq!(kept_parsed, Some(*text) == *ip, "{text:?}: {addr:?}");
            if let Err(raw) = addr.ip() {
                assert_eq!(raw, *text);
            }
        }
    }

    fn node(name: &str, zone: Option<&str>) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: zone.map(|z| [(LABEL_TOPOLOGY_ZONE.to_owned(), z.to_owned())].into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn node_info() {
        let mut store = Store::default();
        store.nodes.insert("a".into(), node("a", Some("zone-a")));
        store.nodes.insert("b".into(), node("b", None));
        let cases = [("a", Some("zone-a")), ("b", None), ("missing", None)];
        for (name, zone) in cases {
            let info = store.node_info(name);
            assert_eq!(info.name, name);
            assert_eq!(info.zone.as_deref(), zone, "node {name}");
        }
    }

    /// The compact form keeps exactly what translation reads.
    #[test]
    fn slice_from_endpoint_slice() {
        let cases: [(&str, Slice); 4] = [
            (
                "{addressType: IPv4}",
                Slice {
                    address_type: "IPv4".into(),
                    ..Default::default()
                },
            ),
            (
                "{metadata: {name: s, labels: {kubernetes.io/service-name: web, other: x}, annotations: {a: b}},
                  addressType: IPv6, ports: [{name: http, port: 80, protocol: TCP}, {}],
                  endpoints: [{addresses: ['fd00::1', 'fd00::2'], nodeName: n1, zone: z1, hostname: h,
                               conditions: {ready: false, terminating: true},
                               hints: {forZones: [{name: z1}], forNodes: [{name: n1}]}},
                              {addresses: []}]}",
                Slice {
                    service: Some("web".into()),
                    address_type: "IPv6".into(),
                    ports: [
                        SlicePort {
                            name: Some("http".into()),
                            protocol: Some("TCP".into()),
                            port: Some(80),
                        },
                        SlicePort::default(),
                    ]
                    .into(),
                    endpoints: [
                        SliceEndpoint {
                            address: Some("fd00::1".into()),
                            node_name: Some("n1".into()),
                            ready: Some(false),
                            serving: None,
                            terminating: Some(true),
                            hints: Some(Box::new(SliceHints {
                                zones: ["z1".into()].into(),
                                nodes: ["n1".into()].into(),
                            })),
                        },
                        SliceEndpoint::default(),
                    ]
                    .into(),
                    proxy_labels: false,
                },
            ),
            (
                "{metadata: {labels: {kubernetes.io/service-name: web, service.kubernetes.io/headless: ''}}, addressType: IPv4}",
                Slice {
                    service: Some("web".into()),
                    address_type: "IPv4".into(),
                    proxy_labels: true,
                    ..Default::default()
                },
            ),
            (
                "{metadata: {labels: {service.kubernetes.io/service-proxy-name: other}}, addressType: IPv4}",
                Slice {
                    address_type: "IPv4".into(),
                    proxy_labels: true,
                    ..Default::default()
                },
            ),
        ];
        for (yaml, want) in cases {
            let slice: EndpointSlice = serde_yaml::from_str(yaml).unwrap();
            assert_eq!(Slice::from(slice), want, "{yaml}");
        }
    }

    #[test]
    fn object_key_order_and_display() {
        let a = ObjectKey::new("a", "z");
        let b = ObjectKey::new("b", "a");
        assert!(a < b);
        assert_eq!(a.to_string(), "a/z");
    }

    #[test]
    fn rejection_display() {
        let cases = [
            (
                Rejection::new("manifests/web.yaml", "Service default/web", "spec.ports[1].port", "70000 is outside 1..65535"),
                "manifests/web.yaml: Service default/web: spec.ports[1].port: 70000 is outside 1..65535",
            ),
            (
                Rejection::new("m/bad.json", "", "", "expected value at line 1 column 1"),
                "m/bad.json: expected value at line 1 column 1",
            ),
            (
                Rejection::new("api", "Service ns/x", "", "unsupported"),
                "api: Service ns/x: unsupported",
            ),
        ];
        for (rejection, want) in cases {
            assert_eq!(rejection.to_string(), want);
        }
    }
}
