//! Objects decoded field by field, straight into the forms the store
//! keeps, never through the API types that are only converted: the
//! manifests' EndpointSlices ([`WireSlice`]) and cluster mode's watched
//! Services and EndpointSlices ([`WatchedService`], [`WatchedSlice`]). Each
//! mirrors k8s-openapi's own decoding of what it reads (same types, a map
//! only, the last of repeated keys wins, `null` is absent, unknown keys
//! ignored), so that it accepts what the API type accepts.
use std::collections::BTreeMap;

use k8s_openapi::{
    api::{
        core::v1::{Service, ServiceSpec, ServiceStatus},
        discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time},
    Resource as _,
};
use serde::{
    de::{Error as _, IgnoredAny, MapAccess, Unexpected},
    Deserialize,
};

use crate::input::store::{Slice, SliceEndpoint, StoredService};

/// An EndpointSlice decoded from JSON straight into [`Slice`], skipping
/// the API type, whose ~350-byte endpoints are allocated only to be
/// converted (~30 ms of a 10k x 10 first sync). It mirrors
/// k8s-openapi's own decoding field by field (same types, a map only, the
/// last of repeated keys wins, `null` is absent, unknown keys ignored), so
/// that it accepts exactly what the API type accepts.
pub struct WireSlice(pub Slice);

/// The keys the EndpointSlice and Endpoint decoders read, one enum for
/// both; a key of the other kind is as unknown as any other.
#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "camelCase")]
enum WireField {
    // EndpointSlice
    ApiVersion,
    Kind,
    AddressType,
    Endpoints,
    Metadata,
    Ports,
    // Endpoint
    Addresses,
    Conditions,
    DeprecatedTopology,
    Hints,
    Hostname,
    NodeName,
    TargetRef,
    Zone,
    #[serde(other)]
    Other,
}

impl FromMap for WireSlice {
    const NAME: &'static str = "EndpointSlice";
    fn from_map<'de, A: MapAccess<'de>>(map: A) -> Result<Self, A::Error> {
        Ok(WireSlice(slice_from_map::<ObjectMeta, _>(map)?.1))
    }
}

/// An EndpointSlice as cluster mode's watch decodes it: the metadata the
/// watcher reads (name, namespace, resourceVersion) and, straight, the
/// compact form the store keeps, as [`WireSlice`] decodes manifests: the
/// API type's endpoints (~350 bytes each, and their strings) are never
/// built only to be converted.
#[derive(Clone, Debug, Default)]
pub struct WatchedSlice {
    pub metadata: ObjectMeta,
    pub slice: Slice,
}

impl FromMap for WatchedSlice {
    const NAME: &'static str = "EndpointSlice";
    fn from_map<'de, A: MapAccess<'de>>(map: A) -> Result<Self, A::Error> {
        let (metadata, slice) = slice_from_map::<WatchedMeta, _>(map)?;
        Ok(WatchedSlice {
            metadata: metadata.unwrap_or_default().into(),
            slice,
        })
    }
}

impl<'de> Deserialize<'de> for WatchedSlice {
    fn deserialize<D: serde::Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        MapVisitor::<Self>::deserialize(de)
    }
}

/// A watched form of an API kind: the same resource to kube-rs (kind,
/// group, path), decoded into its own type.
macro_rules! watched_resource {
    ($watched:ty, $api:ty) => {
        impl k8s_openapi::Resource for $watched {
            const API_VERSION: &'static str = <$api as k8s_openapi::Resource>::API_VERSION;
            const GROUP: &'static str = <$api as k8s_openapi::Resource>::GROUP;
            const KIND: &'static str = <$api as k8s_openapi::Resource>::KIND;
            const VERSION: &'static str = <$api as k8s_openapi::Resource>::VERSION;
            const URL_PATH_SEGMENT: &'static str =
                <$api as k8s_openapi::Resource>::URL_PATH_SEGMENT;
            type Scope = <$api as k8s_openapi::Resource>::Scope;
        }

        impl k8s_openapi::Metadata for $watched {
            type Ty = ObjectMeta;
            fn metadata(&self) -> &ObjectMeta {
                &self.metadata
            }
            fn metadata_mut(&mut self) -> &mut ObjectMeta {
                &mut self.metadata
            }
        }
    };
}

