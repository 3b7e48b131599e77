//! Engines' KV cache events, decoded: what vLLM and SGLang publish (over ZMQ, with `--kv-events-config`) when
//! blocks enter their prefix cache, leave it, or all go.
//!
//! A message's payload is one msgpack `EventBatch`: `ts` (seconds), `events`, and the publishing DP rank
//! (`data_parallel_rank` in vLLM, `attn_dp_rank` in SGLang). Two encodings are in the field, and both are read:
//! - positional (msgspec `array_like`): the batch is `[ts, events, rank?]` and each event an array with its tag
//!   first: `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id?, medium?, …]`,
//!   `["BlockRemoved", block_hashes, medium?]`, `["AllBlocksCleared"]`;
//! - named: maps with the same field names, and each event's tag under `"type"`.
//!
//! Fields may be missing at the end (msgspec's `omit_defaults`) or added by newer engines after the known ones
//! (vLLM's `lora_name`, `extra_keys`, `group_idx`, …): both are accepted. Each event says whether it can serve a
//! plain prompt's prefix ([`KvEvent::Stored::plain`]): not blocks of a LoRA adapter or of a KV cache group other
//! than the first (a hybrid model's sliding-window layers), which the router's keys do not describe. Block hashes are integers (any width, either sign; taken as their 64 low bits) or bytes
//! (hashed to 64 bits with XXH3), so both kinds are [`EngineHash`]es. Anything else is an error naming what was
//! wrong; nothing here panics or allocates beyond what the payload itself holds (`rmpv` grows arrays as elements
//! arrive, never from a declared length).

use rmpv::Value;
use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64;

/// An engine's name for one of its KV blocks, as 64 bits.
pub type EngineHash = u64;

/// One decoded batch.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// When the engine published it, seconds since the epoch.
    pub ts: f64,
    pub events: Vec<KvEvent>,
    /// The DP rank that published it, when the engine says.
    pub dp_rank: Option<u32>,
}

/// One cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Blocks entered the cache: `hashes[i]` holds `tokens[i·block_size .. (i+1)·block_size]`, following `parent`
    /// (the block before the first, `None` at the start of a sequence).
    Stored {
        hashes: Vec<EngineHash>,
        parent: Option<EngineHash>,
        tokens: Vec<u32>,
        block_size: u32,
        /// Where the blocks are (`"GPU"`, `"CPU"`, …); `None` when the engine does not say.
        medium: Option<String>,
        /// No LoRA adapter, and the first KV cache group: blocks a plain prompt can reuse.
        plain: bool,
    },
    /// Blocks left the cache.
    Removed {
        hashes: Vec<EngineHash>,
        medium: Option<String>,
        /// Of the first KV cache group.
        plain: bool,
    },
    /// Every block left the cache (a flush, or a restart).
    Cleared,
}

/// Why a payload could not be read.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DecodeError {
    #[error("not msgpack: {0}")]
    Msgpack(String),
    #[error("{0}")]
    Shape(String),
    #[error("unknown event type `{0}`")]
    UnknownEvent(String),
}

fn shape(what: impl Into<String>) -> DecodeError {
    DecodeError::Shape(what.into())
}

/// The deepest nesting read (a batch is 4 levels deep).
const MAX_DEPTH: usize = 16;

/// Decodes one `EventBatch` payload.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let mut reader = payload;
    let value = rmpv::decode::read_value_with_max_depth(&mut reader, MAX_DEPTH)
        .map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    if !reader.is_empty() {
        return Err(DecodeError::Msgpack(format!("{} bytes after the batch", reader.len())));
    }
    let fields = Fields::of(&value, &["ts", "events", "data_parallel_rank"], "batch")?;
    let ts = match fields.get(0) {
        Some(v) => v
            .as_f64()
            .or_else(|| v.as_i64().map(|t| t as f64))
            .or_else(|| v.as_u64().map(|t| t as f64))
            .ok_or_else(|| shape("batch `ts` is not a number"))?,
        None => return Err(shape("batch without `ts`")),
    };
    // A batch's time orders it against the last one applied: NaN or an infinity would make every later batch
    // look older (or none newer).
    if !ts.is_finite() {
        return Err(shape("batch `ts` is not a finite number"));
    }
    let events = match fields.get(1) {
        Some(Value::Array(events)) => events.iter().map(decode_event).collect::<Result<_, _>>()?,
        _ => return Err(shape("batch `events` is not an array")),
    };
    // SGLang names the rank `attn_dp_rank`.
    let rank = fields.get(2).or_else(|| fields.named("attn_dp_rank"));
    let dp_rank = match rank {
        None | Some(Value::Nil) => None,
        Some(v) => Some(
            v.as_u64()
                .and_then(|r| u32::try_from(r).ok())
                .ok_or_else(|| shape("batch rank is not a small non-negative integer"))?,
        ),
    };
    Ok(EventBatch { ts, events, dp_rank })
}

