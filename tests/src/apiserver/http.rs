//! Request routing and the LIST / WATCH / GET / discovery handlers.

use std::{
    borrow::Cow, collections::VecDeque, convert::Infallible, sync::atomic::Ordering, sync::Arc,
};

use axum::body::{Body, Bytes};
use base64::{engine::general_purpose::URL_SAFE_NO_PAD, Engine as _};
use hyper::{header, Method, Request, Response, StatusCode};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::{
    lock,
    selector::{FieldSelector, LabelSelector},
    store::{bookmark_object, Filter, Msg, Snapshot, Watcher},
    Kind, OpenWatchGuard, Shared,
};

const JSON: &str = "application/json";
const AGGREGATED: &str = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList";

type Resp = Response<Body>;

fn json_response(code: StatusCode, v: &Value) -> Resp {
    Response::builder()
        .status(code)
        .header(header::CONTENT_TYPE, JSON)
        .header(header::CACHE_CONTROL, "no-cache, private")
        .body(Body::from(serde_json::to_vec(v).expect("JSON")))
        .expect("response")
}

fn ok(v: &Value) -> Resp {
    json_response(StatusCode::OK, v)
}

fn status_object(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    })
}

fn error(code: u16, reason: &str, message: &str) -> Resp {
    json_response(
        StatusCode::from_u16(code).expect("status code"),
        &status_object(code, reason, message),
    )
}

fn bad_request(message: &str) -> Resp {
    error(400, "BadRequest", message)
}

fn not_found(message: &str) -> Resp {
    error(404, "NotFound", message)
}

fn expired_status(message: &str) -> Value {
    status_object(410, "Expired", message)
}

