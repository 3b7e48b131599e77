use super::*;

fn part(id: u64, len: usize) -> Part {
    Part {
        ns: Namespace::UserTurn,
        id,
        len,
    }
}

fn step(name: &str, after: Vec<usize>, wait: Micros, continues: Option<usize>, parts: Vec<Part>) -> Step {
    Step {
        name: name.into(),
        session: 0,
        group: 0,
        named_session: true,
        after,
        wait,
        continues,
        parts,
        output_tokens: 3,
    }
}

#[test]
fn a_step_waits_for_all_its_parents_then_its_own_wait() {
    // 0 forks 1 and 2; 3 continues 0's conversation once 1 and 2 are done, 250 ms after the later of them.
    let plan = Plan {
        steps: vec![
            step("root", vec![], 1_000, None, vec![part(0, 10)]),
            step("sub-a", vec![0], 0, None, vec![part(1, 5)]),
            step("sub-b", vec![0], 0, None, vec![part(2, 5)]),
            step("join", vec![0, 1, 2], 250_000, Some(0), vec![part(3, 4)]),
        ],
    };
    let mut w = PlanWorkload::new(plan, 9, "test").unwrap();
    assert_eq!(w.expected_requests(), Some(4));
    let root = w.next_arrival().unwrap();
    assert!(w.next_arrival().is_none(), "only the root is open loop");
    assert_eq!((root.id, root.arrival, root.tokens.len()), (0, 1_000, 10));
    let answer = [7, 8, 9];
    let subs = w.on_finish(&root, &answer, 2_000_000);
    assert_eq!(
        subs.iter().map(|r| (r.id, r.arrival)).collect::<Vec<_>>(),
        [(1, 2_000_000), (2, 2_000_000)]
    );
    assert!(
        w.on_finish(&subs[1], &[1], 5_000_000).is_empty(),
        "the join waits for sub-a too"
    );
    let join = w.on_finish(&subs[0], &[1], 3_000_000);
    assert_eq!(join.len(), 1);
    assert_eq!(join[0].arrival, 5_250_000, "after the later parent, plus its wait");
    let mut expected = root.tokens.clone();
    expected.extend_from_slice(&answer);
    tokens::extend(&mut expected, 9, Namespace::UserTurn, 3, 4);
    assert_eq!(
        join[0].tokens, expected,
        "the root's prompt, its answer, then the new part"
    );
    assert!(w.kept.is_empty(), "nothing kept once released");
}

#[test]
fn a_missing_parent_a_cycle_and_an_unawaited_continuation_are_errors_naming_the_row() {
    let missing = Plan {
        steps: vec![
            step("r1", vec![], 0, None, vec![]),
            step("r2", vec![5], 0, None, vec![]),
        ],
    };
    let e = PlanWorkload::new(missing, 0, "trace").err().unwrap().to_string();
    assert!(e.contains("`r2`") && e.contains("missing"), "{e}");
    let cycle = Plan {
        steps: vec![
            step("r1", vec![], 0, None, vec![]),
            step("r2", vec![2], 0, None, vec![]),
            step("r3", vec![1], 0, None, vec![]),
        ],
    };
    let e = PlanWorkload::new(cycle, 0, "trace").err().unwrap().to_string();
    assert!(e.contains("cycle") && (e.contains("`r2`") || e.contains("`r3`")), "{e}");
    let loose = Plan {
        steps: vec![
            step("r1", vec![], 0, None, vec![]),
            step("r2", vec![], 0, Some(0), vec![]),
        ],
    };
    assert!(PlanWorkload::new(loose, 0, "trace").is_err());
}
