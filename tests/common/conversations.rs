//! Multi-turn conversations with a real engine (vLLM, SmolLM2): what the clients saw of each turn, and its hits.

use std::time::{Duration, Instant};

use hyper::StatusCode;
use serde_json::json;

use super::{client, post};

/// vLLM's KV cache block on CPU, tokens.
pub const BLOCK: u64 = 128;

/// A system prompt of about 400 tokens (SmolLM2's), different for every agent from its first token on.
pub fn system_prompt(agent: usize) -> String {
    let mut text = format!("You are agent number {agent}. You answer briefly. Your tools:\n");
    for i in 0..24 {
        text.push_str(&format!(
            "- tool_{agent}_{i}: looks up record {i} of ledger {agent} and returns its balance.\n"
        ));
    }
    text
}

/// The rank that answered, from the gateway's `x-dprouter-endpoint` (`w0r1`).
pub fn rank_of(reply: &super::Reply) -> Option<u64> {
    reply.endpoint.as_deref()?.rsplit('r').next()?.parse().ok()
}

/// One turn as the client saw it.
#[derive(Debug, Clone)]
pub struct Turn {
    pub rank: Option<u64>,
    pub prompt: u64,
    pub cached: u64,
    pub ttft: Duration,
}

/// `conversations` conversations, each with its own system prompt, running at once through `url`, `turns` turns
/// each (a short question, an answer of at most 8 tokens: less than a block per turn).
pub async fn converse(url: &str, conversations: usize, turns: usize) -> Vec<Vec<Turn>> {
    converse_paced(url, conversations, turns, |_, _| Duration::ZERO).await
}

/// [`converse`], each conversation `n` pausing `pause(n, turn)` before its turn `turn` (as agents do, each at
/// its own pace: the order in which the conversations' turns arrive changes from one round to the next).
pub async fn converse_paced(
    url: &str,
    conversations: usize,
    turns: usize,
    pause: fn(usize, usize) -> Duration,
) -> Vec<Vec<Turn>> {
    let tasks: Vec<_> = (0..conversations)
        .map(|n| {
            let url = url.to_string();
            tokio::spawn(async move {
                let c = client();
                let mut history = vec![json!({"role": "system", "content": system_prompt(n)})];
                let mut seen = Vec::new();
                for turn in 0..turns {
                    tokio::time::sleep(pause(n, turn)).await;
                    history.push(json!({"role": "user", "content": format!("Turn {turn}: what is {turn} plus {n}?")}));
                    let body = json!({"model": "smollm2", "messages": history, "max_tokens": 8, "temperature": 0});
                    let started = Instant::now();
                    let reply = post(&c, &format!("{url}/v1/chat/completions"), &[], &body).await;
                    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
                    let answer = reply.json["choices"][0]["message"]["content"]
                        .as_str()
                        .unwrap()
                        .to_string();
                    history.push(json!({"role": "assistant", "content": answer}));
                    let usage = &reply.json["usage"];
                    seen.push(Turn {
                        rank: rank_of(&reply),
                        prompt: usage["prompt_tokens"].as_u64().unwrap(),
                        cached: usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0),
                        ttft: started.elapsed(),
                    });
                }
                seen
            })
        })
        .collect();
    let mut all = Vec::new();
    for task in tasks {
        all.push(task.await.unwrap());
    }
    all
}

/// Per conversation: its ranks, and its turns' mean time to the whole (short) answer.
pub fn summary(seen: &[Vec<Turn>]) -> String {
    seen.iter()
        .map(|turns| {
            let ranks: Vec<String> = turns
                .iter()
                .map(|t| t.rank.map_or("-".into(), |r| r.to_string()))
                .collect();
            let mean = turns.iter().map(|t| t.ttft).sum::<Duration>() / turns.len().max(1) as u32;
            format!("ranks {} mean {:.2} s", ranks.join(""), mean.as_secs_f64())
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Agents' paces for [`converse_paced`]: 0 to 6 s before each turn (longer than a turn takes here), in an order that
/// changes every round.
pub fn agent_pause(n: usize, turn: usize) -> Duration {
    Duration::from_millis(((n * 7 + turn * 3) % 5) as u64 * 1_500)
}

/// Turns after each conversation's first that found at least the previous prompt's whole blocks cached.
pub fn hits(turns: &[Turn]) -> usize {
    turns
        .windows(2)
        .filter(|w| w[1].cached >= w[0].prompt / BLOCK * BLOCK)
        .count()
}