/// Decodes `application/x-www-form-urlencoded` (the query string).
fn decode_component(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(b) => {
                        out.push(b);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

struct Query(Vec<(String, String)>);

impl Query {
    fn parse(q: Option<&str>) -> Self {
        Self(
            q.unwrap_or("")
                .split('&')
                .filter(|p| !p.is_empty())
                .map(|p| {
                    let (k, v) = p.split_once('=').unwrap_or((p, ""));
                    (decode_component(k), decode_component(v))
                })
                .collect(),
        )
    }

    fn get(&self, k: &str) -> Option<&str> {
        self.0
            .iter()
            .rev()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.as_str())
    }

    fn flag(&self, k: &str) -> bool {
        matches!(self.get(k), Some("true" | "1"))
    }
}

/// What a resource URL names.
struct Target {
    kind: Kind,
    namespace: Option<String>,
    name: Option<String>,
    /// `/api/v1/watch/...` legacy watch paths.
    watch_path: bool,
}

/// Parses `/api/v1/...` and `/apis/{group}/{version}/...` resource paths.
fn parse_resource(segs: &[&str]) -> Option<Result<Target, Resp>> {
    let (group, version, mut rest) = match segs {
        ["api", v, rest @ ..] if !rest.is_empty() => ("", *v, rest),
        ["apis", g, v, rest @ ..] if !rest.is_empty() => (*g, *v, rest),
        _ => return None,
    };
    let mut watch_path = false;
    if rest.first() == Some(&"watch") {
        watch_path = true;
        rest = &rest[1..];
    }
    let (namespace, plural, name) = match rest {
        ["namespaces", ns, plural] => (Some(*ns), *plural, None),
        ["namespaces", ns, plural, name] => (Some(*ns), *plural, Some(*name)),
        [plural] => (None, *plural, None),
        [plural, name] => (None, *plural, Some(*name)),
        _ => {
            return Some(Err(not_found(
                "the server could not find the requested resource",
            )))
        }
    };
    let Some(kind) = Kind::from_resource(group, version, plural) else {
        return Some(Err(not_found(&format!(
            "the server could not find the requested resource ({plural})"
        ))));
    };
    if namespace.is_some() && !kind.namespaced() {
        return Some(Err(not_found(
            "the server could not find the requested resource",
        )));
    }
    if name.is_some() && namespace.is_none() && kind.namespaced() {
        return Some(Err(not_found(
            "the server could not find the requested resource",
        )));
    }
    Some(Ok(Target {
        kind,
        namespace: namespace.map(str::to_string),
        name: name.map(str::to_string),
        watch_path,
    }))
}

pub(super) async fn handle(
    shared: Arc<Shared>,
    req: Request<hyper::body::Incoming>,
) -> Result<Resp, Infallible> {
    let path = req.uri().path().to_string();
    let query = req.uri().query().map(str::to_string);
    shared.log_request(match &query {
        Some(q) => format!("{} {path}?{q}", req.method()),
        None => format!("{} {path}", req.method()),
    });
    let aggregated = req.headers().get_all(header::ACCEPT).iter().any(|v| {
        v.to_str()
            .is_ok_and(|s| s.contains("as=APIGroupDiscoveryList"))
    });
    let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    if req.method() != Method::GET {
        return Ok(error(
            405,
            "MethodNotAllowed",
            "the fixture serves GET (list, watch, get) only",
        ));
    }
    let q = Query::parse(query.as_deref());
    let resp = match segs.as_slice() {
        [] => ok(
            &json!({"paths": ["/api", "/api/v1", "/apis", "/apis/discovery.k8s.io",
            "/apis/discovery.k8s.io/v1", "/healthz", "/livez", "/readyz", "/version"]}),
        ),
        ["version"] => ok(&version()),
        ["healthz" | "livez" | "readyz"] => Response::builder()
            .header(header::CONTENT_TYPE, "text/plain; charset=utf-8")
            .body(Body::from("ok"))
            .expect("response"),
        ["api"] if aggregated => aggregated_discovery(""),
        ["api"] => ok(&json!({
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": shared.addr.to_string()}],
        })),
        ["apis"] if aggregated => aggregated_discovery("discovery.k8s.io"),
        ["apis"] => ok(&json!({
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": [api_group("discovery.k8s.io")],
        })),
        ["apis", "discovery.k8s.io"] => {
            let mut g = api_group("discovery.k8s.io");
            g["kind"] = json!("APIGroup");
            g["apiVersion"] = json!("v1");
            ok(&g)
        }
        ["api", "v1"] => ok(&resource_list("")),
        ["apis", "discovery.k8s.io", "v1"] => ok(&resource_list("discovery.k8s.io")),
        _ => match parse_resource(&segs) {
            None => not_found("the server could not find the requested resource"),
            Some(Err(resp)) => resp,
            Some(Ok(t))
                if t.kind == Kind::ServiceCIDR
                    && !shared
                        .service_cidrs
                        .load(std::sync::atomic::Ordering::SeqCst) =>
            {
                not_found("the server could not find the requested resource (servicecidrs)")
            }
            Some(Ok(t)) => resource(shared, t, q).await,
        },
    };
    Ok(resp)
}

fn version() -> Value {
    json!({
        "major": "1",
        "minor": "33",
        "gitVersion": "v1.33.0-lb-fixture",
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2025-01-01T00:00:00Z",
        "goVersion": "go1.24.0",
        "compiler": "gc",
        "platform": "linux/amd64",
    })
}

fn api_group(group: &str) -> Value {
    let gv = json!({"groupVersion": format!("{group}/v1"), "version": "v1"});
    json!({"name": group, "versions": [gv.clone()], "preferredVersion": gv})
}

const VERBS: [&str; 3] = ["get", "list", "watch"];

fn resource_list(group: &str) -> Value {
    let resources: Vec<Value> = Kind::ALL
        .into_iter()
        .filter(|k| k.group() == group)
        .map(|k| {
            json!({
                "name": k.plural(),
                "singularName": k.singular(),
                "namespaced": k.namespaced(),
                "kind": k.kind(),
                "verbs": VERBS,
                "shortNames": k.short_names(),
            })
        })
        .collect();
    let gv = if group.is_empty() {
        "v1".to_string()
    } else {
        format!("{group}/v1")
    };
    json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources})
}

