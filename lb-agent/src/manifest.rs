//! Standalone mode input: a directory of Kubernetes manifests.
//!
//! Bad input never aborts a load: each problem becomes a [`Rejection`] and
//! only the offending object (or file, when it does not parse) is skipped,
//! so one typo cannot take every other Service down with it.
use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
};

use k8s_openapi::{api::core::v1::Node, apimachinery::pkg::apis::meta::v1::ObjectMeta, Metadata};
use serde::{de::DeserializeOwned, Deserialize};
use serde_json::Value;

use crate::store::{ObjectKey, Rejection, Store};

/// The namespace of a namespaced object whose manifest does not say.
pub const DEFAULT_NAMESPACE: &str = "default";

/// How a manifest file is encoded, decided by its extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `*.yaml`, `*.yml`: any number of `---` separated documents.
    Yaml,
    /// `*.json`: one object (possibly a `List`).
    Json,
}

impl Format {
    /// The format of a manifest file, or `None` when the directory loader
    /// ignores it (wrong extension, hidden, editor backup or autosave).
    pub fn of_path(path: &Path) -> Option<Format> {
        let name = path.file_name()?.to_string_lossy();
        // `.foo.swp`, `.#foo` (hidden), `foo~` (backup), `#foo#` (autosave):
        // editors write these next to the real file while it is being edited.
        if name.starts_with('.') || name.starts_with('#') || name.ends_with('~') {
            return None;
        }
        let (_, ext) = name.rsplit_once('.')?;
        match ext.to_ascii_lowercase().as_str() {
            "yaml" | "yml" => Some(Format::Yaml),
            "json" => Some(Format::Json),
            _ => None,
        }
    }
}

/// Loads every manifest file directly in `dir` (not recursively), in file
/// name order so that "first wins" on duplicates is deterministic.
pub fn load_dir(dir: &Path) -> (Store, Vec<Rejection>) {
    let mut loader = Loader::default();
    match manifest_files(dir) {
        Ok(files) => {
            for (path, format) in files {
                loader.load_file(&path, format);
            }
        }
        Err(err) => loader.reject(
            dir.display().to_string(),
            "",
            "",
            format!("cannot read the manifests directory: {err}"),
        ),
    }
    (loader.store, loader.rejections)
}

/// Loads the manifests in `text`, reporting problems against `source`.
pub fn load_str(source: &str, text: &str, format: Format) -> (Store, Vec<Rejection>) {
    let mut loader = Loader::default();
    loader.load_text(source, text, format);
    (loader.store, loader.rejections)
}

/// The manifest files of `dir`, sorted by name. Symlinks are followed, so a
/// ConfigMap volume (whose files are links into a hidden `..data`) works.
fn manifest_files(dir: &Path) -> std::io::Result<Vec<(PathBuf, Format)>> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        let Some(format) = Format::of_path(&path) else {
            continue;
        };
        // A dangling link is not a file: skipped like a directory would be.
        if fs::metadata(&path).is_ok_and(|m| m.is_file()) {
            files.push((path, format));
        }
    }
    files.sort_by(|(a, _), (b, _)| a.file_name().cmp(&b.file_name()));
    Ok(files)
}

/// The kinds we accept, as `(apiVersion, kind)`.
const ACCEPTED: [(&str, &str); 4] = [
    ("v1", "Service"),
    ("discovery.k8s.io/v1", "EndpointSlice"),
    ("v1", "Endpoints"),
    ("v1", "Node"),
];

#[derive(Default)]
struct Loader {
    store: Store,
    rejections: Vec<Rejection>,
    /// Where each stored object came from, by its label ("Service ns/name"),
    /// to name both files when a duplicate shows up.
    origins: BTreeMap<String, String>,
}

impl Loader {
    fn reject(
        &mut self,
        source: impl Into<String>,
        object: impl Into<String>,
        field: impl Into<String>,
        reason: impl Into<String>,
    ) {
        self.rejections
            .push(Rejection::new(source, object, field, reason));
    }

    fn load_file(&mut self, path: &Path, format: Format) {
        let source = path.display().to_string();
        match fs::read_to_string(path) {
            Ok(text) => self.load_text(&source, &text, format),
            Err(err) => self.reject(source, "", "", format!("cannot read: {err}")),
        }
    }

