//! The bottom layer: what every other folder may use and which uses nothing
//! of the crate itself. Address conversions between `IpAddr` and the maps'
//! 16-byte form, the kernel programs' clock, and the metrics registry every
//! layer records into (`serve` exposes it on `/metrics`).
pub mod addr;
pub mod clock;
pub mod metrics;
#[cfg(test)]
pub mod testing;
