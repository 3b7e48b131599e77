//! Where workers are found at run time: the Kubernetes API server (InferencePool, Pods, EndpointSlices) and
//! DNS, each telling what it found on a channel (joining them to the fleet is `crate::background::joining`).

pub mod dns;
pub mod kubernetes;
pub mod kubernetes_objects;
mod kubernetes_watch;