watched_resource!(WatchedSlice, EndpointSlice);
watched_resource!(WatchedService, Service);

/// The metadata a watch decodes of an object: what the watcher needs (name,
/// namespace, resourceVersion, uid) and what the store keeps (labels,
/// annotations, the creation time). The rest, managedFields above all
/// (often most of an object's bytes in a real cluster), is skipped unread.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct WatchedMeta {
    name: Option<String>,
    namespace: Option<String>,
    resource_version: Option<String>,
    uid: Option<String>,
    labels: Option<BTreeMap<String, String>>,
    annotations: Option<BTreeMap<String, String>>,
    creation_timestamp: Option<Time>,
    deletion_timestamp: Option<Time>,
}

impl From<WatchedMeta> for ObjectMeta {
    fn from(m: WatchedMeta) -> Self {
        ObjectMeta {
            name: m.name,
            namespace: m.namespace,
            resource_version: m.resource_version,
            uid: m.uid,
            labels: m.labels,
            annotations: m.annotations,
            creation_timestamp: m.creation_timestamp,
            deletion_timestamp: m.deletion_timestamp,
            ..Default::default()
        }
    }
}

/// Metadata whose labels a compact form takes.
trait Labelled {
    fn take_labels(&mut self) -> Option<BTreeMap<String, String>>;
}

impl Labelled for ObjectMeta {
    fn take_labels(&mut self) -> Option<BTreeMap<String, String>> {
        self.labels.take()
    }
}

impl Labelled for WatchedMeta {
    fn take_labels(&mut self) -> Option<BTreeMap<String, String>> {
        self.labels.take()
    }
}

/// A Service as cluster mode's watch decodes it: the metadata the watcher
/// reads and the form the store keeps, built from the API type's spec and
/// status as they decode, without a whole Service in between.
#[derive(Clone, Debug, Default)]
pub struct WatchedService {
    pub metadata: ObjectMeta,
    pub service: StoredService,
}

/// The keys of a Service the watch decodes.
#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "camelCase")]
enum ServiceField {
    ApiVersion,
    Kind,
    Metadata,
    Spec,
    Status,
    #[serde(other)]
    Other,
}

impl FromMap for WatchedService {
    const NAME: &'static str = "Service";
    fn from_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<Self, A::Error> {
        let mut metadata: Option<WatchedMeta> = None;
        let mut spec: Option<ServiceSpec> = None;
        let mut status: Option<ServiceStatus> = None;
        while let Some(key) = map.next_key::<ServiceField>()? {
            match key {
                ServiceField::ApiVersion => expect_value(&mut map, Service::API_VERSION)?,
                ServiceField::Kind => expect_value(&mut map, Service::KIND)?,
                ServiceField::Metadata => metadata = map.next_value()?,
                ServiceField::Spec => spec = map.next_value()?,
                ServiceField::Status => status = map.next_value()?,
                ServiceField::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        let mut metadata = metadata.unwrap_or_default();
        // What the stored form takes of the metadata.
        let read = ObjectMeta {
            labels: metadata.labels.take(),
            annotations: metadata.annotations.take(),
            creation_timestamp: metadata.creation_timestamp.clone(),
            ..Default::default()
        };
        let metadata = metadata.into();
        let service = StoredService::from(Service {
            metadata: read,
            spec,
            status,
        });
        Ok(WatchedService { metadata, service })
    }
}

impl<'de> Deserialize<'de> for WatchedService {
    fn deserialize<D: serde::Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        MapVisitor::<Self>::deserialize(de)
    }
}

/// Decodes an EndpointSlice into its metadata (less the labels, which the
/// slice takes) and the compact form.
fn slice_from_map<'de, M: Deserialize<'de> + Labelled, A: MapAccess<'de>>(
    mut map: A,
) -> Result<(Option<M>, Slice), A::Error> {
    let mut address_type: Option<String> = None;
    let mut endpoints: Option<Vec<WireEndpoint>> = None;
    let mut metadata: Option<M> = None;
    let mut ports: Option<Vec<k8s_openapi::api::discovery::v1::EndpointPort>> = None;
    while let Some(key) = map.next_key::<WireField>()? {
        match key {
            WireField::ApiVersion => expect_value(&mut map, EndpointSlice::API_VERSION)?,
            WireField::Kind => expect_value(&mut map, EndpointSlice::KIND)?,
            WireField::AddressType => address_type = map.next_value()?,
            WireField::Endpoints => endpoints = map.next_value()?,
            WireField::Metadata => metadata = map.next_value()?,
            WireField::Ports => ports = map.next_value()?,
            _ => {
                map.next_value::<IgnoredAny>()?;
            }
        }
    }
    let labels = metadata.as_mut().and_then(Labelled::take_labels);
    let slice = Slice::new(
        labels,
        address_type.unwrap_or_default(),
        ports.unwrap_or_default(),
        endpoints.unwrap_or_default().into_iter().map(|e| e.0),
    );
    Ok((metadata, slice))
}

