//! The kernel side as the agent owns it: loading the embedded object and
//! pinning its maps (`loader`), writing the difference between desired and
//! programmed state (`reconcile`, through `batch` and, for the two arrays
//! it fills in bulk, `mapped`, placing backend sets with
//! `slot_ranges`), the tc path's maps and conntrack (`tc`), the devices
//! its programs are attached to (`devices`, through `clsact` filters
//! before TCX), the ageing of what the kernel records (`sweep`, for
//! sessionAffinity in `affinity` and unconnected UDP flows in
//! `datagram_flows`) and destruction of connected UDP sockets whose backend
//! left (`sockets`), the tc path's flow counts of each backend
//! (`backend_state`), outlier detection's quarantines as the operator sees
//! them (`outlier`), and what the kernel supports (`features`). May use
//! `base` and `semantics` (the desired state it programs).
pub mod affinity;
pub mod backend_state;
pub mod batch;
pub mod clsact;
pub mod datagram_flows;
pub mod devices;
pub mod features;
#[cfg(test)]
mod fuzz;
pub mod loader;
pub mod mapped;
pub mod outlier;
pub mod reconcile;
pub mod route_epoch;
pub mod slot_ranges;
pub mod sockets;
pub mod sweep;
pub mod tc;
