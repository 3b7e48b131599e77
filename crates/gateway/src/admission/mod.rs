//! The parts of the state a request passes before its pick: who calls (keys, rate limits), the shared budget
//! of bodies arriving, flow control's queue, the tokenizer that keys prompts, and the session a request names.

pub mod body_budget;
pub mod body_reader;
pub mod clients;
pub mod flow;
pub mod flow_affinity;
pub mod sessions;
pub mod tokens;
