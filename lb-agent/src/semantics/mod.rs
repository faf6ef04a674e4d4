//! Kubernetes semantics as pure functions, with no I/O: which endpoints
//! count, which ports, which traffic policies (`translate`), the north-south
//! rules of the tc path (`northsouth`), Maglev tables (`maglev`), the
//! desired state they produce (`model`), which connected UDP flows a change
//! makes stale (`stale_udp`), the proxy's health as kube-proxy judges
//! it (`health`), and the guarded Service CIDRs (`service_cidr`). Table-tested without privileges.
//! May use `base` and `input::store` (the objects it reads).
pub mod health;
pub mod maglev;
pub mod model;
pub mod northsouth;
pub mod service_cidr;
pub mod stale_udp;
pub mod translate;