fn aggregated_discovery(group: &str) -> Resp {
    let resources: Vec<Value> = Kind::ALL
        .into_iter()
        .filter(|k| k.group() == group)
        .map(|k| {
            json!({
                "resource": k.plural(),
                "responseKind": {"group": "", "version": "", "kind": k.kind()},
                "scope": if k.namespaced() { "Namespaced" } else { "Cluster" },
                "singularResource": k.singular(),
                "verbs": VERBS,
                "shortNames": k.short_names(),
            })
        })
        .collect();
    let body = json!({
        "kind": "APIGroupDiscoveryList",
        "apiVersion": "apidiscovery.k8s.io/v2",
        "metadata": {},
        "items": [{
            "metadata": if group.is_empty() { json!({"creationTimestamp": null}) }
                        else { json!({"name": group, "creationTimestamp": null}) },
            "versions": [{"version": "v1", "resources": resources, "freshness": "Current"}],
        }],
    });
    let mut r = ok(&body);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(AGGREGATED),
    );
    r
}

#[allow(clippy::result_large_err)]
fn filter_of(t: &Target, q: &Query) -> Result<Filter, Resp> {
    let labels = LabelSelector::parse(q.get("labelSelector").unwrap_or(""))
        .map_err(|e| bad_request(&format!("unable to parse requirement: {e}")))?;
    let fields = FieldSelector::parse(q.get("fieldSelector").unwrap_or(""))
        .map_err(|e| bad_request(&format!("invalid field selector: {e}")))?;
    Ok(Filter {
        namespace: t.namespace.clone(),
        labels,
        fields,
    })
}

async fn resource(shared: Arc<Shared>, t: Target, q: Query) -> Resp {
    let kind = t.kind;
    let watch = t.watch_path || q.flag("watch");
    let counters = shared.counters(kind);
    if let Some(name) = &t.name {
        if !watch {
            counters.gets.fetch_add(1, Ordering::SeqCst);
            delay(&shared).await;
            return get(&shared, kind, t.namespace.as_deref(), name);
        }
    }
    if watch {
        counters.watches.fetch_add(1, Ordering::SeqCst);
    } else {
        counters.lists.fetch_add(1, Ordering::SeqCst);
    }
    let mut filter = match filter_of(&t, &q) {
        Ok(f) => f,
        Err(r) => return r,
    };
    if let Some(name) = &t.name {
        // A watch on one object: the apiserver turns it into a field selector.
        match FieldSelector::parse(&format!("metadata.name={name}")) {
            Ok(f) if filter.fields.is_empty() => filter.fields = f,
            _ => return bad_request("a named watch cannot also have a field selector"),
        }
    }
    delay(&shared).await;
    if watch {
        watch_response(shared, kind, filter, &q)
    } else {
        list(&shared, kind, &filter, &q)
    }
}

async fn delay(shared: &Shared) {
    let d = shared.delay();
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}

fn get(shared: &Shared, kind: Kind, namespace: Option<&str>, name: &str) -> Resp {
    let key = super::store::object_key(namespace, name);
    match lock(&shared.store).kind(kind).objects.get(&key) {
        Some(o) => ok(o),
        None => {
            let mut s = status_object(
                404,
                "NotFound",
                &format!("{} \"{name}\" not found", kind.plural()),
            );
            s["details"] = json!({"name": name, "group": kind.group(), "kind": kind.plural()});
            json_response(StatusCode::NOT_FOUND, &s)
        }
    }
}

#[allow(clippy::result_large_err)]
fn parse_rv(s: &str) -> Result<u64, Resp> {
    s.parse::<u64>()
        .map_err(|_| bad_request(&format!("invalid resource version {s:?}")))
}

/// A continue token: the snapshot resourceVersion and the first key of the
/// next page, shaped like kube-apiserver's.
fn encode_continue(rv: u64, start: &str) -> String {
    let j = json!({"v": "meta.k8s.io/v1", "rv": rv, "start": format!("{start}\u{0}")});
    URL_SAFE_NO_PAD.encode(serde_json::to_vec(&j).expect("JSON"))
}