/// A struct's fields, positional or named.
enum Fields<'v> {
    Positional(&'v [Value]),
    Named(&'v [(Value, Value)], &'static [&'static str]),
}

impl<'v> Fields<'v> {
    fn of(value: &'v Value, names: &'static [&'static str], what: &str) -> Result<Self, DecodeError> {
        match value {
            Value::Array(items) => Ok(Fields::Positional(items)),
            Value::Map(members) => Ok(Fields::Named(members, names)),
            _ => Err(shape(format!("{what} is neither an array nor a map"))),
        }
    }

    /// Field `i` (of `names`), absent when missing or nil.
    fn get(&self, i: usize) -> Option<&'v Value> {
        match self {
            Fields::Positional(items) => items.get(i),
            Fields::Named(_, names) => self.named(names.get(i)?),
        }
        .filter(|v| !v.is_nil())
    }

    fn named(&self, name: &str) -> Option<&'v Value> {
        match self {
            Fields::Positional(_) => None,
            Fields::Named(members, _) => members
                .iter()
                .find(|(k, _)| k.as_str() == Some(name))
                .map(|(_, v)| v)
                .filter(|v| !v.is_nil()),
        }
    }
}

const STORED: &[&str] = &[
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
];
const REMOVED: &[&str] = &["type", "block_hashes", "medium", "group_idx"];

/// A KV cache group index that is absent or 0.
fn first_group(value: Option<&Value>) -> bool {
    value.is_none_or(|g| g.as_u64() == Some(0))
}

fn decode_event(value: &Value) -> Result<KvEvent, DecodeError> {
    let tag = match value {
        Value::Array(items) => items.first(),
        Value::Map(members) => members.iter().find(|(k, _)| k.as_str() == Some("type")).map(|(_, v)| v),
        _ => return Err(shape("an event is neither an array nor a map")),
    };
    let tag = tag
        .and_then(|v| v.as_str())
        .ok_or_else(|| shape("an event without a type"))?;
    match tag {
        "BlockStored" => {
            let f = Fields::of(value, STORED, "BlockStored")?;
            let hashes = hashes(f.get(1), "BlockStored.block_hashes")?;
            let parent = f.get(2).map(|h| hash(h, "BlockStored.parent_block_hash")).transpose()?;
            let tokens = match f.get(3) {
                Some(Value::Array(ids)) => ids
                    .iter()
                    .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                    .collect::<Option<Vec<u32>>>()
                    .ok_or_else(|| shape("BlockStored.token_ids holds something other than token ids"))?,
                _ => return Err(shape("BlockStored.token_ids is not an array")),
            };
            let block_size = f
                .get(4)
                .and_then(|v| v.as_u64())
                .and_then(|b| u32::try_from(b).ok())
                .filter(|&b| b > 0)
                .ok_or_else(|| shape("BlockStored.block_size is not a positive integer"))?;
            let plain = f.get(5).is_none() && f.get(7).is_none() && first_group(f.get(9));
            Ok(KvEvent::Stored {
                hashes,
                parent,
                tokens,
                block_size,
                medium: medium(f.get(6)),
                plain,
            })
        }
        "BlockRemoved" => {
            let f = Fields::of(value, REMOVED, "BlockRemoved")?;
            Ok(KvEvent::Removed {
                hashes: hashes(f.get(1), "BlockRemoved.block_hashes")?,
                medium: medium(f.get(2)),
                plain: first_group(f.get(3)),
            })
        }
        "AllBlocksCleared" => Ok(KvEvent::Cleared),
        other => Err(DecodeError::UnknownEvent(other.chars().take(64).collect())),
    }
}

fn medium(value: Option<&Value>) -> Option<String> {
    value.and_then(|v| v.as_str()).map(str::to_owned)
}

fn hashes(value: Option<&Value>, what: &str) -> Result<Vec<EngineHash>, DecodeError> {
    match value {
        Some(Value::Array(items)) => items.iter().map(|h| hash(h, what)).collect(),
        _ => Err(shape(format!("{what} is not an array"))),
    }
}

/// An engine block hash: an integer's 64 low bits, or XXH3 of bytes.
fn hash(value: &Value, what: &str) -> Result<EngineHash, DecodeError> {
    match value {
        Value::Integer(n) => n
            .as_u64()
            .or_else(|| n.as_i64().map(|i| i as u64))
            .ok_or_else(|| shape(format!("{what}: an integer out of range"))),
        Value::Binary(bytes) => Ok(xxh3_64(bytes)),
        // Python ints past 64 bits travel as msgpack ext or strings nowhere we know of; bytes and ints cover both
        // engines.
        _ => Err(shape(format!("{what}: a block hash is neither an integer nor bytes"))),
    }
}

/// How [`encode_batch`] writes events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// Positional arrays, tag first (vLLM and SGLang before their map encoding).
    Positional,
    /// Maps with a `"type"` key (newer engines); the batch stays an array.
    Named,
}

