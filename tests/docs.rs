//! Every `console` block of the README and of `docs/` runs as written, and prints what it shows.
//!
//! A block is a sequence of commands, each a line starting with `$ ` (continued over lines ending in `\`), followed
//! by the standard output it must print. In the expected output a line `...` stands for any number of lines and
//! `[..]` for any text within a line (for figures measured in real time); a last line `? N` expects exit status N
//! instead of 0. A command with no lines after it only has to succeed. Commands run with bash (pipes work) from
//! the repository's root, with this build's `dprouter` first on the `PATH`; standard error is shown on failure,
//! never compared. Blocks fenced as `sh` are not run: they need engines or long-running servers, and the tests
//! that cover them are named in the docs' text.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long one documented command may take (the Mooncake replays take ~10 s each in a test build).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(600);

#[derive(Debug)]
struct Example {
    file: PathBuf,
    line: usize,
    command: String,
    expected: Vec<String>,
    status: i32,
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn documents() -> Vec<PathBuf> {
    let mut files = vec![root().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// The commands of every `console` block of `text`, in order.
fn examples(file: &Path, text: &str) -> Vec<Example> {
    let mut out: Vec<Example> = Vec::new();
    let mut in_block = false;
    let mut continued = false;
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") {
            in_block = !in_block && trimmed.trim_end() == "```console";
            continued = false;
            continue;
        }
        if !in_block {
            continue;
        }
        if continued {
            let example = out.last_mut().unwrap();
            example.command.push('\n');
            example.command.push_str(line);
            continued = line.ends_with('\\');
        } else if let Some(command) = line.strip_prefix("$ ") {
            out.push(Example {
                file: file.to_owned(),
                line: i + 1,
                command: command.to_owned(),
                expected: Vec::new(),
                status: 0,
            });
            continued = line.ends_with('\\');
        } else if let Some(example) = out.last_mut() {
            match line.strip_prefix("? ").map(str::parse) {
                Some(Ok(status)) => example.status = status,
                _ => example.expected.push(line.trim_end().to_owned()),
            }
        } else {
            panic!(
                "{}:{}: output before any command in a console block",
                file.display(),
                i + 1
            );
        }
    }
    assert!(!in_block, "{}: a console block is not closed", file.display());
    out
}

/// Whether `line` matches `pattern`, where `[..]` in the pattern matches any text.
fn line_matches(pattern: &str, line: &str) -> bool {
    let mut parts = pattern.split("[..]");
    let first = parts.next().unwrap_or("");
    let Some(mut rest) = line.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    for (i, part) in parts.iter().enumerate() {
        if i + 1 == parts.len() {
            return rest.ends_with(part);
        }
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.is_empty()
}

/// Whether `lines` match `patterns`, where a pattern line `...` matches any number of lines.
fn lines_match(patterns: &[String], lines: &[&str]) -> bool {
    match patterns.split_first() {
        None => lines.is_empty(),
        Some((p, rest)) if p == "..." => (0..=lines.len()).any(|skip| lines_match(rest, &lines[skip..])),
        Some((p, rest)) => lines
            .split_first()
            .is_some_and(|(l, more)| line_matches(p, l) && lines_match(rest, more)),
    }
}

/// Reads `pipe` to its end on another thread; the receiver gets the bytes.
fn drain(mut pipe: impl std::io::Read + Send + 'static) -> std::sync::mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = pipe.read_to_end(&mut bytes);
        let _ = tx.send(bytes);
    });
    rx
}

