//! The agent: keeps the kernel's load-balancing maps in sync with Services.
//!
//! Folders are layers; a module may use the ones below it, never one above
//! (`tests/layers.rs` checks it):
//!
//! | layer | holds |
//! |---|---|
//! | `cli`, `check`, `inspect`, `run` | the command line, `lb-agent check` and `inspect`, and the wiring of `run` |
//! | `serve` | health (`/healthz`, `/livez`), readiness, metrics and health-check node ports over HTTP |
//! | `datapath` | loading and pinning, the reconciler, tc, affinity, socket destruction |
//! | `semantics` | pure Kubernetes semantics: objects in, desired state out; kube-proxy's health rules |
//! | `input` | manifests directory, API watchers, and the store they feed |
//! | `base` | address conversions, the kernel clock, the metrics registry |
//!
//! `serve` and `datapath` do not use each other.
pub mod base;
pub mod check;
pub mod cli;
pub mod datapath;
pub mod input;
pub mod inspect;
pub mod run;
pub mod semantics;
pub mod serve;
