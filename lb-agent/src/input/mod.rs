//! What the agent is told: Services, EndpointSlices, Endpoints and Nodes,
//! read from a manifests directory (`manifest`) or watched on the API server
//! (`watch`), kept in one `store::Store`; the kinds that make most of a store
//! are decoded straight into its forms (`wire`). Nothing here knows what the
//! objects mean for traffic; that is `semantics`. May use `base` only.
pub mod manifest;
pub mod store;
pub mod watch;
pub mod wire;
