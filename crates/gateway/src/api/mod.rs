//! The HTTP API: the routes, the inference handler, stored Responses, the admin routes, `serve`, and the surface
//! other front ends build on ([`front_end`]).

pub mod admin;
pub mod front_end;
pub mod proxy;
pub mod responses;
pub mod server;