fn decode_continue(token: &str) -> Option<(u64, String)> {
    let raw = URL_SAFE_NO_PAD.decode(token.trim_end_matches('=')).ok()?;
    let j: Value = serde_json::from_slice(&raw).ok()?;
    if j.get("v")?.as_str()? != "meta.k8s.io/v1" {
        return None;
    }
    Some((
        j.get("rv")?.as_u64()?,
        j.get("start")?.as_str()?.to_string(),
    ))
}

fn too_large(rv: u64, current: u64) -> Resp {
    let mut s = status_object(
        504,
        "Timeout",
        &format!("Too large resource version: {rv}, current: {current}"),
    );
    s["details"] = json!({"causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}], "retryAfterSeconds": 1});
    json_response(StatusCode::GATEWAY_TIMEOUT, &s)
}

fn list(shared: &Shared, kind: Kind, filter: &Filter, q: &Query) -> Resp {
    let limit = match q.get("limit").filter(|s| !s.is_empty()) {
        None => None,
        Some(s) => match s.parse::<u64>() {
            Ok(0) => None,
            Ok(n) => Some(n as usize),
            Err(_) => return bad_request(&format!("invalid limit {s:?}")),
        },
    };
    let rv_param = q.get("resourceVersion").filter(|s| !s.is_empty());
    let rv_match = q.get("resourceVersionMatch").filter(|s| !s.is_empty());
    let st = lock(&shared.store);
    let current = st.rv;
    let (snapshot_rv, start) = if let Some(token) = q.get("continue").filter(|s| !s.is_empty()) {
        if rv_param.is_some() || rv_match.is_some() {
            return bad_request("specifying resource version is not allowed when using continue");
        }
        match decode_continue(token) {
            Some((rv, start)) => (Some(rv), Some(start)),
            None => {
                return bad_request(
                    "continue key is not valid: incorrect encoded start resourceVersion",
                )
            }
        }
    } else {
        let rv = match rv_param.map(parse_rv).transpose() {
            Ok(rv) => rv,
            Err(r) => return r,
        };
        match (rv, rv_match) {
            (None, Some(_)) => {
                return bad_request(
                    "resourceVersionMatch: Forbidden: resourceVersionMatch is forbidden unless resourceVersion is provided",
                )
            }
            (None, None) | (Some(0), None | Some("NotOlderThan")) => (None, None),
            (Some(0), Some(m)) => {
                return bad_request(&format!(
                    "resourceVersionMatch: Forbidden: resourceVersionMatch \"{m}\" is forbidden for resourceVersion \"0\""
                ))
            }
            (Some(n), Some("NotOlderThan")) => {
                if n > current {
                    return too_large(n, current);
                }
                (None, None)
            }
            (Some(n), Some("Exact")) => (Some(n), None),
            // Legacy semantics: an exact read when paginating, otherwise
            // "not older than".
            (Some(n), None) if limit.is_some() => (Some(n), None),
            (Some(n), None) => {
                if n > current {
                    return too_large(n, current);
                }
                (None, None)
            }
            (Some(_), Some(m)) => {
                return bad_request(&format!(
                    "resourceVersionMatch: Unsupported value: \"{m}\": supported values: \"Exact\", \"NotOlderThan\", \"\""
                ))
            }
        }
    };
    let (rv, objects) = match snapshot_rv {
        None => (current, Cow::Borrowed(&st.kind(kind).objects)),
        Some(rv) => match st.snapshot(kind, rv) {
            Snapshot::Ok(o) => (rv, o),
            Snapshot::TooLarge => return too_large(rv, current),
            Snapshot::Expired if start.is_some() => {
                return json_response(
                    StatusCode::GONE,
                    &expired_status(
                        "The provided continue parameter is too old to display a consistent list result. \
                         You can start a new list without the continue parameter.",
                    ),
                )
            }
            Snapshot::Expired => {
                return json_response(
                    StatusCode::GONE,
                    &expired_status(&format!("too old resource version: {rv} ({})", st.kind(kind).floor)),
                )
            }
        },
    };
    let mut matching = objects
        .range(start.unwrap_or_default()..)
        .filter(|(_, o)| filter.matches(o));
    let mut items = Vec::new();
    let mut last_key = None;
    let mut more = false;
    for (k, o) in matching.by_ref() {
        if limit.is_some_and(|l| items.len() >= l) {
            more = true;
            break;
        }
        items.push(Arc::clone(o));
        last_key = Some(k.clone());
    }
    // kube-apiserver gives remainingItemCount only to lists without a
    // selector; counting is a walk over the rest of the snapshot.
    let remaining = (more && !filter.is_selective()).then(|| 1 + matching.count());
    drop(objects);
    drop(st);
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if more {
        let last = last_key.expect("a full page");
        metadata["continue"] = json!(encode_continue(rv, &last));
        if let Some(remaining) = remaining {
            metadata["remainingItemCount"] = json!(remaining);
        }
    }
    let mut body = serde_json::to_vec(&json!({
        "kind": kind.list_kind(),
        "apiVersion": kind.api_version(),
        "metadata": metadata,
    }))
    .expect("JSON");
    // Each item's text was written when the object was stored.
    body.reserve(items.iter().map(|o| o.list_item().len() + 1).sum::<usize>() + 16);
    body.pop();
    body.extend_from_slice(br#","items":["#);
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            body.push(b',');
        }
        body.extend_from_slice(item.list_item());
    }
    body.extend_from_slice(b"]}");
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, JSON)
        .header(header::CACHE_CONTROL, "no-cache, private")
        .body(Body::from(body))
        .expect("response")
}

