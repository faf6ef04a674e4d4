//! Standalone mode input: a directory of Kubernetes manifests.
//!
//! Bad input never aborts a load: each problem becomes a [`Rejection`] and
//! only the offending object (or file, when it does not parse) is skipped,
//! so one typo cannot take every other Service down with it.
//!
//! [`ManifestDir`] keeps what each file decoded to, keyed by the file's
//! length, times and inode: a change re-reads only the files that changed
//! and replaces only their objects in the [`Store`], which is what keeps a
//! one-endpoint change cheap next to a large file of other Services.
use std::{
    collections::{BTreeMap, BTreeSet},
    ffi::{OsStr, OsString},
    fs,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use rustc_hash::{FxHashMap, FxHashSet};

use k8s_openapi::{
    api::{
        core::v1::{Endpoints, Node, Service},
        discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
    Metadata,
};
use serde::{de::DeserializeOwned, Deserialize};
use serde_json::{value::RawValue, Value};

use crate::input::{
    store::{Changes, ObjectKey, Rejection, Slice, Store, StoredService},
    wire::WireSlice,
};

/// The namespace of a namespaced object whose manifest does not say.
pub const DEFAULT_NAMESPACE: &str = "default";

/// Files larger than this are not read (`--max-manifest-bytes`): decoding
/// one peaks at about three times its size. 100 000 Services with ten
/// endpoints each, as compact JSON, take about half of it.
pub const DEFAULT_MAX_FILE_BYTES: u64 = 256 << 20;

/// YAML flow collections (`[`, `{`) nested deeper than this are not
/// parsed: the YAML parser takes time quadratic in their depth (a 200 KB
/// file of them took half a minute), and the decoder would give up at 128
/// levels anyway. Counted before parsing without regard to quoting (so
/// the margin is wide): a guard against accidents such as a generator gone
/// wrong, not a sandbox; whoever can write the directory can delete every
/// Service anyway.
const MAX_YAML_FLOW_DEPTH: usize = 1000;

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
    let mut manifests = ManifestDir::new(dir);
    manifests.refresh();
    let rejections = manifests.rejections();
    (manifests.objects.store, rejections)
}

/// Loads the manifests in `text`, reporting problems against `source`.
pub fn load_str(source: &str, text: &str, format: Format) -> (Store, Vec<Rejection>) {
    let mut objects = Objects::default();
    let mut changes = Changes::default();
    objects.replace_file(
        OsString::from(source),
        Some(parse_file(source, text, format)),
        &mut changes,
    );
    objects.update_rejections();
    let rejections = objects.rejections().cloned().collect();
    (objects.store, rejections)
}

/// What identifies a version of a file without reading it. A rename into
/// place brings a new inode; an edit in place moves the change time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
    ino: u64,
    dev: u64,
}

/// File times move in clock ticks (at most 10 ms, HZ=100), so two writes of
/// the same length within one tick leave the same stamp. A file changed
/// that close to when it was read is read again (git's "racy" entries);
/// the margin is several ticks, and short enough that a large file copied
/// in just before the agent started is not read twice.
const RACY_MARGIN: Duration = Duration::from_millis(100);

impl Stamp {
    /// Whether the file may have changed since `read_at` without its stamp
    /// showing it.
    fn racy(&self, read_at: SystemTime) -> bool {
        let read_at = read_at
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .saturating_sub(RACY_MARGIN);
        let as_duration = |(s, ns): (i64, i64)| {
            Duration::new(
                u64::try_from(s).unwrap_or(0),
                u32::try_from(ns).unwrap_or(0),
            )
        };
        as_duration(self.ctime) >= read_at || as_duration(self.mtime) >= read_at
    }

    fn of(meta: &fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        Stamp {
            len: meta.len(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
            ino: meta.ino(),
            dev: meta.dev(),
        }
    }
}

/// A manifests directory and what its files decoded to.
pub struct ManifestDir {
    dir: PathBuf,
    /// The stamp each cached file had, and when it was read.
    stamps: BTreeMap<OsString, (Stamp, SystemTime)>,
    /// The directory itself could not be listed.
    dir_error: Option<Rejection>,
    /// Files that are there but could not be read (or stat'ed), and
    /// listed entries that are not regular files, by name. A file that
    /// could not be read keeps what it last decoded to: a read error (too
    /// many open files, say) says nothing about its content.
    unread: BTreeMap<OsString, Rejection>,
    /// Files larger than this are rejected unread.
    max_file_bytes: u64,
    objects: Objects,
    /// Moves whenever the problems changed.
    rejections_version: u64,
}

impl ManifestDir {
    pub fn new(dir: &Path) -> Self {
        ManifestDir {
            dir: dir.to_owned(),
            stamps: BTreeMap::new(),
            dir_error: None,
            unread: BTreeMap::new(),
            max_file_bytes: DEFAULT_MAX_FILE_BYTES,
            objects: Objects::default(),
            rejections_version: 0,
        }
    }

    pub fn with_max_file_bytes(mut self, max: u64) -> Self {
        self.max_file_bytes = max;
        self
    }

    /// The objects as of the last [`refresh`](Self::refresh).
    pub fn store(&self) -> &Store {
        &self.objects.store
    }

    /// Every problem found, in file name order, then document order.
    pub fn rejections(&self) -> Vec<Rejection> {
        self.rejections_iter().cloned().collect()
    }

    /// [`rejections`](Self::rejections) without copying them.
    pub fn rejections_iter(&self) -> impl Iterator<Item = &Rejection> {
        let files = self.objects.rejections();
        self.dir_error
            .iter()
            .chain(self.unread.values())
            .chain(files)
    }

    /// Moves whenever [`rejections`](Self::rejections) changed: a caller
    /// that saw this version need not look at them again.
    pub fn rejections_version(&self) -> u64 {
        self.rejections_version
    }

    /// Names the file of each rejected object that a later layer reported
    /// (translation says "translate"): the file that defines it now. Not
    /// for this directory's own rejections, which name their file.
    pub fn name_files(&self, rejections: &mut [Rejection]) {
        for r in rejections {
            if let Some(source) = self.objects.source_of(&r.object) {
                if r.source != source {
                    r.source = source.to_owned();
                }
            }
        }
    }

