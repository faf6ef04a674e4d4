//! Fuzz targets of the whole input path: manifest decoding (YAML with
//! anchors and alias bombs, JSON, Lists), the translation to a desired
//! state and the reconciler writing it into maps (the unit tests' fake
//! maps, which check after every write that what a program could read
//! resolves). Inputs are the seeds of `fuzz/corpus/manifests/` mutated
//! byte-wise and field-wise, and token soup. `cargo xtask fuzz` runs them
//! longer; see `base::fuzz`.
//!
//! Properties: nothing panics; each case finishes within a generous bound
//! (against quadratic blowups, not a speed test); every rejection names
//! its file, its object and, for an object that was recognised, the field;
//! what is decoded is bounded by the input; the reconciler's maps hold the
//! desired state, a second sync writes nothing, and an empty state leaves
//! empty maps.
use std::time::{Duration, Instant};

use proptest::{prelude::*, sample::Index};
use serde::Deserialize as _;
use serde_json::Value;

use crate::{
    base::fuzz::{self, Grammar},
    datapath::reconcile::{
        tests::{retire_all, FakeMaps},
        Reconciler,
    },
    input::{
        manifest::{load_str, Format},
        store::{NodeInfo, Rejection, Store},
    },
    semantics::{
        model::{Algorithm, DesiredState},
        translate::{translate, TranslateOptions},
    },
};

/// Cases of each target in the bounded run of `cargo xtask test`.
const SHORT: u32 = 256;

/// A case that takes longer than this is a blowup (every seed takes a
/// few milliseconds).
const CASE_BOUND: Duration = Duration::from_secs(2);

const GRAMMAR: Grammar = Grammar {
    tokens: &[
        b"\n---\n",
        b"\n...\n",
        b": ",
        b"- ",
        b"&a ",
        b"*a",
        b"<<: *a",
        b"!!binary ",
        b"!!str ",
        b"!!int ",
        b"? ",
        b"|\n  ",
        b"[",
        b"]",
        b"{",
        b"}",
        b",",
        b"\"",
        b"'",
        b"\\u0000",
        b"\\ud800",
        b"null",
        b"~",
        b"true",
        b"-1",
        b"0",
        b"65536",
        b"99999999999999999999",
        b"1e400",
        b"0x50",
        b"\"::ffff:10.1.2.3\"",
        b"\"10.96.0.10\"",
        b"fd00::1",
        b"kind: Service",
        b"kind: List",
        b"kind: EndpointSlice",
        b"apiVersion: v1",
        b"\"kind\": \"List\"",
        b"\"items\": [",
        b"metadata: {name: x}",
        b"ports: [{port: 80}]",
        b"addresses: [10.244.1.1]",
        b"nodePort: 30080",
        b"type: NodePort",
        b"type: LoadBalancer",
        b"clusterIP: None",
        b"ipFamilies: [IPv6]",
        b"sessionAffinity: ClientIP",
        b"externalTrafficPolicy: Local",
        b"kubernetes.io/service-name: web",
        b"\t",
        b"\r\n",
        b"\xef\xbb\xbf",
        b"\xff",
    ],
    offsets: &[],
};

/// Values a field-aware mutation puts in place of a field's value.
fn odd_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        Just(serde_json::json!(-1)),
        Just(serde_json::json!(0)),
        Just(serde_json::json!(65536)),
        Just(serde_json::json!(u64::MAX)),
        Just(serde_json::json!(1.5)),
        Just(serde_json::json!("")),
        Just(serde_json::json!("x".repeat(300))),
        Just(serde_json::json!("10.96.0.10")),
        Just(serde_json::json!("fd00::10")),
        Just(serde_json::json!("::ffff:10.96.0.10")),
        Just(serde_json::json!("0.0.0.0")),
        Just(serde_json::json!("10.96.0.0/12")),
        Just(serde_json::json!(true)),
        Just(serde_json::json!([])),
        Just(serde_json::json!({})),
        Just(serde_json::json!([null, {"port": 80}])),
        "[a-zA-Z0-9:./-]{0,12}".prop_map(Value::String),
        any::<i64>().prop_map(Value::from),
    ]
}

/// A field-aware change: the value at one node of the document's tree
/// (counted depth-first) replaced, or the node removed from its parent.
#[derive(Clone, Debug)]
enum FieldChange {
    Replace(Index, Value),
    Remove(Index),
}

fn field_change() -> impl Strategy<Value = FieldChange> {
    prop_oneof![
        3 => (any::<Index>(), odd_value()).prop_map(|(i, v)| FieldChange::Replace(i, v)),
        1 => any::<Index>().prop_map(FieldChange::Remove),
    ]
}

fn count_nodes(v: &Value) -> usize {
    1 + match v {
        Value::Array(a) => a.iter().map(count_nodes).sum(),
        Value::Object(o) => o.values().map(count_nodes).sum(),
        _ => 0,
    }
}

