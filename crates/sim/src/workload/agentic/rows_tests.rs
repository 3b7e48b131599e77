use super::*;
use crate::workload::agentic::PlanWorkload;
use crate::workload::Workload;

fn config(limit: u64) -> TraceConfig {
    TraceConfig {
        path: "t.jsonl".into(),
        speedup: 2.0,
        limit,
    }
}

fn plan(text: &str) -> Result<Plan, WorkloadError> {
    read(text.as_bytes(), &config(0))
}

#[test]
fn wait_for_delay_and_tool_wait_set_the_start_and_metadata_is_accepted() {
    let rows = r#"{"request_id": "a", "session_id": "s", "timestamp": 1000, "hash_ids": [1, 2], "input_length": 700, "output_length": 4, "branches": [], "prefix_reset": true}
{"request_id": "b", "hash_ids": [1, 3], "output_length": 2, "timestamp": 2000}
{"request_id": "c", "session_id": "s", "wait_for": ["a", "b"], "delay": 100, "tool_wait_ms": 300, "timestamp": 99999, "hash_ids": [1, 2, 4], "output_length": 3, "tool_events": [{"x": 1}]}
"#;
    assert!(is_agentic(rows.lines().next().unwrap()));
    assert!(!is_agentic(
        r#"{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}"#
    ));
    let plan = plan(rows).unwrap();
    let [a, b, c] = &plan.steps[..] else { panic!() };
    assert_eq!((a.wait, b.wait), (500_000, 1_000_000), "timestamps at speedup 2");
    assert_eq!(
        (c.after.clone(), c.wait),
        (vec![0, 1], 200_000),
        "(100 + 300) ms at speedup 2"
    );
    assert_eq!(a.parts.iter().map(|p| p.len).collect::<Vec<_>>(), [512, 188]);
    assert_eq!(
        c.parts.iter().map(|p| p.len).sum::<usize>(),
        1536,
        "input_length defaults to its blocks"
    );
    assert!(a.named_session && !b.named_session && a.session == c.session);
    // Run: c arrives 200 ms after the later of a and b completes.
    let mut w = PlanWorkload::new(plan, 0, "trace").unwrap();
    let (ra, rb) = (w.next_arrival().unwrap(), w.next_arrival().unwrap());
    assert_eq!((ra.id, rb.id), (0, 1));
    assert!(w.on_finish(&rb, &[], 3_000_000).is_empty());
    let rc = w.on_finish(&ra, &[], 2_000_000);
    assert_eq!(rc[0].arrival, 3_200_000);
    assert_eq!(rc[0].tokens[..700], ra.tokens[..], "blocks 1 and 2, as `a` had them");
    assert_eq!(rc[0].tokens[..512], rb.tokens[..512], "block 1, as `b` had it");
}

#[test]
fn a_session_without_wait_for_follows_its_previous_turn() {
    let rows = r#"{"session_id": 7, "timestamp": 0, "hash_ids": [1], "output_length": 1}
{"session_id": 7, "timestamp": 4000, "hash_ids": [1, 2], "output_length": 1}
{"session_id": 7, "delay": 50, "hash_ids": [1, 2, 3], "output_length": 1}
{"session_id": 8, "timestamp": 10, "hash_ids": [9], "output_length": 1}
"#;
    let plan = plan(rows).unwrap();
    let waits: Vec<(Vec<usize>, u64)> = plan.steps.iter().map(|s| (s.after.clone(), s.wait)).collect();
    assert_eq!(
        waits,
        [(vec![], 0), (vec![0], 2_000_000), (vec![1], 25_000), (vec![], 5_000)],
        "the timestamp delta, then the delay, each halved"
    );
    assert_eq!(plan.steps[1].name, "line 2");
}

#[test]
fn bad_rows_are_errors_naming_the_row() {
    let cases = [
        (r#"{"request_id": "a", "hash_ids": [1], "output_length": 1, "wait_for": ["zz"]}"#, "`zz`"),
        (
            "{\"request_id\": \"a\", \"hash_ids\": [1], \"output_length\": 1, \"wait_for\": [\"b\"]}\n\
             {\"request_id\": \"b\", \"hash_ids\": [1], \"output_length\": 1, \"wait_for\": [\"a\"]}",
            "cycle",
        ),
        (r#"{"request_id": "a", "hash_ids": [1], "output_length": 1, "wait_for": ["a"]}"#, "cycle"),
        (
            "{\"request_id\": \"a\", \"hash_ids\": [1], \"output_length\": 1}\n{\"request_id\": \"a\", \"hash_ids\": [1], \"output_length\": 1}",
            "twice",
        ),
        (
            "{\"request_id\": \"a\", \"hash_ids\": [1], \"output_length\": 1}\n{\"hash_ids\": [1], \"output_length\": 1}",
            "line 2",
        ),
        (r#"{"request_id": "a", "hash_ids": [1], "input_length": 513, "output_length": 1}"#, "input_length"),
        (r#"{"request_id": "a", "hash_ids": [1], "output_length": 1, "timestamp": -1}"#, "timestamp"),
        (r#"{"request_id": "a", "hash_ids": [1], "output_length": 1, "delay": 5}"#, "delay"),
        (r#"{"request_id": "a", "output_length": 1}"#, "line 1"),
        ("", "no rows"),
    ];
    for (text, needle) in cases {
        let e = match plan(text).and_then(|p| PlanWorkload::new(p, 0, "trace").map(|_| ())) {
            Ok(()) => panic!("accepted {text}"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains(needle), "{text}: {e}");
    }
    // `limit` keeps the first rows; a kept row waiting for a dropped one is an error.
    let rows = "{\"request_id\": \"b\", \"hash_ids\": [1], \"output_length\": 1, \"wait_for\": [\"a\"]}\n\
                {\"request_id\": \"a\", \"hash_ids\": [1], \"output_length\": 1}";
    assert!(read(rows.as_bytes(), &config(1))
        .unwrap_err()
        .to_string()
        .contains("`a`"));
}

#[test]
fn a_huge_wait_saturates_instead_of_overflowing() {
    let rows = r#"{"request_id": "a", "hash_ids": [1], "output_length": 1, "tool_wait_ms": 1e30}
{"request_id": "b", "wait_for": ["a"], "delay": 1e30, "tool_wait_ms": 1e30, "hash_ids": [1, 2], "output_length": 1}
"#;
    let plan = plan(rows).unwrap();
    assert_eq!(plan.steps[1].wait, u64::MAX);
    let mut w = PlanWorkload::new(plan, 0, "trace").unwrap();
    let a = w.next_arrival().unwrap();
    assert_eq!(w.on_finish(&a, &[], 1_000)[0].arrival, u64::MAX);
}
