//! Hostile text given to the parser of `haulage plan --from-file`'s kubectl
//! dump: a real dump with bytes flipped, lines cut, repeated or inserted,
//! YAML alias bombs and deep nesting, and arbitrary text. The parser must
//! answer with an error or facts, never panic, and never hold more than
//! 256 bytes per input byte plus 4 MiB while it reads (linear: the event
//! scanner holds each token of a deeply nested line before it answers).
//!
//! Cases: proptest's count (`PROPTEST_CASES`, 256 by default); longer with
//! `PROPTEST_CASES=20000 cargo test --release -p haulage-plan --test hostile_dump`.

use std::alloc::System;

use haulage_plan::objects::{DumpError, parse_dump, parse_objects};
use peakmem_alloc::{PeakMemAlloc, PeakMemAllocTrait};
use proptest::prelude::*;

#[global_allocator]
static ALLOCATOR: &PeakMemAlloc<System> = &peakmem_alloc::INSTRUMENTED_SYSTEM;

/// A real dump (the one the planner's golden test reads).
const DUMP: &str = include_str!("../../../tests/fixtures/plan/cluster.yaml");

/// Parse `text` both ways and fail when the parser held more than its
/// bound. Only this test runs in its binary, so the allocator's peak (reset
/// before each case) is the parser's own.
fn within_bound(text: &str) {
    ALLOCATOR.reset_peak_memory();
    let _ = parse_dump(text);
    let _ = parse_objects(text);
    let held = ALLOCATOR.get_peak_memory();
    let bound = 256 * text.len() + (4 << 20);
    assert!(
        held <= bound,
        "a dump of {} bytes held {held} bytes at once, above its bound of {bound}: {:?}",
        text.len(),
        text.chars().take(200).collect::<String>()
    );
}

/// The billion-laughs shape: each level names the one before ten times.
fn alias_bomb(levels: usize) -> String {
    let mut text = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
    for level in 1..levels {
        let previous = level - 1;
        text.push_str(&format!(
            "a{level}: &a{level} [*a{previous}, *a{previous}, *a{previous}, *a{previous}, *a{previous}, *a{previous}, *a{previous}, *a{previous}, *a{previous}, *a{previous}]\n"
        ));
    }
    text.push_str(&format!("items: *a{}\n", levels - 1));
    text
}

#[test]
fn the_dump_parser_refuses_hostile_text_without_panicking_or_holding_more_than_its_bound() {
    // The seed is a dump the parser reads.
    let facts = parse_dump(DUMP).expect("the fixture dump parses");
    assert!(!facts.claims.is_empty());

    for levels in [3, 6, 9] {
        let bomb = alias_bomb(levels);
        within_bound(&bomb);
        assert!(
            matches!(parse_dump(&bomb), Err(DumpError::Alias { .. })),
            "an alias bomb of {levels} levels was not refused as one"
        );
    }
    for depth in [64, 1_000, 100_000] {
        within_bound(&format!("{}{}", "[".repeat(depth), "]".repeat(depth)));
        within_bound(&format!("items:\n{}", "- ".repeat(depth)));
    }

    let lines: Vec<&str> = DUMP.lines().collect();
    let mut runner = proptest::test_runner::TestRunner::new(proptest::test_runner::Config {
        failure_persistence: None,
        ..proptest::test_runner::Config::default()
    });
    runner
        .run(
            &proptest::collection::vec(
                (
                    0..lines.len(),
                    0..lines.len(),
                    prop_oneof![
                        Just(String::new()),
                        "[ -~]{0,40}",
                        Just("  - *anchor".to_string()),
                        Just("storage: 99999999999999999999999Ei".to_string()),
                        Just("{{{{{{{{".to_string()),
                    ],
                ),
                1..6,
            ),
            |edits| {
                let mut text: Vec<String> = lines.iter().map(|line| line.to_string()).collect();
                for (at, to, new) in edits {
                    let at = at.min(to).min(text.len());
                    let to = at.max(to).min(at + 8).min(text.len());
                    match new.len() % 3 {
                        0 => {
                            text.drain(at..to);
                        }
                        1 => text.insert(at, new),
                        _ => {
                            let piece: Vec<String> = text[at..to].to_vec();
                            for line in piece.into_iter().rev() {
                                text.insert(at, line);
                            }
                        }
                    }
                }
                within_bound(&text.join("\n"));
                Ok(())
            },
        )
        .expect("damaged dumps");
    runner
        .run(&"\\PC{0,2000}", |text| {
            within_bound(&text);
            Ok(())
        })
        .expect("arbitrary text");
}
