//! The HTTP API: the routes, the inference handler, stored Responses, the admin routes, and `serve`.

pub mod admin;
pub mod proxy;
pub mod responses;
pub mod server;
