//! The object store that both modes feed: the manifests directory
//! (`manifest::load_dir`) in standalone mode and a kube-rs reflector in
//! cluster mode. `translate` reads it and nothing else, which keeps the
//! Kubernetes semantics testable without a cluster.
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
};

use k8s_openapi::api::{
    core::v1::{Endpoints, Node, Service},
    discovery::v1::EndpointSlice,
};

/// The well-known label carrying a Node's zone (`v1.LabelTopologyZone`).
pub const LABEL_TOPOLOGY_ZONE: &str = "topology.kubernetes.io/zone";

/// `namespace/name` of a namespaced object.
///
/// Ordered by namespace, then name, so that iteration over the store (and
/// therefore every tie-break in `translate`) is deterministic.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey {
    pub namespace: String,
    pub name: String,
}

impl ObjectKey {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
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
    pub services: BTreeMap<ObjectKey, Service>,
    pub slices: BTreeMap<ObjectKey, EndpointSlice>,
    pub endpoints: BTreeMap<ObjectKey, Endpoints>,
    /// Nodes are cluster-scoped: keyed by name only.
    pub nodes: BTreeMap<String, Node>,
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
#[derive(Debug, Clone, PartialEq, Eq)]
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
