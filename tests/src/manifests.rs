//! Service and EndpointSlice manifests for the agent's `--manifests` directory.
//!
//! Files are written under a temporary name (`.NAME.tmp`, which the agent
//! ignores) and renamed into place, so the watcher never reads half a file.
use std::{
    net::IpAddr,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result};
use serde_json::{json, Value};

/// One entry of `spec.ports` of a Service.
#[derive(Debug, Clone)]
pub struct ServicePort {
    pub name: Option<String>,
    /// `u32` so that a test can write an invalid port such as 70000.
    pub port: u32,
    /// `TCP` or `UDP`.
    pub protocol: String,
    /// A number or the name of a container port.
    pub target_port: Value,
}

/// A `v1/Service` of type ClusterIP.
#[derive(Debug, Clone)]
pub struct Service {
    pub namespace: String,
    pub name: String,
    pub cluster_ips: Vec<String>,
    pub ports: Vec<ServicePort>,
}

impl Service {
    pub fn new(namespace: &str, name: &str) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
            cluster_ips: Vec::new(),
            ports: Vec::new(),
        }
    }

    /// Adds a ClusterIP (the first one is `spec.clusterIP`); any string, so
    /// that a test can write an invalid one.
    pub fn cluster_ip(mut self, ip: &str) -> Self {
        self.cluster_ips.push(ip.into());
        self
    }

    /// Adds a port; `target_port` is a number (`json!(8080)`) or a name (`json!("web")`).
    pub fn port(mut self, name: &str, port: u32, protocol: &str, target_port: Value) -> Self {
        self.ports.push(ServicePort {
            name: (!name.is_empty()).then(|| name.to_string()),
            port,
            protocol: protocol.to_uppercase(),
            target_port,
        });
        self
    }

    pub fn to_value(&self) -> Value {
        let families: Option<Vec<&str>> = self
            .cluster_ips
            .iter()
            .map(|ip| match ip.parse::<IpAddr>() {
                Ok(IpAddr::V4(_)) => Some("IPv4"),
                Ok(IpAddr::V6(_)) => Some("IPv6"),
                Err(_) => None,
            })
            .collect();
        let ports: Vec<Value> = self
            .ports
            .iter()
            .map(|p| {
                let mut v = json!({
                    "port": p.port,
                    "protocol": p.protocol,
                    "targetPort": p.target_port,
                });
                if let Some(n) = &p.name {
                    v["name"] = json!(n);
                }
                v
            })
            .collect();
        let mut spec = json!({
            "type": "ClusterIP",
            "ports": ports,
        });
        if let Some(first) = self.cluster_ips.first() {
            spec["clusterIP"] = json!(first);
            spec["clusterIPs"] = json!(self.cluster_ips);
        }
        if let Some(f) = families {
            if !f.is_empty() {
                spec["ipFamilies"] = json!(f);
                spec["ipFamilyPolicy"] = json!(if f.len() > 1 {
                    "RequireDualStack"
                } else {
                    "SingleStack"
                });
            }
        }
        json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": spec,
        })
    }
}

/// One endpoint of an EndpointSlice.
#[derive(Debug, Clone)]
pub struct Endpoint {
    pub address: IpAddr,
    /// `conditions.ready`; `None` leaves it out (which counts as ready).
    pub ready: Option<bool>,
    pub node_name: Option<String>,
}

impl Endpoint {
    pub fn ready(address: IpAddr) -> Self {
        Self {
            address,
            ready: Some(true),
            node_name: None,
        }
    }

    pub fn unready(address: IpAddr) -> Self {
        Self {
            ready: Some(false),
            ..Self::ready(address)
        }
    }

    /// Without a `ready` condition.
    pub fn unknown(address: IpAddr) -> Self {
        Self {
            ready: None,
            ..Self::ready(address)
        }
    }
}

/// A `discovery.k8s.io/v1` EndpointSlice of one Service.
#[derive(Debug, Clone)]
pub struct EndpointSlice {
    pub namespace: String,
    pub name: String,
    pub service: String,
    /// `IPv4` or `IPv6`.
    pub address_type: String,
    /// (name, port, protocol)
    pub ports: Vec<(String, u16, String)>,
    pub endpoints: Vec<Endpoint>,
}