/// Applies `change` to the `n`th node below `v` (depth-first, `v` is 0).
fn change_node(v: &mut Value, n: &mut usize, change: &FieldChange) -> bool {
    let len = match v {
        Value::Array(a) => a.len(),
        Value::Object(o) => o.len(),
        _ => return false,
    };
    for i in 0..len {
        *n -= 1;
        if *n == 0 {
            match (change, &mut *v) {
                (FieldChange::Replace(_, value), Value::Array(a)) => a[i] = value.clone(),
                (FieldChange::Replace(_, value), Value::Object(o)) => {
                    *o.values_mut().nth(i).unwrap() = value.clone()
                }
                (FieldChange::Remove(_), Value::Array(a)) => {
                    a.remove(i);
                }
                (FieldChange::Remove(_), Value::Object(o)) => {
                    let key = o.keys().nth(i).unwrap().clone();
                    o.remove(&key);
                }
                _ => unreachable!("only containers have children"),
            }
            return true;
        }
        let child = match v {
            Value::Array(a) => &mut a[i],
            Value::Object(o) => o.values_mut().nth(i).unwrap(),
            _ => unreachable!("only containers have children"),
        };
        if change_node(child, n, change) {
            return true;
        }
    }
    false
}

/// The seeds as JSON trees: every document of each (YAML or JSON) seed
/// that parses, each one a seed of its own.
fn trees(seeds: &[fuzz::Seed]) -> Vec<Value> {
    let mut out = Vec::new();
    for seed in seeds {
        let text = String::from_utf8_lossy(&seed.bytes);
        for doc in serde_yaml::Deserializer::from_str(&text) {
            // After an error the parser cannot go on (it panics).
            let Ok(v) = Value::deserialize(doc) else {
                break;
            };
            if v.is_object() {
                out.push(v);
            }
        }
    }
    out
}

/// A case: the text, how it is encoded and what it stands for.
#[derive(Clone, Debug)]
struct Case {
    what: String,
    format: Format,
    text: String,
}

fn case() -> impl Strategy<Value = Case> {
    let seeds = fuzz::corpus("manifests");
    let trees = trees(&seeds);
    assert!(trees.len() >= 8, "the manifest seeds parse");
    let format_of = |name: &str| {
        if name.ends_with(".json") {
            Format::Json
        } else {
            Format::Yaml
        }
    };
    let bytes = fuzz::mutated(seeds, GRAMMAR, 8).prop_map(move |(name, bytes)| Case {
        format: format_of(&name),
        what: format!("mutated {name}"),
        text: String::from_utf8_lossy(&bytes).into_owned(),
    });
    let fields = (
        any::<Index>(),
        prop::collection::vec(field_change(), 1..6),
        any::<bool>(),
    )
        .prop_map(move |(i, changes, json)| {
            let mut tree = trees[i.index(trees.len())].clone();
            for c in &changes {
                let (FieldChange::Replace(at, _) | FieldChange::Remove(at)) = c;
                let nodes = count_nodes(&tree);
                if nodes > 1 {
                    let mut n = 1 + at.index(nodes - 1);
                    change_node(&mut tree, &mut n, c);
                }
            }
            let (format, text) = if json {
                (Format::Json, serde_json::to_string(&tree).unwrap())
            } else {
                (Format::Yaml, serde_yaml::to_string(&tree).unwrap())
            };
            Case {
                what: format!("fields changed: {changes:?}"),
                format,
                text,
            }
        });
    let soup = (fuzz::generated(GRAMMAR, 48), any::<bool>()).prop_map(|(bytes, json)| Case {
        what: "generated".into(),
        format: if json { Format::Json } else { Format::Yaml },
        text: String::from_utf8_lossy(&bytes).into_owned(),
    });
    prop_oneof![4 => bytes, 3 => fields, 1 => soup]
}

const SOURCE: &str = "fuzz/manifest";

/// A rejection of the manifest layer names its file and an object: the
/// object (`Kind namespace/name`, known kind or not), or the document or
/// List item when the object has no name ("" only for a file that did not
/// parse at all). One that names the object also names the field.
fn check_decoding(r: &Rejection) -> Result<(), TestCaseError> {
    prop_assert_eq!(&r.source, SOURCE, "{}", r);
    prop_assert!(!r.reason.is_empty(), "{}", r);
    if r.object.is_empty() {
        prop_assert!(r.field.is_empty(), "{}", r);
    } else if !r.object.starts_with("document ") {
        prop_assert!(!r.field.is_empty(), "no field: {}", r);
    }
    Ok(())
}