/// Reads the value of an `apiVersion` or `kind` key, which must be `want`.
fn expect_value<'de, A: MapAccess<'de>>(map: &mut A, want: &'static str) -> Result<(), A::Error> {
    let found = map.next_value::<String>()?;
    if found != want {
        return Err(A::Error::invalid_value(Unexpected::Str(&found), &want));
    }
    Ok(())
}

impl<'de> Deserialize<'de> for WireSlice {
    fn deserialize<D: serde::Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        MapVisitor::<Self>::deserialize(de)
    }
}

/// One endpoint of a [`WireSlice`]; the fields translation does not read
/// are checked as the API type would decode them, without keeping them
/// (a real cluster's endpoints each carry a `targetRef` of four strings).
struct WireEndpoint(SliceEndpoint);

impl FromMap for WireEndpoint {
    const NAME: &'static str = "Endpoint";
    fn from_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<Self, A::Error> {
        use k8s_openapi::api::discovery::v1::Endpoint;
        let mut ep = Endpoint::default();
        let mut addresses: Option<Vec<String>> = None;
        while let Some(key) = map.next_key::<WireField>()? {
            match key {
                WireField::Addresses => addresses = map.next_value()?,
                WireField::Conditions => ep.conditions = map.next_value()?,
                WireField::DeprecatedTopology => {
                    map.next_value::<Option<TextMap>>()?;
                }
                WireField::Hints => ep.hints = map.next_value()?,
                WireField::Hostname | WireField::Zone => {
                    map.next_value::<Option<Text>>()?;
                }
                WireField::NodeName => ep.node_name = map.next_value()?,
                WireField::TargetRef => {
                    map.next_value::<Option<ReferenceCheck>>()?;
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        ep.addresses = addresses.unwrap_or_default();
        Ok(WireEndpoint(ep.into()))
    }
}

/// A string value, checked and dropped: what a `String` accepts, without
/// the allocation.
struct Text;

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: serde::Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Text;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: serde::de::Error>(self, _: &str) -> Result<Text, E> {
                Ok(Text)
            }
        }
        de.deserialize_str(V)
    }
}

/// A map of strings to strings, checked and dropped (a
/// `BTreeMap<String, String>`).
struct TextMap;

impl<'de> Deserialize<'de> for TextMap {
    fn deserialize<D: serde::Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = TextMap;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a map")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<TextMap, A::Error> {
                while map.next_entry::<Text, Text>()?.is_some() {}
                Ok(TextMap)
            }
        }
        de.deserialize_map(V)
    }
}