impl EndpointSlice {
    /// A slice `NAME` of Service `service`; the address type follows the
    /// first endpoint unless set with [`address_type`](Self::address_type).
    pub fn new(namespace: &str, name: &str, service: &str) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
            service: service.into(),
            address_type: String::new(),
            ports: Vec::new(),
            endpoints: Vec::new(),
        }
    }

    pub fn address_type(mut self, t: &str) -> Self {
        self.address_type = t.into();
        self
    }

    /// A port named like the Service port it serves.
    pub fn port(mut self, name: &str, port: u16, protocol: &str) -> Self {
        self.ports
            .push((name.into(), port, protocol.to_uppercase()));
        self
    }

    pub fn endpoint(mut self, e: Endpoint) -> Self {
        self.endpoints.push(e);
        self
    }

    pub fn endpoints(mut self, es: impl IntoIterator<Item = Endpoint>) -> Self {
        self.endpoints.extend(es);
        self
    }

    pub fn to_value(&self) -> Value {
        let address_type = if !self.address_type.is_empty() {
            self.address_type.clone()
        } else {
            match self.endpoints.first().map(|e| e.address) {
                Some(IpAddr::V6(_)) => "IPv6".into(),
                _ => "IPv4".into(),
            }
        };
        let endpoints: Vec<Value> = self
            .endpoints
            .iter()
            .map(|e| {
                let mut v = json!({"addresses": [e.address.to_string()]});
                if let Some(r) = e.ready {
                    v["conditions"] = json!({"ready": r});
                }
                if let Some(n) = &e.node_name {
                    v["nodeName"] = json!(n);
                }
                v
            })
            .collect();
        let ports: Vec<Value> = self
            .ports
            .iter()
            .map(|(name, port, proto)| {
                let mut v = json!({"port": port, "protocol": proto});
                if !name.is_empty() {
                    v["name"] = json!(name);
                }
                v
            })
            .collect();
        json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "labels": {"kubernetes.io/service-name": self.service},
            },
            "addressType": address_type,
            "endpoints": endpoints,
            "ports": ports,
        })
    }
}

/// Serializes documents as one multi-document YAML text.
pub fn to_yaml(docs: &[Value]) -> Result<String> {
    let mut out = String::new();
    for d in docs {
        out.push_str("---\n");
        out.push_str(&serde_yaml::to_string(d).context("serializing a manifest")?);
    }
    Ok(out)
}

/// The directory the agent reads with `--manifests`.
#[derive(Debug, Clone)]
pub struct Manifests {
    dir: PathBuf,
}

impl Manifests {
    /// Uses (and creates) `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> Result<Self> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Self { dir })
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Writes `text` to `file` atomically (temporary name, then rename).
    pub fn write_raw(&self, file: &str, text: &str) -> Result<()> {
        let tmp = self.dir.join(format!(".{file}.tmp"));
        let dst = self.dir.join(file);
        std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &dst)
            .with_context(|| format!("renaming {} to {}", tmp.display(), dst.display()))
    }

    /// Writes `docs` as multi-document YAML.
    pub fn write(&self, file: &str, docs: &[Value]) -> Result<()> {
        self.write_raw(file, &to_yaml(docs)?)
    }

    /// Writes one document as JSON.
    pub fn write_json(&self, file: &str, doc: &Value) -> Result<()> {
        self.write_raw(file, &serde_json::to_string_pretty(doc)?)
    }

    pub fn remove(&self, file: &str) -> Result<()> {
        let p = self.dir.join(file);
        std::fs::remove_file(&p).with_context(|| format!("removing {}", p.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_yaml_has_the_fields_the_agent_reads() {
        let svc = Service::new("demo", "web")
            .cluster_ip("10.96.0.10")
            .port("http", 80, "tcp", json!(8080))
            .port("dns", 53, "UDP", json!("dns"));
        let v = svc.to_value();
        assert_eq!(v["spec"]["clusterIP"], "10.96.0.10");
        assert_eq!(v["spec"]["clusterIPs"][0], "10.96.0.10");
        assert_eq!(v["spec"]["ipFamilies"][0], "IPv4");
        assert_eq!(v["spec"]["ports"][0]["protocol"], "TCP");
        assert_eq!(v["spec"]["ports"][1]["targetPort"], "dns");
        let yaml = to_yaml(&[v]).unwrap();
        assert!(yaml.starts_with("---\n"), "{yaml}");
        let back: Value = serde_yaml::from_str(yaml.trim_start_matches("---\n")).unwrap();
        assert_eq!(back["metadata"]["name"], "web");
    }

    #[test]
    fn slice_conditions() {
        let s = EndpointSlice::new("demo", "web-1", "web")
            .port("http", 8080, "TCP")
            .endpoint(Endpoint::ready("10.244.1.1".parse().unwrap()))
            .endpoint(Endpoint::unready("10.244.1.2".parse().unwrap()))
            .endpoint(Endpoint::unknown("10.244.1.3".parse().unwrap()))
            .to_value();
        assert_eq!(s["addressType"], "IPv4");
        assert_eq!(s["metadata"]["labels"]["kubernetes.io/service-name"], "web");
        assert_eq!(s["endpoints"][0]["conditions"]["ready"], true);
        assert_eq!(s["endpoints"][1]["conditions"]["ready"], false);
        assert!(s["endpoints"][2].get("conditions").is_none());
    }
}