fn event_line(etype: &str, object: &Value) -> Bytes {
    let mut v = serde_json::to_vec(&json!({"type": etype, "object": object})).expect("JSON");
    v.push(b'\n');
    Bytes::from(v)
}

/// The state of one watch response body.
struct WatchBody {
    queue: VecDeque<Bytes>,
    rx: Option<mpsc::UnboundedReceiver<Msg>>,
    deadline: tokio::time::Instant,
    filter: Filter,
    kind: Kind,
    bookmarks: bool,
    /// Live events at or below this version were asked to be skipped (a
    /// watch from a resourceVersion newer than the store's at its start).
    min_rv: u64,
    done: bool,
    shared: Arc<Shared>,
    _open: OpenWatchGuard,
}

impl WatchBody {
    async fn next(&mut self) -> Option<Bytes> {
        loop {
            if let Some(b) = self.queue.pop_front() {
                return Some(b);
            }
            if self.done {
                return None;
            }
            let rx = self.rx.as_mut()?;
            tokio::select! {
                _ = tokio::time::sleep_until(self.deadline) => return None,
                msg = rx.recv() => match msg {
                    None => return None,
                    Some(Msg::Event(ev)) => {
                        if ev.rv > self.min_rv {
                            if let Some((t, o)) = self.filter.convert(&ev) {
                                self.queue.push_back(event_line(t.as_str(), &o));
                            }
                        }
                    }
                    Some(Msg::Bookmark(rv)) => {
                        if self.bookmarks && rv > self.min_rv {
                            self.queue
                                .push_back(event_line("BOOKMARK", &bookmark_object(self.kind, rv, false)));
                        }
                    }
                    Some(Msg::Expire) => {
                        self.shared.counters(self.kind).expired.fetch_add(1, Ordering::SeqCst);
                        self.queue.push_back(event_line(
                            "ERROR",
                            &expired_status("too old resource version (the watch was expired by the test)"),
                        ));
                        self.done = true;
                    }
                },
            }
        }
    }
}