    fn load_text(&mut self, source: &str, text: &str, format: Format) {
        match format {
            Format::Json => {
                // An editor may leave the file empty for a moment: that is
                // "no objects", not a syntax error.
                if text.trim().is_empty() {
                    return;
                }
                match serde_json::from_str::<Value>(text) {
                    Ok(value) => self.load_document(source, "document 1", value),
                    Err(err) => self.reject(source, "", "", format!("invalid JSON: {err}")),
                }
            }
            Format::Yaml => {
                for (i, document) in serde_yaml::Deserializer::from_str(text).enumerate() {
                    let label = format!("document {}", i + 1);
                    // Two steps: the YAML value only fails on syntax errors,
                    // after which the parser cannot go on; the conversion to
                    // JSON fails on YAML-only shapes (e.g. non-string keys),
                    // which only spoil this document.
                    let yaml = match serde_yaml::Value::deserialize(document) {
                        Ok(yaml) => yaml,
                        Err(err) => {
                            self.reject(source, label, "", format!("invalid YAML: {err}"));
                            break;
                        }
                    };
                    match serde_json::to_value(yaml) {
                        Ok(value) => self.load_document(source, &label, value),
                        Err(err) => self.reject(
                            source,
                            label,
                            "",
                            format!("not a JSON-compatible document: {err}"),
                        ),
                    }
                }
            }
        }
    }

    /// One document: empty, a `List`, or a single object.
    fn load_document(&mut self, source: &str, label: &str, value: Value) {
        match value {
            Value::Null => {}
            Value::Object(mut list) if is_list(&list) => match list.remove("items") {
                None | Some(Value::Null) => {}
                Some(Value::Array(items)) => {
                    for (i, item) in items.into_iter().enumerate() {
                        self.load_object(source, &format!("{label} items[{i}]"), item);
                    }
                }
                Some(other) => self.reject(
                    source,
                    label,
                    "items",
                    format!("expected a list of objects, found {}", describe(&other)),
                ),
            },
            value => self.load_object(source, label, value),
        }
    }

    fn load_object(&mut self, source: &str, label: &str, value: Value) {
        if !value.is_object() {
            let reason = format!(
                "expected a Kubernetes object (a mapping), found {}",
                describe(&value)
            );
            return self.reject(source, label, "", reason);
        }
        // Owned: `value` is consumed by the typed decoding below.
        let text = |v: Option<&Value>| v.and_then(Value::as_str).unwrap_or("").to_owned();
        let api_version = text(value.get("apiVersion"));
        let kind = text(value.get("kind"));
        let metadata = value.get("metadata");
        let name = text(metadata.and_then(|m| m.get("name")));
        let namespace = match text(metadata.and_then(|m| m.get("namespace"))) {
            ns if ns.is_empty() => DEFAULT_NAMESPACE.to_owned(),
            ns => ns,
        };
        let (api_version, kind, name, namespace) = (
            api_version.as_str(),
            kind.as_str(),
            name.as_str(),
            namespace.as_str(),
        );

        if !ACCEPTED.contains(&(api_version, kind)) {
            // Name the object as precisely as the document allows.
            let object = match (kind.is_empty(), name.is_empty()) {
                (false, false) => format!("{kind} {namespace}/{name}"),
                _ => label.to_owned(),
            };
            let accepted = ACCEPTED.map(|(v, k)| format!("{v} {k}")).join(", ");
            let found = match (api_version, kind) {
                (_, "") => "no kind".to_owned(),
                ("", kind) => format!("kind {kind} without apiVersion"),
                (api_version, kind) => format!("{api_version} {kind}"),
            };
            return self.reject(
                source,
                object,
                "kind",
                format!("unsupported object: {found} (accepted: {accepted})"),
            );
        }
        if name.is_empty() {
            return self.reject(
                source,
                label,
                "metadata.name",
                format!("a {kind} needs a metadata.name"),
            );
        }

        let object_label = if kind == "Node" {
            format!("Node {name}")
        } else {
            format!("{kind} {namespace}/{name}")
        };
        // The first definition wins; a rejected one never got here.
        if let Some(first) = self.origins.get(&object_label) {
            let reason = format!("duplicate: already defined in {first}, which wins");
            return self.reject(source, object_label, "metadata.name", reason);
        }

        let key = ObjectKey::new(namespace, name);
        let store = &mut self.store;
        let stored = match kind {
            "Service" => decode(value).map(|o| {
                store.services.insert(key, with_namespace(o, namespace));
            }),
            "EndpointSlice" => decode(value).map(|o| {
                store.slices.insert(key, with_namespace(o, namespace));
            }),
            "Endpoints" => decode(value).map(|o| {
                store.endpoints.insert(key, with_namespace(o, namespace));
            }),
            _ => decode(value).map(|mut o: Node| {
                // Cluster-scoped: a namespace in the manifest means nothing.
                o.metadata.namespace = None;
                store.nodes.insert(key.name, o);
            }),
        };
        match stored {
            Ok(()) => {
                self.origins.insert(object_label, source.to_owned());
            }
            Err((field, reason)) => self.reject(source, object_label, field, reason),
        }
    }
}

