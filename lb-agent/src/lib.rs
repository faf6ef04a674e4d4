//! The agent: keeps the kernel's load-balancing maps in sync with Services.
pub mod affinity;
pub mod cli;
pub mod cluster;
pub mod datapath;
pub mod health;
pub mod inspect;
pub mod maglev;
pub mod manifest;
pub mod metrics;
pub mod model;
pub mod northsouth;
pub mod reconcile;
pub mod run;
pub mod sockets;
pub mod store;
pub mod tc;
pub mod translate;
