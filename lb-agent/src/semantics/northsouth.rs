//! Kubernetes semantics of north-south traffic that the tc path needs on
//! top of `translate`: the node's addresses (`--nodeport-addresses`),
//! `loadBalancerSourceRanges` and the health-check node ports of
//! `externalTrafficPolicy: Local`. (`--allowed-external-ip-cidrs` applies
//! in `translate`.)
//! Pure functions over the store and the desired state, with table tests.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use k8s_openapi::api::core::v1::Node;

use crate::{
    input::store::{IpField, ObjectKey, Rejection, Store},
    semantics::{
        model::{Cidr, DesiredState, Frontend, FrontendKind, Scope, ServiceName},
        translate,
    },
};

const SOURCE: &str = "translate";

/// `InternalIP` and `ExternalIP` addresses of a Node, in its order.
pub fn node_object_addresses(node: &Node) -> Vec<IpAddr> {
    node.status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .into_iter()
        .flatten()
        .filter(|a| a.type_ == "InternalIP" || a.type_ == "ExternalIP")
        .filter_map(|a| a.address.parse().ok())
        .collect()
}

/// The addresses NodePorts are served on: the Node object's InternalIP and
/// ExternalIP when the store has it, else the addresses of the devices;
/// never loopback or link-local (CVE-2020-8558); limited to
/// `--nodeport-addresses` when given. Deduplicated, in order.
pub fn node_addresses(
    store: &Store,
    node_name: &str,
    device_addresses: &[IpAddr],
    nodeport_cidrs: &[Cidr],
) -> Vec<IpAddr> {
    let from_node = store
        .nodes
        .get(node_name)
        .map(node_object_addresses)
        .unwrap_or_default();
    let source = if from_node.is_empty() {
        device_addresses
    } else {
        &from_node[..]
    };
    let mut seen = BTreeSet::new();
    source
        .iter()
        .copied()
        .filter(|a| !a.is_loopback() && !a.is_unspecified() && !is_link_local(*a))
        .filter(|a| nodeport_cidrs.is_empty() || nodeport_cidrs.iter().any(|c| c.contains(*a)))
        .filter(|a| seen.insert(*a))
        .collect()
}

fn is_link_local(a: IpAddr) -> bool {
    match a {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => v6.segments()[0] & 0xffc0 == 0xfe80,
    }
}

/// `loadBalancerSourceRanges` of the External LoadBalancer frontends that
/// have any (kube-proxy filters the load balancer IPs, not NodePorts).
pub fn source_ranges(
    store: &Store,
    desired: &DesiredState,
) -> (BTreeMap<Frontend, Vec<Cidr>>, Vec<Rejection>) {
    let mut out = BTreeMap::new();
    let mut rejections = Vec::new();
    for (f, s) in &desired.frontends {
        if f.scope != Scope::External || s.kind != FrontendKind::LoadBalancer {
            continue;
        }
        let key = ObjectKey::new(s.service.namespace.clone(), s.service.name.clone());
        let Some(spec) = store.services.get(&key).and_then(|svc| svc.spec.as_ref()) else {
            continue;
        };
        let mut ranges = Vec::new();
        for (i, raw) in spec
            .load_balancer_source_ranges
            .iter()
            .flatten()
            .enumerate()
        {
            match raw.parse::<Cidr>() {
                Ok(c) => ranges.push(c),
                Err(e) => {
                    let r = Rejection::new(
                        SOURCE,
                        format!("Service {key}"),
                        format!("spec.loadBalancerSourceRanges[{i}]"),
                        format!("{e}; ignored"),
                    );
                    if !rejections.contains(&r) {
                        rejections.push(r);
                    }
                }
            }
        }
        // Malformed entries restrict nothing (each is rejected above; the API
        // server refuses them anyway): a frontend without a range of its
        // family is open, as `translate` flags it.
        if !ranges.is_empty() {
            ranges.sort();
            ranges.dedup();
            out.insert(*f, ranges);
        }
    }
    (out, rejections)
}

/// A health-check node port as kube-proxy serves it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthCheck {
    pub port: u16,
    pub service: ServiceName,
    /// Ready endpoints of the Service on this node.
    pub local_endpoints: usize,
}