    /// Re-reads the files that appeared, changed or went away since the last
    /// call, and updates the store with their objects only. What cannot be
    /// read keeps its last good objects: a directory that cannot be listed
    /// keeps every file's, a file that cannot be read keeps its own.
    pub fn refresh(&mut self) -> Changes {
        let mut changes = Changes::default();
        let listed = match manifest_files(&self.dir) {
            Ok(files) => files,
            Err(err) => {
                let error = Rejection::new(
                    self.dir.display().to_string(),
                    "",
                    "",
                    format!(
                        "cannot read the manifests directory: {err}; \
                         its Services stay as last read"
                    ),
                );
                if self.dir_error.as_ref() != Some(&error) {
                    self.dir_error = Some(error);
                    self.rejections_version += 1;
                }
                return changes;
            }
        };
        let listable_again = self.dir_error.take().is_some();
        let names: BTreeSet<&OsString> = listed.iter().map(|(name, ..)| name).collect();
        let gone: Vec<OsString> = self
            .stamps
            .keys()
            .filter(|name| !names.contains(name))
            .cloned()
            .collect();
        let unread_before = std::mem::take(&mut self.unread);
        for name in gone {
            self.stamps.remove(&name);
            self.objects.replace_file(name, None, &mut changes);
        }
        for (name, path, entry) in listed {
            let source = path.display().to_string();
            let (format, stamp) = match entry {
                Entry::File(format, stamp) => (format, stamp),
                Entry::Unreadable(err) => {
                    let reason = format!("cannot read: {err}; its objects stay as last read");
                    self.unread
                        .insert(name, Rejection::new(source, "", "", reason));
                    continue;
                }
                Entry::NotAFile(what) => {
                    // Not a manifest: whatever a file of that name held goes.
                    if self.stamps.remove(&name).is_some() {
                        self.objects.replace_file(name.clone(), None, &mut changes);
                    }
                    let reason = format!("not a regular file ({what}): skipped");
                    self.unread
                        .insert(name, Rejection::new(source, "", "", reason));
                    continue;
                }
            };
            if let Some((cached, read_at)) = self.stamps.get(&name) {
                if *cached == stamp && !stamp.racy(*read_at) {
                    continue;
                }
            }
            let read_at = SystemTime::now();
            let parsed = match read_capped(&path, self.max_file_bytes) {
                Ok(Some(text)) => parse_file(&source, &text, format),
                Ok(None) => {
                    let mut file = ParsedFile::new(&source);
                    file.reject(
                        "",
                        "",
                        format!(
                            "larger than {} bytes (--max-manifest-bytes): not read",
                            self.max_file_bytes
                        ),
                    );
                    file
                }
                Err(err) if err.kind() == std::io::ErrorKind::InvalidData => {
                    ParsedFile::unreadable(&source, err)
                }
                Err(err) => {
                    // Not stamped: read again on the next refresh.
                    let reason = format!("cannot read: {err}; its objects stay as last read");
                    self.unread
                        .insert(name, Rejection::new(source, "", "", reason));
                    continue;
                }
            };
            // Stamped as listed: a write after the listing shows up as a
            // change on the next refresh instead of being missed.
            self.stamps.insert(name.clone(), (stamp, read_at));
            self.objects.replace_file(name, Some(parsed), &mut changes);
        }
        let files_changed = self.objects.update_rejections();
        if files_changed || listable_again || self.unread != unread_before {
            self.rejections_version += 1;
        }
        changes
    }
}

/// The text of `path`, or `None` when it is longer than `max` bytes (also
/// when it grew past that since it was listed).
fn read_capped(path: &Path, max: u64) -> std::io::Result<Option<String>> {
    use std::io::Read as _;
    let mut text = String::new();
    fs::File::open(path)?
        .take(max.saturating_add(1))
        .read_to_string(&mut text)?;
    Ok((text.len() as u64 <= max).then_some(text))
}

/// What a listed name is.
enum Entry {
    /// A manifest file (a symlink followed), with its stamp.
    File(Format, Stamp),
    /// There, but its type cannot be told (a symlink loop, a permission).
    Unreadable(std::io::Error),
    /// A FIFO, socket or device: reading it could block or never end.
    NotAFile(&'static str),
}

/// The manifest files of `dir`, sorted by name. Symlinks are followed, so a
/// ConfigMap volume (whose files are links into a hidden `..data`) works.
fn manifest_files(dir: &Path) -> std::io::Result<Vec<(OsString, PathBuf, Entry)>> {
    use std::os::unix::fs::FileTypeExt;
    let mut files = Vec::new();
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        let Some(format) = Format::of_path(&path) else {
            continue;
        };
        let name = path.file_name().unwrap_or_default().to_owned();
        let entry = match fs::metadata(&path) {
            Ok(meta) if meta.is_file() => Entry::File(format, Stamp::of(&meta)),
            // Not read recursively, as documented.
            Ok(meta) if meta.is_dir() => continue,
            Ok(meta) => {
                let t = meta.file_type();
                Entry::NotAFile(if t.is_fifo() {
                    "a FIFO"
                } else if t.is_socket() {
                    "a socket"
                } else {
                    "a device"
                })
            }
            // A dangling link is no file, like a ConfigMap volume's link
            // for a moment during an update: skipped.
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => continue,
            Err(err) => Entry::Unreadable(err),
        };
        files.push((name, path, entry));
    }
    files.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(files)
}

/// Lists shorter than this are decoded on one thread: starting threads
/// costs more than it saves.
const PARALLEL_ITEMS: usize = 512;

/// The kinds we accept, as `(apiVersion, kind)`.
const ACCEPTED: [(&str, &str); 4] = [
    ("v1", "Service"),
    ("discovery.k8s.io/v1", "EndpointSlice"),
    ("v1", "Endpoints"),
    ("v1", "Node"),
];

/// The kinds of object the store holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Service,
    Slice,
    Endpoints,
    Node,
}

/// One decoded object, with its key in the store (a Node's namespace is "").
#[derive(Clone, Debug, PartialEq)]
enum Object {
    Service(Box<StoredService>),
    Slice(Box<Slice>),
    Endpoints(Box<Endpoints>),
    Node(Box<Node>),
}

impl Object {
    fn put(self, store: &mut Store, key: &ObjectKey) {
        let key = key.clone();
        match self {
            Object::Service(o) => {
                store.services.insert(key, o);
            }
            Object::Slice(o) => {
                store.slices.insert(key, *o);
            }
            Object::Endpoints(o) => {
                store.endpoints.insert(key, *o);
            }
            Object::Node(o) => {
                store.nodes.insert(key.name.to_string(), *o);
            }
        }
    }

    fn take(store: &mut Store, kind: Kind, key: &ObjectKey) -> Option<Object> {
        Some(match kind {
            Kind::Service => Object::Service(store.services.remove(key)?),
            Kind::Slice => Object::Slice(Box::new(store.slices.remove(key)?)),
            Kind::Endpoints => Object::Endpoints(Box::new(store.endpoints.remove(key)?)),
            Kind::Node => Object::Node(Box::new(store.nodes.remove(&*key.name)?)),
        })
    }
}

impl Changes {
    fn note(&mut self, kind: Kind, key: &ObjectKey) {
        match kind {
            Kind::Service => self.services.insert(key.clone()),
            Kind::Slice => self.slices.insert(key.clone()),
            Kind::Endpoints => self.endpoints.insert(key.clone()),
            Kind::Node => self.nodes.insert(key.name.to_string()),
        };
    }
}

/// One entry of a file's outcome, in document order. Kept for every
/// object of every file, so the rare cases are boxed: 64 bytes an item,
/// not 104.
#[derive(Debug)]
enum Item {
    /// Reported as it is (syntax, unknown kind, no name).
    Rejected(Box<Rejection>),
    /// An object named `label` ("Service ns/name"): `Ok` when it decoded
    /// (the object went to the store or waits as a duplicate), else the
    /// field and reason. Whether it is a duplicate depends on the other
    /// files, so its rejection is worked out in [`Objects::rejections`].
    Object {
        /// Shared with the indexes of [`Objects`], which key by it.
        label: Arc<str>,
        kind: Kind,
        key: ObjectKey,
        decoded: Result<(), Box<(String, String)>>,
    },
}

const _: () = assert!(std::mem::size_of::<Item>() <= 64);

/// What one file decoded to.
#[derive(Debug, Default)]
struct ParsedFile {
    source: String,
    items: Vec<Item>,
    /// The decoded objects, by their index in `items`.
    objects: Vec<(usize, Object)>,
    /// One string for each namespace, which every key in it shares.
    namespaces: FxHashSet<Arc<str>>,
}