fn watch_response(shared: Arc<Shared>, kind: Kind, filter: Filter, q: &Query) -> Resp {
    let bookmarks = q.flag("allowWatchBookmarks");
    let send_initial = q.flag("sendInitialEvents");
    let rv_param = q.get("resourceVersion").filter(|s| !s.is_empty());
    let rv_match = q.get("resourceVersionMatch").filter(|s| !s.is_empty());
    if send_initial && rv_match != Some("NotOlderThan") {
        return bad_request(
            "resourceVersionMatch: Forbidden: sendInitialEvents requires setting resourceVersionMatch to NotOlderThan",
        );
    }
    if !send_initial && rv_match.is_some() {
        return bad_request(
            "resourceVersionMatch: Forbidden: resourceVersionMatch is forbidden for watch unless sendInitialEvents is provided",
        );
    }
    let rv = match rv_param.map(parse_rv).transpose() {
        Ok(rv) => rv,
        Err(r) => return r,
    };
    let requested = match q.get("timeoutSeconds").filter(|s| !s.is_empty()) {
        None => std::time::Duration::from_secs(1800),
        Some(s) => match s.parse::<u64>() {
            Ok(n) => std::time::Duration::from_secs(n),
            Err(_) => return bad_request(&format!("invalid timeoutSeconds {s:?}")),
        },
    };
    let cap = lock(&shared.tunables).watch_timeout_cap;
    let timeout = requested.min(cap);

    let mut queue = VecDeque::new();
    let mut done = false;
    let mut min_rv = 0;
    let (tx, rx) = mpsc::unbounded_channel();
    {
        let mut st = lock(&shared.store);
        let current = st.rv;
        let initial_state = send_initial || matches!(rv, None | Some(0));
        if initial_state {
            // "Start at most recent" / "any" / streaming list: the current
            // state as ADDED events, then live ones.
            for o in st.kind(kind).objects.values() {
                if filter.matches(o) {
                    queue.push_back(event_line("ADDED", o));
                }
            }
            if send_initial {
                queue.push_back(event_line(
                    "BOOKMARK",
                    &bookmark_object(kind, current, true),
                ));
            }
        } else {
            let n = rv.expect("a resourceVersion");
            match st.events_since(kind, n) {
                None => {
                    shared.counters(kind).expired.fetch_add(1, Ordering::SeqCst);
                    queue.push_back(event_line(
                        "ERROR",
                        &expired_status(&format!(
                            "too old resource version: {n} ({})",
                            st.kind(kind).floor
                        )),
                    ));
                    done = true;
                }
                Some(evs) => {
                    min_rv = n;
                    for ev in evs {
                        if let Some((t, o)) = filter.convert(&ev) {
                            queue.push_back(event_line(t.as_str(), &o));
                        }
                    }
                }
            }
        }
        if !done {
            st.watchers.push(Watcher {
                kind,
                bookmarks,
                tx,
            });
        }
    }
    let body = WatchBody {
        queue,
        rx: (!done).then_some(rx),
        deadline: tokio::time::Instant::now() + timeout,
        filter,
        kind,
        bookmarks,
        min_rv,
        done,
        shared: shared.clone(),
        _open: OpenWatchGuard::new(shared, kind),
    };
    let stream = futures_util::stream::unfold(body, |mut b| async move {
        b.next().await.map(|bytes| (Ok::<_, Infallible>(bytes), b))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, JSON)
        .header(header::CACHE_CONTROL, "no-cache, private")
        .body(Body::from_stream(stream))
        .expect("response")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_decoding() {
        let q = Query::parse(Some(
            "labelSelector=%21service.kubernetes.io%2Fservice-proxy-name&watch=1&x=a+b",
        ));
        assert_eq!(
            q.get("labelSelector"),
            Some("!service.kubernetes.io/service-proxy-name")
        );
        assert!(q.flag("watch"));
        assert_eq!(q.get("x"), Some("a b"));
        assert_eq!(decode_component("100%"), "100%");
        assert_eq!(decode_component("%4"), "%4");
    }

    #[test]
    fn continue_tokens() {
        let t = encode_continue(42, "demo/web");
        assert_eq!(decode_continue(&t), Some((42, "demo/web\u{0}".to_string())));
        assert_eq!(decode_continue("garbage"), None);
    }
}