/// An `ObjectReference` (an endpoint's `targetRef`), checked field by
/// field as k8s-openapi decodes it, and dropped.
struct ReferenceCheck;

/// The keys of an `ObjectReference`.
#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "camelCase")]
enum ReferenceField {
    ApiVersion,
    FieldPath,
    Kind,
    Name,
    Namespace,
    ResourceVersion,
    Uid,
    #[serde(other)]
    Other,
}

impl FromMap for ReferenceCheck {
    const NAME: &'static str = "ObjectReference";
    fn from_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<Self, A::Error> {
        while let Some(key) = map.next_key::<ReferenceField>()? {
            match key {
                ReferenceField::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
                _ => {
                    map.next_value::<Option<Text>>()?;
                }
            }
        }
        Ok(ReferenceCheck)
    }
}

impl<'de> Deserialize<'de> for ReferenceCheck {
    fn deserialize<D: serde::Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        MapVisitor::<Self>::deserialize(de)
    }
}

impl<'de> Deserialize<'de> for WireEndpoint {
    fn deserialize<D: serde::Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        MapVisitor::<Self>::deserialize(de)
    }
}

/// A type decoded field by field from a map (a JSON or YAML object).
trait FromMap: Sized {
    const NAME: &'static str;
    fn from_map<'de, A: serde::de::MapAccess<'de>>(map: A) -> Result<Self, A::Error>;
}

/// The serde visitor of any [`FromMap`] type.
struct MapVisitor<T>(std::marker::PhantomData<T>);

impl<T: FromMap> MapVisitor<T> {
    fn deserialize<'de, D: serde::Deserializer<'de>>(de: D) -> Result<T, D::Error> {
        de.deserialize_struct(T::NAME, &[], Self(std::marker::PhantomData))
    }
}

impl<'de, T: FromMap> serde::de::Visitor<'de> for MapVisitor<T> {
    type Value = T;
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(T::NAME)
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
        T::from_map(map)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// As the manifests decode an API type, less the path in its errors,
    /// which these tests do not compare.
    fn decode_str<T: serde::de::DeserializeOwned>(text: &str) -> serde_json::Result<Box<T>> {
        serde_json::from_str(text).map(Box::new)
    }