impl ParsedFile {
    fn new(source: &str) -> Self {
        ParsedFile {
            source: source.to_owned(),
            ..Default::default()
        }
    }

    fn unreadable(source: &str, err: std::io::Error) -> Self {
        let mut file = ParsedFile::new(source);
        file.reject("", "", format!("cannot read: {err}"));
        file
    }

    fn reject(
        &mut self,
        object: impl Into<String>,
        field: impl Into<String>,
        reason: impl Into<String>,
    ) {
        let rejection = Rejection::new(self.source.clone(), object, field, reason);
        self.items.push(Item::Rejected(Box::new(rejection)));
    }
}

/// Where a definition is: file name, then index among the file's items.
/// The name is shared by every definition of the file.
type Position = (Arc<OsStr>, usize);

/// The objects of every file, and which definition of each wins.
#[derive(Default)]
struct Objects {
    store: Store,
    /// Per file, in name order: its source (path) and items.
    files: BTreeMap<OsString, (String, Vec<Item>)>,
    /// The definition each stored object came from, by label. Fx-hashed,
    /// as the other two: labels come from the operator's own files, and
    /// SipHash over every label was a tenth of reading 20 000 objects.
    winners: FxHashMap<Arc<str>, Position>,
    /// Decoded definitions that lost to an earlier one, kept so that one
    /// takes over when the winner goes away without re-reading its file.
    shadowed: FxHashMap<Arc<str>, BTreeMap<Position, Object>>,
    /// The files with an object of this label that did not decode: what
    /// they report depends on whether an earlier definition wins.
    failed: FxHashMap<Arc<str>, BTreeSet<OsString>>,
    /// Each file's problems as last worked out (files without any left
    /// out), so that a change elsewhere costs nothing here.
    file_rejections: BTreeMap<OsString, Vec<Rejection>>,
    /// Files whose problems may have changed since.
    dirty: BTreeSet<OsString>,
}

impl Objects {
    /// Replaces the objects of file `name` by `parsed` (`None`: the file is
    /// gone), keeping "the first definition in file name order wins".
    fn replace_file(&mut self, name: OsString, parsed: Option<ParsedFile>, changes: &mut Changes) {
        // Every label this file defined or defines now, to elect again.
        let mut contested: BTreeMap<Arc<str>, (Kind, ObjectKey)> = BTreeMap::new();
        let file: Arc<OsStr> = name.as_os_str().into();
        self.dirty.insert(name.clone());
        if let Some((_, items)) = self.files.remove(&name) {
            for (i, item) in items.into_iter().enumerate() {
                let Item::Object {
                    label,
                    kind,
                    key,
                    decoded,
                } = item
                else {
                    continue;
                };
                if decoded.is_err() {
                    self.unfail(&label, &name);
                    continue;
                }
                let pos = (file.clone(), i);
                if self.winners.get(&label) == Some(&pos) {
                    // Its object stays in the store until `elect` knows
                    // what replaces it: unchanged objects are no change.
                    self.winners.remove(&label);
                } else if let Some(defs) = self.shadowed.get_mut(&label) {
                    defs.remove(&pos);
                    if defs.is_empty() {
                        self.shadowed.remove(&label);
                    }
                }
                contested.insert(label, (kind, key));
            }
        }
        if let Some(parsed) = parsed {
            let ParsedFile {
                source,
                items,
                objects,
                ..
            } = parsed;
            for (i, object) in objects {
                let Item::Object {
                    label, kind, key, ..
                } = &items[i]
                else {
                    continue;
                };
                // Every object of a first read, and any new one: nothing
                // defines its label yet, so this definition wins without an
                // election (the store holds an object exactly when its
                // label has a winner). A tenth of a 20 000-object first
                // sync went through `shadowed` and `elect` for this.
                if !contested.contains_key(label)
                    && !self.winners.contains_key(label)
                    && !self.shadowed.contains_key(label)
                {
                    object.put(&mut self.store, key);
                    changes.note(*kind, key);
                    self.winners.insert(label.clone(), (file.clone(), i));
                    // Files where it failed to decode may now report it as
                    // a duplicate of this one.
                    if let Some(files) = self.failed.get(label) {
                        self.dirty.extend(files.iter().cloned());
                    }
                    continue;
                }
                self.shadowed
                    .entry(label.clone())
                    .or_default()
                    .insert((file.clone(), i), object);
                contested.insert(label.clone(), (*kind, key.clone()));
            }
            for item in &items {
                if let Item::Object {
                    label,
                    decoded: Err(_),
                    ..
                } = item
                {
                    let files = self.failed.entry(label.clone()).or_default();
                    files.insert(name.clone());
                }
            }
            self.files.insert(name, (source, items));
        }
        for (label, (kind, key)) in contested {
            self.elect(&label, kind, &key, changes);
            // Whose duplicate (or decode error) messages may have changed.
            let winner = self.winners.get(&label).map(|(f, _)| f);
            let shadowed = self.shadowed.get(&label).into_iter().flatten();
            let failed = self.failed.get(&label).into_iter().flatten();
            let files = winner.into_iter().chain(shadowed.map(|((f, _), _)| f));
            let files = files.map(|f| f.to_os_string());
            self.dirty.extend(files.chain(failed.cloned()));
        }
        // Every definition of a file passes through `shadowed` on its way
        // to the store: a large file leaves the table's room behind.
        if self.shadowed.is_empty() {
            self.shadowed.shrink_to_fit();
        }
    }

    fn unfail(&mut self, label: &str, file: &OsString) {
        if let Some(files) = self.failed.get_mut(label) {
            files.remove(file);
            if files.is_empty() {
                self.failed.remove(label);
            }
        }
    }

    /// Works out again the problems of the files that changed, or whose
    /// objects' standing did; whether any changed.
    fn update_rejections(&mut self) -> bool {
        let mut changed = false;
        for name in std::mem::take(&mut self.dirty) {
            let now = if self.files.contains_key(&name) {
                self.rejections_of(&name)
            } else {
                Vec::new()
            };
            let before = self.file_rejections.get(&name);
            if before.map_or(now.is_empty(), |b| *b == now) {
                continue;
            }
            changed = true;
            if now.is_empty() {
                self.file_rejections.remove(&name);
            } else {
                self.file_rejections.insert(name, now);
            }
        }
        changed
    }

    /// Every problem, in file name order, then item order, as of the last
    /// [`update_rejections`](Self::update_rejections).
    fn rejections(&self) -> impl Iterator<Item = &Rejection> {
        self.file_rejections.values().flatten()
    }

    /// Puts the earliest definition of `label` into the store. A winner
    /// whose file changed was unregistered but is still in the store.
    fn elect(&mut self, label: &Arc<str>, kind: Kind, key: &ObjectKey, changes: &mut Changes) {
        let best = self
            .shadowed
            .get(label)
            .and_then(|defs| defs.keys().next().cloned());
        let current = self.winners.get(label).cloned();
        match (current, best) {
            (Some(cur), Some(best)) if cur < best => {}
            (Some(_), None) => {}
            (None, None) => {
                if Object::take(&mut self.store, kind, key).is_some() {
                    changes.note(kind, key);
                }
            }
            (current, Some(best)) => {
                let defs = self.shadowed.get_mut(label).expect("has a best");
                let object = defs.remove(&best).expect("listed");
                if defs.is_empty() {
                    self.shadowed.remove(label);
                }
                let previous = Object::take(&mut self.store, kind, key);
                if previous.as_ref() != Some(&object) {
                    changes.note(kind, key);
                }
                // Still defined, now after `best`: shadowed from now on.
                // (Without a current winner, its file changed: the old
                // object is gone.)
                if let (Some(cur), Some(previous)) = (current, previous) {
                    self.shadowed
                        .entry(label.clone())
                        .or_default()
                        .insert(cur, previous);
                }
                object.put(&mut self.store, key);
                self.winners.insert(label.clone(), best);
            }
        }
    }

