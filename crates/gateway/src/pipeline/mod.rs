//! One request's decision and its exchange with an engine: routing (parse, model, tokens, flow control,
//! pick or pair), the relay of the engine's answer, and the feedback its bytes give the ticket.

pub mod body;
pub mod engine_headers;
pub mod feedback;
mod first_token;
pub mod outcome;
pub mod pairing;
pub mod relay;
pub mod retry;
pub mod routing;
