//! The object store: one global resourceVersion counter, objects per kind,
//! an event history per kind (for watch resumption and consistent paginated
//! lists), and the open watches to notify.

use std::{
    borrow::Cow,
    collections::{BTreeMap, VecDeque},
    sync::Arc,
    time::{SystemTime, UNIX_EPOCH},
};

use serde_json::{json, Map, Value};
use tokio::sync::mpsc::UnboundedSender;

use super::{
    selector::{FieldSelector, LabelSelector},
    Kind,
};

/// The first resourceVersion the store hands out (an empty store lists at
/// this version).
const INITIAL_RV: u64 = 1;

/// Watch event types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One change, as recorded in the history.
#[derive(Debug)]
pub struct Ev {
    pub rv: u64,
    pub etype: EventType,
    pub key: String,
    /// The object as sent in the event (kind/apiVersion set). For DELETED,
    /// the last state with the deletion's resourceVersion.
    pub object: Value,
    /// The stored object before the change (None for ADDED).
    pub prev: Option<Value>,
}

/// What an open watch receives from the store, in order.
#[derive(Debug, Clone)]
pub enum Msg {
    Event(Arc<Ev>),
    /// Everything up to this resourceVersion has been delivered.
    Bookmark(u64),
    /// Send a 410 Expired ERROR and end the stream.
    Expire,
}

/// Which objects a list or watch wants.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    pub namespace: Option<String>,
    pub labels: LabelSelector,
    pub fields: FieldSelector,
}

impl Filter {
    pub fn matches(&self, obj: &Value) -> bool {
        if let Some(ns) = &self.namespace {
            let namespace = obj.get("metadata").and_then(|m| m.get("namespace"));
            if namespace.and_then(Value::as_str) != Some(ns.as_str()) {
                return false;
            }
        }
        self.labels.matches(obj) && self.fields.matches(obj)
    }

    pub fn is_selective(&self) -> bool {
        !self.labels.is_empty() || !self.fields.is_empty()
    }

    /// The event a watch with this filter sees for `ev`, as kube-apiserver's
    /// cacher computes it: an object that stops matching is DELETED (its
    /// previous state, with the new resourceVersion), one that starts
    /// matching is ADDED.
    pub fn convert(&self, ev: &Ev) -> Option<(EventType, Value)> {
        let old = ev.prev.as_ref().is_some_and(|p| self.matches(p));
        match ev.etype {
            EventType::Deleted => old.then(|| (EventType::Deleted, ev.object.clone())),
            EventType::Added => self
                .matches(&ev.object)
                .then(|| (EventType::Added, ev.object.clone())),
            EventType::Modified => match (old, self.matches(&ev.object)) {
                (true, true) => Some((EventType::Modified, ev.object.clone())),
                (false, true) => Some((EventType::Added, ev.object.clone())),
                (true, false) => {
                    let mut o = ev.prev.clone().expect("old matched");
                    set_rv(&mut o, ev.rv);
                    Some((EventType::Deleted, o))
                }
                (false, false) => None,
            },
        }
    }
}

pub fn set_rv(obj: &mut Value, rv: u64) {
    if let Some(m) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
        m.insert("resourceVersion".into(), Value::String(rv.to_string()));
    }
}

/// A stored object and its text as a list item, written once when it is
/// stored, as kube-apiserver's watch cache encodes an object once for all
/// its readers (`cachingObject`): a list page is then a copy of texts. The
/// fixture runs on the agent's cores, where a real API server does not, and
/// writing each object of a 10 000-object list anew was most of its cost.
pub struct StoredObject {
    value: Value,
    list_item: Box<[u8]>,
}

impl StoredObject {
    pub fn new(value: Value) -> StoredObject {
        let list_item = serde_json::to_vec(&ListItem(&value))
            .expect("JSON")
            .into_boxed_slice();
        StoredObject { value, list_item }
    }

    /// The object as a list's item (without `kind` and `apiVersion`).
    pub fn list_item(&self) -> &[u8] {
        &self.list_item
    }

    pub fn into_value(self) -> Value {
        self.value
    }
}

impl std::ops::Deref for StoredObject {
    type Target = Value;
    fn deref(&self) -> &Value {
        &self.value
    }
}

/// An object as a list item: kube-apiserver's list items carry no
/// kind/apiVersion.
struct ListItem<'a>(&'a Value);