    /// The source (path) of the file whose definition of `label` is stored.
    fn source_of(&self, label: &str) -> Option<&str> {
        let (name, _) = self.winners.get(label)?;
        self.files.get(&**name).map(|(source, _)| source.as_str())
    }

    /// The problems of file `name`, in item order.
    fn rejections_of(&self, name: &OsString) -> Vec<Rejection> {
        let mut out = Vec::new();
        if let Some((source, items)) = self.files.get(name) {
            for (i, item) in items.iter().enumerate() {
                match item {
                    Item::Rejected(r) => out.push((**r).clone()),
                    // Without any shadowed definition, every decoded
                    // object is the one stored: no lookup for the many.
                    Item::Object {
                        decoded: Ok(()), ..
                    } if self.shadowed.is_empty() => {}
                    Item::Object { label, decoded, .. } => {
                        let winner = self.winners.get(label);
                        let here = (name.as_os_str(), i);
                        fn at(w: &Position) -> (&OsStr, usize) {
                            (&w.0, w.1)
                        }
                        match winner {
                            Some(w) if at(w) == here => {}
                            // The first definition wins; a rejected one
                            // never counts as a definition.
                            Some(w) if at(w) < here => {
                                let first = &self.files[&*w.0].0;
                                let reason =
                                    format!("duplicate: already defined in {first}, which wins");
                                out.push(Rejection::new(
                                    source.clone(),
                                    &**label,
                                    "metadata.name",
                                    reason,
                                ));
                            }
                            _ => {
                                if let Err(e) = decoded {
                                    let (field, reason) = &**e;
                                    out.push(Rejection::new(
                                        source.clone(),
                                        &**label,
                                        field.clone(),
                                        reason.clone(),
                                    ));
                                }
                            }
                        }
                    }
                }
            }
        }
        out
    }
}

/// Decodes one file. Pure: the directory side is in [`ManifestDir`].
fn parse_file(source: &str, text: &str, format: Format) -> ParsedFile {
    let mut file = ParsedFile::new(source);
    match format {
        Format::Json => {
            // An editor may leave the file empty for a moment: that is
            // "no objects", not a syntax error.
            if text.trim().is_empty() {
                return file;
            }
            // Straight from the text into the typed objects: a Value tree
            // of a large file would cost several times its size. A
            // document that is an object (the usual case) is read once for
            // its header and List items, then each item once more when it
            // is decoded.
            let trimmed = text.trim_start();
            if trimmed.starts_with('{') {
                if let Ok(top) = serde_json::from_str::<RawTop<'_>>(trimmed) {
                    file.raw_top("document 1", trimmed, top);
                    return file;
                }
            }
            // Not an object, or not valid: let the generic path say which.
            match serde_json::from_str::<&RawValue>(text) {
                Ok(raw) => file.raw_document("document 1", raw),
                Err(err) => file.reject("", "", format!("invalid JSON: {err}")),
            }
        }
        Format::Yaml => {
            if flow_depth(text) > MAX_YAML_FLOW_DEPTH {
                let reason =
                    format!("`[` and `{{` nested more than {MAX_YAML_FLOW_DEPTH} deep: not parsed");
                file.reject("", "", reason);
                return file;
            }
            for (i, document) in serde_yaml::Deserializer::from_str(text).enumerate() {
                let label = format!("document {}", i + 1);
                // Two steps: the YAML value only fails on syntax errors,
                // after which the parser cannot go on; the conversion to
                // JSON fails on YAML-only shapes (e.g. non-string keys),
                // which only spoil this document.
                let yaml = match serde_yaml::Value::deserialize(document) {
                    Ok(yaml) => yaml,
                    Err(err) => {
                        file.reject(label, "", format!("invalid YAML: {err}"));
                        break;
                    }
                };
                match serde_json::to_value(yaml) {
                    Ok(value) => file.value_document(&label, value),
                    Err(err) => {
                        file.reject(label, "", format!("not a JSON-compatible document: {err}"))
                    }
                }
            }
        }
    }
    file
}

/// The deepest nesting of `[`/`{` in `text`, brackets in strings and
/// comments counted too. Linear.
fn flow_depth(text: &str) -> usize {
    let (mut depth, mut deepest) = (0usize, 0usize);
    for b in text.bytes() {
        match b {
            b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

/// What decides where an object goes, read before its typed decoding.
/// Fields that are not strings count as missing, as with a Value tree.
#[derive(Default)]
struct Header {
    api_version: String,
    kind: String,
    name: String,
    namespace: String,
}

/// The top of a JSON object, borrowed from the text.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawTop<'a> {
    #[serde(borrow, default)]
    api_version: Option<&'a RawValue>,
    #[serde(borrow, default)]
    kind: Option<&'a RawValue>,
    #[serde(borrow, default)]
    metadata: Option<&'a RawValue>,
    #[serde(borrow, default)]
    items: Option<Items<'a>>,
}

/// The `items` of a `List`: each element kept as text, or what stood there
/// instead of a list. Read in the same pass as the rest of the header.
enum Items<'a> {
    List(Vec<&'a RawValue>),
    Null,
    Other(&'static str),
}

impl<'de: 'a, 'a> Deserialize<'de> for Items<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        struct Visitor<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for Visitor<'a> {
            type Value = Items<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("anything")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Self::Value, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element::<&'a RawValue>()? {
                    items.push(item);
                }
                Ok(Items::List(items))
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(Items::Null)
            }
            fn visit_none<E>(self) -> Result<Self::Value, E> {
                Ok(Items::Null)
            }
            fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
                Ok(Items::Other("a boolean"))
            }
            fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
                Ok(Items::Other("a number"))
            }
            fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
                Ok(Items::Other("a number"))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
                Ok(Items::Other("a number"))
            }
            fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
                Ok(Items::Other("a string"))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Self::Value, A::Error> {
                while map
                    .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
                    .is_some()
                {}
                Ok(Items::Other("a mapping"))
            }
        }
        de.deserialize_any(Visitor(std::marker::PhantomData))
    }
}

#[derive(Deserialize)]
struct RawMeta<'a> {
    #[serde(borrow, default)]
    name: Option<&'a RawValue>,
    #[serde(borrow, default)]
    namespace: Option<&'a RawValue>,
}

/// The string a raw JSON value holds, "" for anything else.
fn raw_str(raw: Option<&RawValue>) -> String {
    raw.filter(|r| r.get().starts_with('"'))
        .and_then(|r| serde_json::from_str::<String>(r.get()).ok())
        .unwrap_or_default()
}

/// What a raw JSON value is, for messages (see [`describe`]).
fn describe_raw(raw: &RawValue) -> &'static str {
    match raw.get().as_bytes().first() {
        Some(b'n') => "nothing",
        Some(b't' | b'f') => "a boolean",
        Some(b'"') => "a string",
        Some(b'[') => "a list",
        Some(b'{') => "a mapping",
        _ => "a number",
    }
}

