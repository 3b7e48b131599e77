//! The parts of the state a request passes before its pick: who calls (keys, rate limits), the shared budget
//! of bodies arriving, flow control's queue, and the tokenizer that keys prompts.

pub mod body_budget;
pub mod body_reader;
pub mod clients;
pub mod flow;
pub mod flow_affinity;
pub mod tokens;