/// `healthCheckNodePort` of every `externalTrafficPolicy: Local` Service
/// this proxy serves (`translate::serves`: not another proxy's, not
/// labelled headless), with its count of ready local endpoints; slices with
/// those labels do not count, as in `translate`.
pub fn health_checks(store: &Store, node_name: &str) -> Vec<HealthCheck> {
    // The Local Services first (usually few), then one walk over the slices.
    let mut local: BTreeMap<&ObjectKey, (u16, BTreeSet<&IpField>)> = BTreeMap::new();
    for (key, svc) in &store.services {
        let Some(spec) = &svc.spec else { continue };
        if !translate::serves(svc) || spec.external_traffic_policy.as_deref() != Some("Local") {
            continue;
        }
        let Some(port) = spec
            .health_check_node_port
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p != 0)
        else {
            continue;
        };
        local.insert(key, (port, BTreeSet::new()));
    }
    if !local.is_empty() {
        for (slice_key, slice) in &store.slices {
            let Some(service) = slice.service.as_deref().filter(|_| !slice.proxy_labels) else {
                continue;
            };
            let key = ObjectKey::new(slice_key.namespace.clone(), service);
            let Some((_, addresses)) = local.get_mut(&key) else {
                continue;
            };
            for ep in slice.endpoints.iter() {
                if ep.ready.unwrap_or(true) && ep.node_name.as_deref() == Some(node_name) {
                    if let Some(a) = &ep.address {
                        addresses.insert(a);
                    }
                }
            }
        }
    }
    local
        .into_iter()
        .map(|(key, (port, addresses))| HealthCheck {
            port,
            service: ServiceName {
                namespace: key.namespace.clone(),
                name: key.name.clone(),
            },
            local_endpoints: addresses.len(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::input::store::{Slice, LABEL_SERVICE_NAME};
    use crate::semantics::model::{Algorithm, FrontendState, Protocol};
    use k8s_openapi::api::{
        core::v1::{NodeAddress, NodeStatus, Service, ServiceSpec},
        discovery::v1::{Endpoint, EndpointConditions, EndpointSlice},
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn node(name: &str, addrs: &[(&str, &str)]) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            status: Some(NodeStatus {
                addresses: Some(
                    addrs
                        .iter()
                        .map(|(t, a)| NodeAddress {
                            type_: t.to_string(),
                            address: a.to_string(),
                        })
                        .collect(),
                ),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn node_addresses_table() {
        let mut store = Store::default();
        store.nodes.insert(
            "n1".into(),
            node(
                "n1",
                &[
                    ("Hostname", "n1"),
                    ("InternalIP", "192.168.77.1"),
                    ("ExternalIP", "203.0.113.1"),
                    ("InternalIP", "fd00:77::1"),
                ],
            ),
        );
        let devices = [ip("127.0.0.1"), ip("10.0.0.5"), ip("fe80::1"), ip("::1")];
        let np: Vec<Cidr> = vec!["192.168.0.0/16".parse().unwrap()];
        let cases: [(&str, &[Cidr], &[&str]); 4] = [
            ("n1", &[], &["192.168.77.1", "203.0.113.1", "fd00:77::1"]),
            ("n1", &np, &["192.168.77.1"]),
            // No Node object: the devices' addresses, never loopback or link-local.
            ("other", &[], &["10.0.0.5"]),
            ("other", &np, &[]),
        ];
        for (name, cidrs, want) in cases {
            let got = node_addresses(&store, name, &devices, cidrs);
            let want: Vec<IpAddr> = want.iter().map(|a| ip(a)).collect();
            assert_eq!(got, want, "{name} {cidrs:?}");
        }
    }

    /// Adds each `(addr, scope, service, kind)`: `addr:80/TCP` in `scope`
    /// as a frontend of Service `demo/service`.
    fn add(d: &mut DesiredState, frontends: &[(&str, Scope, &str, FrontendKind)]) {
        for &(addr, scope, service, kind) in frontends {
            d.frontends
                .insert(fe(addr, scope), fstate(service, kind).into());
        }
    }

    fn fstate(name: &str, kind: FrontendKind) -> FrontendState {
        FrontendState {
            service: ServiceName {
                namespace: "demo".into(),
                name: name.into(),
            },
            port_name: String::new(),
            kind,
            active: Vec::new(),
            terminating: Vec::new(),
            serving: Vec::new(),
            affinity_timeout: None,
            selection: Default::default(),
            algorithm: Algorithm::Random,
            reject: false,
            source_ranges: false,
            outlier: Default::default(),
        }
    }

    fn fe(addr: &str, scope: Scope) -> Frontend {
        Frontend {
            addr: ip(addr),
            port: 80,
            protocol: Protocol::Tcp,
            scope,
        }
    }

    /// The metadata of object `demo/name`.
    fn meta(name: &str) -> ObjectMeta {
        ObjectMeta {
            name: Some(name.into()),
            namespace: Some("demo".into()),
            ..Default::default()
        }
    }

    /// Stores Service `demo/name` with the spec `f` makes.
    fn add_service(store: &mut Store, name: &str, f: impl FnOnce(&mut ServiceSpec)) {
        let mut spec = ServiceSpec::default();
        f(&mut spec);
        let service = Service {
            metadata: meta(name),
            spec: Some(spec),
            ..Default::default()
        };
        store
            .services
            .insert(ObjectKey::new("demo", name), Box::new(service.into()));
    }

    #[test]
    fn source_ranges_apply_to_external_load_balancer_frontends() {
        use FrontendKind::{LoadBalancer, NodePort};
        use Scope::{External, Internal};
        let mut store = Store::default();
        add_service(&mut store, "lb", |s| {
            s.load_balancer_source_ranges = Some(vec!["192.168.77.0/25".into(), "bogus".into()])
        });
        add_service(&mut store, "open", |_| {});
        let mut d = DesiredState::default();
        add(
            &mut d,
            &[
                ("203.0.113.10", External, "lb", LoadBalancer),
                ("203.0.113.10", Internal, "lb", LoadBalancer),
                ("192.168.77.1", External, "lb", NodePort),
                ("203.0.113.11", External, "open", LoadBalancer),
            ],
        );
        let (ranges, rejections) = source_ranges(&store, &d);
        assert_eq!(
            ranges,
            BTreeMap::from([(
                fe("203.0.113.10", Scope::External),
                vec!["192.168.77.0/25".parse().unwrap()]
            )])
        );
        assert_eq!(rejections.len(), 1);
        assert_eq!(rejections[0].field, "spec.loadBalancerSourceRanges[1]");
    }

    fn slice(service: &str, eps: &[(&str, &str, bool)]) -> Slice {
        Slice::from(EndpointSlice {
            metadata: ObjectMeta {
                labels: Some([(LABEL_SERVICE_NAME.to_owned(), service.to_owned())].into()),
                ..meta(&format!("{service}-x"))
            },
            address_type: "IPv4".into(),
            endpoints: Some(
                eps.iter()
                    .map(|(a, n, ready)| Endpoint {
                        addresses: vec![a.to_string()],
                        node_name: Some(n.to_string()),
                        conditions: Some(EndpointConditions {
                            ready: Some(*ready),
                            ..Default::default()
                        }),
                        ..Default::default()
                    })
                    .collect(),
            ),
            ports: None,
        })
    }

    #[test]
    fn health_checks_count_ready_local_endpoints() {
        let mut store = Store::default();
        add_service(&mut store, "local", |s| {
            s.external_traffic_policy = Some("Local".into());
            s.health_check_node_port = Some(32000);
        });
        add_service(&mut store, "cluster", |s| {
            s.external_traffic_policy = Some("Cluster".into());
            s.health_check_node_port = Some(32001);
        });
        store.slices.insert(
            ObjectKey::new("demo", "local-x"),
            slice(
                "local",
                &[
                    ("10.244.1.10", "n1", true),
                    ("10.244.1.11", "n1", false),
                    ("10.244.2.10", "n2", true),
                ],
            ),
        );
        let cases = [("n1", 1), ("n2", 1), ("n3", 0)];
        for (node, want) in cases {
            let hc = health_checks(&store, node);
            assert_eq!(hc.len(), 1, "only Local Services: {hc:?}");
            assert_eq!(hc[0].port, 32000);
            assert_eq!(hc[0].local_endpoints, want, "{node}");
        }
    }

    /// Like kube-proxy, no health-check node port for a Service it does not
    /// serve, and no count from a slice its watch would not see.
    #[test]
    fn health_checks_only_for_services_this_proxy_serves() {
        let mut store = Store::default();
        let local = |s: &mut ServiceSpec, port| {
            s.external_traffic_policy = Some("Local".into());
            s.health_check_node_port = Some(port);
        };
        add_service(&mut store, "ours", |s| local(s, 32000));
        for (name, label, port) in [
            ("theirs", "service.kubernetes.io/service-proxy-name", 32001),
            ("headless", "service.kubernetes.io/headless", 32002),
        ] {
            let mut metadata = meta(name);
            metadata.labels = Some([(label.to_owned(), "x".to_owned())].into());
            let mut spec = ServiceSpec::default();
            local(&mut spec, port);
            let labelled = Service {
                metadata,
                spec: Some(spec),
                ..Default::default()
            };
            store
                .services
                .insert(ObjectKey::new("demo", name), Box::new(labelled.into()));
        }
        store.slices.insert(
            ObjectKey::new("demo", "ours-x"),
            slice("ours", &[("10.244.1.10", "n1", true)]),
        );
        let mut labelled = slice("ours", &[("10.244.1.11", "n1", true)]);
        labelled.proxy_labels = true;
        store
            .slices
            .insert(ObjectKey::new("demo", "ours-y"), labelled);
        let hc = health_checks(&store, "n1");
        let got: Vec<(u16, &str, usize)> = hc
            .iter()
            .map(|h| (h.port, &*h.service.name, h.local_endpoints))
            .collect();
        assert_eq!(got, [(32000, "ours", 1)]);
    }
}