/// Encodes a batch as an engine publishes it (vLLM's field names and order; hashes as integers), for the mock
/// engine and tests.
pub fn encode_batch(batch: &EventBatch, encoding: Encoding) -> Vec<u8> {
    let event = |e: &KvEvent| -> Value {
        let ints = |hashes: &[EngineHash]| Value::Array(hashes.iter().map(|&h| Value::from(h)).collect());
        let text = |m: &Option<String>| m.as_deref().map_or(Value::Nil, Value::from);
        let fields: Vec<(&str, Value)> = match e {
            KvEvent::Stored {
                hashes,
                parent,
                tokens,
                block_size,
                medium,
                ..
            } => vec![
                ("type", Value::from("BlockStored")),
                ("block_hashes", ints(hashes)),
                ("parent_block_hash", parent.map_or(Value::Nil, Value::from)),
                (
                    "token_ids",
                    Value::Array(tokens.iter().map(|&t| Value::from(t)).collect()),
                ),
                ("block_size", Value::from(*block_size)),
                ("lora_id", Value::Nil),
                ("medium", text(medium)),
            ],
            KvEvent::Removed { hashes, medium, .. } => vec![
                ("type", Value::from("BlockRemoved")),
                ("block_hashes", ints(hashes)),
                ("medium", text(medium)),
            ],
            KvEvent::Cleared => vec![("type", Value::from("AllBlocksCleared"))],
        };
        match encoding {
            Encoding::Positional => Value::Array(fields.into_iter().map(|(_, v)| v).collect()),
            Encoding::Named => Value::Map(fields.into_iter().map(|(k, v)| (Value::from(k), v)).collect()),
        }
    };
    let value = Value::Array(vec![
        Value::F64(batch.ts),
        Value::Array(batch.events.iter().map(event).collect()),
        batch.dp_rank.map_or(Value::Nil, Value::from),
    ]);
    let mut out = Vec::new();
    // Writing to a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, &value);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(value: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, value).unwrap();
        out
    }

    fn s(text: &str) -> Value {
        Value::from(text)
    }

    fn ints(items: &[u64]) -> Value {
        Value::Array(items.iter().map(|&i| Value::from(i)).collect())
    }

    #[test]
    fn a_time_that_is_not_finite_is_an_error() {
        for ts in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            let payload = rmp_batch(Value::F64(ts));
            let err = decode_batch(&payload).unwrap_err();
            assert!(err.to_string().contains("finite"), "{ts}: {err}");
        }
        assert_eq!(decode_batch(&rmp_batch(Value::F64(1.5))).unwrap().ts, 1.5);
        assert_eq!(
            decode_batch(&rmp_batch(Value::from(u64::MAX))).unwrap().ts,
            u64::MAX as f64
        );
    }

    /// A positional batch of no events at time `ts`.
    fn rmp_batch(ts: Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &Value::Array(vec![ts, Value::Array(Vec::new())])).unwrap();
        out
    }

    #[test]
    fn positional_batches_as_vllm_sends_them() {
        let stored = Value::Array(vec![
            s("BlockStored"),
            ints(&[11, 12]),
            Value::Nil,
            ints(&[1, 2, 3, 4]),
            Value::from(2),
            Value::Nil,
            s("GPU"),
            Value::Nil,
            Value::Array(vec![Value::Nil]),
            Value::from(0),
            s("full_attention"),
        ]);
        let removed = Value::Array(vec![s("BlockRemoved"), Value::Array(vec![Value::from(-5i64)])]);
        let batch = Value::Array(vec![
            Value::F64(1.5),
            Value::Array(vec![stored, removed, Value::Array(vec![s("AllBlocksCleared")])]),
            Value::from(3),
        ]);
        let got = decode_batch(&encode(&batch)).unwrap();
        assert_eq!(got.ts, 1.5);
        assert_eq!(got.dp_rank, Some(3));
        assert_eq!(
            got.events,
            vec![
                KvEvent::Stored {
                    hashes: vec![11, 12],
                    parent: None,
                    tokens: vec![1, 2, 3, 4],
                    block_size: 2,
                    medium: Some("GPU".into()),
                    plain: true,
                },
                KvEvent::Removed {
                    hashes: vec![(-5i64) as u64],
                    medium: None,
                    plain: true,
                },
                KvEvent::Cleared,
            ]
        );
    }

    #[test]
    fn named_batches_and_bytes_hashes() {
        let stored = Value::Map(vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), Value::Array(vec![Value::Binary(b"abc".to_vec())])),
            (s("parent_block_hash"), Value::Binary(b"par".to_vec())),
            (s("token_ids"), ints(&[7])),
            (s("block_size"), Value::from(1)),
            (s("lora_name"), s("an-adapter")),
            (s("session_id"), s("a key from a newer engine")),
        ]);
        let batch = Value::Map(vec![
            (s("ts"), Value::from(2)),
            (s("events"), Value::Array(vec![stored])),
            (s("attn_dp_rank"), Value::from(1)),
        ]);
        let got = decode_batch(&encode(&batch)).unwrap();
        assert_eq!(got.dp_rank, Some(1));
        assert_eq!(
            got.events,
            vec![KvEvent::Stored {
                hashes: vec![xxh3_64(b"abc")],
                parent: Some(xxh3_64(b"par")),
                tokens: vec![7],
                block_size: 1,
                medium: None,
                plain: false,
            }]
        );
    }

    #[test]
    fn bad_payloads_are_errors_that_say_why() {
        let cases = [
            (Value::from(5), "neither an array nor a map"),
            (Value::Array(vec![Value::F64(0.0)]), "`events`"),
            (
                Value::Array(vec![Value::F64(0.0), Value::Array(vec![Value::Array(vec![s("Nope")])])]),
                "Nope",
            ),
            (
                Value::Array(vec![
                    Value::F64(0.0),
                    Value::Array(vec![Value::Array(vec![
                        s("BlockStored"),
                        ints(&[1]),
                        Value::Nil,
                        ints(&[1]),
                    ])]),
                ]),
                "block_size",
            ),
            (
                Value::Array(vec![
                    Value::F64(0.0),
                    Value::Array(vec![Value::Array(vec![
                        s("BlockStored"),
                        ints(&[1]),
                        Value::Nil,
                        ints(&[1 << 40]),
                        Value::from(1),
                    ])]),
                ]),
                "token ids",
            ),
        ];
        for (value, expected) in cases {
            let err = decode_batch(&encode(&value)).unwrap_err().to_string();
            assert!(err.contains(expected), "{value}: {err}");
        }
        assert!(decode_batch(&[0xc1]).is_err());
        let mut trailing = encode(&Value::Array(vec![Value::F64(0.0), Value::Array(vec![])]));
        trailing.push(0);
        assert!(matches!(decode_batch(&trailing), Err(DecodeError::Msgpack(_))));
    }

    #[test]
    fn encoded_batches_decode_to_themselves() {
        let batch = EventBatch {
            ts: 3.25,
            events: vec![
                KvEvent::Stored {
                    hashes: vec![1, u64::MAX],
                    parent: Some(7),
                    tokens: vec![5, 6, 7, 8],
                    block_size: 2,
                    medium: Some("GPU".into()),
                    plain: true,
                },
                KvEvent::Removed {
                    hashes: vec![1],
                    medium: None,
                    plain: true,
                },
                KvEvent::Cleared,
            ],
            dp_rank: Some(2),
        };
        for encoding in [Encoding::Positional, Encoding::Named] {
            assert_eq!(
                decode_batch(&encode_batch(&batch, encoding)),
                Ok(batch.clone()),
                "{encoding:?}"
            );
        }
    }

    proptest::proptest! {
        /// Arbitrary bytes, and truncated real batches: an error or a batch, never a panic.
        #[test]
        fn arbitrary_payloads_never_panic(data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512), cut in 0usize..64) {
            let _ = decode_batch(&data);
            let real = encode(&Value::Array(vec![
                Value::F64(1.0),
                Value::Array(vec![Value::Array(vec![s("BlockStored"), ints(&[1, 2]), Value::from(9), ints(&[5, 6]), Value::from(1)])]),
            ]));
            let _ = decode_batch(&real[..cut.min(real.len())]);
        }
    }
}