impl Header {
    fn of_value(value: &Value) -> Self {
        let text = |v: Option<&Value>| v.and_then(Value::as_str).unwrap_or("").to_owned();
        let metadata = value.get("metadata");
        Header {
            api_version: text(value.get("apiVersion")),
            kind: text(value.get("kind")),
            name: text(metadata.and_then(|m| m.get("name"))),
            namespace: text(metadata.and_then(|m| m.get("namespace"))),
        }
    }

    fn of_raw(top: &RawTop<'_>) -> Self {
        let meta = top.metadata.filter(|m| m.get().starts_with('{'));
        let (name, namespace) = match meta.map(|m| serde_json::from_str::<RawMeta<'_>>(m.get())) {
            None => Default::default(),
            Some(Ok(m)) => (raw_str(m.name), raw_str(m.namespace)),
            // A repeated key (RawMeta takes each once): the Value tree reads
            // it, the last of them winning as in the typed decoding.
            Some(Err(_)) => {
                let value = meta.and_then(|m| serde_json::from_str::<Value>(m.get()).ok());
                let text = |key| {
                    let v = value.as_ref().and_then(|v| v.get(key));
                    v.and_then(Value::as_str).unwrap_or("").to_owned()
                };
                (text("name"), text("namespace"))
            }
        };
        Header {
            api_version: raw_str(top.api_version),
            kind: raw_str(top.kind),
            name,
            namespace,
        }
    }

    /// `apiVersion: v1, kind: List`, what `kubectl get -o yaml` writes.
    fn is_list(&self) -> bool {
        self.api_version == "v1" && self.kind == "List"
    }
}

impl ParsedFile {
    /// One JSON document: empty, a `List`, or a single object.
    fn raw_document(&mut self, label: &str, raw: &RawValue) {
        if raw.get() == "null" {
            return;
        }
        if !raw.get().starts_with('{') {
            return self.raw_object(label, raw, None);
        }
        match serde_json::from_str::<RawTop<'_>>(raw.get()) {
            Ok(top) => self.raw_top(label, raw.get(), top),
            // A shape the header cannot take (a repeated key): the Value
            // tree reads it as before, the last of the repeated keys wins.
            Err(_) => match serde_json::from_str::<Value>(raw.get()) {
                Ok(value) => self.value_document(label, value),
                Err(err) => self.reject(label, "", format!("invalid JSON: {err}")),
            },
        }
    }

    /// A JSON object whose header was read: a `List` or a single object.
    fn raw_top(&mut self, label: &str, text: &str, top: RawTop<'_>) {
        let header = Header::of_raw(&top);
        if !header.is_list() {
            let object = |kind| decode_text(kind, text);
            return self.object(label, header, object);
        }
        match top.items {
            None | Some(Items::Null) => {}
            Some(Items::List(items)) => self.raw_items(label, &items),
            Some(Items::Other(found)) => self.reject(
                label,
                "items",
                format!("expected a list of objects, found {found}"),
            ),
        }
    }

    /// The items of a List. Each item decodes on its own, so a long list
    /// is split over the cores (a large first read is mostly this), and the
    /// parts are joined back in item order.
    fn raw_items(&mut self, label: &str, items: &[&RawValue]) {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let chunk = items.len().div_ceil(threads).max(PARALLEL_ITEMS);
        let decode = |first: usize, part: &[&RawValue]| {
            let mut file = ParsedFile {
                source: self.source.clone(),
                ..Default::default()
            };
            for (i, item) in part.iter().enumerate() {
                file.raw_object(&format!("{label} items[{}]", first + i), item, None);
            }
            file
        };
        let parts: Vec<ParsedFile> = if items.len() <= chunk {
            vec![decode(0, items)]
        } else {
            std::thread::scope(|scope| {
                let handles: Vec<_> = items
                    .chunks(chunk)
                    .enumerate()
                    .map(|(n, part)| scope.spawn(move || decode(n * chunk, part)))
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("decoding does not panic"))
                    .collect()
            })
        };
        for part in parts {
            let offset = self.items.len();
            self.objects
                .extend(part.objects.into_iter().map(|(i, o)| (i + offset, o)));
            self.items.extend(part.items);
        }
    }

    fn raw_object(&mut self, label: &str, raw: &RawValue, header: Option<Header>) {
        let header = match header {
            Some(h) => h,
            None => {
                if !raw.get().starts_with('{') {
                    let reason = format!(
                        "expected a Kubernetes object (a mapping), found {}",
                        describe_raw(raw)
                    );
                    return self.reject(label, "", reason);
                }
                match serde_json::from_str::<RawTop<'_>>(raw.get()) {
                    Ok(top) => Header::of_raw(&top),
                    // As in `raw_document`.
                    Err(_) => match serde_json::from_str::<Value>(raw.get()) {
                        Ok(value) => return self.value_object(label, value),
                        Err(err) => return self.reject(label, "", format!("invalid JSON: {err}")),
                    },
                }
            }
        };
        self.object(label, header, |kind| decode_text(kind, raw.get()));
    }

    /// One YAML document: empty, a `List`, or a single object.
    fn value_document(&mut self, label: &str, value: Value) {
        match value {
            Value::Null => {}
            Value::Object(mut list) if is_list(&list) => match list.remove("items") {
                None | Some(Value::Null) => {}
                Some(Value::Array(items)) => {
                    for (i, item) in items.into_iter().enumerate() {
                        self.value_object(&format!("{label} items[{i}]"), item);
                    }
                }
                Some(other) => self.reject(
                    label,
                    "items",
                    format!("expected a list of objects, found {}", describe(&other)),
                ),
            },
            value => self.value_object(label, value),
        }
    }

    fn value_object(&mut self, label: &str, value: Value) {
        if !value.is_object() {
            let reason = format!(
                "expected a Kubernetes object (a mapping), found {}",
                describe(&value)
            );
            return self.reject(label, "", reason);
        }
        let header = Header::of_value(&value);
        self.object(label, header, |kind| decode_value(kind, value));
    }

    /// Checks the kind and name, then decodes the typed object.
    fn object(
        &mut self,
        label: &str,
        header: Header,
        decode: impl FnOnce(Kind) -> Result<Object, (String, String)>,
    ) {
        let Header {
            api_version,
            kind,
            name,
            namespace,
        } = header;
        let namespace = if namespace.is_empty() {
            DEFAULT_NAMESPACE.to_owned()
        } else {
            namespace
        };
        let (api_version, kind_str) = (api_version.as_str(), kind.as_str());
        if !ACCEPTED.contains(&(api_version, kind_str)) {
            // Name the object as precisely as the document allows.
            let object = match (kind_str.is_empty(), name.is_empty()) {
                (false, false) => format!("{kind_str} {namespace}/{name}"),
                _ => label.to_owned(),
            };
            let accepted = ACCEPTED.map(|(v, k)| format!("{v} {k}")).join(", ");
            let found = match (api_version, kind_str) {
                (_, "") => "no kind".to_owned(),
                ("", kind) => format!("kind {kind} without apiVersion"),
                (api_version, kind) => format!("{api_version} {kind}"),
            };
            return self.reject(
                object,
                "kind",
                format!("unsupported object: {found} (accepted: {accepted})"),
            );
        }
        if name.is_empty() {
            return self.reject(
                label,
                "metadata.name",
                format!("a {kind_str} needs a metadata.name"),
            );
        }
        let (kind, label) = match kind_str {
            "Service" => (Kind::Service, format!("Service {namespace}/{name}")),
            "EndpointSlice" => (Kind::Slice, format!("EndpointSlice {namespace}/{name}")),
            "Endpoints" => (Kind::Endpoints, format!("Endpoints {namespace}/{name}")),
            _ => (Kind::Node, format!("Node {name}")),
        };
        let namespace = match kind {
            Kind::Node => "",
            _ => &namespace,
        };
        let namespace = match self.namespaces.get(namespace) {
            Some(shared) => shared.clone(),
            None => {
                let shared: Arc<str> = namespace.into();
                self.namespaces.insert(shared.clone());
                shared
            }
        };
        let key = ObjectKey::new(namespace, name);
        let label: Arc<str> = label.into();
        let decoded = decode(kind).map(|object| match object {
            // Keep no namespace: their key says.
            o @ (Object::Service(_) | Object::Slice(_)) => o,
            Object::Endpoints(o) => Object::Endpoints(Box::new(with_namespace(*o, &key.namespace))),
            Object::Node(mut o) => {
                // Cluster-scoped: a namespace in the manifest means nothing.
                o.metadata.namespace = None;
                Object::Node(o)
            }
        });
        let index = self.items.len();
        let decoded = match decoded {
            Ok(object) => {
                self.objects.push((index, object));
                Ok(())
            }
            Err(e) => Err(Box::new(e)),
        };
        self.items.push(Item::Object {
            label,
            kind,
            key,
            decoded,
        });
    }
}