    /// The direct decoding accepts exactly what the API type does, to the
    /// same result: on an error, the API type decodes it again for the
    /// message, so a wrongly accepted input is the only thing to fear.
    #[test]
    fn slices_decode_directly_as_through_the_api_type() {
        let cases = [
            r#"{"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "metadata": {"name": "s", "labels": {"kubernetes.io/service-name": "web"}},
                "addressType": "IPv4", "ports": [{"name": "http", "port": 80, "protocol": "TCP"}, {}],
                "endpoints": [{"addresses": ["10.0.0.1", "10.0.0.2"], "conditions": {"ready": false, "serving": true, "terminating": true},
                               "nodeName": "n1", "zone": "z", "hostname": "h", "deprecatedTopology": {"a": "b"}, "unknown": [1, {}],
                               "targetRef": {"kind": "Pod", "name": "p", "namespace": "ns", "uid": "u"},
                               "hints": {"forZones": [{"name": "z"}], "forNodes": [{"name": "n1"}]}},
                              {"addresses": []}, {}]}"#,
            r#"{"addressType": null, "endpoints": null, "ports": null, "metadata": null}"#,
            r#"{"addressType": "IPv4", "endpoints": [{"addresses": null, "conditions": null, "hints": null, "nodeName": null, "targetRef": null}]}"#,
            r#"{"addressType": "IPv4", "addressType": "IPv6", "endpoints": [{"addresses": ["a"], "addresses": ["b"]}]}"#,
            r#"{"apiVersion": "discovery.k8s.io/v1beta1", "addressType": "IPv4"}"#,
            r#"{"kind": "Service", "addressType": "IPv4"}"#,
            r#"{"kind": null, "addressType": "IPv4"}"#,
            r#"{"addressType": 4}"#,
            r#"{"addressType": "IPv4", "endpoints": [["10.0.0.1"]]}"#,
            r#"{"addressType": "IPv4", "endpoints": [{"addresses": "10.0.0.1"}]}"#,
            r#"{"addressType": "IPv4", "endpoints": [{"addresses": [1]}]}"#,
            r#"{"addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": "maybe"}}]}"#,
            r#"{"addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.1"], "hostname": 5}]}"#,
            r#"{"addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.1"], "zone": []}]}"#,
            r#"{"addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.1"], "targetRef": {"name": 5}}]}"#,
            r#"{"addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.1"], "targetRef": {"uid": "u", "kind": ["Pod"]}}]}"#,
            r#"{"addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.1"], "targetRef": {"apiVersion": "v1", "fieldPath": "f", "resourceVersion": "3",
                "kind": "Pod", "kind": "Node", "name": "a\"b\u00e9", "namespace": null, "other": {"x": [1]}}}]}"#,
            r#"{"addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.1"], "targetRef": {}}]}"#,
            r#"{"addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.1"], "targetRef": ["Pod"]}]}"#,
            r#"{"addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.1"], "targetRef": "Pod/a"}]}"#,
            r#"{"addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.1"], "targetRef": {"name": "a"}, "targetRef": 1}]}"#,
            r#"{"addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.1"], "hostname": "h\n", "zone": null}]}"#,
            r#"{"addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.1"], "hostname": true}]}"#,
            r#"{"addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.1"], "deprecatedTopology": null}]}"#,
            r#"{"addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.1"], "deprecatedTopology": {"a\t": "b\u0041", "c": "d"}}]}"#,
            r#"{"addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.1"], "deprecatedTopology": [["a", "b"]]}]}"#,
            r#"{"addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.1"], "deprecatedTopology": {"a": null}}]}"#,
            r#"{"addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.1"], "deprecatedTopology": {"a": 1}}]}"#,
            r#"{"addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.1"], "hints": {"forZones": [{}]}}]}"#,
            r#"{"addressType": "IPv4", "ports": [{"port": "80"}]}"#,
            r#"{"addressType": "IPv4", "metadata": {"labels": {"kubernetes.io/service-name": 1}}}"#,
            r#"["IPv4"]"#,
        ];
        for text in cases {
            let direct = serde_json::from_str::<WireSlice>(text).map(|w| w.0);
            let api = decode_str::<EndpointSlice>(text);
            let typed = api.as_ref().map(|s| Slice::from((**s).clone()));
            // Cluster mode's watch decodes the same way, keeping the
            // metadata but for the labels, which the slice took.
            let watched = serde_json::from_str::<WatchedSlice>(text);
            match (&direct, &typed, &watched) {
                (Ok(direct), Ok(typed), Ok(watched)) => {
                    assert_eq!(direct, typed, "{text}");
                    assert_eq!(&watched.slice, typed, "{text}");
                    let typed_meta = &api.as_ref().expect("decoded above").metadata;
                    assert!(kept_for_watch(&watched.metadata, typed_meta), "{text}");
                }
                (Err(_), Err(_), Err(_)) => {}
                _ => panic!("{text}: direct {direct:?}, API type {typed:?}, watched {watched:?}"),
            }
        }
        // What a list or watch of the API server carries.
        let text = r#"{"metadata": {"name": "web-x1", "namespace": "shop", "resourceVersion": "42",
            "uid": "u1", "creationTimestamp": "2024-01-01T00:00:00Z",
            "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4", "endpoints": [{"addresses": ["10.244.1.5"]}]}"#;
        let watched: WatchedSlice = serde_json::from_str(text).unwrap();
        let meta = &watched.metadata;
        assert_eq!(
            (meta.name.as_deref(), meta.namespace.as_deref()),
            (Some("web-x1"), Some("shop"))
        );
        assert_eq!(meta.resource_version.as_deref(), Some("42"));
        assert_eq!(watched.slice.service.as_deref(), Some("web"));
        assert_eq!(
            watched.slice.endpoints[0].address,
            Some(crate::input::store::IpField::from("10.244.1.5"))
        );
    }

    /// Cluster mode's Service watch builds the stored form as the API type
    /// and its conversion do, and keeps the watcher's metadata.
    #[test]
    fn watched_services_decode_as_through_the_api_type() {
        let cases = [
            r#"{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "shop", "resourceVersion": "7",
                "labels": {"service.kubernetes.io/headless": "", "app": "web"}, "annotations": {"lb-agent.dev/lb-algorithm": "maglev", "x": "y"},
                "creationTimestamp": "2024-01-01T00:00:00Z", "managedFields": [{"manager": "m", "fieldsV1": {"f:spec": {}}}]},
                "spec": {"type": "LoadBalancer", "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10"], "selector": {"app": "web"},
                         "ports": [{"name": "http", "port": 80, "targetPort": "web", "nodePort": 30080}],
                         "externalTrafficPolicy": "Local", "healthCheckNodePort": 32000, "sessionAffinity": "ClientIP",
                         "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 60}}},
                "status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.1", "ipMode": "VIP"}]}}}"#,
            r#"{"metadata": {"name": "a"}}"#,
            r#"{"metadata": null, "spec": null, "status": null, "unknown": [1]}"#,
            r#"{"apiVersion": "v2", "metadata": {"name": "a"}}"#,
            r#"{"kind": "Node", "metadata": {"name": "a"}}"#,
            r#"{"spec": {"ports": [{"port": "80"}]}}"#,
            r#"{"metadata": {"labels": {"a": 1}}}"#,
            r#"["Service"]"#,
        ];
        for text in cases {
            let watched = serde_json::from_str::<WatchedService>(text);
            let typed = decode_str::<Service>(text);
            match (&watched, &typed) {
                (Ok(watched), Ok(typed)) => {
                    let typed = *typed.clone();
                    assert!(kept_for_watch(&watched.metadata, &typed.metadata), "{text}");
                    assert_eq!(watched.service, StoredService::from(typed), "{text}");
                }
                (Err(_), Err(_)) => {}
                _ => panic!("{text}: watched {watched:?}, API type {typed:?}"),
            }
        }
        let first: WatchedService = serde_json::from_str(cases[0]).unwrap();
        assert!(first.service.metadata.proxy_labels);
        assert_eq!(first.service.metadata.algorithm.as_deref(), Some("maglev"));
        assert_eq!(first.metadata.resource_version.as_deref(), Some("7"));
        // managedFields are skipped unread: not even their shape is checked.
        let text = r#"{"metadata": {"name": "a", "managedFields": "not a list"}, "spec": {"clusterIP": "10.96.0.1"}}"#;
        assert!(decode_str::<Service>(text).is_err());
        let watched: WatchedService = serde_json::from_str(text).unwrap();
        assert_eq!(watched.metadata.name.as_deref(), Some("a"));
        let text = r#"{"metadata": {"name": "s", "managedFields": 5}, "addressType": "IPv4"}"#;
        assert!(decode_str::<EndpointSlice>(text).is_err());
        assert!(serde_json::from_str::<WatchedSlice>(text).is_ok());
    }

    /// Whether a watch kept of metadata `typed` what it needs (labels and
    /// annotations go to the stored form), and nothing else.
    fn kept_for_watch(watched: &ObjectMeta, typed: &ObjectMeta) -> bool {
        let needed = |m: &ObjectMeta| {
            (
                m.name.clone(),
                m.namespace.clone(),
                m.resource_version.clone(),
                m.uid.clone(),
                m.creation_timestamp.clone(),
                m.deletion_timestamp.clone(),
            )
        };
        let rest = ObjectMeta {
            name: None,
            namespace: None,
            resource_version: None,
            uid: None,
            creation_timestamp: None,
            deletion_timestamp: None,
            ..watched.clone()
        };
        needed(watched) == needed(typed) && rest == ObjectMeta::default()
    }
}
