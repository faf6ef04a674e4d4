//! Label and field selectors, as kube-apiserver parses them from the
//! `labelSelector` / `fieldSelector` query parameters.

use serde_json::Value;

/// One label requirement.
#[derive(Debug, Clone, PartialEq, Eq)]
enum LabelReq {
    Exists(String),
    NotExists(String),
    Eq(String, String),
    NotEq(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

/// A parsed `labelSelector`: every requirement must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector(Vec<LabelReq>);

/// Splits on commas that are not inside parentheses.
fn split_top(s: &str) -> Result<Vec<&str>, String> {
    let mut out = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth < 0 {
                    return Err(format!("unbalanced ')' in {s:?}"));
                }
            }
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(format!("unbalanced '(' in {s:?}"));
    }
    out.push(&s[start..]);
    Ok(out)
}

fn valid_key(k: &str) -> bool {
    !k.is_empty()
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
}

fn valid_value(v: &str) -> bool {
    v.chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

fn parse_set(key: &str, rest: &str) -> Result<Vec<String>, String> {
    let rest = rest.trim();
    let inner = rest
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(|| format!("expected a parenthesised set after {key:?}, got {rest:?}"))?;
    let vals: Vec<String> = inner
        .split(',')
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .collect();
    if vals.iter().any(|v| !valid_value(v)) {
        return Err(format!("invalid label value in set {rest:?}"));
    }
    Ok(vals)
}

impl LabelSelector {
    /// Parses `key`, `!key`, `key=value`, `key==value`, `key!=value`,
    /// `key in (a,b)`, `key notin (a,b)`, comma-separated.
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut reqs = Vec::new();
        if s.trim().is_empty() {
            return Ok(Self(reqs));
        }
        for term in split_top(s)? {
            let term = term.trim();
            if term.is_empty() {
                return Err(format!("empty term in label selector {s:?}"));
            }
            let req = if let Some(k) = term.strip_prefix('!') {
                let k = k.trim();
                if !valid_key(k) {
                    return Err(format!("invalid label key {k:?}"));
                }
                LabelReq::NotExists(k.to_string())
            } else if let Some((k, v)) = term.split_once("!=") {
                LabelReq::NotEq(k.trim().to_string(), v.trim().to_string())
            } else if let Some((k, v)) = term.split_once("==") {
                LabelReq::Eq(k.trim().to_string(), v.trim().to_string())
            } else if let Some((k, v)) = term.split_once('=') {
                LabelReq::Eq(k.trim().to_string(), v.trim().to_string())
            } else if let Some((k, rest)) = term.split_once(" notin ") {
                LabelReq::NotIn(k.trim().to_string(), parse_set(k, rest)?)
            } else if let Some((k, rest)) = term.split_once(" in ") {
                LabelReq::In(k.trim().to_string(), parse_set(k, rest)?)
            } else {
                LabelReq::Exists(term.to_string())
            };
            let (key, value) = match &req {
                LabelReq::Eq(k, v) | LabelReq::NotEq(k, v) => (k, Some(v)),
                LabelReq::Exists(k)
                | LabelReq::NotExists(k)
                | LabelReq::In(k, _)
                | LabelReq::NotIn(k, _) => (k, None),
            };
            if !valid_key(key) {
                return Err(format!("invalid label key {key:?} in {s:?}"));
            }
            if let Some(v) = value {
                if !valid_value(v) {
                    return Err(format!("invalid label value {v:?} in {s:?}"));
                }
            }
            reqs.push(req);
        }
        Ok(Self(reqs))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `obj`'s `metadata.labels` satisfy every requirement.
    pub fn matches(&self, obj: &Value) -> bool {
        // Not `pointer`, which allocates for each step of its path.
        let labels = obj
            .get("metadata")
            .and_then(|m| m.get("labels"))
            .and_then(Value::as_object);
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        self.0.iter().all(|r| match r {
            LabelReq::Exists(k) => get(k).is_some(),
            LabelReq::NotExists(k) => get(k).is_none(),
            LabelReq::Eq(k, v) => get(k) == Some(v.as_str()),
            LabelReq::NotEq(k, v) => get(k) != Some(v.as_str()),
            LabelReq::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            LabelReq::NotIn(k, vs) => !get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
        })
    }
}

/// A parsed `fieldSelector`: `path=value`, `path==value`, `path!=value`,
/// comma-separated, where `path` is a dotted JSON path such as
/// `metadata.name`, `metadata.namespace` or `spec.clusterIP` (a missing
/// field compares as the empty string).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector(Vec<(String, bool, String)>);

impl FieldSelector {
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut reqs = Vec::new();
        if s.trim().is_empty() {
            return Ok(Self(reqs));
        }
        for term in s.split(',') {
            let term = term.trim();
            let (path, eq, value) = if let Some((k, v)) = term.split_once("!=") {
                (k, false, v)
            } else if let Some((k, v)) = term.split_once("==") {
                (k, true, v)
            } else if let Some((k, v)) = term.split_once('=') {
                (k, true, v)
            } else {
                return Err(format!("invalid field selector term {term:?}"));
            };
            let path = path.trim();
            if path.is_empty()
                || !path
                    .split('.')
                    .all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_alphanumeric()))
            {
                return Err(format!("invalid field path {path:?}"));
            }
            reqs.push((path.to_string(), eq, value.trim().to_string()));
        }
        Ok(Self(reqs))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn matches(&self, obj: &Value) -> bool {
        self.0.iter().all(|(path, eq, want)| {
            let mut cur = Some(obj);
            for p in path.split('.') {
                cur = cur.and_then(|c| c.get(p));
            }
            let got = match cur {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(other) => other.to_string(),
            };
            (got == *want) == *eq
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(labels: Value) -> Value {
        json!({"metadata": {"name": "a", "namespace": "ns", "labels": labels}, "spec": {"clusterIP": "None"}})
    }

    #[test]
    fn labels() {
        let o = obj(json!({"app": "web", "tier": "front"}));
        let m = |s: &str| LabelSelector::parse(s).unwrap().matches(&o);
        assert!(m(""));
        assert!(m("app"));
        assert!(!m("!app"));
        assert!(m("!service.kubernetes.io/service-proxy-name"));
        assert!(m("app=web,tier==front"));
        assert!(!m("app!=web"));
        assert!(m("nope!=x"));
        assert!(m("app in (web, db),tier notin (back)"));
        assert!(!m("app notin (web)"));
        assert!(m("missing notin (x)"));
        assert!(!m("missing in (x)"));
        assert!(LabelSelector::parse("a=b=c").is_err());
        assert!(LabelSelector::parse("a in (x").is_err());
        assert!(LabelSelector::parse(",").is_err());
    }

    #[test]
    fn fields() {
        let o = obj(json!({}));
        let m = |s: &str| FieldSelector::parse(s).unwrap().matches(&o);
        assert!(m("metadata.name=a"));
        assert!(!m("metadata.name=b"));
        assert!(m("metadata.name!=b,metadata.namespace==ns"));
        assert!(m("spec.clusterIP=None"));
        assert!(m("spec.missing="));
        assert!(FieldSelector::parse("metadata.name").is_err());
    }
}