fn decode_value(kind: Kind, value: Value) -> Result<Object, (String, String)> {
    Ok(match kind {
        Kind::Service => Object::Service(Box::new((*decode::<Service>(value)?).into())),
        Kind::Slice => Object::Slice(Box::new(Slice::from(*decode::<EndpointSlice>(value)?))),
        Kind::Endpoints => Object::Endpoints(decode(value)?),
        Kind::Node => Object::Node(decode(value)?),
    })
}

fn decode_text(kind: Kind, text: &str) -> Result<Object, (String, String)> {
    let mut object = match kind {
        Kind::Service => Object::Service(Box::new((*decode_str::<Service>(text)?).into())),
        // Converted right away: the API type is several times the size of
        // what translation reads, and only one object's worth of it lives.
        // Straight into the compact form when it decodes; on any error the
        // API type decodes it again, for its exact message.
        Kind::Slice => match serde_json::from_str::<WireSlice>(text) {
            Ok(WireSlice(slice)) => Object::Slice(Box::new(slice)),
            Err(_) => Object::Slice(Box::new(Slice::from(*decode_str::<EndpointSlice>(text)?))),
        },
        Kind::Endpoints => Object::Endpoints(decode_str(text)?),
        Kind::Node => Object::Node(decode_str(text)?),
    };
    compact(&mut object);
    Ok(object)
}

/// Gives back the spare capacity of the lists the store keeps. Decoded from
/// text, a list does not know its length in advance and grows by doubling:
/// ten endpoints of ~350 bytes each sit in room for sixteen, which over a
/// large store is a good part of the agent's memory.
fn compact(object: &mut Object) {
    fn shrink<T>(list: &mut Option<Vec<T>>) {
        if let Some(list) = list {
            list.shrink_to_fit();
        }
    }
    match object {
        // Exact already: their lists are boxed slices.
        Object::Service(_) | Object::Slice(_) => {}
        Object::Endpoints(endpoints) => {
            if let Some(subsets) = &mut endpoints.subsets {
                subsets.shrink_to_fit();
                for subset in subsets {
                    shrink(&mut subset.addresses);
                    shrink(&mut subset.not_ready_addresses);
                    shrink(&mut subset.ports);
                }
            }
        }
        Object::Node(node) => {
            if let Some(status) = &mut node.status {
                shrink(&mut status.addresses);
            }
        }
    }
}

/// Decodes a typed object, naming the field path of a mismatch
/// (`spec.ports[0].port`) instead of serde's bare "invalid type".
fn decode<T: DeserializeOwned>(value: Value) -> Result<Box<T>, (String, String)> {
    serde_path_to_error::deserialize(value)
        .map(Box::new)
        .map_err(|err| {
            let path = err.path().to_string();
            (field_of(path), err.into_inner().to_string())
        })
}

/// Like [`decode`], from the object's own text. Decoded first without
/// tracking the path, which costs on every field of every object; only an
/// object that fails is decoded again, to name the field.
fn decode_str<T: DeserializeOwned>(text: &str) -> Result<Box<T>, (String, String)> {
    if let Ok(object) = T::deserialize(&mut serde_json::Deserializer::from_str(text)) {
        return Ok(Box::new(object));
    }
    let mut de = serde_json::Deserializer::from_str(text);
    serde_path_to_error::deserialize(&mut de)
        .map(Box::new)
        .map_err(|err| {
            let path = err.path().to_string();
            let inner = err.into_inner();
            // The position is within this one object's text, which for a
            // List item would point at the wrong line of the file; the
            // field path says where.
            let message = inner.to_string();
            let suffix = format!(" at line {} column {}", inner.line(), inner.column());
            let message = match message.strip_suffix(&suffix) {
                Some(m) => m.to_owned(),
                None => message,
            };
            (field_of(path), message)
        })
}

