//! The bottom layer: what every other folder may use and which uses nothing
//! of the crate itself. Address conversions between `IpAddr` and the maps'
//! 16-byte form, the kernel programs' clock, and the metrics registry every
//! layer records into (`serve` exposes it on `/metrics`).
pub mod addr;
pub mod clock;
/// The fuzz targets' seeds and mutations, shared with `tests/tc_frames.rs`.
#[cfg(test)]
#[path = "../../fuzz/mutate.rs"]
pub mod fuzz;
pub mod metrics;
#[cfg(test)]
pub mod testing;
