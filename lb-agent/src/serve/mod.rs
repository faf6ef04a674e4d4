//! What the agent answers over HTTP: `/healthz`, `/livez` and `/readyz` on
//! the health address and `/metrics` on its own (`health`), and the
//! health-check node ports of `externalTrafficPolicy: Local` Services
//! (`healthcheck`); who gets a connection slot on them (`slots`). May use
//! `base` and `semantics`.
#[cfg(test)]
mod fuzz;
pub mod health;
pub mod healthcheck;
pub mod slots;