/// Decodes a typed object, naming the field path of a mismatch
/// (`spec.ports[0].port`) instead of serde's bare "invalid type".
fn decode<T: DeserializeOwned>(value: Value) -> Result<T, (String, String)> {
    serde_path_to_error::deserialize(value).map_err(|err| {
        let path = err.path().to_string();
        // The root path prints as "."; a missing top-level field lands there.
        let field = if path == "." { String::new() } else { path };
        (field, err.into_inner().to_string())
    })
}

/// What the API server would have filled in: objects in the store always
/// carry their namespace, like reflector objects do.
fn with_namespace<T: Metadata<Ty = ObjectMeta>>(mut object: T, namespace: &str) -> T {
    object.metadata_mut().namespace = Some(namespace.to_owned());
    object
}

/// `apiVersion: v1, kind: List`, what `kubectl get -o yaml` writes.
fn is_list(object: &serde_json::Map<String, Value>) -> bool {
    object.get("apiVersion").and_then(Value::as_str) == Some("v1")
        && object.get("kind").and_then(Value::as_str) == Some("List")
}

fn describe(value: &Value) -> &'static str {
    match value {
        Value::Null => "nothing",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "a mapping",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes `files` into a fresh directory and loads it.
    fn load(files: &[(&str, &str)]) -> (tempfile::TempDir, Store, Vec<Rejection>) {
        let dir = tempfile::tempdir().unwrap();
        for (name, text) in files {
            fs::write(dir.path().join(name), text).unwrap();
        }
        let (store, rejections) = load_dir(dir.path());
        (dir, store, rejections)
    }

    /// The store's content as sorted "Kind ns/name" labels.
    fn contents(store: &Store) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        out.extend(store.services.keys().map(|k| format!("Service {k}")));
        out.extend(store.slices.keys().map(|k| format!("EndpointSlice {k}")));
        out.extend(store.endpoints.keys().map(|k| format!("Endpoints {k}")));
        out.extend(store.nodes.keys().map(|k| format!("Node {k}")));
        out.sort();
        out
    }

    const SERVICE_WEB: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}\n";

    struct Case {
        name: &'static str,
        files: &'static [(&'static str, &'static str)],
        objects: &'static [&'static str],
        /// `(file, object, field)` of each rejection, in order.
        rejected: &'static [(&'static str, &'static str, &'static str)],
    }

    #[test]
    fn load_dir_cases() {
        let cases = [
            Case {
                name: "multi-document YAML with empty documents",
                files: &[(
                    "all.yaml",
                    "---\napiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\nspec: {clusterIP: 10.96.0.10}\n---\n---\n\
                     apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-abc, namespace: shop}\naddressType: IPv4\n---\n\
                     apiVersion: v1\nkind: Endpoints\nmetadata: {name: legacy}\n---\n\
                     apiVersion: v1\nkind: Node\nmetadata: {name: node-a, namespace: ignored}\n---\n",
                )],
                objects: &["EndpointSlice shop/web-abc", "Endpoints default/legacy", "Node node-a", "Service shop/web"],
                rejected: &[],
            },
            Case {
                name: "JSON object and .yml extension",
                files: &[
                    ("a.json", r#"{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"}, "spec": {"ports": [{"port": 80}]}}"#),
                    ("b.yml", "apiVersion: v1\nkind: Node\nmetadata: {name: n1}\n"),
                ],
                objects: &["Node n1", "Service default/web"],
                rejected: &[],
            },
            Case {
                name: "List in JSON and in YAML",
                files: &[
                    (
                        "list.json",
                        r#"{"apiVersion": "v1", "kind": "List", "items": [
                            {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "a"}},
                            {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "b"}}]}"#,
                    ),
                    (
                        "list.yaml",
                        "apiVersion: v1\nkind: List\nitems:\n- {apiVersion: v1, kind: Endpoints, metadata: {name: a}}\n- {apiVersion: v1, kind: ConfigMap, metadata: {name: c}}\n",
                    ),
                ],
                objects: &["Endpoints default/a", "Service default/a", "Service default/b"],
                rejected: &[("list.yaml", "ConfigMap default/c", "kind")],
            },
            Case {
                name: "unparseable files next to a good one",
                files: &[
                    ("bad.json", "{\"apiVersion\": \"v1\","),
                    ("bad.yaml", "apiVersion: v1\nkind: Service\nmetadata: {name: x\n"),
                    ("good.yaml", SERVICE_WEB),
                ],
                objects: &["Service default/web"],
                rejected: &[("bad.json", "", ""), ("bad.yaml", "document 1", "")],
            },
            Case {
                name: "YAML syntax error keeps the documents before it",
                files: &[(
                    "two.yaml",
                    "apiVersion: v1\nkind: Node\nmetadata: {name: n1}\n---\nkind: [oops\n---\napiVersion: v1\nkind: Node\nmetadata: {name: n3}\n",
                )],
                objects: &["Node n1"],
                rejected: &[("two.yaml", "document 2", "")],
            },
            Case {
                name: "unknown kind and apiVersion, missing kind, not a mapping",
                files: &[(
                    "mixed.yaml",
                    "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: web}\n---\n\
                     apiVersion: discovery.k8s.io/v1beta1\nkind: EndpointSlice\nmetadata: {name: s, namespace: ns}\n---\n\
                     metadata: {name: nokind}\n---\n\
                     - just a list\n---\n",
                )],
                objects: &[],
                rejected: &[
                    ("mixed.yaml", "Deployment default/web", "kind"),
                    ("mixed.yaml", "EndpointSlice ns/s", "kind"),
                    ("mixed.yaml", "document 3", "kind"),
                    ("mixed.yaml", "document 4", ""),
                ],
            },
            Case {
                name: "missing metadata.name",
                files: &[("noname.yaml", "apiVersion: v1\nkind: Service\nmetadata: {namespace: x}\n---\napiVersion: v1\nkind: Service\n")],
                objects: &[],
                rejected: &[("noname.yaml", "document 1", "metadata.name"), ("noname.yaml", "document 2", "metadata.name")],
            },
            Case {
                name: "type mismatch names the field path, the other object still loads",
                files: &[(
                    "web.yaml",
                    "apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec:\n  ports:\n  - {port: 80}\n  - {port: eighty}\n---\n\
                     apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: s}\naddressType: IPv4\nendpoints: [{addresses: [10.0.0.1], conditions: {ready: maybe}}]\n---\n\
                     apiVersion: v1\nkind: Node\nmetadata: {name: n, labels: [a]}\n---\n"
                    ,
                )],
                objects: &[],
                rejected: &[
                    ("web.yaml", "Service default/web", "spec.ports[1].port"),
                    ("web.yaml", "EndpointSlice default/s", "endpoints[0].conditions.ready"),
                    ("web.yaml", "Node n", "metadata.labels"),
                ],
            },
            Case {
                name: "duplicates: first file wins, across files and within one",
                files: &[
                    ("a.yaml", SERVICE_WEB),
                    ("b.yaml", "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: default}\n---\napiVersion: v1\nkind: Endpoints\nmetadata: {name: web}\n---\napiVersion: v1\nkind: Endpoints\nmetadata: {name: web}\n"),
                ],
                objects: &["Endpoints default/web", "Service default/web"],
                rejected: &[("b.yaml", "Service default/web", "metadata.name"), ("b.yaml", "Endpoints default/web", "metadata.name")],
            },
            Case {
                name: "hidden, backup, autosave and foreign files are not read",
                files: &[
                    (".web.yaml.swp", "garbage: ["),
                    (".hidden.yaml", "garbage: ["),
                    ("web.yaml~", "garbage: ["),
                    ("#web.yaml#", "garbage: ["),
                    ("README.md", "garbage: ["),
                    ("empty.json", "  \n"),
                    ("empty.yaml", ""),
                    ("WEB.YAML", SERVICE_WEB),
                ],
                objects: &["Service default/web"],
                rejected: &[],
            },
        ];

        for case in cases {
            let (dir, store, rejections) = load(case.files);
            assert_eq!(contents(&store), case.objects, "{}: objects", case.name);
            let got: Vec<(String, &str, &str)> = rejections
                .iter()
                .map(|r| {
                    let file = Path::new(&r.source).strip_prefix(dir.path()).unwrap();
                    (
                        file.display().to_string(),
                        r.object.as_str(),
                        r.field.as_str(),
                    )
                })
                .collect();
            let want: Vec<(String, &str, &str)> = case
                .rejected
                .iter()
                .map(|(f, o, d)| (f.to_string(), *o, *d))
                .collect();
            assert_eq!(got, want, "{}: rejections {rejections:#?}", case.name);
        }
    }

    #[test]
    fn messages() {
        let (dir, _, rejections) = load(&[
            ("a.yaml", SERVICE_WEB),
            (
                "b.yaml",
                "apiVersion: v1\nkind: Service\nmetadata: {name: api}\nspec: {ports: [{port: 80}, {port: eighty}]}\n",
            ),
            ("c.yaml", SERVICE_WEB),
            ("d.yaml", "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\n"),
        ]);
        let file = |name: &str| dir.path().join(name).display().to_string();
        let got: Vec<String> = rejections.iter().map(ToString::to_string).collect();
        assert_eq!(
            got,
            [
                format!(
                    "{}: Service default/api: spec.ports[1].port: invalid type: string \"eighty\", expected i32",
                    file("b.yaml")
                ),
                format!(
                    "{}: Service default/web: metadata.name: duplicate: already defined in {}, which wins",
                    file("c.yaml"),
                    file("a.yaml")
                ),
                format!(
                    "{}: Deployment default/d: kind: unsupported object: apps/v1 Deployment \
                     (accepted: v1 Service, discovery.k8s.io/v1 EndpointSlice, v1 Endpoints, v1 Node)",
                    file("d.yaml")
                ),
            ]
        );
    }

    #[test]
    fn loaded_objects_are_complete_and_namespaced() {
        let (_dir, store, rejections) = load(&[(
            "web.yaml",
            "apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec:\n  clusterIP: 10.96.0.10\n  ports: [{name: http, port: 80, targetPort: web}]\n",
        )]);
        assert!(rejections.is_empty(), "{rejections:?}");
        let svc = &store.services[&ObjectKey::new("default", "web")];
        assert_eq!(svc.metadata.namespace.as_deref(), Some("default"));
        let spec = svc.spec.as_ref().unwrap();
        assert_eq!(spec.cluster_ip.as_deref(), Some("10.96.0.10"));
        assert_eq!(
            spec.ports.as_ref().unwrap()[0].name.as_deref(),
            Some("http")
        );
    }

    #[test]
    fn missing_directory() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope");
        let (store, rejections) = load_dir(&missing);
        assert_eq!(store, Store::default());
        assert_eq!(rejections.len(), 1);
        assert_eq!(rejections[0].source, missing.display().to_string());
    }

    #[test]
    fn format_of_path() {
        let cases = [
            ("a.yaml", Some(Format::Yaml)),
            ("a.YML", Some(Format::Yaml)),
            ("a.json", Some(Format::Json)),
            ("dir/a.json", Some(Format::Json)),
            ("a.yaml~", None),
            (".a.yaml", None),
            (".a.yaml.swp", None),
            ("#a.yaml#", None),
            ("a.txt", None),
            ("yaml", None),
        ];
        for (path, want) in cases {
            assert_eq!(Format::of_path(Path::new(path)), want, "{path}");
        }
    }

    #[test]
    fn load_str_yaml() {
        let (store, rejections) = load_str("inline", SERVICE_WEB, Format::Yaml);
        assert!(rejections.is_empty());
        assert_eq!(contents(&store), ["Service default/web"]);
    }
}