/// Runs one example; `Err` describes how it failed.
fn run(example: &Example, path: &str) -> Result<(), String> {
    let mut child = Command::new("bash")
        .args(["-o", "pipefail", "-c", &example.command])
        .current_dir(root())
        .env("PATH", path)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start bash: {e}"))?;
    let stdout = drain(child.stdout.take().unwrap());
    let stderr = drain(child.stderr.take().unwrap());
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > COMMAND_TIMEOUT {
            let _ = child.kill();
            return Err(format!("still running after {COMMAND_TIMEOUT:?}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // A process the command left running in the background would hold the pipes open: that is a failure too.
    let left_running = "a process it started in the background is still running and holds its output open";
    let stdout = stdout
        .recv_timeout(Duration::from_secs(5))
        .map_err(|_| left_running.to_owned())?;
    let stderr = stderr
        .recv_timeout(Duration::from_secs(5))
        .map_err(|_| left_running.to_owned())?;
    let stdout = String::from_utf8_lossy(&stdout);
    let lines: Vec<&str> = stdout.lines().map(str::trim_end).collect();
    let status = status.code().unwrap_or(-1);
    let output_ok = example.expected.is_empty() || lines_match(&example.expected, &lines);
    if status == example.status && output_ok {
        return Ok(());
    }
    Err(format!(
        "exit status {status} (expected {}){}\n--- expected stdout\n{}\n--- actual stdout\n{stdout}--- stderr\n{}",
        example.status,
        if output_ok { "" } else { ", stdout differs" },
        example.expected.join("\n"),
        String::from_utf8_lossy(&stderr)
    ))
}

#[test]
fn every_console_block_runs_as_written() {
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_dprouter")).parent().unwrap();
    let path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap_or_default());
    let files = documents();
    let all: Vec<Vec<Example>> = files
        .iter()
        .map(|f| examples(f, &std::fs::read_to_string(f).unwrap()))
        .collect();
    let count: usize = all.iter().map(Vec::len).sum();
    assert!(count >= 20, "only {count} documented commands found in {files:?}");
    // One thread per document: a document's commands run in order (later ones may read what earlier ones wrote).
    let failures: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = all
            .iter()
            .map(|examples| {
                let path = &path;
                scope.spawn(move || {
                    examples
                        .iter()
                        .filter_map(|e| {
                            run(e, path)
                                .err()
                                .map(|why| format!("{}:{}: $ {}\n{why}", e.file.display(), e.line, e.command))
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    assert!(
        failures.is_empty(),
        "{} of {count} documented commands failed:\n\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

#[test]
fn the_matcher_accepts_wildcards_and_rejects_differences() {
    let p = |lines: &[&str]| lines.iter().map(|l| (*l).to_owned()).collect::<Vec<_>>();
    assert!(lines_match(&p(&["a", "...", "d"]), &["a", "b", "c", "d"]));
    assert!(lines_match(&p(&["a", "...", "d"]), &["a", "d"]));
    assert!(!lines_match(&p(&["a", "...", "d"]), &["a", "b"]));
    assert!(!lines_match(&p(&["a", "b"]), &["a", "b", "c"]));
    assert!(lines_match(&p(&["x [..] y[..]"]), &["x 12 ms y"]));
    assert!(!lines_match(&p(&["x [..] y"]), &["x 12 ms z"]));
    assert!(line_matches("[..]", "anything"));
    assert!(!line_matches("ab", "abc"));
    let text = "```console\n$ echo a \\\n  b\na b\n? 0\n$ false\n? 1\n```\n```sh\n$ not run\n```\n";
    let found = examples(Path::new("t.md"), text);
    assert_eq!(found.len(), 2);
    assert_eq!(found[0].command, "echo a \\\n  b");
    assert_eq!(found[0].expected, vec!["a b"]);
    assert_eq!(found[1].status, 1);
    let path = std::env::var("PATH").unwrap();
    assert!(run(&found[0], &path).is_ok());
    assert!(run(&found[1], &path).is_ok());
    let wrong = Example {
        expected: vec!["a c".into()],
        ..examples(Path::new("t.md"), text).remove(0)
    };
    assert!(run(&wrong, &path).is_err(), "a different output must fail");
    let leak = Example {
        command: "sleep 8 &".into(),
        expected: Vec::new(),
        ..examples(Path::new("t.md"), text).remove(0)
    };
    assert!(
        run(&leak, &path).unwrap_err().contains("background"),
        "a leaked process must fail, not hang"
    );
}
