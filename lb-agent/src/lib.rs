//! The agent: keeps the kernel's load-balancing maps in sync with Services.
pub mod cli;
pub mod model;
pub mod reconcile;
pub mod datapath;
pub mod health;
pub mod inspect;
pub mod maglev;
pub mod affinity;
pub mod store;
pub mod manifest;
pub mod translate;
pub mod run;
pub mod metrics;
pub mod cluster;