impl serde::Serialize for ListItem<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap as _;
        let Value::Object(fields) = self.0 else {
            return self.0.serialize(s);
        };
        let kept = || {
            fields
                .iter()
                .filter(|(k, _)| k.as_str() != "kind" && k.as_str() != "apiVersion")
        };
        let mut map = s.serialize_map(Some(kept().count()))?;
        for (k, v) in kept() {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

pub struct KindState {
    /// Shared, so that a list's snapshot copies pointers, not objects.
    pub objects: BTreeMap<String, Arc<StoredObject>>,
    pub history: VecDeque<Arc<Ev>>,
    /// A watch (or consistent read) from resourceVersion N is possible iff
    /// `N >= floor`: every event after `floor` is in `history`.
    pub floor: u64,
}

pub struct Watcher {
    pub kind: Kind,
    pub bookmarks: bool,
    pub tx: UnboundedSender<Msg>,
}

pub struct Store {
    pub rv: u64,
    pub kinds: [KindState; 4],
    pub watchers: Vec<Watcher>,
    pub history_limit: usize,
    uid_counter: u64,
}

/// The result of looking up a consistent snapshot.
pub enum Snapshot<'a> {
    /// Borrowed when nothing of the kind changed since: the pages of a
    /// list taken while nothing changes copy no map.
    Ok(Cow<'a, BTreeMap<String, Arc<StoredObject>>>),
    /// Older than the compacted history.
    Expired,
    /// Newer than the current resourceVersion.
    TooLarge,
}

/// The parts of an object that `apply` compares to detect a no-op update.
fn comparable(obj: &Value) -> Value {
    let mut o = obj.clone();
    if let Some(m) = o.get_mut("metadata").and_then(Value::as_object_mut) {
        for k in [
            "resourceVersion",
            "uid",
            "creationTimestamp",
            "generation",
            "managedFields",
            "selfLink",
        ] {
            m.remove(k);
        }
    }
    o
}

/// RFC 3339 UTC timestamp, second precision, as Kubernetes writes them.
pub fn now_rfc3339() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0) as i64;
    let (days, rem) = (secs.div_euclid(86400), secs.rem_euclid(86400));
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

impl Store {
    pub fn new() -> Self {
        let ks = || KindState {
            objects: BTreeMap::new(),
            history: VecDeque::new(),
            floor: INITIAL_RV,
        };
        Self {
            rv: INITIAL_RV,
            kinds: [ks(), ks(), ks(), ks()],
            watchers: Vec::new(),
            history_limit: 10_000,
            uid_counter: 0,
        }
    }

    pub fn kind(&self, kind: Kind) -> &KindState {
        &self.kinds[kind.index()]
    }

    fn kind_mut(&mut self, kind: Kind) -> &mut KindState {
        &mut self.kinds[kind.index()]
    }

    fn new_uid(&mut self, kind: Kind) -> String {
        self.uid_counter += 1;
        let salt = (std::process::id() as u64) << 16 ^ (kind.index() as u64);
        format!(
            "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
            (salt >> 16) as u32,
            salt as u16,
            kind.index(),
            (self.uid_counter >> 48) & 0xfff,
            self.uid_counter & 0xffff_ffff_ffff
        )
    }

    /// Creates or updates an object; returns the stored object (unchanged,
    /// without a new resourceVersion, if the update changes nothing).
    pub fn apply(&mut self, obj: Value) -> Result<Value, String> {
        let Value::Object(mut map) = obj else {
            return Err("an object must be a JSON object".into());
        };
        let api_version = map.get("apiVersion").and_then(Value::as_str).unwrap_or("");
        let kind_s = map.get("kind").and_then(Value::as_str).unwrap_or("");
        let kind = Kind::from_type(api_version, kind_s).ok_or_else(|| {
            format!("unsupported object apiVersion={api_version:?} kind={kind_s:?}")
        })?;
        map.insert("apiVersion".into(), kind.api_version().into());
        map.insert("kind".into(), kind.kind().into());
        let meta = map
            .entry("metadata")
            .or_insert_with(|| Value::Object(Map::new()));
        let Value::Object(meta) = meta else {
            return Err("metadata must be an object".into());
        };
        let name = meta
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or("metadata.name is required")?
            .to_string();
        let ns = if kind.namespaced() {
            let ns = meta
                .get("namespace")
                .and_then(Value::as_str)
                .filter(|n| !n.is_empty())
                .unwrap_or("default")
                .to_string();
            meta.insert("namespace".into(), ns.clone().into());
            Some(ns)
        } else {
            meta.remove("namespace");
            None
        };
        let key = object_key(ns.as_deref(), &name);
        let existing = self.kind(kind).objects.get(&key).map(|o| (**o).clone());
        let mut obj = Value::Object(map);
        if let Some(old) = &existing {
            if comparable(old) == comparable(&obj) {
                return Ok(old.clone());
            }
        }
        let uid = match &existing {
            Some(old) => old.pointer("/metadata/uid").cloned().unwrap(),
            None => Value::String(self.new_uid(kind)),
        };
        let created = match &existing {
            Some(old) => old.pointer("/metadata/creationTimestamp").cloned().unwrap(),
            None => Value::String(now_rfc3339()),
        };
        self.rv += 1;
        let rv = self.rv;
        {
            let m = obj["metadata"].as_object_mut().unwrap();
            m.insert("uid".into(), uid);
            m.insert("creationTimestamp".into(), created);
            m.remove("managedFields");
            m.remove("selfLink");
        }
        set_rv(&mut obj, rv);
        self.kind_mut(kind)
            .objects
            .insert(key.clone(), Arc::new(StoredObject::new(obj.clone())));
        let etype = if existing.is_some() {
            EventType::Modified
        } else {
            EventType::Added
        };
        self.record(
            kind,
            Ev {
                rv,
                etype,
                key,
                object: obj.clone(),
                prev: existing,
            },
        );
        Ok(obj)
    }