/// A translation's rejection names the object (a Service, or the
/// EndpointSlice or Endpoints it ignored) and the field.
fn check_translation(r: &Rejection) -> Result<(), TestCaseError> {
    prop_assert!(!r.source.is_empty(), "{}", r);
    let named = ["Service ", "EndpointSlice ", "Endpoints "]
        .iter()
        .any(|k| r.object.starts_with(k) && r.object.contains('/'));
    prop_assert!(named, "object: {}", r);
    prop_assert!(!r.field.is_empty(), "no field: {}", r);
    Ok(())
}

/// What is decoded is bounded by the input: however many aliases repeat
/// a node, the store (as printed) stays within a multiple of the text.
fn check_bounded(store: &Store, text: &str) -> Result<(), TestCaseError> {
    let decoded = format!("{store:?}").len();
    let bound = 64 * text.len() + 4096;
    prop_assert!(
        decoded <= bound,
        "{decoded} bytes decoded from {}",
        text.len()
    );
    Ok(())
}

fn opts(algorithm: Algorithm) -> TranslateOptions {
    TranslateOptions {
        default_algorithm: algorithm,
        node_addresses: vec![
            "192.168.77.1".parse().unwrap(),
            "fd00:77::1".parse().unwrap(),
        ],
        ..TranslateOptions::default()
    }
}

/// Syncs `desired` into fresh fake maps, then again (nothing to write),
/// then an empty state (nothing left).
fn check_reconciler(desired: &DesiredState) -> Result<(), TestCaseError> {
    let mut r = Reconciler::new(251, lb_common::capacity::SLOTS);
    let mut m = FakeMaps::default();
    let report = r.apply(desired, &mut m);
    prop_assert!(report.errors.is_empty(), "{:?}", report.errors);
    prop_assert!(retire_all(&mut r, &mut m).is_empty());
    prop_assert_eq!(r.frontend_count(), desired.frontends.len());
    prop_assert!(m.services.len() <= desired.frontends.len() + desired.vips.len());

    let writes = m.writes;
    let again = r.apply(desired, &mut m);
    prop_assert!(retire_all(&mut r, &mut m).is_empty());
    prop_assert_eq!(
        (again.frontends_written, again.backends_written, m.writes),
        (0, 0, writes),
        "a second sync of the same state wrote"
    );

    r.apply(&DesiredState::default(), &mut m);
    prop_assert!(retire_all(&mut r, &mut m).is_empty());
    prop_assert!(
        m.services.is_empty() && m.slots.is_empty() && m.backends.is_empty() && m.maglev.is_empty(),
        "left after an empty sync: {} services, {} slots, {} backends, {} tables",
        m.services.len(),
        m.slots.len(),
        m.backends.len(),
        m.maglev.len()
    );
    Ok(())
}

fn run_case(case: &Case, algorithm: Algorithm) -> Result<(), TestCaseError> {
    let started = Instant::now();
    let (store, rejections) = load_str(SOURCE, &case.text, case.format);
    for r in &rejections {
        check_decoding(r)?;
    }
    check_bounded(&store, &case.text)?;
    let node = NodeInfo {
        name: "node-a".into(),
        zone: Some("zone-a".into()),
    };
    let (desired, rejections) = translate(&store, &node, &opts(algorithm));
    for r in &rejections {
        check_translation(r)?;
    }
    check_reconciler(&desired)?;
    let took = started.elapsed();
    prop_assert!(took < CASE_BOUND, "took {took:?}");
    Ok(())
}

proptest! {
    #![proptest_config(fuzz::config(SHORT))]

    #[test]
    fn fuzz_manifests_translation_and_reconciler(case in case(), maglev in any::<bool>()) {
        let algorithm = if maglev { Algorithm::Maglev } else { Algorithm::Random };
        run_case(&case, algorithm).map_err(|e| {
            TestCaseError::fail(format!("{e}\n{}, {:?}:\n{}", case.what, case.format, case.text))
        })?;
    }
}

/// Every seed as it is: decodes within the bound, and the caps hold (the
/// deep seeds and the alias bomb are rejected, naming why).
#[test]
fn fuzz_seeds_as_they_are() {
    for seed in fuzz::corpus("manifests") {
        let format = if seed.name.ends_with(".json") {
            Format::Json
        } else {
            Format::Yaml
        };
        let case = Case {
            what: seed.name.clone(),
            format,
            text: String::from_utf8(seed.bytes).unwrap(),
        };
        if let Err(e) = run_case(&case, Algorithm::Maglev) {
            panic!("{}: {e}", seed.name);
        }
        let (_, rejections) = load_str(SOURCE, &case.text, format);
        let want = match seed.name.as_str() {
            "deep-flow.yaml" => Some("nested more than 1000 deep"),
            "deep-block.yaml" => Some("recursion limit exceeded"),
            "alias-bomb.yaml" => Some("repetition limit exceeded"),
            _ => None,
        };
        if let Some(want) = want {
            assert!(
                rejections.iter().any(|r| r.reason.contains(want)),
                "{}: {rejections:#?}",
                seed.name
            );
        }
    }
}
