//! A `dprouter epp` process for the tests: started with its ports chosen by the system, read from its first line.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use super::Proc;

/// A `dprouter epp` process: its gRPC address and its HTTP side.
pub struct Picker {
    pub proc: Proc,
    pub grpc: String,
}

impl Picker {
    pub fn start(engines: &[&Proc], extra: &[&str]) -> Picker {
        let bin = std::env::var("DPROUTER_TEST_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_dprouter").to_string());
        let mut command = Command::new(bin);
        command.args(["epp", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"]);
        for e in engines {
            command.args(["--worker", &e.url]);
        }
        command
            .args(extra)
            .env(
                "RUST_LOG",
                std::env::var("DPROUTER_TEST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = command.spawn().unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        // "dprouter epp listening on grpc://ADDR and http://ADDR"
        let words: Vec<&str> = line.split_whitespace().collect();
        let grpc = words
            .iter()
            .find_map(|w| w.strip_prefix("grpc://"))
            .unwrap()
            .to_string();
        let url = words.iter().find(|w| w.starts_with("http://")).unwrap().to_string();
        Picker {
            proc: Proc { child, url },
            grpc,
        }
    }
}