    /// Deletes an object; returns its last state (with the deletion's
    /// resourceVersion), or None if there was no such object.
    pub fn delete(&mut self, kind: Kind, namespace: &str, name: &str) -> Option<Value> {
        let ns = kind.namespaced().then_some(if namespace.is_empty() {
            "default"
        } else {
            namespace
        });
        let key = object_key(ns, name);
        let old = self.kind_mut(kind).objects.remove(&key)?;
        let old =
            Arc::try_unwrap(old).map_or_else(|shared| (**shared).clone(), StoredObject::into_value);
        self.rv += 1;
        let rv = self.rv;
        let mut object = old.clone();
        set_rv(&mut object, rv);
        self.record(
            kind,
            Ev {
                rv,
                etype: EventType::Deleted,
                key,
                object: object.clone(),
                prev: Some(old),
            },
        );
        Some(object)
    }

    fn record(&mut self, kind: Kind, ev: Ev) {
        let ev = Arc::new(ev);
        let limit = self.history_limit.max(1);
        let ks = self.kind_mut(kind);
        ks.history.push_back(ev.clone());
        while ks.history.len() > limit {
            let dropped = ks.history.pop_front().unwrap();
            ks.floor = dropped.rv;
        }
        self.watchers
            .retain(|w| w.kind != kind || w.tx.send(Msg::Event(ev.clone())).is_ok());
    }

    /// Drops all history: bumps the resourceVersion (so that every version
    /// handed out so far is too old) and makes it the floor of every kind.
    pub fn compact(&mut self) {
        self.rv += 1;
        let rv = self.rv;
        for ks in &mut self.kinds {
            ks.history.clear();
            ks.floor = rv;
        }
    }

    /// Sends `msg` to every open watch (of `kind`, or all); drops the
    /// watches that are gone.
    pub fn broadcast(&mut self, kind: Option<Kind>, msg: impl Fn(&Watcher) -> Option<Msg>) {
        self.watchers.retain(|w| {
            if kind.is_some_and(|k| k != w.kind) {
                return true;
            }
            match msg(w) {
                Some(m) => w.tx.send(m).is_ok(),
                None => !w.tx.is_closed(),
            }
        });
    }

    /// The objects of `kind` as they were at resourceVersion `rv`.
    pub fn snapshot(&self, kind: Kind, rv: u64) -> Snapshot<'_> {
        let ks = self.kind(kind);
        if rv > self.rv {
            return Snapshot::TooLarge;
        }
        if rv < ks.floor {
            return Snapshot::Expired;
        }
        if ks.history.back().is_none_or(|ev| ev.rv <= rv) {
            return Snapshot::Ok(Cow::Borrowed(&ks.objects));
        }
        let mut objects = ks.objects.clone();
        for ev in ks.history.iter().rev() {
            if ev.rv <= rv {
                break;
            }
            match ev.etype {
                EventType::Added => {
                    objects.remove(&ev.key);
                }
                EventType::Modified | EventType::Deleted => {
                    objects.insert(
                        ev.key.clone(),
                        Arc::new(StoredObject::new(ev.prev.clone().expect("prev state"))),
                    );
                }
            }
        }
        Snapshot::Ok(Cow::Owned(objects))
    }

    /// History events of `kind` after `rv`, or None if `rv` is older than
    /// the compacted history.
    pub fn events_since(&self, kind: Kind, rv: u64) -> Option<Vec<Arc<Ev>>> {
        let ks = self.kind(kind);
        if rv < ks.floor {
            return None;
        }
        Some(ks.history.iter().filter(|e| e.rv > rv).cloned().collect())
    }
}

/// The storage key: `namespace/name` or `name`, ordered like etcd keys.
pub fn object_key(namespace: Option<&str>, name: &str) -> String {
    match namespace {
        Some(ns) => format!("{ns}/{name}"),
        None => name.to_string(),
    }
}

/// A `BOOKMARK` event object.
pub fn bookmark_object(kind: Kind, rv: u64, initial_events_end: bool) -> Value {
    let mut meta = json!({"resourceVersion": rv.to_string(), "creationTimestamp": null});
    if initial_events_end {
        meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    json!({"kind": kind.kind(), "apiVersion": kind.api_version(), "metadata": meta})
}
