//! Tests of the body parser: the same prompts and errors as `prompt::parse_request`, the layout forwarded.

use super::*;
use proptest::prelude::*;
use serde_json::json;

fn forwarded(body: &str, rank: Option<&str>) -> String {
    let parsed = parse_body(body.as_bytes(), true).unwrap();
    parsed
        .layout
        .forwarded(
            &body.to_string(),
            rank.map(str::to_owned),
            |_| false,
            |s, r| s[r].to_string(),
        )
        .into_iter()
        .map(|p| match p {
            Piece::Text(t) => t.to_string(),
            Piece::Bytes(b) => b,
        })
        .collect()
}

#[test]
fn the_worker_gets_every_member_but_the_overrides_and_the_rank_first() {
    let body =
        r#" { "routed_dp_rank" : 1 , "prompt": "x", "a": {"b": [1, {"c": "}"}]},"data_parallel_rank":2,"z":null } "#;
    let out = forwarded(body, Some(r#""routed_dp_rank":3"#));
    assert_eq!(
        out,
        r#"{"routed_dp_rank":3,"prompt": "x","a": {"b": [1, {"c": "}"}]},"z":null}"#
    );
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        v,
        json!({"routed_dp_rank": 3, "prompt": "x", "a": {"b": [1, {"c": "}"}]}, "z": null})
    );
    assert_eq!(forwarded(r#"{"prompt":"x"}"#, None), r#"{"prompt":"x"}"#);
    assert_eq!(forwarded(r#"{"routed_dp_rank":0,"text":"x"}"#, None), r#"{"text":"x"}"#);
}

#[test]
fn keys_with_escapes_are_matched_and_kept_whole() {
    let body = r#"{"k\"ey": 1, "t\u0065xt": "x", "routed\u005fdp_rank": 4}"#;
    let parsed = parse_body(body.as_bytes(), true).unwrap();
    assert_eq!(parsed.route.prompt, Prompt::Bytes(b"x".to_vec()));
    assert_eq!(parsed.route.rank_override, Some(4));
    assert_eq!(forwarded(body, None), r#"{"k\"ey": 1,"t\u0065xt": "x"}"#);
}

#[test]
fn disaggregation_members_are_marked_for_the_gateway_to_drop() {
    let body = r#"{"bootstrap_room": 5, "prompt": "x", "bootstrap_host": "h", "kv_transfer_params": {}}"#.to_string();
    let parsed = parse_body(body.as_bytes(), true).unwrap();
    let out: String = parsed
        .layout
        .forwarded(
            &body,
            [r#""bootstrap_room":6"#.to_string()],
            MemberKind::is_pairing,
            |s, r| s[r].to_string(),
        )
        .into_iter()
        .map(|p| match p {
            Piece::Text(t) => t.to_string(),
            Piece::Bytes(b) => b,
        })
        .collect();
    assert_eq!(out, r#"{"bootstrap_room":6,"prompt": "x"}"#);
}

#[test]
fn the_model_member_can_be_replaced() {
    let body = r#"{"model": "alias", "prompt": "x"}"#.to_string();
    let parsed = parse_body(body.as_bytes(), true).unwrap();
    let out: String = parsed
        .layout
        .forwarded(
            &body,
            [r#""model":"served""#.to_string()],
            |k| k == MemberKind::Model,
            |s, r| s[r].to_string(),
        )
        .into_iter()
        .map(|p| match p {
            Piece::Text(t) => t.to_string(),
            Piece::Bytes(b) => b,
        })
        .collect();
    assert_eq!(out, r#"{"model":"served","prompt": "x"}"#);
}

#[test]
fn a_model_that_is_not_a_string_is_an_error() {
    for body in [r#"{"model": 5, "prompt": "x"}"#, r#"{"model": ["m"], "prompt": "x"}"#] {
        let err = parse_body(body.as_bytes(), true).unwrap_err();
        assert!(err.to_string().contains("model"), "{body}: {err}");
    }
    assert_eq!(
        parse_body(br#"{"model": null, "prompt": "x"}"#, true).unwrap().model,
        None
    );
}

#[test]
fn a_prompt_cache_key_is_the_session_hint_and_the_model_is_read() {
    let body = parse_body(br#"{"prompt": "x", "prompt_cache_key": "user-7", "model": "m"}"#, true).unwrap();
    assert_eq!(body.route.session, Some(crate::request::session_hash("user-7")));
    assert_eq!(body.model.as_deref(), Some("m"));
    let next = parse_body(br#"{"input": "more", "previous_response_id": "resp_1"}"#, true).unwrap();
    assert_eq!(next.previous_response_id.as_deref(), Some("resp_1"));
    let odd = parse_body(br#"{"prompt": "x", "prompt_cache_key": 7}"#, true).unwrap();
    assert_eq!(odd.route.session, None, "a hint that is not a string is ignored");
}

#[test]
fn a_message_with_duplicate_keys_renders_as_its_tree_does() {
    let body = r#"{"messages":[{"role":7,"content":"a","role":"user","x":1,"content":"b\u0021","x":2}]}"#;
    let tree = prompt::parse_request(&serde_json::from_str(body).unwrap()).unwrap();
    let view = parse_body(body.as_bytes(), true).unwrap();
    assert_eq!(view.route.prompt, tree.prompt);
    assert_eq!(view.route.prompt, Prompt::Bytes(b"<|user|>\nb!\n{\"x\":2}\n".to_vec()));
}

#[test]
fn overrides_are_not_read_when_not_allowed() {
    let body = br#"{"text": "x", "routed_dp_rank": "two"}"#;
    assert!(parse_body(body, true).is_err());
    let parsed = parse_body(body, false).unwrap();
    assert_eq!(parsed.route.rank_override, None);
}

#[test]
fn messages_read_in_the_members_pass_keep_their_exact_bytes() {
    // The member after `messages` has a key with an escaped quote and an escaped backslash, the content holds
    // colons, commas and braces, and the spacing is odd: the worker gets every byte of every member.
    let messages = r#"[ {"role": "user", "content": "a: b, }\" ,"} ]"#;
    let body = format!(
        r#"{{ "messages" :{messages} ,
        "k\\\"e\\y\\" : {{"x": ":"}}, "routed_dp_rank": 2, "z":[] }}"#
    );
    let parsed = parse_body(body.as_bytes(), true).unwrap();
    assert_eq!(parsed.route.rank_override, Some(2));
    assert_eq!(
        forwarded(&body, None),
        format!(r#"{{"messages" :{messages},"k\\\"e\\y\\" : {{"x": ":"}},"z":[]}}"#)
    );
    let expected = prompt::parse_request(&serde_json::from_str(&body).unwrap()).unwrap();
    assert_eq!(parsed.route.prompt, expected.prompt);
    // Last, before blanks and the closing brace.
    let body = format!(r#"{{"routed_dp_rank": 1, "a": 1, "messages": {messages}   }}"#);
    assert_eq!(forwarded(&body, None), format!(r#"{{"a": 1,"messages": {messages}}}"#));
}

#[test]
fn null_and_repeated_messages_follow_the_tree_parse() {
    let tree = |body: &str| prompt::parse_request(&serde_json::from_str(body).unwrap());
    for body in [
        r#"{"messages": null}"#,
        r#"{"messages" : null , "input": "x"}"#,
        r#"{"input_ids": [1], "messages": [], "messages": 5}"#,
    ] {
        let view = parse_body(body.as_bytes(), true).map(|b| b.route.prompt);
        assert_eq!(view, tree(body).map(|r| r.prompt), "{body}");
    }
    // A tree keeps the last of repeated keys; the view refuses a repeated routing field.
    let body = r#"{"messages": [{"role": "user", "content": "a"}], "messages": [{"role": "user", "content": "b"}]}"#;
    let err = parse_body(body.as_bytes(), true).unwrap_err();
    assert_eq!(err, PromptError::Duplicate("messages".into()));
    // Both repeated members reach the worker when another prompt field decides.
    let body = r#"{"input_ids": [1], "messages": [], "messages": 5}"#;
    assert_eq!(
        forwarded(body, None),
        r#"{"input_ids": [1],"messages": [],"messages": 5}"#
    );
}

#[test]
fn duplicate_routing_fields_are_refused() {
    let err = parse_body(br#"{"text": "a", "text": "b"}"#, true).unwrap_err();
    assert_eq!(err, PromptError::Duplicate("text".into()));
    assert!(
        parse_body(br#"{"text": "a", "x": 1, "x": 2}"#, true).is_ok(),
        "other keys are the worker's business"
    );
}

/// Chat conversations with every kind of message the rendering distinguishes.
fn messages() -> impl Strategy<Value = Value> {
    let role = prop_oneof![
        Just(json!("user")),
        Just(json!("as\"sis\u{e9}tant")),
        Just(json!(7)),
        Just(json!(null)),
    ];
    let content = prop_oneof![
        Just(json!("plain")),
        Just(json!("esc\\aped \"q\" \n \u{1F600}")),
        Just(json!(null)),
        Just(json!([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u"}}])),
        Just(json!([])),
        Just(json!(3)),
        Just(json!({"text": "x"})),
    ];
    let extra = prop_oneof![
        Just(None),
        Just(Some(("name", json!("n")))),
        Just(Some((
            "tool_calls",
            json!([{"id": "c", "function": {"name": "f", "arguments": "{}"}}])
        ))),
    ];
    let message = (proptest::option::of(role), proptest::option::of(content), extra, 0u8..8).prop_map(
        |(role, content, extra, shape)| {
            if shape == 0 {
                return json!("not an object");
            }
            let mut m = serde_json::Map::new();
            if let Some(r) = role {
                m.insert("role".into(), r);
            }
            if let Some(c) = content {
                m.insert("content".into(), c);
            }
            if let Some((k, v)) = extra {
                m.insert(k.into(), v);
            }
            Value::Object(m)
        },
    );
    prop::collection::vec(message, 0..4).prop_map(Value::Array)
}

/// Request-shaped JSON, including the awkward cases of each field.
fn body() -> impl Strategy<Value = Value> {
    let field = prop_oneof![
        Just(("input_ids", json!([1, 2, 3]))),
        Just(("input_ids", json!([[1], [2]]))),
        Just(("input_ids", json!([1.5]))),
        Just(("input_ids", json!([-1]))),
        Just(("input_ids", json!([4294967296u64]))),
        Just(("input_ids", json!("12"))),
        Just(("input_ids", json!([]))),
        Just(("text", json!("hello"))),
        Just(("text", json!(["one"]))),
        Just(("text", json!(["a", "b"]))),
        Just(("text", json!(5))),
        Just(("prompt", json!("p"))),
        Just(("prompt", json!([7, 8]))),
        Just(("prompt", json!(["only"]))),
        Just(("prompt", json!([]))),
        Just(("prompt", json!({"x": 1}))),
        Just(("messages", json!([{"role": "user", "content": "hi"}]))),
        Just((
            "messages",
            json!([{"role": "user", "content": [{"type": "text", "text": "a"}]}])
        )),
        Just(("messages", json!("hi"))),
        Just(("messages", json!([1]))),
        Just(("tools", json!([{"type": "function"}]))),
        Just(("tools", json!("x"))),
        Just(("routed_dp_rank", json!(2))),
        Just(("routed_dp_rank", json!(-1))),
        Just(("routed_dp_rank", json!("1"))),
        Just(("routed_dp_rank", json!(1.0))),
        Just(("data_parallel_rank", json!(3))),
        Just(("data_parallel_rank", json!(null))),
        Just(("bootstrap_room", json!(9))),
        Just(("bootstrap_room", json!(-9))),
        Just(("stream", json!(true))),
        Just(("text", json!(null))),
        Just(("input", json!("embed me"))),
        Just(("input", json!(["a", "b"]))),
        Just(("input", json!([1, 2, 3]))),
        Just(("input", json!([[1, 2], [3]]))),
        Just(("input", json!([{"role": "user", "content": "hi"}]))),
        Just(("input", json!([1, "a"]))),
        Just(("input", json!(5))),
        Just((
            "input",
            json!([{"type": "function_call_output", "call_id": "c", "output": "1"}])
        )),
        Just(("input", json!([{"content": "neither role nor type"}]))),
        Just(("instructions", json!("be brief"))),
        Just(("instructions", json!(7))),
    ];
    let field = prop_oneof![3 => field, 1 => messages().prop_map(|m| ("messages", m))];
    prop::collection::vec(field, 0..6).prop_map(|fields| {
        let mut map = serde_json::Map::new();
        for (k, v) in fields {
            map.insert(k.to_string(), v);
        }
        Value::Object(map)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    /// The borrowed parse agrees with the tree parse on every request: same prompt, override and room, or
    /// the same error; and the forwarded body is the object without the overrides.
    #[test]
    fn agrees_with_the_tree_parse(value in body(), pretty in any::<bool>()) {
        let text = if pretty { serde_json::to_string_pretty(&value).unwrap() } else { value.to_string() };
        let tree = prompt::parse_request(&value);
        let view = parse_body(text.as_bytes(), true);
        match (&tree, &view) {
            (Ok(a), Ok(b)) => {
                prop_assert_eq!(&a.prompt, &b.route.prompt);
                prop_assert_eq!(a.rank_override, b.route.rank_override);
                prop_assert_eq!(a.bootstrap_room, b.route.bootstrap_room);
                let out: Value = serde_json::from_str(&forwarded(&text, None)).unwrap();
                let mut expected = value.as_object().unwrap().clone();
                for f in OVERRIDE_FIELDS {
                    expected.remove(f);
                }
                prop_assert_eq!(out, Value::Object(expected));
            }
            (Err(a), Err(b)) => prop_assert_eq!(a, b),
            _ => prop_assert!(false, "tree {:?} vs view {:?} for {}", tree, view, text),
        }
    }

    /// Any bytes: parsed or refused, never a panic.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256), overrides in any::<bool>()) {
        let _ = parse_body(&bytes, overrides);
    }
}
