//! What the agent answers over HTTP: `/healthz`, `/readyz` and `/metrics`
//! (`health`), and the health-check node ports of `externalTrafficPolicy:
//! Local` Services (`healthcheck`). May use `base` and `semantics`.
pub mod health;
pub mod healthcheck;