/// The root path prints as "."; a missing top-level field lands there.
fn field_of(path: String) -> String {
    if path == "." {
        String::new()
    } else {
        path
    }
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
    use crate::input::store::IpField;

    /// Writes `files` into a fresh directory and loads it.
    fn load(files: &[(&str, &str)]) -> (tempfile::TempDir, Store, Vec<Rejection>) {
        let dir = tempfile::tempdir().unwrap();
        for (name, text) in files {
            fs::write(dir.path().join(name), text).unwrap();
        }
        let (store, rejections) = load_dir(dir.path());
        (dir, store, rejections)
    }

    /// Sorted "Kind key" labels of the keys of the four kinds.
    fn labels(
        services: impl Iterator<Item = impl std::fmt::Display>,
        slices: impl Iterator<Item = impl std::fmt::Display>,
        endpoints: impl Iterator<Item = impl std::fmt::Display>,
        nodes: impl Iterator<Item = impl std::fmt::Display>,
    ) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        out.extend(services.map(|k| format!("Service {k}")));
        out.extend(slices.map(|k| format!("EndpointSlice {k}")));
        out.extend(endpoints.map(|k| format!("Endpoints {k}")));
        out.extend(nodes.map(|k| format!("Node {k}")));
        out.sort();
        out
    }

    /// The store's content as sorted "Kind ns/name" labels.
    fn contents(store: &Store) -> Vec<String> {
        let (services, slices) = (store.services.keys(), store.slices.keys());
        labels(services, slices, store.endpoints.keys(), store.nodes.keys())
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
        let spec = svc.spec.as_ref().unwrap();
        assert_eq!(spec.cluster_ip, Some(IpField::from("10.96.0.10")));
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

    /// What cannot be read keeps its objects and says why, naming the path;
    /// what is not a regular file is named too, not skipped silently.
    #[test]
    fn read_errors_keep_the_last_objects() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("m");
        fs::create_dir(&dir).unwrap();
        let web = dir.join("web.yaml");
        fs::write(&web, SERVICE_WEB).unwrap();
        let mut cached = ManifestDir::new(&dir);
        cached.refresh();
        let before = cached.store().clone();
        assert_eq!(contents(&before), ["Service default/web"]);
        let messages = |m: &ManifestDir| -> Vec<String> {
            m.rejections().iter().map(ToString::to_string).collect()
        };

        // A symlink loop where the file was.
        fs::remove_file(&web).unwrap();
        std::os::unix::fs::symlink("web.yaml", &web).unwrap();
        assert!(cached.refresh().is_empty());
        assert_eq!(cached.store(), &before);
        let got = messages(&cached);
        assert_eq!(got.len(), 1, "{got:?}");
        let want = format!("{}: cannot read: ", web.display());
        assert!(got[0].starts_with(&want), "{got:?}");
        assert!(got[0].ends_with("its objects stay as last read"), "{got:?}");

        // A FIFO is named, not opened (which would block).
        let fifo = dir.join("pipe.yaml");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(cached.refresh().is_empty());
        let got = messages(&cached);
        let want = format!("{}: not a regular file (a FIFO): skipped", fifo.display());
        assert!(got.contains(&want), "{got:?}");

        // The directory cannot be listed: everything stays.
        let away = root.path().join("away");
        fs::rename(&dir, &away).unwrap();
        fs::write(&dir, "").unwrap();
        assert!(cached.refresh().is_empty());
        assert_eq!(cached.store(), &before);
        let got = messages(&cached);
        let want = format!("{}: cannot read the manifests directory: ", dir.display());
        assert!(got.iter().any(|m| m.starts_with(&want)), "{got:?}");

        // Readable again: as a fresh load.
        fs::remove_file(&dir).unwrap();
        fs::rename(&away, &dir).unwrap();
        fs::remove_file(&fifo).unwrap();
        fs::remove_file(&web).unwrap();
        fs::write(&web, SERVICE_WEB_2).unwrap();
        assert_eq!(changed(&cached.refresh()), ["Service default/web"]);
        let (store, rejections) = load_dir(&dir);
        assert_eq!(cached.store(), &store);
        assert_eq!(cached.rejections(), rejections);
        assert!(rejections.is_empty(), "{rejections:?}");
    }

    /// Problems found after decoding (translation) name the file.
    #[test]
    fn later_rejections_name_the_file() {
        let (dir, _, _) = load(&[]);
        fs::write(dir.path().join("a.yaml"), SERVICE_WEB).unwrap();
        fs::write(dir.path().join("b.yaml"), SERVICE_WEB_2).unwrap();
        let mut cached = ManifestDir::new(dir.path());
        cached.refresh();
        let mut found = [
            Rejection::new(
                "translate",
                "Service default/web",
                "spec.ports[0].port",
                "0 is outside 1..65535",
            ),
            Rejection::new("translate", "Service default/gone", "", "x"),
        ];
        cached.name_files(&mut found);
        // The first definition wins: a.yaml's.
        let a = dir.path().join("a.yaml").display().to_string();
        assert_eq!(found[0].source, a);
        assert_eq!(found[1].source, "translate");
    }

    /// A file over the size cap, and YAML nested too deep to parse in
    /// reasonable time, are rejected naming the file.
    #[test]
    fn size_and_depth_caps() {
        let dir = tempfile::tempdir().unwrap();
        let cap = 300_000;
        fs::write(dir.path().join("big.yaml"), "#".repeat(cap + 1)).unwrap();
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        fs::write(dir.path().join("deep.yaml"), deep).unwrap();
        let nested = format!("a: {}1{}\n", "[".repeat(100), "]".repeat(100));
        fs::write(dir.path().join("nested.yaml"), nested).unwrap();
        fs::write(dir.path().join("ok.yaml"), SERVICE_WEB_2).unwrap();
        let mut cached = ManifestDir::new(dir.path()).with_max_file_bytes(cap as u64);
        cached.refresh();
        let got: Vec<String> = cached
            .rejections()
            .iter()
            .map(ToString::to_string)
            .collect();
        let file = |name: &str| dir.path().join(name).display().to_string();
        assert_eq!(
            got,
            [
                format!(
                    "{}: larger than {} bytes (--max-manifest-bytes): not read",
                    file("big.yaml"),
                    cap
                ),
                format!(
                    "{}: `[` and `{{` nested more than 1000 deep: not parsed",
                    file("deep.yaml")
                ),
                // Within the cap: the parser's own answer.
                format!(
                    "{}: document 1: kind: unsupported object: no kind (accepted: v1 Service, \
                     discovery.k8s.io/v1 EndpointSlice, v1 Endpoints, v1 Node)",
                    file("nested.yaml")
                ),
            ],
        );
        assert_eq!(contents(cached.store()), ["Service default/web"]);
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

    /// The changes as sorted "Kind key" labels.
    fn changed(changes: &Changes) -> Vec<String> {
        let (services, slices) = (changes.services.iter(), changes.slices.iter());
        labels(
            services,
            slices,
            changes.endpoints.iter(),
            changes.nodes.iter(),
        )
    }

    enum Step {
        Write(&'static str, &'static str),
        Remove(&'static str),
        /// Written under a hidden name, then renamed into place.
        RenameIn(&'static str, &'static str),
    }

    const SERVICE_WEB_2: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec: {clusterIP: 10.96.0.20, ports: [{port: 80}]}\n";
    const LIST_API: &str = r#"{"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "api"}, "spec": {"clusterIP": "10.96.0.30"}},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "metadata": {"name": "api-1"}, "addressType": "IPv4"}]}"#;
    const LIST_API_RESPACED: &str = r#"{"apiVersion":"v1","kind":"List","items":[
        {"apiVersion":"v1","kind":"Service","metadata":{"name":"api"},"spec":{"clusterIP":"10.96.0.30"}},
        {"apiVersion":"discovery.k8s.io/v1","kind":"EndpointSlice","metadata":{"name":"api-1"},"addressType":"IPv4"}]}"#;
    const LIST_API_MOVED: &str = r#"{"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "api"}, "spec": {"clusterIP": "10.96.0.30"}},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "metadata": {"name": "api-1"}, "addressType": "IPv6"}]}"#;

    /// After every step the cached directory must equal a fresh load of it,
    /// and report as changed exactly the objects whose content changed.
    #[test]
    fn cache_follows_changes_like_a_fresh_load() {
        use Step::*;
        let steps: &[(Step, &[&str])] = &[
            (Write("b.yaml", SERVICE_WEB_2), &["Service default/web"]),
            // An earlier file takes over.
            (Write("a.yaml", SERVICE_WEB), &["Service default/web"]),
            // The loser's file changes: no change to what is stored.
            (
                Write("b.yaml", "apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec: {clusterIP: 10.96.0.21}\n---\napiVersion: v1\nkind: Endpoints\nmetadata: {name: web}\n"),
                &["Endpoints default/web"],
            ),
            // The winner's file goes: the shadowed definition takes over.
            (Remove("a.yaml"), &["Service default/web"]),
            (RenameIn("c.json", LIST_API), &["EndpointSlice default/api-1", "Service default/api"]),
            // Same objects, other text: read again, nothing changed.
            (RenameIn("c.json", LIST_API_RESPACED), &[]),
            (RenameIn("c.json", LIST_API_MOVED), &["EndpointSlice default/api-1"]),
            // A broken file keeps nothing; its objects go.
            (Write("c.json", "{\"apiVersion\": "), &["EndpointSlice default/api-1", "Service default/api"]),
            (Write("d.yaml", "apiVersion: v1\nkind: Node\nmetadata: {name: n1}\n"), &["Node n1"]),
            // Within one file the first definition wins, also after edits.
            (
                Write("b.yaml", "apiVersion: v1\nkind: Endpoints\nmetadata: {name: web}\n---\napiVersion: v1\nkind: Endpoints\nmetadata: {name: web, labels: {a: b}}\n"),
                &["Service default/web"],
            ),
            (Remove("b.yaml"), &["Endpoints default/web"]),
            // A definition that fails, then a first good one in an earlier
            // file (the failure is now a duplicate), then one earlier still:
            // how the failure is reported depends on which wins.
            (
                Write("h.yaml", "apiVersion: v1\nkind: Service\nmetadata: {name: odd}\nspec: {ports: [{port: x}]}\n"),
                &[],
            ),
            (
                Write("g.yaml", "apiVersion: v1\nkind: Service\nmetadata: {name: odd}\nspec: {clusterIP: 10.96.0.30}\n"),
                &["Service default/odd"],
            ),
            (
                Write("e.yaml", "apiVersion: v1\nkind: Service\nmetadata: {name: odd}\nspec: {clusterIP: 10.96.0.31}\n"),
                &["Service default/odd"],
            ),
            (Remove("e.yaml"), &["Service default/odd"]),
            (Remove("g.yaml"), &["Service default/odd"]),
            (Remove("h.yaml"), &[]),
            (Remove("c.json"), &[]),
            (Remove("d.yaml"), &["Node n1"]),
        ];
        let dir = tempfile::tempdir().unwrap();
        let mut cached = ManifestDir::new(dir.path());
        assert!(cached.refresh().is_empty());
        for (i, (step, want)) in steps.iter().enumerate() {
            match step {
                Write(name, text) => fs::write(dir.path().join(name), text).unwrap(),
                Remove(name) => fs::remove_file(dir.path().join(name)).unwrap(),
                RenameIn(name, text) => {
                    let tmp = dir.path().join(format!(".{name}.tmp"));
                    fs::write(&tmp, text).unwrap();
                    fs::rename(&tmp, dir.path().join(name)).unwrap();
                }
            }
            // A file read within `RACY_MARGIN` of its last change is read
            // again by every refresh until it is not: read later, it is
            // left alone by the next steps, so that only the cache's own
            // bookkeeping keeps what it reports right.
            std::thread::sleep(RACY_MARGIN + Duration::from_millis(20));
            let changes = cached.refresh();
            assert_eq!(changed(&changes), *want, "step {i}: changes");
            let (store, rejections) = load_dir(dir.path());
            assert_eq!(cached.store(), &store, "step {i}: store");
            assert_eq!(cached.rejections(), rejections, "step {i}: rejections");
            // Nothing new: nothing read again but racy files, nothing changed.
            assert!(cached.refresh().is_empty(), "step {i}: second refresh");
        }
    }

    /// A long List is decoded in parts: item labels, rejections and
    /// duplicates come out as if in one piece.
    #[test]
    fn long_lists_decode_in_order() {
        let items: Vec<String> = (0..1500)
            .map(|i| match i {
                700 => r#"{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "bad"}, "spec": {"ports": [{"port": "x"}]}}"#.to_owned(),
                1400 => r#"{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s3"}}"#.to_owned(),
                1499 => "7".to_owned(),
                i => format!(r#"{{"apiVersion": "v1", "kind": "Service", "metadata": {{"name": "s{i}"}}}}"#),
            })
            .collect();
        let text = format!(
            r#"{{"apiVersion": "v1", "kind": "List", "items": [{}]}}"#,
            items.join(",")
        );
        let (store, rejections) = load_str("l.json", &text, Format::Json);
        assert_eq!(store.services.len(), 1497);
        let got: Vec<(&str, &str)> = rejections
            .iter()
            .map(|r| (r.object.as_str(), r.field.as_str()))
            .collect();
        assert_eq!(
            got,
            [
                ("Service default/bad", "spec.ports[0].port"),
                ("Service default/s3", "metadata.name"),
                ("document 1 items[1499]", ""),
            ]
        );
    }

    /// Repeated keys, which a Value tree resolves (the last wins), still
    /// load as they did before JSON was read without one.
    #[test]
    fn repeated_keys_in_json() {
        let text = r#"{"apiVersion": "v1", "kind": "List", "items": [
            {"apiVersion": "v1", "kind": "Node", "kind": "Service", "metadata": {"name": "a"}},
            {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "b"}}]}"#;
        let (store, rejections) = load_str("f.json", text, Format::Json);
        assert!(rejections.is_empty(), "{rejections:?}");
        assert_eq!(contents(&store), ["Service default/a", "Service default/b"]);
        let text = r#"{"apiVersion": "v1", "kind": "Service", "kind": "Service", "metadata": {"name": "c"}}"#;
        let (store, rejections) = load_str("f.json", text, Format::Json);
        assert!(rejections.is_empty(), "{rejections:?}");
        assert_eq!(contents(&store), ["Service default/c"]);
        // Within metadata too (it used to read as no name at all), in a
        // List item and in a single object.
        let item = r#"{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x", "namespace": "n", "name": "d"}}"#;
        for text in [
            format!(r#"{{"apiVersion": "v1", "kind": "List", "items": [{item}]}}"#),
            item.to_owned(),
        ] {
            let (store, rejections) = load_str("f.json", &text, Format::Json);
            assert!(rejections.is_empty(), "{text}: {rejections:?}");
            assert_eq!(contents(&store), ["Service n/d"], "{text}");
        }
    }

    #[test]
    fn racy_stamps() {
        // A file time in milliseconds.
        let at = |ms: i64| Stamp {
            len: 1,
            mtime: (ms / 1000, ms % 1000 * 1_000_000),
            ctime: (ms / 1000, ms % 1000 * 1_000_000),
            ino: 1,
            dev: 1,
        };
        let read_at = UNIX_EPOCH + Duration::from_secs(100);
        // (file time, racy)
        let cases = [
            (50_000, false),
            (99_899, false),
            (99_900, true),
            (100_000, true),
            (101_000, true),
        ];
        for (time, want) in cases {
            assert_eq!(at(time).racy(read_at), want, "time {time}");
        }
    }

    #[test]
    fn json_messages_match_yaml() {
        // The same broken Service as JSON and as YAML: one message.
        let json = r#"{"apiVersion": "v1", "kind": "List", "items": [{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "api"}, "spec": {"ports": [{"port": 80}, {"port": "eighty"}]}}, 5, {"kind": 5, "metadata": "x"}]}"#;
        let yaml = "apiVersion: v1\nkind: List\nitems:\n- {apiVersion: v1, kind: Service, metadata: {name: api}, spec: {ports: [{port: 80}, {port: eighty}]}}\n- 5\n- {kind: 5, metadata: x}\n";
        let (_, from_json) = load_str("f", json, Format::Json);
        let (_, from_yaml) = load_str("f", yaml, Format::Yaml);
        let render = |r: &[Rejection]| r.iter().map(ToString::to_string).collect::<Vec<_>>();
        assert_eq!(
            render(&from_json),
            [
                "f: Service default/api: spec.ports[1].port: invalid type: string \"eighty\", expected i32",
                "f: document 1 items[1]: expected a Kubernetes object (a mapping), found a number",
                "f: document 1 items[2]: kind: unsupported object: no kind (accepted: v1 Service, discovery.k8s.io/v1 EndpointSlice, v1 Endpoints, v1 Node)",
            ]
        );
        assert_eq!(render(&from_yaml), render(&from_json));
    }

    #[test]
    fn load_str_yaml() {
        let (store, rejections) = load_str("inline", SERVICE_WEB, Format::Yaml);
        assert!(rejections.is_empty());
        assert_eq!(contents(&store), ["Service default/web"]);
    }
}
